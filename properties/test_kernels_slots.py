"""Properties: ``slot_mapping`` is the spec's ``translate_slot``; ``store_kv`` writes exactly there.

Block tables come from spec runs, so they are realistic: shuffled ids, ids reused after frees,
blocks shared between forks.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import triton_slot_mapping, triton_store_kv
from pagedkv.spec.block_manager import translate_slot
from properties.kernel_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    HEAD_DIMS,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    scenarios,
)

BACKENDS = ("triton", "numba", "reference")

# slot_mapping(block_tables, positions, block_size, seq_ids) -> slots
SlotMapping = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]
# store_kv(key, value, k_cache, v_cache, slot_mapping) -> None
StoreKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def public_slot_mapping(backend: str, num_blocks: int | None = None) -> SlotMapping:
    def slot_mapping(*args: torch.Tensor | int) -> torch.Tensor:
        return kernels.slot_mapping(*args, num_blocks=num_blocks, backend=backend)

    return slot_mapping


def public_store_kv(backend: str) -> StoreKV:
    def store_kv(*args: torch.Tensor) -> None:
        kernels.store_kv(*args, backend=backend)

    return store_kv


def padded_tables(tables: list[list[int]], extra_columns: int) -> torch.Tensor:
    """int32 ``[len(tables), longest + extra_columns]``, padded with -1."""
    width = max(len(t) for t in tables) + extra_columns
    return torch.tensor(
        [t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE
    )


def check_slot_mapping(
    tables: list[list[int]],
    tokens: list[tuple[int, int]],
    block_size: int,
    slot_mapping: SlotMapping,
    extra_columns: int = 0,
    index_dtype: torch.dtype = torch.int64,
) -> None:
    """``slot_mapping`` of ``(sequence, position)`` tokens equals the spec, ``-1`` for padding."""
    expected = [translate_slot(tables[b], p, block_size) if p >= 0 else -1 for b, p in tokens]
    seq_ids = torch.tensor([b for b, _ in tokens], dtype=index_dtype, device=DEVICE)
    positions = torch.tensor([p for _, p in tokens], dtype=index_dtype, device=DEVICE)
    block_tables = padded_tables(tables, extra_columns)
    slots = slot_mapping(block_tables, positions, block_size, seq_ids)
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected


@settings(max_examples=kernel_examples(100))
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    extra_columns=st.integers(0, 2),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_slot_mapping_per_token_matches_spec(
    block_size: int, extra_columns: int, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    run = data.draw(scenarios(block_size), label="scenario").play()
    assume(run.seqs)
    tables = [seq.table for seq in run.seqs]
    # One token: a sequence and a position inside its table, or padding (-1).
    token = st.integers(0, len(tables) - 1).flatmap(
        lambda b: st.tuples(st.just(b), st.integers(-1, len(tables[b]) * block_size - 1))
    )
    tokens = data.draw(st.lists(token, min_size=1, max_size=64), label="tokens")
    for backend in BACKENDS:
        mapping = public_slot_mapping(backend, num_blocks=run.manager.total_blocks)
        check_slot_mapping(tables, tokens, block_size, mapping, extra_columns, index_dtype)


@settings(max_examples=kernel_examples(50))
@given(block_size=st.sampled_from(BLOCK_SIZES), data=st.data())
def test_slot_mapping_per_sequence_gives_each_newest_slot(
    block_size: int, data: st.DataObject
) -> None:
    """One position per sequence (decode): the slot of each sequence's newest token."""
    run = data.draw(scenarios(block_size), label="scenario").play()
    assume(run.seqs)
    newest = [seq.length - 1 for seq in run.seqs]
    expected = [translate_slot(seq.table, seq.length - 1, block_size) for seq in run.seqs]
    positions = torch.tensor(newest, device=DEVICE)
    block_tables = padded_tables([seq.table for seq in run.seqs], 0)
    for backend in BACKENDS:
        slots = kernels.slot_mapping(block_tables, positions, block_size, backend=backend)
        assert slots.tolist() == expected, backend


def check_store_kv(
    cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: list[int],
    store_kv: StoreKV,
) -> None:
    """``store_kv`` into copies of ``cache`` (``[2, blocks, block_size, heads, dim]``) changes
    exactly the rows of the given slots, to the given tokens."""
    block_size = cache.shape[2]
    expected_k, expected_v = cache[0].clone(), cache[1].clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[t]
            expected_v[slot // block_size, slot % block_size] = value[t]
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    store_kv(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@settings(max_examples=kernel_examples(60))
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from(BLOCK_SIZES),
    num_kv_heads=st.sampled_from([1, 2, 3]),
    head_dim=st.sampled_from((*HEAD_DIMS, 8)),
    dtype=st.sampled_from(DTYPES),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_store_kv_writes_exactly_the_given_slots(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    strided: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    num_slots = num_blocks * block_size
    written = data.draw(
        st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_slots, 48)),
        label="written",
    )
    skipped = data.draw(st.integers(0, 3), label="skipped")
    slots = data.draw(st.permutations(written + [-1] * skipped), label="slots")
    generator = torch.Generator().manual_seed(seed)
    size = (num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.randn(2, *size, generator=generator).to(dtype).to(DEVICE)
    # Strided token rows, as when K and V are slices of one fused projection.
    rows = torch.randn(len(slots), num_kv_heads, 2 * head_dim, generator=generator)
    rows = rows.to(dtype).to(DEVICE)
    key = rows[..., ::2] if strided else rows[..., :head_dim].contiguous()
    value = rows[..., 1::2] if strided else rows[..., head_dim:]
    for backend in BACKENDS:
        check_store_kv(cache, key, value, slots, public_store_kv(backend))


# Planted bugs: the checks above must catch each.


def test_check_catches_slot_mapping_that_ignores_the_table(tmp_path: Path) -> None:
    mutant = load_mutant(
        triton_slot_mapping,
        "_slot_mapping_kernel",
        "slot = tl.where(live, block_id * BLOCK_SIZE + pos % BLOCK_SIZE, -1)",
        "slot = tl.where(live, pos + 0 * block_id, -1)",
        tmp_path,
    )

    def slot_mapping(tables, positions, block_size, seq_ids) -> torch.Tensor:
        return mutant.launch(tables, positions.long(), seq_ids.long(), block_size)

    tables = [seq.table for seq in fixed_scenario(4).play().seqs]
    tokens = [(b, p) for b, table in enumerate(tables) for p in range(len(table) * 4)]
    check_slot_mapping(tables, tokens, 4, public_slot_mapping("triton"))
    with pytest.raises(AssertionError):
        check_slot_mapping(tables, tokens, 4, slot_mapping)


def test_check_catches_store_kv_that_skips_slot_zero(tmp_path: Path) -> None:
    mutant = load_mutant(
        triton_store_kv,
        "_store_kv_kernel",
        "(row_mask & (slots >= 0))",
        "(row_mask & (slots >= 1))",
        tmp_path,
    )
    cache = torch.zeros(2, 3, 4, 2, 80, device=DEVICE)
    key = torch.randn(4, 2, 80, device=DEVICE)
    slots = [5, 0, -1, 11]
    check_store_kv(cache, key, -key, slots, public_store_kv("triton"))
    with pytest.raises(AssertionError):
        check_store_kv(cache, key, -key, slots, mutant.launch)
