"""``impl``'s prefix cache against the spec: the prefix machines, the spec's scenarios on impl,
and directed examples of the store's prefix API."""

from __future__ import annotations

from collections.abc import Callable

import pytest

import properties.test_prefix_cache_spec as spec_scenarios
from pagedkv.impl.blocks import BlockTableStore, CapacityError
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import (
    PrefixCacheStats,
    PrefixCachingBlockManager,
    check_tokens,
)
from pagedkv.spec import OutOfBlocksError
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager as SpecPrefixManager
from properties.machines.block_manager import IntSubclass
from properties.machines.prefix import PrefixStoreMachine, WindowPrefixStoreMachine
from properties.machines.prefix_cache import PrefixCacheMachine

TestPrefixCache = PrefixCacheMachine.TestCase
TestPrefixStore = PrefixStoreMachine.TestCase
TestWindowPrefixStore = WindowPrefixStoreMachine.TestCase


@pytest.mark.parametrize("tokens", [[0], [3, 0, 1], (0, 2), [5]])
def test_valid_tokens_are_returned_without_a_copy(tokens: list[int] | tuple[int, ...]) -> None:
    """Plain ints come back as the very argument; with an int subclass, as a new list."""
    assert check_tokens(tokens) is tokens
    mixed = [*tokens, IntSubclass(4)]
    checked = check_tokens(mixed)
    assert checked == mixed and checked is not mixed


def test_store_with_a_plain_manager_caches_nothing() -> None:
    """With a plain manager ``add_prompt`` is ``add``, and the cache calls are no-ops."""
    plain = BlockTableStore(BlockManager(8, 4), 4, 4)
    reference = BlockTableStore(BlockManager(8, 4), 4, 4)
    for store in (plain, reference):
        store.add(0, 6)
    assert plain.blocks_to_allocate([1, 2, 3, 4, 5]) == 2
    assert plain.add_prompt(1, [1, 2, 3, 4, 5], "salt") == 0
    reference.add(1, 5)
    assert plain.cache_blocks(1, [1, 2, 3, 4, 5]) == 0
    assert plain.add_prompt(2, [1, 2, 3, 4, 5]) == 0
    reference.add(2, 5)
    assert plain.tables.tolist() == reference.tables.tolist()
    assert plain.manager.free_block_ids() == reference.manager.free_block_ids()
    assert plain.prefix_cache_stats is None and plain.take_prefix_cache_stats() is None
    assert plain.take_kv_events() == [] and plain.reset_prefix_cache() is True
    for call, args, error in [
        (plain.add_prompt, (3, "12345"), TypeError),
        (plain.add_prompt, (3, [1, -1]), ValueError),
        (plain.add_prompt, (1, [1]), ValueError),
        (plain.add_prompt, (3, list(range(17))), CapacityError),
        (plain.add_prompt, (3, list(range(16))), OutOfBlocksError),
        (plain.cache_blocks, (1, [0] * 6), ValueError),
        (plain.cache_blocks, (9, []), KeyError),
        (plain.blocks_to_allocate, ([True],), TypeError),
    ]:
        with pytest.raises(error):
            call(*args)
    assert plain.tables.tolist() == reference.tables.tolist()


def test_store_hands_on_the_managers_events_stats_and_reset() -> None:
    """The store's event, counter and reset calls are its prefix-caching manager's."""
    store = BlockTableStore(PrefixCachingBlockManager(8, 2, enable_kv_events=True), 2, 4)
    store.add_prompt(0, [1, 2, 3])
    assert store.cache_blocks(0, [1, 2, 3]) == 1
    assert [type(event).__name__ for event in store.take_kv_events()] == ["BlockStored"]
    assert store.take_kv_events() == []
    assert store.take_prefix_cache_stats() == PrefixCacheStats(queried_blocks=1)
    assert store.reset_prefix_cache() is False  # a block is held
    store.remove([0])
    assert store.reset_prefix_cache() is True and store.manager.num_cached_blocks == 0
    assert [type(event).__name__ for event in store.take_kv_events()] == ["AllBlocksCleared"]
    assert store.take_prefix_cache_stats() == PrefixCacheStats(resets=1)


SCENARIOS: dict[str, Callable[[], None]] = {
    name: function
    for name, function in vars(spec_scenarios).items()
    if name.startswith("test_") and callable(function)
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_spec_scenario_on_impl(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spec_scenarios, "PrefixCachingBlockManager", PrefixCachingBlockManager)
    SCENARIOS[name]()


@pytest.mark.parametrize("manager_class", [SpecPrefixManager, PrefixCachingBlockManager])
def test_a_hit_revives_a_cached_block_waiting_for_its_copy(manager_class: type) -> None:
    """Hits revive cached blocks from the queue or the waiting ones; none rejoins at the pop."""
    manager = manager_class(6, 2)
    other, _ = manager.allocate_prompt([5, 6])  # [0]
    manager.cache_blocks(other, [5, 6])
    manager.free(other)  # block 0: cached, free
    table, _ = manager.allocate_prompt([1, 2, 3])  # [1, 2]
    manager.cache_blocks(table, [1, 2, 3])  # block 1 holds [1, 2]
    sibling = manager.fork(table)
    table = manager.truncate(table, 1)  # [1]: cut into block 1, which the sibling holds
    table = manager.append_slot(table, 2)  # copies 1 -> 3
    manager.free(sibling)  # block 2 is free, block 1 waits for its copy
    assert (manager.free_block_ids(), manager.waiting_for_copy) == ([4, 5, 0, 2], [1])
    assert manager.allocate_prompt([5, 6, 7]) == ([0, 4], 2)  # from the queue
    assert (manager.free_block_ids(), manager.waiting_for_copy) == ([5, 2], [1])
    assert manager.allocate_prompt([1, 2, 9]) == ([1, 5], 2)  # from the waiting blocks
    assert (manager.free_block_ids(), manager.waiting_for_copy) == ([2], [])
    assert manager.pop_copy_pairs() == [(1, 3)]
    assert manager.free_block_ids() == [2]
    assert [manager.ref_count(b) for b in range(6)] == [1, 1, 0, 1, 1, 1]


@pytest.mark.parametrize("manager_class", [SpecPrefixManager, PrefixCachingBlockManager])
def test_reviving_a_block_waiting_for_its_copy_takes_no_free_block(manager_class: type) -> None:
    """Hits on a held and a waiting block need one fresh block only: it fits."""
    manager = manager_class(4, 2)
    first, _ = manager.allocate_prompt([1, 2, 3, 4])  # [0, 1]
    manager.cache_blocks(first, [1, 2, 3, 4])
    second = manager.fork(first)
    second = manager.truncate(second, 3)  # cut into block 1, which the first holds
    second = manager.append_slot(second, 4)  # copies 1 -> 2
    manager.free(first)  # block 1 waits for its copy
    assert (manager.free_block_ids(), manager.waiting_for_copy) == ([3], [1])
    assert manager.blocks_to_allocate([1, 2, 3, 4, 5]) == 1
    assert manager.allocate_prompt([1, 2, 3, 4, 5]) == ([0, 1, 3], 4)
    assert (manager.free_block_ids(), manager.waiting_for_copy) == ([], [])
