"""Triton kernel: paged prefill attention, a variable-length batch of causal query chunks.

Grid ``(batch, num_kv_heads, cdiv(max_query_len, BLOCK_Q))``. A program owns one sequence, one KV
head and a tile of ``BLOCK_Q`` of that sequence's query tokens; with the ``group`` query heads that
share the KV head (query head ``h`` reads KV head ``h // group``) that is ``BLOCK_Q * BLOCK_G``
rows, so each K/V row is read once for the whole tile (vLLM's unified-attention tiling). Sequence
``b``'s queries are flat rows ``cu_seqlens_q[b] ..< cu_seqlens_q[b + 1]``, the last ``q_len`` of
its ``context_len`` tokens: query ``i`` sits at position ``context_len - q_len + i``. The program
walks keys ``0 ..`` its tile's last position, ``BLOCK_N`` at a time, each found through the block
table with the spec's ``translate_slot``:

    slot = block_tables[b, n // block_size] * block_size + n % block_size

and masks key ``n`` for a query at position ``p`` unless ``n <= p`` (causal). Scores and the online
softmax are fp32, as in ``triton_decode``. Every query row sees key 0 (its position is ``>= 0``),
so the running max is finite after the first tile. Only keys below ``context_len`` are loaded, so
only the table entries the validation checked are read.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.triton_decode import dot_precision
from pagedkv.kernels.triton_import import tl, triton

ROWS_PER_TILE = 64  # query rows (tokens x heads of a group) per program


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    scale,
    table_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    group: tl.constexpr = NUM_HEADS // NUM_KV_HEADS

    q_start = tl.load(cu_seqlens_ptr + seq).to(tl.int64)
    q_len = (tl.load(cu_seqlens_ptr + seq + 1).to(tl.int64) - q_start).to(tl.int32)
    context_len = tl.load(context_lens_ptr + seq).to(tl.int32)
    first_query = tile * BLOCK_Q

    r = tl.arange(0, BLOCK_Q * BLOCK_G)
    i = first_query + r // BLOCK_G  # query index inside the sequence
    g = r % BLOCK_G
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    row_mask = (i < q_len) & (g < group)
    dim_mask = d < HEAD_DIM
    positions = context_len - q_len + i
    token_rows = ((q_start + i) * NUM_HEADS + heads).to(tl.int64) * HEAD_DIM
    q_offsets = token_rows[:, None] + d[None, :]
    q_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale

    # Keys up to the tile's last position; none for a tile past the sequence's queries.
    end = tl.minimum(context_len, context_len - q_len + first_query + BLOCK_Q)
    end = tl.where(first_query < q_len, end, 0)
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(0, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block_id = tl.load(
            block_tables_ptr + seq * table_stride + n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE
        kv_offsets = (rows * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [rows, BLOCK_N]
        visible = n_mask[None, :] & (n[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: key 0 is in the first tile
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Run paged prefill attention on validated arguments (``kernels.paged_prefill_attention``)."""
    query = query.contiguous()
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(query)
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    starts = cu_seqlens_q.contiguous()
    max_query_len = int((starts[1:] - starts[:-1]).max())
    block_g = triton.next_power_of_2(num_heads // num_kv_heads)
    block_q = max(1, ROWS_PER_TILE // block_g)
    block_d = max(16, triton.next_power_of_2(head_dim))
    tables = block_tables.contiguous()
    _prefill_kernel[(batch, num_kv_heads, triton.cdiv(max_query_len, block_q))](
        query,
        k_cache,
        v_cache,
        tables,
        starts,
        context_lens.contiguous(),
        out,
        scale,
        tables.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        DOT_PRECISION=dot_precision(query.dtype),
        BLOCK_Q=block_q,
        BLOCK_G=block_g,
        BLOCK_D=block_d,
        BLOCK_N=64 if block_d <= 128 else 32,
    )
    return out
