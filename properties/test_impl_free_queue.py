"""``FreeBlockQueue`` against a list, with ``remove`` from the middle and its compaction."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.impl.blocks.free_queue import FreeBlockQueue
from properties.machines.free_queue import FreeQueueMachine

TestFreeQueue = FreeQueueMachine.TestCase


def test_remove_is_amortized_constant() -> None:
    """Reviving blocks from the middle compacts the ring once per more than n // 2 removals."""
    queue = FreeBlockQueue(1000)
    assert queue.compactions == 0  # a new ring has never been compacted
    model = list(range(1000))
    for _ in range(2000):  # revive a block from the middle, free it again later
        middle = model[len(model) // 2]
        queue.remove(middle)
        model.remove(middle)
        queue.extend(np.array([middle], dtype=np.intp))
        model.append(middle)
    assert queue.to_array().tolist() == model
    assert queue.compactions == 3  # when a push finds the ring full: once every 500 pushes


def test_a_small_ring_compacts_when_a_push_finds_it_full() -> None:
    """Two blocks, a ring of three slots: the second revival's push finds it full and compacts;
    a pop of nothing past a tombstone returns an empty array. No blocks: no ring, refused."""
    for num_blocks in (0, -1):
        with pytest.raises(ValueError):
            FreeBlockQueue(num_blocks)
    queue = FreeBlockQueue(2)
    for block_id in (0, 1):  # revive a block from the queue, free it again
        queue.remove(block_id)
        queue.extend(np.array([block_id], dtype=np.intp))
    assert queue.compactions == 1 and queue.to_array().tolist() == [0, 1]
    queue.remove(0)  # a tombstone at the head
    assert queue.popleft(0).tolist() == [] and queue.to_array().tolist() == [1]
