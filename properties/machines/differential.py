"""``impl.BlockManager`` against ``spec.BlockManager`` in lockstep (same results and exception
classes, then the whole state), on small pools, with bad input (wrong types, unknown, repeated,
stale, free ids) and the array API; ``IMPL`` is swappable. Also the shared bad-input strategies."""

from __future__ import annotations

from dataclasses import dataclass
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
from properties.machines.lockstep import Lockstep
from properties.outcomes import outcome

BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 16])


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
    assert expected[0] == actual[0]
    if expected[0] == "raised":
        assert expected[1] is actual[1]


@dataclass(eq=False)
class Table:
    """A table both managers hand out, and every table it has been (the current one last)."""

    blocks: list[int | None]  # None: released by a sliding window
    history: list[list[int | None]]

    def replace(self, blocks: list[int | None]) -> None:
        self.blocks = blocks
        self.history.append(blocks)


def made(kind: str, blocks: Any) -> Any:
    """The bundle entries for a call that may have made a table: one on success, else none."""
    return multiple(Table(blocks, [blocks])) if kind == "ok" else multiple()


class DifferentialMachine(Lockstep, RuleBasedStateMachine):
    """``tables``: the live tables; ``every_table`` also the freed and replaced ones."""

    IMPL: ClassVar[type] = ImplBlockManager
    tables = Bundle("tables")
    every_table = Bundle("every_table")

    @initialize(total_blocks=st.integers(1, 32), block_size=BLOCK_SIZES)
    def start(self, total_blocks: int, block_size: int) -> None:
        self.model = spec_bm.BlockManager(total_blocks, block_size)
        self.impl = self.IMPL(total_blocks, block_size)
        self.total_blocks, self.block_size = total_blocks, block_size

    def step(self, table: Table, name: str, *args: Any, as_tuple: bool = False) -> bool:
        """``name(table.blocks, *args)`` on both; on success the result replaces the table."""
        kind, result = self.both(name, tuple(table.blocks) if as_tuple else table.blocks, *args)
        if kind == "ok":
            table.replace(result)
        return kind == "ok"

    def grow(self, table: Table, *args: Any) -> None:
        self.step(table, "append_slot", *args)

    def free_array(self, table: list[int | None]) -> None:
        """``free_array`` against the spec's ``free`` (a table with released entries: ``free``)."""
        if None in table:
            self.both("free", table)
            return
        expected = outcome(self.model.free, list(table))
        actual = outcome(self.impl.free_array, np.array(table, dtype=np.int64))
        assert expected == actual, f"free {table}: spec {expected}, impl free_array {actual}"

    @rule(
        targets=(tables, every_table),
        num_blocks=st.one_of(st.integers(0, 3), st.integers(0, 34)),
        as_array=st.booleans(),
    )
    def allocate(self, num_blocks: int, as_array: bool) -> Any:
        impl_name = "allocate_array" if as_array else "allocate"
        return made(*self.both("allocate", num_blocks, impl_name=impl_name))

    @rule(
        targets=(tables, every_table),
        value=st.one_of(st.integers(-2, 40), bad_scalars()),
        call=st.sampled_from(["allocate", "can_allocate", "ref_count"]),
    )
    def odd_scalar_argument(self, value: object, call: str) -> Any:
        """A count or block id: a bad type, a negative or huge int, an int subclass."""
        kind, result = self.both(call, value)
        return made(kind, result) if call == "allocate" else multiple()

    @rule(
        table=tables,
        value=st.one_of(st.integers(-2, 40), bad_scalars()),
        count=st.integers(0, 40),
        where=st.sampled_from(["token_count", "new_tokens", "token_pos", "truncate"]),
    )
    def odd_scalar_on_a_table(self, table: Table, value: object, count: int, where: str) -> None:
        """The same for the int parameters of ``append_slot``, ``translate_slot``, ``truncate``."""
        if where == "token_pos":
            self.both("translate_slot", table.blocks, value)
        elif where == "truncate":
            self.step(table, "truncate", value)
        elif where == "token_count":
            self.grow(table, value, min(count, 2))
        else:
            self.grow(table, count, value)

    @rule(table=tables, data=st.data())
    def append_slot(self, table: Table, data: st.DataObject) -> None:
        capacity = len(table.blocks) * self.block_size
        token_count = data.draw(st.integers(0, capacity + 3 * self.block_size), label="count")
        new_tokens = data.draw(st.integers(0, min(token_count, 2 * self.block_size + 1)))
        self.grow(table, token_count, new_tokens)

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def append_one(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """The decode step: the table's tokens are its capacity minus a little, plus one."""
        size = len(table.blocks) * self.block_size
        filled = data.draw(st.integers(max(0, size - self.block_size), size), label="filled")
        self.step(table, "append_slot", filled + 1, as_tuple=as_tuple)

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def truncate(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """Roll back to any count the table holds (drafts rejected), or past it (refused)."""
        capacity = len(table.blocks) * self.block_size
        count = data.draw(st.integers(0, capacity) | st.integers(-1, capacity + 2), label="count")
        self.step(table, "truncate", count, as_tuple=as_tuple)

    @rule(table=tables, data=st.data())
    def speculate(self, table: Table, data: st.DataObject) -> None:
        """Write the last token and ``k`` drafts (lookahead first, maybe), keep ``1 + j``."""
        filled = data.draw(st.integers(0, len(table.blocks) * self.block_size), label="filled")
        drafts = data.draw(st.integers(0, 2 * self.block_size), label="k")
        if data.draw(st.booleans(), label="reserve first"):
            self.grow(table, filled + 1 + drafts, 0)
        if self.step(table, "append_slot", filled + 1 + drafts, 1 + drafts):
            self.step(table, "truncate", filled + 1 + data.draw(st.integers(0, drafts), label="j"))

    @rule(table=tables, data=st.data(), as_tuple=st.booleans())
    def release_outside_window(self, table: Table, data: st.DataObject, as_tuple: bool) -> None:
        """Sliding window at any count the table holds (or past it), any window (or a bad one)."""
        capacity = len(table.blocks) * self.block_size
        count = data.draw(st.integers(0, capacity) | st.integers(-1, capacity + 2), label="count")
        window = data.draw(
            st.integers(1, 3 * self.block_size) | st.integers(-1, 0) | bad_scalars(), label="window"
        )
        self.step(table, "release_outside_window", count, window, as_tuple=as_tuple)

    @rule(table=tables, window=st.integers(1, 8), steps=st.integers(1, 8))
    def decode_with_window(self, table: Table, window: int, steps: int) -> None:
        """Mistral's decode loop on a full table: a token, then release what left the window."""
        for _ in range(steps):
            count = len(table.blocks) * self.block_size + 1
            self.grow(table, count)
            if not self.step(table, "release_outside_window", count, window):
                return

    @rule(targets=(tables, every_table), table=tables)
    def fork(self, table: Table) -> Any:
        return made(*self.both("fork", table.blocks))

    @rule(table=consumes(tables), as_array=st.booleans())
    def free(self, table: Table, as_array: bool) -> None:
        if as_array:
            self.free_array(table.blocks)
        else:
            self.both("free", table.blocks)

    @rule(table=tables, data=st.data())
    def translate_slot(self, table: Table, data: st.DataObject) -> None:
        capacity = len(table.blocks) * self.block_size
        position = data.draw(st.integers(0, max(0, capacity - 1)) | st.integers(-1, capacity + 2))
        self.both("translate_slot", table.blocks, position)

    @rule(targets=(tables, every_table), table=tables, data=st.data(), write_copy=st.booleans())
    def fork_then_write(self, table: Table, data: st.DataObject, write_copy: bool) -> Any:
        """Beam search: fork, write into either from a shared block on (copy-on-write, growth)."""
        kind, blocks = self.both("fork", table.blocks)
        if kind == "raised":  # a stale free released this table's blocks: spec and impl agree
            return multiple()
        child = Table(blocks, [blocks])
        writer = child if write_copy else table
        capacity = len(writer.blocks) * self.block_size
        written = data.draw(st.integers(1, max(1, capacity + self.block_size)), label="count")
        self.grow(writer, written, data.draw(st.integers(1, min(written, self.block_size + 1))))
        return child

    @rule(twice=st.booleans())
    def pop_copy_pairs(self, twice: bool) -> None:
        self.both("pop_copy_pairs")
        if twice:
            self.both("pop_copy_pairs")

    @rule(
        targets=(tables, every_table),
        table=every_table,
        which=st.integers(0, 7),
        operation=st.sampled_from(["free", "fork", "append_slot", "array", "truncate"]),
    )
    def stale_table(self, table: Table, which: int, operation: str) -> Any:
        """A table that was freed or replaced: its blocks may be free or owned by others."""
        blocks = table.history[which % len(table.history)]
        if operation == "array":
            self.free_array(blocks)
            return multiple()
        if operation in ("free", "truncate"):
            self.both(operation, blocks, *((0,) if operation == "truncate" else ()))
            return multiple()
        args = (len(blocks) * self.block_size,) if operation == "append_slot" else ()
        return made(*self.both(operation, blocks, *args))  # it may be live again

    @rule(
        table=tables,
        repeated=st.integers(0, 40),
        data=st.data(),
        operation=st.sampled_from(["free", "fork", "translate", "array", "truncate"]),
    )
    def repeated_ids(
        self, table: Table, repeated: int, data: st.DataObject, operation: str
    ) -> None:
        """A live table (or ``[0]`` for an empty one) with one of its ids repeated."""
        ids = table.blocks or [0]
        doubled = data.draw(st.permutations([*ids, ids[repeated % len(ids)]]), label="order")
        if operation == "array":
            self.free_array(doubled)
        elif operation in ("translate", "truncate"):
            self.both("translate_slot" if operation == "translate" else "truncate", doubled, 0)
        else:
            self.both(operation, doubled)

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
        args = {
            "append_slot": (table, 3),
            "translate_slot": (table, 0),
            "truncate": (table, 1),
            "release_outside_window": (table, 2, 1),
        }
        args = args.get(operation, (table,))
        kind, result = self.both(operation, *args)
        return made(kind, result) if operation in ("fork", "append_slot") else multiple()

    @rule(
        ids=st.lists(st.one_of(st.integers(-2, 34), st.sampled_from([2**31, -(2**40)])), max_size=4)
    )
    def forged_array(self, ids: list[int]) -> None:
        """``free_array`` on any int64 array: unknown, repeated, free or held ids."""
        self.free_array(ids)

    @rule(
        total_blocks=st.one_of(st.integers(-1, 3), not_ints()),  # no huge pools: the spec
        block_size=st.one_of(st.integers(-1, 3), bad_scalars()),  # builds one object a block
    )
    def construct(self, total_blocks: object, block_size: object) -> None:
        assert_same_construction(spec_bm.BlockManager, self.IMPL, total_blocks, block_size)

    @invariant()
    def same_state(self) -> None:
        """Queue order, free count, reference counts and (copied) pending copy pairs agree."""
        assert self.model.free_block_ids() == self.impl.free_block_ids()
        assert self.model.num_free_blocks == self.impl.num_free_blocks
        assert self.model.usage == self.impl.usage
        assert [block.ref_count for block in self.model.blocks] == self.impl.ref_counts().tolist()
        for block_id in range(self.total_blocks):
            assert self.model.ref_count(block_id) == self.impl.ref_count(block_id)
        assert self.impl.pending_copy_pairs() == self.model.pending_copy_pairs()
        assert self.impl.waiting_for_copy == self.model.waiting_for_copy
