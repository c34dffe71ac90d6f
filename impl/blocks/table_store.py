"""Every live sequence's block table in one padded int32 array, driven a scheduler step at a time.

:class:`BlockTableStore` owns the tables of sequences keyed by caller-chosen int ids and drives a
:class:`pagedkv.impl.blocks.manager.BlockManager` with whole batches: grow every running sequence by
its new tokens and compute the step's ``slot_mapping``. Each batch operation is equivalent to
calling the spec once per sequence, in batch order, and costs a fixed number of numpy calls.
Results are numpy arrays (``torch.from_numpy`` shares them without a copy);
:mod:`pagedkv.impl.blocks.page_tables` lays the tables out as attention kernels read them, and
:mod:`pagedkv.impl.blocks.growth` decides, sequence by sequence, a batch the pool cannot serve
whole. The store drives its manager through the manager's trusted API, under the contract
written there: it validates every argument before it calls it.

State, for ``S = max_seqs`` rows and ``M = max_blocks_per_seq`` columns:

* ``tables`` (``int32[S, M]``): row ``r`` holds its sequence's table in columns
  ``0 .. num_blocks[r] - 1``: first ``num_released[r]`` released entries (``PAD``: blocks a
  sliding window gave back, the spec's ``None``), then its block ids; every other entry, and
  every entry of a row with no sequence, is ``-1``.
* ``num_blocks``, ``num_released``, ``token_counts`` (``int32[S]``): a live row's table is
  exactly ``ceil(token_counts[r] / block_size)`` entries long (the store never over-allocates),
  of which ``num_blocks[r] - num_released[r]`` hold a block.
* a dict from sequence id to row; rows of removed sequences are reused.

With a :class:`pagedkv.impl.blocks.prefix_cache.PrefixCachingBlockManager`, ``add_prompt`` reuses a
prompt's cached prefix and ``cache_blocks`` registers a sequence's full blocks once their K/V is
written; with a plain manager ``add_prompt`` is ``add`` and ``cache_blocks`` does nothing.

Errors: ``TypeError`` for an argument of the wrong type; ``KeyError`` for an unknown sequence
id; ``ValueError`` for a repeated id in one batch, an id that is already live, or a count out of
range; :class:`CapacityError` when the store's shape cannot hold the request;
``spec.block_manager.BlockTableError`` for a write into, or a slot of, a released entry;
``spec.block_manager.OutOfBlocksError`` when the pool is exhausted. Every call validates all of
its input before it changes anything, so a call that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.growth import has_repeats, plan_in_order, plan_preemption
from pagedkv.impl.blocks.manager import BlockManager, BlockTableError, IdArray, OutOfBlocksError
from pagedkv.impl.blocks.prefix_cache import (
    BlockKey,
    KVEvent,
    PrefixCacheStats,
    PrefixCachingBlockManager,
    PromptPlan,
    check_tokens,
)
from pagedkv.spec.block_manager import blocks_needed, check_int

__all__ = ["PAD", "BlockTableStore", "CapacityError", "SeqBatch"]

PAD = -1
"""The table entry, and the ``slot_mapping`` entry, that stands for "no block" / "no token"."""

INT32_MAX = 2**31 - 1

SeqIds = Sequence[int] | NDArray[np.integer]


class CapacityError(ValueError):
    """The store's fixed shape cannot hold the request: no free row, or a table that would need
    more than ``max_blocks_per_seq`` blocks."""


@dataclass(frozen=True, eq=False, slots=True)
class SeqBatch:
    """An ordered batch of distinct live sequence ids, resolved to their rows.

    Made by :meth:`BlockTableStore.batch`. Resolving ids costs a dict lookup per sequence; a
    batch pays it once for all the operations of a step, or of many steps. Rows change only when
    a sequence is removed, so a batch made before the last ``remove`` is re-resolved from its
    ids when used (``KeyError`` if one of them is gone).
    """

    seq_ids: tuple[int, ...]
    rows: NDArray[np.intp]
    _base: NDArray[np.intp] = field(repr=False)  # rows * max_blocks_per_seq: flat row offsets
    _store: BlockTableStore = field(repr=False)
    _epoch: int = field(repr=False)

    def __len__(self) -> int:
        return len(self.seq_ids)


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

    def __init__(self, manager: BlockManager, max_seqs: int, max_blocks_per_seq: int) -> None:
        if not isinstance(manager, BlockManager):
            raise TypeError(f"manager must be an impl BlockManager, got {type(manager).__name__}")
        check_int("max_seqs", max_seqs, 1)
        check_int("max_blocks_per_seq", max_blocks_per_seq, 1)
        self.manager = manager
        self._prefix = manager if isinstance(manager, PrefixCachingBlockManager) else None
        self.block_size = manager.block_size
        self._width = max_blocks_per_seq
        if max_blocks_per_seq * self.block_size > INT32_MAX:
            raise ValueError("max_blocks_per_seq * block_size must fit int32 token counts")
        if manager.total_blocks * self.block_size > INT32_MAX:
            raise ValueError("total_blocks * block_size must fit int32 slot ids")
        self._tables = np.full((max_seqs, max_blocks_per_seq), PAD, dtype=np.int32)
        self._num_blocks = np.zeros(max_seqs, dtype=np.int32)
        self._num_released = np.zeros(max_seqs, dtype=np.int32)  # leading PAD entries per row
        self._token_counts = np.zeros(max_seqs, dtype=np.int32)
        self._row_of: dict[int, int] = {}
        self._free_rows = list(range(max_seqs - 1, -1, -1))  # pop() yields the lowest row
        self._epoch = 0  # bumped by every remove: batches made before it must re-resolve
        # Rows whose partly filled last block a fork shared, or a truncate cut into: the only
        # ways a write can reach a block with other owners or a key (prefix-cache hits are
        # full blocks, and never a table's last one). Conservative: a flag outlives the sharing
        # until the row's next growth.
        self._tail_shared = np.zeros(max_seqs, dtype=np.bool_)
        self._num_tail_shared = 0
        self._live: SeqBatch | None = None  # every live sequence in the order added, cached
        # With prefix caching: each live sequence's block keys, extended as its blocks fill,
        # and the keys of the last prompt admit() refused.
        self._keys: dict[int, _SeqKeys] = {}
        self._refused: tuple[int, list[int], Hashable, tuple[BlockKey, ...]] = _NOT_REFUSED

    # ----------------------------------------------------------------- introspection

    @property
    def max_seqs(self) -> int:
        return self._tables.shape[0]

    @property
    def max_blocks_per_seq(self) -> int:
        return self._tables.shape[1]

    @property
    def total_blocks(self) -> int:
        """Blocks in the manager's pool."""
        return self.manager.total_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the manager's free queue (with prefix caching, cached free ones too)."""
        return self.manager.num_free_blocks

    @property
    def tables(self) -> NDArray[np.int32]:
        """Read-only view of the ``int32[max_seqs, max_blocks_per_seq]`` table array."""
        return _read_only(self._tables)

    @property
    def num_blocks(self) -> NDArray[np.int32]:
        """Read-only view of each row's table length."""
        return _read_only(self._num_blocks)

    @property
    def num_released(self) -> NDArray[np.int32]:
        """Read-only view of each row's released leading entries (a sliding window's; the
        row holds ``num_blocks - num_released`` blocks)."""
        return _read_only(self._num_released)

    @property
    def token_counts(self) -> NDArray[np.int32]:
        """Read-only view of each row's token count."""
        return _read_only(self._token_counts)

    @property
    def seq_ids(self) -> tuple[int, ...]:
        """The live sequence ids, in the order they were added."""
        return tuple(self._row_of)

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: object) -> bool:
        return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id in self._row_of

    def row(self, seq_id: int) -> int:
        """The row of ``tables`` that holds ``seq_id``."""
        return self._row_of[self._check_live(seq_id)]

    def table(self, seq_id: int) -> list[int | None]:
        """``seq_id``'s block table, as the spec would hold it: released entries are None."""
        row = self.row(seq_id)
        released = int(self._num_released[row])
        return [None] * released + self._tables[row, released : self._num_blocks[row]].tolist()

    def token_counts_of(self, seqs: SeqBatch | SeqIds | None) -> list[int]:
        """The token counts of ``seqs`` (see :meth:`resolve`), in batch order."""
        return self._token_counts.take(self.resolve(seqs).rows).tolist()

    def token_count(self, seq_id: int) -> int:
        """How many tokens ``seq_id`` holds."""
        return int(self._token_counts[self.row(seq_id)])

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
        if self._prefix is not None:
            return self._prefix.blocks_to_allocate(token_ids, extra_key)
        return blocks_needed(len(check_tokens(token_ids)), self.block_size)

    # ----------------------------------------------------------------- sequence lifecycle

    def add(self, seq_id: int, prompt_len: int) -> None:
        """Add a sequence of ``prompt_len`` tokens: ``manager.allocate(ceil(prompt_len / bs))``.

        Raises ``ValueError`` if ``seq_id`` is live, ``CapacityError`` if no row is free or the
        prompt needs more than ``max_blocks_per_seq`` blocks, ``OutOfBlocksError`` if the pool
        has too few free blocks.
        """
        seq_id = self._check_new(seq_id)
        check_int("prompt_len", prompt_len, 0)
        needed = blocks_needed(prompt_len, self.block_size)
        self._check_room(seq_id, needed, needed)
        self._place(seq_id, self.manager.take_blocks(needed), prompt_len)

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
        seq_id = self._check_new(seq_id)
        if self._prefix is None:
            self.add(seq_id, len(check_tokens(token_ids)))
            return 0
        plan = self._prefix.plan_prompt(token_ids, extra_key)
        self._check_room(seq_id, plan.num_blocks, plan.needed)
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def admit(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        headroom: int = 0,
        extra_key: Hashable = None,
    ) -> int | None:
        """``add_prompt(seq_id, token_ids, extra_key)`` if it leaves at least ``headroom``
        blocks free and a row is free; otherwise None, changing nothing. Plans the prompt once.

        A refused prompt's block keys are kept for the next call with the same ``seq_id``,
        equal tokens and the same ``extra_key`` (a waiting request retried every step), which
        then skips hashing. Raises what ``add_prompt`` raises for bad arguments
        (``CapacityError`` only for a prompt longer than a table).
        """
        seq_id = self._check_new(seq_id)
        check_int("headroom", headroom, 0)
        if self._prefix is None:
            needed = blocks_needed(len(check_tokens(token_ids)), self.block_size)
            self._check_fits(needed, seq_id)
            if not self._free_rows or self.manager.num_free_blocks - needed < headroom:
                return None
            self._place(seq_id, self.manager.take_blocks(needed), len(token_ids))
            return 0
        refused_id, refused_tokens, refused_extra, refused_keys = self._refused
        same = (
            refused_id == seq_id
            and refused_extra is extra_key
            and list(token_ids) == refused_tokens  # one C-level compare
        )
        plan = self._prefix.plan_prompt(token_ids, extra_key, refused_keys if same else None)
        self._check_fits(plan.num_blocks, seq_id)
        if not self._free_rows or self.manager.num_free_blocks - plan.needed < headroom:
            self._refused = (seq_id, list(token_ids), extra_key, plan.keys)
            return None
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Register ``seq_id``'s full blocks, whose K/V now holds ``token_ids``; return how many
        were newly cached (0 with a plain manager, which caches nothing).

        ``token_ids`` is the sequence's whole token list whose K/V is written (prompt plus
        generated tokens), at most ``token_count(seq_id)`` long. Call it after the prefill and
        whenever decode fills a block: ``manager.cache_blocks(table(seq_id), token_ids,
        extra_key)``. Raises, changing nothing: ``KeyError`` for an unknown sequence,
        ``TypeError``/``ValueError`` for bad token ids, ``ValueError`` for more tokens than the
        sequence holds, ``BlockTableError`` if one of its blocks is cached with other tokens.

        Released entries (a sliding window's) are skipped; the keys after them still chain over
        the whole prefix. Incremental: the store keeps each sequence's block keys, so a call
        whose tokens extend the previous call's (checked by one list comparison) hashes and
        registers only the blocks filled since, plus any earlier block left uncached because
        its content was cached elsewhere. Any other call starts over, exactly as the spec walks
        every block.
        """
        row = self.row(seq_id)
        if not isinstance(token_ids, (list, tuple)):
            check_tokens(token_ids)  # the TypeError
        state = self._keys.get(seq_id)
        if state is None or state.extra is not extra_key or not state.extends(token_ids):
            state = _SeqKeys(extra_key)  # start over: every block is hashed and checked
        check_tokens(token_ids[len(state.tokens) :])  # the keyed tokens were checked before
        count = int(self._token_counts[row])
        if len(token_ids) > count:
            raise ValueError(f"{len(token_ids)} tokens, but sequence {seq_id} holds {count}")
        if self._prefix is None:
            return 0
        bs = self.block_size
        new_keys = self._prefix.extend_block_keys(state.keys, token_ids, extra_key)
        full = len(token_ids) // bs
        keys = state.keys + new_keys if new_keys else state.keys
        held = int(self._num_released[row])  # released entries lead and hold nothing: skipped
        # Ascending and below full: retry holds keyed blocks (below done), and a call that
        # extends the keyed tokens has full >= len(state.keys) >= done.
        indices = [i for i in state.retry if i >= held]
        indices += range(max(state.done, held), full)
        blocks = self._tables[row].take(indices).tolist()
        newly_cached, skipped = self._prefix.register_table_blocks(
            blocks, [keys[i] for i in indices]
        )
        # Registered: record what the keys now cover (in place: O(new blocks)).
        state.tokens.extend(token_ids[len(state.tokens) : len(keys) * bs])
        state.keys = keys
        state.retry = [indices[i] for i in skipped]  # ascending, as indices are
        state.done = full
        self._keys[seq_id] = state
        return newly_cached

    def fork(self, parent_id: int, child_id: int) -> None:
        """Add ``child_id`` sharing ``parent_id``'s blocks and token count: ``manager.fork``
        (its released entries are copied; only held blocks gain an owner)."""
        parent_row = self.row(parent_id)
        child_id = self._check_new(child_id)
        if not self._free_rows:
            raise CapacityError(f"all {self.max_seqs} rows hold live sequences")
        row = self._free_rows.pop()
        length, released = self._num_blocks[parent_row], self._num_released[parent_row]
        blocks = self._tables[parent_row, :length]
        self.manager.share_blocks(blocks[released:].astype(np.intp))  # the held entries only
        self._tables[row, :length] = blocks  # released entries copied as PAD
        self._num_blocks[row] = length
        self._num_released[row] = released
        count = self._token_counts[parent_row]
        self._token_counts[row] = count
        self._row_of[child_id] = row
        self._live = None
        if parent_id in self._keys:
            self._keys[child_id] = self._keys[parent_id].copy()
        if count % self.block_size:  # the last block is partly filled: a write may copy it
            self._flag_tail_shared(np.array([parent_row, row]))

    def remove(self, seqs: SeqBatch | SeqIds) -> None:
        """Free the sequences' tables and forget them: ``manager.free`` per sequence, in order.

        Blocks that reach ``ref_count == 0`` join the free queue's tail in the order those
        calls would put them there (each table's last block first); released entries hold
        nothing and are skipped.
        """
        batch = self.resolve(seqs)
        self._release_rows(batch.rows, batch.seq_ids)

    def truncate(self, seqs: SeqBatch | SeqIds, token_counts: int | SeqIds) -> None:
        """Roll sequences back to fewer tokens (one count for all, or one per sequence):
        ``table = manager.truncate(table, count)`` per sequence, in batch order.

        The rollback of a speculative step, which grew each sequence by its last token and
        ``k`` drafts (``grow``) and keeps ``1 + j`` of them. A row keeps ``ceil(count /
        block_size)`` blocks; each dropped block loses this sequence's hold, and those reaching
        0 join the free queue's tail in the order those calls would put them there (each
        table's last block first). With prefix caching, a kept last block cut into that is
        cached and held by this sequence alone loses its key, as in the spec, and the
        sequence's own block keys are cut to its kept full blocks. A kept last block cut into
        that stays shared or cached is copied, or loses its key, at the next write into it.

        Raises, changing nothing: what :meth:`resolve` raises for bad ids, ``TypeError`` for a
        count that is not an int, ``ValueError`` for a count below 0 or above the sequence's
        token count (the store holds no slot past its tokens, so a truncate never grows).
        Released entries hold nothing: dropping one releases nothing.
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = self._token_array("token_counts", token_counts, rows.size)
        counts = np.broadcast_to(np.asarray(step, dtype=np.int64), rows.shape)
        held = self._token_counts.take(rows)
        if (counts > held).any():
            over = [s for s, c, h in zip(batch.seq_ids, counts, held, strict=True) if c > h]
            raise ValueError(f"token_counts exceed the token counts of sequences {over}")
        bs = self.block_size
        kept = (counts + (bs - 1)) // bs
        cut = (counts % bs != 0).nonzero()[0]  # batch indices whose kept last block is partial
        last = self._tables[rows[cut], kept[cut] - 1].astype(np.intp)  # those blocks
        if self._prefix is not None and self._prefix.cached_among(last):
            # The key rule reads a cut block's count between the releases: one at a time.
            cut_block = {  # a released kept last block holds nothing: no key to remove
                i: block
                for i, block in zip(cut.tolist(), last.tolist(), strict=True)
                if block != PAD
            }
            for i in range(rows.size):
                self._cut_rows(rows[i : i + 1], kept[i : i + 1], counts[i : i + 1])
                block = cut_block.get(i)
                if block is not None and self.manager.ref_counts_of(np.array([block]))[0] == 1:
                    self._prefix.remove_keys([block])
        else:
            self._cut_rows(rows, kept, counts)
        for seq_id, count in zip(batch.seq_ids, counts.tolist(), strict=True):
            state = self._keys.get(seq_id)
            if state is not None and len(state.tokens) > count:
                state.cut(count // bs, bs)
        # The next write into a partly kept last block takes grow's general path, which copies
        # it if it is shared and removes its key if it is cached (conservative: every cut row).
        self._clear_tail_shared(rows)
        if cut.size:
            self._flag_tail_shared(rows[cut])

    def release_outside_window(
        self, seqs: SeqBatch | SeqIds | None, window: int, token_counts: int | SeqIds | None = None
    ) -> None:
        """Sliding window: give back each sequence's leading blocks that no query from its
        next position on reads: ``table = manager.release_outside_window(table, count,
        window)`` per sequence, in batch order.

        ``count`` is the sequence's token count, or its entry of ``token_counts`` (one int for
        all, or one per sequence): the position of its next query, which is less than its
        token count while a prompt is still being computed. The first
        ``blocks_outside_window(count, window, block_size)`` entries of each table become
        released (``PAD`` in :attr:`tables`, None in :meth:`table`); each block among them not
        yet released loses this sequence's hold, and those reaching 0 join the free queue's
        tail in the order those calls would put them there (each table's last released block
        first; with prefix caching a cached one stays cached there, revivable). Tables keep
        their length. Calling it again with the same or smaller counts releases nothing.

        Raises, changing nothing: what :meth:`resolve` raises for bad ids, ``TypeError`` for a
        window or count that is not an int, ``ValueError`` for a window below 1, a count below
        0 or above the sequence's table capacity (``num_blocks * block_size``).
        """
        batch = self.resolve(seqs)
        rows = batch.rows
        step = (
            None
            if token_counts is None
            else self._token_array("token_counts", token_counts, rows.size)
        )
        check_int("window", window, 1)
        lengths = self._num_blocks.take(rows)
        if step is None:
            counts = self._token_counts.take(rows).astype(np.int64)
        else:
            counts = np.broadcast_to(np.asarray(step, dtype=np.int64), rows.shape)
            over = counts > lengths.astype(np.int64) * self.block_size
            if over.any():
                ids = [s for s, o in zip(batch.seq_ids, over.tolist(), strict=True) if o]
                raise ValueError(f"token_counts exceed the table capacity of sequences {ids}")
        # The spec's blocks_outside_window(count, window, block_size), for the whole batch.
        outside = np.maximum(counts - (window - 1), 0) // self.block_size
        before = self._num_released.take(rows)
        newly = np.maximum(outside - before, 0)
        total = int(newly.sum())
        if not total:
            return
        flat = self._tables.reshape(-1)  # a view
        owner = np.repeat(np.arange(rows.size), newly)
        within = np.arange(total) - np.repeat(np.cumsum(newly) - newly, newly)
        entries = batch._base[owner] + outside[owner] - 1 - within  # each row's last one first
        self.manager.release_blocks_in_order(flat[entries].astype(np.intp))
        flat[entries] = PAD
        self._num_released[rows] = np.maximum(before, outside)
        # A count past the row's tokens can release its partly filled last block: the next
        # write there must take grow's general path, which refuses it.
        gone = (outside >= lengths) & (self._token_counts.take(rows) % self.block_size != 0)
        if gone.any():
            self._flag_tail_shared(rows[gone])

    # ----------------------------------------------------------------- a scheduler step

    def batch(self, seq_ids: SeqIds) -> SeqBatch:
        """Resolve distinct live sequence ids, in order, to a :class:`SeqBatch`."""
        if isinstance(seq_ids, np.ndarray):
            if seq_ids.ndim != 1 or seq_ids.dtype.kind not in "iu":
                raise TypeError(f"seq_ids must be a 1-D integer array, got {seq_ids.dtype}")
            seq_ids = seq_ids.tolist()
        elif not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids must be a list of ints, got {type(seq_ids).__name__}")
        if set(map(type, seq_ids)) != {int}:  # empty, or a bad id or an int subclass
            seq_ids = [_check_seq_id(seq_id) for seq_id in seq_ids]
        try:
            rows = np.fromiter(
                map(self._row_of.__getitem__, seq_ids), dtype=np.intp, count=len(seq_ids)
            )
        except KeyError as error:
            raise KeyError(f"unknown sequence id {error.args[0]}") from None
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeated within one batch: {_repeats(seq_ids)}")
        rows.flags.writeable = False
        return SeqBatch(tuple(seq_ids), rows, rows * self._width, self, self._epoch)

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
        batch, _, g = self._grow_at_once(seqs, new_tokens)
        if g is None:
            return []
        grown, shared = plan_in_order(
            g.growth, g.writes_last, g.last, g.last_refs, self.manager.num_free_blocks
        )
        failed = [s for s, ok in zip(batch.seq_ids, grown.tolist(), strict=True) if not ok]
        if atomic and failed:
            return failed
        keep = grown.nonzero()[0]
        self._apply_growth(g, keep, shared[keep])
        return failed

    def grow_or_preempt(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds = 1
    ) -> list[int]:
        """Grow every sequence, preempting from the batch's tail when the pool runs short.

        Equivalent to, for each sequence in batch order: while it cannot grow by its
        ``new_tokens`` (``append_slot`` raising ``OutOfBlocksError``), ``remove`` the batch's
        last remaining sequence (preemption by recompute: its blocks are freed, last block
        first), stopping once the sequence fits or was itself removed. Returns the removed ids,
        in removal order (the batch's tail, last first); every other sequence grew. With no
        shared last block to copy, the victims are planned from block counts and applied as one
        batched free and one batched grow; otherwise sequence by sequence. ``CapacityError``
        (changing nothing) as :meth:`grow`.
        """
        batch, step, g = self._grow_at_once(seqs, new_tokens)
        if g is None:
            return []
        free = self.manager.num_free_blocks
        if g.shared.any():  # a copy on write interleaves with the frees: replay in order
            return self._grow_or_preempt_in_order(batch, step)
        stop = self._plan_preemption(g, free)
        victims = np.arange(g.rows.size - 1, stop - 1, -1)
        self._release_rows(g.rows[victims], [batch.seq_ids[i] for i in victims.tolist()])
        keep = np.arange(stop)
        self._apply_growth(g, keep, g.shared[keep])
        return [batch.seq_ids[i] for i in victims.tolist()]

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
        step = self._token_array("num_tokens", num_tokens, rows.size)
        if pad_to is not None:
            check_int("pad_to", pad_to, 0)
        base = batch._base
        counts = self._token_counts.take(rows)
        if isinstance(step, int) and step == 1:  # decode: each sequence's last position
            if np.count_nonzero(counts) != counts.size:
                raise ValueError("num_tokens exceeds a sequence's token count")
            positions = counts - 1
        else:
            step = np.broadcast_to(step, rows.size)
            if (step > counts).any():
                raise ValueError("num_tokens exceeds a sequence's token count")
            ends = np.cumsum(step)
            base = np.repeat(base, step)
            positions = np.repeat(counts - ends, step) + np.arange(base.size)
        entries = self._tables.take(base + positions // self.block_size)
        if entries.size and entries.min() == PAD:  # the spec's translate_slot refuses these
            raise BlockTableError("a position to map lies in a released block")
        slots = entries * self.block_size + (positions % self.block_size)
        if pad_to is None:
            return slots.astype(np.int32, copy=False)
        if pad_to < slots.size:
            raise ValueError(f"{slots.size} slots do not fit pad_to={pad_to}")
        padded = np.full(pad_to, PAD, dtype=np.int32)
        padded[: slots.size] = slots
        return padded

    def pending_copy_pairs(self) -> NDArray[np.int32]:
        """The pending copy-on-write pairs, as :meth:`pop_copy_pairs` would return them, still
        pending: copy them, then pop them, and a failed copy loses nothing."""
        return self.manager.pending_copy_pairs_array()

    def pop_copy_pairs(self) -> NDArray[np.int32]:
        """The manager's pending copy-on-write pairs as an int32 ``[P, 2]`` array of
        ``(src, dst)`` rows, in order; forgets them (see ``BlockManager.pop_copy_pairs``)."""
        return self.manager.pop_copy_pairs_array()

    def resolve(self, seqs: SeqBatch | SeqIds | None) -> SeqBatch:
        """``seqs`` as a current :class:`SeqBatch`: ``None`` is every live sequence in the order
        added, ids are resolved with :meth:`batch`, and a batch made before the last ``remove``
        is re-resolved from its ids (``KeyError`` if one is gone)."""
        if seqs is None:
            if self._live is None:
                rows = np.fromiter(self._row_of.values(), dtype=np.intp, count=len(self._row_of))
                rows.flags.writeable = False
                ids = tuple(self._row_of)
                self._live = SeqBatch(ids, rows, rows * self._width, self, self._epoch)
            return self._live
        if isinstance(seqs, SeqBatch):
            if seqs._store is not self:
                raise ValueError("the batch belongs to another BlockTableStore")
            return seqs if seqs._epoch == self._epoch else self.batch(seqs.seq_ids)
        return self.batch(seqs)

    # ----------------------------------------------------------------- internals

    def _check_new(self, seq_id: object) -> int:
        seq_id = _check_seq_id(seq_id)
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id} is already live")
        return seq_id

    def _check_room(self, seq_id: int, num_blocks: int, free_blocks: int) -> None:
        """A new table of ``num_blocks`` blocks, ``free_blocks`` of them from the free queue."""
        self._check_fits(num_blocks, seq_id)
        if not self._free_rows:
            raise CapacityError(f"all {self.max_seqs} rows hold live sequences")
        if free_blocks > self.manager.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {free_blocks} blocks but only {self.manager.num_free_blocks} are free"
            )

    def _add_planned(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable, plan: PromptPlan
    ) -> int:
        """Carry out a prompt plan just made (room checked); return the cached tokens."""
        fresh = self._prefix.apply_prompt_plan(plan)  # type: ignore[union-attr]
        self._place(seq_id, np.concatenate((plan.hits, fresh)), len(token_ids))
        keyed = list(token_ids[: len(plan.keys) * self.block_size])
        self._keys[seq_id] = _SeqKeys(extra_key, list(plan.keys), tokens=keyed)
        self._refused = _NOT_REFUSED
        return plan.cached_tokens

    def _place(self, seq_id: int, blocks: IdArray, token_count: int) -> None:
        """Give ``seq_id`` a free row holding ``blocks`` and ``token_count`` tokens."""
        row = self._free_rows.pop()
        self._tables[row, : blocks.size] = blocks
        self._num_blocks[row] = blocks.size
        self._token_counts[row] = token_count
        self._row_of[seq_id] = row
        self._live = None

    def _check_live(self, seq_id: object) -> int:
        seq_id = _check_seq_id(seq_id)
        if seq_id not in self._row_of:
            raise KeyError(f"unknown sequence id {seq_id}")
        return seq_id

    def _check_fits(self, num_blocks: int, seq_id: int) -> None:
        if num_blocks > self.max_blocks_per_seq:
            raise CapacityError(
                f"sequence {seq_id} would need {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.max_blocks_per_seq}"
            )

    def _token_array(self, name: str, value: int | SeqIds, size: int) -> int | NDArray[np.int64]:
        """Validate a token count for all (an int) or one per sequence (returned as int64)."""
        if type(value) is int and 0 <= value <= INT32_MAX:
            return value
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind not in "iu":
                raise TypeError(f"{name} must be an int or a 1-D integer array")
            value = value.tolist()
        if not isinstance(value, (list, tuple)):
            check_int(name, value, 0)
            if value > INT32_MAX:
                raise CapacityError(f"{name}={value} exceeds any sequence's capacity")
            return value
        if len(value) != size:
            raise ValueError(f"{name} has {len(value)} entries for {size} sequences")
        if set(map(type, value)) - {int} or (value and min(value) < 0):
            for count in value:  # the exact error for the first bad entry
                check_int(name, count, 0)
        if value and max(value) > INT32_MAX:
            raise CapacityError(f"{name} exceeds any sequence's capacity")
        return np.array(value, dtype=np.int64)

    def _grow_at_once(
        self, seqs: SeqBatch | SeqIds | None, new_tokens: int | SeqIds
    ) -> tuple[SeqBatch, int | NDArray[np.int64], _Growth | None]:
        """Check a growth and carry it out when the order cannot matter (the decode fast path,
        or every sequence fitting at once). Returns the batch, the checked step, and the
        growth still to decide in batch order (None: done)."""
        batch = self.resolve(seqs)
        step = self._token_array("new_tokens", new_tokens, len(batch))
        if self._grow_decode(batch, step):
            return batch, step, None
        g = self._growth(batch, step)
        if g is not None and g.fits_at_once(self.manager.num_free_blocks):
            self._apply_growth(g, None, g.shared)
            return batch, step, None
        return batch, step, g

    def _grow_decode(self, batch: SeqBatch, step: int | NDArray[np.int64]) -> bool:
        """The decode step: every sequence gains one token, and no written last block can be
        shared. Only sequences at a block boundary touch the manager. Returns False, changing
        nothing, when the general path must decide (another step, a possibly shared last
        block, more sequences at a boundary than free blocks, a table at full width)."""
        rows = batch.rows
        if not (isinstance(step, int) and step == 1) or rows.size == 0:
            return False
        if self._num_tail_shared and self._tail_shared.take(rows).any():
            return False
        counts = self._token_counts.take(rows)
        boundary = (counts % self.block_size == 0).nonzero()[0]  # a new block each
        if boundary.size:
            if boundary.size > self.manager.num_free_blocks:
                return False
            growing = rows.take(boundary)
            lengths = self._num_blocks.take(growing)
            if lengths.max() >= self._width:
                return False
            fresh = (
                self.manager.take_block()  # the single-block fast path
                if boundary.size == 1
                else self.manager.take_blocks(boundary.size)
            )
            self._tables.reshape(-1)[batch._base.take(boundary) + lengths] = fresh
            self._num_blocks[growing] = lengths + 1
        self._token_counts[rows] = counts + 1
        return True

    def _growth(self, batch: SeqBatch, step: int | NDArray[np.int64]) -> _Growth | None:
        """What growing ``batch`` by ``step`` needs, changing nothing; None if nothing grows.
        ``CapacityError`` if a sequence would outgrow its table, ``BlockTableError`` if one would
        write into a released entry."""
        rows = batch.rows
        if rows.size == 0:
            return None
        bs, width = self.block_size, self._width
        counts = self._token_counts.take(rows).astype(np.int64)
        lengths = self._num_blocks.take(rows)
        new_counts = counts + step
        needed = (new_counts + (bs - 1)) // bs
        if needed.max() > width:
            over = [s for s, n in zip(batch.seq_ids, needed.tolist(), strict=True) if n > width]
            raise CapacityError(f"sequences {over} would need more than {width} blocks")
        if isinstance(step, int) and step == 0:
            return None
        # A live table holds exactly ceil(count / block_size) blocks, so the only present block
        # a write can reach is the last one, and only when it is partly filled.
        writes_last = counts % bs != 0
        if not isinstance(step, int):
            writes_last &= step > 0
        last = self._tables.take(batch._base + lengths - 1)  # index -1 only if not writes_last
        into_released = writes_last & (last == PAD)  # the spec's rule: never written
        if into_released.any():
            ids = np.array(batch.seq_ids)[into_released].tolist()
            raise BlockTableError(f"sequences {ids} would write into a released block")
        last_refs = self.manager.ref_counts_of(last)
        shared = writes_last & (last_refs > 1)
        return _Growth(
            rows, batch._base, lengths, needed, new_counts, needed - lengths, writes_last, last,
            last_refs, shared,
        )  # fmt: skip

    def _plan_preemption(self, g: _Growth, free: int) -> int:
        """With no copy on write, the first batch index that :meth:`grow_or_preempt` removes:
        sequences before it grow, it and all after it are removed (the last first)."""
        held_counts = g.lengths - self._num_released.take(g.rows)  # released entries free nothing
        stop = plan_preemption(g.growth, held_counts.astype(np.int64), free)
        victims = self._tables[g.rows[stop:]]
        held = victims[victims != PAD].astype(np.intp)
        if held.size == 0 or self.manager.ref_counts_of(held).max() == 1:
            return stop  # the victims own their blocks alone: each frees all it holds
        # Shared blocks (prefix-cache hits): a victim frees only the blocks it held last.
        refs: dict[int, int] = {}
        tail, n = g.rows.size - 1, g.rows.size
        for i, need in enumerate(g.growth.tolist()):
            while need > free:
                victim = tail
                tail -= 1
                row = g.rows[victim]
                blocks = self._tables[row, self._num_released[row] : g.lengths[victim]]
                blocks = blocks.astype(np.intp)
                for block, count in zip(
                    blocks.tolist(), self.manager.ref_counts_of(blocks).tolist(), strict=True
                ):
                    left = refs.get(block, count) - 1
                    refs[block] = left
                    free += left == 0
                if victim == i:
                    return i
            free -= need
            if tail < i + 1:  # every later sequence was removed
                return i + 1
        return n

    def _grow_or_preempt_in_order(
        self, batch: SeqBatch, step: int | NDArray[np.int64]
    ) -> list[int]:
        """``grow_or_preempt`` replayed one sequence at a time (copies on write in play)."""
        steps = [step] * len(batch) if isinstance(step, int) else step.tolist()
        ids = list(batch.seq_ids)
        victims: list[int] = []
        for index, (seq_id, k) in enumerate(zip(batch.seq_ids, steps, strict=True)):
            if index >= len(ids):
                break
            while self.grow([seq_id], k):
                victim = ids.pop()
                self.remove([victim])
                victims.append(victim)
                if victim == seq_id:
                    return victims
        return victims

    def _release_rows(self, rows: NDArray[np.intp], seq_ids: Sequence[int]) -> None:
        """``remove`` the sequences ``seq_ids`` held in ``rows``, in order."""
        if rows.size == 1:
            row = int(rows[0])
            held = self._tables[row, self._num_released[row] : self._num_blocks[row]]
            self.manager.release_blocks(held.astype(np.intp))
        elif rows.size > 1:
            reversed_tables = self._tables[rows, ::-1]  # padding first, then last block first
            self.manager.release_blocks_in_order(
                reversed_tables[reversed_tables != PAD].astype(np.intp)  # no released entry
            )
        self._tables[rows] = PAD
        self._num_blocks[rows] = 0
        self._num_released[rows] = 0
        self._token_counts[rows] = 0
        self._clear_tail_shared(rows)
        for seq_id in seq_ids:
            del self._row_of[seq_id]
            self._keys.pop(seq_id, None)
        self._free_rows.extend(rows[::-1].tolist())
        self._epoch += 1
        self._live = None

    def _cut_rows(
        self, rows: NDArray[np.intp], kept: NDArray[np.int64], counts: NDArray[np.int64]
    ) -> None:
        """Cut ``rows`` to ``kept`` blocks and ``counts`` tokens, releasing the dropped blocks
        in ``truncate``'s order (rows in order, each row's last block first)."""
        lengths = self._num_blocks.take(rows)
        if (kept < lengths).any():
            tables = self._tables[rows]  # a copy
            columns = np.arange(self._width)
            dropped = (columns >= kept[:, None]) & (columns < lengths[:, None])
            released = tables[:, ::-1][dropped[:, ::-1]]  # each row's last block first
            self.manager.release_blocks_in_order(released[released != PAD].astype(np.intp))
            tables[dropped] = PAD
            self._tables[rows] = tables
            self._num_released[rows] = np.minimum(self._num_released.take(rows), kept)
        self._num_blocks[rows] = kept
        self._token_counts[rows] = counts

    def _keyed_in_place(
        self, rows: NDArray[np.intp], last: NDArray[np.int32], in_place: NDArray[np.bool_]
    ) -> NDArray[np.bool_] | None:
        """Among the sequences whose write lands in their present last block (``in_place``),
        those whose block is cached, or None if none is. Only a flagged row's can be: a
        truncate cut into a cached block that other tables held then."""
        if not self._num_tail_shared or self._prefix is None or not self._prefix.num_cached_blocks:
            return None
        candidates = in_place & self._tail_shared.take(rows)
        cached = self._prefix.cached_among(last[candidates].astype(np.intp))
        return candidates & np.isin(last, list(cached)) if cached else None

    def _take_fresh(
        self,
        num_fresh: NDArray[np.int64],
        total: int,
        last: NDArray[np.int32],
        keyed: NDArray[np.bool_] | None,
    ) -> IdArray:
        """``take_blocks(total)`` for the sequences' fresh blocks, in batch order. With
        ``keyed`` (see :meth:`_keyed_in_place`), the spec's order instead: per sequence, its
        fresh blocks, then its written block's key removal (a cached block is never written in
        place). The removals happen even when ``total`` is 0."""
        if keyed is None:
            return self.manager.take_blocks(total)
        parts = []
        for index, count in enumerate(num_fresh.tolist()):
            parts.append(self.manager.take_blocks(count))
            if keyed[index]:
                self._prefix.remove_keys([int(last[index])])  # type: ignore[union-attr]
        return np.concatenate(parts)

    def _flag_tail_shared(self, rows: NDArray[np.intp]) -> None:
        self._tail_shared[rows] = True
        self._num_tail_shared = int(np.count_nonzero(self._tail_shared))

    def _clear_tail_shared(self, rows: NDArray[np.intp]) -> None:
        if self._num_tail_shared:
            self._tail_shared[rows] = False
            self._num_tail_shared = int(np.count_nonzero(self._tail_shared))

    def _apply_growth(
        self, g: _Growth, keep: NDArray[np.intp] | None, shared: NDArray[np.bool_]
    ) -> None:
        """Grow the sequences ``keep`` of ``g`` (all with None), all of which fit; ``shared``
        marks, among them, those that copy their last block on write.

        All fresh blocks are taken at once and placed per sequence, in batch order, as the
        spec's calls would take them: its copy-on-write block first (replacing its shared last
        block), then its growth blocks. After it no written sequence's last block is shared,
        and none written in place is cached (:meth:`_keyed_in_place`).
        """
        if keep is None:
            rows, base, lengths, growth, last = g.rows, g.base, g.lengths, g.growth, g.last
            needed, new_counts = g.needed, g.new_counts
        else:
            rows, base, lengths, growth = (
                g.rows[keep],
                g.base[keep],
                g.lengths[keep],
                g.growth[keep],
            )
            last, needed, new_counts = g.last[keep], g.needed[keep], g.new_counts[keep]
        num_fresh = growth + shared
        total = int(num_fresh.sum())
        writes_last = g.writes_last if keep is None else g.writes_last[keep]
        keyed = self._keyed_in_place(rows, last, writes_last & ~shared)
        if total:
            fresh = self._take_fresh(num_fresh, total, last, keyed)
            flat = self._tables.reshape(-1)  # a view
            # total counts the copies too, so this is: no copy, and at most one block each.
            if total == np.count_nonzero(growth):
                growing = growth.nonzero()[0]
                flat[base.take(growing) + lengths.take(growing)] = fresh
            else:
                first_fresh = np.cumsum(num_fresh) - num_fresh
                copying = shared.nonzero()[0]
                if copying.size:
                    dst = fresh[first_fresh[copying]]
                    flat[base[copying] + lengths[copying] - 1] = dst
                    self.manager.copy_on_write(last[copying].astype(np.intp), dst)
                owner = np.repeat(np.arange(growth.size), growth)
                within = np.arange(owner.size) - np.repeat(np.cumsum(growth) - growth, growth)
                flat[base[owner] + lengths[owner] + within] = fresh[
                    (first_fresh + shared)[owner] + within
                ]
        elif keyed is not None:
            self._take_fresh(num_fresh, 0, last, keyed)
        self._num_blocks[rows] = needed
        self._token_counts[rows] = new_counts
        if self._num_tail_shared:  # a write copied or filled the last block, or passed it
            wrote = (
                (g.writes_last | (g.growth > 0))
                if keep is None
                else (g.writes_last[keep] | (growth > 0))
            )
            self._clear_tail_shared(rows[wrote])


@dataclass(eq=False, slots=True)
class _SeqKeys:
    """A sequence's block keys so far (prefix caching): ``keys[i]`` is full block ``i``'s
    content, for ``extra``, made from ``tokens``; blocks ``0 .. done - 1`` went through
    registration, and those in ``retry`` stayed uncached because their content was cached in
    another block."""

    extra: Hashable
    keys: list[BlockKey] = field(default_factory=list)
    done: int = 0
    retry: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the keyed blocks' tokens

    def extends(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` start with the keyed tokens (one C-level list comparison), so
        the keys still hold and only what follows needs hashing."""
        known = len(self.tokens)
        if len(token_ids) < known:
            return False
        return (token_ids if len(token_ids) == known else token_ids[:known]) == (
            self.tokens if isinstance(token_ids, list) else tuple(self.tokens)
        )

    def cut(self, full: int, block_size: int) -> None:
        """Keep the keys of the first ``full`` blocks only (a truncate kept those whole)."""
        del self.keys[full:]
        del self.tokens[full * block_size :]
        self.done = min(self.done, full)
        self.retry = [index for index in self.retry if index < full]

    def copy(self) -> _SeqKeys:
        return _SeqKeys(self.extra, list(self.keys), self.done, list(self.retry), list(self.tokens))


_NOT_REFUSED: tuple[int, list[int], Hashable, tuple[BlockKey, ...]] = (-1, [], None, ())


@dataclass(frozen=True, eq=False, slots=True)
class _Growth:
    """One batch's growth, decided before anything changes (arrays in batch order)."""

    rows: NDArray[np.intp]
    base: NDArray[np.intp]  # flat row offsets
    lengths: NDArray[np.int32]  # blocks held now
    needed: NDArray[np.int64]  # blocks held after
    new_counts: NDArray[np.int64]
    growth: NDArray[np.int64]  # needed - lengths
    writes_last: NDArray[np.bool_]  # a write lands in the present last block
    last: NDArray[np.int32]  # the present last block (garbage where nothing is held)
    last_refs: NDArray[np.int32]
    shared: NDArray[np.bool_]  # writes_last and the last block has other owners

    def fits_at_once(self, free: int) -> bool:
        """Every sequence grows, and no shared block is written twice: the order is moot."""
        return int(self.growth.sum() + self.shared.sum()) <= free and not (
            self.shared.any() and has_repeats(self.last[self.shared])
        )


def _check_seq_id(seq_id: object) -> int:
    """Rule: a sequence id is an int (not bool); int subclasses are taken by value."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise TypeError(f"sequence id must be an int, got {type(seq_id).__name__}")
    return int(seq_id)


def _repeats(values: Sequence[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({v for v in values if v in seen or seen.add(v)})


def _read_only(array: NDArray[np.generic]) -> NDArray[np.generic]:
    view = array.view()
    view.flags.writeable = False
    return view
