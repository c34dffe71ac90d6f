"""The chapter's worked examples and each documented rule, as concrete cases of the spec."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

import pagedkv.impl.blocks.manager as impl_manager
import pagedkv.impl.blocks.prefix_cache as impl_prefix
import pagedkv.spec.prefix_cache as spec_prefix
from pagedkv.spec import (
    BlockManager,
    BlockTableError,
    OutOfBlocksError,
    blocks_needed,
    blocks_outside_window,
    translate_slot,
)

SPEC_AND_IMPL = pytest.mark.parametrize(
    "manager_cls", [BlockManager, impl_manager.BlockManager], ids=["spec", "impl"]
)


def test_chapter_translation_example() -> None:
    """block_size 4, block_table [7, 3]: positions 0..5 land in slots 28..31, 12, 13."""
    slots = [translate_slot([7, 3], pos, 4) for pos in range(6)]
    assert slots == [28, 29, 30, 31, 12, 13]


def test_chapter_allocate_and_append_example() -> None:
    manager = BlockManager(10, 4)
    table = manager.allocate(2)
    assert table == [0, 1]
    assert manager.free_block_ids() == [2, 3, 4, 5, 6, 7, 8, 9]
    assert manager.append_slot(table, 5) == [0, 1]  # ceil(5/4) = 2 blocks: nothing new
    assert manager.append_slot(table, 9) == [0, 1, 2]  # ceil(9/4) = 3 blocks: one from the head
    assert table == [0, 1], "append_slot must not mutate its argument"


def test_chapter_shared_system_prompt_example() -> None:
    """The ref_count story: a system prompt's blocks shared by requests X and Y."""
    manager = BlockManager(10, 4)
    system = manager.allocate(3)
    x = manager.fork(system) + manager.allocate(1)
    y = manager.fork(system) + manager.allocate(1)
    assert (x, y) == ([0, 1, 2, 3], [0, 1, 2, 4])
    assert manager.ref_count(0) == 3
    manager.free(x)
    assert [manager.ref_count(b) for b in range(5)] == [2, 2, 2, 0, 1]
    assert manager.free_block_ids()[-1] == 3, "only block 3 is returned"


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda m: m.allocate(-1), ValueError, "num_blocks must be >= 0"),
        (lambda m: m.allocate(1.0), TypeError, "num_blocks must be an int"),
        (lambda m: m.allocate(True), TypeError, "num_blocks must be an int"),
        (lambda m: m.free([0, 1, 0]), BlockTableError, r"repeated within one table: \[0\]"),
        (lambda m: m.free([99]), BlockTableError, "unknown block id 99"),
        (lambda m: m.free([-1]), BlockTableError, "unknown block id -1"),
        (lambda m: m.free([2]), BlockTableError, "free"),
        (lambda m: m.free(0), TypeError, "block_table must be a list"),
        (lambda m: m.free(["0"]), TypeError, "block id must be an int"),
        (lambda m: m.fork([5]), BlockTableError, "free"),
        (lambda m: m.append_slot([0, 1], -1), ValueError, "token_count must be >= 0"),
        (lambda m: m.append_slot([0, 1], 3, new_tokens=4), ValueError, "exceeds token_count"),
        (lambda m: m.translate_slot([0, 1], -1), ValueError, "token_pos must be >= 0"),
        (lambda m: m.translate_slot([0, 1], 8), IndexError, "beyond the table's capacity of 8"),
        (lambda m: m.ref_count(10), BlockTableError, "unknown block id 10"),
        (lambda m: m.release_outside_window([0, 1], -1, 1), ValueError, "token_count must be"),
        (lambda m: m.release_outside_window([0, 1], 2.0, 1), TypeError, "token_count must be"),
        (lambda m: m.release_outside_window([0, 1], 9, 1), ValueError, "capacity of 8"),
        (lambda m: m.release_outside_window([0, 1], 8, 0), ValueError, "window must be >= 1"),
        (lambda m: m.release_outside_window([0, 1], 8, 1.0), TypeError, "window must be an int"),
        (lambda m: m.release_outside_window([0, 2], 8, 1), BlockTableError, "free"),
        (lambda m: m.release_outside_window([0, None], 8, 1), TypeError, "block id must be"),
        (lambda m: m.append_slot([None, 1], 2), BlockTableError, "released"),
        # all or nothing: nothing is taken when too few blocks are free
        (lambda m: m.allocate(9), OutOfBlocksError, "asked for 9 blocks but only 8 are free"),
        (lambda m: m.append_slot([0, 1], 41, new_tokens=33), OutOfBlocksError, "9 blocks"),
        # sizes: ints >= 1, not bools
        *((lambda m, a=args: type(m)(*a), error, name)
          for args, error, name in (((0, 4), ValueError, "total_blocks"),
                                    ((4, 0), ValueError, "block_size"),
                                    ((-1, 4), ValueError, "total_blocks"),
                                    ((4.0, 4), TypeError, "total_blocks"),
                                    ((4, "4"), TypeError, "block_size"),
                                    ((True, 4), TypeError, "total_blocks"))),
    ],
)  # fmt: skip
@SPEC_AND_IMPL
def test_bad_input_raises_typed_error_and_changes_nothing(
    call, error, message, manager_cls: type
) -> None:
    manager = manager_cls(10, 4)
    manager.allocate(2)
    before = (manager.free_block_ids(), [manager.ref_count(b) for b in range(10)])
    with pytest.raises(error, match=message):
        call(manager)
    assert (manager.free_block_ids(), [manager.ref_count(b) for b in range(10)]) == before


@pytest.mark.parametrize(
    ("table", "token_pos", "block_size", "error"),
    [({0: 5}, 0, 4, TypeError), ([True], 0, 4, TypeError), ([1.5], 0, 4, TypeError),
     ([-4], 0, 4, ValueError), ([0], 0, 0, ValueError), ([0], 0, True, TypeError),
     ([3, 4], -1, 2, ValueError), ([3, 4], 1.0, 2, TypeError), ([3, 4], True, 2, TypeError)],
)  # fmt: skip
def test_module_translate_slot_rejects_bad_input(
    table: object, token_pos: object, block_size: object, error: type
) -> None:
    """Tables, positions (negative would read from the end) and block sizes: ints, not bools."""
    match = (
        "token_pos" if token_pos != 0 else "block_size" if block_size != 4 else "block(_table| id)"
    )
    with pytest.raises(error, match=match):
        translate_slot(table, token_pos, block_size)  # type: ignore[arg-type]


@given(
    table=st.lists(st.integers(0, 1000), min_size=1, max_size=8, unique=True),
    block_size=st.integers(1, 64),
    data=st.data(),
)
def test_translate_slot_is_a_bijection_onto_the_tables_blocks(table, block_size, data) -> None:
    """Distinct positions map to distinct slots, each inside the block the table names."""
    capacity = len(table) * block_size
    positions = range(capacity)
    slots = [translate_slot(table, pos, block_size) for pos in positions]
    assert len(set(slots)) == capacity
    pos = data.draw(st.integers(0, capacity - 1))
    assert slots[pos] // block_size == table[pos // block_size]
    assert blocks_needed(pos + 1, block_size) == pos // block_size + 1


def test_the_default_block_size_is_16_and_the_error_classes() -> None:
    """``block_size`` defaults to 16 tokens, in the spec and in impl, with or without caching;
    running out is a ``RuntimeError``, a bad table a ``ValueError``."""
    managers = (BlockManager, spec_prefix.PrefixCachingBlockManager, impl_manager.BlockManager)
    for manager_cls in (*managers, impl_prefix.PrefixCachingBlockManager):
        assert manager_cls(4).block_size == 16, manager_cls
    assert issubclass(OutOfBlocksError, RuntimeError) and issubclass(BlockTableError, ValueError)


@SPEC_AND_IMPL
def test_sliding_window_worked_example(manager_cls: type) -> None:
    """docs/design.md, "Sliding window": block size 2, window 3, one token a step."""
    manager = manager_cls(8, 2)
    steps = [
        (lambda t: manager.allocate(3), [0, 1, 2], [3, 4, 5, 6, 7]),
        (lambda t: manager.release_outside_window(t, 5, 3), [None, 1, 2], [3, 4, 5, 6, 7, 0]),
        (lambda t: manager.append_slot(t, 6), [None, 1, 2], [3, 4, 5, 6, 7, 0]),
        (lambda t: manager.release_outside_window(t, 6, 3), [None, None, 2], [3, 4, 5, 6, 7, 0, 1]),
        (lambda t: manager.append_slot(t, 7), [None, None, 2, 3], [4, 5, 6, 7, 0, 1]),
        (lambda t: manager.release_outside_window(t, 7, 3), [None, None, 2, 3], [4, 5, 6, 7, 0, 1]),
    ]
    table: list[int | None] = []
    for call, expected_table, expected_queue in steps:
        table = call(table)
        assert (table, manager.free_block_ids()) == (expected_table, expected_queue)
    with pytest.raises(BlockTableError, match="released"):
        manager.translate_slot(table, 3)  # position 3 was in block 1, released at step 4
    assert manager.translate_slot(table, 4) == 2 * 2
    with pytest.raises(BlockTableError, match="released"):
        manager.append_slot(manager.truncate(table, 3), 4)  # a rollback behind the window


def test_blocks_outside_window_is_the_rule() -> None:
    """Block ``k`` is outside when ``(k + 1) * bs <= token_count - window + 1``."""
    for token_count in range(40):
        for window in range(1, 12):
            for bs in (1, 2, 3, 4, 16):
                expected = sum(
                    (k + 1) * bs <= token_count - window + 1 for k in range(token_count // bs + 1)
                )
                assert blocks_outside_window(token_count, window, bs) == expected


@SPEC_AND_IMPL
def test_a_write_after_released_entries_copies_only_what_it_writes(manager_cls: type) -> None:
    """Released entries shift indices, not the written range: a write copies only its block."""
    manager = manager_cls(10, 2)
    table = manager.release_outside_window(manager.allocate(4), 3, 1)
    assert table == [None, 1, 2, 3]
    manager.fork(table)
    assert manager.append_slot(table, 4) == [None, 4, 2, 3]  # position 3, in block 1
    assert manager.pop_copy_pairs() == [(1, 4)]
