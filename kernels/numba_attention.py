"""numba kernels: paged decode attention (with split-K and its contiguous variant) and paged
prefill / mixed-step attention, compiled for the CPU.

Shaped like the Triton kernels. A *program* owns one sequence, one KV head (all the query heads of
its GQA group, so each K/V row is read once for the group) and one range of work: a split of the
keys (decode) or a tile of queries (prefill). Programs run in a ``prange`` loop on
``numba_runtime.num_threads()`` threads. A program first finds the cache row of each key of its
range, walking the block table one block at a time (one table read per block, no division per
key):

    slot = block_tables[b, n // block_size] * block_size + n % block_size

and makes three passes: scores ``q . k * scale`` for every (query row, key) into a scratch
buffer, an exact softmax per query row (its max, then ``exp`` and the sum; ``exp`` is
``numba_runtime.exp32``, a polynomial within 1.5e-7 of the exact value that vectorizes), and
the weighted sum of the V rows. All arithmetic is fp32 (``numba_runtime.FASTMATH``: sums may be
reordered, NaN still propagates). Only the keys in the program's range are read, so the table
entries of blocks wholly before a sliding window are never read.

The contiguous variant (``block_tables=None``) is the same function compiled without the table
lookup: numba types ``None`` as a constant and prunes the branch, so key ``n`` of sequence ``b``
is row ``b * max_len + n`` of the ``[batch, max_len, heads, dim]`` cache. That is the baseline of
``bench/bench_attention.py``.

Splits (decode): with fewer programs than threads, a sequence's keys are cut into ``num_splits``
ranges whose normalized partial outputs and log-sum-exps are merged, as the Triton kernel does.

fp32 queries only: numba 0.68 has no fp16 arithmetic, and the public functions send fp16 and bf16
attention to the torch reference (``docs/kernels.md``, Backends). An fp8 cache is read as codes
(``numba_fp8.read_row``); K's scale multiplies the (scaled) query and V's the output, in fp32.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

from pagedkv.kernels import numba_fp8
from pagedkv.kernels.check_arguments import MAX_SPLITS
from pagedkv.kernels.numba_runtime import (
    CACHE_LINE_FLOATS,
    FASTMATH,
    PREFETCH_AHEAD,
    as_array,
    exp32,
    launch_threads,
    prefetch,
    sum_in_order,
)

NO_WINDOW = 2**62  # a window no context reaches: it hides nothing
MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more to merge than it saves
TILE_ROWS = 32  # prefill: query rows (queries x GQA group) per program, at most


@njit(cache=True, fastmath=FASTMATH)
def _rows_of(tables, b: int, start: int, end: int, block_size: int) -> np.ndarray:
    """The cache row (``block * block_size + row``) of each key ``start .. end - 1`` of sequence
    ``b``, walking the table one block at a time (one table read and no division per key).
    Contiguous (``tables`` is ``None``): sequence ``b``'s own row, ``b * block_size + n``."""
    rows = np.empty(end - start, np.int64)
    if tables is None:
        for n in range(start, end):
            rows[n - start] = b * block_size + n
        return rows
    column, row = start // block_size, start % block_size
    n = start
    while n < end:
        base = np.int64(tables[b, column]) * block_size
        run = min(block_size - row, end - n)
        for t in range(run):
            rows[n - start + t] = base + row + t
        n += run
        column += 1
        row = 0
    return rows


@njit(cache=True, fastmath=FASTMATH)
def _attend(
    q: np.ndarray,
    positions: np.ndarray,
    k_cache: np.ndarray,
    v_cache: np.ndarray,
    tables,
    b: int,
    kv_head: int,
    start: int,
    end: int,
    window: int,
    out: np.ndarray,
    table,
) -> np.ndarray:
    """Attention of the query rows ``q`` (``[rows, dim]``, scaled; row ``r`` at position
    ``positions[r]``) over keys ``start .. end - 1`` of sequence ``b``, KV head ``kv_head``: key
    ``j`` is visible to row ``r`` iff ``positions[r] - window < j <= positions[r]``. Writes the
    normalized outputs into ``out`` (``[rows, dim]``) and returns each row's log-sum-exp
    (``-inf`` for a row that sees no key, whose output is 0). With a ``table`` (fp8 caches of
    codes: the fp32 value of each of the 256) each K/V row is read through it, unscaled."""
    rows, head_dim = q.shape
    decoded = np.empty(head_dim, np.float32)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_rows = k_cache.reshape(num_slots, k_cache.shape[2], head_dim)
    v_rows = v_cache.reshape(num_slots, k_cache.shape[2], head_dim)
    cache_rows = _rows_of(tables, b, start, end, k_cache.shape[1])
    count = end - start
    scores = np.empty((rows, max(count, 1)), np.float32)
    for column in range(count):  # pass 1: every score of the range
        if column + PREFETCH_AHEAD < count:
            for d in range(0, head_dim, CACHE_LINE_FLOATS):
                prefetch(k_rows, cache_rows[column + PREFETCH_AHEAD], kv_head, d)
        key = numba_fp8.read_row(k_rows, cache_rows[column], kv_head, table, decoded)
        for r in range(rows):
            s = np.float32(0.0)
            for d in range(head_dim):
                s += q[r, d] * key[d]
            scores[r, column] = s
    lse = np.empty(rows, np.float32)
    for r in range(rows):  # pass 2: softmax over each row's visible keys
        lo = max(positions[r] - window + 1, start) - start
        hi = min(positions[r] + 1, end) - start
        # Loops over a view indexed from 0: numba wraps a negative index around, and only an
        # index LLVM can prove non-negative leaves the loop free of that select to vectorize.
        visible = scores[r, lo:hi]
        m = np.float32(-np.inf)
        for c in range(visible.shape[0]):
            m = max(m, visible[c])
        for c in range(visible.shape[0]):
            visible[c] = exp32(visible[c] - m)
        total = sum_in_order(visible)
        # No visible key: -inf, an empty split. A NaN total (a NaN score) stays NaN, so the
        # merge cannot take the split for an empty one.
        lse[r] = m + np.log(total) if total != 0 else -np.inf
        inverse = np.float32(1.0) / total if total > 0 else np.float32(1.0)
        for c in range(visible.shape[0]):
            visible[c] *= inverse
        scores[r, :lo] = 0.0
        scores[r, max(hi, lo) : count] = 0.0
    out[:, :] = 0.0
    for column in range(count):  # pass 3: the weighted sum of the V rows
        if column + PREFETCH_AHEAD < count:
            for d in range(0, head_dim, CACHE_LINE_FLOATS):
                prefetch(v_rows, cache_rows[column + PREFETCH_AHEAD], kv_head, d)
        value = numba_fp8.read_row(v_rows, cache_rows[column], kv_head, table, decoded)
        for r in range(rows):
            weight = scores[r, column]
            for d in range(head_dim):
                out[r, d] += weight * value[d]
    return lse


@njit(cache=True, fastmath=FASTMATH)
def _decode_program(
    program,
    query,
    k_cache,
    v_cache,
    tables,
    lens,
    scale,
    window,
    split_len,
    partial,
    lse,
    table,
    kv_scales,
):
    """Program ``(b, kv_head, split)``: query heads ``kv_head * group ..`` of sequence ``b``
    over keys ``[first + split * split_len, ..)`` of ``[first, lens[b])``, ``first`` being the
    window's first key. ``partial`` ``[batch, heads, splits, dim]``, ``lse`` ``[batch, heads,
    splits]``. ``kv_scales`` ``[2, num_kv_heads]``: K's scale multiplies the query, V's the
    output (1 for a cache that is not fp8)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_splits = lse.shape[2]
    b = program // (num_kv_heads * num_splits)
    kv_head = program // num_splits % num_kv_heads
    split = program % num_splits
    length = lens[b]
    first = max(length - window, 0)
    start = min(first + split * split_len, length)
    end = min(start + split_len, length)
    h0 = kv_head * group
    q = np.empty((group, head_dim), np.float32)
    for g in range(group):
        for d in range(head_dim):
            q[g, d] = query[b, h0 + g, d] * scale * kv_scales[0, kv_head]
    positions = np.full(group, length - 1, np.int64)
    o = np.empty((group, head_dim), np.float32)
    row_lse = _attend(
        q, positions, k_cache, v_cache, tables, b, kv_head, start, end, window, o, table
    )
    for g in range(group):
        partial[b, h0 + g, split, :] = o[g] * kv_scales[1, kv_head]
        lse[b, h0 + g, split] = row_lse[g]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _decode_parallel(
    query, k_cache, v_cache, tables, lens, scale, window, split_len, partial, lse, table, kv_scales
):
    """Every ``_decode_program``, on the thread pool."""
    for program in prange(lse.shape[0] * k_cache.shape[2] * lse.shape[2]):
        _decode_program(
            program, query, k_cache, v_cache, tables, lens, scale, window, split_len, partial,
            lse, table, kv_scales,
        )  # fmt: skip


@njit(cache=True, fastmath=FASTMATH)
def _decode_serial(
    query, k_cache, v_cache, tables, lens, scale, window, split_len, partial, lse, table, kv_scales
):
    """Every ``_decode_program``, on the calling thread."""
    for program in range(lse.shape[0] * k_cache.shape[2] * lse.shape[2]):
        _decode_program(
            program, query, k_cache, v_cache, tables, lens, scale, window, split_len, partial,
            lse, table, kv_scales,
        )  # fmt: skip


@njit(cache=True, fastmath=FASTMATH)
def _merge(partial, lse, out):
    """``out[b, h] = sum_s exp(lse_s - max) * partial_s / sum_s exp(lse_s - max)`` (0 if every
    split is empty, NaN if one read a NaN)."""
    batch, num_heads, num_splits, head_dim = partial.shape
    for bh in range(batch * num_heads):
        b, h = bh // num_heads, bh % num_heads
        top = -np.inf
        poisoned = False  # a split read a NaN: so does the output
        for s in range(num_splits):
            poisoned |= lse[b, h, s] != lse[b, h, s]
            top = max(top, lse[b, h, s])
        out[b, h, :] = np.nan if poisoned else 0.0
        if poisoned or top == -np.inf:
            continue
        total = np.float32(0.0)
        for s in range(num_splits):
            weight = exp32(lse[b, h, s] - top)
            total += weight
            for d in range(head_dim):
                out[b, h, d] += weight * partial[b, h, s, d]
        out[b, h, :] /= total


@njit(cache=True, fastmath=FASTMATH)
def _prefill_program(
    program,
    query,
    k_cache,
    v_cache,
    tables,
    cu_seqlens,
    lens,
    tiles,
    scale,
    window,
    out,
    table,
    kv_scales,
):
    """Program ``(tile, kv_head)``; tile ``i`` is queries ``tiles[i, 1] .. tiles[i, 2] - 1``
    (offsets in the chunk) of sequence ``tiles[i, 0]``. Query ``i`` of sequence ``b``'s chunk of
    ``q_b`` sits at position ``lens[b] - q_b + i`` and sees the keys of ``_attend``'s rule;
    ``table`` and ``kv_scales`` are ``_decode_program``'s."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    tile, kv_head = program // num_kv_heads, program % num_kv_heads
    b, lo, hi = tiles[tile, 0], tiles[tile, 1], tiles[tile, 2]
    first = lens[b] - (cu_seqlens[b + 1] - cu_seqlens[b])  # the chunk's first position
    rows = (hi - lo) * group
    q = np.empty((rows, head_dim), np.float32)
    positions = np.empty(rows, np.int64)
    for i in range(hi - lo):
        token = cu_seqlens[b] + lo + i
        for g in range(group):
            r = i * group + g
            positions[r] = first + lo + i
            for d in range(head_dim):
                q[r, d] = query[token, kv_head * group + g, d] * scale * kv_scales[0, kv_head]
    start = max(first + lo - window + 1, 0)
    end = first + hi
    o = np.empty((rows, head_dim), np.float32)
    _attend(q, positions, k_cache, v_cache, tables, b, kv_head, start, end, window, o, table)
    for i in range(hi - lo):
        token = cu_seqlens[b] + lo + i
        for g in range(group):
            out[token, kv_head * group + g, :] = o[i * group + g] * kv_scales[1, kv_head]


@njit(parallel=True, cache=True, fastmath=FASTMATH)
def _prefill_parallel(
    query, k_cache, v_cache, tables, cu_seqlens, lens, tiles, scale, window, out, table, kv_scales
):
    """Every ``_prefill_program``, on the thread pool."""
    for program in prange(tiles.shape[0] * k_cache.shape[2]):
        _prefill_program(
            program, query, k_cache, v_cache, tables, cu_seqlens, lens, tiles, scale, window,
            out, table, kv_scales,
        )  # fmt: skip


@njit(cache=True, fastmath=FASTMATH)
def _prefill_serial(
    query, k_cache, v_cache, tables, cu_seqlens, lens, tiles, scale, window, out, table, kv_scales
):
    """Every ``_prefill_program``, on the calling thread."""
    for program in range(tiles.shape[0] * k_cache.shape[2]):
        _prefill_program(
            program, query, k_cache, v_cache, tables, cu_seqlens, lens, tiles, scale, window,
            out, table, kv_scales,
        )  # fmt: skip


def choose_num_splits(programs: int, max_tokens: int, threads: int) -> int:
    """Splits per sequence: enough programs for every thread, each split at least
    ``MIN_TOKENS_PER_SPLIT`` of the ``max_tokens`` a query can read; 1 when the batch already
    gives every thread a program."""
    if programs >= threads:
        return 1
    by_threads = -(-threads // programs)
    by_length = max(1, max_tokens // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_threads, by_length, MAX_SPLITS))


def decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor | None,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    window: int | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """Decode attention on validated fp32 arguments; ``block_tables=None`` reads a contiguous
    ``[batch, max_len, heads, dim]`` cache. ``num_splits=None`` uses ``choose_num_splits``. An
    fp8 cache comes as its ``uint8`` view with its format's name ``fp8`` and ``(k, v)`` scales."""
    query = query.contiguous()
    batch, num_heads, head_dim = query.shape
    out = torch.empty_like(query)
    if batch == 0:
        return out
    capacity = (
        block_tables.shape[1] * k_cache.shape[1] if block_tables is not None else k_cache.shape[1]
    )
    max_tokens = max(1, min(capacity, window if window is not None else capacity))
    num_kv_heads = k_cache.shape[2]
    threads = launch_threads(8 * batch * max_tokens * num_kv_heads * head_dim)
    if num_splits is None:
        num_splits = choose_num_splits(batch * num_kv_heads, max_tokens, threads)
    split_len = -(-max_tokens // num_splits)
    partial = torch.empty(batch, num_heads, num_splits, head_dim) if num_splits > 1 else out
    lse = torch.empty(batch, num_heads, num_splits)
    tables = as_array(block_tables.contiguous()) if block_tables is not None else None
    kernel = _decode_parallel if threads > 1 else _decode_serial
    kernel(
        as_array(query),
        as_array(k_cache),
        as_array(v_cache),
        tables,
        as_array(context_lens.to(torch.int64)),
        np.float32(scale),
        window if window is not None else NO_WINDOW,
        split_len,
        as_array(partial.view(batch, num_heads, num_splits, head_dim)),
        as_array(lse),
        *numba_fp8.kernel_arguments(fp8, scales, num_kv_heads),
    )
    if num_splits > 1:
        _merge(as_array(partial), as_array(lse), as_array(out))
    return out


@njit(cache=True)
def query_tiles(cu_seqlens: np.ndarray, per_tile: int) -> np.ndarray:
    """``[tiles, 3]`` int64 rows ``(sequence, first query, end query)``: each sequence's chunk
    (``cu_seqlens`` int64 ``[batch + 1]``) cut into tiles of at most ``per_tile`` queries."""
    batch = cu_seqlens.shape[0] - 1
    count = 0
    for b in range(batch):
        count += (cu_seqlens[b + 1] - cu_seqlens[b] + per_tile - 1) // per_tile
    tiles = np.empty((count, 3), np.int64)
    t = 0
    for b in range(batch):
        queries = cu_seqlens[b + 1] - cu_seqlens[b]
        for lo in range(0, queries, per_tile):
            tiles[t, 0], tiles[t, 1], tiles[t, 2] = b, lo, min(lo + per_tile, queries)
            t += 1
    return tiles


def prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    fp8: str | None = None,
) -> torch.Tensor:
    """Varlen paged prefill attention on validated fp32 arguments (fp8: as :func:`decode`)."""
    query = query.contiguous()
    out = torch.empty_like(query)
    if query.shape[0] == 0:
        return out
    tokens, num_heads, head_dim = query.shape
    capacity = block_tables.shape[1] * k_cache.shape[1]
    keys = min(capacity, window if window is not None else capacity)  # read per query, at most
    threads = launch_threads(8 * tokens * keys * head_dim * num_heads // TILE_ROWS)
    starts = as_array(cu_seqlens_q.to(torch.int64))
    tiles = query_tiles(starts, max(1, TILE_ROWS // (num_heads // k_cache.shape[2])))
    kernel = _prefill_parallel if threads > 1 else _prefill_serial
    kernel(
        as_array(query),
        as_array(k_cache),
        as_array(v_cache),
        as_array(block_tables.contiguous()),
        starts,
        as_array(context_lens.to(torch.int64)),
        tiles,
        np.float32(scale),
        window if window is not None else NO_WINDOW,
        as_array(out),
        *numba_fp8.kernel_arguments(fp8, scales, k_cache.shape[2]),
    )
    return out
