"""A retried step is exact: copying the pending copy-on-write pairs again after any part of them
was copied gives one copy (design.md §5), every backend (engine runs: test_faults' ``FOUND``)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from properties.kernel_cases import DEVICE, copy_in_order, kernel_examples

BACKENDS = ("numba", "reference", "triton")


@st.composite
def pending_lists(draw: st.DrawFn, num_blocks: int) -> list[tuple[int, int]]:
    """Up to 8 pending pairs as a store leaves them: no destination read so far or its source."""
    pairs: list[tuple[int, int]] = []
    read: set[int] = set()
    for _ in range(draw(st.integers(0, 8))):
        src = draw(st.integers(0, num_blocks - 1))
        writable = [b for b in range(num_blocks) if b not in read and b != src]
        if not writable:
            break
        read.add(src)
        pairs.append((src, draw(st.sampled_from(writable))))
    return pairs


def retried_layers(
    cache: torch.Tensor, pairs: list[tuple[int, int]], copied_first: list[list[tuple[int, int]]],
    backend: str,
) -> list[torch.Tensor]:  # fmt: skip
    """Each layer (a copy of ``cache``) copies its ``copied_first`` pairs, then the whole list."""
    layers = []
    for first in copied_first:
        k_cache, v_cache = cache[0].clone(), cache[1].clone()
        for part in (first, pairs):
            if part:
                kernels.copy_blocks(k_cache, v_cache, part, backend=backend)  # type: ignore[arg-type]
        layers.append(torch.stack((k_cache, v_cache)))
    return layers


@settings(max_examples=kernel_examples(60))
@given(num_blocks=st.integers(2, 6), block_size=st.sampled_from([1, 4]),
       seed=st.integers(0, 2**31 - 1), data=st.data())  # fmt: skip
def test_copying_again_after_any_part_gives_one_copy(
    num_blocks: int, block_size: int, seed: int, data: st.DataObject
) -> None:
    pairs = data.draw(pending_lists(num_blocks), label="pending pairs")
    generator = torch.Generator().manual_seed(seed)
    cache = torch.randn(2, num_blocks, block_size, 2, 8, generator=generator).to(DEVICE)
    expected = copy_in_order(cache, pairs)
    # Per layer, what copied before the fault: any sub-list, in order (a prefix of the pairs,
    # of the Triton waves, or the programs of a wave that ran).
    subsets = st.lists(st.booleans(), min_size=len(pairs), max_size=len(pairs))
    copied_first = [
        [pair for pair, ran in zip(pairs, data.draw(subsets, label="copied"), strict=True) if ran]
        for _ in range(3)
    ]
    for backend in BACKENDS:
        for layer in retried_layers(cache, pairs, copied_first, backend):
            assert torch.equal(layer, expected), (backend, pairs, copied_first)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_list_that_writes_a_pending_source_is_not_retry_exact(backend: str) -> None:
    """Teeth: ``(2, 4)`` reads block 2, then ``(1, 2)`` writes it: a retry puts block 1 in 4."""
    pairs = [(1, 3), (2, 4), (1, 2)]
    cache = torch.randn(2, 5, 2, 2, 8, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    (layer,) = retried_layers(cache, pairs, [pairs], backend)
    assert not torch.equal(layer, copy_in_order(cache, pairs))
