"""vLLM's CPU engine as a timed generation server, for ``bench/bench_engine.py --vllm``.

Runs in the vLLM environment (``.venv-vllm``), started with a working directory outside the
repository so that nothing of pagedkv is importable (vLLM needs its own torch stack, and the
repository root on ``sys.path`` would shadow packages). It imports no pagedkv.

``python vllm_generate.py MODEL_DIR PROMPTS_JSON MAX_TOKENS BLOCK_SIZE`` loads the
``save_pretrained`` model in ``MODEL_DIR`` into ``vllm.LLM`` (fp32, no tokenizer, the given
block size, every prompt running at once, no prefix cache), then reads commands on stdin, one a
line, and answers each with one JSON line on stdout: ``run`` generates greedily for every prompt of
``PROMPTS_JSON`` (a JSON list of token-id lists), ``MAX_TOKENS`` new tokens each, no EOS stop,
and answers ``{"seconds": s, "tokens": [[...], ...]}`` (``s`` timing ``LLM.generate`` alone);
``first`` does the same with one new token each (the time to every prompt's first token);
``quit`` exits. The first line it prints is ``{"ready": true}`` once the model is loaded and
warmed up. Everything else (vLLM's logs, from every process it starts) goes to stderr.
"""

from __future__ import annotations

import json
import os
import sys
import time

# vLLM's CPU worker refuses to start unless this fraction of the machine's memory is free; its
# default (0.92) fails on a machine that runs anything else. The KV cache is sized separately
# (VLLM_CPU_KVCACHE_SPACE, in GiB, set by the caller).
MEMORY_FRACTION = 0.3


def main() -> None:
    model_dir, prompts_path, max_tokens, block_size = sys.argv[1:5]
    with open(prompts_path) as file:
        prompts = json.load(file)
    # The answers keep the original stdout; everything else written to file descriptor 1, by
    # this process or the engine processes vLLM starts, goes to stderr.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    import vllm

    llm = vllm.LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        dtype="float32",
        block_size=int(block_size),
        max_num_seqs=len(prompts),
        max_model_len=max(map(len, prompts)) + int(max_tokens),
        seed=0,
        gpu_memory_utilization=MEMORY_FRACTION,
        # Every run sends the same prompts: with its prefix cache on (vLLM's default) every run
        # after the first would skip the prefill, which the engine and generate both compute.
        enable_prefix_caching=False,
    )
    params = {
        command: vllm.SamplingParams(
            temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False
        )
        for command, tokens in (("run", int(max_tokens)), ("first", 1))
    }
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
    llm.generate(inputs[:4], params["run"], use_tqdm=False)  # warm-up
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "quit":
            break
        if command not in params:
            raise SystemExit(f"unknown command {command!r}")
        start = time.perf_counter()
        outputs = llm.generate(inputs, params[command], use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = [list(out.outputs[0].token_ids) for out in outputs]
        print(json.dumps({"seconds": seconds, "tokens": tokens}), file=answers, flush=True)


if __name__ == "__main__":
    main()
