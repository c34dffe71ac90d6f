"""An independent model of the KV-cache group rules (not written from ``spec.kv_cache_groups``):
one ``BlockModel`` pool, each block's owning group in a dict, and all-or-nothing by counting
every group's need before anything is taken, where the spec rolls back."""

from __future__ import annotations

from pagedkv.spec import BlockTableError, OutOfBlocksError
from properties.block_model import BlockModel, Outcome, int_error, plain


class GroupsModel:
    def __init__(self, total_blocks: int, block_size: int, windows: list[int | None]) -> None:
        self.pool = BlockModel(total_blocks, block_size)
        self.size, self.windows = block_size, list(windows)
        self.owner: dict[int, int] = {}  # block id -> the group that took it

    def _take(self, group: int, count: int) -> list[int]:
        taken = self.pool.allocate(count).value  # the need was counted: it fits
        self.owner.update(dict.fromkeys(taken, group))
        return taken

    def tables_error(self, tables: object, *counts: tuple[object, int]) -> type | None:
        """The error a call on a sequence's ``tables`` and ``counts`` raises for them alone."""
        if not isinstance(tables, (list, tuple)) or len(tables) != len(self.windows):
            return TypeError
        for table in tables:  # every table's own error comes before the group rules
            if error := self.pool.table_error(table):
                return error
        held = [(g, b) for g, table in enumerate(tables) for b in table if b is not None]
        if (
            any(self.owner[b] != g for g, b in held)  # a block of another group
            or len({len(table) for table in tables}) > 1  # tables of different lengths
        ):
            return BlockTableError
        return next(filter(None, (int_error(value, least) for value, least in counts)), None)

    def allocate(self, count: int) -> Outcome:
        error = int_error(count, 0)
        blocks = 0 if error else -(-count // self.size)
        if error or blocks * len(self.windows) > len(self.pool.queue):
            return Outcome(error=error or OutOfBlocksError)
        return Outcome(value=[self._take(g, blocks) for g in range(len(self.windows))])

    def can_allocate(self, count: int) -> Outcome:
        if error := int_error(count, 0):
            return Outcome(error=error)
        return Outcome(value=-(-count // self.size) * len(self.windows) <= len(self.pool.queue))

    def append_slot(self, tables: list, token_count: int, new_tokens: int = 1) -> Outcome:
        error = self.tables_error(tables, (token_count, 0), (new_tokens, 0))
        if error or new_tokens > token_count:
            return Outcome(error=error or ValueError)
        written = {pos // self.size for pos in range(token_count - new_tokens, token_count)}
        blocks, free, plans = -(-token_count // self.size), len(self.pool.queue), []
        for table in map(plain, tables):  # each group's copies and growth, counted first
            if any(table[i] is None for i in written if i < len(table)):
                return Outcome(error=BlockTableError)
            shared = [i for i in sorted(written) if i < len(table) and self.pool.refs[table[i]] > 1]
            free -= len(shared) + max(0, blocks - len(table))
            if free < 0:
                return Outcome(error=OutOfBlocksError)
            plans.append((table, shared))
        result = []
        for group, (table, shared) in enumerate(plans):
            fresh = self._take(group, len(shared) + max(0, blocks - len(table)))
            for i, new_id in zip(shared, fresh, strict=False):
                self.pool.refs[table[i]] -= 1
                self.pool.copy_pairs.append((table[i], new_id))
                table[i] = new_id
            result.append(table + fresh[len(shared) :])
        return Outcome(value=result)

    def release_outside_window(self, tables: list, token_count: int) -> Outcome:
        error = self.tables_error(tables, (token_count, 0))
        if error or token_count > len(tables[0]) * self.size:
            return Outcome(error=error or ValueError)
        return Outcome(value=[
            plain(table) if window is None
            else self.pool.release_outside_window(table, token_count, window).value
            for table, window in zip(tables, self.windows, strict=True)
        ])  # fmt: skip

    def fork(self, tables: list) -> Outcome:
        if error := self.tables_error(tables):
            return Outcome(error=error)
        return Outcome(value=[self.pool.fork(table).value for table in tables])

    def truncate(self, tables: list, token_count: int) -> Outcome:
        error = self.tables_error(tables, (token_count, 0))
        if error or token_count > len(tables[0]) * self.size:
            return Outcome(error=error or ValueError)
        return Outcome(value=[self.pool.truncate(table, token_count).value for table in tables])

    def free(self, tables: list) -> Outcome:
        if error := self.tables_error(tables):
            return Outcome(error=error)
        for table in tables:
            self.pool.free(table)
        return Outcome(value=None)

    def translate_slot(self, tables: list, group: int, pos: int) -> Outcome:
        error = self.tables_error(tables, (group, 0))
        if error or group >= len(self.windows):
            return Outcome(error=error or ValueError)
        return self.pool.translate_slot(tables[group], pos)

    def pop_copy_pairs(self) -> Outcome:
        return self.pool.pop_copy_pairs()
