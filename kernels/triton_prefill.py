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

and masks key ``n`` for a query at position ``p`` unless ``n <= p`` (causal). With a sliding window
``w`` it also masks ``n <= p - w``, and the walk starts at ``max(0, p0 - w + 1)``, ``p0`` being the
tile's first query position: tiles wholly before every query's window are skipped, not masked, so a
program reads at most ``w - 1 + BLOCK_Q`` keys. Without a window ``w`` is the table's capacity and
the walk starts at 0. Products, scores and the online softmax are as in ``triton_decode`` (native
16-bit dots with fp32 sums, ``P`` rounded to the query's dtype, an fp8 cache read as there); a row
that has seen no key yet keeps a running max of ``-inf`` and weight 0 (a window can leave a whole
tile of keys before a row's window). Only keys in ``[max(0, f - w + 1), context_len)``, ``f`` the
sequence's first query position, are loaded, so only the table entries the validation checked are
read: never those of blocks wholly before the window."""

from __future__ import annotations

import torch

from pagedkv.kernels.launch_config import (
    INDEX_TYPES,
    SCALAR_TYPES,
    Call,
    LaunchConfig,
    aligned,
    cache_pointers,
    capability,
    operand_constexprs,
    padded_head_dim,
    run,
    tiles,
)
from pagedkv.kernels.triton_fp8 import code_scale, read_kv_tile
from pagedkv.kernels.triton_import import tl, triton
from pagedkv.spec.checks import INT32_MAX


@triton.jit
def _prefill_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_ptr,
    context_lens_ptr,
    out_ptr,
    k_scale_ptr,
    v_scale_ptr,
    scale,
    table_stride,
    window,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    E5M2: tl.constexpr,
    FENCE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile = tl.program_id(2)
    if FP8:  # K's scale joins the softmax scale on the fp32 scores
        scale = scale * code_scale(k_scale_ptr, kv_head, E5M2)
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
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # the cache dtype: native dots
    if DOT_FP32:
        q = q.to(tl.float32)

    # Keys from the window of the tile's first query to the tile's last position; none for a
    # tile past the sequence's queries.
    tile_position = context_len - q_len + first_query
    end = tl.minimum(context_len, tile_position + BLOCK_Q)
    end = tl.where(first_query < q_len, end, 0)
    first_key = tl.maximum(tile_position - window + 1, 0)
    m = tl.full([BLOCK_Q * BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_Q * BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_Q * BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(first_key, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block_id = tl.load(
            block_tables_ptr + seq * table_stride + n // BLOCK_SIZE, mask=n_mask, other=0
        ).to(tl.int64)
        rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE
        kv_offsets = (rows * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = read_kv_tile(k_cache_ptr + kv_offsets, kv_mask, query_ptr, FP8, E5M2, FENCE, DOT_FP32)
        if not FP8:  # a 16-bit or fp32 cache's V is loaded beside K (the loads pipeline)
            v = read_kv_tile(
                v_cache_ptr + kv_offsets, kv_mask, query_ptr, FP8, E5M2, FENCE, DOT_FP32
            )

        # Products of query-dtype operands, summed in fp32; the scale applies to fp32 scores.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [rows, N]
        causal = n[None, :] <= positions[:, None]
        in_window = n[None, :] > positions[:, None] - window
        scores = tl.where(n_mask[None, :] & causal & in_window, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # -inf while a row has seen no key
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        if FP8:  # an fp8 cache's V is read after the softmax: its codes and decoded tile are
            # not live across the first dot (sm_90: 80 registers instead of 83 at head dim 128)
            v = read_kv_tile(
                v_cache_ptr + kv_offsets, kv_mask, query_ptr, FP8, E5M2, FENCE, DOT_FP32
            )
        # P is rounded to the query dtype for the second product, as the first's operands are.
        p = p.to(query_ptr.dtype.element_ty).to(v.dtype)
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(denom > 0, denom, 1.0)[:, None]
    if FP8:  # V's scale, once, on the fp32 output
        out = out * code_scale(v_scale_ptr, kv_head, E5M2)
    tl.store(out_ptr + q_offsets, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def prefill_config(
    call: Call, *, window: int, max_query_len: int, scale: float = 1.0
) -> LaunchConfig:
    """The prefill kernel's launch: pure, shared by :func:`launch` and the compile gate.

    ``window`` is the kernel's window (the capacity, or int32's limit, when there is none),
    ``max_query_len`` the longest query chunk; ``call.index_dtype`` is that of both
    ``cu_seqlens_q`` and ``context_lens``."""
    tile = tiles("prefill", call.dtype, call.head_dim, call.capability, call.fp8 is not None)
    block_g = triton.next_power_of_2(call.num_heads // call.num_kv_heads)
    block_q = max(1, tile.rows // block_g)
    kind = SCALAR_TYPES[call.dtype]
    index = f"*{INDEX_TYPES[call.index_dtype]}"
    return LaunchConfig(
        kernel="_prefill_kernel",
        grid=(call.batch, call.num_kv_heads, triton.cdiv(max_query_len, block_q)),
        signature={
            "query_ptr": f"*{kind}",
            **cache_pointers(call),
            "block_tables_ptr": "*i32",
            "cu_seqlens_ptr": index,
            "context_lens_ptr": index,
            "out_ptr": f"*{kind}",
            "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32",
            "scale": "fp32",
            "table_stride": "i32",
            "window": "i32",
        },
        scalars={"scale": scale, "table_stride": call.table_stride, "window": window},
        constexprs={
            "NUM_HEADS": call.num_heads,
            "NUM_KV_HEADS": call.num_kv_heads,
            "HEAD_DIM": call.head_dim,
            "BLOCK_SIZE": call.block_size,
            **operand_constexprs(call),
            "BLOCK_Q": block_q,
            "BLOCK_G": block_g,
            "BLOCK_D": padded_head_dim(call.head_dim),
            "BLOCK_N": tile.block_n,
        },
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        max_registers=tile.max_registers,
    )


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    max_query_len: int | None = None,
    *,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """Run paged prefill attention on validated arguments (``kernels.paged_prefill_attention``);
    ``window`` is the sliding window (``None``: none), ``max_query_len`` the longest query
    chunk (``None``: read from ``cu_seqlens_q``, which synchronizes a GPU). An fp8 cache comes
    as its ``uint8`` view with its format's name ``fp8`` and the ``(k, v)`` scales."""
    query = aligned(query.contiguous())
    num_tokens = query.shape[0]
    out = torch.empty_like(query)
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    starts = aligned(cu_seqlens_q.contiguous())
    lens = aligned(context_lens.to(starts.dtype).contiguous())
    if max_query_len is None:
        max_query_len = int((starts[1:] - starts[:-1]).max())
    tables = aligned(block_tables.contiguous())
    # The kernel's window: the capacity (or int32's limit) when there is none or it is longer.
    capacity = tables.shape[1] * k_cache.shape[1]
    window = max(1, min(capacity, INT32_MAX if window is None else window, INT32_MAX))
    call = Call(
        batch, query.shape[1], k_cache.shape[2], query.shape[2], query.dtype, starts.dtype,
        k_cache.shape[1], tables.stride(0), capability(query.device),
        interpreted=query.device.type != "cuda", fp8=fp8,
    )  # fmt: skip
    config = prefill_config(call, window=window, max_query_len=max_query_len, scale=scale)
    if scales is None:  # not fp8: never read
        scales = (torch.empty(0, device=query.device),) * 2
    k_scale, v_scale = (aligned(scale) for scale in scales)
    tensors = (query, k_cache, v_cache, tables, starts, lens, out, k_scale, v_scale)
    run(_prefill_kernel, config, *tensors)
    return out
