"""Triton kernel: copy-on-write copies of whole cache blocks.

The spec's ``pop_copy_pairs`` contract is sequential: copy the pairs *in order*. One launch copies
its pairs in parallel, so the pairs are cut into waves, in order, such that no pair in a wave
reads or writes a block that an earlier pair of the same wave writes, or writes a block that an
earlier pair reads. Running the waves one after another then equals the sequential loop.
A retry after a failed wave launches every wave again: exact for the lists a block manager
leaves pending, in which no pair writes a block that it or an earlier pair reads (design.md §5).
An fp8 cache is copied through its ``uint8`` view: bytes as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kernels.fp8 import FP8_DTYPES
from pagedkv.kernels.launch_config import ELEMENTS_PER_PROGRAM
from pagedkv.kernels.triton_import import tl, triton


@triton.jit
def _copy_blocks_kernel(
    k_cache_ptr,
    v_cache_ptr,
    pairs_ptr,
    BLOCK_NUMEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pair = tl.program_id(0)
    offsets = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < BLOCK_NUMEL
    src = tl.load(pairs_ptr + 2 * pair).to(tl.int64) * BLOCK_NUMEL + offsets
    dst = tl.load(pairs_ptr + 2 * pair + 1).to(tl.int64) * BLOCK_NUMEL + offsets
    tl.store(k_cache_ptr + dst, tl.load(k_cache_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_cache_ptr + src, mask=mask), mask=mask)


def hazard_free_waves(pairs: Sequence[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Cut ``pairs`` into consecutive waves whose pairs may run in parallel."""
    waves: list[list[tuple[int, int]]] = []
    reads: set[int] = set()
    writes: set[int] = set()
    for src, dst in pairs:
        if not waves or src in writes or dst in writes or dst in reads:
            waves.append([])
            reads, writes = set(), set()
        waves[-1].append((src, dst))
        reads.add(src)
        writes.add(dst)
    return waves


def launch(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> None:
    """Copy validated ``(src, dst)`` pairs, wave by wave."""
    if k_cache.dtype in FP8_DTYPES:  # neither the interpreter nor sm_80 loads an fp8 dtype
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    block_numel = k_cache[0].numel() if k_cache.shape[0] else 0
    for wave in hazard_free_waves(pairs):
        wave_pairs = torch.tensor(wave, dtype=torch.int64, device=k_cache.device)
        grid = (len(wave), triton.cdiv(block_numel, ELEMENTS_PER_PROGRAM))
        _copy_blocks_kernel[grid](
            k_cache,
            v_cache,
            wave_pairs,
            BLOCK_NUMEL=block_numel,
            BLOCK=min(ELEMENTS_PER_PROGRAM, triton.next_power_of_2(block_numel)),
        )
