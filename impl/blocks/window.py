"""Sliding-window attention as a block-management strategy: which leading blocks no query
reads any more, for a whole batch at once, and giving them back.

:class:`SlidingWindow` is the store's one home of the spec's ``blocks_outside_window``
(``spec/checks.py`` states the rule) over arrays. It is the per-attention-type part of the
store in vLLM's sense: full attention keeps every block and needs no strategy; another
attention type plugs in beside this one with its own :meth:`~SlidingWindow.blocks_outside`.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import BlockPool
from pagedkv.impl.blocks.rows import Rows, SeqRows


class SlidingWindow:
    """A window of ``window`` tokens (checked by the caller, at most ``INT32_MAX``) over blocks
    of ``block_size``."""

    def __init__(self, window: int, block_size: int) -> None:
        self.window = window
        self.block_size = block_size

    def blocks_outside(self, counts: NDArray[np.int64]) -> NDArray[np.int64]:
        """``blocks_outside_window(count, window, block_size)`` for each of ``counts``."""
        return np.maximum(counts - (self.window - 1), 0) // self.block_size

    def release(
        self,
        rows: SeqRows,
        batch_rows: Rows,
        base: Rows,
        counts: NDArray[np.int64],
        pool: BlockPool,
    ) -> None:
        """``release_outside_window`` per row in batch order: each row's leading blocks
        outside the window of its next query, at position ``counts`` (one per row)."""
        rows.release_leading(batch_rows, base, self.blocks_outside(counts), pool)
