"""Checks that a kernel call's tensors have the shapes, dtypes and devices that fit each other.

``check_caches`` fixes the cache geometry (:class:`CacheShape`); the query, the K/V rows, the
block tables, the lengths, the slots and the token index are checked against it. These checks
read no tensor value (``kernels.check_values`` does); errors as in ``kernels.check_arguments``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.kernels.check_arguments import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_disjoint,
    check_same_device,
    check_shape,
    check_tensor,
)
from pagedkv.kernels.fp8 import FP8_DTYPES

CACHE_DTYPES = (*FLOAT_DTYPES, *FP8_DTYPES)


def check_compute_dtype(name: str, tensor: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """A query's or a K/V row's dtype: the caches' own, or any of fp32, fp16 and bf16 for an
    fp8 cache (``TypeError``)."""
    if cache_dtype in FP8_DTYPES:
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be fp32, fp16 or bf16 (fp8 caches), got {tensor.dtype}")
    elif tensor.dtype != cache_dtype:
        raise TypeError(f"{name} has dtype {tensor.dtype} but the caches have {cache_dtype}")


@dataclass(frozen=True)
class CacheShape:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` of a K/V cache pair."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_caches(k_cache: object, v_cache: object) -> CacheShape:
    """Two contiguous caches of one shape, dtype (fp32, fp16, bf16 or an fp8 format) and
    device."""
    k = check_tensor("k_cache", k_cache, 4, CACHE_DTYPES)
    v = check_tensor("v_cache", v_cache, 4, CACHE_DTYPES)
    check_shape("v_cache", v, k.shape)
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache has dtype {v.dtype} but k_cache has {k.dtype}")
    check_same_device(k_cache=k, v_cache=v)
    for name, cache in (("k_cache", k), ("v_cache", v)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_blocks, block_size, heads, dim]")
    check_disjoint("k_cache", k, "v_cache", v)
    num_blocks, block_size, num_kv_heads, head_dim = k.shape
    for name, size in (("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if size < 1:
            raise ValueError(f"k_cache {name} must be >= 1, got shape {tuple(k.shape)}")
    if head_dim < 1:
        raise ValueError(f"k_cache head_dim must be >= 1, got shape {tuple(k.shape)}")
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim)


def check_decode_query(query: object, caches: CacheShape, dtype: torch.dtype) -> torch.Tensor:
    """A ``[batch, num_heads, head_dim]`` query matching the caches; heads a multiple of KV's."""
    q = check_tensor("query", query, 3, FLOAT_DTYPES)
    check_compute_dtype("query", q, dtype)
    _, num_heads, head_dim = q.shape
    if head_dim != caches.head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {caches.head_dim}")
    if num_heads < 1 or num_heads % caches.num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a positive multiple of the caches' "
            f"num_kv_heads ({caches.num_kv_heads})"
        )
    return q


def check_kv_rows(
    key: object, value: object, caches: CacheShape, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` of shape ``[tokens, num_kv_heads, head_dim]`` in the caches' dtype
    (for an fp8 cache: in one of fp32, fp16 and bf16, both the same)."""
    k = check_tensor("key", key, 3, FLOAT_DTYPES)
    v = check_tensor("value", value, 3, FLOAT_DTYPES)
    expected = (k.shape[0], caches.num_kv_heads, caches.head_dim)
    check_shape("key", k, expected)
    check_shape("value", v, expected)
    for name, tensor in (("key", k), ("value", v)):
        check_compute_dtype(name, tensor, dtype)
    if v.dtype != k.dtype:
        raise TypeError(f"value has dtype {v.dtype} but key has {k.dtype}")
    return k, v


def check_sources_apart(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """The rows ``store_kv`` reads share no memory with the caches it writes (``key`` and
    ``value`` may overlap each other: both are only read)."""
    for source, tensor in (("key", key), ("value", value)):
        for cache, target in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_disjoint(source, tensor, cache, target)


def check_block_tables(block_tables: object, batch: int) -> torch.Tensor:
    """An int32 ``[batch, max_blocks]`` table."""
    table = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if table.shape[0] != batch:
        raise ValueError(
            f"block_tables must have one row per sequence ({batch}), got shape {tuple(table.shape)}"
        )
    return table


def check_context_lens(context_lens: object, batch: int) -> torch.Tensor:
    """An integer ``[batch]`` tensor (its values are checked by ``check_context_values``)."""
    lens = check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    check_shape("context_lens", lens, (batch,))
    return lens


def check_cu_seqlens(cu_seqlens_q: object, batch: int) -> torch.Tensor:
    """An integer ``[batch + 1]`` tensor of query offsets (values: ``check_cu_seqlens_values``)."""
    starts = check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    check_shape("cu_seqlens_q", starts, (batch + 1,))
    return starts


def check_slots(slot_mapping: object, num_tokens: int) -> torch.Tensor:
    """An integer ``[num_tokens]`` tensor (its values are checked by ``check_slot_values``)."""
    slots = check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_shape("slot_mapping", slots, (num_tokens,))
    return slots


def check_token_index(
    positions: object, seq_ids: object, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` ``[batch]``, or ``[tokens]`` with ``seq_ids`` ``[tokens]``; both as int64.

    Without ``seq_ids`` token ``b`` belongs to sequence ``b``.
    """
    pos = check_tensor("positions", positions, 1, INDEX_DTYPES)
    if seq_ids is None:
        check_shape("positions", pos, (batch,))
        seq = torch.arange(batch, device=pos.device)
    else:
        seq = check_tensor("seq_ids", seq_ids, 1, INDEX_DTYPES)
        check_shape("seq_ids", seq, pos.shape)
        check_same_device(positions=pos, seq_ids=seq)
    return pos.to(torch.int64), seq.to(torch.int64)
