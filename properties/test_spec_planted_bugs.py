"""The spec's state machine has teeth: each planted bug in a copy of the spec is caught.

The control case runs the same unmodified-source path, so a mutant can only fail because of its
bug, never because of how it was loaded.
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import pagedkv.spec.block_manager as spec_block_manager
from properties.machines.block_manager import block_manager_machine
from properties.mutants import CONTROL_SEARCHES, FIND, bug_table, load_copy, load_mutant

SPEC_BUGS = bug_table("""
no double-free check | BlockManager.check_live_table
- already_free = [b for b in table if self.blocks[b].ref_count == 0]
+ already_free = []
blocks freed in table order | BlockManager._release
- reversed(blocks)
+ blocks
partial allocation on OutOfBlocksError | BlockManager.allocate
- check_available(num_blocks, len(self.free_queue))
- return self._take_from_head(num_blocks)
+ taken = self._take_from_head(min(num_blocks, len(self.free_queue)))
+ check_available(num_blocks - len(taken) + len(self.free_queue), len(self.free_queue))
+ return taken
off-by-one in append_slot's block count | BlockManager.append_slot
- needed = blocks_needed(token_count, self.block_size)
+ needed = token_count // self.block_size + 1
fork does not increment ref_count | BlockManager.fork
- for block_id in held_ids(table):
-     self.blocks[block_id].ref_count += 1
+ for block_id in held_ids(table):
+     pass
a failed call drops the pending copy pairs | BlockManager.allocate
- check_available(num_blocks, len(self.free_queue))
+ if num_blocks > len(self.free_queue):
+     self._copy_pairs.clear()
+ check_available(num_blocks, len(self.free_queue))
append_slot edits the caller's table in place | BlockManager.append_slot
- table = self.check_live_table(block_table)
- check_int("token_count", token_count, 0)
- check_int("new_tokens", new_tokens, 0)
+ self.check_live_table(block_table)
+ table = block_table
+ check_int("token_count", token_count, 0)
+ check_int("new_tokens", new_tokens, 0)
no copy-on-write | BlockManager.append_slot
- shared = [i for i in written if self.blocks[table[i]].ref_count > 1]
+ shared = []
truncate releases the dropped blocks head first | BlockManager.truncate
- self._release(held_ids(table[kept:]))  # Rule: dropped blocks go as free releases them.
+ self._release(held_ids(table[kept:])[::-1])
truncate frees the dropped blocks outright, shared ones too | BlockManager.truncate
- self._release(held_ids(table[kept:]))  # Rule: dropped blocks go as free releases them.
+ for block_id in reversed(held_ids(table[kept:])):
+     self.blocks[block_id].ref_count = 0
+     self.free_queue.append(block_id)
truncate drops a partly kept last block | BlockManager.truncate
- kept = blocks_needed(token_count, self.block_size)  # Rule: ceil(count / size) stay.
+ kept = token_count // self.block_size
truncate past the table's capacity | BlockManager.truncate
- edit:delete-Expr:check_capacity(len(table), token_count, self.block_size)
the window releases one block it still reads | BlockManager.release_outside_window
- blocks_outside_window(token_count, window, self.block_size)
+ max(0, token_count - window + 2) // self.block_size
the window releases its blocks head first | BlockManager.release_outside_window
- self._release(held_ids(table[:outside]))
+ self._release(held_ids(table[:outside])[::-1])
the window frees shared blocks outright | BlockManager.release_outside_window
- self._release(held_ids(table[:outside]))
+ for block_id in held_ids(table[:outside]):
+     self.blocks[block_id].ref_count = 0
+     self.free_queue.append(block_id)
the window keeps the released entries' ids | BlockManager.release_outside_window
- return [None] * outside + table[outside:]
+ return table
a write into a released entry is not refused | BlockManager.append_slot
- any(table[i] is None for i in written)
+ False
a pending copy's source is freed at once | BlockManager._release
- sources = {src for src, _ in self._copy_pairs}
+ sources = set()
the blocks waiting for a copy stay out of the queue after it | BlockManager.pop_copy_pairs
- self.free_queue.extend(self.waiting_for_copy)  # Rule: read by now; free again.
+ pass
the window past the table's capacity | BlockManager.release_outside_window
- edit:delete-Expr:check_capacity(len(table), token_count, self.block_size)
""")
"""name -> (function, old, new), planted in ``spec.block_manager``."""

SHARED_NAMES = ("OutOfBlocksError", "BlockTableError")


@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(search: settings) -> None:
    """The loading path itself is sound: an identity 'mutation' passes the machine."""
    machine = block_manager_machine(load_copy(spec_block_manager, SHARED_NAMES).BlockManager)
    run_state_machine_as_test(machine, settings=search)


@pytest.mark.parametrize("bug", sorted(SPEC_BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    mutant = load_mutant(spec_block_manager, *SPEC_BUGS[bug], SHARED_NAMES).BlockManager
    with pytest.raises(AssertionError):
        run_state_machine_as_test(block_manager_machine(mutant), settings=FIND)
