"""pagedkv's optimized block manager: the spec's behaviour, array-backed and batched.

The package namespace holds the block-management API, which needs only numpy (and torch for the
tensor exports). The engine lives in its own modules: ``impl.model``, ``impl.scheduler``,
``impl.engine`` (``PagedAttentionEngine``; ``python -m impl.engine`` runs the demo) and
``impl.dense`` (the dense oracle).
"""

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
