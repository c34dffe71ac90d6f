"""Sequence ids resolved to rows: :class:`SeqBatch`, the index behind it, and the checks of ids
and per-sequence counts that every batched call of the store makes first."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.tables import CapacityError
from pagedkv.spec.checks import INT32_MAX, check_int

SeqIds = Sequence[int] | NDArray[np.integer]
"""Sequence ids as a store's methods take them: a list, tuple or 1-D integer array."""


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
    _index: SeqIndex = field(repr=False)

    def __len__(self) -> int:
        return len(self.seq_ids)


class SeqIndex:
    """Which row holds each live sequence, in the order the sequences were added."""

    def __init__(self, width: int) -> None:
        self._width = width
        self._row_of: dict[int, int] = {}
        self._live: SeqBatch | None = None  # every live sequence in the order added, cached

    def __len__(self) -> int:
        return len(self._row_of)

    def __contains__(self, seq_id: object) -> bool:
        return isinstance(seq_id, int) and not isinstance(seq_id, bool) and seq_id in self._row_of

    def __iter__(self) -> Iterator[int]:
        return iter(self._row_of)

    def add(self, seq_id: int, row: int) -> None:
        self._row_of[seq_id] = row
        self._live = None

    def remove(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            del self._row_of[seq_id]
        self._live = None

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
        return SeqBatch(tuple(seq_ids), rows, rows * self._width, self)

    def resolve(self, seqs: SeqBatch | SeqIds | None) -> SeqBatch:
        """``seqs`` as a current :class:`SeqBatch`: ``None`` is every live sequence in the order
        added (kept until the next addition or removal), ids and a batch's ids are resolved
        with :meth:`batch` (``KeyError`` if one is gone)."""
        if seqs is None:
            if self._live is None:
                rows = np.fromiter(self._row_of.values(), dtype=np.intp, count=len(self._row_of))
                rows.flags.writeable = False
                ids = tuple(self._row_of)
                self._live = SeqBatch(ids, rows, rows * self._width, self)
            return self._live
        if isinstance(seqs, SeqBatch):
            if seqs._index is not self:
                raise ValueError("the batch belongs to another BlockTableStore")
            return self.batch(seqs.seq_ids)
        return self.batch(seqs)


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
