"""Properties: ``paged_prefill_attention`` (varlen chunked prefill) equals causal dense attention.

Caches are filled by spec runs (``properties.kernel_cases``: shuffled ids, forks sharing blocks,
copy-on-write, frees and reuse). Each live sequence then asks for attention of its last ``q``
tokens, ``0 <= q <= length`` (a chunk over a cached prefix; ``q = length`` is a whole prompt, ``q
= 1`` a decode, ``q = 0`` a sequence with nothing to compute this step), all in one flat batch cut
by ``cu_seqlens_q``. The Triton kernel (compiled on a GPU, interpreted on CPU), the torch
reference and the spec's meaning, fp32 causal ``scaled_dot_product_attention`` of each query over
its sequence's logical K/V up to its own position, must agree within ``TOLERANCES``. Every block
size from 1 to 256 is a parametrized case; dtype, GQA ratio and head dim are drawn. A step of
decodes only equals ``paged_decode_attention``. Invalid calls raise the documented errors, and
planted bugs in both implementations are caught by the same check.

With a sliding window ``w`` (query at ``p`` sees keys ``p - w < j <= p``, drawn from 1 to past
the longest context) the same three agree on chunks over cached prefixes; the table entries of
blocks wholly before each sequence's first query's window are poisoned (a NaN block, or ``-1``)
without changing any output; and planted bugs that shift the window, or walk keys from 0 and
only mask (reading the released blocks), are caught.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import reference, triton_prefill
from properties.kernel_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    GQA_RATIOS,
    HEAD_DIMS,
    KVCache,
    Seq,
    Shape,
    assert_close,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    poison_outside_window,
    scenarios,
    window_mask,
    window_start,
)

MAX_CHUNK = 64  # longest drawn query chunk: the interpreter runs every query tile

# prefill(query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale) -> output
Prefill = Callable[..., torch.Tensor]


def triton_prefill_api(*args: torch.Tensor | float, window: int | None = None) -> torch.Tensor:
    """The public function on the triton backend."""
    return kernels.paged_prefill_attention(*args, window=window, backend="triton")


def dense_prefill(
    query: torch.Tensor,
    seqs: list[Seq | None],
    query_lens: list[int],
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """The spec: each query token attends, in fp32, its sequence's logical K/V at positions up to
    its own (``length - q + i`` for the chunk's ``i``-th token), and with ``window`` ``w`` only
    those above its own minus ``w``."""
    out = torch.zeros_like(query)
    start = 0
    for seq, count in zip(seqs, query_lens, strict=True):
        if count:
            assert seq is not None
            key, value = seq.logical_kv()
            group = query.shape[1] // key.shape[1]
            k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, dim]
            v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start : start + count].float().transpose(0, 1)  # [heads, count, dim]
            positions = torch.arange(seq.length - count, seq.length, device=query.device)
            mask = window_mask(positions, seq.length, window, query.device)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=scale)
            out[start : start + count] = o.transpose(0, 1).to(query.dtype)
        start += count
    return out


def check_prefill(
    cache: KVCache,
    query_lens: list[int],
    prefill: Prefill,
    extra_columns: int = 0,
    padding_row: bool = False,
    pad: int = -1,
    window: int | None = None,
    poison: str | None = None,
) -> None:
    """``prefill``, the torch reference and the spec agree; ``query_lens`` is one count per
    sequence of ``cache.batch(...)`` (0 for the padding row). ``window`` goes to all three.
    With ``poison`` the entries of blocks wholly before each window are poisoned
    (``poison_outside_window``) for ``prefill`` and the reference, which must then return
    exactly what they return without it."""
    seqs, tables, lens = cache.batch(extra_columns, pad, padding_row)
    shape = cache.shape
    query = cache.randn(sum(query_lens), shape.num_heads, shape.head_dim)
    offsets = torch.tensor([0, *query_lens], device=DEVICE).cumsum(0).to(torch.int32)
    scale = shape.head_dim**-0.5
    args = (query, cache.k_cache, cache.v_cache, tables, offsets, lens, scale)
    expected = dense_prefill(query, seqs, query_lens, scale, window)
    ref = kernels.paged_prefill_attention(*args, window=window, backend="reference")
    actual = prefill(*args, window=window)
    if poison is not None:
        starts = [window_start(int(n), q, window) for n, q in zip(lens, query_lens, strict=True)]
        k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, poison)
        dirty = (query, k_cache, v_cache, poisoned, offsets, lens, scale)
        dirty_ref = kernels.paged_prefill_attention(*dirty, window=window, backend="reference")
        assert torch.equal(dirty_ref, ref), "the reference read a block outside the window"
        assert torch.equal(prefill(*dirty, window=window), actual), "prefill read outside"
    assert actual.dtype == query.dtype and actual.shape == query.shape
    assert_close(ref, expected, "reference vs spec")
    assert_close(actual, expected, "prefill vs spec")
    assert_close(actual, ref, "prefill vs reference")


def draw_query_lens(data: st.DataObject, seqs: list[Seq | None], block_size: int) -> list[int]:
    """A chunk length per sequence: edge lengths (0, 1, a block, the whole sequence) are likely."""
    counts = []
    for seq in seqs:
        length = 0 if seq is None else seq.length
        cap = min(length, MAX_CHUNK)
        edges = sorted({n for n in (0, 1, block_size, block_size + 1, length) if n <= cap})
        counts.append(data.draw(st.sampled_from(edges) | st.integers(0, cap), label="query_len"))
    return counts


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@settings(max_examples=kernel_examples(10), deadline=None)
@given(data=st.data())
def test_prefill_matches_spec_for_every_block_size(block_size: int, data: st.DataObject) -> None:
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    scenario = data.draw(scenarios(block_size), label="scenario")
    cache = KVCache(scenario, Shape(block_size, num_kv_heads, group, head_dim, dtype))
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    query_lens = draw_query_lens(data, seqs, block_size)
    extra_columns = data.draw(st.integers(0, 2), label="extra_columns")
    check_prefill(cache, query_lens, triton_prefill_api, extra_columns, padding_row)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("block_size", [1, 16])
def test_a_step_of_decodes_equals_decode_attention(block_size: int, backend: str) -> None:
    """Query length 1 everywhere: the prefill function is the decode function."""
    cache = KVCache(fixed_scenario(block_size), Shape(block_size, 2, 4, 64, torch.float32))
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = cache.randn(len(seqs), cache.shape.num_heads, cache.shape.head_dim)
    offsets = torch.arange(len(seqs) + 1, device=DEVICE)
    offsets[-1] -= 1  # the padding row (length 0) has no query
    live = query[:-1]
    args = (cache.k_cache, cache.v_cache, tables)
    prefill = kernels.paged_prefill_attention(live, *args, offsets, lens, backend=backend)
    decode = kernels.paged_decode_attention(query, *args, lens, backend=backend)
    assert_close(prefill, decode[:-1], f"{backend} prefill vs decode")


def test_fixed_run_matches_spec() -> None:
    """The fixed run the planted-bug tests use passes with the real kernel."""
    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32))
    check_prefill(cache, MUTANT_QUERY_LENS, triton_prefill_api, extra_columns=1, pad=0)


def test_empty_batches_give_empty_outputs() -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    query = cache.randn(0, 4, 64)
    for backend in ("triton", "reference"):
        for batch in (0, 2):  # no sequences; sequences with no queries
            out = kernels.paged_prefill_attention(
                query, cache.k_cache, cache.v_cache,
                torch.zeros(batch, 3, dtype=torch.int32, device=DEVICE),
                torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE),
                torch.zeros(batch, dtype=torch.int32, device=DEVICE), backend=backend,
            )  # fmt: skip
            assert out.shape == (0, 4, 64)


# ----------------------------------------------------------------------- validation


def valid_call() -> dict[str, object]:
    """Arguments of a valid call: two sequences of 5 and 3 tokens computing 2 and 3 of them."""
    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(4, 4, 2, 8, generator=generator)
    return {
        "query": torch.randn(5, 4, 8, generator=generator),
        "k_cache": k_cache,
        "v_cache": torch.randn(4, 4, 2, 8, generator=generator),
        "block_tables": torch.tensor([[2, 0], [3, -1]], dtype=torch.int32),
        "cu_seqlens_q": torch.tensor([0, 2, 5]),
        "context_lens": torch.tensor([5, 3]),
    }


INVALID = {
    "cu_seqlens_q float": ("cu_seqlens_q", torch.tensor([0.0, 2.0, 5.0]), TypeError),
    "cu_seqlens_q not batch + 1": ("cu_seqlens_q", torch.tensor([0, 5]), ValueError),
    "cu_seqlens_q not from 0": ("cu_seqlens_q", torch.tensor([1, 2, 5]), ValueError),
    "cu_seqlens_q short of the tokens": ("cu_seqlens_q", torch.tensor([0, 2, 4]), ValueError),
    "cu_seqlens_q decreasing": ("cu_seqlens_q", torch.tensor([0, 6, 5]), ValueError),
    "more queries than context": ("cu_seqlens_q", torch.tensor([0, 1, 5]), ValueError),
    "context_lens wrong length": ("context_lens", torch.tensor([5, 3, 1]), ValueError),
    "context beyond the table": ("context_lens", torch.tensor([9, 3]), IndexError),
    "negative context": ("context_lens", torch.tensor([5, -3]), ValueError),
    "block id outside the cache": ("block_tables", torch.tensor([[2, 4], [3, -1]]), TypeError),
    "block id outside the cache (int32)": (
        "block_tables",
        torch.tensor([[2, 4], [3, -1]], dtype=torch.int32),
        IndexError,
    ),
    "reached padding entry": (
        "block_tables",
        torch.tensor([[2, -1], [3, -1]], dtype=torch.int32),
        IndexError,
    ),
    "query 2-d": ("query", torch.zeros(5, 32), ValueError),
    "query heads not a multiple": ("query", torch.zeros(5, 3, 8), ValueError),
    "query dtype": ("query", torch.zeros(5, 4, 8, dtype=torch.float16), TypeError),
    "max_query_len not the longest chunk": ("max_query_len", 2, ValueError),
    "max_query_len negative": ("max_query_len", -1, ValueError),
    "max_query_len not an int": ("max_query_len", 3.0, TypeError),
}


def test_the_valid_call_passes_on_both_backends() -> None:
    """With or without ``max_query_len`` (3, the longest chunk), the same output."""
    call = valid_call()
    outputs = [
        kernels.paged_prefill_attention(**call, **extra, backend=b)
        for b in ("triton", "reference")
        for extra in ({}, {"max_query_len": 3})
    ]
    for output in outputs[1:]:
        assert_close(output, outputs[0], "triton and reference, max_query_len or not")


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("case", list(INVALID), ids=list(INVALID))
def test_invalid_calls_raise(case: str, backend: str) -> None:
    name, value, error = INVALID[case]
    call = {**valid_call(), name: value}
    with pytest.raises(error, match=name.split("_")[0] if error is not IndexError else None):
        kernels.paged_prefill_attention(**call, backend=backend)


# ----------------------------------------------------------------------- planted bugs

MUTANT_QUERY_LENS = [17, 1, 19]  # fixed_scenario's live sequences hold 50, 51 and 19 tokens

TRITON_MUTANTS = {
    "table read off by one": (
        "_prefill_kernel",
        "block_tables_ptr + seq * table_stride + n // BLOCK_SIZE",
        "block_tables_ptr + seq * table_stride + n // BLOCK_SIZE + 1",
    ),
    "wrong row inside a block": (
        "_prefill_kernel",
        "rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE",
        "rows = block_id * BLOCK_SIZE + (n + 1) % BLOCK_SIZE",
    ),
    "query heads interleaved over KV heads": (
        "_prefill_kernel",
        "heads = kv_head * group + g",
        "heads = kv_head + g * NUM_KV_HEADS",
    ),
    "causal mask lets a query see the next token": (
        "_prefill_kernel",
        "causal = n[None, :] <= positions[:, None]",
        "causal = n[None, :] <= positions[:, None] + 1",
    ),
    "chunk positions ignore the cached prefix": (
        "_prefill_kernel",
        "positions = context_len - q_len + i",
        "positions = i",
    ),
}
REFERENCE_MUTANTS = {
    "table read off by one": (
        "gather_kv",
        "tokens // block_size",
        "tokens // block_size + 1",
    ),
    "wrong row inside a block": (
        "gather_kv",
        "entries * block_size + tokens % block_size",
        "entries * block_size + (tokens + 1) % block_size",
    ),
    "query heads interleaved over KV heads": (
        "masked_attention",
        "q = query.float().view(batch, num_queries, num_kv_heads, group, head_dim)",
        "q = query.float().view(batch, num_queries, group, num_kv_heads, head_dim).transpose(2, 3)",
    ),
    "causal mask lets a query see the next token": (
        "masked_attention",
        "hidden = key_positions[:, None, :] > p",
        "hidden = key_positions[:, None, :] > p + 1",
    ),
    "chunk positions ignore the cached prefix": (
        "paged_prefill_attention",
        "first = lens - query_lens  # position of each sequence's first query token",
        "first = lens * 0",
    ),
}


def planted_cache() -> KVCache:
    """The fixed run at block size 16, GQA 4, with chunks over cached prefixes."""
    return KVCache(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32))


@pytest.mark.parametrize("mutation", list(TRITON_MUTANTS), ids=list(TRITON_MUTANTS))
def test_check_catches_planted_triton_bug(mutation: str, tmp_path: Path) -> None:
    """Tables get one extra column holding a real block id (``pad=0``), so the off-by-one read
    stays inside the caches."""
    mutant = load_mutant(triton_prefill, *TRITON_MUTANTS[mutation], tmp_path)
    with pytest.raises(AssertionError):
        check_prefill(planted_cache(), MUTANT_QUERY_LENS, mutant.launch, extra_columns=1, pad=0)


@pytest.mark.parametrize("mutation", list(REFERENCE_MUTANTS), ids=list(REFERENCE_MUTANTS))
def test_check_catches_planted_reference_bug(mutation: str, tmp_path: Path) -> None:
    """The same check, with the broken torch reference in the place of the kernel under test."""
    mutant = load_mutant(reference, *REFERENCE_MUTANTS[mutation], tmp_path)
    with pytest.raises(AssertionError):
        check_prefill(
            planted_cache(), MUTANT_QUERY_LENS, mutant.paged_prefill_attention,
            extra_columns=1, pad=0,
        )  # fmt: skip


# ----------------------------------------------------------------------- sliding window

WINDOW_BLOCK_SIZES = (1, 2, 4, 16)  # small blocks: many of them fall wholly outside a window


@pytest.mark.parametrize("block_size", WINDOW_BLOCK_SIZES)
@settings(max_examples=kernel_examples(8), deadline=None)
@given(data=st.data())
def test_windowed_prefill_matches_spec(block_size: int, data: st.DataObject) -> None:
    """Chunks over cached prefixes with a window from 1 to past the context: Triton, the
    reference and the spec agree, and poisoning what lies wholly before the windows changes
    nothing."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    scenario = data.draw(scenarios(block_size), label="scenario")
    cache = KVCache(scenario, Shape(block_size, num_kv_heads, group, 64, dtype))
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    query_lens = draw_query_lens(data, seqs, block_size)
    longest = max((seq.length for seq in seqs if seq is not None), default=1)
    edges = st.sampled_from([1, 2, block_size, longest, longest + 1])
    window = data.draw(edges | st.integers(1, longest), label="window")
    poison = data.draw(st.sampled_from(["nan", "invalid"]), label="poison")
    check_prefill(
        cache, query_lens, triton_prefill_api, 1, padding_row, window=window, poison=poison
    )


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("window", [1, 6, 1000])
def test_a_windowed_step_of_decodes_equals_windowed_decode(window: int, backend: str) -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    seqs, tables, lens = cache.batch(extra_columns=1)
    query = cache.randn(len(seqs), 4, 64)
    offsets = torch.arange(len(seqs) + 1, device=DEVICE)
    args = (query, cache.k_cache, cache.v_cache, tables)
    prefill = kernels.paged_prefill_attention(*args, offsets, lens, window=window, backend=backend)
    decode = kernels.paged_decode_attention(*args, lens, window=window, backend=backend)
    assert_close(prefill, decode, f"{backend} windowed prefill vs decode")


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_prefill_window_is_checked(backend: str) -> None:
    call = valid_call()
    for bad, error in ((0, ValueError), (-1, ValueError), (3.0, TypeError), (False, TypeError)):
        with pytest.raises(error, match="window"):
            kernels.paged_prefill_attention(**call, window=bad, backend=backend)
    # Sequence 0 has 8 tokens and one query, at 7; sequence 1 has 3 tokens, all queries. Window
    # 4 reads positions 4 .. 7 of sequence 0, entry 1 alone, so entry 0 may hold anything;
    # window 5 reaches position 3, so entry 0 is read, and checked.
    call["context_lens"] = torch.tensor([8, 3])
    call["query"] = torch.randn(4, 4, 8)
    call["cu_seqlens_q"] = torch.tensor([0, 1, 4])
    for window, entry_read in ((4, False), (5, True)):
        tables = torch.tensor([[-1, 0], [3, -1]], dtype=torch.int32)
        args = {**call, "block_tables": tables, "window": window, "backend": backend}
        if entry_read:
            with pytest.raises(IndexError, match=r"block_tables\[0, 0\]"):
                kernels.paged_prefill_attention(**args)
        else:  # and the output is that of a table whose entry 0 is a real block
            real = torch.tensor([[2, 0], [3, -1]], dtype=torch.int32)
            expected = kernels.paged_prefill_attention(**{**args, "block_tables": real})
            assert torch.equal(kernels.paged_prefill_attention(**args), expected)


WINDOW_TRITON_MUTANTS = {
    "window one token too wide": (
        "_prefill_kernel",
        "in_window = n[None, :] > positions[:, None] - window",
        "in_window = n[None, :] >= positions[:, None] - window",
    ),
    "keys walked from 0 and masked": (
        "_prefill_kernel",
        "range(first_key, end, BLOCK_N)",
        "range(0, end, BLOCK_N)",
    ),
    "window starts at the tile's last query": (
        "_prefill_kernel",
        "first_key = tl.maximum(tile_position - window + 1, 0)",
        "first_key = tl.maximum(tile_position + BLOCK_Q - window, 0)",
    ),
}
WINDOW_REFERENCE_MUTANTS = {
    "window one token too wide": (
        "masked_attention",
        "hidden |= key_positions[:, None, :] <= p - window",
        "hidden |= key_positions[:, None, :] < p - window",
    ),
    "keys gathered from 0 and masked": (
        "paged_prefill_attention",
        "starts = window_starts(lens, query_lens, window)",
        "starts = torch.zeros_like(lens)",
    ),
}
# fixed_scenario(4)'s live sequences hold 14, 10 and 7 tokens: with window 4, the first two
# have blocks wholly before their windows (chunks over cached prefixes), the third none.
WINDOW_QUERY_LENS = [3, 1, 7]


@pytest.mark.parametrize("mutation", list(WINDOW_TRITON_MUTANTS), ids=list(WINDOW_TRITON_MUTANTS))
def test_check_catches_planted_triton_window_bug(mutation: str, tmp_path: Path) -> None:
    """Block size 4, window 4, poisoned with a NaN block: the real kernel passes, each mutant
    fails."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    check_prefill(cache, WINDOW_QUERY_LENS, triton_prefill_api, window=4, poison="nan")
    mutant = load_mutant(triton_prefill, *WINDOW_TRITON_MUTANTS[mutation], tmp_path)
    with pytest.raises(AssertionError):
        check_prefill(cache, WINDOW_QUERY_LENS, mutant.launch, window=4, poison="nan")


@pytest.mark.parametrize(
    "mutation", list(WINDOW_REFERENCE_MUTANTS), ids=list(WINDOW_REFERENCE_MUTANTS)
)
def test_check_catches_planted_reference_window_bug(mutation: str, tmp_path: Path) -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    mutant = load_mutant(reference, *WINDOW_REFERENCE_MUTANTS[mutation], tmp_path)
    with pytest.raises(AssertionError):
        check_prefill(
            cache, WINDOW_QUERY_LENS, mutant.paged_prefill_attention, window=4, poison="nan"
        )
