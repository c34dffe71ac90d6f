"""pagedkv's executable specification: the semantics every other package is checked against."""

if __name__ != "pagedkv.spec":  # the repository root is on sys.path: refuse a second name
    raise ImportError(f"import pagedkv.spec, not {__name__}: one module, one name")

from pagedkv.spec.block_manager import (
    Block,
    BlockManager,
    BlockTableError,
    OutOfBlocksError,
    blocks_needed,
    blocks_outside_window,
    translate_slot,
)

__all__ = [
    "Block",
    "BlockManager",
    "BlockTableError",
    "OutOfBlocksError",
    "blocks_needed",
    "blocks_outside_window",
    "translate_slot",
]
