"""Properties: ``copy_blocks`` equals copying the pairs one after another, in order.

The spec's ``pop_copy_pairs`` contract is sequential; pairs may chain (a block copied into is
copied from later, after a fork of a fork). The Triton path runs hazard-free waves of pairs in
parallel, which must change nothing.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import triton_copy_blocks
from pagedkv.kernels.triton_copy_blocks import hazard_free_waves
from properties.kernel_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    copy_in_order,
    kernel_examples,
    load_mutant,
)


def block_pairs(num_blocks: int) -> st.SearchStrategy[list[tuple[int, int]]]:
    """Up to 8 (src, dst) pairs, chains, swaps and self-copies included."""
    block = st.integers(0, num_blocks - 1)
    return st.lists(st.tuples(block, block), max_size=8)


CopyBlocks = Callable[[torch.Tensor, torch.Tensor, object], None]


def check_copy_blocks(cache: torch.Tensor, pairs: object, copy_blocks: CopyBlocks) -> None:
    """``copy_blocks`` on copies of ``cache`` (``[2, blocks, ...]``) equals the sequential loop."""
    expected = copy_in_order(
        cache, torch.as_tensor(pairs, dtype=torch.int64).reshape(-1, 2).tolist()
    )
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    copy_blocks(k_cache, v_cache, pairs)
    assert torch.equal(k_cache, expected[0])
    assert torch.equal(v_cache, expected[1])


def public_copy_blocks(backend: str) -> CopyBlocks:
    def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: object) -> None:
        kernels.copy_blocks(k_cache, v_cache, pairs, backend=backend)  # type: ignore[arg-type]

    return copy_blocks


@settings(max_examples=kernel_examples(40))
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from(BLOCK_SIZES),
    num_kv_heads=st.sampled_from([1, 2]),
    head_dim=st.sampled_from([8, 80]),
    dtype=st.sampled_from(DTYPES),
    as_tensor=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_copy_blocks_matches_sequential_copies(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    as_tensor: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    pairs = data.draw(block_pairs(num_blocks), label="pairs")
    generator = torch.Generator().manual_seed(seed)
    size = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(2, *size, generator=generator).to(dtype).to(DEVICE)
    arg = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2) if as_tensor else pairs
    for backend in ("triton", "numba", "reference"):
        check_copy_blocks(cache, arg, public_copy_blocks(backend))


def test_check_catches_copy_that_reads_the_wrong_block(tmp_path: Path) -> None:
    """Planted bug: the kernel loads ``dst`` where it should load ``src``."""
    mutant = load_mutant(
        triton_copy_blocks,
        "_copy_blocks_kernel",
        "tl.load(pairs_ptr + 2 * pair)",
        "tl.load(pairs_ptr + 2 * pair + 1)",
        tmp_path,
    )
    cache = torch.randn(2, 4, 16, 2, 80, device=DEVICE)
    pairs = [(0, 1), (2, 3)]
    check_copy_blocks(cache, pairs, public_copy_blocks("triton"))
    with pytest.raises(AssertionError):
        check_copy_blocks(cache, pairs, mutant.launch)


Waves = Callable[[list[tuple[int, int]]], list[list[tuple[int, int]]]]


def check_waves(pairs: list[tuple[int, int]], order: random.Random, waves_of: Waves) -> None:
    """Within each wave, reading the wave's starting state (all copies at once, as on a GPU)
    and any one-at-a-time order agree; wave after wave, that is the sequential result."""
    waves = waves_of(pairs)
    assert [pair for wave in waves for pair in wave] == pairs
    sequential = list(range(5))  # block b holds the value b
    for src, dst in pairs:
        sequential[dst] = sequential[src]
    state = list(range(5))
    for wave in waves:
        simultaneous = list(state)
        for src, dst in wave:
            simultaneous[dst] = state[src]
        serial = list(state)
        for src, dst in order.sample(wave, len(wave)):
            serial[dst] = serial[src]
        assert simultaneous == serial, f"wave {wave} is not safe to run in parallel"
        state = simultaneous
    assert state == sequential


@settings(max_examples=kernel_examples(300))
@given(pairs=block_pairs(5), order=st.randoms(use_true_random=False))
def test_waves_are_safe_to_run_in_parallel(
    pairs: list[tuple[int, int]], order: random.Random
) -> None:
    check_waves(pairs, order, hazard_free_waves)


@pytest.mark.parametrize("pairs", [[(0, 1), (1, 2)], [(1, 2), (0, 1)], [(0, 1), (2, 1)]])
def test_check_catches_one_wave_for_dependent_pairs(pairs: list[tuple[int, int]]) -> None:
    """Planted bug: launching read-after-write, write-after-read or write-after-write pairs
    together. (The interpreter runs programs in order, so only this model can catch it.)"""

    def one_wave(pairs: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        return [list(pairs)]

    class Reversed(random.Random):
        def sample(self, population, k):  # type: ignore[override]
            return list(reversed(population))[:k]

    with pytest.raises(AssertionError):
        check_waves(pairs, Reversed(), one_wave)
