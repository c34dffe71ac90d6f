"""Plain torch versions of every kernel: obviously correct, and the CPU fast path.

Each function takes arguments that ``kernels.validation`` has already accepted; call them through
the public functions in ``kernels`` to get the checks. The attention here gathers each sequence's
K/V through its block table into a dense ``[context_len, num_kv_heads, head_dim]`` tensor, then
runs textbook softmax attention in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def slot_mapping(
    block_tables: torch.Tensor, positions: torch.Tensor, seq_ids: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``translate_slot`` for every token; ``-1`` positions give ``-1``. Returns int64."""
    live = positions >= 0
    pos = torch.where(live, positions, 0)
    row = torch.where(live, seq_ids, 0)
    block_ids = block_tables[row, pos // block_size].to(torch.int64)
    return torch.where(live, block_ids * block_size + pos % block_size, -1)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """``cache.flat_slots[slot_mapping[t]] = key[t]`` for every ``t`` whose slot is not ``-1``."""
    written = slot_mapping >= 0
    slots = slot_mapping[written].to(torch.int64)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:])[slots] = key[written]
    v_cache.view(num_slots, *v_cache.shape[2:])[slots] = value[written]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """A sequence's logical ``[context_len, heads, dim]`` K or V, block by block via its table."""
    block_size = cache.shape[1]
    used_blocks = -(-context_len // block_size)
    blocks = cache[block_table[:used_blocks].to(torch.int64)]  # [used, block_size, heads, dim]
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def dense_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """One token's attention over dense ``[len, num_kv_heads, dim]`` K/V, in fp32.

    ``query`` is ``[num_heads, dim]``; query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``. An empty context gives zeros. Returns ``query``'s dtype.
    """
    num_heads = query.shape[0]
    if key.shape[0] == 0:
        return torch.zeros_like(query)
    group = num_heads // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)  # [len, num_heads, dim]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", query.float(), k) * scale
    weights = torch.softmax(scores, dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v).to(query.dtype)


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a sequence's last ``T`` tokens over its dense ``[L, num_kv_heads, dim]``
    K/V, in fp32: the prefill (or prefill-chunk) counterpart of ``dense_decode_attention``.

    ``query`` is ``[T, num_heads, dim]`` with ``T <= L``; query row ``t`` is the token at position
    ``L - T + t`` and attends keys ``0 .. L - T + t``. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. Returns ``[T, num_heads, dim]`` in ``query``'s dtype.
    """
    num_queries, num_heads = query.shape[:2]
    context_len = key.shape[0]
    group = num_heads // key.shape[1]
    k = key.float().repeat_interleave(group, dim=1)  # [L, num_heads, dim]
    v = value.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("thd,lhd->htl", query.float(), k) * scale
    positions = torch.arange(context_len - num_queries, context_len, device=query.device)
    future = torch.arange(context_len, device=query.device)[None, :] > positions[:, None]
    weights = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
    return torch.einsum("htl,lhd->thd", weights, v).to(query.dtype)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Per sequence: gather K/V through the block table, then dense attention."""
    out = torch.empty_like(query)
    for b, context_len in enumerate(context_lens.tolist()):
        key = gather_kv(k_cache, block_tables[b], context_len)
        value = gather_kv(v_cache, block_tables[b], context_len)
        out[b] = dense_decode_attention(query[b], key, value, scale)
    return out


def contiguous_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over a contiguous ``[batch, max_len, num_kv_heads, dim]`` cache."""
    out = torch.empty_like(query)
    for b, context_len in enumerate(context_lens.tolist()):
        out[b] = dense_decode_attention(
            query[b], key[b, :context_len], value[b, :context_len], scale
        )
    return out


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy block ``src`` over block ``dst`` in both caches, one pair after another, in order."""
    for src, dst in pairs:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
