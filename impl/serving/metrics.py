"""Per-step serving metrics, computed from the scheduler and the block tables (no model needed).

KV memory is measured physically: a block shared by several tables (forked samples, a cached
prefix) counts once. A held block's *filled* slots are the rows some holder's tokens reach
(``min(block_size, token_count - i * block_size)`` for the ``i``-th block of a table, the most
over its holders); every block in a table holds at least one token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pagedkv.impl.blocks.store import BlockTableStore
    from pagedkv.impl.serving.scheduler import Scheduler, SchedulerOutput


@dataclass(frozen=True)
class StepMetrics:
    """What one step did and the state it left."""

    step: int
    num_running: int  # sequences running after the step
    num_waiting: int  # sequences waiting after the step (including preempted ones)
    num_batched_tokens: int  # tokens computed this step (prefill chunks + decodes)
    num_decodes: int  # sequences that computed exactly one token
    free_blocks: int  # blocks in the free queue (cached-free blocks included)
    used_blocks: int  # distinct blocks held by live tables
    kv_utilization: float  # filled slots / slots of used blocks (1.0 when nothing is held)
    tail_waste: int  # slots of used blocks that hold no token: used_blocks * bs - filled
    preemptions: int  # sequences preempted this step
    prefix_hit_tokens: int  # prompt tokens served from the prefix cache this step
    num_finished: int  # sequences finished this step

    def line(self) -> str:
        """A one-line summary for a log or a progress bar."""
        return (
            f"step {self.step:4d} | run {self.num_running:2d} wait {self.num_waiting:2d} | "
            f"tokens {self.num_batched_tokens:4d} ({self.num_decodes} decode) | "
            f"blocks free {self.free_blocks:4d} used {self.used_blocks:4d} | "
            f"kv util {self.kv_utilization:6.1%} tail waste {self.tail_waste:4d} | "
            f"preempt {self.preemptions} | prefix hits {self.prefix_hit_tokens:3d} | "
            f"done {self.num_finished}"
        )


def kv_occupancy(store: BlockTableStore) -> tuple[int, int]:
    """``(filled slots, used blocks)`` over the live tables, each physical block once.

    O(live sequences), whatever the pool size, table width or sequence length, from three facts
    of a store that is its manager's only user: every block neither in the free queue nor
    waiting for a copy is held by a live table; a table's blocks before its last are full; and
    a partly filled last block is never an earlier block of another table (prefix hits are full
    blocks, a fork shares a last block only until the first write copies it, and the engine's
    speculative rollback cuts only into a block the step just wrote, which no other table
    holds). So only the distinct partly filled last blocks fall short of ``block_size``, each by
    its most-filled holder's shortfall.
    """
    bs = store.block_size
    rows = store.resolve(None).rows
    lengths = store.num_blocks.take(rows)
    held = lengths > 0
    rows, lengths = rows[held], lengths[held]
    fill = store.token_counts.take(rows) - (lengths - 1) * bs
    partial = fill < bs
    last = store.tables[rows[partial], lengths[partial] - 1]
    unique, inverse = np.unique(last, return_inverse=True)
    most = np.zeros(unique.size, dtype=np.int64)
    np.maximum.at(most, inverse, fill[partial])
    used = store.total_blocks - store.num_free_blocks - store.num_waiting_blocks
    return (used - unique.size) * bs + int(most.sum()), used


def step_metrics(
    step: int, scheduler: Scheduler, output: SchedulerOutput, num_finished: int
) -> StepMetrics:
    """The metrics of the step that ran ``output``, measured after it."""
    store = scheduler.store
    filled, used = kv_occupancy(store)
    slots = used * store.block_size
    return StepMetrics(
        step=step,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_batched_tokens=output.num_batched_tokens,
        num_decodes=int(np.count_nonzero(output.num_tokens == 1)),
        free_blocks=store.num_free_blocks,
        used_blocks=used,
        kv_utilization=filled / slots if slots else 1.0,
        tail_waste=slots - filled,
        preemptions=len(output.preempted),
        prefix_hit_tokens=output.prefix_hit_tokens,
        num_finished=num_finished,
    )
