"""pagedkv's executable specification: the semantics every other package is checked against."""

from spec.block_manager import (
    Block,
    BlockManager,
    BlockTableError,
    OutOfBlocksError,
    blocks_needed,
    translate_slot,
)

__all__ = [
    "Block",
    "BlockManager",
    "BlockTableError",
    "OutOfBlocksError",
    "blocks_needed",
    "translate_slot",
]
