"""impl's property tests have teeth: each bug planted in a copy of an ``impl`` module is caught.

A mutant is the module with one piece of code replaced (``properties.mutants``). Bugs in the
free queue, the pool and the manager run against the differential machine (spec vs impl in
lockstep, over copies of the modules above the bug) or the free-queue machine; bugs in the store
and its parts (tables, growth) run against the store machine, those in its handling of
sliding-window releases against the store machine with releases among its steps. The control
cases load unmodified copies the same way and must pass, so a mutant can only fail because of
its bug. Settings are explicit, so the result does not depend on the Hypothesis profile.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

import pagedkv.impl.blocks.free_queue
import pagedkv.impl.blocks.growth
import pagedkv.impl.blocks.manager
import pagedkv.impl.blocks.page_tables
import pagedkv.impl.blocks.pool
import pagedkv.impl.blocks.rows
import pagedkv.impl.blocks.store
import pagedkv.impl.blocks.window
from properties.machines.differential import DifferentialMachine
from properties.machines.free_queue import FreeQueueMachine
from properties.machines.store import StoreMachine, WindowStoreMachine
from properties.mutants import CONTROL_SEARCHES, FIND, load_chain, load_mutant, planted_store

# (module, function, code, replacement, machine that must catch it)
BUGS: dict[str, tuple[types.ModuleType, str, str, str, str]] = {
    "ring buffer: head advances without wrapping around": (
        pagedkv.impl.blocks.free_queue,
        "FreeBlockQueue._advance",
        "self._head = (self._head + count) % self._capacity",
        "self._head = self._head + count",
        "differential",
    ),
    "ring buffer: a wrapped push records positions past the end": (
        pagedkv.impl.blocks.free_queue,
        "FreeBlockQueue.extend",
        "np.arange(tail, end, dtype=np.int32) % self._capacity",
        "np.arange(tail, end, dtype=np.int32)",
        "queue",
    ),
    "pops hand out tombstones": (
        pagedkv.impl.blocks.free_queue,
        "FreeBlockQueue.popleft",
        "live = window[window != TOMBSTONE]",
        "live = window",
        "queue",
    ),
    "compaction forgets the new positions": (
        pagedkv.impl.blocks.free_queue,
        "FreeBlockQueue._compact",
        "self._pos[live] = np.arange(live.size, dtype=np.int32)",
        "pass",
        "queue",
    ),
    "repeated ids go unnoticed": (
        pagedkv.impl.blocks.free_queue,
        "FreeBlockQueue.has_repeats",
        "return np.count_nonzero(self._pos[block_ids] != stamps) > 0",
        "return False",
        "differential",
    ),
    "free pushes a table's blocks first-to-last": (
        pagedkv.impl.blocks.pool,
        "BlockPool.release_held",
        "self._free(freed[::-1].copy())",
        "self._free(freed.copy())",
        "differential",
    ),
    "append_slot takes growth blocks before copy-on-write blocks": (
        pagedkv.impl.blocks.manager,
        "BlockManager.append_slot",
        "src, dst = ids[shared - released], fresh[: shared.size]",
        "src, dst = ids[shared - released], fresh[fresh.size - shared.size :]",
        "differential",
    ),
    "allocate takes what is left instead of raising OutOfBlocksError": (
        pagedkv.impl.blocks.manager,
        "BlockManager.allocate_array",
        "check_available(num_blocks, self.pool.num_free)\nreturn self.pool.take(num_blocks)",
        "return self.pool.take(min(num_blocks, self.pool.num_free))",
        "differential",
    ),
    "truncate frees the dropped blocks outright, shared ones too": (
        pagedkv.impl.blocks.manager,
        "BlockManager.truncate",
        "self.pool.release_held(ids[first_dropped:], held[first_dropped:])",
        "self.pool.release_held(ids[first_dropped:], np.ones_like(held[first_dropped:]))",
        "differential",
    ),
    "truncate releases the dropped blocks head first": (
        pagedkv.impl.blocks.manager,
        "BlockManager.truncate",
        "self.pool.release_held(ids[first_dropped:], held[first_dropped:])",
        "self.pool.release_held(\n"
        "    ids[first_dropped:][::-1].copy(), held[first_dropped:][::-1].copy()\n"
        ")",
        "differential",
    ),
    "the window releases from the table's start, not after its released entries": (
        pagedkv.impl.blocks.manager,
        "BlockManager.release_outside_window",
        "newly = max(0, outside - released)",
        "newly = outside",
        "differential",
    ),
    "the window releases its blocks head first": (
        pagedkv.impl.blocks.manager,
        "BlockManager.release_outside_window",
        "self.pool.release_held(ids[:newly], held[:newly])",
        "self.pool.release_held(ids[:newly][::-1].copy(), held[:newly][::-1].copy())",
        "differential",
    ),
    "append_slot writes into a released entry": (
        pagedkv.impl.blocks.manager,
        "BlockManager.append_slot",
        "first_written < released",
        "False",
        "differential",
    ),
    "the pool frees a pending copy's source at once": (
        pagedkv.impl.blocks.pool,
        "BlockPool._free",
        "waits = self.is_source.take(freed)",
        "waits = np.zeros(freed.size, dtype=np.bool_)",
        "differential",
    ),
    "a store truncate forgets the tail-shared flag": (
        pagedkv.impl.blocks.rows,
        "SeqRows.truncate",
        "self.tail_shared[rows] = counts % self.block_size != 0",
        "self.tail_shared[rows] = False",
        "store",
    ),
    "a store truncate releases each row's dropped blocks head first": (
        pagedkv.impl.blocks.rows,
        "SeqRows.truncate",
        "released = tables[:, ::-1][dropped[:, ::-1]]",
        "released = tables[dropped]",
        "store",
    ),
    "an atomic grow applies the sequences that fit": (
        pagedkv.impl.blocks.store,
        "BlockTableStore.grow",
        "atomic and failed",
        "False",
        "store",
    ),
    "stale padding: a removed row keeps its block ids": (
        pagedkv.impl.blocks.rows,
        "SeqRows.release",
        "self.tables[rows] = PAD",
        "",
        "store",
    ),
    "grow copies on write only from three owners up": (
        pagedkv.impl.blocks.growth,
        "growth_of",
        "last_refs = pool.refs_of(last)",
        "last_refs = pool.refs_of(last) - 1",
        "store",
    ),
    "two writers of one shared block in a batch both copy it": (
        pagedkv.impl.blocks.growth,
        "plan_in_order",
        "refs[last[i]] = owners - 1",
        "refs[last[i]] = owners",
        "store",
    ),
    "decode slot_mapping maps the position after the last": (
        pagedkv.impl.blocks.rows,
        "SeqRows.slot_mapping",
        "positions = counts - 1",
        "positions = counts - 1 + (counts % self.block_size != 0)",
        "store",
    ),
    "the window's outside count is one block too many at the edge": (
        pagedkv.impl.blocks.window,
        "SlidingWindow.blocks_outside",
        "np.maximum(counts - (self.window - 1), 0) // self.block_size",
        "np.maximum(counts - self.window + 2, 0) // self.block_size",
        "window store",
    ),
    "a window releases each row's blocks head first": (
        pagedkv.impl.blocks.rows,
        "SeqRows.release_leading",
        "entries = base[owner] + outside[owner] - 1 - within",
        "entries = base[owner] + before[owner] + within",
        "window store",
    ),
    "a window forgets which entries it released": (
        pagedkv.impl.blocks.rows,
        "SeqRows.release_leading",
        "self.num_released[rows] = np.maximum(before, outside)",
        "",
        "window store",
    ),
    "remove of one sequence releases its released entries (PAD, id -1)": (
        pagedkv.impl.blocks.rows,
        "SeqRows.release",
        "pool.release(self.held(int(rows[0])).astype(np.intp))",
        "pool.release(self.tables[int(rows[0]), : self.num_blocks[int(rows[0])]].astype(np.intp))",
        "window store",
    ),
    "fork shares a released entry (PAD, id -1)": (
        pagedkv.impl.blocks.store,
        "BlockTableStore.fork",
        "self._pool.share(self._rows.held(parent_row).astype(np.intp))",
        "self._pool.share(self._rows.tables[parent_row, : self._rows.num_blocks[parent_row]])",
        "window store",
    ),
    "a truncate below the released entries keeps counting them": (
        pagedkv.impl.blocks.rows,
        "SeqRows.truncate",
        "self.num_released[rows] = np.minimum(self.num_released.take(rows), kept)",
        "",
        "window store",
    ),
    "grow writes into a released entry": (
        pagedkv.impl.blocks.growth,
        "growth_of",
        "into_released = writes_last & (last == PAD)",
        "into_released = writes_last & False",
        "window store",
    ),
    "a window releasing a partly filled last block leaves the decode fast path open": (
        pagedkv.impl.blocks.rows,
        "SeqRows.release_leading",
        "if gone.any():\n    self.tail_shared[rows[gone]] = True",
        "",
        "window store",
    ),
    "slot_mapping maps a position in a released entry": (
        pagedkv.impl.blocks.rows,
        "SeqRows.slot_mapping",
        "entries.size and entries.min() == PAD",
        "False",
        "window store",
    ),
    "FlashInfer last page length is 0 for a full page": (
        pagedkv.impl.blocks.page_tables,
        "flashinfer_page_table",
        "counts - (lengths - 1) * store.block_size",
        "counts % store.block_size",
        "page tables",
    ),
}

SHARED = {
    pagedkv.impl.blocks.free_queue: (),
    pagedkv.impl.blocks.pool: (),
    pagedkv.impl.blocks.manager: ("BlockTableError", "OutOfBlocksError"),
    pagedkv.impl.blocks.store: ("CapacityError",),
    pagedkv.impl.blocks.rows: ("CapacityError",),
    pagedkv.impl.blocks.window: (),
    pagedkv.impl.blocks.growth: ("CapacityError",),
    pagedkv.impl.blocks.page_tables: (),
}


UNDER_THE_MANAGER = [
    pagedkv.impl.blocks.free_queue,
    pagedkv.impl.blocks.pool,
    pagedkv.impl.blocks.manager,
]
"""The modules the manager is built on, in import order."""


def machine_with(module: types.ModuleType, within: str, old: str, new: str, kind: str) -> type:
    """The ``kind`` machine running against impl with ``old`` -> ``new`` planted in ``within``
    of ``module``."""
    if kind == "queue":
        queue = load_mutant(module, within, old, new, SHARED[module])
        attrs: dict[str, object] = {"QUEUE": queue.FreeBlockQueue}
        base: type[RuleBasedStateMachine] = FreeQueueMachine
    elif kind == "store":
        attrs, base = {"STORE": planted_store(module, within, old, new)}, StoreMachine
    elif kind == "window store":
        attrs, base = {"STORE": planted_store(module, within, old, new)}, WindowStoreMachine
    elif kind == "page tables":
        tables = load_mutant(module, within, old, new, SHARED[module])
        attrs, base = {"PAGE_TABLES": tables}, StoreMachine
    else:  # the manager, over copies of the pool and queue below it where the bug is there
        below = UNDER_THE_MANAGER[UNDER_THE_MANAGER.index(module) :]
        manager = load_chain(below, within, old, new, ("BlockTableError", "OutOfBlocksError"))
        attrs, base = {"IMPL": manager.BlockManager}, DifferentialMachine
    return type(f"Planted{base.__name__}", (base,), attrs)


@pytest.mark.parametrize(
    ("module", "within", "snippet", "kind"),
    [
        (
            pagedkv.impl.blocks.free_queue,
            "FreeBlockQueue._advance",
            "self._head = (self._head + count) % self._capacity",
            "differential",
        ),
        (
            pagedkv.impl.blocks.free_queue,
            "FreeBlockQueue.popleft",
            "live = window[window != TOMBSTONE]",
            "queue",
        ),
        (
            pagedkv.impl.blocks.pool,
            "BlockPool._free",
            "waits = self.is_source.take(freed)",
            "differential",
        ),
        (
            pagedkv.impl.blocks.manager,
            "BlockManager.release_outside_window",
            "newly = max(0, outside - released)",
            "differential",
        ),
        (pagedkv.impl.blocks.store, "BlockTableStore.grow", "atomic and failed", "store"),
        (pagedkv.impl.blocks.rows, "SeqRows.release", "self.tables[rows] = PAD", "store"),
        (
            pagedkv.impl.blocks.growth,
            "plan_in_order",
            "refs[last[i]] = owners - 1",
            "window store",
        ),
        (
            pagedkv.impl.blocks.page_tables,
            "flashinfer_page_table",
            "counts - (lengths - 1) * store.block_size",
            "page tables",
        ),
    ],
    ids=[
        "queue-in-manager",
        "queue",
        "pool",
        "manager",
        "store",
        "tables-in-store",
        "growth-in-window-store",
        "page-tables",
    ],
)
@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(
    module: types.ModuleType, within: str, snippet: str, kind: str, search: settings
) -> None:
    """The loading path itself is sound: an identity 'mutation' passes each machine."""
    machine = machine_with(module, within, snippet, snippet, kind)
    run_state_machine_as_test(machine, settings=search)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    """The machine fails on the mutant: an assertion, or the mutant crashing inside a rule."""
    machine = machine_with(*BUGS[bug])
    with pytest.raises(Exception):  # noqa: B017 - either kind of failure is a catch
        run_state_machine_as_test(machine, settings=FIND)
