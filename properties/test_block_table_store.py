"""``BlockTableStore`` against the spec per sequence: the store machines and directed examples."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks import BlockTableStore, CapacityError, growth, page_tables, rows
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from properties.block_lockstep import Both
from properties.machines.differential import IntSubclass
from properties.machines.store import StoreMachine, WindowStoreMachine

TestBlockTableStore = StoreMachine.TestCase
TestWindowStore = WindowStoreMachine.TestCase


def test_stale_batch_is_resolved_again() -> None:
    """A batch made before a ``remove`` re-resolves its ids; one naming a removed id fails."""
    store = BlockTableStore(BlockManager(16, 4), 4, 4)
    for seq_id in (7, 8, 9):
        store.add(seq_id, 5)
    both, only_nine = store.batch([7, 9]), store.batch([9])
    store.remove([7])
    store.add(10, 1)  # reuses row 0, where 7 was
    assert page_tables.context_lens(store, only_nine).tolist() == [5]
    with pytest.raises(KeyError):
        page_tables.context_lens(store, both)


def test_other_stores_batch_is_refused() -> None:
    first = BlockTableStore(BlockManager(8, 4), 2, 2)
    second = BlockTableStore(BlockManager(8, 4), 2, 2)
    first.add(1, 1)
    second.add(1, 1)
    with pytest.raises(ValueError):
        second.grow(first.batch([1]))


def test_the_store_shape_is_checked() -> None:
    """Row and column counts are ints >= 1; token counts and slot ids must fit int32."""
    manager = BlockManager(4, 2)
    for bad, error in ((0, ValueError), (-1, ValueError), (1.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="max_seqs"):
            BlockTableStore(manager, bad, 4)  # type: ignore[arg-type]
        with pytest.raises(error, match="max_blocks_per_seq"):
            BlockTableStore(manager, 4, bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="slot ids"):
        BlockTableStore(BlockManager(2**16, 2**15), 1, 1)  # 2**31 slots
    with pytest.raises(ValueError, match="token counts"):
        BlockTableStore(BlockManager(4, 2**15), 1, 2**16)
    BlockTableStore(BlockManager(2**16 - 1, 2**15), 1, 2**16 - 1)  # the largest that fits
    # 2**31 - 1 is prime: only a block that size makes a count exactly int32's largest.
    store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
    store.add(0, 2**31 - 1)
    assert store.token_count(0) == 2**31 - 1
    with pytest.raises(TypeError, match="manager"):
        BlockTableStore(spec_bm.BlockManager(4, 2), 1, 1)  # type: ignore[arg-type]


def test_a_batch_is_an_immutable_value_that_shows_only_its_ids_and_rows() -> None:
    """A SeqBatch is kept across steps: frozen, and its repr is its ids and rows only."""
    store = BlockTableStore(BlockManager(8, 2), 4, 4)
    store.add(5, 1)
    store.add(7, 1)
    batch = store.batch([7, 5])
    for name in [field.name for field in dataclasses.fields(batch)]:
        with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError
            setattr(batch, name, getattr(batch, name))
    assert repr(batch) == "SeqBatch(seq_ids=(7, 5), rows=array([1, 0]))"


def test_a_refused_prompt_retried_with_another_salt_is_planned_again() -> None:
    """A refused prompt's kept keys are not reused by a retry under another salt."""
    manager = PrefixCachingBlockManager(8, 2)
    store = BlockTableStore(manager, 3, 4)
    prompt = [1, 2, 3, 4, 5]
    store.add_prompt(0, prompt, "a")
    store.cache_blocks(0, prompt, "a")
    assert store.admit(1, prompt, headroom=8, extra_key="b") is None  # refused: keys kept
    assert store.admit(1, prompt, extra_key="a") == 4  # salt a's two blocks hit
    assert store.table(1)[:2] == store.table(0)[:2]


BAD_CALLS: list[tuple[Callable[[BlockTableStore], object], type[Exception], str]] = [
    # a prompt wider than a row:
    (lambda s: s.admit(5, [1, 2, 3, 4, 5]), CapacityError, "max_blocks_per_seq"),
    *((lambda s, t=t: s.cache_blocks(0, t), TypeError, "token_ids") for t in ("123", 3, None)),
    *(
        (call, error, name)
        for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError))
        for call, name in (
            (lambda s, b=bad: s.add(5, b), "prompt_len"),
            (lambda s, b=bad: s.admit(5, [1, 2], b), "headroom"),
            (lambda s, b=bad: s.slot_mapping([0], 1, pad_to=b), "pad_to must be"),
        )
    ),
    *(
        (lambda s, b=b: s.batch(b), TypeError, "seq_ids")
        for b in (np.array([[0]]), np.array([0.0]), np.array([True]))
    ),
    (lambda s: s.slot_mapping([2]), ValueError, "num_tokens exceeds"),  # no token yet
    *(
        (lambda s, b=b: s.grow([0, 1], b), TypeError, "new_tokens must be an int or a 1-D integer")
        for b in (np.array([[1, 1]]), np.array([1.0, 1.0]))
    ),
    (lambda s: s.truncate([0, 1], [1]), ValueError, "token_counts has 1 entries for 2 sequences"),
    # Beyond int32 is CapacityError, even where a smaller count would be another error.
    *(
        (lambda s, i=ids, c=c: s.truncate(i, c), CapacityError, "token_counts")
        for ids, c in (([0], 2**31), ([0], [2**31]), ([0, 1], [1, 2**31]))
    ),
    (lambda s: s.slot_mapping([0, 1], 1, pad_to=1), ValueError, "do not fit pad_to=1"),
]


@pytest.mark.parametrize("prefix", [False, True])
@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_a_bad_argument_is_a_typed_error_naming_it_and_changes_nothing(
    case: int, prefix: bool
) -> None:
    manager = (PrefixCachingBlockManager if prefix else BlockManager)(8, 2)
    store = BlockTableStore(manager, 4, 2)
    store.add_prompt(0, [1, 2, 3])
    store.add(1, 1)
    store.add(2, 0)

    def state() -> tuple:
        counts = store.token_counts.tolist()
        return (
            store.tables.tolist(),
            counts,
            manager.free_block_ids(),
            manager.ref_counts().tolist(),
        )

    before = state()
    call, error, match = BAD_CALLS[case]
    with pytest.raises(error, match=match):
        call(store)
    assert state() == before and 5 not in store


def test_views_are_read_only_and_good_calls_work() -> None:
    """Batch rows and arrays are read-only; slot mapping defaults to the last position; ``admit``
    without headroom may take the last free blocks."""
    store = BlockTableStore(BlockManager(4, 2), 3, 4)
    store.add(0, 3)
    for batch in (store.batch(np.array([0])), store.resolve(None)):
        with pytest.raises(ValueError, match="read-only"):
            batch.rows[0] = 2
    for view in (store.tables, store.num_blocks, store.num_released, store.token_counts):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    assert store.slot_mapping([0]).tolist() == [2]
    assert store.admit(1, [1, 2, 3, 4]) == 0
    assert store.table(1) == [2, 3] and store.manager.num_free_blocks == 0


def test_cache_blocks_skips_blocks_released_before_they_were_cached() -> None:
    """Released entries are skipped by cache_blocks, as the spec skips them."""
    manager = PrefixCachingBlockManager(8, 2)
    store = BlockTableStore(manager, 2, 4)
    store.add_prompt(0, [1, 2, 3, 4, 5])
    store.release_outside_window([0], 1)  # blocks 0 and 1 (positions 0..3) go back
    assert store.table(0) == [None, None, 2]
    assert store.cache_blocks(0, [1, 2, 3, 4, 5]) == 0
    assert manager.num_cached_blocks == 0


def test_an_int_subclass_count_is_the_int_it_equals() -> None:
    """As the spec's ``check_int`` takes it: an int subclass of 0 grows by nothing."""
    store = BlockTableStore(BlockManager(8, 2), 2, 4)
    store.add(0, 3)
    store.grow([0], IntSubclass(0))
    store.grow([0], IntSubclass(1))
    assert store.token_count(0) == 4 and store.table(0) == [0, 1]


@pytest.mark.parametrize("step", [1, 2])
def test_a_batch_grow_at_block_boundaries_is_the_spec_per_sequence(step: int) -> None:
    """Sequences at and inside block boundaries grow (step 1: the fast path) as the spec's."""
    both = Both(12, 2, 3, 6, prefix=False)
    for seq_id, prompt_len in ((0, 2), (1, 3), (2, 4)):
        both.add(seq_id, prompt_len)
    both.grow(dict.fromkeys((0, 1, 2), step))
    both.check()
    assert [both.store.token_count(s) for s in (0, 1, 2)] == [2 + step, 3 + step, 4 + step]


def test_a_write_into_a_cached_block_a_truncate_left_alone_removes_its_key() -> None:
    """A truncate into a shared cached block, its other holder gone: a write removes the key."""
    prompt = [1, 2, 3, 4]
    both = Both(8, 2, 2, 4)
    both.prompt(0, prompt)
    both.cache(0, prompt)
    assert both.prompt(1, [*prompt, 5]) == 4  # both blocks hit: shared with sequence 0
    both.truncate({0: 3})  # into the shared, cached second block
    both.remove(1)
    both.grow({0: 1})  # position 3 of the now unshared second block, written in place
    both.check()
    assert both.store.pop_copy_pairs().tolist() == []
    assert both.manager.lookup([*prompt, 5]) == both.spec.lookup([*prompt, 5]) == both.tables[0][:1]


def test_cache_blocks_under_another_extra_key_starts_over_as_the_spec() -> None:
    """Another salt names other keys for blocks already cached: the spec's BlockTableError."""
    prompt = [1, 2, 3, 4, 5]
    both = Both(8, 2, 2, 4)
    both.prompt(0, prompt, "a")
    both.grow({0: 1})
    assert both.cache(0, prompt, "a") == 2
    for manager_under_test, call in (
        (both.spec, lambda: both.spec.cache_blocks(both.tables[0], [*prompt, 6], "b")),
        (both.manager, lambda: both.store.cache_blocks(0, [*prompt, 6], "b")),
    ):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()
        assert manager_under_test.num_cached_blocks == 2


def test_a_block_left_uncached_is_registered_once_its_other_copy_is_evicted() -> None:
    """An uncached duplicate is registered once the cached copy is evicted (the spec's walk)."""
    manager = PrefixCachingBlockManager(4, 2)
    store = BlockTableStore(manager, 2, 4)
    store.add_prompt(0, [1, 2, 3])
    store.add_prompt(1, [1, 2, 4])  # no hit yet: computed concurrently
    assert store.cache_blocks(0, [1, 2, 3]) == 1
    assert store.cache_blocks(1, [1, 2, 4]) == 0  # its block 0 duplicates sequence 0's
    kept = store.table(1)[0]
    store.remove([0])  # sequence 0's blocks join the queue, block 0 still cached
    store.add(2, 4)  # takes both: block 0's key is evicted
    assert manager.key_of(kept) is None and manager.num_cached_blocks == 0
    store.grow([1])
    assert store.cache_blocks(1, [1, 2, 4, 5]) == 2  # block 0 retried, block 1 new
    assert manager.lookup([1, 2, 4, 5, 6]) == store.table(1)


def test_a_rollback_then_the_same_tokens_on_reused_blocks_caches_them_again() -> None:
    """Regrowth after a truncate evicts the dropped blocks' keys; the same tokens re-cache."""
    tokens = [1, 2, 3, 4, 5, 6]
    both = Both(3, 2, 1, 3)
    both.prompt(0, tokens)
    assert both.cache(0, tokens) == 3
    both.truncate({0: 2})
    both.grow({0: 4})
    both.check()
    assert both.cache(0, tokens) == 2
    assert both.manager.num_cached_blocks == both.spec.num_cached_blocks == 3


def test_default_growth_is_one_token_and_not_atomic() -> None:
    """One token by default; a default ``grow`` grows the sequences that fit."""
    store = BlockTableStore(BlockManager(3, 2), 3, 4)
    store.add(0, 2)
    store.add(1, 2)
    assert store.grow([0, 1]) == [1]  # one free block: sequence 0 takes it
    assert [store.token_count(s) for s in (0, 1)] == [3, 2]
    assert store.grow_or_preempt([0]) == []
    assert store.token_count(0) == 4


def test_counts_of_int32s_largest_are_taken() -> None:
    """Int32's largest count, as an int subclass or in a list, is taken."""
    for count in (2**31 - 1, IntSubclass(2**31 - 1), [2**31 - 1]):
        store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
        store.add(0, 0)
        assert store.grow([0], count) == []  # type: ignore[arg-type]
        assert store.token_count(0) == 2**31 - 1


def test_the_live_batch_maps_the_slots_its_ids_map() -> None:
    """``None`` (every live sequence) maps as its ids do."""
    store = BlockTableStore(BlockManager(16, 2), 3, 4)
    for seq_id, count in ((4, 5), (2, 3), (9, 7)):
        store.add(seq_id, count)
    assert store.slot_mapping(None, 2).tolist() == store.slot_mapping([4, 2, 9], 2).tolist()


def test_a_prompt_registered_with_other_tokens_than_planned_is_keyed_by_them() -> None:
    """Blocks are keyed by the tokens cache_blocks is told, not the admitted ones (as spec)."""
    prompt, written = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    both = Both(8, 2, 1, 4)
    both.prompt(0, prompt)
    assert both.cache(0, written) == 2
    both.check()
    for tokens in ([*prompt, 0], [*written, 0]):
        assert both.manager.lookup(tokens) == both.spec.lookup(tokens)


def test_a_general_path_growth_keeps_the_keys_of_blocks_it_does_not_write() -> None:
    """Grow's general path removes only keys of blocks written in place, as the spec does."""
    both = Both(10, 2, 3, 4)
    for seq_id, prompt in ((0, [1, 2, 3, 4]), (1, [1, 2, 3, 4, 5]), (2, [7, 8, 9, 10])):
        both.prompt(seq_id, prompt)
        both.cache(seq_id, prompt)
    both.truncate({0: 3})  # into block 1, which sequence 1 shares
    both.remove(1)  # block 1 is sequence 0's alone now: its next write is in place
    both.grow({0: 1, 2: 1})
    both.check()
    for tokens in ([1, 2, 3, 4, 0], [7, 8, 9, 10, 0]):
        assert both.manager.lookup(tokens) == both.spec.lookup(tokens)
    assert both.manager.lookup([7, 8, 9, 10, 0]) == both.tables[2][:2]


@pytest.mark.parametrize("another_fails", [False, True])
def test_a_zero_token_growth_leaves_a_shared_tail_to_be_copied(another_fails: bool) -> None:
    """A 0-token grow writes nothing: a forked tail is copied at its next write (as spec)."""
    both = Both(4, 2, 4, 4, prefix=False)
    both.add(0, 3)
    both.fork(0, 1)
    both.fork(0, 2)
    both.add(3, 2)
    steps = {0: 0, 1: 1, 3: 4} if another_fails else {0: 0, 1: 1}
    # Sequence 1 copies the shared block (the last free one); 0 and 2 still share it.
    assert both.grow(steps) == ([3] if another_fails else [])
    both.remove(3)
    both.grow({0: 1}, decode=True)  # the decode step's own path must see the shared tail too
    both.check()
    assert both.store.pop_copy_pairs().tolist() == [list(p) for p in both.spec.pop_copy_pairs()]


def test_a_decode_over_tails_no_table_shares_skips_the_general_planner(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A fork flags both rows (their last block is shared); a write into the last block once it
    is the row's own, or freeing the row, clears the flag. A decode over unflagged rows takes the
    fast path: the general planner (``growth_of``) is never asked."""
    both = Both(8, 2, 2, 4, prefix=False)
    both.add(0, 3)
    both.fork(0, 1)
    both.remove(1)
    both.grow({0: 1})  # writes its last block, its own again: in place
    both.add(2, 3)  # into the freed row
    both.release(2, 2, 3)  # its first block; the partly filled last stays
    monkeypatch.setattr(growth, "growth_of", lambda *_: pytest.fail("the general planner ran"))
    assert both.grow({0: 1, 2: 1}, decode=True) == []
    both.check()


def test_a_decode_taking_every_free_block_takes_the_fast_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """As many sequences at a block boundary as free blocks: the decode fast path decides."""
    both = Both(4, 2, 2, 4, prefix=False)
    both.add(0, 2)
    both.add(1, 2)
    monkeypatch.setattr(growth, "growth_of", lambda *_: pytest.fail("the general planner ran"))
    assert both.grow({0: 1, 1: 1}, decode=True) == [] and both.manager.num_free_blocks == 0
    both.check()


def test_a_window_past_the_tokens_that_releases_the_last_block_refuses_the_next_write() -> None:
    """A count past the tokens can release the partly filled last block: the next write into
    it is refused, on the decode step's path too, as the spec refuses it."""
    both = Both(4, 2, 2, 4, prefix=False)
    both.add(0, 3)
    both.release(0, 1, 4)
    with pytest.raises(spec_bm.BlockTableError):
        both.spec.append_slot(both.tables[0], 4, 1)
    with pytest.raises(spec_bm.BlockTableError):
        both.store.grow([0])
    both.check()


def test_growth_with_preemption_and_no_copy_is_planned_by_the_batched_shortcut(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No sequence writes a block another holds (a fork at a block boundary shares a full last
    block; an unshared tail is written in place): ``grow_or_preempt`` takes the batched plan,
    and ``plan_in_order`` (one sequence at a time) is never asked."""
    both = Both(8, 2, 3, 4, prefix=False)
    both.add(0, 4)
    both.fork(0, 1)
    both.add(2, 3)
    monkeypatch.setattr(growth, "plan_in_order", lambda *_: pytest.fail("the in-order plan ran"))
    assert both.grow({0: 1, 1: 1, 2: 1}, "grow_or_preempt") == []
    both.check()


def test_a_removed_sequences_keys_do_not_outlive_it() -> None:
    """A reused id starts with no block keys: evicted blocks with its tokens re-cache."""
    tokens = [1, 2, 3, 4]
    manager = PrefixCachingBlockManager(2, 2)
    store = BlockTableStore(manager, 1, 2)
    store.add_prompt(0, tokens)
    assert store.cache_blocks(0, tokens) == 2
    store.remove([0])
    store.add(0, 4)  # takes both blocks back: their keys are evicted
    assert manager.num_cached_blocks == 0
    assert store.cache_blocks(0, tokens) == 2


def test_after_a_rollback_other_tokens_in_a_kept_block_are_refused_as_the_spec() -> None:
    """Other tokens for a kept cached block after a truncate: the spec's BlockTableError."""
    tokens = [1, 2, 3, 4, 5, 6]
    both = Both(4, 2, 1, 3)
    both.prompt(0, tokens)
    both.cache(0, tokens)
    both.truncate({0: 4})
    other = [1, 2, 9, 4]  # block 1 named with another token
    for call in (
        lambda: both.spec.cache_blocks(both.tables[0], other),
        lambda: both.store.cache_blocks(0, other),
    ):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()


def test_a_rollback_forgets_the_retries_of_the_blocks_it_drops() -> None:
    """A truncate drops the retries of uncached blocks it drops, as the spec's walk does."""
    tokens = [1, 2, 3, 4, 5, 6]
    both = Both(8, 2, 2, 3)
    for seq_id in (0, 1):  # computed concurrently: no hit
        both.prompt(seq_id, tokens)
    for seq_id in (0, 1):
        both.cache(seq_id, tokens)
    both.truncate({1: 4})
    assert both.cache(1, tokens[:4]) == 0
    both.check()


def test_preemption_over_shared_prefix_blocks_stops_once_the_rest_can_grow() -> None:
    """Victims sharing prefix blocks free only their last holds: only the tail is preempted."""
    system = [1, 2, 3, 4]
    manager = PrefixCachingBlockManager(5, 2)
    store = BlockTableStore(manager, 4, 4)
    store.add_prompt(9, [*system, 0])
    store.cache_blocks(9, [*system, 0])
    store.remove([9])  # the system prompt's two blocks stay cached
    for seq_id, tail in ((0, [5, 6]), (1, [7]), (2, [8, 9])):
        assert store.add_prompt(seq_id, [*system, *tail]) == 4
    assert manager.num_free_blocks == 0
    assert store.grow_or_preempt([0, 1, 2]) == [2]
    assert [store.token_count(s) for s in (0, 1)] == [7, 6]


@pytest.mark.parametrize("prefix", [False, True])
def test_the_undo_calls_do_what_remove_and_truncate_do(prefix: bool) -> None:
    """``undo_fork`` is ``remove`` and ``undo_growth`` is ``truncate``, in every observable."""

    def made() -> BlockTableStore:
        manager = (PrefixCachingBlockManager if prefix else BlockManager)(12, 4)
        store = BlockTableStore(manager, 4, 6)
        prompt = list(range(10))
        store.add_prompt(0, prompt)
        store.cache_blocks(0, prompt)
        store.fork(0, 1)
        store.fork(0, 2)
        store.grow([0, 1], [3, 6])
        return store

    def state(store: BlockTableStore) -> tuple:
        manager = store.manager
        keys = [manager.key_of(b) for b in range(12)] if prefix else []
        return (
            [store.table(s) for s in store.seq_ids], store.token_counts_of(None),
            manager.free_block_ids(), manager.ref_counts().tolist(),
            store.pending_copy_pairs().tolist(), keys,
        )  # fmt: skip

    undone, checked = made(), made()
    undone.undo_fork([2, 1])
    checked.remove([2, 1])
    assert state(undone) == state(checked)
    undone, checked = made(), made()
    undone.undo_growth([1, 0], [9, 10])
    checked.truncate([1, 0], [9, 10])
    assert state(undone) == state(checked)
    assert undone.token_counts_of([0, 1]) == [10, 9]


def test_a_batched_truncate_into_cached_blocks_removes_the_keys_the_spec_removes() -> None:
    """One truncate into alone-held and shared cached blocks and at a boundary: the spec's keys."""
    both = Both(16, 4, 4, 4)
    for seq_id, tokens in ((0, list(range(8))), (1, list(range(10, 18))), (3, list(range(20, 28)))):
        both.prompt(seq_id, tokens)
        both.cache(seq_id, tokens)
    both.fork(1, 2)
    both.truncate({0: 5, 1: 6, 3: 4})
    both.check()


def test_a_list_of_valid_counts_is_checked_in_bulk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain non-negative ints, 0 included, pass one bulk check; only a bad list is checked
    entry by entry, for the first bad entry's exact error."""
    both = Both(8, 2, 2, 4, prefix=False)
    both.add(0, 2)
    both.add(1, 2)
    monkeypatch.setattr(rows, "check_int", lambda *_: pytest.fail("checked entry by entry"))
    assert both.grow({0: 0, 1: 3}) == []
    both.check()


def test_a_decode_step_taking_a_cached_free_block_evicts_it() -> None:
    """The decode fast path's single block, taken from the free queue, loses its key: an
    eviction, counted as the spec counts it."""
    both = Both(2, 2, 2, 4)
    both.prompt(0, [1, 2])
    both.cache(0, [1, 2])
    both.remove(0)  # its block is free and cached, behind the other free block
    both.prompt(1, [3, 4])
    both.grow({1: 1}, decode=True)
    assert both.manager.stats.evictions == 1
    both.check()
