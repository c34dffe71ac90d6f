"""The kernels on a CUDA machine: property tests compiled, latency sweeps, one engine step.

Installs nothing (``pagedkv`` must be installed, e.g. ``pip install -e .``); runs from any
directory::

    python bench/gpu_kernels.py --out gpu_kernels.json           # on the GPU
    python bench/gpu_kernels.py --small --out /tmp/small.json    # on CPU, Triton interpreter

Steps:

1. ``pytest properties -k kernels`` with ``CI=1``: on a GPU the kernel properties run compiled
   (``--small`` runs one quick test of them instead; ``--no-tests`` skips the step).
2. For each dtype, batch, context and block size: ``paged_decode_attention`` (shuffled block
   tables), the same kernel over a contiguous cache (``contiguous_decode_attention``), and torch
   ``scaled_dot_product_attention`` over the contiguous K/V. Each is timed (median), checked
   against the others, and reported with the bandwidth it achieves reading K and V once. The
   paged kernel is also timed over an fp8_e4m3 cache of the same K/V (``paged-fp8``, block sizes
   16 and 256), checked against the contiguous kernel over the values its codes hold.
3. The prefill kernel: ``paged_prefill_attention`` of each sequence's last ``chunk`` tokens
   over its cached prefix (shuffled tables, block sizes 16 and 256), against torch SDPA with the
   same causal mask on the same contiguous data; timed and checked the same way, over the
   16-bit cache and an fp8_e4m3 one (``prefill-fp8``).
4. One end-to-end engine step: a bf16 Llama-style model (hidden 2048, 8 layers, GQA 16/4 x
   128) on the GPU with the triton backend, 64 sequences of 512 prompt tokens prefilled, then
   decode steps of the whole batch timed (``--small``: a tiny fp32 model, the interpreter, and
   its tokens checked against the dense oracle).
5. A JSON report (``--out``) with every measurement and the goals: paged within 10% of
   contiguous for block size >= 16, and >= 70% of peak HBM bandwidth (``--peak-gbps``, the
   H200's 4800 GB/s by default) at the longest context, both for decode.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from pagedkv import kernels
from pagedkv.kernels import fp8

ROOT = Path(__file__).resolve().parent.parent

FULL = {
    "dtypes": ("float16", "bfloat16"),
    "batches": (1, 32, 128),
    "contexts": (512, 4096, 32768),
    "block_sizes": (1, 2, 4, 8, 16, 32, 64, 128, 256),
}
SMALL = {
    "dtypes": ("float16", "bfloat16"),
    "batches": (1, 3),
    "contexts": (16, 40),
    "block_sizes": (1, 4, 16, 256),
}
# The prefill grid: each sequence computes its last ``chunk`` tokens over its cached prefix.
PREFILL_FULL = {"batches": (1, 8), "contexts": (512, 4096), "chunks": (128, 512)}
PREFILL_SMALL = {"batches": (2,), "contexts": (40,), "chunks": (7,)}
PREFILL_BLOCK_SIZES_FULL = (16, 256)
PREFILL_BLOCK_SIZES_SMALL = (4, 16)
# The engine step: a Llama-style model (hidden, layers, query heads, KV heads, head dim), a
# batch of sequences with a prompt each, then decode steps timed.
ENGINE_FULL = {"hidden": 2048, "layers": 8, "heads": (16, 4, 128), "batch": 64, "prompt": 512}
ENGINE_SMALL = {"hidden": 64, "layers": 2, "heads": (4, 2, 16), "batch": 3, "prompt": 9}
ENGINE_BLOCK_SIZE = 16
ENGINE_STEPS = 3
HEADS_FULL = (32, 8, 128)  # query heads, KV heads, head dim (a Llama-3-8B layer)
HEADS_SMALL = (4, 2, 80)
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}
FP8_CACHE = torch.float8_e4m3fn  # the fp8 cache timed beside each 16-bit one
FP8_BLOCK_SIZES = (16, 256)  # the decode block sizes timed over it (prefill: all of its own)
PAGED_OVERHEAD_GOAL = 0.10
PEAK_FRACTION_GOAL = 0.70


@dataclass
class Measurement:
    """One timed kernel on one configuration."""

    kernel: str  # "paged", "contiguous", "sdpa", "prefill", "prefill-sdpa", or an "-fp8" one
    dtype: str
    batch: int
    context: int
    block_size: int | None
    ms: float
    kv_gbps: float
    peak_fraction: float
    max_abs_diff: float  # against the contiguous kernel (for "contiguous": against sdpa;
    # for "prefill": against "prefill-sdpa")
    within_tolerance: bool
    chunk: int | None = None  # prefill only: query tokens per sequence


def run_property_tests(selection: str) -> int:
    """The kernel property tests in a child pytest, compiled on a GPU; returns its exit code."""
    command = [sys.executable, "-m", "pytest", "properties", "-q", "-k", selection, "-p"]
    command += ["no:cacheprovider"]
    print("$", " ".join(command), flush=True)
    return subprocess.run(command, cwd=ROOT, env={**os.environ, "CI": "1"}, check=False).returncode


def time_ms(fn: Callable[[], object], device: torch.device, small: bool) -> float:
    """Median milliseconds per call (CUDA events via ``triton.testing.do_bench`` on a GPU)."""
    if device.type == "cuda":
        import triton.testing  # main() has loaded triton already, through resolve_backend

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()  # warm up (the interpreter has nothing to compile, but be fair)
    samples = []
    for _ in range(2 if small else 5):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def paged_pair(
    key: torch.Tensor, value: torch.Tensor, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Contiguous ``[batch, context, heads, dim]`` K/V cut into blocks and shuffled.

    Returns ``(k_cache, v_cache, block_tables)``: physical block ``p`` holds logical block
    ``order[p]``, and ``block_tables`` maps each sequence's logical blocks back to physical ones.
    """
    batch, context, heads, dim = key.shape
    per_seq = -(-context // block_size)
    num_blocks = batch * per_seq
    order = torch.randperm(num_blocks, generator=generator).to(key.device)
    tables = torch.empty_like(order)
    tables[order] = torch.arange(num_blocks, device=key.device)

    def paged(cache: torch.Tensor) -> torch.Tensor:
        tail = per_seq * block_size - context
        if tail:
            cache = torch.nn.functional.pad(cache, (0, 0, 0, 0, 0, tail))
        return cache.reshape(num_blocks, block_size, heads, dim)[order].contiguous()

    return paged(key), paged(value), tables.to(torch.int32).reshape(batch, per_seq)


def fp8_pair(
    key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]:
    """``key`` and ``value`` stored as ``FP8_CACHE`` codes (``spec.fp8``'s rule) under one
    power-of-two scale that puts their largest magnitude at most half the format's largest
    value; with the values the codes hold, in the rows' dtype (exact: a code times a power of
    two), which an oracle reads. Returns ``(k_codes, v_codes, k_values, v_values, scale)``."""
    amax = max(key.abs().max().item(), value.abs().max().item(), 1e-30)
    scale = 2.0 ** math.ceil(math.log2(2 * amax / torch.finfo(FP8_CACHE).max))
    scales = torch.full((key.shape[2],), scale, dtype=torch.float32, device=key.device)
    codes = [fp8.quantize(rows, scales, FP8_CACHE).view(FP8_CACHE) for rows in (key, value)]
    k_values, v_values = (c.float().mul(scale).to(key.dtype) for c in codes)
    return codes[0], codes[1], k_values, v_values, scale


def paged_fp8_pair(
    k_codes: torch.Tensor, v_codes: torch.Tensor, block_size: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`paged_pair` of fp8 codes (moved as bytes: torch pads and gathers ``uint8``)."""
    k_cache, v_cache, tables = paged_pair(
        k_codes.view(torch.uint8), v_codes.view(torch.uint8), block_size, generator
    )
    return k_cache.view(k_codes.dtype), v_cache.view(v_codes.dtype), tables


def sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> Callable[[], object]:
    """torch SDPA over ``[batch, heads, len, dim]`` K/V, grouped-query when torch supports it."""
    q = query[:, :, None, :]  # [batch, heads, 1, dim]
    attention = torch.nn.functional.scaled_dot_product_attention
    try:
        attention(q, key, value, enable_gqa=True)
    except TypeError:  # torch < 2.5: repeat the KV heads, outside the timed call
        group = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        return lambda: attention(q, key, value)
    return lambda: attention(q, key, value, enable_gqa=True)


def measure(
    dtype_name: str,
    batch: int,
    context: int,
    block_sizes: Sequence[int],
    heads: tuple[int, int, int],
    device: torch.device,
    peak_gbps: float,
    generators: tuple[torch.Generator, torch.Generator],
) -> list[Measurement]:
    """Contiguous kernel, SDPA, then the paged kernel at every block size, for one shape."""
    num_heads, num_kv_heads, head_dim = heads
    shuffle, values = generators
    dtype = getattr(torch, dtype_name)
    size = (batch, context, num_kv_heads, head_dim)
    key = torch.randn(size, generator=values, device=device, dtype=dtype)
    value = torch.randn(size, generator=values, device=device, dtype=dtype)
    query = torch.randn(batch, num_heads, head_dim, generator=values, device=device, dtype=dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    kv_bytes = 2 * key.numel() * key.element_size()
    small = device.type != "cuda"
    results: list[Measurement] = []

    def record(
        kernel: str, block_size: int | None, fn: Callable[[], object], diff: float,
        nbytes: int = kv_bytes,
    ) -> None:  # fmt: skip
        ms = time_ms(fn, device, small)
        gbps = nbytes / (ms * 1e-3) / 1e9
        fraction = gbps / peak_gbps
        ok = diff <= TOLERANCE[dtype]
        results.append(
            Measurement(
                kernel, dtype_name, batch, context, block_size, round(ms, 5), round(gbps, 1),
                round(fraction, 4), diff, ok,
            )
        )  # fmt: skip
        print(
            f"{dtype_name:9} batch {batch:4} ctx {context:6} {kernel:10} bs {block_size or '-':>4}"
            f" {ms:10.4f} ms {gbps:9.1f} GB/s ({fraction:6.1%})  diff {diff:.1e}"
            + ("" if ok else "  OUT OF TOLERANCE"),
            flush=True,
        )

    # The host knows the longest context: splits are cut over it, nothing is read back.
    options: dict[str, Any] = {"backend": "triton", "validate": False, "max_context_len": context}
    contiguous = partial(kernels.contiguous_decode_attention, query, key, value, lens, **options)
    expected = contiguous()
    sdpa_call = sdpa(query, key.transpose(1, 2).contiguous(), value.transpose(1, 2).contiguous())
    sdpa_out = sdpa_call()[:, :, 0, :]  # type: ignore[index]
    diff = (expected.float() - sdpa_out.float()).abs().max().item()
    record("contiguous", None, contiguous, diff)
    record("sdpa", None, sdpa_call, 0.0)
    del sdpa_call, sdpa_out

    for block_size in block_sizes:
        k_cache, v_cache, tables = paged_pair(key, value, block_size, shuffle)
        args = (query, k_cache, v_cache, tables, lens)
        kernels.paged_decode_attention(*args)  # validated once, untimed
        paged = partial(kernels.paged_decode_attention, *args, **options)
        diff = (paged().float() - expected.float()).abs().max().item()
        record("paged", block_size, paged, diff)
        del k_cache, v_cache, tables, args, paged

    # fp8: the same kernel over codes, against the contiguous kernel over the codes' values.
    k_codes, v_codes, k_values, v_values, scale = fp8_pair(key, value)
    expected = kernels.contiguous_decode_attention(query, k_values, v_values, lens, **options)
    del k_values, v_values
    for block_size in (size for size in block_sizes if size in FP8_BLOCK_SIZES):
        k_cache, v_cache, tables = paged_fp8_pair(k_codes, v_codes, block_size, shuffle)
        args = (query, k_cache, v_cache, tables, lens)
        kernels.paged_decode_attention(*args, k_scale=scale, v_scale=scale)  # validated, untimed
        paged = partial(
            kernels.paged_decode_attention, *args, k_scale=scale, v_scale=scale, **options
        )
        diff = (paged().float() - expected.float()).abs().max().item()
        record("paged-fp8", block_size, paged, diff, kv_bytes // key.element_size())
        del k_cache, v_cache, tables, args, paged
    return results


def measure_prefill(
    dtype_name: str,
    batch: int,
    context: int,
    chunk: int,
    block_sizes: Sequence[int],
    heads: tuple[int, int, int],
    device: torch.device,
    peak_gbps: float,
    generators: tuple[torch.Generator, torch.Generator],
) -> list[Measurement]:
    """``paged_prefill_attention`` of each sequence's last ``chunk`` tokens over its whole
    ``context`` (shuffled block tables, every block size), against torch SDPA on the same
    contiguous data with the same causal mask. ``kv_gbps`` counts K and V read once."""
    num_heads, num_kv_heads, head_dim = heads
    shuffle, values = generators
    dtype = getattr(torch, dtype_name)
    size = (batch, context, num_kv_heads, head_dim)
    key = torch.randn(size, generator=values, device=device, dtype=dtype)
    value = torch.randn(size, generator=values, device=device, dtype=dtype)
    query = torch.randn(batch * chunk, num_heads, head_dim, generator=values, device=device)
    query = query.to(dtype)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    offsets = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=device)
    kv_bytes = 2 * key.numel() * key.element_size()
    small = device.type != "cuda"
    sdpa_call = prefill_sdpa(query, key, value, chunk)
    expected = sdpa_call().transpose(1, 2).reshape(query.shape)
    results: list[Measurement] = []

    def record(
        kernel: str, block_size: int | None, fn: Callable[[], object], diff: float,
        nbytes: int = kv_bytes,
    ) -> None:  # fmt: skip
        ms = time_ms(fn, device, small)
        gbps = nbytes / (ms * 1e-3) / 1e9
        results.append(
            Measurement(
                kernel, dtype_name, batch, context, block_size, round(ms, 5), round(gbps, 1),
                round(gbps / peak_gbps, 4), diff, diff <= TOLERANCE[dtype], chunk,
            )
        )  # fmt: skip
        print(
            f"{dtype_name:9} batch {batch:4} ctx {context:6} chunk {chunk:4} {kernel:12} bs "
            f"{block_size or '-':>4} {ms:10.4f} ms  diff {diff:.1e}"
            + ("" if diff <= TOLERANCE[dtype] else "  OUT OF TOLERANCE"),
            flush=True,
        )

    record("prefill-sdpa", None, sdpa_call, 0.0)
    del sdpa_call
    options: dict[str, Any] = {"backend": "triton", "validate": False, "max_query_len": chunk}
    for block_size in block_sizes:
        k_cache, v_cache, tables = paged_pair(key, value, block_size, shuffle)
        args = (query, k_cache, v_cache, tables, offsets, lens)
        kernels.paged_prefill_attention(*args)  # validated once, untimed
        prefill = partial(kernels.paged_prefill_attention, *args, **options)
        diff = (prefill().float() - expected.float()).abs().max().item()
        record("prefill", block_size, prefill, diff)
        del k_cache, v_cache, tables, args, prefill

    # fp8: the same kernel over codes, against SDPA over the codes' values.
    k_codes, v_codes, k_values, v_values, scale = fp8_pair(key, value)
    expected = prefill_sdpa(query, k_values, v_values, chunk)().transpose(1, 2)
    expected = expected.reshape(query.shape)
    del k_values, v_values
    options |= {"k_scale": scale, "v_scale": scale}
    for block_size in block_sizes:
        k_cache, v_cache, tables = paged_fp8_pair(k_codes, v_codes, block_size, shuffle)
        args = (query, k_cache, v_cache, tables, offsets, lens)
        kernels.paged_prefill_attention(*args, k_scale=scale, v_scale=scale)  # validated
        prefill = partial(kernels.paged_prefill_attention, *args, **options)
        diff = (prefill().float() - expected.float()).abs().max().item()
        record("prefill-fp8", block_size, prefill, diff, kv_bytes // key.element_size())
        del k_cache, v_cache, tables, args, prefill
    return results


def prefill_sdpa(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, chunk: int
) -> Callable[[], torch.Tensor]:
    """torch SDPA of each sequence's last ``chunk`` queries (``query`` ``[batch * chunk, heads,
    dim]``) over its contiguous ``key``/``value`` (``[batch, context, kv_heads, dim]``, the KV
    heads repeated) with the causal mask of a chunk ending at the context's end; the call
    returns ``[batch, heads, chunk, dim]``."""
    batch, context, num_kv_heads, head_dim = key.shape
    num_heads = query.shape[1]
    q = query.view(batch, chunk, num_heads, head_dim).transpose(1, 2)
    group = num_heads // num_kv_heads
    k, v = (t.transpose(1, 2).repeat_interleave(group, 1) for t in (key, value))
    positions = torch.arange(context - chunk, context, device=key.device)
    mask = torch.arange(context, device=key.device)[None, :] <= positions[:, None]
    attention = torch.nn.functional.scaled_dot_product_attention
    return partial(attention, q, k, v, attn_mask=mask)


def engine_step(shape: dict[str, Any], device: torch.device, small: bool) -> dict[str, Any]:
    """One end-to-end engine step on ``device`` (triton backend): ``shape["batch"]`` sequences
    of a ``shape["prompt"]``-token prompt prefilled in one step, then ``ENGINE_STEPS`` decode
    steps of the whole batch, each timed (scheduling, tables, slots, every layer's store and
    attention, sampling). The greedy tokens are checked against the dense oracle on the CPU
    (``--small`` only: the full model's oracle would take minutes there)."""
    from pagedkv.impl.serving.dense import dense_generate
    from pagedkv.impl.serving.engine import PagedAttentionEngine
    from pagedkv.impl.serving.model import CausalLM, ModelConfig
    from pagedkv.spec.block_manager import blocks_needed

    num_heads, num_kv_heads, head_dim = shape["heads"]
    config = ModelConfig(
        vocab_size=32000 if not small else 128, hidden_size=shape["hidden"],
        intermediate_size=4 * shape["hidden"], num_layers=shape["layers"], num_heads=num_heads,
        num_kv_heads=num_kv_heads, head_dim=head_dim,
    )  # fmt: skip
    dtype = torch.float32 if small else torch.bfloat16
    model = CausalLM.from_seed(config, seed=0, dtype=dtype).to(device)
    batch, prompt_len = shape["batch"], shape["prompt"]
    new = 3 + ENGINE_STEPS  # the prefill's token, an untimed decode, the timed ones, one more
    per_seq = blocks_needed(prompt_len + new, ENGINE_BLOCK_SIZE)
    engine = PagedAttentionEngine(
        model, batch * per_seq, ENGINE_BLOCK_SIZE, max_num_seqs=batch,
        max_num_batched_tokens=batch * prompt_len, max_model_len=prompt_len + new,
        backend="triton",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(config.vocab_size, (prompt_len,), generator=generator).tolist()
        for _ in range(batch)
    ]
    for prompt in prompts:
        engine.add_request(prompt, new)
    outputs: dict[int, list[int]] = {}
    samples = []
    while engine.has_unfinished_requests():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        out = engine.step()
        elapsed = (time.perf_counter() - start) * 1e3
        if 2 <= len(engine.metrics) < 2 + ENGINE_STEPS:  # past the prefill and first decode
            assert out.metrics.num_decodes == batch, out.metrics
            samples.append(elapsed)
        for result in out.finished:
            outputs[result.request_id] = result.outputs[0]
    report: dict[str, Any] = {
        "model": {**shape, "vocab": config.vocab_size, "dtype": str(dtype)},
        "block_size": ENGINE_BLOCK_SIZE,
        "decode_step_ms": [round(ms, 3) for ms in samples],
        "median_ms": round(statistics.median(samples), 3),
    }
    if small:
        cpu_model = CausalLM.from_seed(config, seed=0, dtype=dtype)
        report["tokens_equal_dense"] = sum(
            outputs[i] == dense_generate(cpu_model, tuple(prompt), new).tokens
            for i, prompt in enumerate(prompts)
        )
    print(f"engine decode step at batch {batch}: {report['median_ms']} ms", flush=True)
    return report


def sweep(
    grid: dict[str, Sequence[Any]],
    heads: tuple[int, int, int],
    device: torch.device,
    peak_gbps: float,
    progress: Callable[[list[Measurement]], None],
) -> list[Measurement]:
    """Every (dtype, batch, context) of ``grid``, each at every block size; ``progress`` sees
    the results so far after each shape."""
    generators = (torch.Generator().manual_seed(0), torch.Generator(device).manual_seed(0))
    results: list[Measurement] = []
    shapes = itertools.product(grid["dtypes"], grid["batches"], grid["contexts"])
    for dtype_name, batch, context in shapes:
        results += measure(
            dtype_name, batch, context, grid["block_sizes"], heads, device, peak_gbps, generators
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        progress(results)
    prefill = grid["prefill"]
    shapes = itertools.product(
        grid["dtypes"], prefill["batches"], prefill["contexts"], prefill["chunks"]
    )
    for dtype_name, batch, context, chunk in shapes:
        if chunk <= context:
            results += measure_prefill(
                dtype_name, batch, context, chunk, grid["prefill_block_sizes"], heads, device,
                peak_gbps, generators,
            )  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
            progress(results)
    return results


def goals(results: list[Measurement]) -> dict[str, Any]:
    """The issue's two goals, evaluated over paged decode runs with block size >= 16."""
    results = [m for m in results if m.chunk is None]  # decode only
    contiguous = {(m.dtype, m.batch, m.context): m.ms for m in results if m.kernel == "contiguous"}
    paged = [m for m in results if m.kernel == "paged" and (m.block_size or 0) >= 16]
    overheads = [
        {
            "dtype": m.dtype, "batch": m.batch, "context": m.context, "block_size": m.block_size,
            "overhead": round(m.ms / contiguous[m.dtype, m.batch, m.context] - 1, 4),
        }
        for m in paged
    ]  # fmt: skip
    longest = max((m.context for m in results), default=0)
    at_longest = [
        {
            "dtype": m.dtype,
            "batch": m.batch,
            "block_size": m.block_size,
            "fraction": m.peak_fraction,
        }
        for m in paged
        if m.context == longest
    ]
    return {
        "paged_within_10pct_of_contiguous_bs_ge_16": {
            "met": all(o["overhead"] <= PAGED_OVERHEAD_GOAL for o in overheads),
            "worst": max(overheads, key=lambda o: o["overhead"], default=None),
            "all": overheads,
        },
        f"peak_fraction_ge_70pct_at_context_{longest}": {
            "met": all(a["fraction"] >= PEAK_FRACTION_GOAL for a in at_longest),
            "worst": min(at_longest, key=lambda a: a["fraction"], default=None),
            "all": at_longest,
        },
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny CPU/interpreter run")
    parser.add_argument("--out", type=Path, default=Path("gpu_kernels.json"), help="JSON report")
    parser.add_argument("--no-tests", action="store_true", help="skip the property tests")
    parser.add_argument(
        "--tests-k", help="pytest -k selection (default: every kernel test; --small: one)"
    )
    parser.add_argument("--peak-gbps", type=float, default=4800.0, help="peak HBM GB/s (H200)")

    def ints(text: str) -> tuple[int, ...]:
        return tuple(int(part) for part in text.split(","))

    parser.add_argument("--dtypes", type=lambda t: tuple(t.split(",")), help="e.g. float16")
    parser.add_argument("--batches", type=ints, help="e.g. 1,32,128")
    parser.add_argument("--contexts", type=ints, help="e.g. 512,4096,32768")
    parser.add_argument("--block-sizes", type=ints, help="e.g. 16,256")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not args.small:
        print("no CUDA device: run with --small (Triton interpreter, tiny shapes)")
        return 2
    # Load triton now, under the package's interpreter rule (on CPU: the interpreter), and fail
    # here, before any work, if it cannot run on this device.
    kernels.resolve_backend("triton", device)
    grid: dict[str, Any] = dict(SMALL if args.small else FULL)
    for name in grid:
        if getattr(args, name) is not None:
            grid[name] = getattr(args, name)
    grid["prefill"] = dict(PREFILL_SMALL if args.small else PREFILL_FULL)
    grid["prefill_block_sizes"] = (
        PREFILL_BLOCK_SIZES_SMALL if args.small else PREFILL_BLOCK_SIZES_FULL
    )
    heads = HEADS_SMALL if args.small else HEADS_FULL

    selection = args.tests_k or (
        "test_a_nan_key_reaches_the_output_at_every_split_count" if args.small else "kernels"
    )
    tests = None if args.no_tests else run_property_tests(selection)
    report: dict[str, Any] = {
        "complete": False,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "interpreter": kernels.interpreter_active(),
        "small": args.small,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "heads": dict(zip(("num_heads", "num_kv_heads", "head_dim"), heads, strict=True)),
        "grid": grid,
        "peak_gbps": args.peak_gbps,
        "launch": launch_table(device, heads),
        "property_tests": {"selection": selection, "exit_code": tests},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)

    def write(results: list[Measurement]) -> None:  # after every shape: a kill loses little
        report["goals"] = goals(results)
        report["out_of_tolerance"] = sum(not m.within_tolerance for m in results)
        report["measurements"] = [asdict(m) for m in results]
        args.out.write_text(json.dumps(report, indent=2))

    write(sweep(grid, heads, device, args.peak_gbps, write))
    report["engine_step"] = engine_step(
        ENGINE_SMALL if args.small else ENGINE_FULL, device, args.small
    )
    report["complete"] = True
    args.out.write_text(json.dumps(report, indent=2))
    for name, goal in report["goals"].items():
        print(f"goal {name}: {'met' if goal['met'] else 'NOT met'}; worst {goal['worst']}")
    print(f"wrote {args.out}")
    return 1 if tests or report["out_of_tolerance"] else 0


def launch_table(device: torch.device, heads: tuple[int, int, int]) -> dict[str, Any]:
    """The tile-table rows (``kernels.launch_config.tiles``) this run's kernels launch with."""
    from pagedkv.kernels.launch_config import capability, tiles

    target = capability(device)
    return {
        f"{kernel} {dtype}{' fp8' if on_fp8 else ''}": asdict(
            tiles(kernel, getattr(torch, dtype), heads[2], target, on_fp8)
        )
        for kernel in ("decode", "prefill")
        for dtype in ("float16", "bfloat16")
        for on_fp8 in (False, True)
    } | {"capability": target}


def _triton_version() -> str:
    """The version of triton, which ``main`` has loaded by then."""
    import triton

    return triton.__version__


if __name__ == "__main__":
    sys.exit(main())
