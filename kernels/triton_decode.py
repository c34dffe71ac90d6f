"""Triton kernels: paged decode attention (one query token per sequence), with split-K.

Grid ``(batch, num_kv_heads, num_splits)``. A program owns one sequence, one KV head and one
contiguous range of that sequence's tokens. It loads the query heads that share the KV head
(grouped-query attention: query head ``h`` reads KV head ``h // group``), then walks its tokens
``BLOCK_N`` at a time. For each token ``n`` it finds the K/V row through the block table, the
spec's ``translate_slot``:

    slot = block_tables[b, n // block_size] * block_size + n % block_size

so a tile may span several blocks (small block sizes) or part of one (large ones). Scores and
the running softmax (max ``m``, denominator ``l``, accumulator ``acc``) are fp32: K/V are
upcast right after the load. With one split the program writes the normalized output;
with several (flash-decoding, for long contexts and few sequences) each writes its normalized
partial output and log-sum-exp, and ``_merge_kernel`` combines them:

    out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse)

With a sliding window ``w`` the query (at position ``context_len - 1``) attends only the last
``w`` tokens, so a program's range starts at ``lo = max(0, context_len - w)``: the splits cut
``[lo, lo + w)`` instead of ``[0, capacity)``, and the tiles wholly before ``lo`` are skipped, not
masked. Without a window ``w`` is the table's capacity and ``lo`` is 0. Only tokens in ``[lo,
context_len)`` are loaded, so only the table entries the validation checked are read: never
those of blocks wholly before the window. A sequence of length 0 gives zeros.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.triton_import import tl, triton
from pagedkv.kernels.validation import INT32_MAX, MAX_SPLITS

MIN_TOKENS_PER_SPLIT = 512
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight


@triton.jit
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    scale,
    table_stride,
    rows_per_seq,
    window,
    tokens_per_split,
    num_splits,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    group: tl.constexpr = NUM_HEADS // NUM_KV_HEADS

    # The range's bounds in int64 (no overflow at any capacity), then clamped to the context,
    # which fits int32: tokens are counted in int32.
    context_len = tl.load(context_lens_ptr + seq).to(tl.int64)
    first_key = tl.maximum(context_len - window, 0)  # the window's first token
    start = tl.minimum(first_key + split * tokens_per_split, context_len)
    end = tl.minimum(start + tokens_per_split, context_len).to(tl.int32)
    start = start.to(tl.int32)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    heads = kv_head * group + g
    head_mask = g < group
    dim_mask = d < HEAD_DIM
    q_offsets = (seq * NUM_HEADS + heads)[:, None] * HEAD_DIM + d[None, :]
    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0).to(tl.float32) * scale

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        if PAGED:
            block_id = tl.load(
                block_tables_ptr + seq * table_stride + n // BLOCK_SIZE, mask=n_mask, other=0
            ).to(tl.int64)
            rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE
        else:
            rows = seq.to(tl.int64) * rows_per_seq + n
        kv_offsets = (rows * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + d[None, :]
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(tl.float32)

        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the tile has a live token
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
        m = m_new

    has_tokens = denom > 0  # false for an empty range (and for padding heads)
    safe_denom = tl.where(has_tokens, denom, 1.0)
    out = acc / safe_denom[:, None]
    lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
    row = (seq * NUM_HEADS + heads) * num_splits + split
    tl.store(
        out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )
    tl.store(lse_ptr + row, lse, mask=head_mask)


@triton.jit
def _merge_kernel(
    partial_ptr,
    lse_ptr,
    out_ptr,
    num_splits,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0)  # seq * num_heads + head
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    split_mask = s < num_splits
    lse = tl.load(lse_ptr + row * num_splits + s, mask=split_mask, other=float("-inf"))
    lse_max = tl.max(lse, axis=0)
    weights = tl.exp(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # 0 if empty
    total = tl.sum(weights, axis=0)
    mask = split_mask[:, None] & (d < HEAD_DIM)[None, :]
    partial = tl.load(
        partial_ptr + (row * num_splits + s)[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0
    )
    out = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s precision for a cache dtype: IEEE fp32 for fp32 caches; TF32 for fp16 and
    bf16, whose upcast values TF32 holds exactly (docs/kernels.md, Tolerances)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def choose_num_splits(num_programs: int, max_tokens: int, device: torch.device) -> int:
    """Splits per sequence (flash-decoding): enough programs for about four per SM, each
    covering at least ``MIN_TOKENS_PER_SPLIT`` of the ``max_tokens`` a sequence can read (the
    capacity, or the window when it is smaller). Always 1 off CUDA."""
    if device.type != "cuda":
        return 1
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    by_parallelism = triton.cdiv(PROGRAMS_PER_SM * sm_count, num_programs)
    by_length = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    window: int | None = None,
) -> torch.Tensor:
    """Run decode attention on validated arguments.

    With ``block_tables`` the caches are paged ``[num_blocks, block_size, kv_heads, dim]``;
    with ``None`` they are contiguous ``[batch, max_len, kv_heads, dim]`` (the same kernel without
    the table lookup, for comparison). ``window`` is the sliding window (``None``: none).
    """
    query = query.contiguous()
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    paged = block_tables is not None
    if paged:
        tables = block_tables.contiguous()
        block_size, max_tokens = k_cache.shape[1], tables.shape[1] * k_cache.shape[1]
    else:  # a dummy table, never read
        tables = torch.zeros(1, 1, dtype=torch.int32, device=query.device)
        block_size, max_tokens = 1, k_cache.shape[1]
    out = torch.empty_like(query)
    if batch == 0:
        return out
    # The most tokens a query reads, the kernel's window: a longer window changes nothing. At
    # least 1, and within int32 (context lengths are validated to fit it).
    max_tokens = max(1, min(max_tokens, INT32_MAX if window is None else window, INT32_MAX))

    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = 64 if block_d <= 128 else 32
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_tokens, query.device)
    tokens_per_split = max(1, triton.cdiv(max_tokens, num_splits))
    split = num_splits > 1
    partial = (
        torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
        if split
        else out
    )
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)

    _decode_kernel[(batch, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        tables,
        context_lens.contiguous(),
        partial,
        lse,
        scale,
        tables.stride(0),
        k_cache.shape[1],
        max_tokens,
        tokens_per_split,
        num_splits,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        PAGED=paged,
        DOT_PRECISION=dot_precision(query.dtype),
        BLOCK_G=max(16, triton.next_power_of_2(num_heads // num_kv_heads)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )
    if split:
        _merge_kernel[(batch * num_heads,)](
            partial,
            lse,
            out,
            num_splits,
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=triton.next_power_of_2(head_dim),
        )
    return out
