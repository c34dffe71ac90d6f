"""Triton kernel: the spec's ``translate_slot`` for a batch of tokens.

``slot = block_tables[seq, pos // block_size] * block_size + pos % block_size``; position ``-1``
(padding) gives slot ``-1``. One program handles ``BLOCK`` tokens.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.triton_import import tl, triton

TOKENS_PER_PROGRAM = 256


@triton.jit
def _slot_mapping_kernel(
    block_tables_ptr,
    positions_ptr,
    seq_ids_ptr,
    slots_ptr,
    num_tokens,
    table_stride,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = tokens < num_tokens
    pos = tl.load(positions_ptr + tokens, mask=in_range, other=-1).to(tl.int64)
    live = in_range & (pos >= 0)
    seq = tl.load(seq_ids_ptr + tokens, mask=live, other=0).to(tl.int64)
    block_id = tl.load(
        block_tables_ptr + seq * table_stride + pos // BLOCK_SIZE, mask=live, other=0
    ).to(tl.int64)
    slot = tl.where(live, block_id * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    tl.store(slots_ptr + tokens, slot, mask=in_range)


def launch(
    block_tables: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, block_size: int
) -> torch.Tensor:
    """Run the kernel on validated int64 ``positions``/``seq_ids``; returns int64 slots."""
    tables = block_tables.contiguous()
    slots = torch.empty_like(positions, dtype=torch.int64)
    num_tokens = positions.numel()
    if num_tokens:
        grid = (triton.cdiv(num_tokens, TOKENS_PER_PROGRAM),)
        _slot_mapping_kernel[grid](
            tables,
            positions.contiguous(),
            seq_ids.contiguous(),
            slots,
            num_tokens,
            tables.stride(0),
            BLOCK_SIZE=block_size,
            BLOCK=TOKENS_PER_PROGRAM,
        )
    return slots
