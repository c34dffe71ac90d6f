"""``impl.BlockManager`` against ``spec.BlockManager``, in lockstep.

Every rule makes the same call on both managers and asserts the same outcome: an equal result of
the same types (lists of plain ints, not numpy ints), or an exception of the same class. After
every step the free queues (in order), the free counts and every block's reference count agree.
Pools are small (1..32 blocks) so exhaustion is common; rules also feed bad input (wrong types,
unknown, repeated, stale and free ids, negative counts) and ``impl``'s array API.

``IMPL`` is a class attribute so that ``test_impl_planted_bugs`` can run this machine against
deliberately broken copies of ``impl``. The spec's own model-based machine
(``properties.block_manager_machine``) runs on ``impl`` too.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from properties.block_manager_machine import block_manager_machine

BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 16])


class IntSubclass(int):
    """An int subclass: the spec accepts it as a block id or count, and so must impl."""


def not_ints() -> st.SearchStrategy[object]:
    """Things the spec refuses where it wants an int (``TypeError``)."""
    return st.one_of(
        st.booleans(),
        st.floats(allow_nan=False, min_value=-2, max_value=40),
        st.none(),
        st.text(max_size=2),
        st.sampled_from([np.int64(1), np.int32(2), np.float64(3.0)]),
    )


def odd_ints() -> st.SearchStrategy[object]:
    """Ints the spec accepts as ints but that sit outside every range, or are a subclass."""
    return st.one_of(
        st.integers(-3, -1),
        st.sampled_from([2**31, 2**40, 2**63, 2**64, 2**70, -(2**70)]),
        st.builds(IntSubclass, st.integers(0, 33)),
    )


def bad_scalars() -> st.SearchStrategy[object]:
    return st.one_of(not_ints(), odd_ints())


def outcome(call: Any, *args: Any) -> tuple[str, Any]:
    """``("ok", result)`` or ``("raised", exception class)``."""
    try:
        return "ok", call(*args)
    except Exception as error:  # the class is what is compared
        return "raised", type(error)


def assert_same_construction(spec_cls: type, impl_cls: type, *args: object) -> None:
    """Both constructors succeed on ``args``, or both raise the same exception class."""
    expected, actual = outcome(spec_cls, *args), outcome(impl_cls, *args)
    assert expected[0] == actual[0]
    if expected[0] == "raised":
        assert expected[1] is actual[1]


def same_types(expected: Any, actual: Any) -> bool:
    """Equal and of the same types, element by element (so no numpy ints slip through)."""
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(actual) and all(map(same_types, expected, actual))
    return bool(expected == actual)


class DifferentialMachine(RuleBasedStateMachine):
    """spec and impl block managers, driven by the same calls."""

    IMPL: ClassVar[type] = ImplBlockManager

    def __init__(self) -> None:
        super().__init__()
        self.live: list[list[int]] = []  # tables both managers hold
        self.dead: list[list[int]] = []  # tables already freed (or replaced by append_slot)

    @initialize(total_blocks=st.integers(1, 32), block_size=BLOCK_SIZES)
    def start(self, total_blocks: int, block_size: int) -> None:
        self.spec = spec_bm.BlockManager(total_blocks, block_size)
        self.impl = self.IMPL(total_blocks, block_size)
        self.total_blocks, self.block_size = total_blocks, block_size

    # ----------------------------------------------------------------- helpers

    def both(self, name: str, *args: Any, impl_name: str | None = None) -> tuple[str, Any]:
        """Call ``name`` on both managers (``impl_name`` on impl), assert the same outcome."""
        spec_args = [list(a) if isinstance(a, list) else a for a in args]
        expected = outcome(getattr(self.spec, name), *spec_args)
        actual = outcome(getattr(self.impl, impl_name or name), *args)
        if impl_name and actual[0] == "ok" and isinstance(actual[1], np.ndarray):
            actual = ("ok", actual[1].tolist())
        assert expected[0] == actual[0], f"{name}{args}: spec {expected}, impl {actual}"
        if expected[0] == "raised":
            assert expected[1] is actual[1], f"{name}{args}: spec {expected}, impl {actual}"
        else:
            assert same_types(expected[1], actual[1]), f"{name}{args}: {expected} vs {actual}"
        for arg, spec_arg in zip(args, spec_args, strict=True):
            if isinstance(arg, list):
                assert arg == spec_arg, f"{name} mutated its argument"
        return expected

    def pick(self, data: st.DataObject, tables: list[list[int]]) -> int:
        return data.draw(st.integers(0, len(tables) - 1), label="table index")

    # ----------------------------------------------------------------- allocation

    @rule(num_blocks=st.one_of(st.integers(0, 3), st.integers(0, 34)), as_array=st.booleans())
    def allocate(self, num_blocks: int, as_array: bool) -> None:
        impl_name = "allocate_array" if as_array else "allocate"
        kind, table = self.both("allocate", num_blocks, impl_name=impl_name)
        if kind == "ok":
            self.live.append(table)

    @rule(data=st.data(), value=st.one_of(st.integers(-2, 40), bad_scalars()))
    def odd_scalar_argument(self, data: st.DataObject, value: object) -> None:
        """Every int parameter, given anything: a bad type, a negative or huge int, a subclass."""
        table = data.draw(st.sampled_from(self.live)) if self.live else []
        call = data.draw(
            st.sampled_from(["allocate", "can_allocate", "ref_count", "count", "new", "pos"])
        )
        if call in ("allocate", "can_allocate", "ref_count"):
            kind, result = self.both(call, value)
            if kind == "ok" and call == "allocate":
                self.live.append(result)
        elif call == "pos":
            self.both("translate_slot", table, value)
        else:
            count = data.draw(st.integers(0, 40))
            args = (table, value, min(count, 2)) if call == "count" else (table, count, value)
            kind, grown = self.both("append_slot", *args)
            if kind == "ok" and table in self.live:
                self.live[self.live.index(table)] = grown
                self.dead.append(table)

    # ----------------------------------------------------------------- table operations

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def append_slot(self, data: st.DataObject) -> None:
        index = self.pick(data, self.live)
        table = self.live[index]
        capacity = len(table) * self.block_size
        token_count = data.draw(st.integers(0, capacity + 3 * self.block_size), label="count")
        new_tokens = data.draw(st.integers(0, min(token_count, 2 * self.block_size + 1)))
        kind, grown = self.both("append_slot", table, token_count, new_tokens)
        if kind == "ok":
            self.live[index] = grown
            self.dead.append(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), as_tuple=st.booleans())
    def append_one(self, data: st.DataObject, as_tuple: bool) -> None:
        """The decode step: the table's tokens are its capacity minus a little, plus one."""
        index = self.pick(data, self.live)
        table = self.live[index]
        filled = data.draw(
            st.integers(max(0, (len(table) - 1) * self.block_size), len(table) * self.block_size)
        )
        arg = tuple(table) if as_tuple else table
        kind, grown = self.both("append_slot", arg, filled + 1)
        if kind == "ok":
            self.live[index] = grown
            self.dead.append(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        kind, copy = self.both("fork", self.live[self.pick(data, self.live)])
        if kind == "ok":
            self.live.append(copy)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), as_array=st.booleans())
    def free(self, data: st.DataObject, as_array: bool) -> None:
        table = self.live.pop(self.pick(data, self.live))
        if as_array:
            self.free_array(table)
        else:
            self.both("free", table)
        self.dead.append(table)

    def free_array(self, table: list[int]) -> None:
        expected = outcome(self.spec.free, list(table))
        actual = outcome(self.impl.free_array, np.array(table, dtype=np.int64))
        assert expected == actual, f"free {table}: spec {expected}, impl free_array {actual}"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def translate_slot(self, data: st.DataObject) -> None:
        table = self.live[self.pick(data, self.live)]
        capacity = len(table) * self.block_size
        position = data.draw(st.integers(0, max(0, capacity - 1)) | st.integers(-1, capacity + 2))
        self.both("translate_slot", table, position)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), write_copy=st.booleans())
    def fork_then_write(self, data: st.DataObject, write_copy: bool) -> None:
        """Beam search: fork a table, then write one token into the original or the copy."""
        kind, copy = self.both("fork", self.live[self.pick(data, self.live)])
        if kind == "ok":
            self.live.append(copy)
            index = len(self.live) - 1 if write_copy else self.live.index(copy)
            table = self.live[index]
            written = data.draw(st.integers(1, max(1, len(table) * self.block_size)))
            kind, grown = self.both("append_slot", table, written)
            if kind == "ok":
                self.live[index] = grown
                self.dead.append(table)

    @rule(twice=st.booleans())
    def pop_copy_pairs(self, twice: bool) -> None:
        self.both("pop_copy_pairs")
        if twice:
            self.both("pop_copy_pairs")

    # ----------------------------------------------------------------- bad tables

    @precondition(lambda self: self.dead)
    @rule(data=st.data(), operation=st.sampled_from(["free", "fork", "append_slot", "array"]))
    def stale_table(self, data: st.DataObject, operation: str) -> None:
        """A table that was freed or replaced: its blocks may be free or owned by others."""
        table = self.dead[self.pick(data, self.dead)]
        if operation == "array":
            self.free_array(table)
        elif operation == "append_slot":
            kind, grown = self.both("append_slot", table, len(table) * self.block_size)
            if kind == "ok":
                self.live.append(grown)  # the stale table happened to be live again
        else:
            kind, result = self.both(operation, table)
            if kind == "ok" and operation == "fork":
                self.live.append(result)
            if kind == "ok" and operation == "free":
                self.forget_live_copy(table)

    def forget_live_copy(self, table: list[int]) -> None:
        """A stale table freed successfully equals a live one: that owner is gone now."""
        for i, live in enumerate(self.live):
            if live == table:
                del self.live[i]
                return

    @precondition(lambda self: self.live)
    @rule(data=st.data(), operation=st.sampled_from(["free", "fork", "translate", "array"]))
    def repeated_ids(self, data: st.DataObject, operation: str) -> None:
        """A live table with one of its ids repeated."""
        table = self.live[self.pick(data, self.live)]
        if not table:
            return
        doubled = [*table, data.draw(st.sampled_from(table))]
        doubled = data.draw(st.permutations(doubled))
        if operation == "array":
            self.free_array(doubled)
        elif operation == "translate":
            self.both("translate_slot", doubled, 0)
        else:
            self.both(operation, doubled)

    @rule(
        table=st.one_of(
            st.lists(st.one_of(st.integers(-2, 34), bad_scalars()), max_size=4),
            st.sampled_from([None, 3, "ab", {1}, range(2), np.array([0, 1])]),
        ),
        operation=st.sampled_from(["free", "fork", "append_slot", "translate_slot", "array"]),
    )
    def forged_table(self, table: Any, operation: str) -> None:
        """Any list (unknown ids, wrong types, free or held blocks, in any order), or no list."""
        if operation == "array":
            if not isinstance(table, list):
                return
            if all(type(b) is int and -(2**63) <= b < 2**63 for b in table):
                self.free_array(table)
            return
        args = {"append_slot": (table, 3), "translate_slot": (table, 0)}.get(operation, (table,))
        kind, result = self.both(operation, *args)
        if kind == "ok" and operation in ("fork", "append_slot"):
            self.live.append(result)
        if kind == "ok" and operation == "free":
            self.forget_live_copy(table)

    @rule(
        total_blocks=st.one_of(st.integers(-1, 3), not_ints()),  # no huge pools: the spec
        block_size=st.one_of(st.integers(-1, 3), bad_scalars()),  # builds one object a block
    )
    def construct(self, total_blocks: object, block_size: object) -> None:
        assert_same_construction(spec_bm.BlockManager, self.IMPL, total_blocks, block_size)

    # ----------------------------------------------------------------- invariants

    @invariant()
    def same_state(self) -> None:
        if not hasattr(self, "spec"):
            return
        assert self.spec.free_block_ids() == self.impl.free_block_ids()
        assert self.spec.num_free_blocks == self.impl.num_free_blocks
        assert [block.ref_count for block in self.spec.blocks] == self.impl.ref_counts().tolist()
        for block_id in range(self.total_blocks):
            assert self.spec.ref_count(block_id) == self.impl.ref_count(block_id)


TestImplDifferential = DifferentialMachine.TestCase

# The spec's own model-based machine (KV data simulated through every table) on impl as well.
TestSpecMachineOnImpl = block_manager_machine(ImplBlockManager).TestCase
