"""The block manager of ``spec.block_manager``, with reference counts and free queue in arrays.

For any sequence of calls, :class:`BlockManager` returns what the spec returns (same block ids,
same order, same result types), raises the spec's exception classes in the spec's precedence,
and leaves the same free queue and reference counts. No Python object exists per block:
reference counts are one ``int32`` array and the free queue is a
:class:`pagedkv.impl.blocks.free_queue.FreeBlockQueue`.

Besides the spec's API it offers :meth:`BlockManager.allocate_array` and
:meth:`BlockManager.free_array` (the same operations on numpy id arrays, skipping the conversion
to and from Python ints) and :meth:`BlockManager.ref_counts`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.free_queue import MAX_FREE_RING_BLOCKS
from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.spec.block_manager import blocks_needed, leading_released, translate_slot
from pagedkv.spec.checks import (
    BlockTableError,
    OutOfBlocksError,
    blocks_outside_window,
    check_available,
    check_block_id,
    check_capacity,
    check_int,
    check_window,
)

__all__ = ["BlockManager", "BlockTableError", "OutOfBlocksError"]

_NO_IDS: IdArray = np.empty(0, dtype=np.intp)


def _as_list(released: int, ids: IdArray) -> list[int | None]:
    """A table as the spec returns it: ``released`` entries ``None``, then ``ids`` as ints."""
    return [None] * released + ids.tolist() if released else ids.tolist()


class BlockManager:
    """``spec.block_manager.BlockManager``'s behaviour, array-backed.

    State: ``pool``, a :class:`pagedkv.impl.blocks.pool.BlockPool`: every block's reference
    count, the FIFO free queue and the pending copy-on-write pairs as ``int32[P, 2]``
    chunks. A call converts its table to one id array and does its per-block work in numpy: the
    Python work per call is O(1) and the array work O(1) per block. A call that raises changes
    nothing.

    :class:`pagedkv.impl.blocks.store.BlockTableStore` drives the same pool directly, under
    the contract written in :mod:`pagedkv.impl.blocks.pool`.
    """

    def __init__(self, total_blocks: int, block_size: int = 16) -> None:
        self.total_blocks = check_int("total_blocks", total_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        if total_blocks > MAX_FREE_RING_BLOCKS:
            raise ValueError(
                f"total_blocks must be <= {MAX_FREE_RING_BLOCKS} (int32 ring positions)"
            )
        self.pool = BlockPool(total_blocks)

    # ----------------------------------------------------------------- introspection

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks in the free queue."""
        return self.pool.num_free

    @property
    def usage(self) -> float:
        """The fraction of the pool not free (held, or waiting for a copy),
        ``1 - free / total_blocks``."""
        return (self.total_blocks - self.pool.num_free) / self.total_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now."""
        return check_int("num_blocks", num_blocks, 0) <= self.pool.num_free

    def ref_count(self, block_id: int) -> int:
        """How many live tables hold ``block_id``."""
        return int(self.pool.refs[check_block_id(block_id, self.total_blocks)])

    def ref_counts(self) -> NDArray[np.int32]:
        """Every block's reference count, indexed by block id (a copy)."""
        return self.pool.refs.copy()

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return self.pool.queue.to_array().tolist()

    @property
    def waiting_for_copy(self) -> list[int]:
        """Sources of pending pairs that no table holds, in the order let go: not free until
        the pairs are popped (the spec's ``waiting_for_copy``)."""
        return list(self.pool.waiting)

    def pending_copy_pairs(self) -> list[tuple[int, int]]:
        """The copy-on-write pairs :meth:`pop_copy_pairs` would return, still pending."""
        return [(src, dst) for src, dst in self.pool.pending_copy_pairs().tolist()]

    def pop_copy_pairs(self) -> list[tuple[int, int]]:
        """Return and forget the ``(src, dst)`` copy-on-write pairs made since the last call;
        the blocks waiting for them join the free queue's tail, in order.

        The caller must copy block ``src`` into block ``dst`` for every pair, in order, before
        writing new KV data. (``BlockTableStore.pop_copy_pairs`` drains the same pairs.)
        """
        return [(src, dst) for src, dst in self.pool.pop_copy_pairs().tolist()]

    # ----------------------------------------------------------------- the spec's operations

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue for a new table.

        Raises ``OutOfBlocksError`` (changing nothing) if fewer are free. ``allocate(0) == []``.
        """
        return self.allocate_array(num_blocks).tolist()

    def append_slot(
        self, block_table: Sequence[int], token_count: int, new_tokens: int = 1
    ) -> list[int]:
        """Return a new table that can hold ``token_count`` tokens, the last ``new_tokens`` written.

        Exactly ``spec.BlockManager.append_slot``: missing blocks are appended from the head of
        the free queue; each present block that receives a write while shared (``ref_count > 1``)
        is replaced, in table order, by a fresh block taken before the growth blocks, and
        ``(shared, fresh)`` is recorded for ``pop_copy_pairs``. All-or-nothing
        (``OutOfBlocksError``); the argument is never mutated.
        """
        released, ids, held = self.read_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_int("new_tokens", new_tokens, 0)
        if new_tokens > token_count:
            raise ValueError(f"new_tokens ({new_tokens}) exceeds token_count ({token_count})")
        needed = blocks_needed(token_count, self.block_size)
        size = released + ids.size
        # Table indices of the blocks that receive a write, capped at the existing table.
        first_written = (token_count - new_tokens) // self.block_size
        stop_written = min(needed if new_tokens else first_written, size)
        shared = _NO_IDS
        if first_written < stop_written:
            if first_written < released:
                raise BlockTableError(
                    f"positions {token_count - new_tokens}..{token_count - 1} reach a released "
                    "block"
                )
            written = held[first_written - released : stop_written - released]
            shared = first_written + np.flatnonzero(written > 1)
        num_fresh = shared.size + max(0, needed - size)
        check_available(num_fresh, self.pool.num_free)
        if num_fresh == 0:
            return _as_list(released, ids)
        fresh = self.pool.take(num_fresh)
        if shared.size:
            src, dst = ids[shared - released], fresh[: shared.size]
            self.pool.copy_on_write(src, dst)
            ids[shared - released] = dst  # ids is this call's own array
        return _as_list(released, ids) + fresh[shared.size :].tolist()

    def fork(self, block_table: Sequence[int | None]) -> list[int | None]:
        """Share a live table's blocks with a new owner (each ``ref_count + 1``); return a copy,
        released entries included."""
        released, ids, held = self.read_live_table(block_table)
        self.pool.refs[ids] = held + 1
        return _as_list(released, ids)

    def free(self, block_table: Sequence[int | None]) -> None:
        """Release one owner's hold on every block of a live table.

        Blocks that reach ``ref_count == 0`` join the tail of the free queue, the table's LAST
        block first; released entries are skipped. Unknown, repeated or already-free ids raise
        ``BlockTableError`` before anything changes.
        """
        _, ids, held = self.read_live_table(block_table)
        self.pool.release_held(ids, held)

    def truncate(self, block_table: Sequence[int | None], token_count: int) -> list[int | None]:
        """Roll a live table back to ``token_count`` tokens; return the shorter table.

        Exactly ``spec.BlockManager.truncate``: the result is ``table[:ceil(token_count /
        block_size)]``; each dropped block loses this table's hold and those reaching 0 join the
        free queue's tail, the table's LAST block first. ``BlockTableError`` for a table that is
        not live, ``TypeError``/``ValueError`` for a ``token_count`` that is not an int >= 0, and
        ``ValueError`` for one beyond ``len(table) * block_size``; nothing changes then.
        """
        released, ids, held = self.read_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_capacity(released + ids.size, token_count, self.block_size)
        kept = blocks_needed(token_count, self.block_size)
        first_dropped = max(0, kept - released)  # among the held ids
        self.pool.release_held(ids[first_dropped:], held[first_dropped:])
        return _as_list(released, ids)[:kept]

    def release_outside_window(
        self, block_table: Sequence[int | None], token_count: int, window: int
    ) -> list[int | None]:
        """Sliding window: exactly ``spec.BlockManager.release_outside_window``. The first
        ``blocks_outside_window(token_count, window, block_size)`` entries become ``None``;
        their blocks are released as ``free`` releases a table (the LAST of them first).
        ``BlockTableError`` for a table that is not live; ``TypeError``/``ValueError`` for a
        ``token_count`` that is not an int >= 0 or beyond the table's capacity, or a ``window``
        that is not an int >= 1; nothing changes then."""
        released, ids, held = self.read_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_window(window)
        check_capacity(released + ids.size, token_count, self.block_size)
        outside = blocks_outside_window(token_count, window, self.block_size)
        newly = max(0, outside - released)  # among the held ids
        self.pool.release_held(ids[:newly], held[:newly])
        return [None] * outside + _as_list(released, ids)[outside:]

    def translate_slot(self, block_table: Sequence[int | None], token_pos: int) -> int:
        """Physical slot of ``token_pos`` in a live table (module-level ``translate_slot``);
        ``BlockTableError`` for a position in a released entry."""
        released = self.read_live_table(block_table)[0]
        check_int("token_pos", token_pos, 0)
        if token_pos // self.block_size < released:
            raise BlockTableError(f"token_pos {token_pos} lies in a released block")
        return translate_slot(list(block_table), token_pos, self.block_size)

    # ----------------------------------------------------------------- array operations

    def allocate_array(self, num_blocks: int) -> IdArray:
        """``allocate``, returning the ids as a new ``intp`` array instead of a list."""
        num_blocks = check_int("num_blocks", num_blocks, 0)  # a plain int: its value
        check_available(num_blocks, self.pool.num_free)
        return self.pool.take(num_blocks)

    def free_array(self, block_ids: NDArray[np.integer]) -> None:
        """``free`` for a table given as a 1-D integer numpy array: same order, same errors.

        Raises ``TypeError`` for anything but a 1-D array of an integer dtype.
        """
        self.pool.release_held(*self._live_array(block_ids))

    # ----------------------------------------------------------------- validation

    def read_live_table(self, block_table: object) -> tuple[int, IdArray, NDArray[np.int32]]:
        """Validate a live table as the spec does; return how many entries lead released
        (``None``), the ids after them and their reference counts.

        Precedence as in the spec: ``TypeError`` unless a list or tuple; then per element after
        the released ones, in table order, ``TypeError`` (not an int, ``None`` included) or
        ``BlockTableError`` (unknown id); then ``BlockTableError`` for repeated ids, then for
        free blocks.
        """
        if not isinstance(block_table, (list, tuple)):
            raise TypeError(f"block_table must be a list of ints, got {type(block_table).__name__}")
        released = leading_released(block_table)
        held = block_table[released:] if released else block_table
        return (released, *self._distinct_and_held(self._table_ids(held)))

    def _table_ids(self, block_table: Sequence[object]) -> IdArray:
        """The table's ids as an array, or the spec's per-element error for the first bad one."""
        if set(map(type, block_table)) == {int}:  # the common case, checked in C
            try:
                ids = np.fromiter(block_table, dtype=np.intp, count=len(block_table))
            except OverflowError:  # an id beyond int64: unknown, reported below
                pass
            else:  # a negative id reads as a huge unsigned one
                if ids.view(np.uintp).max() < self.total_blocks:
                    return ids
        # Empty, or some element is bad or an int subclass: check one by one, in order.
        return np.array([check_block_id(b, self.total_blocks) for b in block_table], dtype=np.intp)

    def _live_array(self, block_ids: object) -> tuple[IdArray, NDArray[np.int32]]:
        """``_live_table`` for a 1-D integer numpy array (``TypeError`` for anything else)."""
        if not isinstance(block_ids, np.ndarray):
            raise TypeError(f"block_ids must be a numpy array, got {type(block_ids).__name__}")
        if block_ids.ndim != 1 or block_ids.dtype.kind not in "iu":
            raise TypeError(f"block_ids must be a 1-D integer array, got {block_ids.dtype}")
        ids = np.asarray(block_ids, dtype=np.intp)
        if ids.size and ids.view(np.uintp).max() >= self.total_blocks:
            check_block_id(int(ids[(ids < 0) | (ids >= self.total_blocks)][0]), self.total_blocks)
        return self._distinct_and_held(ids)

    def _distinct_and_held(self, ids: IdArray) -> tuple[IdArray, NDArray[np.int32]]:
        """Rule: a live table's (known) ids are distinct, then each is held. Returns the counts.

        O(n): the repeat check borrows the free queue's dead slots, so it runs once every block
        is known to be held; when some is not, repeats are looked for first, as in the spec.
        """
        held = self.pool.refs[ids]
        if np.count_nonzero(held) != held.size:
            if np.unique(ids).size < ids.size:
                self._raise_repeated(ids)
            already_free = ids[held == 0].tolist()
            raise BlockTableError(f"blocks {already_free} are free (double free or stale table)")
        if self.pool.queue.has_repeats(ids):
            self._raise_repeated(ids)
        return ids, held

    def _raise_repeated(self, ids: IdArray) -> None:
        unique, counts = np.unique(ids, return_counts=True)
        raise BlockTableError(f"block ids repeated within one table: {unique[counts > 1].tolist()}")
