"""pagedkv's optimized block manager: the spec's behaviour, array-backed and batched."""

from impl.block_manager import BlockManager, BlockTableError, OutOfBlocksError
from impl.block_tables import PAD, BlockTableStore, CapacityError, SeqBatch
from impl.free_queue import FreeBlockQueue

__all__ = [
    "PAD",
    "BlockManager",
    "BlockTableError",
    "BlockTableStore",
    "CapacityError",
    "FreeBlockQueue",
    "OutOfBlocksError",
    "SeqBatch",
]
