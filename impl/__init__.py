"""pagedkv's optimized block manager: the spec's behaviour, array-backed and batched."""

from impl.block_manager import BlockManager, BlockTableError, OutOfBlocksError
from impl.block_tables import PAD, BlockTableStore, CapacityError, SeqBatch
from impl.dense import dense_generate
from impl.engine import PagedAttentionEngine, RequestOutput
from impl.free_queue import FreeBlockQueue
from impl.metrics import StepMetrics
from impl.model import CausalLM, ModelConfig
from impl.prefix_cache import BlockKey, PrefixCacheStats, PrefixCachingBlockManager
from impl.scheduler import RequestTooLargeError, Scheduler, SchedulerConfig

__all__ = [
    "PAD",
    "BlockKey",
    "BlockManager",
    "BlockTableError",
    "BlockTableStore",
    "CapacityError",
    "CausalLM",
    "FreeBlockQueue",
    "ModelConfig",
    "OutOfBlocksError",
    "PagedAttentionEngine",
    "PrefixCacheStats",
    "PrefixCachingBlockManager",
    "RequestOutput",
    "RequestTooLargeError",
    "Scheduler",
    "SchedulerConfig",
    "SeqBatch",
    "StepMetrics",
    "dense_generate",
]
