"""The sequence lifecycle: every live sequence's block table, driven a scheduler step at a time.

:class:`BlockTableStore` owns the tables of sequences keyed by caller-chosen int ids and drives a
block manager's pool with whole batches. Each batch operation is equivalent to calling the spec
once per sequence, in batch order, and costs a fixed number of numpy calls; results are numpy
arrays (``torch.from_numpy`` shares them without a copy). It is a facade over small parts:
:mod:`~pagedkv.impl.blocks.rows` (the one owner of each sequence's row, table and counts),
:mod:`~pagedkv.impl.blocks.admission` (a new sequence's first blocks),
:mod:`~pagedkv.impl.blocks.growth` (a pure plan of who grows, copies or is preempted, then
applying it), :mod:`~pagedkv.impl.blocks.window` (the sliding window's released blocks) and,
with a prefix-caching manager only, :mod:`~pagedkv.impl.blocks.prefix_store` (its hooks and
each sequence's block keys); :mod:`~pagedkv.impl.blocks.page_tables` lays the tables out as
kernels read them. It drives the unchecked :mod:`~pagedkv.impl.blocks.pool` under the
contract written there: it validates every argument before it changes anything, so a call that
raises changes nothing.

Errors: ``TypeError`` for an argument of the wrong type; ``KeyError`` for an unknown sequence
id; ``ValueError`` for a repeated id in one batch, an id that is already live, or a count out of
range; :class:`~pagedkv.impl.blocks.rows.CapacityError` when the store's shape cannot hold the
request; ``BlockTableError`` for a write into, or a slot of, a released entry;
``OutOfBlocksError`` when the pool is exhausted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.admission import Admission
from pagedkv.impl.blocks.growth import DecodePlan, GrowthPlan, Plan, apply, plan
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import (
    KVEvent,
    PrefixCacheStats,
    PrefixCachingBlockManager,
)
from pagedkv.impl.blocks.prefix_store import PrefixStore
from pagedkv.impl.blocks.rows import CapacityError, SeqBatch, SeqIds, SeqRows, check_counts
from pagedkv.impl.blocks.window import SlidingWindow
from pagedkv.spec.checks import INT32_MAX, check_int, check_tokens, check_window, int32_window

__all__ = ["BlockTableStore", "SeqBatch"]


class BlockTableStore:
    """The block tables of up to ``max_seqs`` sequences, each up to ``max_blocks_per_seq`` blocks.

    Block ids come from and return to ``manager``, whose reference counts, free-queue order and
    copy-on-write pairs evolve exactly as if each sequence's table were driven through the spec
    API: ``add`` is ``allocate``, ``fork`` is ``fork``, ``remove`` is ``free``, ``grow`` is
    ``append_slot``, ``truncate`` is ``truncate`` and ``release_outside_window`` is
    ``release_outside_window``; with a prefix-caching manager
    ``add_prompt`` is ``allocate_prompt`` and ``cache_blocks`` is ``cache_blocks``. Methods
    taking ``seqs`` accept a :class:`SeqBatch` or a list, tuple or 1-D integer array of sequence
    ids; ``None`` means every live sequence, in the order added.
    """

    def __init__(
        self,
        manager: BlockManager | PrefixCachingBlockManager,
        max_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        if not isinstance(manager, (BlockManager, PrefixCachingBlockManager)):
            raise TypeError(
                "manager must be an impl BlockManager or PrefixCachingBlockManager, got "
                f"{type(manager).__name__}"
            )
        check_int("max_seqs", max_seqs, 1)
        check_int("max_blocks_per_seq", max_blocks_per_seq, 1)
        self.block_size = manager.block_size
        if max_blocks_per_seq * self.block_size > INT32_MAX:
            raise ValueError("max_blocks_per_seq * block_size must fit int32 token counts")
        if manager.total_blocks * self.block_size > INT32_MAX:
            raise ValueError("total_blocks * block_size must fit int32 slot ids")
        self.manager = manager
        self._pool = manager.pool
        self._prefix = (
            PrefixStore(manager) if isinstance(manager, PrefixCachingBlockManager) else None
        )
        self._take_fresh = None if self._prefix is None else self._prefix.take_fresh
        self._rows = SeqRows(max_seqs, max_blocks_per_seq, self.block_size)
        self._admission = Admission(self._pool, self._prefix, self._rows)

    # ----------------------------------------------------------------- introspection

    @property
    def max_seqs(self) -> int:
        return self._rows.tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self._rows.tables.shape[1]

    @property
    def total_blocks(self) -> int:
        """Blocks in the manager's pool."""
        return self.manager.total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the manager's free queue (with prefix caching, cached free ones too)."""
        return self.manager.num_free_blocks

    @property
    def num_waiting_blocks(self) -> int:
        """Blocks waiting for a copy: sources of pending copy-on-write pairs that no table holds
        (``manager.waiting_for_copy``); neither free nor held until the pairs are popped."""
        return len(self._pool.waiting)

    @property
    def prefix_caching(self) -> bool:
        """Whether the manager caches prefixes (else :meth:`cache_blocks` registers nothing)."""
        return self._prefix is not None

    @property
    def tables(self) -> NDArray[np.int32]:
        """Read-only view of the ``int32[max_seqs, max_blocks_per_seq]`` table array."""
        return _read_only(self._rows.tables)

    @property
    def num_blocks(self) -> NDArray[np.int32]:
        """Read-only view of each row's table length."""
        return _read_only(self._rows.num_blocks)

    @property
    def num_released(self) -> NDArray[np.int32]:
        """Read-only view of each row's released leading entries (a sliding window's; the
        row holds ``num_blocks - num_released`` blocks)."""
        return _read_only(self._rows.num_released)

    @property
    def token_counts(self) -> NDArray[np.int32]:
        """Read-only view of each row's token count."""
        return _read_only(self._rows.token_counts)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The live sequence ids, in the order they were added."""
        return tuple(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._rows

    def row(self, seq_id: int) -> int:
        """The row of ``tables`` that holds ``seq_id``."""
        return self._rows.row(seq_id)

    def table(self, seq_id: int) -> list[int | None]:
        """``seq_id``'s block table, as the spec would hold it: released entries are None."""
        row = self.row(seq_id)
        return [None] * int(self._rows.num_released[row]) + self._rows.held(row).tolist()

    def token_counts_of(self, seqs: SeqBatch | SeqIds | None) -> list[int]:
        """The token counts of ``seqs`` (see :meth:`resolve`), in batch order."""
        return self._rows.token_counts.take(self.resolve(seqs).rows).tolist()

    def token_count(self, seq_id: int) -> int:
        """How many tokens ``seq_id`` holds."""
        return int(self._rows.token_counts[self.row(seq_id)])

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats | None:
        """A snapshot of the prefix cache's counters, or None with a plain manager."""
        return None if self._prefix is None else replace(self._prefix.manager.stats)

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """``manager.take_stats()`` (the counters since the last call), or None."""
        return None if self._prefix is None else self._prefix.manager.take_stats()

    @property
    def usage(self) -> float:
        """The fraction of the pool held by live sequences (``manager.usage``)."""
        return self.manager.usage

    def take_kv_events(self) -> list[KVEvent]:
        """``manager.take_events()`` (oldest first); empty with a plain manager."""
        return [] if self._prefix is None else self._prefix.manager.take_events()

    def reset_prefix_cache(self) -> bool:
        """``manager.reset_prefix_cache()`` (True with a plain manager: nothing cached)."""
        return True if self._prefix is None else self._prefix.manager.reset_prefix_cache()

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Free blocks ``add_prompt(seq_id, token_ids, extra_key)`` would take now (the
        manager's ``blocks_to_allocate``). ``TypeError``/``ValueError`` for bad token ids."""
        return self._admission.blocks_to_allocate(token_ids, extra_key)

    # ----------------------------------------------------------------- sequence lifecycle

    def add(self, seq_id: int, prompt_len: int) -> None:
        """Add a sequence of ``prompt_len`` tokens: ``manager.allocate(ceil(prompt_len / bs))``.
        Raises ``ValueError`` if ``seq_id`` is live, ``CapacityError`` if no row is free or the
        prompt needs more than ``max_blocks_per_seq`` blocks, ``OutOfBlocksError``."""
        self._admission.add(seq_id, prompt_len)

    def add_prompt(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Add a sequence holding the prompt ``token_ids``; return how many of its tokens are
        cached (the spec's ``allocate_prompt`` rule: a multiple of ``block_size``, less than
        ``len(token_ids)``), whose K/V the caller must not compute:
        ``slot_mapping([seq_id], len(token_ids) - cached)`` maps the rest. With a plain manager
        it is ``add(seq_id, len(token_ids))`` and returns 0. Raises, changing nothing, as
        :meth:`add` does, and ``TypeError``/``ValueError`` for bad token ids.
        """
        return self._admission.add_prompt(seq_id, token_ids, extra_key)

    def admit(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        headroom: int = 0,
        extra_key: Hashable = None,
    ) -> int | None:
        """``add_prompt(seq_id, token_ids, extra_key)`` if it leaves at least ``headroom``
        blocks free and a row is free; otherwise None, changing nothing (a refused prompt's
        keys are kept for its retry). Raises what ``add_prompt`` raises for bad arguments
        (``CapacityError`` only for a prompt longer than a table).
        """
        return self._admission.admit(seq_id, token_ids, headroom, extra_key)

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """``manager.cache_blocks(table(seq_id), token_ids, extra_key)``, incremental
        (:mod:`~pagedkv.impl.blocks.prefix_store`): ``token_ids`` is the sequence's whole token
        list whose K/V is written, at most ``token_count(seq_id)`` long; returns the blocks
        newly cached (0 with a plain manager). Raises, changing nothing: ``KeyError``,
        ``TypeError``/``ValueError`` for bad token ids or too many, ``BlockTableError`` if a
        block is cached with other tokens.
        """
        row, rows = self.row(seq_id), self._rows
        count, released = int(rows.token_counts[row]), int(rows.num_released[row])
        if self._prefix is not None:
            table = rows.tables[row]
            return self._prefix.cache_blocks(seq_id, token_ids, extra_key, table, count, released)
        if len(check_tokens(token_ids)) > count:
            raise ValueError(f"{len(token_ids)} tokens, but sequence {seq_id} holds {count}")
        return 0

    def fork(self, parent_id: int, child_id: int) -> None:
        """Add ``child_id`` sharing ``parent_id``'s blocks and token count: ``manager.fork``
        (its released entries are copied; only held blocks gain an owner)."""
        parent_row = self.row(parent_id)
        child_id = self._rows.check_new(child_id)
        if not self._rows.free_rows:
            raise CapacityError(f"all {self.max_seqs} rows hold live sequences")
        self._pool.share(self._rows.held(parent_row).astype(np.intp))  # held entries only
        row = self._rows.copy_row(parent_row, child_id)
        if self._prefix is not None:
            self._prefix.fork(parent_id, child_id)
        if self._rows.token_counts[row] % self.block_size:  # a write into the partly filled
            self._rows.tail_shared[[parent_row, row]] = True  # last block may copy it

    def remove(self, seqs: SeqBatch | SeqIds) -> None:
        """Free the sequences' tables and forget them: ``manager.free`` per sequence, in order
        (released entries hold nothing)."""
        batch = self.resolve(seqs)
        self._remove_rows(batch.rows, batch.seq_ids)

    def truncate(self, seqs: SeqBatch | SeqIds, token_counts: int | SeqIds) -> None:
        """``table = manager.truncate(table, count)`` per sequence, in batch order (one count
        for all, or one per sequence): the rollback of a speculative step. Raises, changing
        nothing: what :meth:`resolve` raises, ``TypeError``/``ValueError`` for a count that is
        not an int, below 0 or above the sequence's token count (a truncate never grows).
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = check_counts("token_counts", token_counts, rows.size)
        counts = np.broadcast_to(np.asarray(step, dtype=np.int64), rows.shape)
        over = counts > self._rows.token_counts.take(rows)
        if over.any():
            ids = np.array(batch.seq_ids)[over].tolist()
            raise ValueError(f"token_counts exceed the token counts of sequences {ids}")
        self._truncate_rows(rows, batch.seq_ids, counts)

    def release_outside_window(
        self, seqs: SeqBatch | SeqIds | None, window: int, token_counts: int | SeqIds | None = None
    ) -> None:
        """``table = manager.release_outside_window(table, count, window)`` per sequence, in
        batch order (:mod:`~pagedkv.impl.blocks.window`). ``count`` is the sequence's token
        count, or its entry of ``token_counts`` (one int for all, or one per sequence): the
        position of its next query. Released entries are ``PAD`` in :attr:`tables`, None in
        :meth:`table`. Raises, changing nothing: what :meth:`resolve` raises,
        ``TypeError``/``ValueError`` for a window or count that is not an int, a window below
        1, a count below 0 or above ``num_blocks * block_size``. A window above ``INT32_MAX``
        releases nothing (``int32_window``).
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = (
            None if token_counts is None else check_counts("token_counts", token_counts, rows.size)
        )
        width = int32_window(check_window(window))  # None: wider than the store's counts
        lengths = self._rows.num_blocks.take(rows)
        if step is None:
            counts = self._rows.token_counts.take(rows).astype(np.int64)
        else:
            counts = np.broadcast_to(np.asarray(step, dtype=np.int64), rows.shape)
            over = counts > lengths.astype(np.int64) * self.block_size
            if over.any():
                ids = np.array(batch.seq_ids)[over].tolist()
                raise ValueError(f"token_counts exceed the table capacity of sequences {ids}")
        if width is None:
            return  # wider than any count the store holds: releases nothing, as in the spec
        SlidingWindow(width, self.block_size).release(
            self._rows, rows, batch.base, counts, self._pool
        )

    # ----------------------------------------------------------------- a scheduler step

    def batch(self, seq_ids: SeqIds) -> SeqBatch:
        """Resolve distinct live sequence ids, in order, to a :class:`SeqBatch`."""
        return self._rows.batch(seq_ids)

    def grow(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds = 1, *, atomic: bool = False
    ) -> list[int]:
        """``table = manager.append_slot(table, count + k, new_tokens=k)`` per sequence in batch
        order (``k``: one int for all, or one per sequence), ``OutOfBlocksError`` caught: returns
        the ids that could not grow, unchanged. With ``atomic=True`` nothing changes if one
        could not grow. Raises, changing nothing, ``CapacityError`` past ``max_blocks_per_seq``
        blocks and ``BlockTableError`` for a write into a released entry. Copy-on-write pairs go
        to :meth:`pending_copy_pairs`.
        """
        batch, decided = self._plan(seqs, new_tokens, preempt=False)
        if decided is None:
            return []
        failed = []
        if isinstance(decided, GrowthPlan):  # a DecodePlan grows every sequence
            failed = [batch.seq_ids[i] for i in decided.not_grown()]
        if atomic and failed:
            return failed
        self._apply(batch, decided)
        return failed

    def grow_or_preempt(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds = 1
    ) -> list[int]:
        """:meth:`grow`, except that while a sequence cannot grow the batch's last remaining
        sequence is removed (preemption by recompute), until it fits or was itself removed.
        Returns the removed ids in removal order; every other sequence grew. Raises as
        :meth:`grow`.
        """
        batch, decided = self._plan(seqs, new_tokens, preempt=True)
        if decided is None:
            return []
        self._apply(batch, decided)
        if isinstance(decided, DecodePlan):
            return []
        return [batch.seq_ids[i] for i in decided.victims]

    def slot_mapping(
        self,
        seqs: SeqBatch | SeqIds | None = None,
        num_tokens: int | SeqIds = 1,
        pad_to: int | None = None,
    ) -> NDArray[np.int32]:
        """``translate_slot(table, pos)`` of each sequence's last ``k = num_tokens`` positions,
        runs concatenated in batch order, as a new int32 array (``PAD``-padded to ``pad_to``):
        after ``grow(seqs, k)``, the step's new tokens. ``ValueError`` if some ``k`` exceeds its
        count or the slots exceed ``pad_to``, ``BlockTableError`` for a released entry.
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = check_counts("num_tokens", num_tokens, rows.size)
        if pad_to is not None:
            check_int("pad_to", pad_to, 0)
        return self._rows.slot_mapping(rows, batch.base, step, pad_to)

    def pending_copy_pairs(self) -> NDArray[np.int32]:
        """The pending copy-on-write pairs, as :meth:`pop_copy_pairs` would return them, still
        pending: copy them, then pop them, and a failed copy loses nothing."""
        return self._pool.pending_copy_pairs()

    def pop_copy_pairs(self) -> NDArray[np.int32]:
        """The manager's pending copy-on-write pairs as an int32 ``[P, 2]`` array of
        ``(src, dst)`` rows, in order; forgets them (see ``BlockManager.pop_copy_pairs``)."""
        return self._pool.pop_copy_pairs()

    def resolve(self, seqs: SeqBatch | SeqIds | None) -> SeqBatch:
        """``seqs`` as a current :class:`SeqBatch`: ``None`` is every live sequence in the order
        added, and ids, or a batch's ids, are resolved with :meth:`batch` (``KeyError`` if one
        is gone)."""
        return self._rows.resolve(seqs)

    # ----------------------------------------------------------------- in-step undo

    # A caller's undo of its own calls earlier in the same step, made when a later call of
    # that step failed. Unchecked, so they cannot fail: beyond looking their ids up they check
    # nothing (the caller passes ids and counts that those calls made valid), and they take
    # no block, only give blocks back (docs/design.md, "Failure semantics").

    def undo_fork(self, child_ids: Sequence[int]) -> None:
        """Forget children that ``fork`` added in this step, as ``remove(child_ids)`` would
        (their shared blocks lose the owner the fork gave them), checking nothing."""
        rows = np.array([self._rows.row(seq_id) for seq_id in child_ids], dtype=np.intp)
        self._remove_rows(rows, child_ids)

    def undo_growth(self, seq_ids: Sequence[int], token_counts: Sequence[int]) -> None:
        """Give back what ``grow`` added to each sequence in this step, as ``truncate(seq_ids,
        token_counts)`` would (each count at most the sequence's), checking nothing."""
        rows = np.array([self._rows.row(seq_id) for seq_id in seq_ids], dtype=np.intp)
        self._truncate_rows(rows, seq_ids, np.array(token_counts, dtype=np.int64))

    # ----------------------------------------------------------------- internals

    def _plan(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds, preempt: bool
    ) -> tuple[SeqBatch, Plan | None]:
        """Check a growth and plan it (:func:`~pagedkv.impl.blocks.growth.plan`)."""
        batch = self.resolve(seqs)
        step = check_counts("new_tokens", new_tokens, len(batch))
        rows, base = batch.rows, batch.base
        return batch, plan(self._rows, self._pool, batch.seq_ids, rows, base, step, preempt)

    def _apply(self, batch: SeqBatch, decided: Plan) -> None:
        """Carry a plan out (:func:`~pagedkv.impl.blocks.growth.apply`)."""

        def remove(indices: list[int]) -> None:
            chosen = batch.rows[np.array(indices, dtype=np.intp)]
            self._remove_rows(chosen, [batch.seq_ids[i] for i in indices])

        apply(decided, self._rows, self._pool, self._take_fresh, remove)

    def _truncate_rows(
        self, rows: NDArray[np.intp], seq_ids: Sequence[int], counts: NDArray[np.int64]
    ) -> None:
        """``truncate`` the sequences ``seq_ids`` held in ``rows`` to ``counts`` tokens."""
        if self._prefix is None:
            self._rows.truncate(rows, counts, self._pool)
        else:
            self._prefix.truncate(self._rows, rows, seq_ids, counts)

    def _remove_rows(self, rows: NDArray[np.intp], seq_ids: Sequence[int]) -> None:
        """``remove`` the sequences ``seq_ids`` held in ``rows``, in order."""
        self._rows.release(rows, seq_ids, self._pool)
        if self._prefix is not None:
            self._prefix.forget(seq_ids)


def _read_only(array: NDArray[np.generic]) -> NDArray[np.generic]:
    view = array.view()
    view.flags.writeable = False
    return view
