"""Every live sequence's block table as one row of padded int32 arrays, and its slot mapping.

:class:`BlockTables` holds, for ``S = max_seqs`` rows and ``M = max_blocks_per_seq`` columns:

* ``tables`` (``int32[S, M]``): row ``r`` holds its sequence's table in columns
  ``0 .. num_blocks[r] - 1``: first ``num_released[r]`` released entries (``PAD``: blocks a
  sliding window gave back, the spec's ``None``), then its block ids; every other entry, and
  every entry of a row with no sequence, is ``PAD``;
* ``num_blocks``, ``num_released``, ``token_counts`` (``int32[S]``): a live row's table is
  exactly ``ceil(token_counts[r] / block_size)`` entries long, of which
  ``num_blocks[r] - num_released[r]`` hold a block;
* the free rows, as a stack (the row released last is filled first; row 0 first when none
  was released);
* ``tail_shared`` (``bool[S]``): rows whose partly filled last block a fork shared, or a
  truncate or window cut into: the only ways a write can reach a block with other owners or a
  key (prefix-cache hits are full blocks, and never a table's last one). Conservative: a flag
  outlives the sharing until the row's next growth.

It moves blocks in and out of rows through the unchecked :class:`~pagedkv.impl.blocks.pool.
BlockPool` in the orders the spec's calls would (each table's LAST block first), and checks
nothing: :class:`pagedkv.impl.blocks.store.BlockTableStore` validates every argument first.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.spec.checks import BlockTableError

PAD = -1
"""The table entry, and the ``slot_mapping`` entry, that stands for "no block" / "no token"."""

Rows = NDArray[np.intp]


class CapacityError(ValueError):
    """The store's fixed shape cannot hold the request: no free row, or a table that would need
    more than ``max_blocks_per_seq`` blocks."""


class BlockTables:
    """``max_seqs`` rows of up to ``max_blocks_per_seq`` entries for blocks of ``block_size``."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.tables = np.full((max_seqs, max_blocks_per_seq), PAD, dtype=np.int32)
        self.num_blocks = np.zeros(max_seqs, dtype=np.int32)
        self.num_released = np.zeros(max_seqs, dtype=np.int32)  # leading PAD entries per row
        self.token_counts = np.zeros(max_seqs, dtype=np.int32)
        self.free_rows = list(range(max_seqs - 1, -1, -1))  # pop() yields row 0 first
        self.tail_shared = np.zeros(max_seqs, dtype=np.bool_)

    @property
    def flat(self) -> NDArray[np.int32]:
        """``tables`` as one flat view: row ``r``, column ``c`` is entry ``r * width + c``."""
        return self.tables.reshape(-1)

    def held(self, row: int) -> NDArray[np.int32]:
        """The blocks row ``row`` holds (its entries after the released ones), a view."""
        return self.tables[row, self.num_released[row] : self.num_blocks[row]]

    def place(self, blocks: IdArray, token_count: int) -> int:
        """Fill the next free row with ``blocks`` and ``token_count`` tokens; return it."""
        row = self.free_rows.pop()
        self.tables[row, : blocks.size] = blocks
        self.num_blocks[row] = blocks.size
        self.token_counts[row] = token_count
        return row

    def copy_row(self, parent: int) -> int:
        """Fill the next free row with a copy of row ``parent`` (released entries as
        ``PAD``); return it. The caller gives its held blocks their new owner."""
        row = self.free_rows.pop()
        length = self.num_blocks[parent]
        self.tables[row, :length] = self.tables[parent, :length]
        self.num_blocks[row] = length
        self.num_released[row] = self.num_released[parent]
        self.token_counts[row] = self.token_counts[parent]
        return row

    def release(self, rows: Rows, pool: BlockPool) -> None:
        """Free ``rows`` as ``free`` per row in order would (each table's last block first;
        released entries hold nothing), and return them to the free rows."""
        if rows.size == 1:
            row = int(rows[0])
            pool.release(self.held(row).astype(np.intp))
        else:  # several (or no) rows
            reversed_tables = self.tables[rows, ::-1]  # padding first, then last block first
            pool.release_in_order(reversed_tables[reversed_tables != PAD].astype(np.intp))
        self.tables[rows] = PAD
        self.num_blocks[rows] = 0
        self.num_released[rows] = 0
        self.token_counts[rows] = 0
        self.clear_tail_shared(rows)
        self.free_rows.extend(rows.tolist())

    def truncate(
        self,
        rows: Rows,
        counts: NDArray[np.int64],
        pool: BlockPool,
        prefix: PrefixCachingBlockManager | None,
    ) -> None:
        """Roll ``rows`` back to ``counts`` tokens (each at most the row's), as ``truncate``
        per row in order would: the dropped blocks are released, and with ``prefix`` a kept
        last block cut into that is cached and held by its row alone loses its key."""
        bs = self.block_size
        kept = (counts + (bs - 1)) // bs
        cut = (counts % bs != 0).nonzero()[0]  # batch indices whose kept last block is partial
        last = self.tables[rows[cut], kept[cut] - 1].astype(np.intp)  # those blocks
        if prefix is not None and prefix.cached_among(last):
            # The key rule reads a cut block's count between the releases: one at a time.
            held = last != PAD  # a released kept last block holds nothing: no key to remove
            cut_block = dict(np.stack((cut[held], last[held]), axis=1).tolist())
            for i in range(rows.size):
                self.cut(rows[i : i + 1], kept[i : i + 1], counts[i : i + 1], pool)
                block = cut_block.get(i)
                if block is not None and pool.refs_of(np.array([block]))[0] == 1:
                    prefix.remove_keys([block])
        else:
            self.cut(rows, kept, counts, pool)
        # The next write into a partly kept last block takes grow's general path, which copies
        # it if it is shared and removes its key if it is cached (conservative: every cut row).
        self.clear_tail_shared(rows)
        if cut.size:
            self.flag_tail_shared(rows[cut])

    def cut(
        self, rows: Rows, kept: NDArray[np.int64], counts: NDArray[np.int64], pool: BlockPool
    ) -> None:
        """Cut ``rows`` to ``kept`` blocks and ``counts`` tokens, releasing the dropped blocks
        in ``truncate``'s order (rows in order, each row's last block first)."""
        tables = self.tables[rows]  # a copy
        dropped = np.arange(self.width) >= kept[:, None]  # past each row's length: PAD already
        released = tables[:, ::-1][dropped[:, ::-1]]  # each row's last block first
        pool.release_in_order(released[released != PAD].astype(np.intp))
        tables[dropped] = PAD
        self.tables[rows] = tables
        self.num_released[rows] = np.minimum(self.num_released.take(rows), kept)
        self.num_blocks[rows] = kept
        self.token_counts[rows] = counts

    def release_leading(
        self, rows: Rows, base: Rows, outside: NDArray[np.int64], pool: BlockPool
    ) -> None:
        """Release each row's first ``outside`` entries not yet released, as
        ``release_outside_window`` per row in order would (each row's last one first)."""
        before = self.num_released.take(rows)
        newly = np.maximum(outside - before, 0)
        total = int(newly.sum())
        if not total:
            return
        flat = self.flat
        owner = np.repeat(np.arange(rows.size), newly)
        within = np.arange(total) - np.repeat(np.cumsum(newly) - newly, newly)
        entries = base[owner] + outside[owner] - 1 - within  # each row's last one first
        pool.release_in_order(flat[entries].astype(np.intp))
        flat[entries] = PAD
        self.num_released[rows] = np.maximum(before, outside)
        # A count past the row's tokens can release its partly filled last block: the next
        # write there must take grow's general path, which refuses it.
        lengths = self.num_blocks.take(rows)
        gone = (outside >= lengths) & (self.token_counts.take(rows) % self.block_size != 0)
        if gone.any():
            self.flag_tail_shared(rows[gone])

    def slot_mapping(
        self, rows: Rows, base: Rows, step: int | NDArray[np.int64], pad_to: int | None
    ) -> NDArray[np.int32]:
        """The slots of each row's last ``step`` positions (one int for all, or one per row),
        concatenated as a new int32 array, ``PAD``-padded to ``pad_to``. ``ValueError`` if a
        step exceeds its row's count or the slots exceed ``pad_to``, ``BlockTableError`` if a
        position lies in a released entry."""
        counts = self.token_counts.take(rows)
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
        entries = self.tables.take(base + positions // self.block_size)
        if entries.size and entries.min() == PAD:  # the spec's translate_slot refuses these
            raise BlockTableError("a position to map lies in a released block")
        slots = entries * self.block_size + (positions % self.block_size)
        if pad_to is None:
            return np.asarray(slots, dtype=np.int32)
        if pad_to < slots.size:
            raise ValueError(f"{slots.size} slots do not fit pad_to={pad_to}")
        padded = np.full(pad_to, PAD, dtype=np.int32)
        padded[: slots.size] = slots
        return padded

    def flag_tail_shared(self, rows: Rows) -> None:
        self.tail_shared[rows] = True

    def clear_tail_shared(self, rows: Rows) -> None:
        self.tail_shared[rows] = False
