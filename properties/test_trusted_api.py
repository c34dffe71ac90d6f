"""The unchecked pool's one-block operations against the spec's, and the queue's
``pop_one``/``push_one`` against a list; planted bugs in copies are caught."""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

import pagedkv.impl.blocks.free_queue
import pagedkv.impl.blocks.manager
import pagedkv.impl.blocks.pool
import pagedkv.impl.blocks.prefix_cache
from pagedkv.impl.blocks import FreeBlockQueue, PrefixCachingBlockManager
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager as SpecPrefixManager
from properties.mutants import CONTROL_SEARCHES, FIND, load_chain, load_mutant
from properties.outcomes import outcome


class SingleBlockMachine(RuleBasedStateMachine):
    """One-block tables through the unchecked pool (impl) and the checked API (spec)."""

    IMPL: ClassVar[type] = PrefixCachingBlockManager
    held = Bundle("held")

    @initialize(total_blocks=st.integers(1, 8))
    def start(self, total_blocks: int) -> None:
        self.spec = SpecPrefixManager(total_blocks, 1)
        self.impl = self.IMPL(total_blocks, 1)

    @precondition(lambda self: self.spec.num_free_blocks > 0)
    @rule(target=held)
    def take(self) -> int:
        (block,) = self.spec.allocate(1)
        assert self.impl.pool.take_one() == block
        return block

    @rule(block=held)
    def share(self, block: int) -> None:
        if self.spec.ref_count(block) > 0:
            self.spec.fork([block])
            self.impl.pool.share(np.array([block], dtype=np.intp))

    @rule(block=consumes(held))
    def release(self, block: int) -> None:
        if self.spec.ref_count(block) > 0:
            self.spec.free([block])
            self.impl.pool.release(np.array([block], dtype=np.intp))

    @rule(block=held, token=st.integers(0, 1))
    def cache(self, block: int, token: int) -> None:
        if self.spec.ref_count(block) > 0:
            assert outcome(self.impl.cache_blocks, [block], [token]) == outcome(
                self.spec.cache_blocks, [block], [token]
            )

    @rule(token=st.integers(0, 1), data=st.data())
    def revive(self, token: int, data: st.DataObject) -> None:
        # A cached, free first block: revived from the queue's middle.
        prompt = [token, data.draw(st.integers(0, 1))]
        if self.spec.blocks_to_allocate(prompt) <= self.spec.num_free_blocks:
            table, _ = self.spec.allocate_prompt(prompt)
            assert self.impl.allocate_prompt(prompt)[0] == table
            self.spec.free(table)
            self.impl.free(table)

    @invariant()
    def agrees(self) -> None:
        assert self.impl.free_block_ids() == self.spec.free_block_ids()
        assert self.impl.ref_counts().tolist() == [b.ref_count for b in self.spec.blocks]
        assert self.impl.stats == self.spec.stats
        for block in range(self.spec.total_blocks):
            assert self.impl.key_of(block) == self.spec.key_of(block)


TestSingleBlock = SingleBlockMachine.TestCase


class OneIdQueueMachine(RuleBasedStateMachine):
    QUEUE: ClassVar[type] = FreeBlockQueue

    @initialize(size=st.integers(1, 12))
    def start(self, size: int) -> None:
        self.queue = self.QUEUE(size)
        self.model = list(range(size))
        self.size = size

    @precondition(lambda self: self.model)
    @rule()
    def pop_one(self) -> None:
        assert self.queue.pop_one() == self.model.pop(0)

    @precondition(lambda self: len(self.model) < self.size)
    @rule(data=st.data())
    def push_one(self, data: st.DataObject) -> None:
        out = [b for b in range(self.size) if b not in self.model]
        block = data.draw(st.sampled_from(out))
        self.queue.push_one(block)
        self.model.append(block)

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove(self, data: st.DataObject) -> None:
        block = data.draw(st.sampled_from(self.model))
        self.queue.remove(block)
        self.model.remove(block)

    @invariant()
    def agrees(self) -> None:
        assert self.queue.to_array().tolist() == self.model
        assert len(self.queue) == len(self.model)


TestOneIdQueue = OneIdQueueMachine.TestCase


PLANTED = {  # bug: (module, scope, old, new, the machine that catches it)
    "pop_one returns a tombstone": (pagedkv.impl.blocks.free_queue, "FreeBlockQueue.pop_one",
        "block == TOMBSTONE", "False", OneIdQueueMachine),
    "release frees a block that still has owners": (pagedkv.impl.blocks.pool,
        "BlockPool.release_held", "ids[remaining == 0] if np.count_nonzero(remaining) else ids",
        "ids", SingleBlockMachine),
    "take_one does not evict": (pagedkv.impl.blocks.pool, "BlockPool.take_one",
        "self.evictor.evict_one(block)", "None", SingleBlockMachine),
}  # fmt: skip


def planted(module: Any, within: str, old: str, new: str, base: type) -> type:
    if module is pagedkv.impl.blocks.free_queue:
        queue = load_mutant(module, within, old, new)
        return type("PlantedQueue", (base,), {"QUEUE": queue.FreeBlockQueue})
    prefix = load_chain(  # the prefix manager over a copy of the mutant pool
        [module, pagedkv.impl.blocks.manager, pagedkv.impl.blocks.prefix_cache],
        within, old, new, ("BlockTableError", "OutOfBlocksError"),
    )  # fmt: skip
    return type("PlantedManager", (base,), {"IMPL": prefix.PrefixCachingBlockManager})


@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_copies_pass(search: settings) -> None:
    for bug in ("pop_one returns a tombstone", "take_one does not evict"):
        module, within, old, _, base = PLANTED[bug]
        run_state_machine_as_test(planted(module, within, old, old, base), settings=search)


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_trusted_path_bug_is_caught(bug: str) -> None:
    machine = planted(*PLANTED[bug])
    with pytest.raises(Exception):  # noqa: B017 - an assertion or a crash inside a rule
        run_state_machine_as_test(machine, settings=FIND)
