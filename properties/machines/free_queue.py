"""The free-queue machine: ``FreeBlockQueue`` against a list (``QUEUE``: swappable)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.impl.blocks.free_queue import FreeBlockQueue
from properties.machines.lockstep import Lockstep


class FreeQueueMachine(Lockstep, RuleBasedStateMachine):
    QUEUE: ClassVar[type] = FreeBlockQueue

    @initialize(num_blocks=st.integers(1, 40))
    def start(self, num_blocks: int) -> None:
        self.queue = self.QUEUE(num_blocks)
        self.model = list(range(num_blocks))
        self.num_blocks = num_blocks

    def snapshot(self) -> list[int]:
        return self.queue.to_array().tolist()

    def outside(self) -> list[int]:
        queued = set(self.model)
        return [b for b in range(self.num_blocks) if b not in queued]

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def popleft(self, data: st.DataObject) -> None:
        count = data.draw(st.integers(0, len(self.model)))
        popped = self.queue.popleft(count)
        assert popped.dtype == np.intp
        assert popped.tolist() == self.model[:count]
        del self.model[:count]

    @precondition(lambda self: self.model)
    @rule()
    def pop_one(self) -> None:
        """The single-block pop: the head, as a plain int, tombstones skipped."""
        block = self.queue.pop_one()
        assert type(block) is int and block == self.model.pop(0)

    @rule(data=st.data())
    def popleft_too_many(self, data: st.DataObject) -> None:
        self.refuses(IndexError, self.queue.popleft, len(self.model) + data.draw(st.integers(1, 3)))

    @precondition(lambda self: len(self.model) < self.num_blocks)
    @rule(data=st.data())
    def extend(self, data: st.DataObject) -> None:
        pushed = data.draw(st.lists(st.sampled_from(self.outside()), unique=True))
        self.queue.extend(np.array(pushed, dtype=np.intp))
        self.model += pushed

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def remove_one(self, data: st.DataObject) -> None:
        self.remove(data.draw(st.sampled_from(self.model)))

    def remove(self, block_id: int) -> None:
        self.queue.remove(block_id)
        self.model.remove(block_id)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), rounds=st.integers(1, 4))
    def recycle(self, data: st.DataObject, rounds: int) -> None:
        """Evict queued blocks and push them back, ``rounds`` times: the tombstones fill the
        ring until a push compacts it, and later removals find the blocks where they moved."""
        for _ in range(rounds):
            taken = data.draw(st.lists(st.sampled_from(self.model), min_size=1, unique=True))
            for block_id in taken:
                self.remove(block_id)
            self.queue.extend(np.array(taken, dtype=np.intp))
            self.model += taken

    @precondition(lambda self: len(self.model) < self.num_blocks)
    @rule(data=st.data())
    def remove_absent(self, data: st.DataObject) -> None:
        self.refuses(KeyError, self.queue.remove, data.draw(st.sampled_from(self.outside())))

    @precondition(lambda self: len(self.model) < self.num_blocks)
    @rule(data=st.data())
    def has_repeats(self, data: st.DataObject) -> None:
        ids = data.draw(st.lists(st.sampled_from(self.outside()), min_size=1, max_size=8))
        assert self.queue.has_repeats(np.array(ids, dtype=np.intp)) == (len(set(ids)) < len(ids))

    @invariant()
    def equals_model(self) -> None:
        assert len(self.queue) == len(self.model)
        assert self.queue.to_array().tolist() == self.model
        queued = set(self.model)
        assert [b in self.queue for b in range(self.num_blocks)] == [
            b in queued for b in range(self.num_blocks)
        ]
