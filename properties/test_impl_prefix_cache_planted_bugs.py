"""impl's prefix-cache tests have teeth: each bug planted in a copy of impl source is caught.

Bugs in ``pagedkv.impl.blocks.prefix_cache`` run against the spec-vs-impl differential machine;
bugs in the store and its parts (tables, growth, block hashes) against the prefix store machine.
impl reuses the spec's ``BlockKey``, so "no token comparison on lookup" is planted in a copy of
``spec.prefix_cache``'s ``BlockKey`` (the spec's own planted bug) and handed to a faithful copy
of ``pagedkv.impl.blocks.prefix_cache``, as ``test_impl_planted_bugs`` hands a mutant queue to a
faithful block manager. The control cases load unmodified copies along both paths and must pass.
Settings are explicit, so the result does not depend on the Hypothesis profile.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

import pagedkv.spec.prefix_cache as spec_prefix_cache
from pagedkv.impl.blocks import admission, growth, prefix_cache, prefix_store, rows, store
from properties.machines.prefix import PrefixDifferentialMachine, PrefixStoreMachine
from properties.mutants import (
    CONTROL_SEARCHES,
    FIND,
    bug_table,
    load_copy,
    load_mutant,
    planted_store,
)
from properties.test_prefix_cache_planted_bugs import PREFIX_BUGS

STORE_PARTS = (store, admission, rows, growth, prefix_store)
MODULES = {module.__name__.rsplit(".", 1)[1]: module for module in (prefix_cache, *STORE_PARTS)}

BUGS: dict[str, tuple[types.ModuleType, str, str, str]] = {
    "no token comparison on lookup": (  # reaches impl through the spec's BlockKey
        spec_prefix_cache,
        *PREFIX_BUGS["no token comparison on lookup"],
    ),
    **{
        name: (MODULES[module], within, old, new)
        for name, (module, within, old, new) in bug_table("""
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
""").items()
    },
}
"""name -> (module, function, old, new)."""


def machine_with(
    module: types.ModuleType, within: str, old: str, new: str
) -> type[RuleBasedStateMachine]:
    """The machine that must catch a bug planted in ``module``, running the mutant."""
    if module in STORE_PARTS:
        planted = planted_store(module, within, old, new)
        return type("PlantedStore", (PrefixStoreMachine,), {"STORE": planted})
    if module is spec_prefix_cache:  # a faithful impl copy over the mutant key class
        manager = load_copy(prefix_cache, ("BlockTableError",))
        manager.BlockKey = load_mutant(module, within, old, new).BlockKey
    else:
        manager = load_mutant(module, within, old, new, ("BlockTableError",))
    attrs = {"IMPL": manager.PrefixCachingBlockManager}
    return type("PlantedDifferential", (PrefixDifferentialMachine,), attrs)


@pytest.mark.parametrize(
    ("module", "within", "snippet"),
    [
        (spec_prefix_cache, "BlockKey.__eq__", "mine, theirs = mine.parent, theirs.parent"),
        (store, "BlockTableStore.grow", "atomic and failed"),
    ],
    ids=["impl-over-copied-key", "store"],
)
@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copy_passes(
    module: types.ModuleType, within: str, snippet: str, search: settings
) -> None:
    """The loading paths are sound: identity 'mutations' pass the machines."""
    machine = machine_with(module, within, snippet, snippet)
    run_state_machine_as_test(machine, settings=search)


@pytest.mark.parametrize("bug", sorted(BUGS))
def test_planted_bug_is_caught(bug: str) -> None:
    """The machine's assertions fail on the mutant."""
    machine = machine_with(*BUGS[bug])  # loading must not fail
    with pytest.raises(AssertionError):
        run_state_machine_as_test(machine, settings=FIND)
