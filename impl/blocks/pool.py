"""The unchecked block pool: reference counts, the free queue and pending copy-on-write pairs.

Internal to the blocks layer. :class:`BlockPool` is the state every checked API of the layer
drives (:class:`pagedkv.impl.blocks.manager.BlockManager`,
:class:`pagedkv.impl.blocks.prefix_cache.PrefixCachingBlockManager`,
:class:`pagedkv.impl.blocks.store.BlockTableStore`), and it checks NOTHING about its arguments:
not the ids' range, not that a table's ids are distinct, not that a released or shared block is
held, not that enough blocks are free. A caller that breaks a precondition corrupts the pool (a
block in two tables, or freed twice) without an error. Every caller validates its own arguments
first, so a call never fails halfway:

* the managers check each table against the reference counts before they touch the pool;
* the store passes only ids read from its own tables, which hold exactly blocks this pool
  handed out and not yet released, and compares with ``num_free`` before it takes.

``refs`` (``int32[total_blocks]``) is every block's reference count and ``queue`` the FIFO free
queue; both are read by the callers' checks. ``waiting`` holds, in the order they were let go,
the sources of pending copy-on-write pairs that every table has let go of: the spec's
``waiting_for_copy``, which join the queue's tail when the pairs are popped. A pool made with
an :class:`Evictor` calls it with every block it hands to a new owner (prefix caching forgets
their keys there).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.free_queue import FreeBlockQueue

IdArray = NDArray[np.intp]
"""Block ids as numpy's index type, the fastest for gathers and scatters."""


class Evictor(Protocol):
    """Told of every block handed to a new owner, in queue order."""

    def evict(self, taken: IdArray) -> None:
        """The blocks ``taken`` (in queue order) have new owners."""

    def evict_one(self, block_id: int) -> None:
        """The block ``block_id`` has a new owner."""


class BlockPool:
    """``total_blocks`` blocks: all free, the queue ``0, 1, ..., n - 1``, no pair pending."""

    def __init__(self, total_blocks: int, evictor: Evictor | None = None) -> None:
        self.total_blocks = total_blocks
        self.refs = np.zeros(total_blocks, dtype=np.int32)
        self.queue = FreeBlockQueue(total_blocks)
        self.evictor = evictor
        self.copy_pairs: list[NDArray[np.int32]] = []  # int32[P, 2] chunks, oldest first
        self.is_source = np.zeros(total_blocks, dtype=np.bool_)  # of a pending pair
        self.waiting: list[int] = []  # sources no table holds, in the order let go

    @property
    def num_free(self) -> int:
        """Blocks in the free queue."""
        return len(self.queue)

    def take(self, num_blocks: int) -> IdArray:
        """Pop ``num_blocks`` (``<= num_free``) ids from the head of the free queue for a new
        owner, each now with ``ref_count`` 1."""
        taken = self.queue.popleft(num_blocks)
        self.refs[taken] = 1
        if self.evictor is not None:
            self.evictor.evict(taken)
        return taken

    def take_one(self) -> int:
        """``take(1)`` as an int, without array work (``num_free >= 1``)."""
        block = self.queue.pop_one()
        self.refs[block] = 1
        if self.evictor is not None:
            self.evictor.evict_one(block)
        return block

    def revive(self, hits: IdArray, revived: IdArray) -> None:
        """Give each of the distinct cached blocks ``hits`` one more owner; ``revived``, those
        of them no table holds, leave the free queue first (the rest of it keeps its order), or
        the blocks waiting for a copy."""
        for block_id in revived.tolist():
            if self.waiting and block_id in self.waiting:
                self.waiting.remove(block_id)  # a source waiting for its copy
            else:
                self.queue.remove(block_id)  # O(1)
        self.refs[hits] += 1

    def share(self, ids: IdArray) -> None:
        """Give each block of a live table (distinct, held ids) one more owner: ``fork``."""
        self.refs[ids] += 1

    def refs_of(self, ids: IdArray) -> NDArray[np.int32]:
        """The reference counts of ``ids`` (in range), as a new array."""
        return self.refs.take(ids)

    def release(self, ids: IdArray) -> None:
        """Drop one owner's hold on one live table (``ids`` in table order): ``free``.

        Blocks that reach 0 join the free queue's tail, the table's LAST block first.
        """
        self.release_held(ids, self.refs[ids])

    def release_held(self, ids: IdArray, held: NDArray[np.int32]) -> None:
        """:meth:`release` given the table's counts ``held`` (already read by a check)."""
        remaining = held - 1
        self.refs[ids] = remaining
        freed = ids[remaining == 0] if np.count_nonzero(remaining) else ids
        self._free(freed[::-1].copy())  # contiguous: faster scatters in extend

    def release_in_order(self, ids: IdArray) -> None:
        """Drop one reference per occurrence in ``ids``, in order (several tables' ids).

        A block joins the free queue's tail when its count reaches 0, at its last occurrence.
        Every block's count must cover its occurrences.
        """
        unique, first_in_reverse, counts = np.unique(
            ids[::-1], return_index=True, return_counts=True
        )
        remaining = self.refs[unique] - counts.astype(np.int32)
        self.refs[unique] = remaining
        freed = remaining == 0
        # The later a block's last occurrence, the earlier its first one in reverse.
        self._free(unique[freed][np.argsort(-first_in_reverse[freed])])

    def _free(self, freed: IdArray) -> None:
        """Blocks whose last hold just went, in order: to the free queue's tail, except the
        sources of pending pairs, which wait for :meth:`pop_copy_pairs`."""
        if self.copy_pairs:
            waits = self.is_source.take(freed)
            if waits.any():
                self.waiting += freed[waits].tolist()
                freed = freed[~waits]
        self.queue.extend(freed)

    def copy_on_write(self, src: IdArray, dst: IdArray) -> None:
        """Record that block ``dst[i]`` (freshly taken) replaces the shared ``src[i]`` in one
        table, for every ``i`` in order: each ``src`` occurrence loses that table's hold (its
        count stays >= 1) and ``(src[i], dst[i])`` is queued for :meth:`pop_copy_pairs`."""
        np.subtract.at(self.refs, src, 1)
        self.copy_pairs.append(np.stack((src, dst), axis=1).astype(np.int32))
        self.is_source[src] = True

    def pending_sources(self) -> list[int]:
        """The blocks that pending pairs read."""
        return np.flatnonzero(self.is_source).tolist()

    def pending_copy_pairs(self) -> NDArray[np.int32]:
        """The pending ``(src, dst)`` pairs as a new ``int32[P, 2]`` array, oldest first, still
        pending: a caller copies, then pops, so a failed copy loses no pair."""
        pairs = self.copy_pairs
        if not pairs:
            return np.empty((0, 2), dtype=np.int32)
        merged = np.concatenate(pairs)
        self.copy_pairs = [merged]  # one chunk from now on
        return merged.copy()

    def pop_copy_pairs(self) -> NDArray[np.int32]:
        """:meth:`pending_copy_pairs`, then forget them; the blocks waiting for them join the
        free queue's tail, in order."""
        pairs = self.pending_copy_pairs()
        self.copy_pairs = []
        self.is_source[pairs[:, 0]] = False
        if self.waiting:
            self.queue.extend(np.array(self.waiting, dtype=np.intp))
            self.waiting = []
        return pairs
