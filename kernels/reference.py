"""Plain torch versions of every kernel: obviously correct, and the CPU fast path.

Each function takes arguments that the ``kernels.check_*`` modules have accepted; call them through
the public functions in ``kernels`` to get the checks. The attention here handles a whole batch
in a few tensor operations: it gathers every sequence's K/V through its block table into one
padded ``[batch, num_kv_heads, max_context_len, head_dim]`` tensor, then runs textbook softmax
attention in fp32 with a causal mask (:func:`masked_attention`). Decode, the contiguous
baseline, the dense oracle's prompts and the varlen paged prefill all run that one function.

With a sliding window ``w`` (``window=``) a query at position ``p`` attends keys ``p - w < j <=
p``, and the gather starts at each sequence's first key in the window, so the padded tensor is
at most ``w`` (decode) or ``w - 1 + query_len`` (prefill) keys wide and no table entry of a
block wholly before the window is read.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kernels import fp8
from pagedkv.kernels.check_values import window_starts


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
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``cache.flat_slots[slot_mapping[t]] = key[t]`` for every ``t`` whose slot is not ``-1``;
    an fp8 cache stores ``fp8.quantize`` of the rows under ``scales`` (``(k_scale, v_scale)``)."""
    written = slot_mapping >= 0
    slots = slot_mapping[written].to(torch.int64)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    pairs = zip((k_cache, v_cache), (key, value), scales or (None, None), strict=True)
    for cache, rows, scale in pairs:
        rows = rows[written]
        if scale is not None:
            cache, rows = cache.view(torch.uint8), fp8.quantize(rows, scale, cache.dtype)
        cache.view(num_slots, *cache.shape[2:])[slots] = rows


def gather_kv(
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    width: int,
    starts: torch.Tensor | None = None,
) -> torch.Tensor:
    """Every sequence's logical K or V through its table, padded and head-major: ``[batch,
    num_kv_heads, width, dim]``.

    Entry ``(b, :, n)`` is token ``t = starts[b] + n`` of sequence ``b`` (``starts`` int64
    ``[batch]``, default all 0), read from slot ``block_tables[b, t // block_size] * block_size
    + t % block_size``, for ``t < context_lens[b]``. Past a context, the entry repeats the
    sequence's token ``starts[b]`` (arbitrary for a sequence with no token from there), so it
    holds written K/V that a mask can weigh by exactly 0. Only the entries of the blocks holding
    tokens ``starts[b] .. context_lens[b] - 1`` are used, so an entry of any value outside them
    (padding, or a block wholly before a sliding window) is harmless. ``width`` must be at most
    the tables' capacity.
    """
    block_size, max_blocks = cache.shape[1], block_tables.shape[1]
    lens = context_lens.to(torch.int64)
    if starts is None:
        starts = torch.zeros_like(lens)
    tokens = starts[:, None] + torch.arange(width, device=cache.device)[None, :]  # [batch, width]
    valid = tokens < lens[:, None]
    has_tokens = starts < lens
    # Padding reads token starts[b], and column 0 where even that is past the context.
    tokens = torch.where(valid, tokens, torch.where(has_tokens, starts, 0)[:, None])
    # Every column is in the table already; the clamp keeps a wrong one there too.
    columns = (tokens // block_size).clamp(max=max(max_blocks - 1, 0))
    entries = torch.gather(block_tables, 1, columns).to(torch.int64)
    read = valid | has_tokens[:, None]
    slots = torch.where(read, entries * block_size + tokens % block_size, 0)
    num_kv_heads, head_dim = cache.shape[2:]
    heads = torch.arange(num_kv_heads, device=cache.device)[None, :, None]
    rows = (slots[:, None, :] * num_kv_heads + heads).view(-1)  # [batch, kv, width], flattened
    flat = cache.view(-1, head_dim).index_select(0, rows)
    return flat.view(block_tables.shape[0], num_kv_heads, width, head_dim)


def read_kv(
    cache: torch.Tensor,
    scale: torch.Tensor | None,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    width: int,
    starts: torch.Tensor,
) -> torch.Tensor:
    """:func:`gather_kv` of a cache, read as values: an fp8 cache's codes (gathered through its
    ``uint8`` view) as ``fp8.dequantize`` under ``scale``, fp32."""
    if scale is None:
        return gather_kv(cache, block_tables, context_lens, width, starts)
    codes = gather_kv(cache.view(torch.uint8), block_tables, context_lens, width, starts)
    return fp8.dequantize(codes, scale, cache.dtype)


def masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    key_starts: torch.Tensor | None = None,
    gpu_rounding: bool = False,
) -> torch.Tensor:
    """Causal attention of a padded batch, in fp32: the one formula every reference path runs.

    ``query`` is ``[batch, Q, num_heads, dim]``; ``key``/``value`` are head-major ``[batch,
    num_kv_heads, L, dim]``, key ``k`` of sequence ``b`` being the token at position
    ``key_starts[b] + k`` (``key_starts`` int64 ``[batch]``, default all 0). Query ``(b, q)`` is
    the token at ``p = positions[b, q]`` and attends the keys at positions ``j <= p`` (a negative
    ``p`` counts as 0), and with ``window`` ``w`` only those with ``p - w < j <= p``; a query
    that sees no key gets NaN. Hidden keys get weight exactly 0, so they may hold anything
    finite. Query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``. Returns
    ``[batch, Q, num_heads, dim]`` in ``query``'s dtype.

    The score product's operands are the inputs' own values (exact in fp32) and the scale
    applies to the fp32 scores, as in the Triton kernels. With ``gpu_rounding`` the weights are
    also rounded where a compiled kernel rounds them: the unnormalized ``exp(s - max)`` is cast
    to the query's dtype for the PV product, and the denominator sums it in fp32 before the cast
    (docs/kernels.md, Tolerances). For fp32 inputs the cast changes nothing.
    """
    batch, num_queries, num_heads, head_dim = query.shape
    num_kv_heads, length = key.shape[1], key.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(batch, num_queries, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_queries, head_dim)
    scores = (q @ key.float().transpose(2, 3)) * scale  # [batch, kv, group * Q, L]
    scores = scores.view(batch, num_kv_heads, group, num_queries, length)
    key_positions = torch.arange(length, device=query.device)[None, :]  # [batch or 1, L]
    if key_starts is not None:
        key_positions = key_starts[:, None] + key_positions
    p = positions.clamp(min=0)[:, :, None]  # [batch, Q, 1]
    hidden = key_positions[:, None, :] > p
    if window is not None:
        hidden |= key_positions[:, None, :] <= p - window
    scores = scores.masked_fill(hidden[:, None, None], float("-inf"))
    if gpu_rounding:  # exp(s - max) in the query dtype over its fp32 sum
        p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
        weights = p.to(query.dtype).float() / p.sum(dim=-1, keepdim=True)
    else:
        weights = torch.softmax(scores, dim=-1)
    out = weights.view(batch, num_kv_heads, group * num_queries, length) @ value.float()
    out = out.view(batch, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_queries, num_heads, head_dim).to(query.dtype)


def causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of a sequence's last ``T`` tokens over its dense ``[L, num_kv_heads, dim]``
    K/V, in fp32 (:func:`masked_attention` for one sequence).

    ``query`` is ``[T, num_heads, dim]`` with ``1 <= T <= L``; query row ``t`` is the token at
    position ``p = L - T + t`` and attends keys ``0 .. p``, or with ``window`` ``w`` the keys
    ``max(0, p - w + 1) .. p``. Query head ``h`` reads KV head ``h // (num_heads //
    num_kv_heads)``. Returns ``[T, num_heads, dim]`` in ``query``'s dtype.
    """
    context_len, num_queries = key.shape[0], query.shape[0]
    positions = torch.arange(context_len - num_queries, context_len, device=query.device)
    k, v = (tensor.transpose(0, 1)[None] for tensor in (key, value))
    return masked_attention(query[None], k, v, positions[None], scale, window=window)[0]


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    gpu_rounding: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """All sequences at once: gather K/V through the tables into a padded batch (an fp8
    cache's read under ``scales``, :func:`read_kv`), then :func:`masked_attention` with each
    query at its last position. Length 0 gives zeros. With ``window`` ``w`` each sequence
    gathers only its last ``w`` tokens. ``gpu_rounding`` is :func:`masked_attention`'s."""
    lens = context_lens.to(torch.int64)
    starts = (lens - window).clamp(min=0) if window is not None else torch.zeros_like(lens)
    width = int((lens - starts).max()) if lens.numel() else 0
    if width == 0:
        return torch.zeros_like(query)
    k_scale, v_scale = scales or (None, None)
    key = read_kv(k_cache, k_scale, block_tables, lens, width, starts)
    value = read_kv(v_cache, v_scale, block_tables, lens, width, starts)
    positions = (lens - 1)[:, None]
    out = masked_attention(
        query[:, None], key, value, positions, scale,
        window=window, key_starts=starts, gpu_rounding=gpu_rounding,
    )[:, 0]  # fmt: skip
    return torch.where((lens > 0)[:, None, None], out, 0)


def contiguous_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention over a contiguous ``[batch, max_len, num_kv_heads, dim]`` cache: the identity
    table ``[b]`` of a cache with ``max_len``-token blocks, through
    :func:`paged_decode_attention`."""
    identity = torch.arange(query.shape[0], dtype=torch.int32, device=query.device)[:, None]
    return paged_decode_attention(
        query, key, value, identity, context_lens, scale, window, scales=scales
    )


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    *,
    gpu_rounding: bool = False,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """Variable-length causal attention through the tables: scatter the flat queries into a
    padded ``[batch, max_query_len]`` batch, read K/V as :func:`paged_decode_attention` does
    (with ``window`` ``w``, from each sequence's first query's window start ``max(0, first - w +
    1)``), run :func:`masked_attention`, and gather the real rows back (``[tokens, heads,
    dim]``). Padding queries sit at their sequence's last position; their rows are dropped.
    ``gpu_rounding`` is :func:`masked_attention`'s."""
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
    positions = torch.minimum(positions, lens[:, None] - 1)  # padding rows: the last position
    starts = window_starts(lens, query_lens, window)
    width = int((lens - starts).max())
    k_scale, v_scale = scales or (None, None)
    key = read_kv(k_cache, k_scale, block_tables, lens, width, starts)
    value = read_kv(v_cache, v_scale, block_tables, lens, width, starts)
    out = masked_attention(
        padded, key, value, positions, scale,
        window=window, key_starts=starts, gpu_rounding=gpu_rounding,
    )  # fmt: skip
    return out[rows, columns]


def copy_blocks(
    k_cache: torch.Tensor, v_cache: torch.Tensor, pairs: Sequence[tuple[int, int]]
) -> None:
    """Copy block ``src`` over block ``dst`` in both caches, one pair after another, in order
    (an fp8 cache's bytes as they are)."""
    for src, dst in pairs:
        k_cache[dst] = k_cache[src]
        v_cache[dst] = v_cache[src]
