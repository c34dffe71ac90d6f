"""The ``pagedkv`` command (``python -m pagedkv.impl.serving.cli``): a small generation on the
engine, printing the metrics of every step.

By default it serves a tiny seeded model on demo prompts that share a system prefix; ``--model
DIR`` serves a model that ``save_pretrained`` wrote to DIR (``pagedkv.impl.serving.hf_loader``;
local files only), its prompts given with ``--prompt`` as text (DIR must hold a tokenizer) or,
with ``--token-ids``, as token ids.
"""

from __future__ import annotations

import argparse
from collections import abc
from typing import Any

import torch
from tqdm import tqdm

from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.hf_loader import load_hf, load_tokenizer
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.kernels.fp8 import FP8_DTYPES, kv_cache_dtype
from pagedkv.spec.utilization import blocks_in_budget, bytes_per_block

DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def main(argv: abc.Sequence[str] | None = None) -> None:
    """A small generation, printing every step's metrics: a tiny seeded model by default, or with
    ``--model DIR`` a ``transformers`` Llama or Mistral saved in DIR (local files only)."""
    parser = _parser()
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the model is tiny: more threads only add synchronization
    if args.model is None:
        if args.prompt:
            parser.error("--prompt needs --model")
        model, tokenizer = CausalLM.from_seed(ModelConfig(), seed=0), None
        prompts = _demo_prompts(model.config.vocab_size, args.requests)
    else:
        try:
            model, tokenizer = load_hf(args.model), load_tokenizer(args.model)
            prompts = [_parse_prompt(text, tokenizer, args.token_ids) for text in args.prompt]
        except ValueError as error:
            parser.error(str(error))
        if not prompts:
            parser.error("--model needs at least one --prompt")
    try:
        engine = _engine(args, model)
    except (TypeError, ValueError) as error:  # a bad option: nothing was allocated
        parser.error(str(error))
    _serve(args, engine, tokenizer, prompts)


def _parser() -> argparse.ArgumentParser:
    """The command's arguments."""
    parser = argparse.ArgumentParser(prog="pagedkv", description=main.__doc__)
    parser.add_argument("--blocks", type=int, default=24, help="KV blocks in the pool")
    parser.add_argument("--block-size", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8, help="demo requests (no --model)")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--n", type=int, default=2, help="samples per request")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--backend", choices=("auto", "triton", "numba", "reference"), default=None)
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="auto (the model's), fp8, fp8_e4m3 or fp8_e5m2"
    )
    scales = parser.add_mutually_exclusive_group()
    scales.add_argument(
        "--kv-scales", type=float, nargs=2, metavar=("K", "V"), help="an fp8 cache's scales"
    )
    scales.add_argument(
        "--calculate-kv-scales", action="store_true",
        help="an fp8 cache's scales from the first step's K/V, per layer",
    )  # fmt: skip
    parser.add_argument(
        "--kv-cache-bytes", type=int, metavar="BYTES",
        help="a KV byte budget: the pool holds as many blocks as fit (overrides --blocks)",
    )  # fmt: skip
    parser.add_argument(
        "--model", metavar="DIR", help="serve the model that save_pretrained wrote to DIR"
    )
    parser.add_argument(
        "--prompt", action="append", default=[], metavar="PROMPT",
        help="with --model, one prompt (repeatable): text, which needs a tokenizer in DIR",
    )  # fmt: skip
    parser.add_argument(
        "--token-ids", action="store_true",
        help="each --prompt is token ids separated by commas or spaces, not text",
    )  # fmt: skip
    return parser


def _engine(args: argparse.Namespace, model: CausalLM) -> PagedAttentionEngine:
    """The engine the arguments configure; with ``--kv-cache-bytes``, as many blocks as the
    budget holds in the cache's dtype (``spec.utilization``)."""
    if args.kv_cache_bytes is not None:  # the dtype checked first: its error names it
        dtype = kv_cache_dtype(args.kv_cache_dtype, model.dtype)
        name = DTYPE_NAMES.get(dtype) or FP8_DTYPES[dtype]
        config = model.config
        block_bytes = bytes_per_block(
            args.block_size, config.num_layers, config.num_kv_heads, config.head_dim, name
        )
        args.blocks = blocks_in_budget(args.kv_cache_bytes, block_bytes)
    kv_scales = "calculate" if args.calculate_kv_scales else args.kv_scales
    return PagedAttentionEngine(
        model, args.blocks, args.block_size,
        max_num_seqs=8, max_num_batched_tokens=64, watermark_blocks=1,
        enable_prefix_caching=not args.no_prefix_caching, backend=args.backend,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_scales=tuple(kv_scales) if isinstance(kv_scales, list) else kv_scales,
    )  # fmt: skip


def _serve(
    args: argparse.Namespace,
    engine: PagedAttentionEngine,
    tokenizer: Any | None,
    prompts: list[list[int]],
) -> None:
    """Generate for ``prompts`` on ``engine``, printing every step's metrics, each request's
    samples (decoded too with a ``tokenizer``) and a summary."""
    print(
        f"{len(prompts)} requests x {args.n} samples, {args.max_new_tokens} new tokens each; "
        f"{args.blocks} blocks of {args.block_size} tokens ({engine.kv.cache_dtype}); prefix "
        f"caching {'off' if args.no_prefix_caching else 'on'}"
    )
    outputs = engine.generate(
        prompts, args.max_new_tokens, n=args.n, temperature=args.temperature,
        progress=True, on_step=lambda m: tqdm.write(m.line()),
    )  # fmt: skip
    for out in outputs:
        print(f"request {out.request_id}: prompt {len(out.prompt)} tokens -> {out.outputs}")
        if tokenizer is not None:
            for sample in out.outputs:
                print(f"  {tokenizer.decode(sample)!r}")
    total = sum(m.preemptions for m in engine.metrics)
    hits = sum(m.prefix_hit_tokens for m in engine.metrics)
    print(
        f"{len(engine.metrics)} steps, {total} preemptions, {hits} prompt tokens from the "
        f"prefix cache; free blocks at the end: {engine.store.num_free_blocks}/"
        f"{args.blocks}"
    )


def _demo_prompts(vocab_size: int, requests: int) -> list[list[int]]:
    """Seeded prompts that share a 9-token system prefix, of 12 to 16 tokens."""
    generator = torch.Generator().manual_seed(0)
    system = torch.randint(vocab_size, (9,), generator=generator).tolist()
    return [
        system + torch.randint(vocab_size, (3 + i % 5,), generator=generator).tolist()
        for i in range(requests)
    ]


def _parse_prompt(prompt: str, tokenizer: Any | None, token_ids: bool) -> list[int]:
    """A ``--prompt``'s tokens: its ids with ``token_ids``, else its text tokenized.
    ``ValueError`` for ids that are not integers, or text without a tokenizer."""
    if token_ids:
        try:
            return [int(token) for token in prompt.replace(",", " ").split()]
        except ValueError:
            raise ValueError(f"--token-ids: {prompt!r} is not integers") from None
    if tokenizer is None:
        raise ValueError("a text --prompt needs a tokenizer in the --model directory")
    return list(tokenizer.encode(prompt))


if __name__ == "__main__":
    main()
