"""The sequence lifecycle: every live sequence's block table, driven a scheduler step at a time.

:class:`BlockTableStore` owns the tables of sequences keyed by caller-chosen int ids and drives a
block manager's pool with whole batches. Each batch operation is equivalent to calling the spec
once per sequence, in batch order, and costs a fixed number of numpy calls; results are numpy
arrays (``torch.from_numpy`` shares them without a copy). It is composed of small parts:
:mod:`~pagedkv.impl.blocks.tables` (the padded rows and slot mapping),
:mod:`~pagedkv.impl.blocks.batches` (ids to rows), :mod:`~pagedkv.impl.blocks.admission` (a
new sequence's first blocks), :mod:`~pagedkv.impl.blocks.growth` (who grows, copies or is
preempted, carried out in the spec's order) and :mod:`~pagedkv.impl.blocks.block_hashes` (each
sequence's block keys); :mod:`~pagedkv.impl.blocks.page_tables` lays the tables out as kernels
read them. It drives the unchecked :mod:`~pagedkv.impl.blocks.pool` under the contract written
there: it validates every argument before it changes anything, so a call that raises changes
nothing.

Errors: ``TypeError`` for an argument of the wrong type; ``KeyError`` for an unknown sequence
id; ``ValueError`` for a repeated id in one batch, an id that is already live, or a count out of
range; :class:`~pagedkv.impl.blocks.tables.CapacityError` when the store's shape cannot hold the
request; ``BlockTableError`` for a write into, or a slot of, a released entry;
``OutOfBlocksError`` when the pool is exhausted.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import replace

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.admission import Admission
from pagedkv.impl.blocks.batches import SeqBatch, SeqIds, SeqIndex, check_counts
from pagedkv.impl.blocks.block_hashes import BlockHashes
from pagedkv.impl.blocks.growth import Growth, Plan, carry_out, decide
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import (
    KVEvent,
    PrefixCacheStats,
    PrefixCachingBlockManager,
)
from pagedkv.impl.blocks.tables import BlockTables, CapacityError
from pagedkv.spec.checks import (
    INT32_MAX,
    check_int,
    check_window,
    int32_window,
)

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
        self.manager = manager
        self._pool = manager.pool
        self._prefix = manager if isinstance(manager, PrefixCachingBlockManager) else None
        self.block_size = manager.block_size
        self._width = max_blocks_per_seq
        if max_blocks_per_seq * self.block_size > INT32_MAX:
            raise ValueError("max_blocks_per_seq * block_size must fit int32 token counts")
        if manager.total_blocks * self.block_size > INT32_MAX:
            raise ValueError("total_blocks * block_size must fit int32 slot ids")
        self._rows = BlockTables(max_seqs, max_blocks_per_seq, self.block_size)
        self._seqs = SeqIndex(max_blocks_per_seq)
        self._hashes = BlockHashes(self.block_size)  # with prefix caching: block keys
        self._admission = Admission(self._pool, self._prefix, self._rows, self._seqs, self._hashes)

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
        return tuple(self._seqs)

    def __len__(self) -> int:
        return len(self._seqs)

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    def row(self, seq_id: int) -> int:
        """The row of ``tables`` that holds ``seq_id``."""
        return self._seqs.row(seq_id)

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
        return None if self._prefix is None else replace(self._prefix.stats)

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters since the last call, which start again at zero
        (``manager.take_stats``), or None with a plain manager."""
        return None if self._prefix is None else self._prefix.take_stats()

    @property
    def usage(self) -> float:
        """The fraction of the pool held by live sequences (``manager.usage``)."""
        return self.manager.usage

    def take_kv_events(self) -> list[KVEvent]:
        """The prefix cache's KV events since the last call, oldest first
        (``manager.take_events``); empty with a plain manager or with events off."""
        return [] if self._prefix is None else self._prefix.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key if no block is held (``manager.reset_prefix_cache``); return
        whether it did. With a plain manager nothing is cached: True."""
        return True if self._prefix is None else self._prefix.reset_prefix_cache()

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Free blocks ``add_prompt(seq_id, token_ids, extra_key)`` would take now.

        With prefix caching: fresh blocks plus the cached free blocks it would revive (the
        manager's ``blocks_to_allocate``); otherwise ``ceil(len(token_ids) / block_size)``.
        ``TypeError``/``ValueError`` for token ids that are not a list or tuple of ints >= 0.
        """
        return self._admission.blocks_to_allocate(token_ids, extra_key)

    # ----------------------------------------------------------------- sequence lifecycle

    def add(self, seq_id: int, prompt_len: int) -> None:
        """Add a sequence of ``prompt_len`` tokens: ``manager.allocate(ceil(prompt_len / bs))``.

        Raises ``ValueError`` if ``seq_id`` is live, ``CapacityError`` if no row is free or the
        prompt needs more than ``max_blocks_per_seq`` blocks, ``OutOfBlocksError`` if the pool
        has too few free blocks.
        """
        self._admission.add(seq_id, prompt_len)

    def add_prompt(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Add a sequence holding the prompt ``token_ids``; return how many of its tokens are
        cached, i.e. whose K/V the caller must not compute.

        With a prefix-caching manager this is ``manager.allocate_prompt(token_ids, extra_key)``:
        the cached prefix's blocks are shared (free ones revived), the rest taken from the free
        queue. The count is a multiple of ``block_size`` and less than ``len(token_ids)`` (0 for
        an empty prompt); ``slot_mapping([seq_id], len(token_ids) - cached)`` maps the tokens to
        compute. With a plain manager it is ``add(seq_id, len(token_ids))`` and returns 0.

        Raises, changing nothing: ``TypeError`` for a bad ``seq_id`` or token ids,
        ``ValueError`` if ``seq_id`` is live or a token id is negative, ``CapacityError`` if no
        row is free or the prompt needs more than ``max_blocks_per_seq`` blocks,
        ``OutOfBlocksError`` if ``blocks_to_allocate`` exceeds the free blocks.
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
        blocks free and a row is free; otherwise None, changing nothing. Plans the prompt once.

        A refused prompt's block keys are kept for the next call with equal tokens and the
        same ``extra_key`` (a waiting request retried every step), which then skips hashing.
        Raises what ``add_prompt`` raises for bad arguments (``CapacityError`` only for a
        prompt longer than a table).
        """
        return self._admission.admit(seq_id, token_ids, headroom, extra_key)

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Register ``seq_id``'s full blocks, whose K/V now holds ``token_ids``; return how many
        were newly cached (0 with a plain manager, which caches nothing).

        ``token_ids`` is the sequence's whole token list whose K/V is written (prompt plus
        generated tokens), at most ``token_count(seq_id)`` long: ``manager.cache_blocks(
        table(seq_id), token_ids, extra_key)``, made incremental by
        :mod:`~pagedkv.impl.blocks.block_hashes`. Released entries are skipped; the keys after
        them still chain over the whole prefix. Raises, changing nothing: ``KeyError`` for an
        unknown sequence, ``TypeError``/``ValueError`` for bad token ids, ``ValueError`` for
        more tokens than the sequence holds, ``BlockTableError`` if one of its blocks is cached
        with other tokens.
        """
        row, rows = self.row(seq_id), self._rows
        count, released = int(rows.token_counts[row]), int(rows.num_released[row])
        return self._hashes.cache_blocks(
            self._prefix, seq_id, token_ids, extra_key, rows.tables[row], count, released
        )

    def fork(self, parent_id: int, child_id: int) -> None:
        """Add ``child_id`` sharing ``parent_id``'s blocks and token count: ``manager.fork``
        (its released entries are copied; only held blocks gain an owner)."""
        parent_row = self.row(parent_id)
        child_id = self._seqs.check_new(child_id)
        if not self._rows.free_rows:
            raise CapacityError(f"all {self.max_seqs} rows hold live sequences")
        self._pool.share(self._rows.held(parent_row).astype(np.intp))  # held entries only
        row = self._rows.copy_row(parent_row)
        self._seqs.add(child_id, row)
        self._hashes.fork(parent_id, child_id)
        if self._rows.token_counts[row] % self.block_size:  # a write into the partly filled
            self._rows.flag_tail_shared(np.array([parent_row, row]))  # last block may copy it

    def remove(self, seqs: SeqBatch | SeqIds) -> None:
        """Free the sequences' tables and forget them: ``manager.free`` per sequence, in order.

        Blocks that reach ``ref_count == 0`` join the free queue's tail in the order those
        calls would put them there (each table's last block first); released entries hold
        nothing and are skipped.
        """
        batch = self.resolve(seqs)
        self._remove_rows(batch.rows, batch.seq_ids)

    def truncate(self, seqs: SeqBatch | SeqIds, token_counts: int | SeqIds) -> None:
        """Roll sequences back to fewer tokens (one count for all, or one per sequence):
        ``table = manager.truncate(table, count)`` per sequence, in batch order.

        The rollback of a speculative step, which grew each sequence by its last token and
        ``k`` drafts (``grow``) and keeps ``1 + j`` of them. Dropped blocks are released in the
        spec's order; with prefix caching a cut cached block held alone loses its key, and the
        sequence's own block keys are cut to its kept full blocks. Raises, changing nothing:
        what :meth:`resolve` raises for bad ids, ``TypeError`` for a count that is not an int,
        ``ValueError`` for a count below 0 or above the sequence's token count (a truncate
        never grows).
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
        """Sliding window: give back each sequence's leading blocks that no query from its
        next position on reads: ``table = manager.release_outside_window(table, count,
        window)`` per sequence, in batch order.

        ``count`` is the sequence's token count, or its entry of ``token_counts`` (one int for
        all, or one per sequence): the position of its next query. The first
        ``blocks_outside_window(count, window, block_size)`` entries of each table become
        released (``PAD`` in :attr:`tables`, None in :meth:`table`), their blocks freed in the
        spec's order (a cached one stays cached, revivable); tables keep their length. Raises,
        changing nothing: what :meth:`resolve` raises for bad ids, ``TypeError`` for a window
        or count that is not an int, ``ValueError`` for a window below 1, a count below 0 or
        above the sequence's table capacity (``num_blocks * block_size``). A window above
        ``INT32_MAX`` is wider than any count the store holds and releases nothing
        (``int32_window``: no window).
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = (
            None if token_counts is None else check_counts("token_counts", token_counts, rows.size)
        )
        width = int32_window(check_window(window))  # None: wider than any count the store holds
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
        # The spec's blocks_outside_window(count, window, block_size), for the whole batch.
        outside = np.maximum(counts - (window - 1), 0) // self.block_size
        self._rows.release_leading(rows, batch.base, outside, self._pool)

    # ----------------------------------------------------------------- a scheduler step

    def batch(self, seq_ids: SeqIds) -> SeqBatch:
        """Resolve distinct live sequence ids, in order, to a :class:`SeqBatch`."""
        return self._seqs.batch(seq_ids)

    def grow(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds = 1, *, atomic: bool = False
    ) -> list[int]:
        """Append ``new_tokens`` tokens (one int for all, or one per sequence) to each sequence.

        Equivalent to, for each sequence in batch order, ``table = manager.append_slot(table,
        count + k, new_tokens=k)`` with ``OutOfBlocksError`` caught: a sequence either grows
        fully (including copy-on-write of a shared last block, taken before its growth blocks)
        or is left unchanged. Returns the ids that could not grow, in batch order; later
        sequences still try. With ``atomic=True`` the batch grows as a whole or not at all: if
        some sequence could not grow, nothing changes and those ids are returned. Raises
        (changing nothing) ``CapacityError`` if any sequence would need more than
        ``max_blocks_per_seq`` blocks, ``BlockTableError`` if one would write into a released
        entry (its token count lies in a block a sliding window released). Copy-on-write pairs
        go to :meth:`pop_copy_pairs`.
        """
        batch, decided = self._plan(seqs, new_tokens, preempt=False)
        if decided is None:
            return []
        g, decided = decided
        failed = [batch.seq_ids[i] for i in (~decided.grown).nonzero()[0].tolist()]
        if atomic and failed:
            return failed
        self._carry_out(batch, g, decided)
        return failed

    def grow_or_preempt(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds = 1
    ) -> list[int]:
        """Grow every sequence, preempting from the batch's tail when the pool runs short.

        Equivalent to, for each sequence in batch order: while it cannot grow by its
        ``new_tokens`` (``append_slot`` raising ``OutOfBlocksError``), ``remove`` the batch's
        last remaining sequence (preemption by recompute: its blocks are freed, last block
        first), stopping once the sequence fits or was itself removed. Returns the removed ids,
        in removal order (the batch's tail, last first); every other sequence grew.
        ``CapacityError`` (changing nothing) as :meth:`grow`.
        """
        batch, decided = self._plan(seqs, new_tokens, preempt=True)
        if decided is None:
            return []
        g, decided = decided
        self._carry_out(batch, g, decided)
        return [batch.seq_ids[i] for i in decided.victims]

    def slot_mapping(
        self,
        seqs: SeqBatch | SeqIds | None = None,
        num_tokens: int | SeqIds = 1,
        pad_to: int | None = None,
    ) -> NDArray[np.int32]:
        """Physical slots of each sequence's last ``num_tokens`` positions, as a new int32 array.

        For sequence ``i`` in batch order, positions ``count - k .. count - 1`` map to
        ``translate_slot(table, pos)``; the sequences' runs are concatenated. After
        ``grow(seqs, k)`` this is the step's new tokens (``k = 1``: decode); after
        ``add(seq, n)``, ``num_tokens=n`` maps every prompt position (prefill). With ``pad_to``
        the result is padded with ``PAD`` (-1) to that length. ``ValueError`` if some ``k``
        exceeds its sequence's count or the slots exceed ``pad_to``, ``BlockTableError`` if a
        position lies in a released entry.
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
        return self._seqs.resolve(seqs)

    # ----------------------------------------------------------------- in-step undo

    # A caller's undo of its own calls earlier in the same step, made when a later call of
    # that step failed. Unchecked, so they cannot fail: beyond looking their ids up they check
    # nothing (the caller passes ids and counts that those calls made valid), and they take
    # no block, only give blocks back (docs/design.md, "Failure semantics").

    def undo_fork(self, child_ids: Sequence[int]) -> None:
        """Forget children that ``fork`` added in this step, as ``remove(child_ids)`` would
        (their shared blocks lose the owner the fork gave them), checking nothing."""
        rows = np.array([self._seqs.row(seq_id) for seq_id in child_ids], dtype=np.intp)
        self._remove_rows(rows, child_ids)

    def undo_growth(self, seq_ids: Sequence[int], token_counts: Sequence[int]) -> None:
        """Give back what ``grow`` added to each sequence in this step, as ``truncate(seq_ids,
        token_counts)`` would (each count at most the sequence's), checking nothing."""
        rows = np.array([self._seqs.row(seq_id) for seq_id in seq_ids], dtype=np.intp)
        self._truncate_rows(rows, seq_ids, np.array(token_counts, dtype=np.int64))

    # ----------------------------------------------------------------- internals

    def _plan(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds, preempt: bool
    ) -> tuple[SeqBatch, tuple[Growth, Plan] | None]:
        """Check a growth and decide it (:func:`~pagedkv.impl.blocks.growth.decide`)."""
        batch = self.resolve(seqs)
        step = check_counts("new_tokens", new_tokens, len(batch))
        rows, base = batch.rows, batch.base
        return batch, decide(self._rows, self._pool, batch.seq_ids, rows, base, step, preempt)

    def _carry_out(self, batch: SeqBatch, g: Growth, decided: Plan) -> None:
        """Apply a plan (:func:`~pagedkv.impl.blocks.growth.carry_out`)."""

        def remove(indices: list[int]) -> None:
            chosen = np.array(indices, dtype=np.intp)
            self._remove_rows(g.rows[chosen], [batch.seq_ids[i] for i in indices])

        carry_out(self._rows, self._pool, self._prefix, g, decided, remove)

    def _truncate_rows(
        self, rows: NDArray[np.intp], seq_ids: Sequence[int], counts: NDArray[np.int64]
    ) -> None:
        """``truncate`` the sequences ``seq_ids`` held in ``rows`` to ``counts`` tokens."""
        self._rows.truncate(rows, counts, self._pool, self._prefix)
        for index, count in enumerate(counts.tolist()):
            self._hashes.cut(seq_ids[index], count)

    def _remove_rows(self, rows: NDArray[np.intp], seq_ids: Sequence[int]) -> None:
        """``remove`` the sequences ``seq_ids`` held in ``rows``, in order."""
        self._rows.release(rows, self._pool)
        self._seqs.remove(seq_ids)
        for seq_id in seq_ids:
            self._hashes.forget(seq_id)


def _read_only(array: NDArray[np.generic]) -> NDArray[np.generic]:
    view = array.view()
    view.flags.writeable = False
    return view
