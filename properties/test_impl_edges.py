"""Edges of ``pagedkv.impl.blocks`` the machines rarely reach (found by the mutation run), each
against the spec or a stated rule."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pagedkv.impl.blocks.manager as manager_module
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.spec import checks
from pagedkv.spec.block_manager import BlockManager as SpecBlockManager
from pagedkv.spec.block_manager import BlockTableError
from properties.outcomes import outcome


def same_state(spec: SpecBlockManager, impl: BlockManager) -> None:
    assert impl.free_block_ids() == spec.free_block_ids()
    assert impl.ref_counts().tolist() == [block.ref_count for block in spec.blocks]
    assert impl.pop_copy_pairs() == spec.pop_copy_pairs()


def test_the_largest_pool_is_two_to_the_29(monkeypatch: pytest.MonkeyPatch) -> None:
    """The free queue's ring (1.5x the pool) fits int32; block ids allow four times more. A pool
    at the limit is accepted, one more block refused."""
    assert manager_module.MAX_FREE_RING_BLOCKS == 2**29
    assert manager_module.MAX_FREE_RING_BLOCKS * 3 // 2 < 2**31
    assert checks.MAX_INT32_BLOCKS == 2**31 == checks.INT32_MAX + 1
    monkeypatch.setattr(manager_module, "MAX_FREE_RING_BLOCKS", 8)  # at a testable size
    assert BlockManager(8).total_blocks == 8
    with pytest.raises(ValueError, match="total_blocks"):
        BlockManager(9)


def test_a_write_over_several_blocks_copies_exactly_the_shared_ones() -> None:
    """Rewriting all of ``[0, 1, 2]`` whose middle block alone is shared copies block 1 only."""
    spec, impl = SpecBlockManager(8, 2), BlockManager(8, 2)
    for manager in (spec, impl):
        parent = manager.allocate(3)
        child = manager.fork(parent)
        child = manager.append_slot(child, 2, new_tokens=2)  # copies block 0 away
        child = manager.append_slot(child, 6, new_tokens=2)  # copies block 2 away
        manager.pop_copy_pairs()
        assert manager.ref_count(1) == 2 and manager.ref_count(0) == 1
    results = [
        outcome(manager.append_slot, [0, 1, 2], 6, 6, message=True) for manager in (spec, impl)
    ]
    assert results[0] == results[1] == ("ok", [0, 5, 2])
    same_state(spec, impl)


@pytest.mark.parametrize(
    "block_ids",
    [[0, 1], np.zeros((1, 2), dtype=np.int64), np.array([0.0, 1.0]), np.array([True])],
    ids=["list", "2-d", "float", "bool"],
)
def test_free_array_refuses_what_is_not_a_1d_integer_array(block_ids: object) -> None:
    impl = BlockManager(4)
    impl.allocate(2)
    kind, (error, _) = outcome(impl.free_array, block_ids, message=True)
    assert (kind, error) == ("raised", TypeError)
    assert impl.num_free_blocks == 2


@pytest.mark.parametrize(
    ("table", "freed_first"),
    [([4], []), ([0, 4], []), ([0, -1, 4], []), ([-1], []), ([1, 9, -3], []), ([4, 0], []),
     ([0, 2, 0], [2]), ([2, 2], [2]), ([3, 0, 3, 2], [2, 3]), ([2], [2])],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.intp])
def test_a_bad_table_gets_the_spec_error_for_its_first_bad_id(
    table: list[int], freed_first: list[int], dtype: Any
) -> None:
    """Unknown ids in table order, repeated ids before free ones: the spec's error and message,
    through ``free`` and ``free_array``; nothing changes."""
    spec, impl = SpecBlockManager(4), BlockManager(4)
    for manager in (spec, impl):
        held = manager.allocate(4)
        manager.free([b for b in held if b in freed_first])
    expected = outcome(spec.free, table, message=True)
    assert expected[0] == "raised" and expected[1][0] is BlockTableError
    assert outcome(impl.free, table, message=True) == expected
    assert outcome(impl.free_array, np.array(table, dtype=dtype), message=True) == expected
    same_state(spec, impl)


@pytest.mark.parametrize("shared", [False, True])
def test_releasing_several_tables_at_once_orders_the_queue_as_frees_in_turn(shared: bool) -> None:
    """``release_in_order`` of reversed tables is frees in turn; a twice-held block joins last."""
    spec, impl = SpecBlockManager(9, 1), BlockManager(9, 1)
    tables = [[0, 1, 2], [3, 4], [5, 6, 7]]
    for manager in (spec, impl):
        for table in tables:
            assert manager.allocate(len(table)) == table
        if shared:
            manager.fork(tables[1])
    order = [*tables, tables[1]] if shared else tables
    for table in order:
        spec.free(table)
    impl.pool.release_in_order(np.concatenate([np.array(t[::-1]) for t in order]))
    same_state(spec, impl)
    expected = [8, 2, 1, 0, 7, 6, 5, 4, 3] if shared else [8, 2, 1, 0, 4, 3, 7, 6, 5]
    assert spec.free_block_ids() == expected


def waiting_state(manager: Any) -> tuple[list[int], list[int], list[int]]:
    refs = [manager.ref_count(b) for b in range(manager.total_blocks)]
    return manager.free_block_ids(), list(manager.waiting_for_copy), refs


@pytest.mark.parametrize("manager_class", [SpecBlockManager, BlockManager])
def test_a_source_is_a_source_only_while_its_pair_is_pending(manager_class: type) -> None:
    """A block freed after its pair was taken joins the queue though a later pair pends."""
    manager = manager_class(4, 4)
    table = manager.allocate(1)  # [0], one token
    sibling = manager.fork(table)
    table = manager.append_slot(table, 2)  # copies 0 -> 1
    assert manager.pop_copy_pairs() == [(0, 1)]
    forked = manager.fork(table)
    table = manager.append_slot(table, 3)  # copies 1 -> 2: pending
    manager.free(sibling)  # block 0's last holder
    assert waiting_state(manager) == ([3, 0], [], [0, 1, 1, 0])
    manager.free(forked)  # block 1's last holder: it waits for (1, 2)
    assert waiting_state(manager) == ([3, 0], [1], [0, 0, 1, 0])
    assert manager.pop_copy_pairs() == [(1, 2)]
    assert waiting_state(manager) == ([3, 0, 1], [], [0, 0, 1, 0])
