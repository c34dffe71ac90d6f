"""The sliding-window rule every schedule keeps, checked by the scheduler and engine properties."""

from __future__ import annotations

from pagedkv.impl.serving.scheduler import Scheduler
from pagedkv.spec.block_manager import blocks_needed, blocks_outside_window


def check_window(scheduler: Scheduler, window: int | None) -> int:
    """Running tables release exactly the blocks outside the window; decoding ones hold it + 1."""
    store = scheduler.store
    bs, total = store.block_size, 0
    for seq in scheduler.running:
        row, table = store.row(seq.seq_id), store.table(seq.seq_id)  # type: ignore[attr-defined]
        count = int(store.num_released[row])  # type: ignore[attr-defined]
        assert count == (blocks_outside_window(seq.num_computed, window, bs) if window else 0)
        assert table[:count] == [None] * count and None not in table[count:]
        assert store.tables[row, :count].tolist() == [-1] * count  # type: ignore[attr-defined]
        if window and seq.num_pending == 1:  # decoding: the table holds the token being computed
            assert len(table) - count <= blocks_needed(window - 1, bs) + 2, (seq.seq_id, window)
        total += count
    return total
