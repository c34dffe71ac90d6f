"""Block management's machines have teeth: each bug planted in a copy of spec or impl source
fails its machine, and each loading path run on unmodified copies (a control) passes, so a catch
is the bug's. Searches are explicit (``mutants.FIND``): no Hypothesis profile changes them."""

from __future__ import annotations

import importlib
import types

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import pagedkv.spec.block_manager as spec_block_manager
import pagedkv.spec.kv_cache_groups as spec_groups
import pagedkv.spec.prefix_cache as spec_prefix_cache
from properties.machines.block_manager import BlockManagerMachine
from properties.machines.free_queue import FreeQueueMachine
from properties.machines.kv_cache_groups import GroupsMachine
from properties.machines.prefix import PrefixStoreMachine
from properties.machines.prefix_cache import PrefixCacheMachine
from properties.machines.store import StoreMachine, WindowStoreMachine
from properties.mutants import (
    CONTROL_SEARCHES,
    FIND,
    bug_table,
    load_chain,
    load_copy,
    load_mutant,
    planted_store,
)

SHARED_NAMES = ("OutOfBlocksError", "BlockTableError")
EVENT_CLASSES = ("AllBlocksCleared", "BlockRemoved", "BlockStored")
"""Shared with the real modules, so the machines recognise a mutant's errors and events."""

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

PREFIX_BUGS = bug_table("""
no token comparison on lookup | BlockKey.__eq__
- mine.tokens != theirs.tokens or not _same(mine.extra, theirs.extra)
+ not _same(mine.extra, theirs.extra)
no extra-key comparison on lookup | BlockKey.__eq__
- mine.tokens != theirs.tokens or not _same(mine.extra, theirs.extra)
+ mine.tokens != theirs.tokens
revival reorders the queue | PrefixCachingBlockManager.allocate_prompt
- self.free_queue.remove(block_id)
+ self.free_queue.remove(block_id)
+ self.free_queue.rotate(1)
eviction keeps the stale key | PrefixCachingBlockManager._take_from_head
- self._remove_key(block_id)
- self.stats.evictions += 1
+ self.stats.evictions += 1
lookup never hits | PrefixCachingBlockManager.lookup
- key not in self._block_of
+ True
lookup drops its last hit | PrefixCachingBlockManager.lookup
- return hits
+ return hits[:-1]
a cut cached block keeps its key | PrefixCachingBlockManager.truncate
- self._remove_key(cut)  # Rule: a cut block held alone loses its key.
+ pass
a cut cached block loses its key while other tables hold it | PrefixCachingBlockManager.truncate
- cut is not None and self.blocks[cut].ref_count == 1 and cut in self._key_of
+ cut is not None and cut in self._key_of
a cached block is written in place | PrefixCachingBlockManager.append_slot
- self._remove_key(block_id)
+ pass
cache_blocks registers nothing | PrefixCachingBlockManager.cache_blocks
- block_id not in self._key_of and key not in self._block_of
+ False
eviction takes the most recently freed block (the queue's tail)
| PrefixCachingBlockManager._take_from_head
- taken = super()._take_from_head(num_blocks)
+ self.free_queue.reverse()
+ taken = super()._take_from_head(num_blocks)
+ self.free_queue.reverse()
the salt is ignored | PrefixCachingBlockManager.block_keys
- parent = BlockKey(parent, chunk, extra_key, hash_value)
+ parent = BlockKey(parent, chunk, None, hash_value)
a revival leaves the block in the free queue | PrefixCachingBlockManager.allocate_prompt
- self.free_queue.remove(block_id)
+ pass
a stored block emits no event | PrefixCachingBlockManager.cache_blocks
- self._emit(BlockStored(block_id, key))  # Rule: in table order.
+ pass
an eviction emits no event | PrefixCachingBlockManager._remove_key
- self._emit(BlockRemoved(block_id, key))
+ pass
a reset emits no event | PrefixCachingBlockManager.reset_prefix_cache
- self._emit(AllBlocksCleared())
+ pass
events are recorded while disabled | PrefixCachingBlockManager._emit
- if self.enable_kv_events:
-     self._events.append(event)
+ self._events.append(event)
a reset while blocks are held | PrefixCachingBlockManager.reset_prefix_cache
- self.num_free_blocks != self.total_blocks
+ not self.free_queue
a reset reorders the free queue | PrefixCachingBlockManager.reset_prefix_cache
- self._key_of.clear()
+ self._key_of.clear()
+ self.free_queue.reverse()
reading the stats does not reset them | PrefixCachingBlockManager.take_stats
- stats, self.stats = self.stats, PrefixCacheStats()
+ stats = self.stats
hits beyond the last prompt token | PrefixCachingBlockManager.max_hit_blocks
- return max(0, check_int("prompt_len", prompt_len, 0) - 1) // self.block_size
+ return check_int("prompt_len", prompt_len, 0) // self.block_size
""")
"""name -> (function, old, new), planted in ``spec.prefix_cache``."""

IMPL_BUGS = bug_table("""
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
""")
"""name -> (module, function, the machine that must catch it, old, new)."""

IMPL_PREFIX_BUGS = bug_table("""
revival moves the queue's head to its tail
| prefix_cache PrefixCachingBlockManager.apply_prompt_plan
- self.pool.revive(plan.hits, plan.revived)
+ self.pool.revive(plan.hits, plan.revived)
+ queue = self.pool.queue
+ queue.extend(queue.popleft(min(plan.revived.size, len(queue))))
eviction keeps the stale key | prefix_cache PrefixCachingBlockManager.evict
- for block_id in evicted:
-     self._remove_key(block_id)
events of one batch's evictions out of queue order | prefix_cache PrefixCachingBlockManager.evict
- evicted = [block_id for block_id in ids if block_id in evicted]
+ evicted = sorted(evicted, reverse=True)
a registration emits no event | prefix_cache PrefixCachingBlockManager.register_table_blocks
- events.append(BlockStored(block_id, key))
+ pass
a reset while blocks are held | prefix_cache PrefixCachingBlockManager.reset_prefix_cache
- if self.pool.num_free != self.total_blocks:
-     return False
reading the stats does not reset them | prefix_cache PrefixCachingBlockManager.take_stats
- stats, self.stats = self.stats, PrefixCacheStats()
+ stats = self.stats
re-registration trusts a cached block without comparing its tokens
| prefix_cache PrefixCachingBlockManager._chain
- held is not None and held.parent is parent and held.extra is extra_key and held.tokens == chunk
+ held is not None and held.parent is parent and held.extra is extra_key
revived blocks are not counted as consumed | prefix_cache PromptPlan.needed
- self.num_blocks - self.hits.size + self.revived.size
+ self.num_blocks - self.hits.size
duplicate content is cached twice | prefix_cache PrefixCachingBlockManager.register_table_blocks
- holder is None
+ holder != block_id
add_prompt counts only the computed tokens | admission Admission._add_planned
- self.rows.place(seq_id, blocks, len(token_ids))
+ self.rows.place(seq_id, blocks, len(token_ids) - prompt.cached_tokens)
cache_blocks registers the blocks after the released entries under the wrong keys
| prefix_cache PrefixCachingBlockManager.cache_blocks
- return self.register_table_blocks(held, keys[released:])[0]
+ return self.register_table_blocks(held, keys[: len(held)])[0]
truncate keeps the key of a cut cached block | prefix_cache PrefixCachingBlockManager.truncate
- self.remove_keys([cut])
+ pass
append_slot writes a cached block in place | prefix_cache PrefixCachingBlockManager.append_slot
- self.remove_keys(table[first:end])
+ pass
a store truncate keeps the sequence's keys past its kept blocks | prefix_store PrefixStore.truncate
- state.cut(count // self.block_size, self.block_size)
+ None
a store truncate keeps the key of a cut cached block | prefix_store PrefixStore.truncate
- self.manager.remove_keys([block])
+ None
a store grow writes a cached block in place | prefix_store PrefixStore.take_fresh
- manager.remove_keys([int(last[index])])
+ None
""")
"""name -> (module, function, old, new): the store's parts on the prefix store machine, the rest
on the prefix differential machine."""

GROUP_BUGS = bug_table("""
a group left ungrown | GroupedBlockManager.append_slot
- grown.append(list(self.pool.append_slot(table, token_count, new_tokens)))
+ grown.append(list(self.pool.append_slot(table, token_count, new_tokens)) if group == 0 else table)
a window released one token late | GroupedBlockManager.release_outside_window
- release(table, token_count, window)
+ release(table, token_count, window + 1)
a sliding group's bound one token short | GroupedBlockManager.held_bound
- span = window + new_tokens - 1
+ span = window + new_tokens - 1 - 1
a failed group keeps what earlier groups took | GroupedBlockManager._atomically
- self.pool, self.group_of = saved
+ pass
a table of another group accepted | GroupedBlockManager.check_tables
- foreign = [b for b in held_ids(table) if self.group_of[b] != group]
+ foreign = []
groups allocated last first | GroupedBlockManager.allocate
- for group in range(len(self.windows)):
-     table: list[int | None] = list(self.pool.allocate(count))
-     self._claim(group, [], table)
-     tables.append(table)
+ for group in reversed(range(len(self.windows))):
+     table: list[int | None] = list(self.pool.allocate(count))
+     self._claim(group, [], table)
+     tables.insert(0, table)
""")

MODULES = {  # impl's block modules by name
    name: importlib.import_module(f"pagedkv.impl.blocks.{name}")
    for name in ["free_queue", "pool", "manager", "store", "rows", "window", "growth",
                 "page_tables", "admission", "prefix_cache", "prefix_store"]
}  # fmt: skip
UNDER_THE_MANAGER = [MODULES[name] for name in ("free_queue", "pool", "manager")]
STORE_PARTS = [MODULES[name] for name in ("store", "admission", "rows", "growth", "prefix_store")]

BUGS = {  # name -> (module, function, old, new, the machine that must catch it)
    **{f"spec: {name}": (spec_block_manager, *bug, "spec") for name, bug in SPEC_BUGS.items()},
    **{f"spec prefix: {name}": (spec_prefix_cache, *bug, "spec prefix")
       for name, bug in PREFIX_BUGS.items()},
    **{f"groups: {name}": (spec_groups, *bug, "groups") for name, bug in GROUP_BUGS.items()},
    **{f"impl: {name}": (MODULES[module], within, old, new, kind)
       for name, (module, within, kind, old, new) in IMPL_BUGS.items()},
    **{f"impl prefix: {name}": (MODULES[module], within, old, new, "prefix")
       for name, (module, within, old, new) in IMPL_PREFIX_BUGS.items()},
    # impl reuses the spec's BlockKey: its planted bug, under a faithful copy of impl
    "impl prefix: no token comparison on lookup": (
        spec_prefix_cache, *PREFIX_BUGS["no token comparison on lookup"], "prefix"),
}  # fmt: skip
CRASH_CATCHES = {"queue", "differential", "store", "window-store", "page-tables"}
"""The machines whose catch may be a mutant crashing inside a rule; the others' must assert."""
STORE_MACHINES = {
    "store": StoreMachine,
    "window-store": WindowStoreMachine,
    "prefix": PrefixStoreMachine,
}


def machine_with(module: types.ModuleType, within: str, old: str, new: str, kind: str) -> type:
    """The ``kind`` machine over copies with ``old`` -> ``new`` planted in ``within`` of ``module``
    (and of the modules above it that import it)."""
    edit = (module, within, old, new)
    if kind == "spec prefix":
        spec = load_mutant(*edit, EVENT_CLASSES).PrefixCachingBlockManager
        attrs, base = {"SPEC": spec}, PrefixCacheMachine
    elif kind == "spec":
        attrs, base = {"SPEC": load_mutant(*edit, SHARED_NAMES).BlockManager}, BlockManagerMachine
    elif kind == "groups":
        attrs, base = {"SPEC": load_mutant(*edit).GroupedBlockManager}, GroupsMachine
    elif kind == "queue":
        attrs, base = {"QUEUE": load_mutant(*edit).FreeBlockQueue}, FreeQueueMachine
    elif kind == "page-tables":
        attrs, base = {"PAGE_TABLES": load_mutant(*edit)}, StoreMachine
    elif kind in ("store", "window-store") or module in STORE_PARTS:
        attrs, base = {"STORE": planted_store(*edit)}, STORE_MACHINES[kind]
    elif module is spec_prefix_cache:  # a faithful copy of impl's prefix cache over the mutant key
        planted = load_copy(MODULES["prefix_cache"], ("BlockTableError",))
        planted.BlockKey = load_mutant(*edit).BlockKey
        attrs, base = {"IMPL": planted.PrefixCachingBlockManager}, PrefixCacheMachine
    elif kind == "prefix":
        planted = load_mutant(*edit, ("BlockTableError",))
        attrs, base = {"IMPL": planted.PrefixCachingBlockManager}, PrefixCacheMachine
    else:  # the manager, over copies of the pool and queue below it where the bug is there
        below = UNDER_THE_MANAGER[UNDER_THE_MANAGER.index(module) :]
        attrs = {"IMPL": load_chain(below, within, old, new, SHARED_NAMES).BlockManager}
        base = BlockManagerMachine
    return type(f"Planted{base.__name__}", (base,), attrs)


CONTROLS = [  # bugs whose code an identity 'mutation' replaces by itself: every loading path
    "spec: no double-free check", "spec prefix: lookup never hits",
    "groups: a group left ungrown",
    "impl: ring buffer: head advances without wrapping around",  # the queue under the manager
    "impl: pops hand out tombstones", "impl: the pool frees a pending copy's source at once",
    "impl: the window releases from the table's start, not after its released entries",
    "impl: an atomic grow applies the sequences that fit",
    "impl: stale padding: a removed row keeps its block ids",
    "impl: grow writes into a released entry",  # growth, in the window store
    "impl: FlashInfer last page length is 0 for a full page",
    "impl prefix: no token comparison on lookup", "impl prefix: eviction keeps the stale key",
    "impl prefix: add_prompt counts only the computed tokens",
]  # fmt: skip


@pytest.mark.parametrize("bug", CONTROLS)
@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(bug: str, search: settings) -> None:
    module, within, old, _, kind = BUGS[bug]
    run_state_machine_as_test(machine_with(module, within, old, old, kind), settings=search)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    """The machine fails on the mutant (loading it must not)."""
    machine = machine_with(*BUGS[bug])
    with pytest.raises(Exception if BUGS[bug][-1] in CRASH_CATCHES else AssertionError):
        run_state_machine_as_test(machine, settings=FIND)
