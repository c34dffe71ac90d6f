"""Block management: the spec's block manager and prefix cache on numpy arrays, and the store
that drives them a scheduler step at a time. Needs numpy only: no torch, no kernels.

* :class:`FreeBlockQueue` (``free_queue``): the FIFO free queue, O(1) removal from the middle.
* :class:`BlockManager` (``manager``): ``pagedkv.spec``'s block manager, array-backed, over an
  unchecked ``pool.BlockPool`` (internal to this package).
* :class:`PrefixCachingBlockManager` (``prefix_cache``): prefix caching, holding a
  :class:`BlockManager` and its pool.
* :class:`BlockTableStore` (``store``): the sequence lifecycle, a facade over ``rows`` (the one
  owner of each sequence's row, table and counts; :class:`SeqBatch`), ``admission`` (a new
  sequence's first blocks), ``growth`` (a pure plan, then applying it), ``window`` (the sliding
  window) and, under prefix caching only, ``prefix_store`` (its hooks and each sequence's block
  keys); ``page_tables`` lays the tables out for kernels.
"""

from pagedkv.impl.blocks.free_queue import FreeBlockQueue
from pagedkv.impl.blocks.manager import BlockManager, BlockTableError, OutOfBlocksError
from pagedkv.impl.blocks.prefix_cache import BlockKey, PrefixCacheStats, PrefixCachingBlockManager
from pagedkv.impl.blocks.rows import PAD, CapacityError, SeqBatch
from pagedkv.impl.blocks.store import BlockTableStore

__all__ = [
    "PAD",
    "BlockKey",
    "BlockManager",
    "BlockTableError",
    "BlockTableStore",
    "CapacityError",
    "FreeBlockQueue",
    "OutOfBlocksError",
    "PrefixCacheStats",
    "PrefixCachingBlockManager",
    "SeqBatch",
]
