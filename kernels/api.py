"""The public kernel functions: validate every argument, pick the backend, run.

Every function accepts ``backend=`` (``"auto"``, ``"triton"``, ``"numba"`` or ``"reference"``;
see ``kernels.backend``). Types, shapes, dtypes and devices are always checked. Checks that read
tensor values (block ids, context lengths, slots, positions), and so synchronize a GPU, run unless
``validate=False``; pass that only for arguments already known to be valid, because the kernels
trust them and a bad block id would read or write outside the caches. Every check runs before
anything is launched or written, so a call that raises leaves the caches untouched. After
its checks, ``store_kv`` and the paged attention functions run the function of the same name in
``kernels.trusted`` (no checks, for callers that validated a whole step once).

The Triton kernel modules import triton, so each function imports its kernel module only on the
triton branch, after ``resolve_backend`` has loaded triton under the interpreter rule: the
reference backend never imports triton and works without it installed. The numba kernel
modules are imported on the numba branch likewise; attention runs there in fp32, and fp16 or bf16
attention on the numba backend runs the reference.

fp8 caches (``torch.float8_e4m3fn``, ``torch.float8_e5m2``; ``kernels.fp8``): ``store_kv`` and
the attention functions take ``k_scale=`` and ``v_scale=`` (a number, or an fp32 tensor
``[num_kv_heads]``; ``None`` is 1.0), which other caches refuse. ``store_kv`` stores each row's
code under its KV head's scale (``spec.fp8.quantize``, bit for bit on every backend); attention
reads code value times scale and computes in fp32 with queries of fp32, fp16 or bf16; the numba
backend runs fp32 queries and sends the others to the reference. ``copy_blocks`` copies bytes.

The attention functions take ``window=`` (``None``, or an int ``w >= 1``): sliding-window
attention, in which a query at position ``p`` attends only the keys at positions ``j`` with
``p - w < j <= p`` (itself and the ``w - 1`` tokens before it). That is Hugging Face's
``sliding_window`` convention (``transformers.masking_utils.sliding_window_overlay``: ``kv_idx >
q_idx - sliding_window``, with the causal ``kv_idx <= q_idx``), so Mistral's ``sliding_window =
4096`` is ``window=4096``. With a window the kernels start at each sequence's first key in the
window and never read the block-table entries of blocks wholly before it; validation checks only
the entries that are read (``check_values.window_starts``), so those of released blocks may hold
anything.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagedkv.kernels import reference, trusted
from pagedkv.kernels.backend import resolve_backend
from pagedkv.kernels.check_arguments import (
    MAX_BLOCK_SIZE,
    MAX_NUM_BLOCKS,
    check_bool,
    check_int_range,
    check_num_splits,
    check_same_device,
    check_scale,
    check_tensor,
)
from pagedkv.kernels.check_shapes import (
    CacheShape,
    check_block_tables,
    check_caches,
    check_context_lens,
    check_cu_seqlens,
    check_decode_query,
    check_kv_rows,
    check_slots,
    check_sources_apart,
    check_token_index,
)
from pagedkv.kernels.check_values import (
    check_context_values,
    check_cu_seqlens_values,
    check_max_context_len,
    check_max_query_len,
    check_pairs,
    check_position_values,
    check_slot_values,
    window_starts,
)
from pagedkv.kernels.fp8 import check_kv_scales
from pagedkv.spec.checks import INT32_MAX, int32_window


def slot_mapping(
    block_tables: torch.Tensor,
    positions: torch.Tensor,
    block_size: int,
    seq_ids: torch.Tensor | None = None,
    *,
    num_blocks: int | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Physical slot of every token: the spec's ``translate_slot`` for a batch.

    ``block_tables`` is int32 ``[batch, max_blocks]``. ``positions`` (int32/int64) holds one
    position per sequence (``[batch]``) or, with ``seq_ids`` naming each token's table row, one
    per token (``[tokens]``). Position ``-1`` is padding and maps to ``-1``. Returns int64
    slots ``block_tables[seq, pos // block_size] * block_size + pos % block_size``.

    ``block_size`` must lie in ``[1, MAX_BLOCK_SIZE]`` (``2**32``: the largest slot of an int32
    block id then fits int64) and ``num_blocks`` in ``[0, MAX_NUM_BLOCKS]`` (``2**31``).
    Raises ``IndexError`` for a position beyond the table's capacity or one that reaches a
    negative entry (or one ``>= num_blocks`` when ``num_blocks`` is given). A table with no
    entries (``[0, M]`` or ``[B, 0]``) maps padding-only positions to ``-1``.
    """
    check_int_range("block_size", block_size, 1, MAX_BLOCK_SIZE)
    if num_blocks is not None:
        check_int_range("num_blocks", num_blocks, 0, MAX_NUM_BLOCKS)
    check_bool("validate", validate)
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    pos, seq = check_token_index(positions, seq_ids, tables.shape[0])
    device = check_same_device(block_tables=tables, positions=pos, seq_ids=seq)
    if validate:
        check_position_values(pos, seq, tables, block_size, num_blocks)
    backend_name = resolve_backend(backend, device)
    if tables.numel() == 0:  # no entry to read: every (valid) position is padding
        return torch.full_like(pos, -1)
    if backend_name == "numba":
        from pagedkv.kernels import numba_cache

        return numba_cache.slot_mapping(tables, pos, seq, block_size)
    if backend_name == "reference":
        return reference.slot_mapping(tables, pos, seq, block_size)
    from pagedkv.kernels import triton_slot_mapping

    return triton_slot_mapping.launch(tables, pos, seq, block_size)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> None:
    """Write ``key[t]``/``value[t]`` (``[tokens, num_kv_heads, head_dim]``) into slot ``t``'s row.

    Slot ``s`` is row ``s % block_size`` of block ``s // block_size``. A slot of ``-1`` skips its
    token. Slots must be distinct and in ``[-1, num_blocks * block_size)``; the token tensors
    must have the caches' dtype (fp32, fp16 or bf16 for an fp8 cache, whose rows are stored as
    codes under ``k_scale``/``v_scale``) and device, may have any strides, and must share no
    memory with the caches (``ValueError``: the kernel would read rows it is overwriting).
    """
    caches = check_caches(k_cache, v_cache)
    key, value = check_kv_rows(key, value, caches, k_cache.dtype)
    check_sources_apart(key, value, k_cache, v_cache)
    slots = check_slots(slot_mapping, key.shape[0])
    check_bool("validate", validate)
    device = check_same_device(k_cache=k_cache, key=key, value=value, slot_mapping=slots)
    scales = check_kv_scales(k_scale, v_scale, k_cache, validate)
    if validate:
        check_slot_values(slots, caches.num_blocks * caches.block_size)
    backend_name = resolve_backend(backend, device)
    trusted.store_kv(key, value, k_cache, v_cache, slots, backend_name, scales)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
    window: int | None = None,
    max_context_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence over its K/V, read through its block table.

    ``query`` ``[batch, num_heads, head_dim]``; caches ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` of the query's dtype (fp32, fp16 or bf16), or fp8 read under ``k_scale`` and
    ``v_scale`` (module docstring); ``block_tables`` int32 ``[batch,
    max_blocks]``; ``context_lens`` ``[batch]``, each in ``[0, max_blocks * block_size]`` (0 gives
    zeros). ``num_heads`` must be a multiple of ``num_kv_heads``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``. ``scale`` defaults to ``1 / sqrt(head_dim)``.
    ``num_splits`` (triton and numba backends; 1 to 64) cuts each sequence's tokens into that
    many ranges merged by log-sum-exp; ``None`` chooses from the GPU's size (numba: from the
    thread count). ``window`` (``None`` or an int ``w >= 1``) is a sliding window: the query, at
    position ``p = context_lens[b] - 1``, attends only keys ``p - w < j <= p``, the last ``w``
    tokens; the table entries of blocks wholly before them are neither read nor validated.
    ``max_context_len`` (an int ``>= 0``; vLLM's
    ``max_seq_len``) is the largest ``context_lens[b]``, on the host: the triton backend cuts its
    splits over it (or the window, when shorter), and without it reads ``context_lens`` back
    when it splits (a GPU synchronization); with ``validate`` it must equal the largest
    (``ValueError``). Returns ``[batch, num_heads, head_dim]`` in the query's dtype; scores,
    softmax and sums are fp32 (docs/kernels.md, Tolerances).
    """
    caches = check_caches(k_cache, v_cache)
    q = check_decode_query(query, caches, k_cache.dtype)
    tables = check_block_tables(block_tables, q.shape[0])
    lens = check_context_lens(context_lens, q.shape[0])
    device = check_same_device(query=q, k_cache=k_cache, block_tables=tables, context_lens=lens)
    scale = check_scale(scale, caches.head_dim)
    num_splits = check_num_splits(num_splits)
    window = int32_window(window)
    if max_context_len is not None:
        check_int_range("max_context_len", max_context_len, 0, INT32_MAX)
    scales = check_kv_scales(k_scale, v_scale, k_cache, check_bool("validate", validate))
    if validate:
        starts = window_starts(lens, 1, window) if window is not None else None
        check_context_values(lens, tables, caches.block_size, caches.num_blocks, starts)
        check_max_context_len(max_context_len, lens)
    return trusted.paged_decode_attention(
        q, k_cache, v_cache, tables, lens, scale, num_splits, window, max_context_len,
        resolve_backend(backend, device), scales,
    )  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    window: int | None = None,
    max_query_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """Causal attention of a variable-length batch of query chunks over paged K/V (chunked
    prefill over a cached prefix; a decode is a chunk of one token).

    ``query`` ``[tokens, num_heads, head_dim]`` holds the sequences' query tokens back to back:
    sequence ``b``'s are rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1] - 1`` (``cu_seqlens_q``
    int32/int64 ``[batch + 1]``, from 0 to ``tokens``, non-decreasing: FlashAttention's varlen
    offsets). They are the last ``q_b`` of its ``context_lens[b]`` tokens, whose K/V (cached
    prefix and chunk) must already be in the caches, read through row ``b`` of ``block_tables``
    (int32 ``[batch, max_blocks]``): query ``i`` sits at position ``context_lens[b] - q_b + i``
    and attends keys ``0 ..`` that position. ``q_b <= context_lens[b] <= max_blocks *
    block_size``; a sequence may have no queries. Caches, dtypes, fp8 scales, GQA and ``scale``
    follow ``paged_decode_attention``. With ``window`` ``w`` (an int ``>= 1``; ``None``: full
    causal attention) the query at position ``p`` attends only keys ``p - w < j <= p``; sequence
    ``b`` reads nothing before ``max(0, f_b - w + 1)``, ``f_b = context_lens[b] - q_b`` being
    its first query's position (for ``q_b = 0``, the position it computes next), and the table
    entries of blocks wholly before that are neither read nor validated. ``max_query_len`` (an
    int ``>= 0``; FlashAttention's ``max_seqlen_q``), the largest ``q_b``, sizes the triton
    backend's grid on the host: given, ``cu_seqlens_q`` is not read back (a GPU
    synchronization); with ``validate`` it must equal the largest ``q_b`` (``ValueError``).
    Returns ``[tokens, num_heads, head_dim]`` in the query's dtype; scores, softmax and sums are
    fp32.
    """
    caches = check_caches(k_cache, v_cache)
    q = check_decode_query(query, caches, k_cache.dtype)
    tables = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    lens = check_context_lens(context_lens, tables.shape[0])
    starts = check_cu_seqlens(cu_seqlens_q, tables.shape[0])
    device = check_same_device(
        query=q, k_cache=k_cache, block_tables=tables, cu_seqlens_q=starts, context_lens=lens
    )
    scale = check_scale(scale, caches.head_dim)
    window = int32_window(window)
    if max_query_len is not None:
        check_int_range("max_query_len", max_query_len, 0, INT32_MAX)
    scales = check_kv_scales(k_scale, v_scale, k_cache, check_bool("validate", validate))
    if validate:
        _check_chunks(caches, tables, starts, lens, q.shape[0], window, max_query_len)
    return trusted.paged_prefill_attention(
        q, k_cache, v_cache, tables, starts, lens, scale, window, max_query_len,
        resolve_backend(backend, device), scales,
    )  # fmt: skip


def _check_chunks(
    caches: CacheShape,
    tables: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    num_tokens: int,
    window: int | None,
    max_query_len: int | None,
) -> None:
    """``paged_prefill_attention``'s value checks: the table entries the chunks read (with a
    window, only those in it), the offsets, and ``max_query_len``."""
    query_lens = starts[1:].to(torch.int64) - starts[:-1].to(torch.int64)
    key_starts = None  # bad offsets are refused just below, whatever starts they give
    if window is not None:
        key_starts = window_starts(lens, query_lens.clamp(min=0), window)
    check_context_values(lens, tables, caches.block_size, caches.num_blocks, key_starts)
    check_cu_seqlens_values(starts, lens, num_tokens)
    check_max_query_len(max_query_len, query_lens)


def contiguous_decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float | None = None,
    *,
    num_splits: int | None = None,
    window: int | None = None,
    max_context_len: int | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """``paged_decode_attention`` over a contiguous ``[batch, max_len, kv_heads, dim]`` cache.

    The same kernel with the block-table lookup replaced by ``row = seq * max_len + pos``: the
    baseline that measures what paging costs. ``context_lens`` must lie in ``[0, max_len]``.
    ``window``, ``max_context_len`` and an fp8 cache's ``k_scale``/``v_scale`` are
    ``paged_decode_attention``'s: only the last ``w`` tokens are read.
    """
    caches = check_caches(key, value)
    q = check_decode_query(query, caches, key.dtype)
    if caches.num_blocks != q.shape[0]:
        raise ValueError(
            f"key must have one row of tokens per sequence ({q.shape[0]}), got shape "
            f"{tuple(key.shape)}"
        )
    lens = check_context_lens(context_lens, q.shape[0])
    device = check_same_device(query=q, key=key, context_lens=lens)
    scale = check_scale(scale, caches.head_dim)
    num_splits = check_num_splits(num_splits)
    window = int32_window(window)
    if max_context_len is not None:
        check_int_range("max_context_len", max_context_len, 0, INT32_MAX)
    scales = check_kv_scales(k_scale, v_scale, key, check_bool("validate", validate))
    if validate:  # contiguous: a paged cache whose table for b is [b]
        identity = torch.arange(q.shape[0], dtype=torch.int32, device=device)[:, None]
        check_context_values(lens, identity, caches.block_size, caches.num_blocks)
        check_max_context_len(max_context_len, lens)
    return trusted.paged_decode_attention(
        q, key, value, None, lens, scale, num_splits, window, max_context_len,
        resolve_backend(backend, device), scales,
    )  # fmt: skip


def copy_blocks(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pairs: Sequence[tuple[int, int]] | torch.Tensor,
    *,
    backend: str | None = None,
) -> None:
    """Copy block ``src`` over block ``dst`` in both caches for every pair, as if in order.

    ``pairs`` is what ``BlockManager.pop_copy_pairs()`` returns (or an integer tensor
    ``[num_pairs, 2]``); ids must lie in ``[0, num_blocks)``. The pairs are host data, so they
    are always checked (there is no ``validate=``).
    """
    caches = check_caches(k_cache, v_cache)
    checked = check_pairs(pairs, caches.num_blocks)
    backend_name = resolve_backend(backend, k_cache.device)
    if not checked:
        return
    if backend_name == "numba":
        from pagedkv.kernels import numba_cache

        numba_cache.copy_blocks(k_cache, v_cache, checked)
    elif backend_name == "reference":
        reference.copy_blocks(k_cache, v_cache, checked)
    else:
        from pagedkv.kernels import triton_copy_blocks

        triton_copy_blocks.launch(k_cache, v_cache, checked)
