"""The CPU fast path of a whole step's paged attention: one plan per step, one SDPA per layer.

``kernels.reference.paged_prefill_attention`` computes a step's attention from scratch in every
layer: the padded query layout, each sequence's key window, the slots of its keys, the mask.
None of that depends on the layer, only on the step's tables and lengths. :func:`plan` computes
it once per step, from host data, into a :class:`SdpaPlan`. Per layer, :func:`store` writes the
new K/V (one ``index_copy_`` per cache) and :func:`attention` attends: two row gathers of the
caches (``index_select`` of whole ``num_kv_heads * head_dim`` rows at the plan's slots) and one
``torch.nn.functional.scaled_dot_product_attention`` call with the plan's additive mask. The
query heads of one KV head are folded into the query axis (GQA without repeating K/V), so each
call is a plain multi-head attention over ``num_kv_heads`` heads.

They compute exactly what ``reference.store_kv`` and ``reference.paged_prefill_attention``
compute (the same slots, the same keys, the same mask, fp32 arithmetic), the attention up to the
rounding of SDPA's blocked softmax; ``properties/test_kernels_agreement.py`` checks both against the
reference. Arguments are trusted: the tables, lengths and windows come valid (from the store,
through ``PagedKVCache.step``; ``kernels.check_values`` checks them), and nothing here reads a
tensor's values on the host.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SdpaPlan:
    """A step's attention layout, shared by every layer that attends with its ``window``.

    The step has ``batch`` sequences; sequence ``b`` has ``query_lens[b]`` flat query tokens
    and attends ``width`` key columns, column ``c`` being its token ``key_starts[b] + c``.
    """

    window: int | None
    batch: int
    max_query_len: int  # Q: queries per sequence in the padded layout
    width: int  # W: key columns per sequence
    group: int  # query heads per KV head
    # int64 [batch * W]: the cache row (slot) each key column reads; a column past a
    # sequence's context repeats its first key column, which is written.
    slots: torch.Tensor
    # fp32 [batch, 1, group * Q, W], contiguous (SDPA's fastest mask on CPU): 0 where query
    # row (g, q) of sequence b attends column c, -inf where it does not.
    mask: torch.Tensor
    # int64 [tokens]: each flat query's row in the padded [batch * Q] layout; None when every
    # sequence has exactly Q queries (the flat step is the padded layout).
    query_rows: torch.Tensor | None


def store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    """``kernels.store_kv`` for a step that writes every token: ``key[t]``/``value[t]``
    (``[tokens, num_kv_heads, head_dim]``) into slot ``slots[t]`` (int64, distinct, each in
    ``[0, num_blocks * block_size)``; no ``-1``) of the caches, as one ``index_copy_`` each."""
    for cache, rows in ((k_cache, key), (v_cache, value)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows)


def plan(
    block_tables: torch.Tensor,
    query_lens: Sequence[int],
    context_lens: Sequence[int],
    block_size: int,
    group: int,
    window: int | None,
) -> SdpaPlan:
    """The plan of one step: ``block_tables`` int32 ``[batch, max_blocks]`` on the caches'
    device; sequence ``b``'s queries are its last ``query_lens[b]`` of ``context_lens[b]``
    tokens (host ints, ``query_lens[b] <= context_lens[b]``, at least one sequence with a
    query); ``group`` query heads per KV head; ``window`` as ``kernels.paged_prefill_attention``
    takes it. Key columns start where that function's window starts
    (``check_values.window_starts``), so no table entry of a block wholly before a window is read.
    """
    device = block_tables.device
    batch = len(query_lens)
    max_query_len = max(query_lens)
    starts = [
        0 if window is None else max(0, n - q - window + 1)
        for q, n in zip(query_lens, context_lens, strict=True)
    ]
    width = max(n - s for n, s in zip(context_lens, starts, strict=True))
    lens = torch.tensor(context_lens, dtype=torch.int64).to(device)
    key_starts = torch.tensor(starts, dtype=torch.int64).to(device)
    num_queries = torch.tensor(query_lens, dtype=torch.int64).to(device)

    # Key columns: token key_starts[b] + c; past the context, token key_starts[b], or for a
    # sequence with no key from there, slot 0 (its columns are all masked).
    columns = torch.arange(width, device=device)
    tokens = key_starts[:, None] + columns[None, :]  # [batch, W]
    inside = tokens < lens[:, None]
    has_keys = (key_starts < lens)[:, None]
    read = torch.where(inside, tokens, torch.where(has_keys, key_starts[:, None], 0))
    entries = torch.gather(block_tables, 1, read // block_size).to(torch.int64)
    slots = torch.where(has_keys, entries * block_size + read % block_size, 0).view(-1)

    # Query q of sequence b sits at position first[b] + q (padding: at its last position).
    first = lens - num_queries
    positions = first[:, None] + torch.arange(max_query_len, device=device)[None, :]
    positions = torch.minimum(positions, lens[:, None] - 1)[:, :, None]  # [batch, Q, 1]
    visible = tokens[:, None, :] <= positions  # padding columns lie past every position
    if window is not None:
        visible &= tokens[:, None, :] > positions - window
    mask = torch.zeros(visible.shape, dtype=torch.float32, device=device)
    mask = mask.masked_fill_(~visible, float("-inf"))[:, None]
    mask = mask.expand(batch, group, max_query_len, width).contiguous()
    mask = mask.view(batch, 1, group * max_query_len, width)

    query_rows = None
    if any(q != max_query_len for q in query_lens):
        rows = torch.repeat_interleave(torch.arange(batch, device=device), num_queries)
        offsets = torch.cumsum(num_queries, 0) - num_queries
        flat = torch.arange(rows.numel(), device=device)
        query_rows = rows * max_query_len + flat - offsets[rows]
    return SdpaPlan(window, batch, max_query_len, width, group, slots, mask, query_rows)


def attention(
    plan: SdpaPlan,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The step's attention for one layer: ``query`` ``[tokens, num_heads, head_dim]`` (the
    plan's flat queries, ``num_heads = group * num_kv_heads``) over caches ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` that already hold the step's K/V. Returns ``[tokens,
    num_heads, head_dim]`` in the query's dtype; the arithmetic is fp32."""
    batch, q_len, width, group = plan.batch, plan.max_query_len, plan.width, plan.group
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    padded = query
    if plan.query_rows is not None:
        padded = query.new_zeros(batch * q_len, *query.shape[1:])
        padded.index_copy_(0, plan.query_rows, query)
    # [batch * Q, kv * group, dim] -> [batch, kv, group * Q, dim], rows ordered (g, q).
    q = padded.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * q_len, head_dim)
    k, v = (
        cache.view(-1, num_kv_heads * head_dim)
        .index_select(0, plan.slots)
        .view(batch, width, num_kv_heads, head_dim)
        .transpose(1, 2)
        for cache in (k_cache, v_cache)
    )
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=plan.mask, scale=scale
    )
    out = out.view(batch, num_kv_heads, group, q_len, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * q_len, num_kv_heads * group, head_dim).to(query.dtype)
    return out if plan.query_rows is None else out.index_select(0, plan.query_rows)
