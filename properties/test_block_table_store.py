"""``impl.BlockTableStore`` against the spec called once per sequence: the store machines of
``properties.machines.store`` (with and without sliding-window releases), and directed examples
of the store's rules and argument checks.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pagedkv.spec.block_manager as spec_bm
import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import BlockTableStore, CapacityError, page_tables
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
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
    try:
        page_tables.context_lens(store, both)
    except KeyError:
        pass
    else:
        raise AssertionError("a batch naming a removed sequence must raise KeyError")


def test_other_stores_batch_is_refused() -> None:
    first = BlockTableStore(BlockManager(8, 4), 2, 2)
    second = BlockTableStore(BlockManager(8, 4), 2, 2)
    first.add(1, 1)
    second.add(1, 1)
    try:
        second.grow(first.batch([1]))
    except ValueError:
        return
    raise AssertionError("a SeqBatch of another store must be refused")


def test_the_store_shape_is_checked() -> None:
    """Row and column counts are ints >= 1, and the token counts and slot ids the store hands
    out must fit int32: typed errors naming the argument."""
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
    # 2**31 - 1 is prime: only a block of that size makes a count or slot id exactly int32's
    # largest, which fits.
    store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
    store.add(0, 2**31 - 1)
    assert store.token_count(0) == 2**31 - 1
    with pytest.raises(TypeError, match="manager"):
        BlockTableStore(spec_bm.BlockManager(4, 2), 1, 1)  # type: ignore[arg-type]


def test_a_batch_is_an_immutable_value_that_shows_only_its_ids_and_rows() -> None:
    """A :class:`SeqBatch` is kept across steps, so none of its fields can be reassigned, and
    its repr is its ids and rows (not the store behind it)."""
    store = BlockTableStore(BlockManager(8, 2), 4, 4)
    store.add(5, 1)
    store.add(7, 1)
    batch = store.batch([7, 5])
    for name in [field.name for field in dataclasses.fields(batch)]:
        with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError
            setattr(batch, name, getattr(batch, name))
    assert repr(batch) == "SeqBatch(seq_ids=(7, 5), rows=array([1, 0]))"


def test_admit_refuses_a_prompt_longer_than_a_row() -> None:
    """Admit checks the row width before it takes a block, with or without prefix caching."""
    for manager in (BlockManager(8, 2), PrefixCachingBlockManager(8, 2)):
        store = BlockTableStore(manager, 2, 2)
        with pytest.raises(CapacityError):
            store.admit(0, [1, 2, 3, 4, 5])
        assert store.num_free_blocks == 8 and 0 not in store


def test_a_refused_prompt_retried_with_another_salt_is_planned_again() -> None:
    """Admit keeps a refused prompt's keys for a retry with the same tokens and extra key; a
    retry with another extra key (a cache salt) must not reuse them: its hits are its own."""
    manager = PrefixCachingBlockManager(8, 2)
    store = BlockTableStore(manager, 3, 4)
    prompt = [1, 2, 3, 4, 5]
    store.add_prompt(0, prompt, "a")
    store.cache_blocks(0, prompt, "a")
    assert store.admit(1, prompt, headroom=8, extra_key="b") is None  # refused: keys kept
    assert store.admit(1, prompt, extra_key="a") == 4  # salt a's two blocks hit
    assert store.table(1)[:2] == store.table(0)[:2]


def test_cache_blocks_refuses_tokens_that_are_not_a_list() -> None:
    for manager in (BlockManager(8, 2), PrefixCachingBlockManager(8, 2)):
        store = BlockTableStore(manager, 2, 4)
        store.add_prompt(0, [1, 2, 3])
        for tokens in ("123", 3, None):
            with pytest.raises(TypeError, match="token_ids"):
                store.cache_blocks(0, tokens)  # type: ignore[arg-type]


def test_cache_blocks_skips_blocks_released_before_they_were_cached() -> None:
    """A window can release a prompt's first blocks before their K/V is registered; then
    nothing is registered for them, as the spec's cache_blocks skips released entries."""
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
    """Two sequences at a block boundary and one inside a block grow by ``step`` tokens (the
    decode fast path when ``step`` is 1): the spec's tables, one ``append_slot`` each."""
    store = BlockTableStore(BlockManager(12, 2), 3, 6)
    spec = spec_bm.BlockManager(12, 2)
    tables = {}
    for seq_id, prompt_len in ((0, 2), (1, 3), (2, 4)):
        store.add(seq_id, prompt_len)
        tables[seq_id] = (spec.allocate(-(-prompt_len // 2)), prompt_len)
    store.grow([0, 1, 2], step)
    for seq_id, (table, count) in tables.items():
        assert store.table(seq_id) == spec.append_slot(table, count + step, step)
        assert store.token_count(seq_id) == count + step
    assert store.manager.free_block_ids() == spec.free_block_ids()


def store_and_spec(
    total_blocks: int, max_seqs: int, max_blocks: int
) -> tuple[PrefixCachingBlockManager, BlockTableStore, spec_pc.PrefixCachingBlockManager]:
    """A prefix-caching store over a pool of ``total_blocks`` blocks of 2 tokens, its manager,
    and the spec's prefix cache of the same pool, for examples that run the same calls on
    both."""
    manager = PrefixCachingBlockManager(total_blocks, 2)
    store = BlockTableStore(manager, max_seqs, max_blocks)
    return manager, store, spec_pc.PrefixCachingBlockManager(total_blocks, 2)


def admit_on_both(
    store: BlockTableStore,
    spec: spec_pc.PrefixCachingBlockManager,
    seq_id: int,
    tokens: list[int],
    extra_key: str | None = None,
) -> list[int | None]:
    """``add_prompt`` on the store and ``allocate_prompt`` on the spec; the spec's table."""
    store.add_prompt(seq_id, tokens, extra_key)
    return spec.allocate_prompt(tokens, extra_key)[0]


def cache_on_both(
    store: BlockTableStore,
    spec: spec_pc.PrefixCachingBlockManager,
    seq_id: int,
    table: list[int | None],
    tokens: list[int],
    extra_key: str | None = None,
) -> int:
    """``cache_blocks`` on the store's sequence and on the spec's table; both must register
    the same number of blocks, which is returned."""
    newly_cached = store.cache_blocks(seq_id, tokens, extra_key)
    assert newly_cached == spec.cache_blocks(table, tokens, extra_key)
    return newly_cached


def test_a_write_into_a_cached_block_a_truncate_left_alone_removes_its_key() -> None:
    """A truncate cuts into a cached block another table holds (the row is flagged tail-shared);
    once the other holder is gone, the next write lands in that block in place, so its key must
    go first, as the spec's ``append_slot`` removes it: a later prompt with the old content hits
    only the untouched block. The spec runs the same calls."""
    prompt = [1, 2, 3, 4]
    manager, store, spec = store_and_spec(8, 2, 4)
    spec_table = admit_on_both(store, spec, 0, prompt)
    cache_on_both(store, spec, 0, spec_table, prompt)
    assert store.add_prompt(1, [*prompt, 5]) == 4  # both blocks hit: shared with sequence 0
    other, _ = spec.allocate_prompt([*prompt, 5])
    store.truncate([0], 3)  # into the shared, cached second block
    spec_table = spec.truncate(spec_table, 3)
    store.remove([1])
    spec.free(other)
    store.grow([0])  # position 3 of the now unshared second block, written in place
    spec_table = spec.append_slot(spec_table, 4)
    assert store.table(0) == spec_table
    assert store.pop_copy_pairs().tolist() == []
    longer = [*prompt, 5]  # a prompt that may hit both blocks
    assert manager.lookup(longer) == spec.lookup(longer) == spec_table[:1]


def test_add_and_admit_check_their_counts() -> None:
    """A bad ``prompt_len`` or ``headroom`` is a typed error naming it, changing nothing; and
    an ``admit`` without a headroom may take the last free blocks."""
    for manager in (BlockManager(2, 2), PrefixCachingBlockManager(2, 2)):
        store = BlockTableStore(manager, 2, 4)
        for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError)):
            with pytest.raises(error, match="prompt_len"):
                store.add(0, bad)  # type: ignore[arg-type]
            with pytest.raises(error, match="headroom"):
                store.admit(0, [1, 2], bad)  # type: ignore[arg-type]
        assert len(store) == 0 and manager.num_free_blocks == 2
        assert store.admit(0, [1, 2, 3, 4]) == 0
        assert store.table(0) == [0, 1] and manager.num_free_blocks == 0


def test_cache_blocks_under_another_extra_key_starts_over_as_the_spec() -> None:
    """The store keys a sequence's blocks incrementally, for one extra key. A call with
    another extra key (a cache salt) names other keys for blocks already cached: the spec's
    ``BlockTableError``, changing nothing."""
    prompt = [1, 2, 3, 4, 5]
    manager, store, spec = store_and_spec(8, 2, 4)
    table = admit_on_both(store, spec, 0, prompt, "a")
    store.grow([0])
    table = spec.append_slot(table, 6)
    assert cache_on_both(store, spec, 0, table, prompt, "a") == 2
    for manager_under_test, call in (
        (spec, lambda: spec.cache_blocks(table, [*prompt, 6], "b")),
        (manager, lambda: store.cache_blocks(0, [*prompt, 6], "b")),
    ):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()
        assert manager_under_test.num_cached_blocks == 2


def test_a_block_left_uncached_is_registered_once_its_other_copy_is_evicted() -> None:
    """Two prompts computed at once share a first block's content: the second's copy stays
    uncached. Once the first copy is evicted, the second sequence's next registration caches
    its copy, as the spec's walk over every block does; the prefix hits again."""
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
    """A truncate cuts the sequence's own block keys to its kept full blocks. Here the dropped
    blocks are the only free ones, so the regrowth takes them back and evicts their keys; a
    registration of the same tokens must then cache them again, as the spec's does."""
    tokens = [1, 2, 3, 4, 5, 6]
    manager, store, spec = store_and_spec(3, 1, 3)
    table = admit_on_both(store, spec, 0, tokens)
    assert cache_on_both(store, spec, 0, table, tokens) == 3
    store.truncate([0], 2)
    table = spec.truncate(table, 2)
    store.grow([0], 4)
    table = spec.append_slot(table, 6, 4)
    assert store.table(0) == table
    assert cache_on_both(store, spec, 0, table, tokens) == 2
    assert manager.num_cached_blocks == spec.num_cached_blocks == 3


def test_batch_and_slot_mapping_arguments_are_checked() -> None:
    """A batch is made of a 1-D integer array or a list; its rows, the live batch's and the
    store's array views are read-only; ``slot_mapping`` checks ``pad_to`` and refuses a
    sequence with no token."""
    store = BlockTableStore(BlockManager(8, 2), 3, 4)
    store.add(0, 3)
    store.add(1, 0)
    for bad in (np.array([[0]]), np.array([0.0]), np.array([True])):
        with pytest.raises(TypeError, match="seq_ids"):
            store.batch(bad)
    for batch in (store.batch(np.array([0])), store.resolve(None)):
        with pytest.raises(ValueError, match="read-only"):
            batch.rows[0] = 2
    for view in (store.tables, store.num_blocks, store.num_released, store.token_counts):
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    for bad, error in ((-1, ValueError), (True, TypeError), (1.0, TypeError)):
        with pytest.raises(error, match="pad_to must be"):
            store.slot_mapping([0], 1, pad_to=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="num_tokens exceeds"):
        store.slot_mapping([1])  # the default: each sequence's last position
    assert store.slot_mapping([0]).tolist() == [2]


def test_default_growth_is_one_token_and_not_atomic() -> None:
    """``grow`` and ``grow_or_preempt`` add one token by default, and a default ``grow`` still
    grows the sequences that fit when another cannot."""
    store = BlockTableStore(BlockManager(3, 2), 3, 4)
    store.add(0, 2)
    store.add(1, 2)
    assert store.grow([0, 1]) == [1]  # one free block: sequence 0 takes it
    assert [store.token_count(s) for s in (0, 1)] == [3, 2]
    assert store.grow_or_preempt([0]) == []
    assert store.token_count(0) == 4


def test_token_counts_are_checked_as_an_int_or_one_per_sequence() -> None:
    """``grow``, ``truncate`` and ``slot_mapping`` take one count for all or one per sequence:
    a count array must be 1-D integers, a list one entry per sequence, and no count beyond
    int32 (``CapacityError``, even where a smaller count would be another error)."""
    store = BlockTableStore(BlockManager(8, 2), 2, 4)
    store.add(0, 3)
    store.add(1, 1)
    for bad in (np.array([[1, 1]]), np.array([1.0, 1.0])):
        with pytest.raises(TypeError, match="new_tokens must be an int or a 1-D integer array"):
            store.grow([0, 1], bad)
    with pytest.raises(ValueError, match="token_counts has 1 entries for 2 sequences"):
        store.truncate([0, 1], [1])
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0], 2**31)
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0], [2**31])
    with pytest.raises(CapacityError, match="token_counts"):
        store.truncate([0, 1], [1, 2**31])  # the largest count decides
    with pytest.raises(ValueError, match="do not fit pad_to=1"):
        store.slot_mapping([0, 1], 1, pad_to=1)
    assert [store.token_count(s) for s in (0, 1)] == [3, 1]


def test_counts_of_int32s_largest_are_taken() -> None:
    """Int32's largest count, given as an int subclass or in a list, is a count like any other
    (a block of that size holds it)."""
    for count in (2**31 - 1, IntSubclass(2**31 - 1), [2**31 - 1]):
        store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
        store.add(0, 0)
        assert store.grow([0], count) == []  # type: ignore[arg-type]
        assert store.token_count(0) == 2**31 - 1


def test_the_live_batch_maps_the_slots_its_ids_map() -> None:
    """``None`` (every live sequence) resolves to the same rows and offsets as its ids."""
    store = BlockTableStore(BlockManager(16, 2), 3, 4)
    for seq_id, count in ((4, 5), (2, 3), (9, 7)):
        store.add(seq_id, count)
    assert store.slot_mapping(None, 2).tolist() == store.slot_mapping([4, 2, 9], 2).tolist()


def test_a_prompt_registered_with_other_tokens_than_planned_is_keyed_by_them() -> None:
    """``cache_blocks`` is told what the K/V holds; when that differs from the admitted
    prompt in a full block, the blocks are keyed by what it is told, as the spec keys them."""
    prompt, written = [1, 2, 3, 4, 5], [1, 2, 9, 4, 5]
    manager, store, spec = store_and_spec(8, 1, 4)
    table = admit_on_both(store, spec, 0, prompt)
    assert cache_on_both(store, spec, 0, table, written) == 2
    for tokens in ([*prompt, 0], [*written, 0]):
        assert manager.lookup(tokens) == spec.lookup(tokens)


def test_a_general_path_growth_keeps_the_keys_of_blocks_it_does_not_write() -> None:
    """A truncate into a shared cached block sends the batch's next growth down grow's general
    path, which removes a key only from a cached block written in place (here sequence 0's,
    once its other holder is gone). Another sequence of the batch whose full, cached last
    block stays as it is (it grows into a fresh block) keeps that block's key, as the spec
    does."""
    manager, store, spec = store_and_spec(10, 3, 4)
    tables = {}
    for seq_id, prompt in ((0, [1, 2, 3, 4]), (1, [1, 2, 3, 4, 5]), (2, [7, 8, 9, 10])):
        tables[seq_id] = admit_on_both(store, spec, seq_id, prompt)
        cache_on_both(store, spec, seq_id, tables[seq_id], prompt)
    store.truncate([0], 3)  # into block 1, which sequence 1 shares
    tables[0] = spec.truncate(tables[0], 3)
    store.remove([1])  # block 1 is sequence 0's alone now: its next write is in place
    spec.free(tables.pop(1))
    store.grow([0, 2])
    tables[0] = spec.append_slot(tables[0], 4)
    tables[2] = spec.append_slot(tables[2], 5)
    for seq_id, table in tables.items():
        assert store.table(seq_id) == table
    for tokens in ([1, 2, 3, 4, 0], [7, 8, 9, 10, 0]):
        assert manager.lookup(tokens) == spec.lookup(tokens)
    assert manager.lookup([7, 8, 9, 10, 0]) == tables[2][:2]


@pytest.mark.parametrize("another_fails", [False, True])
def test_a_zero_token_growth_leaves_a_shared_tail_to_be_copied(another_fails: bool) -> None:
    """A sequence given 0 new tokens in a batch grow writes nothing, so its partly filled last
    block, still shared by a fork, must be copied at its next write, as the spec copies it;
    whether the batch grew at once or, with ``another_fails``, in order with a sequence that
    could not grow."""
    store = BlockTableStore(BlockManager(4, 2), 4, 4)
    spec = spec_bm.BlockManager(4, 2)
    store.add(0, 3)
    table = spec.allocate(2)
    store.fork(0, 1)
    store.fork(0, 2)
    forks = [spec.fork(table), spec.fork(table)]
    store.add(3, 2)
    other = spec.allocate(1)
    ids, counts = ([0, 1, 3], [0, 1, 4]) if another_fails else ([0, 1], [0, 1])
    # Sequence 1 copies the shared block (the last free one); 0 and 2 still share it.
    assert store.grow(ids, counts) == ([3] if another_fails else [])
    forks[0] = spec.append_slot(forks[0], 4)
    store.remove([3])
    spec.free(other)
    store.grow([0])
    table = spec.append_slot(table, 4)
    assert [store.table(s) for s in (0, 1, 2)] == [table, *forks]
    assert store.pop_copy_pairs().tolist() == [list(pair) for pair in spec.pop_copy_pairs()]


def test_a_removed_sequences_keys_do_not_outlive_it() -> None:
    """A new sequence that reuses a removed one's id starts with no block keys: when it holds
    the same tokens in blocks whose old keys were evicted, registering caches them again."""
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
    """A truncate keeps the sequence's keys of its kept full blocks, with their tokens. A
    registration that then names other tokens for a kept cached block is refused with the
    spec's ``BlockTableError``, however few of the kept tokens differ."""
    tokens = [1, 2, 3, 4, 5, 6]
    _, store, spec = store_and_spec(4, 1, 3)
    table = admit_on_both(store, spec, 0, tokens)
    cache_on_both(store, spec, 0, table, tokens)
    store.truncate([0], 4)
    table = spec.truncate(table, 4)
    other = [1, 2, 9, 4]  # block 1 named with another token
    for call in (lambda: spec.cache_blocks(table, other), lambda: store.cache_blocks(0, other)):
        with pytest.raises(spec_bm.BlockTableError, match="cached with other tokens"):
            call()


def test_a_rollback_forgets_the_retries_of_the_blocks_it_drops() -> None:
    """Blocks left uncached (their content cached in another sequence's blocks) are retried
    at the next registration; a truncate drops the retries of the blocks it drops, so the
    next registration of the kept tokens retries only kept blocks, as the spec's walk does."""
    tokens = [1, 2, 3, 4, 5, 6]
    _, store, spec = store_and_spec(8, 2, 3)
    tables = []
    for seq_id in (0, 1):  # computed concurrently: no hit
        tables.append(admit_on_both(store, spec, seq_id, tokens))
    for seq_id, table in enumerate(tables):
        cache_on_both(store, spec, seq_id, table, tokens)
    store.truncate([1], 4)
    tables[1] = spec.truncate(tables[1], 4)
    assert cache_on_both(store, spec, 1, tables[1], tokens[:4]) == 0


def test_preemption_over_shared_prefix_blocks_stops_once_the_rest_can_grow() -> None:
    """Victims that share prefix-cache blocks free only the blocks they held last. Here the
    tail sequence's removal lets the first grow, and the one between needs no new block: it
    grows too, and only the tail is preempted."""
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
    """``undo_fork`` after ``fork`` leaves the store as ``remove`` would, and ``undo_growth``
    after ``grow`` as ``truncate`` would: the same tables, free queue, reference counts,
    pending copies and (with prefix caching) cached keys, for a cut into a shared, cached
    block included."""

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
            [store.table(s) for s in store.seq_ids],
            store.token_counts_of(None),
            manager.free_block_ids(),
            manager.ref_counts().tolist(),
            store.pending_copy_pairs().tolist(),
            keys,
        )

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
    """One truncate of three sequences: one cuts into a cached block it holds alone (the block
    loses its key), one into a cached block a fork shares (it keeps it), one to a block
    boundary (no block cut). The keys left equal the spec's per-sequence calls."""
    spec = spec_pc.PrefixCachingBlockManager(16, 4)
    store = BlockTableStore(PrefixCachingBlockManager(16, 4), 4, 4)
    prompts = {0: list(range(8)), 1: list(range(10, 18)), 3: list(range(20, 28))}
    tables = {}
    for seq_id, tokens in prompts.items():
        store.add_prompt(seq_id, tokens)
        tables[seq_id], _ = spec.allocate_prompt(tokens)
        assert store.cache_blocks(seq_id, tokens) == spec.cache_blocks(tables[seq_id], tokens)
    store.fork(1, 2)
    tables[2] = spec.fork(tables[1])
    counts = {0: 5, 1: 6, 3: 4}
    store.truncate(list(counts), list(counts.values()))
    for seq_id, count in counts.items():
        tables[seq_id] = spec.truncate(tables[seq_id], count)
    manager = store.manager
    assert [manager.key_of(b) for b in range(16)] == [spec.key_of(b) for b in range(16)]
    assert [store.table(seq_id) for seq_id in sorted(tables)] == [tables[s] for s in sorted(tables)]
