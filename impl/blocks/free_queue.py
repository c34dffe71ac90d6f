"""The free-block queue: exact FIFO order in two int32 arrays, with O(1) removal from the middle.

Layout, for a pool of ``n`` blocks and a ring of capacity ``c = n + max(1, n // 2)``:

* ``_ring`` (``int32[c]``): the queue, head first, in the ring slots ``_head, _head + 1, ...,
  _head + _used - 1`` (all mod ``c``), the *window*. A slot in the window holds a block id or
  the tombstone ``-1`` left by :meth:`FreeBlockQueue.remove`. Slots outside the window are
  garbage and never read.
* ``_pos`` (``int32[n]``): the ring slot each block was last pushed to. Block ``b`` is queued
  iff ``_pos[b]`` lies in the window and ``_ring[_pos[b]] == b`` (a slot in the window was
  written by the push that put its current entry there, so a stale ``_pos`` cannot match).
  Pops therefore never touch ``_pos``, and the entry of a block that is not queued is dead:
  any valid ring slot may be written there (:meth:`FreeBlockQueue.has_repeats` uses that).

Costs: ``popleft(k)`` is one slice copy of ``k`` slots (plus any tombstones it skips, each
skipped once); ``extend(ids)`` is one slice write and one scatter into ``_pos``; ``remove`` is
O(1): it writes a tombstone. When a push would overflow the ring, the window is compacted to the
front in one O(c) pass; that needs more than ``c - n >= n // 2`` tombstones in the window, so
compaction is amortized O(1) per ``remove``. Without removals the ring never compacts.
Memory: ``4 * (c + n)`` bytes, 10 MB for a million blocks.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

MAX_FREE_RING_BLOCKS = 2**29
"""The most blocks the queue serves: its ring is 1.5x the pool, and the ring's slot arithmetic
is int32, so 1.5 * 2**29 stays below 2**31 (the spec's deque has no limit)."""

TOMBSTONE = -1
"""Marks a ring slot whose block was removed from the middle of the queue."""


class FreeBlockQueue:
    """A FIFO queue of distinct block ids in ``[0, num_blocks)``, initially ``0, 1, ..., n-1``.

    Callers guarantee the preconditions stated on each method; they are not re-checked here
    (``pagedkv.impl.blocks.manager`` validates its arguments before it touches the queue).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self._capacity = num_blocks + max(1, num_blocks // 2)
        self._pos = np.arange(num_blocks, dtype=np.int32)
        self._ring = np.full(self._capacity, TOMBSTONE, dtype=np.int32)
        self._ring[:num_blocks] = self._pos
        self._head = 0  # ring slot of the queue's head
        self._used = num_blocks  # window length: live ids plus tombstones
        self._len = num_blocks  # live ids
        self.compactions = 0  # how often the ring was compacted: the cost removals cause

    def __len__(self) -> int:
        """Number of block ids in the queue."""
        return self._len

    def __contains__(self, block_id: int) -> bool:
        """Whether ``block_id`` (in ``[0, num_blocks)``) is in the queue. O(1)."""
        slot = int(self._pos[block_id])
        in_window = (slot - self._head) % self._capacity < self._used
        return in_window and int(self._ring[slot]) == block_id

    def to_array(self) -> NDArray[np.intp]:
        """The queue as a new ``intp`` array, head (next to be popped) first."""
        window = self._read(self._head, self._used)
        return window if self._used == self._len else window[window != TOMBSTONE]

    def popleft(self, count: int) -> NDArray[np.intp]:
        """Remove and return the first ``count`` ids (``intp``), head first.

        Requires ``count <= len(self)``.
        """
        if count > self._len:
            raise IndexError(f"popleft({count}) from a queue of {self._len}")
        if self._used == self._len:  # no tombstones: exactly `count` slots
            out = self._read(self._head, count)
            self._advance(count)
            self._len -= count
            return out
        pieces = []
        while count:  # each pass consumes `count` slots; tombstones among them are dropped
            window = self._read(self._head, count)
            live = window[window != TOMBSTONE]
            pieces.append(live)
            self._advance(count)
            self._len -= live.size
            count -= live.size
        return np.concatenate(pieces) if pieces else np.empty(0, dtype=np.intp)

    def pop_one(self) -> int:
        """``popleft(1)`` as an int, without array work. Requires a non-empty queue."""
        ring, capacity = self._ring, self._capacity
        head = self._head
        block = int(ring[head])
        while block == TOMBSTONE:  # each tombstone is skipped once
            head = (head + 1) % capacity
            self._used -= 1
            block = int(ring[head])
        self._head = (head + 1) % capacity
        self._used -= 1
        self._len -= 1
        return block

    def push_one(self, block_id: int) -> None:
        """``extend`` of one id, without array work: distinct, in range, not queued."""
        if self._used == self._capacity:
            self._compact()
        tail = (self._head + self._used) % self._capacity
        self._ring[tail] = block_id
        self._pos[block_id] = tail
        self._used += 1
        self._len += 1

    def extend(self, block_ids: NDArray[np.intp]) -> None:
        """Append ``block_ids`` (``intp``, numpy's fast index type) at the tail, in order.

        Requires distinct ids in ``[0, num_blocks)``, none of them already queued.
        """
        count = block_ids.size
        if count == 0:
            return
        if self._used + count > self._capacity:
            self._compact()
        tail = (self._head + self._used) % self._capacity
        end = tail + count
        if end <= self._capacity:
            self._ring[tail:end] = block_ids
            self._pos[block_ids] = np.arange(tail, end, dtype=np.int32)
        else:  # wrap around the end of the ring
            split = self._capacity - tail
            self._ring[tail:] = block_ids[:split]
            self._ring[: end - self._capacity] = block_ids[split:]
            self._pos[block_ids] = np.arange(tail, end, dtype=np.int32) % self._capacity
        self._used += count
        self._len += count

    def has_repeats(self, block_ids: NDArray[np.intp]) -> bool:
        """Whether ``block_ids`` holds some id twice. O(n), no extra memory.

        Requires ids in ``[0, num_blocks)``, none of them queued. Their ``_pos`` entries are then
        dead (see the module docstring), so each position writes its own index there as a stamp
        and reads it back: a repeated id keeps only one of its stamps. The stamps are valid ring
        slots that do not hold these ids, so every membership answer stays correct.
        """
        if block_ids.size > self._pos.size:  # more ids than blocks: some id repeats
            return True
        stamps = np.arange(block_ids.size, dtype=np.int32)
        self._pos[block_ids] = stamps
        return np.count_nonzero(self._pos[block_ids] != stamps) > 0

    def remove(self, block_id: int) -> None:
        """Take ``block_id`` out of the queue wherever it is; the others keep their order. O(1).

        Raises ``KeyError`` if ``block_id`` is not queued.
        """
        if block_id not in self:
            raise KeyError(f"block {block_id} is not in the free queue")
        self._ring[self._pos[block_id]] = TOMBSTONE
        self._len -= 1
        if self._len == 0:  # only tombstones left: drop them
            self._head = self._used = 0

    # ----------------------------------------------------------------- internals

    def _read(self, start: int, count: int) -> NDArray[np.intp]:
        """A copy (as ``intp``, numpy's index type) of ``count`` ring slots from ``start`` on."""
        end = start + count
        if end <= self._capacity:
            return self._ring[start:end].astype(np.intp)
        return np.concatenate(
            (self._ring[start:], self._ring[: end - self._capacity]), dtype=np.intp
        )

    def _advance(self, count: int) -> None:
        """Drop ``count`` slots from the front of the window."""
        self._head = (self._head + count) % self._capacity
        self._used -= count

    def _compact(self) -> None:
        """Move the live ids, in order, to the front of the ring; tombstones disappear."""
        live = self.to_array()
        self._ring[: live.size] = live
        self._pos[live] = np.arange(live.size, dtype=np.int32)
        self._head = 0
        self._used = live.size
        self.compactions += 1
