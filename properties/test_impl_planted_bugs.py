"""impl's property tests have teeth: each bug planted in a copy of an ``impl`` module is caught.

A mutant is the module's source with one snippet replaced (``properties.mutants``). Bugs in
``pagedkv.impl.blocks.free_queue`` and ``pagedkv.impl.blocks.manager`` run against the differential
machine (spec vs impl in lockstep) or the free-queue machine; bugs in
``pagedkv.impl.blocks.table_store`` run against the store machine, those in its handling of
sliding-window releases against the store machine with releases among its steps. The control
cases load unmodified copies the same way and must pass, so a mutant can only fail because of
its bug. Settings are explicit, so the result does not depend on the Hypothesis profile.
"""

from __future__ import annotations

import types

import pytest
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

import pagedkv.impl.blocks.free_queue
import pagedkv.impl.blocks.manager
import pagedkv.impl.blocks.page_tables
import pagedkv.impl.blocks.table_store
from properties.mutants import FIND, load_mutant
from properties.test_block_table_store import StoreMachine, WindowStoreMachine
from properties.test_impl_differential import DifferentialMachine
from properties.test_impl_free_queue import FreeQueueMachine

# (module, snippet, replacement, machine that must catch it)
BUGS: dict[str, tuple[types.ModuleType, str, str, str]] = {
    "ring buffer: head advances without wrapping around": (
        pagedkv.impl.blocks.free_queue,
        "self._head = (self._head + count) % self._capacity",
        "self._head = self._head + count",
        "differential",
    ),
    "ring buffer: a wrapped push records positions past the end": (
        pagedkv.impl.blocks.free_queue,
        "np.arange(tail, end, dtype=np.int32) % self._capacity",
        "np.arange(tail, end, dtype=np.int32)",
        "queue",
    ),
    "pops hand out tombstones": (
        pagedkv.impl.blocks.free_queue,
        "live = window[window != TOMBSTONE]",
        "live = window",
        "queue",
    ),
    "compaction forgets the new positions": (
        pagedkv.impl.blocks.free_queue,
        "self._pos[live] = np.arange(live.size, dtype=np.int32)",
        "pass",
        "queue",
    ),
    "repeated ids go unnoticed": (
        pagedkv.impl.blocks.free_queue,
        "return np.count_nonzero(self._pos[block_ids] != stamps) > 0",
        "return False",
        "differential",
    ),
    "free pushes a table's blocks first-to-last": (
        pagedkv.impl.blocks.manager,
        "self._free.extend(freed[::-1].copy())",
        "self._free.extend(freed.copy())",
        "differential",
    ),
    "append_slot takes growth blocks before copy-on-write blocks": (
        pagedkv.impl.blocks.manager,
        "src, dst = ids[shared - released], fresh[: shared.size]",
        "src, dst = ids[shared - released], fresh[fresh.size - shared.size :]",
        "differential",
    ),
    "allocate takes what is left instead of raising OutOfBlocksError": (
        pagedkv.impl.blocks.manager,
        "        self._check_available(num_blocks)\n        return self.take_blocks(num_blocks)",
        "        return self.take_blocks(min(num_blocks, len(self._free)))",
        "differential",
    ),
    "truncate frees the dropped blocks outright, shared ones too": (
        pagedkv.impl.blocks.manager,
        "self._release_held(ids[first_dropped:], held[first_dropped:])",
        "self._release_held(ids[first_dropped:], np.ones_like(held[first_dropped:]))",
        "differential",
    ),
    "truncate releases the dropped blocks head first": (
        pagedkv.impl.blocks.manager,
        "self._release_held(ids[first_dropped:], held[first_dropped:])",
        "self._release_held(ids[first_dropped:][::-1].copy(), held[first_dropped:][::-1].copy())",
        "differential",
    ),
    "the window releases from the table's start, not after its released entries": (
        pagedkv.impl.blocks.manager,
        "self._release_held(ids[: outside - released], held[: outside - released])",
        "self._release_held(ids[:outside], held[:outside])",
        "differential",
    ),
    "the window releases its blocks head first": (
        pagedkv.impl.blocks.manager,
        "self._release_held(ids[: outside - released], held[: outside - released])",
        "self._release_held(\n"
        "                ids[: outside - released][::-1].copy(),\n"
        "                held[: outside - released][::-1].copy(),\n"
        "            )",
        "differential",
    ),
    "append_slot writes into a released entry": (
        pagedkv.impl.blocks.manager,
        "            if first_written < released:",
        "            if False:",
        "differential",
    ),
    "a store truncate forgets the tail-shared flag": (
        pagedkv.impl.blocks.table_store,
        "            self._flag_tail_shared(rows[cut])",
        "            pass",
        "store",
    ),
    "a store truncate releases each row's dropped blocks head first": (
        pagedkv.impl.blocks.table_store,
        "released = tables[:, ::-1][dropped[:, ::-1]]",
        "released = tables[dropped]",
        "store",
    ),
    "an atomic grow applies the sequences that fit": (
        pagedkv.impl.blocks.table_store,
        "if atomic and failed:",
        "if False:",
        "store",
    ),
    "stale padding: a removed row keeps its block ids": (
        pagedkv.impl.blocks.table_store,
        "        self._tables[rows] = PAD\n",
        "",
        "store",
    ),
    "grow copies on write only from three owners up": (
        pagedkv.impl.blocks.table_store,
        "shared = writes_last & (last_refs > 1)",
        "shared = writes_last & (last_refs > 2)",
        "store",
    ),
    "fast path ignores a shared block written twice in one batch": (
        pagedkv.impl.blocks.table_store,
        "self.shared.any() and has_repeats(self.last[self.shared])",
        "False",
        "store",
    ),
    "decode slot_mapping maps the position after the last": (
        pagedkv.impl.blocks.table_store,
        "            positions = counts - 1\n",
        "            positions = counts - 1 + (counts % self.block_size != 0)\n",
        "store",
    ),
    "the window's outside count is one block too many at the edge": (
        pagedkv.impl.blocks.table_store,
        "outside = np.maximum(counts - (window - 1), 0) // self.block_size",
        "outside = np.maximum(counts - window + 2, 0) // self.block_size",
        "window store",
    ),
    "a window releases each row's blocks head first": (
        pagedkv.impl.blocks.table_store,
        "entries = batch._base[owner] + outside[owner] - 1 - within",
        "entries = batch._base[owner] + before[owner] + within",
        "window store",
    ),
    "a window forgets which entries it released": (
        pagedkv.impl.blocks.table_store,
        "        self._num_released[rows] = np.maximum(before, outside)\n",
        "",
        "window store",
    ),
    "remove of one sequence releases its released entries (PAD, id -1)": (
        pagedkv.impl.blocks.table_store,
        "held = self._tables[row, self._num_released[row] : self._num_blocks[row]]",
        "held = self._tables[row, : self._num_blocks[row]]",
        "window store",
    ),
    "fork shares a released entry (PAD, id -1)": (
        pagedkv.impl.blocks.table_store,
        "self.manager.share_blocks(blocks[released:].astype(np.intp))",
        "self.manager.share_blocks(blocks.astype(np.intp))",
        "window store",
    ),
    "a truncate below the released entries keeps counting them": (
        pagedkv.impl.blocks.table_store,
        "            self._num_released[rows] = np.minimum(self._num_released.take(rows), kept)\n",
        "",
        "window store",
    ),
    "grow writes into a released entry": (
        pagedkv.impl.blocks.table_store,
        "into_released = writes_last & (last == PAD)",
        "into_released = writes_last & False",
        "window store",
    ),
    "a window releasing a partly filled last block leaves the decode fast path open": (
        pagedkv.impl.blocks.table_store,
        "        if gone.any():\n            self._flag_tail_shared(rows[gone])\n",
        "",
        "window store",
    ),
    "slot_mapping maps a position in a released entry": (
        pagedkv.impl.blocks.table_store,
        "if entries.size and entries.min() == PAD:",
        "if False:",
        "window store",
    ),
    "FlashInfer last page length is 0 for a full page": (
        pagedkv.impl.blocks.page_tables,
        "counts - (lengths - 1) * store.block_size",
        "counts % store.block_size",
        "page tables",
    ),
}

SHARED = {
    pagedkv.impl.blocks.free_queue: (),
    pagedkv.impl.blocks.manager: ("BlockTableError", "OutOfBlocksError"),
    pagedkv.impl.blocks.table_store: ("CapacityError", "OutOfBlocksError"),
    pagedkv.impl.blocks.page_tables: (),
}


def machine_with(module: types.ModuleType, old: str, new: str, kind: str) -> type:
    """The ``kind`` machine running against impl with ``old`` -> ``new`` planted in ``module``."""
    mutant = load_mutant(module, old, new, SHARED[module])
    if kind == "queue":
        attrs: dict[str, object] = {"QUEUE": mutant.FreeBlockQueue}
        base: type[RuleBasedStateMachine] = FreeQueueMachine
    elif kind == "store":
        attrs, base = {"STORE": mutant.BlockTableStore}, StoreMachine
    elif kind == "window store":
        attrs, base = {"STORE": mutant.BlockTableStore}, WindowStoreMachine
    elif kind == "page tables":
        attrs, base = {"PAGE_TABLES": mutant}, StoreMachine
    else:
        manager = mutant
        if (
            module is pagedkv.impl.blocks.free_queue
        ):  # a faithful copy of block_manager over the mutant queue
            manager = load_mutant(
                pagedkv.impl.blocks.manager,
                "class BlockManager:",
                "class BlockManager:",
                SHARED[pagedkv.impl.blocks.manager],
            )
            manager.FreeBlockQueue = mutant.FreeBlockQueue
        attrs, base = {"IMPL": manager.BlockManager}, DifferentialMachine
    return type(f"Planted{base.__name__}", (base,), attrs)


@pytest.mark.parametrize(
    ("module", "snippet", "kind"),
    [
        (
            pagedkv.impl.blocks.free_queue,
            "self._head = (self._head + count) % self._capacity",
            "differential",
        ),
        (pagedkv.impl.blocks.free_queue, "live = window[window != TOMBSTONE]", "queue"),
        (pagedkv.impl.blocks.manager, "self._free.extend(freed[::-1].copy())", "differential"),
        (pagedkv.impl.blocks.table_store, "        self._tables[rows] = PAD\n", "store"),
        (pagedkv.impl.blocks.table_store, "        self._tables[rows] = PAD\n", "window store"),
        (pagedkv.impl.blocks.page_tables, "def flashinfer_page_table(", "page tables"),
    ],
    ids=["queue-in-manager", "queue", "manager", "store", "window-store", "page-tables"],
)
def test_control_unmutated_copy_passes(module: types.ModuleType, snippet: str, kind: str) -> None:
    """The loading path itself is sound: an identity 'mutation' passes each machine."""
    run_state_machine_as_test(machine_with(module, snippet, snippet, kind), settings=FIND)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    """The machine fails on the mutant: an assertion, or the mutant crashing inside a rule."""
    machine = machine_with(*BUGS[bug])
    with pytest.raises(Exception):  # noqa: B017 - either kind of failure is a catch
        run_state_machine_as_test(machine, settings=FIND)
