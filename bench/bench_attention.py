"""Decode-attention latency: paged cache (by block size) against a contiguous cache.

One group per block size, ``attention-bs{B}``, each holding ``paged`` (``paged_decode_attention``
reading K/V through shuffled block tables) and ``contiguous`` (``contiguous_decode_attention``
over the same K/V laid out ``[batch, len, heads, dim]``) at each batch of ``BATCHES`` and context
of ``CONTEXTS``, so the table reads as "what paging costs at this block size". The backend is
whichever ``auto`` picks: the compiled Triton kernel on CUDA, the numba kernel on CPU. Both run
the contiguous call as the same kernel compiled without the table lookup (Triton's
``PAGED=False``; numba's ``block_tables=None``), so the ratio is the table's cost. (The torch
reference sends both calls through one gather; the report does not tabulate it.)

Timings must hold still. On CPU every call runs on ``CPU_THREADS`` thread (``torch`` and numba
alike, ``kernels.numba_runtime``), so the figure is the kernel's, not the scheduler's. Each case
is ``pedantic``: ``WARMUP`` warm-up rounds, then ``ROUNDS`` rounds of enough calls to last about
``ROUND_SECONDS`` (20 ms: several of the OS's time slices, so a timer tick or a short preemption is
a small part of any round; on this project's 2-core VM, rounds of 2 ms left 8 to 10 of the 81 cases
with a spread of 10% or more, rounds of 20 ms 4). The calls per round follow from the bytes a call
reads and :data:`CALL_COST`, not from a timing, so two runs' rounds hold as many calls and
pytest-benchmark's compare, which reads round times, compares like with like (timed, the count
moved by up to 2x between two runs of the same code). Paged rounds are timed by
pytest-benchmark; before each, its untimed ``setup`` times a contiguous round of as many calls,
so the two alternate and the ratio is the median over rounds of each pair's. The report puts
the spread, interquartile range / median, beside each median. On a shared machine run it at
real-time priority, pinned to one core (``docs/results.md`` says why and how).

Context 256 is the quick suite's (with ``--benchmark-disable`` every case runs once and both
layouts are checked against the reference); contexts 1,024 and 4,096 are marked ``long``
(``pytest -m long``). The whole file, timed, took 32 to 41 s at real-time priority on the
2-core development machine. On CUDA the shapes are the GPU's (fp16, head dim 128);
``bench/gpu_kernels.py`` is the full GPU sweep. ``extra_info`` records backend, device, threads,
shapes, the K/V bytes one call reads, calls per round and, when timed, the contiguous median,
both interquartile ranges, the paired ratio and the achieved bandwidth.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.backend import resolve_backend

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
BATCHES = (1, 8, 32)
CONTEXTS = (
    256,
    pytest.param(1024, marks=pytest.mark.long),
    pytest.param(4096, marks=pytest.mark.long),
)
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 4, 128 if DEVICE.type == "cuda" else 64
CPU_THREADS = 1
WARMUP, ROUNDS, ROUND_SECONDS = 3, 21, 20e-3
CALL_COST = {"cpu": (35e-6, 10e9), "cuda": (10e-6, 3e12)}
"""A call's rough cost by device: (seconds of overhead, bytes of K/V read a second); measured
on the 2-core development machine (numba, one thread) and estimated for an H200."""
TOLERANCE = {torch.float16: 2e-3, torch.float32: 2e-5}[DTYPE]


@pytest.fixture(autouse=True)
def fixed_threads() -> Iterator[None]:
    """``CPU_THREADS`` torch (and so numba) threads for the test, restored after it."""
    before = torch.get_num_threads()
    torch.set_num_threads(CPU_THREADS)
    yield
    torch.set_num_threads(before)


def make_inputs(block_size: int, batch: int, context: int) -> dict[str, torch.Tensor]:
    """Query, contiguous K/V, and the same K/V paged through shuffled block tables."""
    generator = torch.Generator().manual_seed(block_size * 1000 + batch + context * 7)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DTYPE).to(DEVICE)

    key = randn(batch, context, NUM_KV_HEADS, HEAD_DIM)
    value = randn(batch, context, NUM_KV_HEADS, HEAD_DIM)
    blocks_per_seq = context // block_size
    num_blocks = batch * blocks_per_seq
    # Physical block p holds logical block order[p]; the table maps logical to physical.
    order = torch.randperm(num_blocks, generator=generator)
    tables = torch.empty(num_blocks, dtype=torch.int32)
    tables[order] = torch.arange(num_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return {
        "query": randn(batch, NUM_KV_HEADS * GROUP, HEAD_DIM),
        "key": key,
        "value": value,
        "k_cache": key.reshape(shape)[order.to(DEVICE)].contiguous(),
        "v_cache": value.reshape(shape)[order.to(DEVICE)].contiguous(),
        "block_tables": tables.reshape(batch, blocks_per_seq).to(DEVICE),
        "context_lens": torch.full((batch,), context, dtype=torch.int32, device=DEVICE),
    }


def synchronized(fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
    """``fn`` followed by a device synchronization, so GPU timings include the kernel."""
    if DEVICE.type != "cuda":
        return fn

    def run() -> torch.Tensor:
        out = fn()
        torch.cuda.synchronize()
        return out

    return run


def calls_per_round(kv_bytes: int) -> int:
    """Calls per round: about ``ROUND_SECONDS`` of calls reading ``kv_bytes`` each, by
    :data:`CALL_COST`."""
    overhead, bytes_per_second = CALL_COST[DEVICE.type]
    return max(1, round(ROUND_SECONDS / (overhead + kv_bytes / bytes_per_second)))


def round_of(call: Callable[[], torch.Tensor], calls: int) -> Callable[[], torch.Tensor]:
    """``calls`` calls of ``call`` in a row; returns the last output."""

    def run() -> torch.Tensor:
        for _ in range(calls - 1):
            call()
        return call()

    return run


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_attention(benchmark: Any, block_size: int, context: int, batch: int) -> None:
    """Paged rounds timed by pytest-benchmark, each preceded (in its untimed ``setup``) by a
    contiguous round of as many calls, timed here: the two layouts alternate round by round, so
    the paired ratio of round ``i`` compares two measurements taken under the same load."""
    inputs = make_inputs(block_size, batch, context)
    q, lens = inputs["query"], inputs["context_lens"]
    paged_args = (q, inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], lens)
    contiguous_args = (q, inputs["key"], inputs["value"], lens)
    paged = synchronized(lambda: kernels.paged_decode_attention(*paged_args, validate=False))
    contiguous = synchronized(
        lambda: kernels.contiguous_decode_attention(*contiguous_args, validate=False)
    )
    kv_bytes = 2 * inputs["key"].numel() * inputs["key"].element_size()
    calls = calls_per_round(kv_bytes) if not benchmark.disabled else 1
    contiguous_rounds: list[float] = []

    def time_contiguous_round() -> None:
        start = time.perf_counter()
        round_of(contiguous, calls)()
        contiguous_rounds.append((time.perf_counter() - start) / calls)

    benchmark.group = f"attention-bs{block_size}"
    benchmark.extra_info.update(
        backend=resolve_backend(None, DEVICE),
        device=str(DEVICE),
        threads=CPU_THREADS if DEVICE.type == "cpu" else None,
        dtype=str(DTYPE).removeprefix("torch."),
        block_size=block_size,
        batch=batch,
        context=context,
        heads=f"{NUM_KV_HEADS * GROUP}q/{NUM_KV_HEADS}kv x {HEAD_DIM}",
        kv_bytes=kv_bytes,
        calls_per_round=calls,
    )
    out = benchmark.pedantic(
        round_of(paged, calls), setup=time_contiguous_round, rounds=ROUNDS, warmup_rounds=WARMUP
    )
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.median > 0:
        paged_rounds = [t / calls for t in stats.stats.data]
        timed = contiguous_rounds[-len(paged_rounds) :]  # setup also runs before warm-up rounds
        benchmark.extra_info.update(
            paged_iqr=iqr(paged_rounds),
            contiguous_median=statistics.median(timed),
            contiguous_iqr=iqr(timed),
            paired_ratio=statistics.median(p / c for p, c in zip(paged_rounds, timed, strict=True)),
            kv_gbps=round(kv_bytes / (stats.stats.median / calls) / 1e9, 2),
        )

    expected = kernels.contiguous_decode_attention(
        q, inputs["key"], inputs["value"], lens, backend="reference"
    )
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
    torch.testing.assert_close(contiguous(), expected, atol=TOLERANCE, rtol=TOLERANCE)


def iqr(values: list[float]) -> float:
    """The interquartile range of ``values`` (``statistics.quantiles``, exclusive method)."""
    quartiles = statistics.quantiles(values, n=4)
    return quartiles[2] - quartiles[0]
