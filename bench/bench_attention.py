"""Decode-attention latency: paged cache (by block size) against a contiguous cache.

One group per block size, ``attention-bs{B}``, each holding ``paged`` (``paged_decode_attention``
reading K/V through shuffled block tables) and ``contiguous`` (``contiguous_decode_attention``
over the same K/V laid out ``[batch, len, heads, dim]``) at each batch of ``BATCHES``, so the
table reads as "what paging costs at this block size". The backend is whichever ``auto`` picks:
the compiled Triton kernel on CUDA, the torch reference on CPU (the Triton interpreter is for
correctness only).

Timings must hold still, because the report reads the contiguous column (which does not depend
on the block size) as this machine's noise. So each case is ``pedantic``: ``WARMUP`` untimed
calls, then ``ROUNDS`` rounds of ``ITERATIONS`` calls each, and the median round counts. On CPU
the shapes are small (context 256, batch up to 32: a few MB of K/V, which stays in cache), as in
the engine's decode steps; on CUDA they are the GPU's (context 1024, batch up to 128).
``extra_info`` records backend, device, shapes, the K/V bytes one call reads and, when timed, the
achieved bandwidth.

Under ``--benchmark-disable`` each case runs once, and the paged result is still checked
against the contiguous one. ``bench/gpu_kernels.py`` is the full sweep for a CUDA machine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels.backend import resolve_backend

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPE = torch.float16 if DEVICE.type == "cuda" else torch.float32
BATCHES, CONTEXT = ((1, 32, 128), 1024) if DEVICE.type == "cuda" else ((1, 8, 32), 256)
NUM_KV_HEADS, GROUP, HEAD_DIM = 2, 4, 128 if DEVICE.type == "cuda" else 64
WARMUP, ROUNDS, ITERATIONS = 3, 15, 5
TOLERANCE = {torch.float16: 2e-3, torch.float32: 2e-5}[DTYPE]


def make_inputs(block_size: int, batch: int) -> dict[str, torch.Tensor]:
    """Query, contiguous K/V, and the same K/V paged through shuffled block tables."""
    generator = torch.Generator().manual_seed(block_size * 1000 + batch)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DTYPE).to(DEVICE)

    key = randn(batch, CONTEXT, NUM_KV_HEADS, HEAD_DIM)
    value = randn(batch, CONTEXT, NUM_KV_HEADS, HEAD_DIM)
    blocks_per_seq = CONTEXT // block_size
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
        "context_lens": torch.full((batch,), CONTEXT, dtype=torch.int32, device=DEVICE),
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


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_attention(benchmark: Any, block_size: int, batch: int, layout: str) -> None:
    inputs = make_inputs(block_size, batch)
    q, lens = inputs["query"], inputs["context_lens"]
    if layout == "paged":
        args = (q, inputs["k_cache"], inputs["v_cache"], inputs["block_tables"], lens)

        def call() -> torch.Tensor:
            return kernels.paged_decode_attention(*args, validate=False)

    else:
        args = (q, inputs["key"], inputs["value"], lens)

        def call() -> torch.Tensor:
            return kernels.contiguous_decode_attention(*args, validate=False)

    kv_bytes = 2 * inputs["key"].numel() * inputs["key"].element_size()
    benchmark.group = f"attention-bs{block_size}"
    benchmark.extra_info.update(
        backend=resolve_backend(None, DEVICE),
        device=str(DEVICE),
        dtype=str(DTYPE).removeprefix("torch."),
        layout=layout,
        block_size=block_size,
        batch=batch,
        context=CONTEXT,
        heads=f"{NUM_KV_HEADS * GROUP}q/{NUM_KV_HEADS}kv x {HEAD_DIM}",
        kv_bytes=kv_bytes,
    )
    out = benchmark.pedantic(
        synchronized(call), rounds=ROUNDS, iterations=ITERATIONS, warmup_rounds=WARMUP
    )
    stats = getattr(benchmark, "stats", None)
    if stats is not None and stats.stats.mean > 0:
        benchmark.extra_info["kv_gbps"] = round(kv_bytes / stats.stats.mean / 1e9, 2)

    expected = kernels.contiguous_decode_attention(q, inputs["key"], inputs["value"], lens)
    torch.testing.assert_close(out, expected, atol=TOLERANCE, rtol=TOLERANCE)
