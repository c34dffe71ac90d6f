"""An independent, minimal model of the block manager's rules (unlike ``spec`` on purpose: a list
queue, explicit loops); each method returns the rules' outcome and changes state only on success."""

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
        count = 0
        for block_id in table:
            if block_id is not None:
                break
            count += 1
        return count

    def table_error(self, table: list[int | None]) -> type[BaseException] | None:
        """The error any call on ``table`` raises for the table alone, or None if it is live."""
        table = table[self._released(table) :]
        if None in table:  # a released entry after a held one
            return TypeError
        for block_id in table:
            if not (0 <= block_id < self.total_blocks):
                return BlockTableError
        if len(set(table)) < len(table):
            return BlockTableError
        for block_id in table:
            if self.refs[block_id] == 0:
                return BlockTableError
        return None

    def _take(self, count: int) -> list[int]:
        taken, self.queue = self.queue[:count], self.queue[count:]
        for block_id in taken:
            self.refs[block_id] = 1
        return taken

    def allocate(self, count: int) -> Outcome:
        if count < 0:
            return Outcome(error=ValueError)
        if count > len(self.queue):
            return Outcome(error=OutOfBlocksError)
        return Outcome(value=self._take(count))

    def append_slot(self, table: list[int], token_count: int, new_tokens: int) -> Outcome:
        error = self.table_error(table)
        if error is None and (token_count < 0 or new_tokens < 0 or new_tokens > token_count):
            error = ValueError
        if error is not None:
            return Outcome(error=error)
        size = self.block_size
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
        error = self.table_error(table)
        if error is not None:
            return Outcome(error=error)
        for block_id in table:
            if block_id is not None:
                self.refs[block_id] += 1
        return Outcome(value=list(table))

    def free(self, table: list[int]) -> Outcome:
        error = self.table_error(table)
        if error is not None:
            return Outcome(error=error)
        self._drop(table)
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
        error = self.table_error(table)
        if error is None and not 0 <= token_count <= len(table) * self.block_size:
            error = ValueError
        if error is not None:
            return Outcome(error=error)
        kept = (token_count + self.block_size - 1) // self.block_size
        self._drop(table[kept:])
        return Outcome(value=table[:kept])

    def release_outside_window(
        self, table: list[int | None], token_count: int, window: int
    ) -> Outcome:
        """Release each leading block wholly before ``token_count - window + 1`` (the next read)."""
        error = self.table_error(table)
        if error is None and not (0 <= token_count <= len(table) * self.block_size and window >= 1):
            error = ValueError
        if error is not None:
            return Outcome(error=error)
        first_read = token_count - window + 1
        outside = 0
        while outside < len(table) and (outside + 1) * self.block_size <= first_read:
            outside += 1
        self._drop(table[:outside])
        return Outcome(value=[None] * outside + table[outside:])

    def translate_slot(self, table: list[int], pos: int) -> Outcome:
        error = self.table_error(table)
        if error is not None:
            return Outcome(error=error)
        if pos < 0:
            return Outcome(error=ValueError)
        if pos >= len(table) * self.block_size:
            return Outcome(error=IndexError)
        if table[pos // self.block_size] is None:
            return Outcome(error=BlockTableError)
        return Outcome(
            value=table[pos // self.block_size] * self.block_size + pos % self.block_size
        )
