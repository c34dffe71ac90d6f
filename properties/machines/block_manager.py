"""The block managers in lockstep: impl (``IMPL``) against the spec (``SPEC``), with the same
results of the same types or exception classes, then the whole state, and both against the
independent ``BlockModel``. Pools are small (1 to 32 blocks). Bad input is fed too: wrong
types, unknown, repeated, stale and forged ids, tuples, and impl's array API. KV data is
simulated: each token stores a unique value at its slot and copy pairs copy blocks. While the
caller is honest (no stale or forged table accepted), every live table reads back exactly its
own tokens. Also the bad-input strategies other machines share."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
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

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from properties.block_model import BlockModel
from properties.machines.lockstep import Lockstep, same_outcome
from properties.outcomes import outcome

BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 16])
FOREIGN_ARGS = {"append_slot": (3,), "translate_slot": (0,), "truncate": (1,),
                "release_outside_window": (2, 1)}  # fmt: skip
"""The arguments after a table the caller may not hold (a table error comes first)."""


class IntSubclass(int):
    """An int subclass: the spec accepts it as a block id or count, and so must impl."""


def not_ints() -> st.SearchStrategy[object]:
    """Things the spec refuses where it wants an int (``TypeError``)."""
    return st.one_of(
        st.booleans(), st.floats(allow_nan=False, min_value=-2, max_value=40), st.none(),
        st.text(max_size=2), st.sampled_from([np.int64(1), np.int32(2), np.float64(3.0)]),
    )  # fmt: skip


def odd_ints() -> st.SearchStrategy[object]:
    """Ints the spec accepts as ints but that sit outside every range, or are a subclass."""
    return st.one_of(
        st.integers(-3, -1),
        st.sampled_from([2**31, 2**40, 2**63, 2**64, 2**70, -(2**70)]),
        st.builds(IntSubclass, st.integers(0, 33)),
    )


def bad_scalars() -> st.SearchStrategy[object]:
    return st.one_of(not_ints(), odd_ints())


def assert_same_construction(spec_cls: type, impl_cls: type, *args: object) -> None:
    """Both constructors succeed on ``args``, or both raise the same exception class."""
    expected, actual = outcome(spec_cls, *args), outcome(impl_cls, *args)
    assert expected[0] == actual[0] and (expected[0] == "ok" or expected[1] is actual[1])


@dataclass(eq=False)
class Table:
    """A table the managers handed out, every table it has been (the current one last), the
    caller's token count and the value stored at each position written."""

    blocks: list[int | None]  # None: released by a sliding window
    history: list[list[int | None]]
    count: int = 0
    tokens: dict[int, int] = field(default_factory=dict)

    def replace(self, blocks: list[int | None]) -> None:
        self.blocks = blocks
        self.history.append(blocks)


class BlockManagerMachine(Lockstep, RuleBasedStateMachine):
    """``tables``: the live tables; ``every_table`` also the freed and replaced ones. An
    ``HONEST`` caller passes a table it does not hold only where the rules refuse it."""

    SPEC: ClassVar[type] = spec_bm.BlockManager
    IMPL: ClassVar[type] = ImplBlockManager
    HONEST: ClassVar[bool] = False
    tables = Bundle("tables")
    every_table = Bundle("every_table")

    @initialize(total_blocks=st.integers(1, 32), block_size=BLOCK_SIZES)
    def start(self, total_blocks: int, block_size: int) -> None:
        self.model = self.SPEC(total_blocks, block_size)
        self.impl = self.IMPL(total_blocks, block_size)
        self.rules = BlockModel(total_blocks, block_size)
        self.total_blocks, self.size = total_blocks, block_size
        self.live: list[Table] = []
        self.cache: dict[int, int] = {}  # physical slot -> stored token value
        self.values = itertools.count(1)
        self.honest = True  # no call on a table the caller does not hold was accepted

    def snapshot(self) -> tuple[object, ...]:
        return tuple(
            (manager.free_block_ids(), [manager.ref_count(b) for b in range(self.total_blocks)],
             manager.num_free_blocks, manager.pending_copy_pairs(), list(manager.waiting_for_copy))
            for manager in (self.model, self.impl)
        )  # fmt: skip

    def expect(self, name: str, *args: Any) -> tuple[str, Any]:
        """The spec's outcome, which must be the rules' (a result of the same types)."""
        rules = getattr(self.rules, name)(*args)
        ruled = ("raised", rules.error) if rules.error else ("ok", rules.value)
        expected = outcome(getattr(self.model, name), *args)
        assert same_outcome(ruled, expected), f"{name}{args}: rules {ruled}, spec {expected}"
        return expected

    def made(self, kind: str, blocks: Any, parent: Table | None = None) -> Any:
        """The bundle entry for a call that may have made a table (a fork: its parent's tokens)."""
        if kind != "ok":
            return multiple()
        table = Table(blocks, [blocks])
        if parent is not None:
            table.count, table.tokens = parent.count, dict(parent.tokens)
        self.live.append(table)
        return table

    def foreign(self, name: str, table: Any, *args: Any) -> Any:
        """``name(table, *args)`` for a table the caller may not hold ("array": ``free_array``):
        accepting one with ids makes the caller dishonest (they may be another table's)."""
        args = args or FOREIGN_ARGS.get(name, ())
        if self.HONEST and name != "translate_slot" and self.rules.table_error(table) is None:
            return multiple()
        kind, result = self.free_array(table) if name == "array" else self.both(name, table, *args)
        if kind == "ok" and name != "translate_slot" and any(b is not None for b in table):
            self.honest = False
        return self.made(kind, result) if name in ("fork", "append_slot") else multiple()

    def free_array(self, blocks: list[int | None]) -> tuple[str, Any]:
        """``free_array`` against the spec's ``free`` (a table with released entries: ``free``)."""
        return self.both("free", blocks, impl_name=None if None in blocks else "free_array")

    def step(self, table: Table, name: str, *args: Any, as_tuple: bool = False) -> bool:
        """``name(table.blocks, *args)`` on all; on success the result replaces the table."""
        kind, result = self.both(name, tuple(table.blocks) if as_tuple else table.blocks, *args)
        if kind == "ok":
            table.replace(result)
        return kind == "ok"

    def store(self, table: Table, first: int, count: int) -> None:
        """Store a fresh value at positions ``first .. count - 1``: the table holds ``count``."""
        for pos in range(first, count):
            slot = table.blocks[pos // self.size] * self.size + pos % self.size
            table.tokens[pos] = self.cache[slot] = next(self.values)
        table.count = count

    def grow(self, table: Table, count: Any, *new: Any, as_tuple: bool = False) -> bool:
        """``append_slot(table, count, *new)``; on success the caller copies the new pairs,
        then writes the new tokens, each into a block it alone holds."""
        pairs = len(self.rules.copy_pairs)
        if not self.step(table, "append_slot", count, *new, as_tuple=as_tuple):
            return False
        for src, dst in self.rules.copy_pairs[pairs:]:
            for offset in range(self.size):
                if src * self.size + offset in self.cache:
                    self.cache[dst * self.size + offset] = self.cache[src * self.size + offset]
        first = count - (new[0] if new else 1)
        for block in {table.blocks[pos // self.size] for pos in range(first, count)}:
            assert self.model.ref_count(block) == 1, f"write into shared block {block}"
        self.store(table, first, count)
        return True

    def write(self, table: Table, count: int, new: int, reserve: int | None) -> bool:
        """Reserve up to ``reserve`` (unless None), then write the last ``new`` of ``count``."""
        return (reserve is None or self.grow(table, reserve, 0)) and self.grow(table, count, new)

    def roll_back(self, table: Table, count: Any, as_tuple: bool = False) -> None:
        if self.step(table, "truncate", count, as_tuple=as_tuple):
            table.count = count
            table.tokens = {pos: value for pos, value in table.tokens.items() if pos < count}

    def release(self, table: Table, count: Any, window: Any, as_tuple: bool = False) -> bool:
        """Slide a window; a table as long as its count needs then holds what the window reads,
        and its last released position is no slot."""
        if not self.step(table, "release_outside_window", count, window, as_tuple=as_tuple):
            return False
        if None in table.blocks:
            self.both("translate_slot", table.blocks, table.blocks.count(None) * self.size - 1)
        if len(table.blocks) == -(-count // self.size):  # memory bounded by the window
            held = sum(b is not None for b in table.blocks)
            assert held <= -(-(window - 1) // self.size) + 1, (held, window)
        return True

    @rule(targets=(tables, every_table), data=st.data(), as_array=st.booleans())
    def allocate(self, data: st.DataObject, as_array: bool) -> Any:
        """A prompt's blocks (or more than are free), then its tokens, into its last block."""
        free, size = len(self.rules.queue), self.size
        count = data.draw(st.integers(0, 3) | st.integers(0, 34) | st.integers(free + 1, free + 3))
        table = self.made(*self.both("allocate", count, impl_name=as_array and "allocate_array"))
        if isinstance(table, Table) and count:
            self.store(table, 0, data.draw(st.integers(count * size - size + 1, count * size)))
        return table

    @rule(targets=(tables, every_table), value=st.one_of(st.integers(-2, 40), bad_scalars()))
    def odd_scalar_argument(self, value: object) -> Any:
        """A count or block id: a bad type, a negative or huge int, an int subclass."""
        self.both("can_allocate", value)
        self.both("ref_count", value)
        return self.made(*self.both("allocate", value))

    @rule(offset=st.integers(-2, 1))
    def can_allocate(self, offset: int) -> None:
        """``can_allocate`` for 0 and at the free count's boundary."""
        for count in (0, max(0, len(self.rules.queue) + offset)):
            self.both("can_allocate", count)

    @rule(
        table=tables, value=st.one_of(st.integers(-2, 40), bad_scalars()), count=st.integers(0, 40)
    )
    def odd_scalar_on_a_table(self, table: Table, value: Any, count: int) -> None:
        """The same as each int parameter of the calls on a table, the others valid."""
        self.both("translate_slot", table.blocks, value)
        self.grow(table, value, min(count, 2))
        self.grow(table, count, value)
        self.release(table, min(count, len(table.blocks) * self.size), value)
        self.release(table, value, count + 1)
        self.roll_back(table, value)

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def append_slot(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """Any count up to three blocks past the capacity, or a decode step at its edge
        (``new_tokens`` left at its default, one)."""
        capacity = len(table.blocks) * self.size
        if data.draw(st.booleans(), label="decode"):
            count = data.draw(st.integers(max(0, capacity - self.size), capacity), label="filled")
            self.grow(table, count + 1, as_tuple=as_tuple)
            return
        count = data.draw(st.integers(0, capacity + 3 * self.size), label="count")
        new_tokens = data.draw(st.integers(0, min(count, 2 * self.size + 1)), label="new")
        self.grow(table, count, new_tokens, as_tuple=as_tuple)

    @rule(
        table=tables,
        new_tokens=st.one_of(st.just(1), st.integers(0, 40)),
        lookahead=st.one_of(st.just(0), st.integers(0, 20)),
    )
    def append(self, table: Table, new_tokens: int, lookahead: int) -> None:
        """Write ``new_tokens`` tokens; ``lookahead`` slots past the count reserved first."""
        self.write(table, table.count + new_tokens, new_tokens, table.count + lookahead)

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def truncate(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """Roll back to any count the table holds (drafts rejected), or past it (refused)."""
        capacity = len(table.blocks) * self.size
        count = data.draw(
            st.integers(0, capacity)
            | st.integers(-2, capacity + self.size)
            | st.integers(capacity + 1, capacity + self.size),  # past the capacity: refused
            label="count",
        )
        self.roll_back(table, count, as_tuple)

    @rule(table=tables, data=st.data())
    def speculate(self, table: Table, data: st.DataObject) -> None:
        """Write the last token and ``k`` drafts (maybe reserving first), keep ``1 + j``."""
        capacity = len(table.blocks) * self.size
        filled = data.draw(st.just(table.count) | st.integers(0, capacity), label="filled")
        drafts = data.draw(st.integers(0, 6) | st.integers(0, 2 * self.size), label="k")
        reserve = data.draw(st.sampled_from([filled, filled + 1 + drafts, None]), label="reserve")
        if self.write(table, filled + 1 + drafts, 1 + drafts, reserve):
            self.roll_back(table, filled + 1 + data.draw(st.integers(0, drafts), label="j"))

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def release_outside_window(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """A window at the count or any other (maybe past the capacity), of any width."""
        capacity = len(table.blocks) * self.size
        count = data.draw(
            st.just(table.count)
            | st.integers(-1, capacity + 2)
            | st.integers(capacity + 1, capacity + self.size),  # past the capacity: refused
            label="count",
        )
        window = data.draw(st.integers(1, 20) | st.integers(1, 3 * self.size), label="window")
        self.release(table, count, window, as_tuple)

    @rule(table=tables, window=st.integers(1, 8), steps=st.integers(0, 8), back=st.integers(1, 8))
    def decode_with_window(self, table: Table, window: int, steps: int, back: int) -> None:
        """Mistral's decode loop on a full table (a token, then release what left the window), a
        beam's next token, then roll ``back`` tokens back and rewrite them: writing a released
        block is refused."""
        for _ in range(steps):
            count = len(table.blocks) * self.size + 1
            if not (self.grow(table, count) and self.release(table, count, window)):
                return
        beam = self.made(*self.both("fork", table.blocks), parent=table)
        if isinstance(beam, Table):  # a beam's next token: its last block is copied on write
            self.grow(beam, beam.count + 1)
            self.free(beam)
        self.release(table, table.count, window)
        self.roll_back(table, max(0, table.count - back))
        self.write(table, table.count + back, back, table.count)

    @rule(twice=st.booleans())
    def pop_copy_pairs(self, twice: bool) -> None:
        """Pairs stay pending, failed calls included, until the caller takes them, once."""
        for _ in range(1 + twice):
            self.both("pop_copy_pairs")

    @rule(targets=(tables, every_table), table=tables)
    def fork(self, table: Table) -> Any:
        return self.made(*self.both("fork", table.blocks), parent=table)

    @rule(targets=(tables, every_table), parent=consumes(tables), data=st.data())
    def fork_then_write(self, parent: Table, data: st.DataObject) -> Any:
        """Beam search (maybe under a window): fork, write into either from a shared block on
        (copy-on-write, growth), maybe free the parent: a pending copy's source may lose its
        last table first."""
        if window := data.draw(st.none() | st.integers(1, 8), label="window"):
            self.release(parent, parent.count, window)
        child = self.made(*self.both("fork", parent.blocks), parent=parent)
        if not isinstance(child, Table):  # a stale free released the parent's blocks
            return parent
        writer = data.draw(st.sampled_from([child, parent]), label="writer")
        new_tokens = data.draw(st.integers(1, 8), label="new")
        capacity = len(writer.blocks) * self.size
        count = data.draw(
            st.just(writer.count + new_tokens)
            | st.integers(new_tokens, max(new_tokens, capacity + self.size))
        )
        self.grow(writer, count, new_tokens)
        if data.draw(st.booleans(), label="free the parent"):
            self.free(parent)
            return child
        return multiple(parent, child)

    @rule(table=consumes(tables), as_array=st.booleans())
    def free(self, table: Table, as_array: bool = False) -> None:
        self.free_array(table.blocks) if as_array else self.both("free", table.blocks)
        self.live.remove(table)

    @rule(table=tables, data=st.data())
    def translate_slot(self, table: Table, data: st.DataObject) -> None:
        capacity = len(table.blocks) * self.size
        position = data.draw(
            st.integers(0, max(0, capacity - 1)) | st.integers(-2, max(60, capacity + 2))
        )
        self.both("translate_slot", table.blocks, position)

    @rule(
        table=tables,
        data=st.data(),
        operation=st.sampled_from(
            ["free", "fork", "append_slot", "translate_slot", "array", "truncate"]
        ),
    )
    def repeated_or_unknown_id(self, table: Table, data: st.DataObject, operation: str) -> None:
        """A live table (``[0]`` for an empty one) with one more id anywhere: one of its own
        repeated, then one the pool does not have."""
        ids, total = table.blocks or [0], self.total_blocks
        for extra in (st.sampled_from(ids), st.sampled_from([-1, total, total + 7])):
            self.foreign(operation, data.draw(st.permutations([*ids, data.draw(extra)])))

    @rule(
        targets=(tables, every_table),
        table=every_table,
        which=st.integers(0, 7),
        operation=st.sampled_from(
            ["free", "fork", "append_slot", "array", "truncate", "translate_slot"]
        ),
    )
    def stale_table(self, table: Table, which: int, operation: str) -> Any:
        """A table that was freed or replaced: its blocks may be free or owned by others."""
        blocks = table.history[which % len(table.history)]
        full = len(blocks) * self.size  # its capacity: no growth
        args = {"append_slot": (full,), "truncate": (0,), "translate_slot": (which % 4,)}
        return self.foreign(operation, blocks, *args.get(operation, ()))

    @rule(
        targets=(tables, every_table),
        table=st.one_of(
            st.lists(st.one_of(st.none(), st.integers(-2, 34), bad_scalars()), max_size=4),
            st.sampled_from([None, 3, "ab", {1}, range(2), np.array([0, 1])]),
        ),
        operation=st.sampled_from(
            ["free", "fork", "append_slot", "translate_slot", "truncate", "release_outside_window"]
        ),
    )
    def forged_table(self, table: Any, operation: str) -> Any:
        """Any list (unknown, wrong-type, released, free or held ids, any order), or no list."""
        return self.foreign(operation, table)

    @rule(
        ids=st.lists(st.one_of(st.integers(-2, 34), st.sampled_from([2**31, -(2**40)])), max_size=4)
    )
    def forged_array(self, ids: list[int]) -> None:
        """``free_array`` on any int64 array: unknown, repeated, free or held ids."""
        self.foreign("array", ids)

    @rule(
        total_blocks=st.one_of(st.integers(-1, 3), not_ints()),  # no huge pools: the spec
        block_size=st.one_of(st.integers(-1, 3), bad_scalars()),  # builds one object a block
    )
    def construct(self, total_blocks: object, block_size: object) -> None:
        assert_same_construction(self.SPEC, self.IMPL, total_blocks, block_size)

    @invariant()
    def same_state(self) -> None:
        """Spec, impl and the rules agree: the queue in order, the free count and usage,
        reference counts, pending copy pairs and the sources waiting for them; each block is
        in one state, and no pending pair writes what an earlier one reads."""
        spec, impl, rules, total = self.model, self.impl, self.rules, self.total_blocks
        assert spec.free_block_ids() == impl.free_block_ids() == rules.queue
        assert spec.num_free_blocks == impl.num_free_blocks == len(rules.queue)
        assert spec.usage == impl.usage == (total - len(rules.queue)) / total
        assert [block.ref_count for block in spec.blocks] == impl.ref_counts().tolist()
        for block_id in range(total):
            assert spec.ref_count(block_id) == impl.ref_count(block_id) == rules.refs[block_id]
            waiting = block_id in rules.parked
            in_queue = block_id in rules.queue
            assert in_queue == (rules.refs[block_id] == 0 and not waiting), f"block {block_id}"
        assert spec.pending_copy_pairs() == impl.pending_copy_pairs() == rules.copy_pairs
        assert spec.waiting_for_copy == impl.waiting_for_copy == rules.parked
        read: set[int] = set()
        for src, dst in rules.copy_pairs:
            read.add(src)
            assert dst not in read, f"pair {(src, dst)} overwrites a pending source"

    @invariant()
    def live_tables_read_their_own_tokens(self) -> None:
        """While the caller is honest: each reference count is the live tables' holds, and
        every live table reads back exactly the tokens it wrote."""
        if not self.honest:
            return
        held = [b for table in self.live for b in table.blocks if b is not None]
        assert self.rules.refs == [held.count(b) for b in range(self.total_blocks)]
        for table in self.live:
            for pos, value in table.tokens.items():
                block = table.blocks[pos // self.size]
                slot = None if block is None else block * self.size + pos % self.size
                assert block is None or self.cache.get(slot) == value, f"{slot} lost {pos}"
