"""The spec's prefix caching: directed scenarios (rerun on impl). The state machine, the spec,
impl and the model in lockstep, is test_impl_prefix_cache's."""

from __future__ import annotations

import hashlib
from dataclasses import FrozenInstanceError

import numpy as np
import pytest

from pagedkv.spec import BlockTableError
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager, default_block_hash
from properties.machines.prefix_cache import colliding_hash

EVENT_NAMES = ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
SYSTEM = list(range(100, 108))  # two full blocks of 4


def test_freed_cached_blocks_are_revived_in_place() -> None:
    """design.md section 8's worked example (the machine checks the same on every step)."""
    manager = PrefixCachingBlockManager(6, 4)
    table, _ = manager.allocate_prompt([*SYSTEM, 1])
    manager.cache_blocks(table, [*SYSTEM, 1])
    manager.free(table)
    assert manager.free_block_ids() == [3, 4, 5, 2, 1, 0]  # tail first, keys kept
    assert manager.num_cached_blocks == 2
    revived, cached = manager.allocate_prompt([*SYSTEM, 9])
    assert (revived, cached) == ([0, 1, 3], 8)
    assert manager.free_block_ids() == [4, 5, 2], "revival keeps the rest of the queue in order"


def test_other_tokens_in_or_before_a_cached_block_are_refused() -> None:
    """A key covers its whole prefix: other tokens in or before a cached block are refused (as
    are more tokens than the table holds, and no list), nothing changed."""
    manager = PrefixCachingBlockManager(8, 2)
    a, _ = manager.allocate_prompt([1, 2, 3, 4, 0])
    b, _ = manager.allocate_prompt([1, 2, 5, 6, 0])  # computed concurrently: no hit yet
    manager.cache_blocks(a, [1, 2, 3, 4, 0])
    assert manager.cache_blocks(b, [1, 2, 5, 6, 0]) == 1  # b[0] duplicates a[0]: uncached
    for table, tokens in [(a, [1, 2, 3, 9, 0]), (b, [7, 8, 5, 6, 0])]:
        with pytest.raises(BlockTableError, match="cached with other tokens"):
            manager.cache_blocks(table, tokens)
    with pytest.raises(ValueError, match="do not fit"):
        manager.cache_blocks(a, list(range(7)))
    with pytest.raises(TypeError):
        manager.allocate_prompt("1234")
    assert manager.key_of(b[0]) is None and manager.num_cached_blocks == 3
    assert manager.lookup([1, 2, 5, 6, 0]) == [a[0], b[1]]


def test_kv_events_are_off_by_default_switched_on_by_a_bool_and_frozen() -> None:
    """``enable_kv_events`` must be a bool; without it nothing is recorded. Keys and events are
    immutable."""
    for value in (1, "yes", None):
        with pytest.raises(TypeError, match="enable_kv_events"):
            PrefixCachingBlockManager(4, 2, enable_kv_events=value)  # type: ignore[arg-type]
    (key,) = PrefixCachingBlockManager(4, 4).block_keys([1, 2, 3, 4])
    for name, value in [("tokens", (9, 9, 9, 9)), ("extra", "salt"), ("parent", None)]:
        with pytest.raises(FrozenInstanceError):
            setattr(key, name, value)
    for switch, names in [({}, []), ({"enable_kv_events": True}, EVENT_NAMES)]:
        manager = PrefixCachingBlockManager(1, 2, **switch)
        table, _ = manager.allocate_prompt([1, 2])
        manager.cache_blocks(table, [1, 2])
        manager.free(table)
        manager.free(manager.allocate(1))  # evicts block 0's key
        assert manager.reset_prefix_cache()
        events = manager.take_events()
        assert [type(e).__name__ for e in events] == names
    for item in events:
        with pytest.raises(FrozenInstanceError):
            item.block_id = 5  # type: ignore[misc, union-attr]


def test_lookup_stops_at_the_first_miss_though_a_later_block_is_cached() -> None:
    """A block is found only through its whole prefix: a child of an evicted parent misses."""
    manager = PrefixCachingBlockManager(6, 2)
    first, _ = manager.allocate_prompt([1, 1, 2, 2, 0])  # blocks 0 1 2, prefill still running
    second, _ = manager.allocate_prompt([1, 1, 3, 3, 0])  # blocks 3 4 5
    manager.cache_blocks(second, [1, 1, 3, 3, 0])  # caches [1, 1] in 3
    assert manager.cache_blocks(first, [1, 1, 2, 2, 0]) == 1  # block 0 duplicates block 3
    manager.free(second)
    manager.allocate(3)  # evicts blocks 4 and 3: [1, 1] is no longer cached anywhere
    assert manager.key_of(1) is not None and manager.stats.evictions == 2
    assert manager.lookup([1, 1, 2, 2, 0]) == []
    assert manager.blocks_to_allocate([1, 1, 2, 2, 0]) == 3


def test_a_hash_that_is_not_an_int_is_refused() -> None:
    """``hash_fn`` must return an int: TypeError, nothing cached."""
    manager = PrefixCachingBlockManager(4, 2, hash_fn=lambda parent, tokens, extra: "1")
    with pytest.raises(TypeError):
        manager.block_keys([1, 2])
    with pytest.raises(TypeError):
        manager.allocate_prompt([1, 2, 3])
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 0


KEY_PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7]
GOLDEN_SALTED = [4134609230749097507, 2022915652591636899, -5562750073687475860]
"""``block_keys(KEY_PROMPT, "tenant-a")``'s hashes, block size 4 (as other processes see them)."""


def test_block_hashes_are_the_written_down_values_and_a_salt_changes_every_one() -> None:
    manager = PrefixCachingBlockManager(8, 4)
    salted = [key.hash_value for key in manager.block_keys(KEY_PROMPT, "tenant-a")]
    assert salted == GOLDEN_SALTED
    for other in (None, "tenant-b", ("tenant-a",), ("tenant", ("a", 1.5, b"x", True))):
        hashes = [key.hash_value for key in manager.block_keys(KEY_PROMPT, other)]
        assert not set(hashes) & set(salted)


def test_an_unstable_extra_key_is_refused_by_the_first_call_that_receives_it() -> None:
    """Every call taking an extra key refuses an unstable one, even with no block hashed."""
    manager = PrefixCachingBlockManager(8, 4)
    for call in (
        lambda: manager.allocate_prompt([1, 2], frozenset()),
        lambda: manager.lookup([1, 2], frozenset()),
        lambda: manager.blocks_to_allocate([], ("ok", frozenset())),
        lambda: manager.block_keys([1, 2, 3], object()),
    ):
        with pytest.raises(TypeError, match="extra_key"):
            call()
        assert manager.num_free_blocks == 8 and manager.stats.queried_blocks == 0
    table, _ = manager.allocate_prompt([1, 2], "fine")
    with pytest.raises(TypeError, match="extra_key"):
        manager.cache_blocks(table, [1, 2], frozenset())
    assert manager.num_cached_blocks == 0 and manager.num_free_blocks == 7
    other = PrefixCachingBlockManager(8, 4, hash_fn=lambda *parts: 0)  # it judges its keys
    assert other.allocate_prompt([1, 2], frozenset())[1] == 0
    for extra in (frozenset({1}), object(), [1], ("ok", {1}), ("ok", ("deep", {1})), 1j):
        manager = PrefixCachingBlockManager(8, 4)
        with pytest.raises(TypeError, match="extra_key"):
            manager.allocate_prompt(KEY_PROMPT, extra)
        assert manager.num_free_blocks == 8 and manager.stats.queried_blocks == 0


EQUAL_EXTRA_KEYS: list[tuple[object, list[object]]] = [
    (1, [True, 1.0, np.float64(1.0)]), (0.0, [-0.0, 0, False]),
    (("t", 1), [("t", True), ("t", 1.0)]), ("t", [np.str_("t")]), (b"t", [np.bytes_(b"t")]),
]  # fmt: skip


def test_equal_extra_keys_hash_equal_and_hit() -> None:
    """Equal extra keys (``1``, ``True``) hash equal and hit under both hashes; others miss."""
    cases = [(h, stored, equal) for h in (default_block_hash, colliding_hash)
             for stored, equal in EQUAL_EXTRA_KEYS]  # fmt: skip
    for hash_fn, stored, equal in cases:
        manager = PrefixCachingBlockManager(8, 4, hash_fn=hash_fn)
        table, _ = manager.allocate_prompt(KEY_PROMPT, stored)
        manager.cache_blocks(table, KEY_PROMPT, stored)
        hashes = [key.hash_value for key in manager.block_keys(KEY_PROMPT, stored)]
        for other in equal:
            assert [key.hash_value for key in manager.block_keys(KEY_PROMPT, other)] == hashes
            assert manager.lookup(KEY_PROMPT, other) == table[:3], (hash_fn, other)
        assert manager.lookup(KEY_PROMPT, 2) == []
        assert manager.lookup(KEY_PROMPT, (stored, stored)) == []


def test_the_default_hash_is_the_documented_recipe() -> None:
    """design.md §8's recipe from its words: BLAKE2b-8 of the UTF-8 repr of (parent hash or
    None, tokens, canonical extra key), little-endian signed; ``("t", True, -0.0, 2.5)`` is
    canonically ``('t', 1, 0, 2.5)``."""

    def recipe(text: str) -> int:
        digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    first = recipe("(None, (0, 1, 2, 3), ('t', 1, 0, 2.5))")
    second = recipe(f"({first}, (4, 5, 6, 7), ('t', 1, 0, 2.5))")
    keys = PrefixCachingBlockManager(8, 4).block_keys(list(range(9)), ("t", True, -0.0, 2.5))
    assert [key.hash_value for key in keys] == [first, second]
    cut = hashlib.blake2b(b"(None, (0, 1, 2, 3), ('t', 1, 0, 2.5))").digest()[:8]
    assert int.from_bytes(cut, "little", signed=True) != first, "a cut digest is another hash"
