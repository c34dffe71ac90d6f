"""Triton kernel: write each token's K and V rows into its cache slot.

The caches are contiguous ``[num_blocks, block_size, num_kv_heads, head_dim]``, so head ``h`` of
slot ``s`` starts at element ``(s * num_kv_heads + h) * head_dim``. The kernel walks the
``[tokens * num_kv_heads, head_dim]`` rows of ``key``/``value``, ``BLOCK_R`` rows per program;
a token whose slot is ``-1`` writes nothing. An fp8 cache (``FP8``, seen as ``uint8``) stores
the code of each row divided by its KV head's scale: ``x / scale`` in IEEE fp32 (``div_rn``:
Triton's ``/`` is approximate on GPUs), then ``triton_fp8.fp8_encode``, as ``spec.fp8.quantize``.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.launch_config import (
    ELEMENTS_PER_PROGRAM,
    INDEX_TYPES,
    SCALAR_TYPES,
    LaunchConfig,
    aligned,
    fp8_constexprs,
    run,
)
from pagedkv.kernels.triton_fp8 import fp8_encode
from pagedkv.kernels.triton_import import tl, triton

# An fp8 store's program encodes 4 elements a thread: at ELEMENTS_PER_PROGRAM (32 a thread) the
# encode's integer arithmetic took 157 to 165 registers on sm_80, 94 to 95 on sm_90 (kernels.md).
FP8_ELEMENTS_PER_PROGRAM = 512


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    FP8: tl.constexpr,
    E5M2: tl.constexpr,
    MANTISSA: tl.constexpr,
    BIAS: tl.constexpr,
    MAX_CODE: tl.constexpr,
    MAX_BITS: tl.constexpr,
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
    k = tl.load(key_ptr + key_src, mask=mask)
    v = tl.load(value_ptr + value_src, mask=mask)
    if FP8:  # Rule (spec.fp8.quantize): x / scale in fp32, then the nearest code
        k_scale = tl.load(k_scale_ptr + heads, mask=row_mask, other=1.0)[:, None]
        v_scale = tl.load(v_scale_ptr + heads, mask=row_mask, other=1.0)[:, None]
        k = tl.math.div_rn(k.to(tl.float32), k_scale)
        v = tl.math.div_rn(v.to(tl.float32), v_scale)
        k = fp8_encode(k, MANTISSA, BIAS, MAX_CODE, MAX_BITS)
        v = fp8_encode(v, MANTISSA, BIAS, MAX_CODE, MAX_BITS)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_config(
    shape: tuple[int, int, int],
    dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
    strides: tuple[int, ...],
    fp8: str | None = None,
    cache_dtype: torch.dtype | None = None,
) -> LaunchConfig:
    """The store's launch, pure (the compile gate builds it too): ``key``'s ``shape`` ``(tokens,
    kv_heads, head_dim)``, the ``dtypes`` of ``key``, ``value`` and the slot mapping, both rows'
    ``strides`` (key's three, then value's), and the caches' fp8 format or their
    ``cache_dtype``."""
    num_tokens, num_kv_heads, head_dim = shape
    num_rows = num_tokens * num_kv_heads
    block_d = triton.next_power_of_2(head_dim)
    elements = FP8_ELEMENTS_PER_PROGRAM if fp8 else ELEMENTS_PER_PROGRAM
    block_r = min(max(1, elements // block_d), triton.next_power_of_2(max(1, num_rows)))
    cache = "*u8" if fp8 else f"*{SCALAR_TYPES[cache_dtype or dtypes[0]]}"
    scale = "*fp32" if fp8 else f"*{INDEX_TYPES[dtypes[2]]}"  # not fp8: the slots, never read
    names = [f"{row}_stride_{axis}" for row in ("key", "value") for axis in "thd"]
    scalars = {"num_rows": num_rows, **dict(zip(names, strides, strict=True))}
    integers = {name: "i32" if value < 2**31 else "i64" for name, value in scalars.items()}
    return LaunchConfig(
        kernel="_store_kv_kernel",
        grid=(triton.cdiv(num_rows, block_r), 1, 1),
        signature={
            "key_ptr": f"*{SCALAR_TYPES[dtypes[0]]}",
            "value_ptr": f"*{SCALAR_TYPES[dtypes[1]]}",
            "k_cache_ptr": cache,
            "v_cache_ptr": cache,
            "slots_ptr": f"*{INDEX_TYPES[dtypes[2]]}",
            "k_scale_ptr": scale,
            "v_scale_ptr": scale,
            **integers,
        },
        scalars=scalars,
        constexprs={
            "NUM_KV_HEADS": num_kv_heads,
            "HEAD_DIM": head_dim,
            "BLOCK_R": block_r,
            "BLOCK_D": block_d,
            **fp8_constexprs(fp8, store=True),
        },
        num_warps=4,
        num_stages=1,
    )


def launch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> None:
    """Run the kernel on validated arguments (any strides for ``key``/``value``); an fp8 cache
    comes as its ``uint8`` view with its format's name ``fp8`` and the ``(k, v)`` scales."""
    if key.shape[0] * key.shape[1] == 0:
        return
    key, value, slots = aligned(key), aligned(value), aligned(slot_mapping.contiguous())
    config = store_config(
        tuple(key.shape), (key.dtype, value.dtype, slots.dtype), (*key.stride(), *value.stride()),
        fp8, k_cache.dtype,
    )  # fmt: skip
    scale_tensors = tuple(map(aligned, scales)) if scales is not None else (slots, slots)
    run(_store_kv_kernel, config, key, value, k_cache, v_cache, slots, *scale_tensors)
