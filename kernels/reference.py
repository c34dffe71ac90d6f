"""Plain torch versions of every kernel: obviously correct, and the CPU fast path.

Each function takes arguments that ``kernels.validation`` has already accepted; call them through
the public functions in ``kernels`` to get the checks. The attention here handles a whole batch
in a few tensor operations: it gathers every sequence's K/V through its block table into one
padded ``[batch, num_kv_heads, max_context_len, head_dim]`` tensor, then runs textbook softmax
attention in fp32 with a causal mask (:func:`masked_attention`). Decode, the contiguous
baseline, the dense oracle's prompts and the varlen paged prefill all run that one function.
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


def gather_kv(
    cache: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, width: int
) -> torch.Tensor:
    """Every sequence's logical K or V through its table, padded and head-major: ``[batch,
    num_kv_heads, width, dim]``.

    Entry ``(b, :, n)`` is token ``n`` of sequence ``b``, read from slot
    ``block_tables[b, n // block_size] * block_size + n % block_size``, for ``n <
    context_lens[b]``. Past a context, the entry repeats the sequence's token 0 (arbitrary for a
    sequence of length 0), so it holds written K/V that a mask can weigh by exactly 0; no table
    entry past a context is read, so a padding entry of any value is harmless. ``width`` must be
    at most the tables' capacity.
    """
    block_size = cache.shape[1]
    n = torch.arange(width, device=cache.device)
    valid = n[None, :] < context_lens[:, None].to(torch.int64)  # [batch, width]
    slots = torch.where(valid, block_tables[:, n // block_size] * block_size + n % block_size, 0)
    first = torch.where(context_lens > 0, block_tables[:, 0] * block_size, 0)[:, None]
    slots = torch.where(valid, slots, first).to(torch.int64)
    num_kv_heads, head_dim = cache.shape[2:]
    heads = torch.arange(num_kv_heads, device=cache.device)[None, :, None]
    rows = (slots[:, None, :] * num_kv_heads + heads).view(-1)  # [batch, kv, width], flattened
    flat = cache.view(-1, head_dim).index_select(0, rows)
    return flat.view(block_tables.shape[0], num_kv_heads, width, head_dim)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a padded batch, in fp32: the one formula every reference path runs.

    ``query`` is ``[batch, Q, num_heads, dim]``; ``key``/``value`` are head-major ``[batch,
    num_kv_heads, L, dim]``. Query ``(b, q)`` is the token at ``positions[b, q]`` and attends
    keys ``0 .. positions[b, q]`` of sequence ``b`` (a negative position attends key 0 alone);
    hidden keys get weight exactly 0, so they may hold anything finite. Query head ``h`` reads KV
    head ``h // (num_heads // num_kv_heads)``. Returns ``[batch, Q, num_heads, dim]`` in
    ``query``'s dtype.
    """
    batch, num_queries, num_heads, head_dim = query.shape
    num_kv_heads, length = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_queries, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_queries, head_dim)
    scores = (q @ key.float().transpose(2, 3)) * scale  # [batch, kv, group * Q, L]
    scores = scores.view(batch, num_kv_heads, group, num_queries, length)
    hidden = torch.arange(length, device=query.device) > positions.clamp(min=0)[:, :, None]
    weights = torch.softmax(scores.masked_fill(hidden[:, None, None], float("-inf")), dim=-1)
    out = weights.view(batch, num_kv_heads, group * num_queries, length) @ value.float()
    out = out.view(batch, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_queries, num_heads, head_dim).to(query.dtype)


def causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a sequence's last ``T`` tokens over its dense ``[L, num_kv_heads, dim]``
    K/V, in fp32 (:func:`masked_attention` for one sequence).

    ``query`` is ``[T, num_heads, dim]`` with ``1 <= T <= L``; query row ``t`` is the token at
    position ``L - T + t`` and attends keys ``0 .. L - T + t``. Query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. Returns ``[T, num_heads, dim]`` in ``query``'s dtype.
    """
    context_len, num_queries = key.shape[0], query.shape[0]
    positions = torch.arange(context_len - num_queries, context_len, device=query.device)
    k, v = (tensor.transpose(0, 1)[None] for tensor in (key, value))
    return masked_attention(query[None], k, v, positions[None], scale)[0]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """All sequences at once: gather K/V through the tables into a padded batch, then
    :func:`masked_attention` with each query at its last position. Length 0 gives zeros."""
    lens = context_lens.to(torch.int64)
    width = int(lens.max()) if lens.numel() else 0
    if width == 0:
        return torch.zeros_like(query)
    key = gather_kv(k_cache, block_tables, lens, width)
    value = gather_kv(v_cache, block_tables, lens, width)
    out = masked_attention(query[:, None], key, value, (lens - 1)[:, None], scale)[:, 0]
    return torch.where((lens > 0)[:, None, None], out, 0)


def contiguous_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention over a contiguous ``[batch, max_len, num_kv_heads, dim]`` cache: the identity
    table ``[b]`` of a cache with ``max_len``-token blocks, through
    :func:`paged_decode_attention`."""
    identity = torch.arange(query.shape[0], dtype=torch.int32, device=query.device)[:, None]
    return paged_decode_attention(query, key, value, identity, context_lens, scale)


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Variable-length causal attention through the tables: scatter the flat queries into a
    padded ``[batch, max_query_len]`` batch, gather K/V as :func:`paged_decode_attention` does,
    run :func:`masked_attention`, and gather the real rows back (``[tokens, heads, dim]``)."""
    starts = cu_seqlens_q.to(torch.int64)
    query_lens = starts[1:] - starts[:-1]
    lens = context_lens.to(torch.int64)
    num_tokens = query.shape[0]
    if num_tokens == 0:
        return torch.empty_like(query)
    rows = torch.repeat_interleave(torch.arange(lens.numel(), device=query.device), query_lens)
    columns = torch.arange(num_tokens, device=query.device) - starts[rows]
    padded = query.new_zeros(lens.numel(), int(query_lens.max()), *query.shape[1:])
    padded[rows, columns] = query
    first = lens - query_lens  # position of each sequence's first query token
    positions = first[:, None] + torch.arange(padded.shape[1], device=query.device)[None, :]
    width = int(lens.max())
    key = gather_kv(k_cache, block_tables, lens, width)
    value = gather_kv(v_cache, block_tables, lens, width)
    return masked_attention(padded, key, value, positions, scale)[rows, columns]


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy block ``src`` over block ``dst`` in both caches, one pair after another, in order."""
    for src, dst in pairs:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
