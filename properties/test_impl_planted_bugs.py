"""impl's property tests have teeth: each bug planted in a copy of an ``impl`` module is caught.

Bugs in the free queue, the pool and the manager run against the differential machine (over
copies of the modules above the bug) or the free-queue machine; bugs in the store and its parts
against the store machine, those in its sliding-window handling against the window store
machine. The controls load unmodified copies the same way and must pass, so a mutant can only
fail because of its bug. Settings are explicit, so the result does not depend on the profile.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from pagedkv.impl.blocks import free_queue, growth, manager, page_tables, pool, rows, store, window
from properties.machines.differential import DifferentialMachine
from properties.machines.free_queue import FreeQueueMachine
from properties.machines.store import StoreMachine, WindowStoreMachine
from properties.mutants import (
    CONTROL_SEARCHES,
    FIND,
    bug_table,
    load_chain,
    load_mutant,
    planted_store,
)

MODULES = {
    module.__name__.rsplit(".", 1)[1]: module
    for module in (free_queue, pool, manager, store, rows, window, growth, page_tables)
}

BUGS = {
    name: (MODULES[module], within, old, new, kind)
    for name, (module, within, kind, old, new) in bug_table("""
ring buffer: head advances without wrapping around | free_queue FreeBlockQueue._advance differential
- self._head = (self._head + count) % self._capacity
+ self._head = self._head + count
ring buffer: a wrapped push records positions past the end | free_queue FreeBlockQueue.extend queue
- np.arange(tail, end, dtype=np.int32) % self._capacity
+ np.arange(tail, end, dtype=np.int32)
pops hand out tombstones | free_queue FreeBlockQueue.popleft queue
- live = window[window != TOMBSTONE]
+ live = window
compaction forgets the new positions | free_queue FreeBlockQueue._compact queue
- self._pos[live] = np.arange(live.size, dtype=np.int32)
+ pass
repeated ids go unnoticed | free_queue FreeBlockQueue.has_repeats differential
- return np.count_nonzero(self._pos[block_ids] != stamps) > 0
+ return False
free pushes a table's blocks first-to-last | pool BlockPool.release_held differential
- self._free(freed[::-1].copy())
+ self._free(freed.copy())
append_slot takes growth blocks before copy-on-write blocks
| manager BlockManager.append_slot differential
- src, dst = ids[shared - released], fresh[: shared.size]
+ src, dst = ids[shared - released], fresh[fresh.size - shared.size :]
allocate takes what is left instead of raising OutOfBlocksError
| manager BlockManager.allocate_array differential
- check_available(num_blocks, self.pool.num_free)
- return self.pool.take(num_blocks)
+ return self.pool.take(min(num_blocks, self.pool.num_free))
truncate frees the dropped blocks outright, shared ones too
| manager BlockManager.truncate differential
- self.pool.release_held(ids[first_dropped:], held[first_dropped:])
+ self.pool.release_held(ids[first_dropped:], np.ones_like(held[first_dropped:]))
truncate releases the dropped blocks head first | manager BlockManager.truncate differential
- self.pool.release_held(ids[first_dropped:], held[first_dropped:])
+ self.pool.release_held(
+     ids[first_dropped:][::-1].copy(), held[first_dropped:][::-1].copy()
+ )
the window releases from the table's start, not after its released entries
| manager BlockManager.release_outside_window differential
- newly = max(0, outside - released)
+ newly = outside
the window releases its blocks head first | manager BlockManager.release_outside_window differential
- self.pool.release_held(ids[:newly], held[:newly])
+ self.pool.release_held(ids[:newly][::-1].copy(), held[:newly][::-1].copy())
append_slot writes into a released entry | manager BlockManager.append_slot differential
- first_written < released
+ False
the pool frees a pending copy's source at once | pool BlockPool._free differential
- waits = self.is_source.take(freed)
+ waits = np.zeros(freed.size, dtype=np.bool_)
a store truncate forgets the tail-shared flag | rows SeqRows.truncate store
- self.tail_shared[rows] = counts % self.block_size != 0
+ self.tail_shared[rows] = False
a store truncate releases each row's dropped blocks head first | rows SeqRows.truncate store
- released = tables[:, ::-1][dropped[:, ::-1]]
+ released = tables[dropped]
an atomic grow applies the sequences that fit | store BlockTableStore.grow store
- atomic and failed
+ False
stale padding: a removed row keeps its block ids | rows SeqRows.release store
- self.tables[rows] = PAD
grow copies on write only from three owners up | growth growth_of store
- last_refs = pool.refs_of(last)
+ last_refs = pool.refs_of(last) - 1
two writers of one shared block in a batch both copy it | growth plan_in_order store
- refs[last[i]] = owners - 1
+ refs[last[i]] = owners
decode slot_mapping maps the position after the last | rows SeqRows.slot_mapping store
- positions = counts - 1
+ positions = counts - 1 + (counts % self.block_size != 0)
the window's outside count is one block too many at the edge
| window SlidingWindow.blocks_outside window-store
- np.maximum(counts - (self.window - 1), 0) // self.block_size
+ np.maximum(counts - self.window + 2, 0) // self.block_size
a window releases each row's blocks head first | rows SeqRows.release_leading window-store
- entries = base[owner] + outside[owner] - 1 - within
+ entries = base[owner] + before[owner] + within
a window forgets which entries it released | rows SeqRows.release_leading window-store
- self.num_released[rows] = np.maximum(before, outside)
remove of one sequence releases its released entries (PAD, id -1)
| rows SeqRows.release window-store
- pool.release(self.held(int(rows[0])).astype(np.intp))
+ pool.release(self.tables[int(rows[0]), : self.num_blocks[int(rows[0])]].astype(np.intp))
fork shares a released entry (PAD, id -1) | store BlockTableStore.fork window-store
- self._pool.share(self._rows.held(parent_row).astype(np.intp))
+ self._pool.share(self._rows.tables[parent_row, : self._rows.num_blocks[parent_row]])
a truncate below the released entries keeps counting them | rows SeqRows.truncate window-store
- self.num_released[rows] = np.minimum(self.num_released.take(rows), kept)
grow writes into a released entry | growth growth_of window-store
- into_released = writes_last & (last == PAD)
+ into_released = writes_last & False
a window releasing a partly filled last block leaves the decode fast path open
| rows SeqRows.release_leading window-store
- if gone.any():
-     self.tail_shared[rows[gone]] = True
slot_mapping maps a position in a released entry | rows SeqRows.slot_mapping window-store
- entries.size and entries.min() == PAD
+ False
FlashInfer last page length is 0 for a full page | page_tables flashinfer_page_table page-tables
- counts - (lengths - 1) * store.block_size
+ counts % store.block_size
""").items()
}
"""name -> (module, function, old, new, the machine that must catch it)."""

UNDER_THE_MANAGER = [free_queue, pool, manager]
"""The modules the manager is built on, in import order."""


def machine_with(module: types.ModuleType, within: str, old: str, new: str, kind: str) -> type:
    """The ``kind`` machine running against impl with ``old`` -> ``new`` planted in ``within``
    of ``module``."""
    attrs: dict[str, object]
    if kind == "queue":
        attrs = {"QUEUE": load_mutant(module, within, old, new).FreeBlockQueue}
        base: type[RuleBasedStateMachine] = FreeQueueMachine
    elif kind in ("store", "window-store"):
        attrs = {"STORE": planted_store(module, within, old, new)}
        base = StoreMachine if kind == "store" else WindowStoreMachine
    elif kind == "page-tables":
        attrs, base = {"PAGE_TABLES": load_mutant(module, within, old, new)}, StoreMachine
    else:  # the manager, over copies of the pool and queue below it where the bug is there
        below = UNDER_THE_MANAGER[UNDER_THE_MANAGER.index(module) :]
        planted = load_chain(below, within, old, new, ("BlockTableError", "OutOfBlocksError"))
        attrs, base = {"IMPL": planted.BlockManager}, DifferentialMachine
    return type(f"Planted{base.__name__}", (base,), attrs)


CONTROLS = {  # id -> (the bug whose code an identity 'mutation' replaces by itself, machine)
    "queue-in-manager": ("ring buffer: head advances without wrapping around", "differential"),
    "queue": ("pops hand out tombstones", "queue"),
    "pool": ("the pool frees a pending copy's source at once", "differential"),
    "manager": (
        "the window releases from the table's start, not after its released entries",
        "differential",
    ),
    "store": ("an atomic grow applies the sequences that fit", "store"),
    "tables-in-store": ("stale padding: a removed row keeps its block ids", "store"),
    "growth-in-window-store": (
        "two writers of one shared block in a batch both copy it",
        "window-store",
    ),
    "page-tables": ("FlashInfer last page length is 0 for a full page", "page-tables"),
}


@pytest.mark.parametrize("control", CONTROLS)
@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(control: str, search: settings) -> None:
    """The loading path itself is sound: an identity 'mutation' passes each machine."""
    bug, kind = CONTROLS[control]
    module, within, old, _, _ = BUGS[bug]
    run_state_machine_as_test(machine_with(module, within, old, old, kind), settings=search)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    """The machine fails on the mutant: an assertion, or the mutant crashing inside a rule."""
    machine = machine_with(*BUGS[bug])
    with pytest.raises(Exception):  # noqa: B017 - either kind of failure is a catch
        run_state_machine_as_test(machine, settings=FIND)
