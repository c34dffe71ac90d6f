"""The prefix-cache machine has teeth: planted bugs in a copy of the spec are caught."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

import pagedkv.spec.prefix_cache as spec_prefix_cache
from properties.machines.prefix_cache import prefix_cache_machine
from properties.mutants import CONTROL_SEARCHES, FIND, bug_table, load_copy, load_mutant

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

EVENT_CLASSES = ("AllBlocksCleared", "BlockRemoved", "BlockStored")
"""Shared with the real module, so the machine recognises a mutant's events."""


@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(search: settings) -> None:
    manager = load_copy(spec_prefix_cache, EVENT_CLASSES).PrefixCachingBlockManager
    run_state_machine_as_test(prefix_cache_machine(manager), settings=search)


@pytest.mark.parametrize("bug", sorted(PREFIX_BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    mutant = load_mutant(spec_prefix_cache, *PREFIX_BUGS[bug], EVENT_CLASSES)
    machine = prefix_cache_machine(mutant.PrefixCachingBlockManager)  # loading must not fail
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=FIND)
