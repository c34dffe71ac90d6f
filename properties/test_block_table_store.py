"""``BlockTableStore`` against the spec per sequence: the store machines, directed examples and
a table of scenarios run in lockstep with the spec (:mod:`properties.block_lockstep`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks import BlockTableStore, CapacityError, growth, page_tables, rows
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.spec.block_manager import BlockTableError
from properties.block_lockstep import Both
from properties.machines.block_manager import IntSubclass
from properties.machines.store import StoreMachine, WindowStoreMachine

TestBlockTableStore = StoreMachine.TestCase
TestWindowStore = WindowStoreMachine.TestCase


def test_a_batch_is_an_immutable_value_of_its_ids_resolved_again_in_its_own_store() -> None:
    """A SeqBatch is frozen, its repr its ids and rows only; made before a ``remove`` it
    re-resolves its ids (one naming a removed id fails); another store's batch is refused, and
    ``None`` (every live sequence) maps as its ids do."""
    store = BlockTableStore(BlockManager(16, 2), 4, 4)
    for seq_id, count in ((7, 5), (4, 3), (9, 7)):
        store.add(seq_id, count)
    assert store.slot_mapping(None, 2).tolist() == store.slot_mapping([7, 4, 9], 2).tolist()
    both, only_nine = store.batch([9, 7]), store.batch([9])
    for name in [field.name for field in dataclasses.fields(both)]:
        with pytest.raises(AttributeError):  # FrozenInstanceError is an AttributeError
            setattr(both, name, getattr(both, name))
    assert repr(both) == "SeqBatch(seq_ids=(9, 7), rows=array([2, 0]))"
    store.remove([7])
    store.add(10, 1)  # reuses row 0, where 7 was
    assert page_tables.context_lens(store, only_nine).tolist() == [7]
    with pytest.raises(KeyError):
        page_tables.context_lens(store, both)
    first, second = (BlockTableStore(BlockManager(8, 4), 2, 2) for _ in range(2))
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


BAD_CALLS: list[tuple[Callable[[BlockTableStore], object], type[Exception], str]] = [
    # a prompt wider than a row:
    (lambda s: s.admit(5, [1, 2, 3, 4, 5]), CapacityError, "max_blocks_per_seq"),
    *((lambda s, t=t: s.cache_blocks(0, t), TypeError, "token_ids") for t in ("123", 3, None)),
    *((call, error, name)
      for bad, error in ((-1, ValueError), (1.5, TypeError), (True, TypeError))
      for call, name in ((lambda s, b=bad: s.add(5, b), "prompt_len"),
                         (lambda s, b=bad: s.admit(5, [1, 2], b), "headroom"),
                         (lambda s, b=bad: s.slot_mapping([0], 1, pad_to=b), "pad_to must be"))),
    *((lambda s, b=b: s.batch(b), TypeError, "seq_ids")
      for b in (np.array([[0]]), np.array([0.0]), np.array([True]))),
    (lambda s: s.slot_mapping([2]), ValueError, "num_tokens exceeds"),  # no token yet
    *((lambda s, b=b: s.grow([0, 1], b), TypeError, "new_tokens must be an int or a 1-D integer")
      for b in (np.array([[1, 1]]), np.array([1.0, 1.0]))),
    (lambda s: s.truncate([0, 1], [1]), ValueError, "token_counts has 1 entries for 2 sequences"),
    # Beyond int32 is CapacityError, even where a smaller count would be another error.
    *((lambda s, i=ids, c=c: s.truncate(i, c), CapacityError, "token_counts")
      for ids, c in (([0], 2**31), ([0], [2**31]), ([0, 1], [1, 2**31]))),
    (lambda s: s.slot_mapping([0, 1], 1, pad_to=1), ValueError, "do not fit pad_to=1"),
]  # fmt: skip


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
        return (store.tables.tolist(), store.token_counts.tolist(), manager.free_block_ids(),
                manager.ref_counts().tolist())  # fmt: skip

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
    batches = (store.batch(np.array([0])), store.resolve(None))
    for view in (*(b.rows for b in batches), store.tables, store.num_blocks, store.num_released,
                 store.token_counts):  # fmt: skip
        with pytest.raises(ValueError, match="read-only"):
            view[0] = 1
    assert store.slot_mapping([0]).tolist() == [2]
    assert store.admit(1, [1, 2, 3, 4]) == 0
    assert store.table(1) == [2, 3] and store.manager.num_free_blocks == 0


def test_counts_default_to_one_token_and_are_the_ints_they_equal() -> None:
    """One token by default; a default ``grow`` grows the sequences that fit (not atomic). As the
    spec's ``check_int`` takes it, an int subclass of 0 grows by nothing; int32's largest count,
    as an int subclass or in a list, is taken."""
    store = BlockTableStore(BlockManager(3, 2), 3, 4)
    store.add(0, 1)
    store.add(1, 2)
    store.grow([0], IntSubclass(0))
    store.grow([0], IntSubclass(1))
    assert store.token_count(0) == 2 and store.table(0) == [0]
    assert store.grow([0, 1]) == [1]  # one free block: sequence 0 takes it
    assert [store.token_count(s) for s in (0, 1)] == [3, 2]
    assert store.grow_or_preempt([0]) == []
    assert store.token_count(0) == 4
    for count in (2**31 - 1, IntSubclass(2**31 - 1), [2**31 - 1]):
        store = BlockTableStore(BlockManager(1, 2**31 - 1), 1, 1)
        store.add(0, 0)
        assert store.grow([0], count) == []  # type: ignore[arg-type]
        assert store.token_count(0) == 2**31 - 1


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
        manager_cls = PrefixCachingBlockManager if prefix else BlockManager
        store = BlockTableStore(manager_cls(12, 4), 4, 6)
        store.add_prompt(0, list(range(10)))
        store.cache_blocks(0, list(range(10)))
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

    for undo, same, args in (("undo_fork", "remove", ([2, 1],)),
                             ("undo_growth", "truncate", ([1, 0], [9, 10]))):  # fmt: skip
        undone, checked = made(), made()
        getattr(undone, undo)(*args)
        getattr(checked, same)(*args)
        assert state(undone) == state(checked)
    assert undone.token_counts_of([0, 1]) == [10, 9]


class Script:
    """``S.grow({0: 1}, expect=[])`` is the step ``("grow", ({0: 1},), {"expect": []})``: a call
    of :class:`Both` (``forbid``: a function the rest of the scenario must not call)."""

    def __getattr__(self, method: str) -> Callable[..., Step]:
        return lambda *args, **kwargs: (method, args, kwargs)


Step = tuple[str, tuple[Any, ...], dict[str, Any]]
S = Script()
P5, T6 = [1, 2, 3, 4, 5], [1, 2, 3, 4, 5, 6]
WRITERS = {  # sequences added, forks (parent, child), and the writers of one batch
    "two blocks, one written twice": ([0, 2], [(0, 1), (2, 3)], [0, 2, 3]),
    "one block written by four": ([0], [(0, 1), (0, 2), (0, 3)], [0, 1, 2, 3]),
}
SCENARIOS: dict[str, tuple[tuple[Any, ...], list[Step]]] = {
    # Both's sizes (total, block_size, max_seqs, max_blocks[, prefix]), then its calls in order
    **{f"a batch grow by {k} at and inside block boundaries": ((12, 2, 3, 6, False), [
        S.add(0, 2), S.add(1, 3), S.add(2, 4), S.grow({0: k, 1: k, 2: k}, expect=[]),
    ]) for k in (1, 2)},  # k = 1: the fast path
    "a write into a cached block that a truncate left alone removes its key": ((8, 2, 2, 4), [
        S.prompt(0, [1, 2, 3, 4]), S.cache(0, [1, 2, 3, 4]),
        S.prompt(1, P5, expect=4),  # both blocks hit: shared with sequence 0
        S.truncate({0: 3}),  # into the shared, cached second block
        S.remove(1), S.grow({0: 1}),  # position 3 of the now unshared block, written in place
        S.check(), S.pop(expect=[]), S.lookup(P5, expect=[0]),
    ]),
    "cache_blocks under another extra key starts over": ((8, 2, 2, 4), [
        S.prompt(0, P5, "a"), S.grow({0: 1}), S.cache(0, P5, "a", expect=2),
        S.cache(0, T6, "b", expect=BlockTableError), S.attr("num_cached_blocks", expect=2),
    ]),
    "a rollback, then the same tokens on reused blocks cache again": ((3, 2, 1, 3), [
        S.prompt(0, T6), S.cache(0, T6, expect=3), S.truncate({0: 2}),
        S.grow({0: 4}),  # evicts the dropped blocks' keys
        S.check(), S.cache(0, T6, expect=2), S.attr("num_cached_blocks", expect=3),
    ]),
    "blocks are keyed by the tokens cache_blocks is told, not the admitted": ((8, 2, 1, 4), [
        S.prompt(0, P5), S.cache(0, [1, 2, 9, 4, 5], expect=2), S.check(),
        S.lookup([*P5, 0]), S.lookup([1, 2, 9, 4, 5, 0]),
    ]),
    "grow's general path removes only the keys of blocks written in place": ((10, 2, 3, 4), [
        S.prompt(0, [1, 2, 3, 4]), S.cache(0, [1, 2, 3, 4]), S.prompt(1, P5), S.cache(1, P5),
        S.prompt(2, [7, 8, 9, 10]), S.cache(2, [7, 8, 9, 10]),
        S.truncate({0: 3}),  # into block 1, which sequence 1 shares
        S.remove(1),  # block 1 is sequence 0's alone now: its next write is in place
        S.grow({0: 1, 2: 1}), S.check(),
        S.lookup([1, 2, 3, 4, 0]), S.lookup([7, 8, 9, 10, 0], expect=[3, 4]),
    ]),
    **{f"a 0-token grow leaves a forked tail to be copied{', another fails' * fails}": (
        (4, 2, 4, 4, False), [
        S.add(0, 3), S.fork(0, 1), S.fork(0, 2), S.add(3, 2),
        # sequence 1 copies the shared block (the last free one); 0 and 2 still share it
        S.grow({0: 0, 1: 1, 3: 4} if fails else {0: 0, 1: 1}, expect=[3] if fails else []),
        S.remove(3),
        S.grow({0: 1}, decode=True),  # the decode step's own path must see the shared tail too
        S.check(), S.pop(),
    ]) for fails in (False, True)},
    # A fork flags both rows (their last block is shared); a write into the last block once it
    # is the row's own, or freeing the row, clears the flag: a decode over unflagged rows takes
    # the fast path.
    "a decode over tails no table shares skips the general planner": ((8, 2, 2, 4, False), [
        S.add(0, 3), S.fork(0, 1), S.remove(1),
        S.grow({0: 1}),  # writes its last block, its own again: in place
        S.add(2, 3),  # into the freed row
        S.release(2, 2, 3),  # its first block; the partly filled last stays
        S.forbid(growth, "growth_of"), S.grow({0: 1, 2: 1}, decode=True, expect=[]),
    ]),
    "a decode taking every free block takes the fast path": ((4, 2, 2, 4, False), [
        S.add(0, 2), S.add(1, 2), S.forbid(growth, "growth_of"),
        S.grow({0: 1, 1: 1}, decode=True, expect=[]), S.attr("num_free_blocks", expect=0),
    ]),
    # A count past the tokens can release the partly filled last block: the next write into it
    # is refused, on the decode step's path too.
    "a window past the tokens that releases the last block refuses the next write": (
        (4, 2, 2, 4, False),
        [S.add(0, 3), S.release(0, 1, 4), S.grow({0: 1}, decode=True, expect=BlockTableError)],
    ),
    # No sequence writes a block another holds (a fork at a block boundary shares a full last
    # block; an unshared tail is written in place): the batched plan, never the in-order one.
    "growth with preemption and no copy is planned by the batched shortcut": (
        (8, 2, 3, 4, False), [
        S.add(0, 4), S.fork(0, 1), S.add(2, 3), S.forbid(growth, "plan_in_order"),
        S.grow({0: 1, 1: 1, 2: 1}, "grow_or_preempt", expect=[]),
    ]),
    "after a rollback other tokens in a kept cached block are refused": ((4, 2, 1, 3), [
        S.prompt(0, T6), S.cache(0, T6), S.truncate({0: 4}),
        S.cache(0, [1, 2, 9, 4], expect=BlockTableError),  # block 1 named with another token
    ]),
    "a rollback forgets the retries of the blocks it drops": ((8, 2, 2, 3), [
        S.prompt(0, T6), S.prompt(1, T6),  # computed concurrently: no hit
        S.cache(0, T6), S.cache(1, T6), S.truncate({1: 4}), S.cache(1, T6[:4], expect=0),
    ]),
    # One truncate into alone-held and shared cached blocks and at a block boundary.
    "a batched truncate into cached blocks removes the keys the spec removes": ((16, 4, 4, 4), [
        *(s for i, first in ((0, 0), (1, 10), (3, 20))
          for s in (S.prompt(i, list(range(first, first + 8))),
                    S.cache(i, list(range(first, first + 8))))),
        S.fork(1, 2), S.truncate({0: 5, 1: 6, 3: 4}),
    ]),
    # Plain non-negative ints, 0 included, pass one bulk check; only a bad list is checked
    # entry by entry, for the first bad entry's exact error.
    "a list of valid counts is checked in bulk": ((8, 2, 2, 4, False), [
        S.add(0, 2), S.add(1, 2), S.forbid(rows, "check_int"), S.grow({0: 0, 1: 3}, expect=[]),
    ]),
    # The decode fast path's single block, taken from the free queue, loses its key.
    "a decode step taking a cached free block evicts it": ((2, 2, 2, 4), [
        S.prompt(0, [1, 2]), S.cache(0, [1, 2]),
        S.remove(0),  # its block is free and cached, behind the other free block
        S.prompt(1, [3, 4]), S.grow({1: 1}, decode=True), S.attr("stats.evictions", expect=1),
    ]),
    "a refused prompt's kept keys are not reused by a retry under another salt": ((8, 2, 3, 4), [
        S.prompt(0, P5, "a"), S.cache(0, P5, "a"),
        S.admit(1, P5, 8, "b", expect=None),  # refused: keys kept
        S.admit(1, P5, extra="a", expect=4),  # salt a's two blocks hit
    ]),
    "cache_blocks skips the blocks released before they were cached": ((8, 2, 2, 4), [
        S.prompt(0, P5), S.release(0, 1),  # blocks 0 and 1 (positions 0..3) go back
        S.cache(0, P5, expect=0), S.attr("num_cached_blocks", expect=0),
    ]),
    "an uncached duplicate is registered once the cached copy is evicted": ((4, 2, 2, 4), [
        S.prompt(0, [1, 2, 3]), S.prompt(1, [1, 2, 4]),  # no hit yet: computed concurrently
        S.cache(0, [1, 2, 3], expect=1),
        S.cache(1, [1, 2, 4], expect=0),  # its block 0 duplicates sequence 0's
        S.remove(0),  # sequence 0's blocks join the queue, block 0 still cached
        S.add(2, 4),  # takes both: block 0's key is evicted
        S.attr("num_cached_blocks", expect=0), S.grow({1: 1}, decode=True),
        S.cache(1, [1, 2, 4, 5], expect=2),  # block 0 retried, block 1 new
        S.lookup([1, 2, 4, 5, 6], expect=[2, 3]),
    ]),
    "a reused id starts with no block keys": ((2, 2, 1, 2), [
        S.prompt(0, [1, 2, 3, 4]), S.cache(0, [1, 2, 3, 4], expect=2), S.remove(0),
        S.add(0, 4),  # takes both blocks back: their keys are evicted
        S.attr("num_cached_blocks", expect=0), S.cache(0, [1, 2, 3, 4], expect=2),
    ]),
    # Every writer of a shared partly filled block but the last copies it, in batch order.
    **{f"writers copy in batch order ({method}): {case}": ((12, 4, 8, 8, False), [
        *(S.add(s, 2) for s in added), *(S.fork(*pair) for pair in forks),
        S.grow(dict.fromkeys(writers, 1), method, expect=[]), S.check(), S.pop(),
    ]) for case, (added, forks, writers) in WRITERS.items()
       for method in ("grow", "grow_or_preempt")},
}  # fmt: skip


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_a_scenario_is_the_spec_per_sequence(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each call's results agree (and the stated ones hold); the whole state agrees at the end."""
    sizes, steps = SCENARIOS[name]
    both = Both(*sizes)
    for method, args, kwargs in steps:
        if method == "forbid":  # the rest of the scenario takes another path
            module, function = args
            monkeypatch.setattr(module, function, lambda *_, f=function: pytest.fail(f"{f} ran"))
        else:
            getattr(both, method)(*args, **kwargs)
    both.check()
