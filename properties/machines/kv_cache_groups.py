"""The KV-cache group rules in lockstep: ``spec.kv_cache_groups`` (``SPEC``) against the
independent ``GroupsModel``, outcomes and the pool's whole state after every call. A sequence
runs Mistral-style steps (release what the step's first query cannot read, then write), forks,
rollbacks and frees; bad input is fed too (a table of another group, tables of two sequences,
the wrong number of tables, bad counts). KV data is simulated per group: each written position
stores a fresh value at its group's slot, copies copy blocks, and after every step each live
table reads back its own tokens and a sliding group holds no more than its window needs."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from pagedkv.spec.kv_cache_groups import GroupedBlockManager
from properties.groups_model import GroupsModel
from properties.machines.lockstep import Lockstep

WINDOWS = st.lists(st.none() | st.integers(1, 12), min_size=1, max_size=4)


@dataclass(eq=False)
class Seq:
    """A sequence the caller holds: its tables, token count and the value at each (group, pos)."""

    tables: list[list[int | None]]
    count: int = 0
    values: dict[tuple[int, int], int] = field(default_factory=dict)


class GroupsMachine(Lockstep, RuleBasedStateMachine):
    """Lockstep's ``impl`` side is the spec here (there is no grouped impl yet)."""

    SPEC: ClassVar[type] = GroupedBlockManager
    seqs = Bundle("seqs")

    @initialize(total_blocks=st.integers(1, 40), block_size=st.sampled_from([1, 2, 3, 4, 8]),
                windows=WINDOWS)  # fmt: skip
    def start(self, total_blocks: int, block_size: int, windows: list[int | None]) -> None:
        self.impl = self.SPEC(total_blocks, block_size, windows)
        self.model = GroupsModel(total_blocks, block_size, windows)
        self.total, self.size, self.windows = total_blocks, block_size, windows
        self.live: list[Seq] = []
        self.cache: dict[int, int] = {}  # slot -> value (a block is one group's at a time)
        self.fresh = itertools.count()
        self.honest = True  # no call on tables the caller does not hold was accepted

    def expect(self, name: str, *args: Any) -> tuple[str, Any]:
        ruled = getattr(self.model, name)(*args)
        return ("raised", ruled.error) if ruled.error else ("ok", ruled.value)

    def snapshot(self) -> tuple[Any, ...]:
        pool = self.impl.pool
        return (pool.free_block_ids(), [pool.ref_count(b) for b in range(self.total)],
                pool.pending_copy_pairs(), list(pool.waiting_for_copy))  # fmt: skip

    def slot(self, seq: Seq, group: int, pos: int) -> int:
        return seq.tables[group][pos // self.size] * self.size + pos % self.size

    def made(self, kind: str, tables: Any, parent: Seq | None = None) -> Any:
        if kind != "ok":
            return multiple()
        seq = Seq(tables, parent.count if parent else 0, dict(parent.values) if parent else {})
        self.live.append(seq)
        return seq

    def write(self, seq: Seq, count: int, new: int) -> bool:
        """``append_slot`` to ``count`` writing the last ``new``: copy the new pairs, then store
        fresh values, each into a block its table alone holds."""
        pairs = len(self.model.pool.copy_pairs)
        args = (count,) if new == 1 else (count, new)  # one new token: the default
        kind, tables = self.both("append_slot", seq.tables, *args)
        if kind != "ok":
            return False
        seq.tables = tables
        for src, dst in self.model.pool.copy_pairs[pairs:]:
            for offset in range(self.size):
                if src * self.size + offset in self.cache:
                    self.cache[dst * self.size + offset] = self.cache[src * self.size + offset]
        for group, pos in itertools.product(range(len(self.windows)), range(count - new, count)):
            assert self.impl.pool.ref_count(seq.tables[group][pos // self.size]) == 1
            seq.values[group, pos] = self.cache[self.slot(seq, group, pos)] = next(self.fresh)
        seq.count = count
        return True

    def release(self, seq: Seq, count: int) -> bool:
        kind, tables = self.both("release_outside_window", seq.tables, count)
        if kind == "ok":
            seq.tables = tables
        return kind == "ok"

    @rule(target=seqs, data=st.data())
    def allocate(self, data: st.DataObject) -> Any:
        """A prompt's tables (or more than fit), then its tokens in every group."""
        free = len(self.model.pool.queue) // len(self.windows) * self.size
        count = data.draw(st.integers(0, free + 1) | st.integers(free, free + 2 * self.size))
        self.both("can_allocate", count)
        seq = self.made(*self.both("allocate", count))
        if isinstance(seq, Seq) and count:
            new = data.draw(st.integers(1, count))
            self.write(seq, count, new)  # the prompt's last ``new`` tokens land in its blocks
        return seq

    @rule(seq=seqs, new=st.integers(1, 9))
    def step(self, seq: Seq, new: int) -> None:
        """A step: release what the first query reads no more, write ``new`` tokens; then each
        sliding group holds at most what the step's window needs."""
        first = seq.count
        if self.release(seq, first) and self.write(seq, first + new, new):
            needed = -(-seq.count // self.size)
            for group, (table, window) in enumerate(zip(seq.tables, self.windows, strict=True)):
                bound = self.impl.held_bound(group, seq.count, new)
                span = needed if window is None else -(-(window + new - 2) // self.size) + 1
                assert bound == min(needed, span), (bound, window, new)  # the formula
                if len(table) == needed:  # no lookahead reserved
                    assert sum(block is not None for block in table) <= bound

    @rule(seq=seqs, data=st.data())
    def odd_append(self, seq: Seq, data: st.DataObject) -> None:
        """Any count and written tokens, into released entries or past the pool, or bad ints."""
        capacity = len(seq.tables[0]) * self.size
        count = data.draw(st.integers(-1, capacity + 3 * self.size) | st.sampled_from([True, 2.0]))
        new = data.draw(st.integers(-1, 2 * self.size + 1))
        if self.write(seq, count, new) is False or new < 0:
            return
        seq.values = {key: value for key, value in seq.values.items() if key[1] < count}

    @rule(seq=seqs, data=st.data())
    def odd_release(self, seq: Seq, data: st.DataObject) -> None:
        """A release at any count, past the capacity refused even with no sliding group."""
        capacity = len(seq.tables[0]) * self.size
        bad = st.sampled_from([None, True, 2.0, -1])
        self.release(seq, data.draw(st.integers(-1, capacity + self.size) | bad))

    @rule(target=seqs, seq=seqs)
    def fork(self, seq: Seq) -> Any:
        return self.made(*self.both("fork", seq.tables), parent=seq)

    @rule(seq=seqs, data=st.data())
    def truncate(self, seq: Seq, data: st.DataObject) -> None:
        """Roll back to any count (drafts rejected), or past the capacity (refused)."""
        count = data.draw(st.integers(-1, len(seq.tables[0]) * self.size + self.size))
        kind, tables = self.both("truncate", seq.tables, count)
        if kind == "ok":
            seq.tables, seq.count = tables, min(seq.count, count)
            seq.values = {key: value for key, value in seq.values.items() if key[1] < count}

    @rule(seq=consumes(seqs))
    def free(self, seq: Seq) -> None:
        self.both("free", seq.tables)
        self.live.remove(seq)
        again = self.both("free", seq.tables)  # refused, unless its ids are held again
        if again[0] == "ok" and any(b is not None for t in seq.tables for b in t):
            self.honest = False

    @rule(seq=seqs, group=st.integers(-1, 4), pos=st.integers(-1, 40))
    def translate_slot(self, seq: Seq, group: int, pos: int) -> None:
        self.both("translate_slot", seq.tables, group, pos)

    @rule(seq=seqs, other=seqs, data=st.data())
    def foreign_tables(self, seq: Seq, other: Seq, data: st.DataObject) -> None:
        """Tables the caller does not hold as one sequence's: groups swapped, mixed with another
        sequence's, one cut short, one too few or many: refused, unless the rules cannot tell
        them from its own."""
        tables = list(seq.tables)
        kind = data.draw(st.sampled_from(["swap", "mix", "cut", "short", "long"]))
        if kind == "swap" and len(tables) > 1:
            tables[0], tables[-1] = tables[-1], tables[0]
        elif kind == "mix":
            tables[-1] = other.tables[-1]
        elif kind == "cut":  # one table a block shorter: still live, but not the others' length
            tables[-1] = tables[-1][:-1]
        else:
            tables = tables[:-1] if kind == "short" else [*tables, tables[0]]
        self.both("translate_slot", tables, 0, 0)
        self.both("append_slot", tables, 0, 0)  # accepted, it changes nothing
        self.both("release_outside_window", tables, 0)

    @rule()
    def pop_copy_pairs(self) -> None:
        self.both("pop_copy_pairs")

    @invariant()
    def same_pool_and_tokens(self) -> None:
        """The pool as the model's; while honest, each block's count is the number of live
        tables holding it, in its own group only, and each table reads back its tokens."""
        model = self.model.pool
        assert self.snapshot() == (model.queue, model.refs, model.copy_pairs, model.parked)
        if not self.honest:
            return
        holders = [0] * self.total
        for seq in self.live:
            for group, table in enumerate(seq.tables):
                for block in filter(lambda b: b is not None, table):
                    holders[block] += 1
                    assert self.impl.group_of[block] == group
        assert holders == model.refs
        for seq in self.live:
            for (group, pos), value in seq.values.items():
                if seq.tables[group][pos // self.size] is not None:
                    assert self.cache[self.slot(seq, group, pos)] == value, (group, pos)
