"""The exhaustive check: every pool to its depth, its distinct states pinned (exploring less
fails); the spec's planted bugs caught on small pools; controls pass."""

from __future__ import annotations

import pytest

import pagedkv.spec.block_manager as spec_block_manager
import pagedkv.spec.prefix_cache as spec_prefix_cache
from properties.exhaustive import (
    BLOCK_POOLS,
    PREFIX_POOLS,
    BlockSystem,
    Mismatch,
    PrefixSystem,
    System,
    explore,
)
from properties.mutants import load_copy, load_mutant
from properties.test_planted_bugs import EVENT_CLASSES, PREFIX_BUGS, SHARED_NAMES, SPEC_BUGS

STATES = {
    BlockSystem: (BLOCK_POOLS, [85, 126, 583, 1159, 926, 1964, 1983, 4398]),
    PrefixSystem: (PREFIX_POOLS, [19, 54, 459, 1113, 1409, 1736, 807, 3918]),
}
"""Each system's pools and the distinct states each visits, in order (docs/results.md)."""

# The planted bugs left to the machines: the exhaustive check enumerates no rollbacks, window
# releases, KV events, resets or stats reads.
ROLLBACK_BUGS = {
    "truncate releases the dropped blocks head first",
    "truncate frees the dropped blocks outright, shared ones too",
    "truncate drops a partly kept last block",
    "truncate past the table's capacity",
    "a cut cached block keeps its key",
    "a cut cached block loses its key while other tables hold it",
    "a cached block is written in place",
}
WINDOW_BUGS = {
    "the window releases one block it still reads",
    "the window releases its blocks head first",
    "the window frees shared blocks outright",
    "the window keeps the released entries' ids",
    "a write into a released entry is not refused",
    "the window past the table's capacity",
}
OBSERVER_BUGS = {
    "a stored block emits no event",
    "an eviction emits no event",
    "a reset emits no event",
    "events are recorded while disabled",
    "a reset while blocks are held",
    "a reset reorders the free queue",
    "reading the stats does not reset them",
}


QUICK_STATES = 1000
"""Pools with fewer states run in the quick command; larger ones (minutes each) are ``long``."""

POOLS = [
    pytest.param(
        system_cls,
        *pool,
        states,
        id=f"{system_cls.__name__}-{pool[0]}x{pool[1]}-depth{pool[2]}",
        marks=[pytest.mark.long] if states >= QUICK_STATES else [],
    )
    for system_cls, (pools, counts) in STATES.items()
    for pool, states in zip(pools, counts, strict=True)
]


@pytest.mark.parametrize(("system_cls", "total_blocks", "block_size", "depth", "states"), POOLS)
def test_every_sequence_agrees(
    system_cls: type[System], total_blocks: int, block_size: int, depth: int, states: int
) -> None:
    assert explore(system_cls(total_blocks, block_size), depth) == states


def planted(system_cls: type[System], spec_cls: type, block_size: int) -> System:
    """``system_cls`` on a pool of 3 blocks of ``block_size`` with ``spec_cls`` as its spec."""
    attrs = {"spec_cls": spec_cls}
    return type(f"Planted{system_cls.__name__}", (system_cls,), attrs)(3, block_size)


def test_the_bugs_left_to_the_machines_are_planted_bugs() -> None:
    assert set(PREFIX_BUGS) >= OBSERVER_BUGS and set(PREFIX_BUGS) | set(SPEC_BUGS) >= ROLLBACK_BUGS
    assert set(SPEC_BUGS) >= WINDOW_BUGS


def test_controls_pass() -> None:
    explore(planted(BlockSystem, load_copy(spec_block_manager, SHARED_NAMES).BlockManager, 2), 4)
    prefix = load_copy(spec_prefix_cache, EVENT_CLASSES).PrefixCachingBlockManager
    explore(planted(PrefixSystem, prefix, 1), 4)


FIVE_OPERATIONS = {"the blocks waiting for a copy stay out of the queue after it"}
"""Planted bugs that need five operations (depth 5; the others depth 4)."""


@pytest.mark.parametrize("bug", sorted(set(SPEC_BUGS) - ROLLBACK_BUGS - WINDOW_BUGS))
def test_planted_block_manager_bug_is_caught(bug: str) -> None:
    mutant = load_mutant(spec_block_manager, *SPEC_BUGS[bug], SHARED_NAMES).BlockManager
    with pytest.raises(Mismatch):
        explore(planted(BlockSystem, mutant, 2), 5 if bug in FIVE_OPERATIONS else 4)


@pytest.mark.parametrize("bug", sorted(set(PREFIX_BUGS) - ROLLBACK_BUGS - OBSERVER_BUGS))
def test_planted_prefix_cache_bug_is_caught(bug: str) -> None:
    mutant = load_mutant(spec_prefix_cache, *PREFIX_BUGS[bug], EVENT_CLASSES)
    with pytest.raises(Mismatch):
        explore(planted(PrefixSystem, mutant.PrefixCachingBlockManager, 1), 4)
