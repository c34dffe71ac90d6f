"""Decode-attention latency by block size with an fp8 cache beside an fp32 one, on the CPU.

One group per block size, ``attention-fp8-bs{B}``: ``paged_decode_attention`` over an
``fp8_e4m3`` cache (the numba kernel reading a quarter of the bytes through its 256-entry table)
and over an fp32 cache holding the same values (the numba kernel, fp32 queries both), at each
batch of ``BATCHES`` and context of ``CONTEXTS``. fp8 rounds are timed by pytest-benchmark; the
untimed ``setup`` before each times an fp32 round of as many calls, so ``paired_ratio`` (fp8 /
fp32, the median over rounds of each pair's) compares two measurements under the same load, as
``bench/bench_attention.py`` does (its helpers and round sizes are reused). On a GPU the fp8
figures come from ``bench/gpu_kernels.py``'s sweep instead; this file skips there.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pytest
import torch

from bench.bench_attention import (
    BLOCK_SIZES,
    CPU_THREADS,
    DEVICE,
    ROUNDS,
    WARMUP,
    calls_per_round,
    fixed_threads,  # noqa: F401 - an autouse fixture
    iqr,
    make_inputs,
    round_of,
)
from pagedkv import kernels

BATCHES = (8, 32)
CONTEXTS = (256, pytest.param(4096, marks=pytest.mark.long))
K_SCALE, V_SCALE = 0.01, 0.01  # N(0, 1) K/V over 448: no value saturates

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the numba backend runs on CPU")


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_attention_fp8(benchmark: Any, block_size: int, context: int, batch: int) -> None:
    inputs = make_inputs(block_size, batch, context)
    q, tables, lens = inputs["query"], inputs["block_tables"], inputs["context_lens"]
    fp8 = [torch.empty_like(inputs[c], dtype=torch.float8_e4m3fn) for c in ("k_cache", "v_cache")]
    slots = torch.arange(inputs["k_cache"].shape[0] * block_size)
    rows = [inputs[c].flatten(0, 1) for c in ("k_cache", "v_cache")]
    kernels.store_kv(*rows, *fp8, slots, k_scale=K_SCALE, v_scale=V_SCALE)
    values = [cache.float() * scale for cache, scale in zip(fp8, (K_SCALE, V_SCALE), strict=True)]

    def fp8_call() -> torch.Tensor:
        return kernels.paged_decode_attention(
            q, *fp8, tables, lens, k_scale=K_SCALE, v_scale=V_SCALE, validate=False
        )

    def fp32_call() -> torch.Tensor:
        return kernels.paged_decode_attention(q, *values, tables, lens, validate=False)

    fp32_bytes = 2 * values[0].numel() * 4
    calls = calls_per_round(fp32_bytes) if not benchmark.disabled else 1
    fp32_rounds: list[float] = []

    def time_fp32_round() -> None:
        start = time.perf_counter()
        round_of(fp32_call, calls)()
        fp32_rounds.append((time.perf_counter() - start) / calls)

    benchmark.group = f"attention-fp8-bs{block_size}"
    benchmark.extra_info.update(
        backend=kernels.resolve_backend(None, DEVICE), threads=CPU_THREADS, block_size=block_size,
        batch=batch, context=context, fp8_bytes=fp32_bytes // 4, calls_per_round=calls,
    )  # fmt: skip
    out = benchmark.pedantic(
        round_of(fp8_call, calls), setup=time_fp32_round, rounds=ROUNDS, warmup_rounds=WARMUP
    )
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.median > 0:
        fp8_rounds = [t / calls for t in stats.stats.data]
        timed = fp32_rounds[-len(fp8_rounds) :]
        benchmark.extra_info.update(
            fp8_iqr=iqr(fp8_rounds),
            fp32_median=statistics.median(timed),
            fp32_iqr=iqr(timed),
            paired_ratio=statistics.median(a / b for a, b in zip(fp8_rounds, timed, strict=True)),
        )
    torch.testing.assert_close(out, fp32_call(), atol=2e-5, rtol=2e-5)
