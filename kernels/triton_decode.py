"""Triton kernels: paged decode attention (one query token per sequence), with split-K.

Grid ``(batch, num_kv_heads, num_splits)``. A program owns one sequence, one KV head and one
contiguous range of that sequence's tokens. It loads the query heads that share the KV head
(grouped-query attention: query head ``h`` reads KV head ``h // group``), then walks its tokens
``BLOCK_N`` at a time. For each token ``n`` it finds the K/V row through the block table, the
spec's ``translate_slot``:

    slot = block_tables[b, n // block_size] * block_size + n % block_size

so a tile may span several blocks (small block sizes) or part of one (large ones). An fp8 cache
(``FP8``; its ``uint8`` view) is read as codes, decoded exactly to the query's dtype
(``triton_fp8.fp8_to_fp16``; compiled, through ``triton_fp8.fence``), K's scale joining the softmax
scale on the fp32 scores and V's multiplying the fp32 output. q, K and V stay in the query's dtype
(a non-fp8 cache's own): ``q K^T`` is a native ``tl.dot`` with fp32 sums, the scale multiplies the
fp32 scores, and the unnormalized weights ``P`` are rounded to that dtype for ``P V`` (fp32: exact
IEEE fp32 dots). The running softmax (max ``m``, denominator ``l``, accumulator ``acc``) is fp32.
``DOT_FP32`` upcasts the operands instead, for bf16 under the interpreter only, whose bf16
``tl.dot`` multiplies raw storage bits (docs/kernels.md, Tolerances). With one split the program
writes the normalized output; with several (flash-decoding, for long contexts and few sequences)
each writes its normalized partial output and log-sum-exp, and ``_merge_kernel`` combines them:

    out = sum_s exp(lse_s - max lse) * out_s / sum_s exp(lse_s - max lse)

With a sliding window ``w`` the query (at position ``context_len - 1``) attends only the last ``w``
tokens, so a program's range starts at ``lo = max(0, context_len - w)``: the splits cut ``[lo, lo +
T)``, ``T = min(max_context_len, w)``, into whole tiles (:func:`split_work`), and the tiles wholly
before ``lo`` are skipped, not masked. Without a window ``lo`` is 0. Every launch comes from
:func:`decode_config` (and :func:`merge_config`), which the compile gate compiles. Only tokens in
``[lo, context_len)`` are loaded, so only the table entries the validation checked are read: never
those of blocks wholly before the window. A sequence of length 0 gives zeros."""

from __future__ import annotations

import functools

import torch

from pagedkv.kernels.check_arguments import MAX_SPLITS
from pagedkv.kernels.launch_config import (
    DEFAULT_CAPABILITY,
    INDEX_TYPES,
    SCALAR_TYPES,
    TARGETS,
    Call,
    LaunchConfig,
    aligned,
    cache_pointers,
    capability,
    operand_constexprs,
    padded_head_dim,
    programs_per_sm,
    run,
    tiles,
)
from pagedkv.kernels.triton_fp8 import code_scale, read_kv_tile
from pagedkv.kernels.triton_import import tl, triton
from pagedkv.spec.checks import INT32_MAX

MIN_TOKENS_PER_SPLIT = 512


@triton.jit
def _decode_kernel(
    query_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    out_ptr,
    lse_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    DOT_FP32: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
    E5M2: tl.constexpr,
    FENCE: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if FP8:  # K's scale joins the softmax scale on the fp32 scores
        scale = scale * code_scale(k_scale_ptr, kv_head, E5M2)
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
    q = tl.load(query_ptr + q_offsets, mask=q_mask, other=0.0)  # the cache dtype: native dots
    if DOT_FP32:
        q = q.to(tl.float32)

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
        # Both tiles up front; e5m2 read with its NaN codes selected (triton_fp8.fp8_to_fp16).
        k = read_kv_tile(
            k_cache_ptr + kv_offsets, kv_mask, query_ptr, FP8, E5M2, FENCE, DOT_FP32, True
        )
        v = read_kv_tile(
            v_cache_ptr + kv_offsets, kv_mask, query_ptr, FP8, E5M2, FENCE, DOT_FP32, True
        )

        # Products of query-dtype operands, summed in fp32; the scale applies to fp32 scores.
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [G, N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))  # finite: the tile has a live token
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(p, axis=1)
        # P is rounded to the query dtype for the second product, as the first's operands are.
        p = p.to(query_ptr.dtype.element_ty).to(v.dtype)
        pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m = m_new

    has_tokens = denom > 0  # false for an empty range (and for padding heads)
    safe_denom = tl.where(has_tokens, denom, 1.0)
    out = acc / safe_denom[:, None]
    if FP8:  # V's scale, once, on the fp32 output
        out = out * code_scale(v_scale_ptr, kv_head, E5M2)
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


def split_work(max_tokens: int, num_splits: int, block_n: int) -> tuple[int, int]:
    """``(num_splits, tokens_per_split)`` for cutting ``max_tokens`` (the most tokens a
    sequence of the batch reads: its longest context, or the window when that is shorter) into
    at most ``num_splits`` ranges of whole ``block_n``-key tiles. Every split of the longest
    sequence has work: the count is lowered until the last range starts before its end."""
    max_tokens = max(1, max_tokens)
    tiles_per_split = triton.cdiv(triton.cdiv(max_tokens, block_n), num_splits)
    tokens_per_split = tiles_per_split * block_n
    return triton.cdiv(max_tokens, tokens_per_split), tokens_per_split


def auto_num_splits(num_programs: int, max_tokens: int, sm_count: int, resident: int) -> int:
    """Splits per sequence (flash-decoding) on a GPU of ``sm_count`` SMs where ``resident``
    programs of the compiled kernel fit per SM: enough programs to fill them, each covering at
    least ``MIN_TOKENS_PER_SPLIT`` of the ``max_tokens`` the longest sequence reads."""
    by_parallelism = triton.cdiv(max(1, resident) * sm_count, num_programs)
    by_length = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


def decode_config(
    call: Call,
    *,
    rows_per_seq: int,
    paged: bool,
    max_tokens: int,
    num_splits: int,
    scale: float = 1.0,
) -> LaunchConfig:
    """The decode kernel's launch: pure, shared by :func:`launch` and the compile gate.
    ``max_tokens`` is the most tokens a sequence of the batch reads (its longest context, or
    the window when shorter; at least 1), ``num_splits`` the splits asked for, lowered by
    :func:`split_work` so the longest sequence's splits all have work. ``rows_per_seq`` is the
    contiguous cache's ``max_len`` (``paged=False``)."""
    tile = tiles("decode", call.dtype, call.head_dim, call.capability, call.fp8 is not None)
    num_splits, tokens_per_split = split_work(max_tokens, num_splits, tile.block_n)
    group = call.num_heads // call.num_kv_heads
    return LaunchConfig(
        kernel="_decode_kernel",
        grid=(call.batch, call.num_kv_heads, num_splits),
        signature={
            "query_ptr": f"*{SCALAR_TYPES[call.dtype]}",
            **cache_pointers(call),
            "block_tables_ptr": "*i32",
            "context_lens_ptr": f"*{INDEX_TYPES[call.index_dtype]}",
            "out_ptr": f"*{SCALAR_TYPES[call.dtype]}" if num_splits == 1 else "*fp32",
            "lse_ptr": "*fp32",
            "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32",
            "scale": "fp32",
            "table_stride": "i32",
            "rows_per_seq": "i32",
            "window": "i32",
            "tokens_per_split": "i32",
            "num_splits": "i32",
        },
        scalars={
            "scale": scale,
            "table_stride": call.table_stride,
            "rows_per_seq": rows_per_seq,
            "window": max_tokens,
            "tokens_per_split": tokens_per_split,
            "num_splits": num_splits,
        },
        constexprs={
            "NUM_HEADS": call.num_heads,
            "NUM_KV_HEADS": call.num_kv_heads,
            "HEAD_DIM": call.head_dim,
            "BLOCK_SIZE": call.block_size if paged else 1,
            "PAGED": paged,
            **operand_constexprs(call),
            "BLOCK_G": max(tile.rows, triton.next_power_of_2(group)),
            "BLOCK_D": padded_head_dim(call.head_dim),
            "BLOCK_N": tile.block_n,
        },
        num_warps=tile.num_warps,
        num_stages=tile.num_stages,
        max_registers=tile.max_registers,
    )


def merge_config(
    *, batch: int, num_heads: int, head_dim: int, dtype: torch.dtype, num_splits: int
) -> LaunchConfig:
    """The split-K merge's launch: one program per (sequence, query head)."""
    return LaunchConfig(
        kernel="_merge_kernel",
        grid=(batch * num_heads, 1, 1),
        signature={
            "partial_ptr": "*fp32",
            "lse_ptr": "*fp32",
            "out_ptr": f"*{SCALAR_TYPES[dtype]}",
            "num_splits": "i32",
        },
        scalars={"num_splits": num_splits},
        constexprs={
            "HEAD_DIM": head_dim,
            "BLOCK_S": triton.next_power_of_2(num_splits),
            "BLOCK_D": triton.next_power_of_2(head_dim),
        },
        num_warps=4,
        num_stages=1,
    )


def resident_programs(config: LaunchConfig, device: torch.device) -> int:
    """Programs per SM that the compiled decode kernel of ``config`` fits on ``device`` (CUDA),
    from its registers and shared memory as the driver loaded it; cached per variant."""
    major, minor = torch.cuda.get_device_capability(device)
    key = (device.index, repr(config.constexprs), repr(config.signature))
    if key not in _RESIDENT:
        compiled = _decode_kernel.warmup(  # compiles (or finds) the variant, launches nothing
            *config.pointer_dtypes(),
            *config.scalars.values(),
            **config.constexprs,
            grid=config.grid,
            **config.options(),
        )
        _ = compiled.run  # the public property loads the binary, which sets n_regs
        target = TARGETS.get(10 * major + minor, TARGETS[DEFAULT_CAPABILITY])
        _RESIDENT[key] = programs_per_sm(
            target, compiled.n_regs, compiled.metadata.shared, config.num_warps
        )
    return _RESIDENT[key]


_RESIDENT: dict[tuple, int] = {}


def launch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    window: int | None = None,
    *,
    max_context_len: int | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """Run decode attention on validated arguments.

    With ``block_tables`` the caches are paged ``[num_blocks, block_size, kv_heads, dim]``;
    with ``None`` they are contiguous ``[batch, max_len, kv_heads, dim]`` (the same kernel without
    the table lookup, for comparison). ``window`` is the sliding window (``None``: none).
    ``max_context_len`` is the largest of ``context_lens``; splits are cut over it (or the
    window, when shorter). ``None`` reads it from ``context_lens`` when splits need it, which
    synchronizes a GPU; one split needs nothing. An fp8 cache comes as its ``uint8`` view with
    its format's name ``fp8`` and the ``(k, v)`` scales.
    """
    query = aligned(query.contiguous())
    batch, num_heads, head_dim = query.shape
    tables, block_size, capacity = _table_of(block_tables, k_cache, query.device)
    out = torch.empty_like(query)
    if batch == 0:
        return out
    lens = aligned(context_lens.contiguous())
    cuda = query.device.type == "cuda"
    if num_splits == 1 or (num_splits is None and not cuda):
        longest = capacity  # one split reads each sequence to its end: no length needed
        num_splits = 1
    else:
        longest = max_context_len if max_context_len is not None else int(lens.max())
    # The most tokens a query reads: its context, within the window. At least 1, and within
    # int32 (context lengths are validated to fit it).
    max_tokens = max(1, min(longest, capacity, INT32_MAX if window is None else window))
    call = Call(
        batch, num_heads, k_cache.shape[2], head_dim, query.dtype, lens.dtype, block_size,
        tables.stride(0), capability(query.device), interpreted=not cuda, fp8=fp8,
    )  # fmt: skip
    config = functools.partial(
        decode_config,
        call,
        rows_per_seq=k_cache.shape[1],
        paged=block_tables is not None,
        max_tokens=max_tokens,
        scale=scale,
    )
    if num_splits is None:  # CUDA: as many splits as fill the SMs with the resident programs
        resident = resident_programs(config(num_splits=MAX_SPLITS), query.device)
        sm_count = torch.cuda.get_device_properties(query.device).multi_processor_count
        num_splits = auto_num_splits(batch * call.num_kv_heads, max_tokens, sm_count, resident)
    _run_decode(config(num_splits=num_splits), query, k_cache, v_cache, tables, lens, out, scales)
    return out


def _table_of(
    block_tables: torch.Tensor | None, k_cache: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor, int, int]:
    """``(tables, block_size, capacity)`` for the kernel: the aligned block tables of paged
    caches, or for contiguous ones (``block_tables`` ``None``) a dummy table that is never read,
    a block size of 1 and each sequence's ``max_len`` rows."""
    if block_tables is not None:
        tables = aligned(block_tables.contiguous())
        return tables, k_cache.shape[1], tables.shape[1] * k_cache.shape[1]
    return torch.zeros(1, 1, dtype=torch.int32, device=device), 1, k_cache.shape[1]


def _run_decode(
    decode: LaunchConfig,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    out: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Launch the decode kernel of ``decode`` into ``out``: with one split directly, with
    several into fp32 partial outputs and log-sum-exps that the merge kernel combines."""
    batch, num_heads, head_dim = query.shape
    num_splits = decode.grid[2]
    split = num_splits > 1
    partial = (
        torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
        if split
        else out
    )
    lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=out.device)
    k_scale, v_scale = scales if scales is not None else (lse, lse)  # not fp8: never read
    run(
        _decode_kernel, decode, query, k_cache, v_cache, tables, lens, partial, lse,
        aligned(k_scale), aligned(v_scale),
    )  # fmt: skip
    if split:
        merge = merge_config(
            batch=batch,
            num_heads=num_heads,
            head_dim=head_dim,
            dtype=query.dtype,
            num_splits=num_splits,
        )
        run(_merge_kernel, merge, partial, lse, out)
