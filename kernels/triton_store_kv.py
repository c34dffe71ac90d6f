"""Triton kernel: write each token's K and V rows into its cache slot.

The caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]``, so head ``h`` of
slot ``s`` starts at element ``(s * num_kv_heads + h) * head_dim``. The kernel walks the
``[tokens * num_kv_heads, head_dim]`` rows of ``key``/``value``, ``BLOCK_R`` rows per program;
a token whose slot is ``-1`` writes nothing.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.launch_config import ELEMENTS_PER_PROGRAM
from pagedkv.kernels.triton_import import tl, triton


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    num_rows,
    key_stride_t,
    key_stride_h,
    key_stride_d,
    value_stride_t,
    value_stride_h,
    value_stride_d,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    tokens = rows // NUM_KV_HEADS
    heads = rows % NUM_KV_HEADS
    dims = tl.arange(0, BLOCK_D)[None, :]
    row_mask = rows < num_rows
    slots = tl.load(slots_ptr + tokens, mask=row_mask, other=-1).to(tl.int64)
    mask = (row_mask & (slots >= 0))[:, None] & (dims < HEAD_DIM)
    dst = ((slots * NUM_KV_HEADS + heads) * HEAD_DIM)[:, None] + dims
    key_src = (tokens * key_stride_t + heads * key_stride_h)[:, None] + dims * key_stride_d
    value_src = (tokens * value_stride_t + heads * value_stride_h)[:, None] + dims * value_stride_d
    tl.store(k_cache_ptr + dst, tl.load(key_ptr + key_src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(value_ptr + value_src, mask=mask), mask=mask)


def launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Run the kernel on validated arguments (any strides for ``key``/``value``)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    num_rows = num_tokens * num_kv_heads
    if num_rows == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_r = min(max(1, ELEMENTS_PER_PROGRAM // block_d), triton.next_power_of_2(num_rows))
    _store_kv_kernel[(triton.cdiv(num_rows, block_r),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping.contiguous(),
        num_rows,
        *key.stride(),
        *value.stride(),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_R=block_r,
        BLOCK_D=block_d,
    )
