"""An independent, minimal model of the block manager's rules, its input rules included (unlike
``spec`` on purpose: a list queue, explicit loops); each method returns the rules' outcome and
changes state only on success."""

from __future__ import annotations

from dataclasses import dataclass

from pagedkv.spec import BlockTableError, OutOfBlocksError


@dataclass
class Outcome:
    value: object = None
    error: type[BaseException] | None = None


def observe(call, *args, **kwargs) -> Outcome:
    try:
        return Outcome(value=call(*args, **kwargs))
    except Exception as exc:  # every exception type is part of the observed behaviour
        return Outcome(error=type(exc))


def int_error(value: object, minimum: int) -> type[BaseException] | None:
    """A count or position is an int, not a bool (``TypeError``), at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        return TypeError
    return ValueError if value < minimum else None


class BlockModel:
    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks = total_blocks
        self.block_size = block_size
        self.queue = list(range(total_blocks))  # head first
        self.refs = [0] * total_blocks
        self.copy_pairs: list[tuple[int, int]] = []
        self.parked: list[int] = []  # copy sources no table holds, until the pairs are popped

    @staticmethod
    def _released(table: list[int | None]) -> int:
        return next((i for i, block_id in enumerate(table) if block_id is not None), len(table))

    def id_error(self, block_id: object) -> type[BaseException] | None:
        """A block id is an int (``TypeError``) of this pool (``BlockTableError``)."""
        if (error := int_error(block_id, 0)) is TypeError:
            return error
        return BlockTableError if error or block_id >= self.total_blocks else None

    def table_error(
        self, table: list[int | None], *counts: tuple[object, int]
    ) -> type[BaseException] | None:
        """The error a call on ``table`` and ``counts`` (``(value, minimum)`` pairs, checked
        after the table) raises for them alone, or None if the table is live."""
        if not isinstance(table, (list, tuple)):
            return TypeError
        held = table[self._released(table) :]
        for block_id in held:  # the first bad id decides; a None after an id is no id
            if error := self.id_error(block_id):
                return error
        if len(set(held)) < len(held) or any(self.refs[b] == 0 for b in held):
            return BlockTableError
        return next(filter(None, (int_error(value, least) for value, least in counts)), None)

    def _take(self, count: int) -> list[int]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        for block_id in taken:
            self.refs[block_id] = 1
        return taken

    def can_allocate(self, count: int) -> Outcome:
        error = int_error(count, 0)
        return Outcome(error=error) if error else Outcome(value=count <= len(self.queue))

    def ref_count(self, block_id: int) -> Outcome:
        error = self.id_error(block_id)
        return Outcome(error=error) if error else Outcome(value=self.refs[block_id])

    def allocate(self, count: int) -> Outcome:
        error = int_error(count, 0) or (count > len(self.queue) and OutOfBlocksError)
        return Outcome(error=error) if error else Outcome(value=self._take(count))

    def append_slot(self, table: list[int], token_count: int, new_tokens: int = 1) -> Outcome:
        error = self.table_error(table, (token_count, 0), (new_tokens, 0))
        if error or new_tokens > token_count:
            return Outcome(error=error or ValueError)
        size, table = self.block_size, plain(table)
        blocks = (token_count + size - 1) // size
        written = {pos // size for pos in range(token_count - new_tokens, token_count)}
        if any(i < self._released(table) for i in written):
            return Outcome(error=BlockTableError)
        shared = [i for i in range(len(table)) if i in written and self.refs[table[i]] > 1]
        growth = max(0, blocks - len(table))
        if len(shared) + growth > len(self.queue):
            return Outcome(error=OutOfBlocksError)
        fresh = self._take(len(shared) + growth)
        result = list(table)
        for i, new_id in zip(shared, fresh, strict=False):
            self.refs[table[i]] -= 1
            self.copy_pairs.append((table[i], new_id))
            result[i] = new_id
        return Outcome(value=result + fresh[len(shared) :])

    def pop_copy_pairs(self) -> Outcome:
        """The pairs made since the last call, oldest first; their parked sources become free."""
        pairs, self.copy_pairs = self.copy_pairs, []
        self.queue += self.parked  # their copies are the caller's now
        self.parked = []
        return Outcome(value=pairs)

    def fork(self, table: list[int]) -> Outcome:
        if error := self.table_error(table):
            return Outcome(error=error)
        for block_id in table:
            if block_id is not None:
                self.refs[block_id] += 1
        return Outcome(value=plain(table))

    def free(self, table: list[int]) -> Outcome:
        if error := self.table_error(table):
            return Outcome(error=error)
        self._drop(plain(table))
        return Outcome(value=None)

    def _drop(self, blocks: list[int | None]) -> None:
        """One hold less on each held entry of ``blocks``, last first; 0 joins the queue."""
        for block_id in blocks[::-1]:
            if block_id is None:
                continue
            self.refs[block_id] -= 1
            if self.refs[block_id] > 0:
                continue
            if any(src == block_id for src, _ in self.copy_pairs):
                self.parked.append(block_id)  # read by a pending copy: not free yet
            else:
                self.queue.append(block_id)

    def truncate(self, table: list[int], token_count: int) -> Outcome:
        """Keep the blocks the first ``token_count`` tokens need; give the rest back, tail first."""
        error = self.table_error(table, (token_count, 0))
        if error or token_count > len(table) * self.block_size:
            return Outcome(error=error or ValueError)
        kept, table = (token_count + self.block_size - 1) // self.block_size, plain(table)
        self._drop(table[kept:])
        return Outcome(value=table[:kept])

    def release_outside_window(
        self, table: list[int | None], token_count: int, window: int
    ) -> Outcome:
        """Release each leading block wholly before ``token_count - window + 1`` (the next read)."""
        error = self.table_error(table, (token_count, 0), (window, 1))
        if error or token_count > len(table) * self.block_size:
            return Outcome(error=error or ValueError)
        first_read, table = token_count - window + 1, plain(table)
        outside = 0
        while outside < len(table) and (outside + 1) * self.block_size <= first_read:
            outside += 1
        self._drop(table[:outside])
        return Outcome(value=[None] * outside + table[outside:])

    def translate_slot(self, table: list[int], pos: int) -> Outcome:
        if error := self.table_error(table, (pos, 0)) or (
            pos >= len(table) * self.block_size and IndexError
        ):
            return Outcome(error=error)
        if table[pos // self.block_size] is None:
            return Outcome(error=BlockTableError)
        return Outcome(
            value=int(table[pos // self.block_size]) * self.block_size + pos % self.block_size
        )


def plain(table: list[int | None]) -> list[int | None]:
    """A checked table as a list of plain ints (an int subclass is taken as its value)."""
    return [None if block_id is None else int(block_id) for block_id in table]
