"""The engine against Hugging Face ``transformers`` ``generate`` (and vLLM), on the CPU.

``python bench/bench_engine.py`` is the comparison with Hugging Face ``transformers``: one random
fp32 Llama (:data:`HF_SHAPE`, changed by the ``--model`` preset of :data:`PRESETS`, which also
sets the prompts and new tokens: ``small``, the default, or ``large``), served by the engine
and by ``generate`` (one batch, left padding) on the same prompts in one run, greedy, one
thread. It prints each side's output tokens/s (median of ``--repeats`` interleaved runs, after
a warm-up of each), their ratio, whether the engine's tokens equal ``generate``'s, and the
engine's decode step at full batch split into model math, attention (``PagedStep.attend``:
every layer's K/V store and attention, through the kernels' ``auto`` backend, numba on the CPU)
and bookkeeping (the rest of ``engine.step()``: scheduling, tables, validation, slot
mapping, the step's attention plan, sampling, metrics). It also times each side's first token
of every prompt (a run of one new token: inputs, prefill, first sampling), and from it and the
median run each side's decode step, and the longest engine decode step at which the engine
would make :data:`TARGET_RATIO` times ``generate``'s tokens/s.
``test_engine_against_hf_smoke`` runs a small version as a test.

``--vllm`` adds vLLM's CPU engine (vLLM 0.32 in ``.venv-vllm``; ``python -m properties.vllm_env
--build`` builds it) on the same model, written with ``save_pretrained``, and the same prompts:
it runs in its own process (``bench/vllm_generate.py``, block size 32, the only sizes its CPU
attention takes), interleaved with the other two, and the figure is its tokens/s of
``LLM.generate`` (median, after a warm-up), its time to the first token and decode step, and
how many prompts' tokens equal the engine's. vLLM schedules in one process and computes in
another, bound to one core; its prefix cache is off and its KV space holds the whole batch.

``--linear-ab`` runs :func:`linear_ab` instead: the engine's decode step with the model's
projections as they are (oneDNN, prepacked) and through ``torch.nn.functional.linear``.
``--base DIR`` runs :func:`base_ab` instead: the engine's decode step of this tree against that
of ``DIR``, a checkout of another commit (``git archive REV | tar -x -C DIR``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.hf_loader import load_hf
from pagedkv.impl.serving.model import CausalLM, Linear
from pagedkv.impl.serving.paged_kv import PagedStep
from pagedkv.spec.block_manager import blocks_needed

HF_SHAPE: dict[str, Any] = {
    "vocab_size": 4096,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
HF_BLOCK_SIZE = 16
TARGET_RATIO = 1.5  # the engine's goal: this many times generate's tokens/s


@dataclass(frozen=True)
class Preset:
    """A model and workload of the comparison: ``shape`` overrides :data:`HF_SHAPE`, and
    ``count`` seeded prompts of ``shortest .. longest`` tokens get ``new`` tokens each."""

    shape: dict[str, Any]
    count: int
    shortest: int
    longest: int
    new: int


PRESETS: dict[str, Preset] = {
    # 8 query and 2 KV heads of 32: 4 KB of K/V per token.
    "small": Preset({}, count=32, shortest=16, longest=128, new=96),
    # 16 query and 4 KV heads of 64: 16 KB of K/V per token; about 40,000 prompt tokens.
    "large": Preset(
        {
            "vocab_size": 32000,
            "hidden_size": 1024,
            "intermediate_size": 2816,
            "num_hidden_layers": 8,
            "num_attention_heads": 16,
            "num_key_value_heads": 4,
            "max_position_embeddings": 2048 + 64,
        },
        count=32,
        shortest=512,
        longest=2048,
        new=64,
    ),
}


@dataclass(frozen=True)
class Comparison:
    """Output tokens/s of the engine and of ``generate`` (medians; ``runs`` has every run's), and
    the engine's decode step at full batch, in median milliseconds: whole step, model math,
    attention, bookkeeping."""

    engine_tokens_per_s: float
    hf_tokens_per_s: float
    tokens_equal: int  # prompts whose engine tokens equal generate's
    prompts: int
    step_ms: float
    model_ms: float
    attention_ms: float
    bookkeeping_ms: float
    vllm_tokens_per_s: float | None = None  # with vLLM only
    vllm_tokens_equal: int | None = None  # prompts whose vLLM tokens equal the engine's
    runs: dict[str, list[float]] = field(default_factory=dict)  # every run's tokens/s, by side
    new_tokens: int = 1  # tokens generated per prompt
    # Seconds to the first token of every prompt (median; building the inputs, the prefill and
    # the first sampling), by side: "engine", "hf" and, with vLLM, "vllm" (``LLM.generate`` of one
    # token).
    first_token_s: dict[str, float] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """Engine tokens/s over ``generate``'s."""
        return self.engine_tokens_per_s / self.hf_tokens_per_s

    def decode_step_ms(self, side: str) -> float:
        """One decode step of ``side`` ("engine", "hf" or "vllm"), in ms: the whole run's time
        (from its median tokens/s) less the time to the first token, over the remaining steps."""
        rate = {
            "engine": self.engine_tokens_per_s, "hf": self.hf_tokens_per_s,
            "vllm": self.vllm_tokens_per_s,
        }[side]  # fmt: skip
        assert rate is not None, "no vLLM figure in this comparison"
        return self._step_ms(rate, self.first_token_s[side])

    def step_ms_for_ratio(self, target: float) -> float:
        """The longest engine decode step, in ms, at which the engine's tokens/s would be
        ``target`` times ``generate``'s, its time to the first token unchanged."""
        return self._step_ms(target * self.hf_tokens_per_s, self.first_token_s["engine"])

    def _step_ms(self, tokens_per_s: float, first_token_s: float) -> float:
        """The decode step, in ms, of a run at ``tokens_per_s`` whose first token took
        ``first_token_s``."""
        total = self.prompts * self.new_tokens / tokens_per_s
        return (total - first_token_s) / (self.new_tokens - 1) * 1e3


def hf_llama(seed: int, **overrides: Any) -> torch.nn.Module:
    """A ``transformers.LlamaForCausalLM`` of :data:`HF_SHAPE` (with ``overrides``), seeded random
    weights, eval mode; nothing is downloaded."""
    import transformers

    config = transformers.LlamaConfig(**{**HF_SHAPE, **overrides})
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def bench_prompts(count: int, shortest: int, longest: int, vocab: int) -> list[list[int]]:
    """``count`` seeded prompts of ``shortest .. longest`` tokens, ids in ``[3, vocab)``."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(shortest, longest + 1, (count,), generator=generator).tolist()
    return [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in lengths]


def engine_workload(
    count: int, shortest: int, longest: int, **overrides: Any
) -> tuple[CausalLM, list[list[int]]]:
    """The engine's model (:func:`hf_llama` with seed 0, loaded) and the prompts
    (:func:`bench_prompts`) of the comparison."""
    model = load_hf(hf_llama(0, **overrides))
    return model, bench_prompts(count, shortest, longest, model.config.vocab_size)


def hf_generate(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """``generate(do_sample=False)`` on all prompts as one left-padded batch, no EOS stop."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
            do_sample=False, pad_token_id=0, eos_token_id=None,
        )  # fmt: skip
    return out[:, width:].tolist()


def engine_for(
    model: CausalLM, prompts: list[list[int]], new: int, **options: Any
) -> PagedAttentionEngine:
    """An engine whose pool holds every prompt and its ``new`` tokens, all running at once, with
    a step budget that prefills every prompt in one step (``options``: the engine's others)."""
    longest = max(map(len, prompts)) + new
    return PagedAttentionEngine(
        model, len(prompts) * blocks_needed(longest, HF_BLOCK_SIZE), HF_BLOCK_SIZE,
        max_num_seqs=len(prompts), max_num_batched_tokens=sum(map(len, prompts)),
        max_model_len=longest, **options,
    )  # fmt: skip


def engine_generate(model: CausalLM, prompts: list[list[int]], new: int) -> list[list[int]]:
    """The engine's greedy tokens for every prompt (a fresh engine)."""
    return [out.outputs[0] for out in engine_for(model, prompts, new).generate(prompts, new)]


def tokens_per_s(fn: Callable[[], list[list[int]]]) -> tuple[float, list[list[int]]]:
    """Output tokens per second of one call of ``fn``, and its tokens."""
    start = time.perf_counter()
    tokens = fn()
    return sum(map(len, tokens)) / (time.perf_counter() - start), tokens


def seconds(fn: Callable[[], object]) -> float:
    """Wall seconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@contextmanager
def timed(target: object, name: str, totals: dict[str, float]) -> Iterator[None]:
    """While active, every call of ``target.name`` adds its seconds to ``totals[name]``."""
    original = getattr(target, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[name] += time.perf_counter() - start

    with mock.patch.object(target, name, wrapper):
        yield


VLLM_PYTHON = Path(__file__).resolve().parents[1] / ".venv-vllm" / "bin" / "python"
VLLM_SCRIPT = Path(__file__).resolve().parent / "vllm_generate.py"
VLLM_BLOCK_SIZE = 32  # vLLM 0.32's CPU attention takes only multiples of 32


def vllm_kv_cache_gib(hf_model: torch.nn.Module, prompts: list[list[int]], new: int) -> int:
    """The KV space vLLM gets (``VLLM_CPU_KVCACHE_SPACE``, whole GiB): at least 1, and enough
    for every prompt and its ``new`` tokens at once, in blocks of :data:`VLLM_BLOCK_SIZE`, fp32
    K and V in every layer."""
    config = hf_model.config
    head_dim = config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4
    blocks = sum(blocks_needed(len(p) + new, VLLM_BLOCK_SIZE) for p in prompts)
    return max(1, -(-blocks * VLLM_BLOCK_SIZE * per_token // 2**30))


@contextmanager
def vllm_server(
    python: Path, hf_model: torch.nn.Module, prompts: list[list[int]], new: int
) -> Iterator[Callable[[], tuple[float, list[list[int]]]]]:
    """vLLM's CPU engine on ``hf_model`` (written with ``save_pretrained`` to a temporary
    directory), in ``bench/vllm_generate.py`` run by the vLLM environment's ``python``, with a KV
    space that holds every prompt and its ``new`` tokens at once. Yields a function that, for
    ``command`` ``"run"``, generates ``new`` greedy tokens for every prompt and returns vLLM's
    output tokens/s (``LLM.generate`` alone) and its tokens, and for ``"first"`` does the same
    with one new token. ``RuntimeError`` with the end of vLLM's log if it cannot start or
    answer."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        hf_model.save_pretrained(directory / "model")
        (directory / "prompts.json").write_text(json.dumps(prompts))
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["VLLM_CPU_KVCACHE_SPACE"] = str(vllm_kv_cache_gib(hf_model, prompts, new))
        log_path = directory / "vllm.log"
        with log_path.open("w") as log:
            server = subprocess.Popen(
                [str(python), str(VLLM_SCRIPT), "model", "prompts.json", str(new),
                 str(VLLM_BLOCK_SIZE)],
                cwd=directory, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                text=True, env=env,
            )  # fmt: skip
        assert server.stdin is not None and server.stdout is not None
        stdin, stdout = server.stdin, server.stdout

        def answer() -> dict[str, Any]:
            line = stdout.readline()
            if not line:
                server.wait(timeout=60)
                tail = log_path.read_text()[-3000:]
                raise RuntimeError(f"vLLM exited with status {server.returncode}:\n{tail}")
            return json.loads(line)

        def run(command: str = "run") -> tuple[float, list[list[int]]]:
            stdin.write(f"{command}\n")
            stdin.flush()
            result = answer()
            tokens = result["tokens"]
            return sum(map(len, tokens)) / result["seconds"], tokens

        try:
            answer()  # ready
            yield run
        finally:
            if server.poll() is None:
                stdin.write("quit\n")
                stdin.flush()
                try:
                    server.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    server.kill()
                    server.wait()


def decode_split(model: CausalLM, prompts: list[list[int]], new: int) -> list[float]:
    """Median milliseconds of the engine's decode steps with every prompt running: ``[step,
    model math, attention, bookkeeping]``, from one instrumented generation."""
    engine = engine_for(model, prompts, new)
    for prompt in prompts:
        engine.add_request(prompt, new)
    splits: list[list[float]] = []
    with (
        timed(PagedStep, "attend", totals := dict.fromkeys(("attend", "forward"), 0.0)),
        timed(CausalLM, "forward", totals),
        timed(CausalLM, "compute_logits", logits := {"compute_logits": 0.0}),
    ):
        while engine.has_unfinished_requests():
            totals.update(attend=0.0, forward=0.0)
            logits["compute_logits"] = 0.0
            start = time.perf_counter()
            metrics = engine.step().metrics
            step = time.perf_counter() - start
            if metrics.num_decodes == metrics.num_batched_tokens == len(prompts):
                math = totals["forward"] + logits["compute_logits"]
                splits.append([step, math - totals["attend"], totals["attend"], step - math])
    return [statistics.median(column) * 1e3 for column in zip(*splits, strict=True)]


def compare(
    count: int = 32, shortest: int = 16, longest: int = 128, new: int = 96, repeats: int = 3,
    vllm_python: Path | None = None, log: Callable[[str], None] | None = None, **overrides: Any,
) -> Comparison:  # fmt: skip
    """The engine against batched ``generate``, and with ``vllm_python`` (the vLLM environment's
    interpreter) against vLLM's CPU engine, on one model and one set of prompts (see the module
    docstring); ``overrides`` change :data:`HF_SHAPE`. ``log``, if given, gets a line after each
    timed run (long runs show progress)."""
    hf_model = hf_llama(0, **overrides)
    model = load_hf(hf_model)
    prompts = bench_prompts(count, shortest, longest, hf_model.config.vocab_size)
    hf_generate(hf_model, prompts[:4], 4)  # warm-up
    engine_generate(model, prompts[:4], 4)
    rates: dict[str, list[float]] = {"engine": [], "hf": [], "vllm": []}
    first: dict[str, list[float]] = {"engine": [], "hf": [], "vllm": []}
    note = log or (lambda line: None)
    with contextlib.ExitStack() as stack:
        vllm = None
        if vllm_python is not None:
            vllm = stack.enter_context(vllm_server(vllm_python, hf_model, prompts, new))
        for _ in range(repeats):  # interleaved, so a noisy stretch hits every side
            hf_rate, expected = tokens_per_s(lambda: hf_generate(hf_model, prompts, new))
            engine_rate, actual = tokens_per_s(lambda: engine_generate(model, prompts, new))
            rates["hf"].append(hf_rate)
            rates["engine"].append(engine_rate)
            note(f"generate {hf_rate:.1f} tok/s, engine {engine_rate:.1f} tok/s")
            if new > 1:
                first["hf"].append(seconds(lambda: hf_generate(hf_model, prompts, 1)))
                first["engine"].append(seconds(lambda: engine_generate(model, prompts, 1)))
                note(
                    f"first token: generate {first['hf'][-1]:.2f} s, "
                    f"engine {first['engine'][-1]:.2f} s"
                )
            if vllm is not None:
                vllm_rate, theirs = vllm()
                rates["vllm"].append(vllm_rate)
                if new > 1:
                    one_rate, _ = vllm("first")
                    first["vllm"].append(count / one_rate)
                note(
                    f"vLLM {vllm_rate:.1f} tok/s"
                    + (f", first token {first['vllm'][-1]:.2f} s" if new > 1 else "")
                )
    equal = sum(a == e for a, e in zip(actual, expected, strict=True))
    vllm_rate = vllm_equal = None
    if vllm is not None:
        vllm_rate = statistics.median(rates["vllm"])
        vllm_equal = sum(a == t for a, t in zip(actual, theirs, strict=True))
    step, math, attention, bookkeeping = decode_split(model, prompts, new)
    note(f"decode split done: step {step:.2f} ms")
    return Comparison(
        statistics.median(rates["engine"]), statistics.median(rates["hf"]), equal, count,
        step, math, attention, bookkeeping, vllm_rate, vllm_equal,
        {side: values for side, values in rates.items() if values}, new,
        {side: statistics.median(values) for side, values in first.items() if values},
    )  # fmt: skip


def linear_ab(
    count: int, shortest: int, longest: int, new: int, repeats: int, **overrides: Any
) -> dict[str, list[float]]:
    """Same-run A/B of the model's projections: the engine's decode step at full batch
    (:func:`decode_split`) with :class:`~pagedkv.impl.serving.model.Linear` as it is (``onednn``:
    the prepacked oneDNN product on the CPU) and with every projection through
    ``torch.nn.functional.linear`` (``plain``), interleaved ``repeats`` times after a warm-up of
    each, on one model and one set of prompts (as :func:`compare`), then one generation of each
    for the tokens. Returns, by side, the median
    ``[step, model math, attention, bookkeeping]`` in ms and, last, the number of prompts whose
    tokens equal the other side's."""
    model, prompts = engine_workload(count, shortest, longest, **overrides)
    plain = mock.patch.object(
        Linear, "forward", lambda self, x: torch.nn.functional.linear(x, self.weight)
    )
    sides = {"onednn": contextlib.nullcontext, "plain": lambda: plain}
    for context in sides.values():
        with context():
            engine_generate(model, prompts[:4], 4)  # warm-up
    splits: dict[str, list[list[float]]] = {side: [] for side in sides}
    for _ in range(repeats):
        for side, context in sides.items():
            with context():
                splits[side].append(decode_split(model, prompts, new))
    tokens: dict[str, list[list[int]]] = {}
    for side, context in sides.items():
        with context():
            tokens[side] = engine_generate(model, prompts, new)
    equal = sum(a == b for a, b in zip(tokens["onednn"], tokens["plain"], strict=True))
    return {
        side: [statistics.median(column) for column in zip(*rows, strict=True)] + [equal]
        for side, rows in splits.items()
    }


def split_child(count: int, shortest: int, longest: int, new: int, **overrides: Any) -> None:
    """Print, as JSON, :func:`decode_split` of the engine as this process imports it, after a
    warm-up generation (one side of :func:`base_ab`)."""
    model, prompts = engine_workload(count, shortest, longest, **overrides)
    engine_generate(model, prompts[:4], 4)
    print(json.dumps(decode_split(model, prompts, new)))


def base_ab(base: Path, args: list[str], repeats: int) -> dict[str, list[float]]:
    """Same-run A/B of the engine's decode step at full batch: this tree (``current``) against
    ``base``, a checkout of another commit, each side's ``pagedkv`` imported from its own tree
    (through ``bench.trace_ab.shim``) by this file's :func:`decode_split`. Each run is a fresh
    process (``--split-child`` with ``args``, the preset's options), the two sides interleaved
    ``repeats`` times, taking turns to go first. Returns,
    by side, the median over the runs of ``[step, model math, attention, bookkeeping]`` in ms.
    """
    if __package__:
        from bench.trace_ab import shim
    else:  # run as a script: this folder is on the path, the repository root is not
        from trace_ab import shim  # type: ignore[no-redef]

    trees = {"current": Path(__file__).resolve().parents[1], "base": base.resolve()}
    paths = {side: shim(tree) for side, tree in trees.items()}  # each side's own pagedkv
    runs: dict[str, list[list[float]]] = {side: [] for side in paths}
    try:
        for repeat in range(repeats):
            order = list(paths) if repeat % 2 == 0 else list(reversed(paths))  # no side first
            for side in order:
                command = [sys.executable, str(Path(__file__).resolve()), "--split-child", *args]
                env = {**os.environ, "PYTHONPATH": str(paths[side])}
                out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
                runs[side].append(json.loads(out.stdout.splitlines()[-1]))
    finally:
        for path in paths.values():
            shutil.rmtree(path)
    return {
        side: [statistics.median(column) for column in zip(*rows, strict=True)]
        for side, rows in runs.items()
    }


def test_engine_against_hf_smoke() -> None:
    """The comparison runs end to end on a small case, and the engine's tokens are ``generate``'s
    (a smaller model, so greedy ties stay unlikely)."""
    pytest.importorskip("transformers")
    result = compare(
        count=4, shortest=3, longest=12, new=6, repeats=1,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256,
    )  # fmt: skip
    assert result.tokens_equal == result.prompts
    assert result.engine_tokens_per_s > 0 and result.hf_tokens_per_s > 0
    assert result.runs == {"engine": [result.engine_tokens_per_s], "hf": [result.hf_tokens_per_s]}
    assert result.step_ms >= result.attention_ms > 0
    assert result.first_token_s.keys() == {"engine", "hf"}
    # At the measured ratio the bound is the engine's own decode step.
    bound = result.step_ms_for_ratio(result.ratio)
    assert bound == pytest.approx(result.decode_step_ms("engine"))


def test_linear_ab_smoke() -> None:
    """The projections' A/B runs on a small case: both sides timed, tokens equal."""
    pytest.importorskip("transformers")
    result = linear_ab(
        4, 3, 12, 6, 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256
    )
    assert result.keys() == {"onednn", "plain"}
    for step, math, attention, _bookkeeping, equal in result.values():
        assert step >= math > 0 and attention > 0 and equal == 4


@pytest.mark.long
def test_base_ab_smoke() -> None:
    """The A/B against another checkout runs end to end, here against this tree itself."""
    pytest.importorskip("transformers")
    options = ["--prompts", "2", "--new-tokens", "3", "--shortest", "3", "--longest", "5"]
    result = base_ab(Path(__file__).resolve().parents[1], options, 1)
    assert result.keys() == {"current", "base"}
    for step, math, attention, book in result.values():
        assert step >= math > 0 and attention > 0 and book > 0


def main() -> None:
    parser = argparse.ArgumentParser(description=compare.__doc__)
    parser.add_argument(
        "--model", choices=PRESETS, default="small",
        help="the model and workload (PRESETS): small (the default) or large",
    )  # fmt: skip
    parser.add_argument("--prompts", type=int, help="default: the preset's")
    parser.add_argument("--new-tokens", type=int, help="default: the preset's")
    parser.add_argument("--shortest", type=int, help="shortest prompt; default: the preset's")
    parser.add_argument("--longest", type=int, help="longest prompt; default: the preset's")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--linear-ab", action="store_true",
        help="instead: the same-run A/B of the projections (linear_ab), no generate, no vLLM",
    )  # fmt: skip
    parser.add_argument(
        "--base", type=Path, metavar="DIR",
        help="instead: the same-run A/B of the decode step against the checkout in DIR (base_ab)",
    )  # fmt: skip
    parser.add_argument("--split-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--vllm", nargs="?", const=VLLM_PYTHON, type=Path, metavar="PYTHON",
        help="also time vLLM's CPU engine, run by this interpreter (default: the one in "
        ".venv-vllm, which python -m properties.vllm_env builds)",
    )  # fmt: skip
    args = parser.parse_args()
    preset = PRESETS[args.model]
    count = preset.count if args.prompts is None else args.prompts
    new = preset.new if args.new_tokens is None else args.new_tokens
    shortest = preset.shortest if args.shortest is None else args.shortest
    longest = preset.longest if args.longest is None else args.longest
    torch.set_num_threads(1)
    if args.split_child:
        split_child(count, shortest, longest, new, **preset.shape)
        return
    if args.base is not None:
        options = ["--model", args.model, "--prompts", str(count), "--new-tokens", str(new)]
        options += ["--shortest", str(shortest), "--longest", str(longest)]
        for side, (step, math, attention, book) in base_ab(
            args.base, options, args.repeats
        ).items():
            print(
                f"{side}: decode step at batch {count} {step:.2f} ms = model math {math:.2f} + "
                f"attention {attention:.2f} + bookkeeping {book:.2f} (median of {args.repeats})"
            )
        return
    if args.linear_ab:
        for side, (step, math, attention, book, equal) in linear_ab(
            count, shortest, longest, new, args.repeats, **preset.shape
        ).items():
            print(
                f"{side}: decode step at batch {count} {step:.2f} ms = model math {math:.2f} + "
                f"attention {attention:.2f} + bookkeeping {book:.2f}; tokens equal the other "
                f"side's for {equal:.0f}/{count} prompts"
            )
        return
    result = compare(
        count, shortest, longest, new, args.repeats, args.vllm,
        lambda line: print(line, file=sys.stderr, flush=True), **preset.shape,
    )  # fmt: skip
    print(
        f"engine {result.engine_tokens_per_s:.0f} tok/s, transformers generate "
        f"{result.hf_tokens_per_s:.0f} tok/s: {result.ratio:.2f}x; tokens equal for "
        f"{result.tokens_equal}/{result.prompts} prompts"
    )
    if result.vllm_tokens_per_s is not None:
        print(
            f"vLLM {result.vllm_tokens_per_s:.0f} tok/s (block size {VLLM_BLOCK_SIZE}): engine "
            f"/ vLLM {result.engine_tokens_per_s / result.vllm_tokens_per_s:.2f}x; vLLM's "
            f"tokens equal the engine's for {result.vllm_tokens_equal}/{result.prompts} prompts"
        )
    for side, values in result.runs.items():
        print(f"{side} runs, in order: {', '.join(f'{v:.0f}' for v in values)} tok/s")
    print(
        f"decode step at batch {count}: {result.step_ms:.2f} ms = model math "
        f"{result.model_ms:.2f} + attention {result.attention_ms:.2f} + bookkeeping "
        f"{result.bookkeeping_ms:.2f}"
    )
    first = result.first_token_s
    print(
        f"first token of every prompt: engine {first['engine'] * 1e3:.0f} ms, generate "
        f"{first['hf'] * 1e3:.0f} ms; each decode step after it (from the medians): engine "
        f"{result.decode_step_ms('engine'):.2f} ms, generate {result.decode_step_ms('hf'):.2f} ms"
    )
    if result.vllm_tokens_per_s is not None:
        print(
            f"vLLM: first token of every prompt {first['vllm'] * 1e3:.0f} ms, each decode step "
            f"after it {result.decode_step_ms('vllm'):.2f} ms"
        )
    print(
        f"for {TARGET_RATIO}x generate's tokens/s the engine's decode step would have to take "
        f"at most {result.step_ms_for_ratio(TARGET_RATIO):.2f} ms"
    )


if __name__ == "__main__":
    main()
