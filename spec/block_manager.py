"""Executable specification of the paged KV-cache block manager.

The KV cache is cut into ``total_blocks`` physical blocks of ``block_size`` token slots each.
A sequence owns a *block table*: the list of physical block ids that hold its logical blocks
0, 1, 2, ... in order. Under sliding-window attention the leading blocks a sequence can never
read again are given back (``release_outside_window``) and their entries become ``None``
(*released*): the table keeps its length, so position ``p`` still lives at entry
``p // block_size``. This module decides every rule; ``impl`` must behave identically.

Pure Python, standard library only. Each rule is stated next to the line that implements it.
Every public method validates all of its arguments before it changes anything, so a call that
raises leaves the manager exactly as it was.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

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

__all__ = [
    "Block",
    "BlockManager",
    "BlockTableError",
    "OutOfBlocksError",
    "blocks_needed",
    "blocks_outside_window",
    "check_capacity",
    "check_int",
    "held_ids",
    "leading_released",
    "translate_slot",
]


@dataclass
class Block:
    """One physical block: its id and how many live block tables hold it."""

    block_id: int
    ref_count: int = 0


def blocks_needed(token_count: int, block_size: int) -> int:
    """Rule: ``token_count`` tokens occupy ``ceil(token_count / block_size)`` blocks."""
    return -(-token_count // block_size)


def leading_released(block_table: Sequence[int | None]) -> int:
    """How many entries at the start of ``block_table`` are released (``None``)."""
    count = 0
    while count < len(block_table) and block_table[count] is None:
        count += 1
    return count


def held_ids(block_table: Sequence[int | None]) -> list[int]:
    """The block ids of a table, in order, without its released entries."""
    return [block_id for block_id in block_table if block_id is not None]


def translate_slot(block_table: Sequence[int], token_pos: int, block_size: int) -> int:
    """Map logical position ``token_pos`` to its physical slot (the chapter's formula).

    ``block_table[token_pos // block_size] * block_size + token_pos % block_size``.
    The table is a list or tuple of block ids (``TypeError`` otherwise; the id read must be a
    non-negative int). Negative positions raise ``ValueError``; positions at or beyond the
    table's capacity (``len(block_table) * block_size``) raise ``IndexError``.
    """
    if not isinstance(block_table, (list, tuple)):
        raise TypeError(f"block_table must be a list of ints, got {type(block_table).__name__}")
    check_int("block_size", block_size, 1)
    check_int("token_pos", token_pos, 0)
    block_idx = token_pos // block_size  # index into the block table
    slot_in_block = token_pos % block_size  # offset inside that block
    if block_idx >= len(block_table):
        raise IndexError(
            f"token_pos {token_pos} is beyond the table's capacity of "
            f"{len(block_table) * block_size} slots"
        )
    return check_int("block id", block_table[block_idx], 0) * block_size + slot_in_block


class BlockManager:
    """Hands out physical blocks from a FIFO free queue and takes them back by reference count.

    Invariants, true between any two calls:

    * every block is exactly one of: in the free queue (``ref_count == 0``), held by at least
      one live table (``ref_count >= 1``), or waiting for its copy (``ref_count == 0``, the
      source of a pending copy-on-write pair that every table has let go of);
    * ``ref_count`` of a block equals the number of live tables that contain it;
    * the free queue holds each free block exactly once;
    * no pending pair writes a block that it or an earlier pending pair reads: a source is
      never handed out again while its pair is pending, so copying the pending pairs again,
      after any part of them was copied, gives the same bytes (design.md §6, "Copy-on-write
      and retries");
    * a live table's released entries (``None``) come before its block ids and hold nothing.
    """

    def __init__(self, total_blocks: int, block_size: int = 16) -> None:
        self.total_blocks = check_int("total_blocks", total_blocks, 1)
        self.block_size = check_int("block_size", block_size, 1)
        # Rule: every block starts free with ref_count 0; the queue starts as [0, 1, ..., n-1].
        self.blocks = [Block(block_id) for block_id in range(total_blocks)]
        self.free_queue: deque[int] = deque(range(total_blocks))
        self._copy_pairs: list[tuple[int, int]] = []
        # Rule: a pending pair's source let go of by every table waits here, in the order it
        # was let go, until the pairs are popped: it is read by the copy, so it is not free.
        self.waiting_for_copy: list[int] = []

    # ----------------------------------------------------------------- introspection

    @property
    def num_free_blocks(self) -> int:
        """Number of blocks in the free queue."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Rule: the fraction of the pool not free (held by live tables or waiting for a
        copy), ``1 - free / total_blocks``."""
        return (self.total_blocks - len(self.free_queue)) / self.total_blocks

    def can_allocate(self, num_blocks: int) -> bool:
        """Whether ``allocate(num_blocks)`` would succeed now."""
        return check_int("num_blocks", num_blocks, 0) <= len(self.free_queue)

    def ref_count(self, block_id: int) -> int:
        """How many live tables hold ``block_id``."""
        check_block_id(block_id, self.total_blocks)
        return self.blocks[block_id].ref_count

    def free_block_ids(self) -> list[int]:
        """The free queue, head (next to be allocated) first."""
        return list(self.free_queue)

    def pending_copy_pairs(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` copy-on-write pairs made since the last ``pop_copy_pairs``, oldest
        first, still pending (a caller copies them, then pops them)."""
        return list(self._copy_pairs)

    def pop_copy_pairs(self) -> list[tuple[int, int]]:
        """Return and forget the ``(src, dst)`` copy-on-write pairs made since the last call.

        The caller must copy the KV data of block ``src`` into block ``dst`` for every pair, in
        order, before writing any new KV data into the cache. The blocks waiting for these
        copies (sources every table let go of while their pair was pending) join the tail of
        the free queue, in the order they were let go.
        """
        pairs, self._copy_pairs = self._copy_pairs, []
        self.free_queue.extend(self.waiting_for_copy)  # Rule: read by now; free again.
        self.waiting_for_copy = []
        return pairs

    # ----------------------------------------------------------------- validation

    def check_live_table(self, block_table: Sequence[int | None]) -> list[int | None]:
        """Rule: a live table is a list of known, distinct ids, each held (ref_count >= 1),
        after any number of released entries (``None``)."""
        if not isinstance(block_table, (list, tuple)):
            raise TypeError(f"block_table must be a list of ints, got {type(block_table).__name__}")
        released = leading_released(block_table)
        # Rule: released entries only lead; a None after an id is not an id (TypeError).
        table = [check_block_id(b, self.total_blocks) for b in block_table[released:]]
        if len(set(table)) != len(table):
            repeated = sorted({b for b in table if table.count(b) > 1})
            raise BlockTableError(f"block ids repeated within one table: {repeated}")
        already_free = [b for b in table if self.blocks[b].ref_count == 0]
        if already_free:
            raise BlockTableError(f"blocks {already_free} are free (double free or stale table)")
        return [None] * released + table

    # ----------------------------------------------------------------- operations

    def _release(self, blocks: list[int]) -> None:
        """Drop one hold on each of ``blocks`` (held, distinct), in the order ``free`` uses."""
        sources = {src for src, _ in self._copy_pairs}
        for block_id in reversed(blocks):  # Rule: tail first, so prefixes outlive tails.
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0 and block_id in sources:
                self.waiting_for_copy.append(block_id)  # Rule: a pending copy still reads it.
            elif block.ref_count == 0:
                self.free_queue.append(block_id)  # Rule: freed blocks join the tail of the queue.

    def _take_from_head(self, num_blocks: int) -> list[int]:
        """Pop ``num_blocks`` blocks from the head of the free queue, each with ref_count 1."""
        taken = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block_id in taken:
            self.blocks[block_id].ref_count = 1  # Rule: a fresh block has exactly one owner.
        return taken

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue for a new table.

        Raises ``OutOfBlocksError`` (changing nothing) if fewer are free. ``allocate(0) == []``.
        """
        check_int("num_blocks", num_blocks, 0)
        check_available(num_blocks, len(self.free_queue))
        return self._take_from_head(num_blocks)

    def append_slot(
        self, block_table: Sequence[int], token_count: int, new_tokens: int = 1
    ) -> list[int]:
        """Return a new table that can hold ``token_count`` tokens, the last ``new_tokens`` written.

        * Growth: the result holds at least ``ceil(token_count / block_size)`` blocks; missing
          blocks are appended, taken from the head of the free queue. A table that is already
          large enough keeps its length.
        * Copy-on-write: the append writes positions ``token_count - new_tokens`` to
          ``token_count - 1``. Each existing block that receives one of those writes while it is
          shared (``ref_count > 1``) is replaced, in table order, by a fresh block from the head
          of the queue (taken before the growth blocks); the shared block loses this owner
          (``ref_count - 1``) and ``(shared, fresh)`` is recorded for ``pop_copy_pairs``.
        * Lookahead: ``append_slot(table, token_count + k, new_tokens=0)`` reserves ``k`` slots
          beyond the last token without writing any, so it grows but never copies; ``truncate``
          gives back slots that were not kept.
        * Released entries: a write into a released (``None``) entry raises ``BlockTableError``.
        * All-or-nothing: if the free queue cannot supply every fresh block, ``OutOfBlocksError``
          is raised and nothing changes. The argument is never mutated.
        """
        table = self.check_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_int("new_tokens", new_tokens, 0)
        if new_tokens > token_count:
            raise ValueError(f"new_tokens ({new_tokens}) exceeds token_count ({token_count})")
        needed = blocks_needed(token_count, self.block_size)
        # Table indices of the blocks that receive a write, capped at the existing table
        # (writes past its end land in growth blocks, which are fresh).
        first_written = (token_count - new_tokens) // self.block_size
        end_written = needed if new_tokens else first_written
        written = range(first_written, min(end_written, len(table)))
        if any(table[i] is None for i in written):  # Rule: a released block is never written.
            raise BlockTableError(
                f"positions {token_count - new_tokens}..{token_count - 1} reach a released block"
            )
        shared = [i for i in written if self.blocks[table[i]].ref_count > 1]
        growth = max(0, needed - len(table))
        check_available(len(shared) + growth, len(self.free_queue))
        fresh = self._take_from_head(len(shared) + growth)
        for copy, index in enumerate(shared):  # the first fresh blocks replace shared ones
            old_id, fresh_id = table[index], fresh[copy]
            self.blocks[old_id].ref_count -= 1  # Rule: the shared block loses one owner.
            self._copy_pairs.append((old_id, fresh_id))  # Rule: the caller copies old -> fresh.
            table[index] = fresh_id
        return table + fresh[len(shared) :]

    def fork(self, block_table: Sequence[int | None]) -> list[int | None]:
        """Share a live table's blocks with a new owner (each ``ref_count + 1``); return a copy,
        released entries included."""
        table = self.check_live_table(block_table)
        for block_id in held_ids(table):
            self.blocks[block_id].ref_count += 1
        return table

    def free(self, block_table: Sequence[int | None]) -> None:
        """Release one owner's hold on every block of a live table.

        Each block's ``ref_count`` drops by one; blocks that reach 0 join the TAIL of the free
        queue, the table's LAST block first, so a sequence's prefix blocks are reused after its
        tail blocks; one that a pending copy-on-write pair still reads waits for
        ``pop_copy_pairs`` instead (``waiting_for_copy``). Released entries hold nothing and
        are skipped. Unknown ids, repeated ids and already-free blocks raise
        ``BlockTableError`` before anything changes.
        """
        self._release(held_ids(self.check_live_table(block_table)))

    def truncate(self, block_table: Sequence[int | None], token_count: int) -> list[int | None]:
        """Roll a live table back to ``token_count`` tokens; return the shorter table.

        The rollback of speculative decoding: draft tokens are written (``append_slot`` with
        ``new_tokens = 1 + k``), checked, and the rejected ones' slots are given back here.

        * The result is ``table[:ceil(token_count / block_size)]``; the dropped blocks are
          released exactly as ``free`` releases a table: each loses this table's hold, and those
          reaching 0 join the TAIL of the free queue, the table's LAST block first. A dropped
          block that other tables hold stays held by them.
        * ``token_count`` is an int >= 0 (``TypeError``/``ValueError``) and at most the table's
          capacity, ``len(table) * block_size`` (``ValueError``); the table must be live
          (``BlockTableError``). All of it is checked before anything changes. The argument is
          never mutated. Positions from ``token_count`` on are free to be written again; a kept
          last block that other tables share is copied on the next write into it.
        """
        table = self.check_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_capacity(len(table), token_count, self.block_size)
        kept = blocks_needed(token_count, self.block_size)  # Rule: ceil(count / size) stay.
        self._release(held_ids(table[kept:]))  # Rule: dropped blocks go as free releases them.
        return table[:kept]

    def release_outside_window(
        self, block_table: Sequence[int | None], token_count: int, window: int
    ) -> list[int | None]:
        """Sliding window: give back the leading blocks no query from ``token_count`` on reads.

        ``token_count`` is how many tokens the table holds, so the next query is at position
        ``token_count``; under a window of ``window`` tokens it and every later query read only
        positions above ``token_count - window``. The result is the table with its first
        ``blocks_outside_window(token_count, window, block_size)`` entries released (``None``):

        * each of those blocks not yet released is released exactly as ``free`` releases a
          table (one hold dropped; blocks reaching 0 join the TAIL of the free queue, the LAST
          of them first); a block other tables hold stays held by them;
        * the table keeps its length; afterwards it holds at most
          ``blocks_needed(window - 1, block_size) + 1`` blocks if it held
          ``blocks_needed(token_count, block_size)``;
        * ``token_count`` and ``window`` are ints, ``>= 0`` and ``>= 1``
          (``TypeError``/``ValueError``), ``token_count`` at most the table's capacity
          (``ValueError``); the table must be live (``BlockTableError``). All of it is checked
          before anything changes. The argument is never mutated.
        """
        table = self.check_live_table(block_table)
        check_int("token_count", token_count, 0)
        check_window(window)
        check_capacity(len(table), token_count, self.block_size)
        outside = blocks_outside_window(token_count, window, self.block_size)
        self._release(held_ids(table[:outside]))  # Rule: released as free releases them.
        return [None] * outside + table[outside:]  # Rule: the entries stay, as None.

    def translate_slot(self, block_table: Sequence[int | None], token_pos: int) -> int:
        """Physical slot of ``token_pos`` in a live table (module-level ``translate_slot``);
        a position in a released entry raises ``BlockTableError``."""
        table = self.check_live_table(block_table)
        check_int("token_pos", token_pos, 0)
        if token_pos // self.block_size < leading_released(table):
            raise BlockTableError(f"token_pos {token_pos} lies in a released block")
        return translate_slot(table, token_pos, self.block_size)
