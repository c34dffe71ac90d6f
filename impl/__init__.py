"""pagedkv's optimized block manager: the spec's behaviour, array-backed and batched."""

from impl.block_manager import BlockManager, BlockTableError, OutOfBlocksError
from impl.block_tables import PAD, BlockTableStore, CapacityError, SeqBatch
from impl.free_queue import FreeBlockQueue
from impl.prefix_cache import BlockKey, PrefixCacheStats, PrefixCachingBlockManager

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
