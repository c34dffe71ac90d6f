"""The one owner of every live sequence's block state: its row, padded table and counts.

:class:`SeqRows` holds, for ``S = max_seqs`` rows of ``M = max_blocks_per_seq`` entries, and
``bs = block_size``. One live row ``r``, a sequence of ``count = token_counts[r]`` tokens whose
sliding window released its first two blocks::

    column    0     1     2     3     4     ...  M-1
    tables   PAD   PAD    17    4     9     PAD  PAD    int32[S, M]
             |released |  held blocks   |  padding  |
             <---- num_blocks[r] = ceil(count / bs) --->
    num_released[r] = 2, num_blocks[r] = 5, token_counts[r] = count (4 * bs < count <= 5 * bs)

* ``tables``: columns ``0 .. num_released[r] - 1`` are released entries (``PAD``: blocks a
  sliding window gave back, the spec's ``None``), then the held block ids up to
  ``num_blocks[r]``; every other entry, and every entry of a free row, is ``PAD``.
* ``num_blocks``, ``num_released``, ``token_counts`` (``int32[S]``).
* ``tail_shared`` (``bool[S]``): rows whose partly filled last block a fork shared, or a
  truncate or window cut into: the only ways a write can reach a block with other owners or a
  key (prefix-cache hits are full blocks, never a table's last one). Conservative: a flag
  outlives the sharing until the row's next growth.
* which row holds each live sequence id (in the order added), and the free rows as a stack
  (the row released last is filled first; row 0 first when none was released).

Everything else reads a sequence's blocks by row through :class:`SeqBatch` (ids resolved to
rows). Blocks move in and out of rows through the unchecked
:class:`~pagedkv.impl.blocks.pool.BlockPool` in the orders the spec's calls would (each
table's last block first); nothing here checks more than ids and counts:
:class:`~pagedkv.impl.blocks.store.BlockTableStore` validates every argument first.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.spec.checks import INT32_MAX, BlockTableError, check_int

PAD = -1
"""The table entry, and the ``slot_mapping`` entry, that stands for "no block" / "no token"."""

Rows = NDArray[np.intp]

SeqIds = Sequence[int] | NDArray[np.integer]
"""Sequence ids as a store's methods take them: a list, tuple or 1-D integer array."""


class CapacityError(ValueError):
    """The store's fixed shape cannot hold the request: no free row, or a table that would need
    more than ``max_blocks_per_seq`` blocks."""


@dataclass(frozen=True, eq=False)
class SeqBatch:
    """An ordered batch of distinct live sequence ids, resolved to their rows.

    Made by ``BlockTableStore.batch``, which checks the ids once. Rows change when sequences
    are removed and others added, so every use resolves the ids again (``KeyError`` if one of
    them is gone): the store's trace benchmark was no faster with a batch that skipped that
    while no sequence was removed (docs/design.md §9).
    """

    seq_ids: tuple[int, ...]
    rows: NDArray[np.intp]
    base: NDArray[np.intp] = field(repr=False)  # rows * max_blocks_per_seq: flat row offsets
    owner: SeqRows = field(repr=False)

    def __len__(self) -> int:
        return len(self.seq_ids)


class SeqRows:
    """``max_seqs`` rows of up to ``max_blocks_per_seq`` entries for blocks of ``block_size``."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, block_size: int) -> None:
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.tables = np.full((max_seqs, max_blocks_per_seq), PAD, dtype=np.int32)
        self.num_blocks = np.zeros(max_seqs, dtype=np.int32)
        self.num_released = np.zeros(max_seqs, dtype=np.int32)
        self.token_counts = np.zeros(max_seqs, dtype=np.int32)
        self.tail_shared = np.zeros(max_seqs, dtype=np.bool_)
        self.free_rows = list(range(max_seqs - 1, -1, -1))  # pop() yields row 0 first
        self._row_of: dict[int, int] = {}
        self._live: SeqBatch | None = None  # every live sequence in the order added, cached

    # ----------------------------------------------------------------- ids and rows

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: object) -> bool:
        return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id in self._row_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._row_of)

    def check_new(self, seq_id: object) -> int:
        """A sequence id that is not live (``ValueError`` if it is)."""
        seq_id = check_seq_id(seq_id)
        if seq_id in self._row_of:
            raise ValueError(f"sequence {seq_id} is already live")
        return seq_id

    def row(self, seq_id: object) -> int:
        """The row of a live sequence (``KeyError`` for an unknown one)."""
        seq_id = check_seq_id(seq_id)
        try:
            return self._row_of[seq_id]
        except KeyError:
            raise KeyError(f"unknown sequence id {seq_id}") from None

    def batch(self, seq_ids: SeqIds) -> SeqBatch:
        """Resolve distinct live sequence ids, in order, to a :class:`SeqBatch`."""
        if isinstance(seq_ids, np.ndarray):
            if seq_ids.ndim != 1 or seq_ids.dtype.kind not in "iu":
                raise TypeError(f"seq_ids must be a 1-D integer array, got {seq_ids.dtype}")
            seq_ids = seq_ids.tolist()
        elif not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"seq_ids must be a list of ints, got {type(seq_ids).__name__}")
        if set(map(type, seq_ids)) != {int}:  # empty, or a bad id or an int subclass
            seq_ids = [check_seq_id(seq_id) for seq_id in seq_ids]
        try:
            rows = np.fromiter(
                map(self._row_of.__getitem__, seq_ids), dtype=np.intp, count=len(seq_ids)
            )
        except KeyError as error:
            raise KeyError(f"unknown sequence id {error.args[0]}") from None
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"sequence ids repeated within one batch: {_repeats(seq_ids)}")
        rows.flags.writeable = False
        return SeqBatch(tuple(seq_ids), rows, rows * self.width, self)

    def resolve(self, seqs: SeqBatch | SeqIds | None) -> SeqBatch:
        """``seqs`` as a current :class:`SeqBatch`: ``None`` is every live sequence in the order
        added (kept until the next addition or removal), ids and a batch's ids are resolved
        with :meth:`batch` (``KeyError`` if one is gone)."""
        if seqs is None:
            if self._live is None:
                rows = np.fromiter(self._row_of.values(), dtype=np.intp, count=len(self._row_of))
                rows.flags.writeable = False
                self._live = SeqBatch(tuple(self._row_of), rows, rows * self.width, self)
            return self._live
        if isinstance(seqs, SeqBatch):
            if seqs.owner is not self:
                raise ValueError("the batch belongs to another BlockTableStore")
            return self.batch(seqs.seq_ids)
        return self.batch(seqs)

    # ----------------------------------------------------------------- reading a row

    @property
    def flat(self) -> NDArray[np.int32]:
        """``tables`` as one flat view: row ``r``, column ``c`` is entry ``r * width + c``."""
        return self.tables.ravel()

    def held(self, row: int) -> NDArray[np.int32]:
        """The blocks row ``row`` holds (its entries after the released ones), a view."""
        return self.tables[row, self.num_released[row] : self.num_blocks[row]]

    # ----------------------------------------------------------------- changing rows

    def place(self, seq_id: int, blocks: IdArray, token_count: int) -> None:
        """Give ``seq_id`` the next free row, holding ``blocks`` and ``token_count`` tokens."""
        row = self.free_rows.pop()
        self.tables[row, : blocks.size] = blocks
        self.num_blocks[row] = blocks.size
        self.token_counts[row] = token_count
        self._add(seq_id, row)

    def copy_row(self, parent: int, seq_id: int) -> int:
        """Give ``seq_id`` the next free row, a copy of row ``parent`` (released entries as
        ``PAD``); return it. The caller gives its held blocks their new owner."""
        row = self.free_rows.pop()
        length = self.num_blocks[parent]
        self.tables[row, :length] = self.tables[parent, :length]
        self.num_blocks[row] = length
        self.num_released[row] = self.num_released[parent]
        self.token_counts[row] = self.token_counts[parent]
        self._add(seq_id, row)
        return row

    def release(self, rows: Rows, seq_ids: Sequence[int], pool: BlockPool) -> None:
        """Free the sequences ``seq_ids`` held in ``rows`` as ``free`` per row in order would
        (each table's last block first; released entries hold nothing), and forget them."""
        if rows.size == 1:
            pool.release(self.held(int(rows[0])).astype(np.intp))
        else:  # several (or no) rows
            reversed_tables = self.tables[rows, ::-1]  # padding first, then last block first
            pool.release_in_order(reversed_tables[reversed_tables != PAD].astype(np.intp))
        self.tables[rows] = PAD
        self.num_blocks[rows] = 0
        self.num_released[rows] = 0
        self.token_counts[rows] = 0
        self.tail_shared[rows] = False
        self.free_rows.extend(rows.tolist())
        for seq_id in seq_ids:
            del self._row_of[seq_id]
        self._live = None

    def cut_into(self, rows: Rows, counts: NDArray[np.int64]) -> tuple[Rows, NDArray[np.intp]]:
        """Of a truncate of ``rows`` to ``counts`` tokens: the batch indices whose kept last
        block is partly kept, and those blocks (``PAD`` where released)."""
        kept = (counts + (self.block_size - 1)) // self.block_size
        cut = (counts % self.block_size != 0).nonzero()[0]
        return cut, self.tables[rows[cut], kept[cut] - 1].astype(np.intp)

    def truncate(self, rows: Rows, counts: NDArray[np.int64], pool: BlockPool) -> None:
        """Roll ``rows`` back to ``counts`` tokens (each at most the row's), as ``truncate`` per
        row in order would: the dropped blocks are released (rows in order, each row's last
        block first). The next write into a partly kept last block takes the growth's general
        path, which copies it if shared (conservative: every such row is flagged)."""
        kept = (counts + (self.block_size - 1)) // self.block_size
        tables = self.tables[rows]  # a copy
        dropped = np.arange(self.width) >= kept[:, None]  # past each row's length: PAD already
        released = tables[:, ::-1][dropped[:, ::-1]]  # each row's last block first
        pool.release_in_order(released[released != PAD].astype(np.intp))
        tables[dropped] = PAD
        self.tables[rows] = tables
        self.num_released[rows] = np.minimum(self.num_released.take(rows), kept)
        self.num_blocks[rows] = kept
        self.token_counts[rows] = counts
        self.tail_shared[rows] = counts % self.block_size != 0

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
        # write there must take the growth's general path, which refuses it.
        lengths = self.num_blocks.take(rows)
        gone = (outside >= lengths) & (self.token_counts.take(rows) % self.block_size != 0)
        if gone.any():
            self.tail_shared[rows[gone]] = True

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

    def _add(self, seq_id: int, row: int) -> None:
        self._row_of[seq_id] = row
        self._live = None


def check_seq_id(seq_id: object) -> int:
    """Rule: a sequence id is an int (not bool); int subclasses are taken by value."""
    if isinstance(seq_id, bool) or not isinstance(seq_id, int):
        raise TypeError(f"sequence id must be an int, got {type(seq_id).__name__}")
    return int(seq_id)


def check_counts(name: str, value: int | SeqIds, size: int) -> int | NDArray[np.int64]:
    """Token counts for a batch of ``size``: one int for all, or one per sequence (returned as
    int64). ``TypeError``/``ValueError`` as ``check_int`` for a bad count, ``ValueError`` for a
    list of the wrong length, ``CapacityError`` above int32 (no sequence holds that many)."""
    if isinstance(value, np.ndarray):
        if value.ndim != 1 or value.dtype.kind not in "iu":
            raise TypeError(f"{name} must be an int or a 1-D integer array")
        value = value.tolist()
    if not isinstance(value, (list, tuple)):
        count = check_int(name, value, 0)
        if count > INT32_MAX:
            raise CapacityError(f"{name}={count} exceeds any sequence's capacity")
        return count
    if len(value) != size:
        raise ValueError(f"{name} has {len(value)} entries for {size} sequences")
    if set(map(type, value)) - {int} or (value and min(value) < 0):
        for count in value:  # the exact error for the first bad entry
            check_int(name, count, 0)
    if value and max(value) > INT32_MAX:
        raise CapacityError(f"{name} exceeds any sequence's capacity")
    return np.array(value, dtype=np.int64)


def _repeats(values: Sequence[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({v for v in values if v in seen or seen.add(v)})
