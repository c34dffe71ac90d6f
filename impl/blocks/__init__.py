"""Block management: the spec's block manager and prefix cache on numpy arrays, and the store
that drives them a scheduler step at a time. Needs numpy only: no torch, no kernels.

* :class:`FreeBlockQueue` (``free_queue``): the FIFO free queue, O(1) removal from the middle.
* :class:`BlockManager` (``manager``): ``pagedkv.spec``'s block manager, array-backed.
* :class:`PrefixCachingBlockManager` (``prefix_cache``): prefix caching on that manager.
* :class:`BlockTableStore` (``table_store``): every live sequence's table in one padded array;
  batched grow, slot mapping, page-table exports.
"""

from pagedkv.impl.blocks.free_queue import FreeBlockQueue
from pagedkv.impl.blocks.manager import BlockManager, BlockTableError, OutOfBlocksError
from pagedkv.impl.blocks.prefix_cache import BlockKey, PrefixCacheStats, PrefixCachingBlockManager
from pagedkv.impl.blocks.table_store import PAD, BlockTableStore, CapacityError, SeqBatch

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
