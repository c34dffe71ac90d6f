"""Properties: ``store_kv`` then ``paged_decode_attention`` equals dense attention.

Caches are filled by spec runs (shuffled ids, forks sharing blocks, copy-on-write, ragged lengths
that include 1 and exact block multiples). The Triton kernel (compiled on a GPU, interpreted on
CPU), the torch reference and fp32 dense attention over each sequence's logical K/V must agree
within ``TOLERANCES``; the split-K path must agree with the single pass. Every block size meets
every dtype, and every GQA ratio meets every head dim, by parametrization; Hypothesis draws the
rest.

Sliding windows (``window=w``: the query at ``p`` sees keys ``p - w < j <= p``) are drawn from 1
up to past the longest context, with split-K and the contiguous kernel too. With a window, the
table entries of blocks wholly before it are poisoned (a NaN block, or ``-1``) and the outputs
must not change: those blocks are never read, nor their entries validated. Planted bugs that
ignore the window, widen it by one, or read from token 0 and mask must be caught.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import triton_decode
from properties.kernel_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    GQA_RATIOS,
    HEAD_DIMS,
    Attention,
    KVCache,
    Seq,
    Shape,
    assert_close,
    check_attention,
    dense_attention,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    poison_outside_window,
    scenarios,
    window_start,
)


def triton_attention(num_splits: int | None = None) -> Attention:
    """The public function on the triton backend, with ``num_splits`` fixed."""

    def attention(*args: torch.Tensor | float, window: int | None = None) -> torch.Tensor:
        return kernels.paged_decode_attention(
            *args, num_splits=num_splits, window=window, backend="triton"
        )

    return attention


def draw_cache(data: st.DataObject, block_size: int, group: int, head_dim: int, dtype) -> KVCache:
    """A cache filled by a drawn scenario, with one or two KV heads."""
    scenario = data.draw(scenarios(block_size), label="scenario")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    return KVCache(scenario, Shape(block_size, num_kv_heads, group, head_dim, dtype))


@pytest.mark.parametrize(
    ("block_size", "dtype"),
    list(itertools.product(BLOCK_SIZES, DTYPES)),
    ids=lambda value: str(value).removeprefix("torch."),
)
@settings(max_examples=kernel_examples(8))
@given(data=st.data())
def test_attention_matches_dense_for_every_block_size(
    block_size: int, dtype: torch.dtype, data: st.DataObject
) -> None:
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    cache = draw_cache(data, block_size, group, head_dim, dtype)
    check_attention(
        cache,
        triton_attention(num_splits=1),
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        padding_row=data.draw(st.booleans(), label="padding_row"),
    )


@pytest.mark.parametrize(("group", "head_dim"), list(itertools.product(GQA_RATIOS, HEAD_DIMS)))
@settings(max_examples=kernel_examples(8))
@given(data=st.data())
def test_attention_matches_dense_for_every_gqa_ratio_and_head_dim(
    group: int, head_dim: int, data: st.DataObject
) -> None:
    block_size = data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    check_attention(draw_cache(data, block_size, group, head_dim, dtype), triton_attention())


@settings(max_examples=kernel_examples(25))
@given(data=st.data())
def test_split_k_matches_single_pass(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    cache = draw_cache(data, block_size, group, 64, dtype)
    num_splits = data.draw(st.integers(2, 9), label="num_splits")
    _, tables, lens = cache.batch(extra_columns=data.draw(st.integers(0, 2)), padding_row=True)
    query = cache.randn(tables.shape[0], cache.shape.num_heads, cache.shape.head_dim)
    args = (query, cache.k_cache, cache.v_cache, tables, lens)
    single = triton_attention(num_splits=1)(*args)
    split = triton_attention(num_splits=num_splits)(*args)
    assert not split.isnan().any()
    assert_close(split, single, f"{num_splits} splits vs single pass")


@pytest.mark.parametrize("scale", [0.05, 1.0])
def test_explicit_scale_is_used(scale: float) -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    check_attention(cache, triton_attention(num_splits=2), scale=scale)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
def test_fixed_run_matches_dense(block_size: int, dtype: torch.dtype) -> None:
    """The fixed run the mutant tests use passes with the real kernel."""
    cache = KVCache(fixed_scenario(block_size), Shape(block_size, 2, 4, 80, dtype))
    check_attention(cache, triton_attention(), extra_columns=1, padding_row=True)


@settings(max_examples=kernel_examples(6))
@given(
    batch=st.integers(1, 3),
    max_len=st.integers(1, 80),
    group=st.sampled_from(GQA_RATIOS),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_contiguous_attention_matches_dense(
    batch: int, max_len: int, group: int, dtype: torch.dtype, seed: int, data: st.DataObject
) -> None:
    """The contiguous-cache baseline (same kernel, no table) is right too."""
    generator = torch.Generator().manual_seed(seed)
    num_kv_heads, head_dim = 2, 80

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(dtype).to(DEVICE)

    key = randn(batch, max_len, num_kv_heads, head_dim)
    value = randn(batch, max_len, num_kv_heads, head_dim)
    query = randn(batch, num_kv_heads * group, head_dim)
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    context_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    seqs = [Seq([], n, [(key[b, :n], value[b, :n])]) for b, n in enumerate(lens)]
    window = data.draw(st.none() | st.integers(1, max_len + 2), label="window")
    expected = dense_attention(query, seqs, scale, window)
    for backend in ("triton", "reference"):
        num_splits = data.draw(st.integers(1, 3), label="num_splits")
        actual = kernels.contiguous_decode_attention(
            query, key, value, context_lens, num_splits=num_splits, window=window,
            backend=backend,
        )  # fmt: skip
        assert_close(actual, expected, f"contiguous {backend} vs dense")


# Planted bugs: each is a one-line change to the kernel's source that the checks above must catch.
MUTANTS = {
    "table read off by one": (
        "_decode_kernel",
        "block_tables_ptr + seq * table_stride + n // BLOCK_SIZE",
        "block_tables_ptr + seq * table_stride + n // BLOCK_SIZE + 1",
    ),
    "wrong row inside a block": (
        "_decode_kernel",
        "rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE",
        "rows = block_id * BLOCK_SIZE + (n + 1) % BLOCK_SIZE",
    ),
    "query heads interleaved over KV heads": (
        "_decode_kernel",
        "heads = kv_head * group + g",
        "heads = kv_head + g * NUM_KV_HEADS",
    ),
    "split-K merge ignores each split's denominator": (
        "_decode_kernel",
        'lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))',
        'lse = tl.where(has_tokens, m, float("-inf"))',
    ),
}


@pytest.mark.parametrize("mutation", list(MUTANTS), ids=list(MUTANTS))
def test_check_catches_planted_kernel_bug(mutation: str, tmp_path: Path) -> None:
    """The oracle comparison is not vacuous: the same check fails for a broken kernel.

    Tables get one extra column holding a real block id, so the off-by-one read stays inside the
    caches (as it would not, on a GPU, in general).
    """
    mutant = load_mutant(triton_decode, *MUTANTS[mutation], tmp_path)

    def attention(query, k_cache, v_cache, tables, lens, scale, window=None) -> torch.Tensor:
        return mutant.launch(query, k_cache, v_cache, tables, lens, scale, 3, window)

    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32))
    check_attention(cache, triton_attention(num_splits=3), extra_columns=1, pad=0)
    with pytest.raises(AssertionError):
        check_attention(cache, attention, extra_columns=1, pad=0)


# ----------------------------------------------------------------------- sliding window

WINDOW_BLOCK_SIZES = (1, 2, 4, 16)  # small blocks: many of them fall wholly outside a window


def draw_window(data: st.DataObject, longest: int) -> int:
    """A window from 1 (the query alone) to past the longest context (no effect); ``longest``
    is 0 when the scenario freed every sequence, and a window is still at least 1."""
    longest = max(1, longest)
    edges = st.sampled_from([1, 2, longest, longest + 1, 10**6])
    return data.draw(edges | st.integers(1, longest), label="window")


def windowed_decode(
    cache: KVCache, window: int, backend: str, num_splits: int = 1, poison: str | None = None
) -> torch.Tensor:
    """Decode attention of a fixed seeded query over the cache's batch (with a padding row),
    optionally with the entries of blocks wholly before each window poisoned."""
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = torch.randn(
        len(seqs), cache.shape.num_heads, cache.shape.head_dim,
        generator=torch.Generator().manual_seed(7),
    ).to(cache.shape.dtype).to(DEVICE)  # fmt: skip
    k_cache, v_cache = cache.k_cache, cache.v_cache
    if poison is not None:
        starts = [window_start(int(n), 1, window) for n in lens]
        k_cache, v_cache, tables = poison_outside_window(cache, tables, starts, poison)
    splits = {"num_splits": num_splits} if backend == "triton" else {}
    return kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, window=window, backend=backend, **splits
    )


@pytest.mark.parametrize("block_size", WINDOW_BLOCK_SIZES)
@settings(max_examples=kernel_examples(10))
@given(data=st.data())
def test_windowed_attention_matches_dense(block_size: int, data: st.DataObject) -> None:
    """Triton (one pass or split-K), the reference and dense attention agree with a window."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    cache = draw_cache(data, block_size, group, 64, dtype)
    window = draw_window(data, max((seq.length for seq in cache.run.seqs), default=0))
    num_splits = data.draw(st.integers(1, 4), label="num_splits")
    check_attention(
        cache, triton_attention(num_splits), extra_columns=1, padding_row=True, window=window
    )


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("poison", ["nan", "invalid"])
@settings(max_examples=kernel_examples(8))
@given(data=st.data())
def test_blocks_outside_the_window_are_never_read(
    poison: str, backend: str, data: st.DataObject
) -> None:
    """Entries of blocks wholly before the window name a NaN block, or ``-1``: validation
    accepts them and the outputs are unchanged, bit for bit."""
    block_size = data.draw(st.sampled_from(WINDOW_BLOCK_SIZES), label="block_size")
    cache = draw_cache(data, block_size, 2, 64, torch.float32)
    longest = max((seq.length for seq in cache.run.seqs), default=1)
    window = data.draw(st.integers(1, longest), label="window")
    num_splits = data.draw(st.integers(1, 3), label="num_splits")
    clean = windowed_decode(cache, window, backend, num_splits)
    poisoned = windowed_decode(cache, window, backend, num_splits, poison)
    assert bool(torch.isfinite(clean).all())
    assert torch.equal(poisoned, clean)


def test_poisoning_reaches_blocks_a_window_excludes() -> None:
    """The poison test is not vacuous: on the fixed run, with a window of one block, entries are
    poisoned, and without the window the same poisoned call returns NaN."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    _, tables, lens = cache.batch()
    starts = [window_start(int(n), 1, 4) for n in lens]
    k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, "nan")
    assert int((poisoned != tables).sum()) >= 3
    query = cache.randn(tables.shape[0], 4, 64)
    for backend in ("triton", "reference"):
        out = kernels.paged_decode_attention(
            query, k_cache, v_cache, poisoned, lens, backend=backend
        )
        assert bool(out.isnan().any())


@pytest.mark.parametrize("backend", ["triton", "numba", "reference"])
def test_a_nan_key_reaches_the_output_at_every_split_count(backend: str) -> None:
    """A NaN in a K row that a sequence reads makes that sequence's outputs NaN, whatever the
    split count: a split whose scores are NaN must not pass for an empty one in the merge (the
    reference, one softmax over every key, is the oracle of which outputs are NaN)."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    _, tables, lens = cache.batch()
    # The shortest sequence: its keys lie in the first split, the others are empty.
    b = min(range(len(lens)), key=lambda i: int(lens[i]) if int(lens[i]) >= 2 else 10**9)
    k_cache = cache.k_cache.clone()
    k_cache[int(tables[b, 0]), 1] = torch.nan  # its position 1, every KV head
    query = cache.randn(tables.shape[0], 4, 64)
    args = (query, k_cache, cache.v_cache, tables, lens)
    expected = kernels.paged_decode_attention(*args, backend="reference").isnan()
    assert bool(expected[b].all()) and not bool(expected.all())
    for num_splits in (1, 2, 3, 4):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits, backend=backend)
        assert torch.equal(out.isnan(), expected), num_splits


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_window_is_checked(backend: str) -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 4, 64)
    args = (query, cache.k_cache, cache.v_cache, tables, lens)
    contiguous = (query, cache.k_cache[: tables.shape[0]], cache.v_cache[: tables.shape[0]])
    for bad, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="window"):
            kernels.paged_decode_attention(*args, window=bad, backend=backend)
        with pytest.raises(error, match="window"):
            kernels.contiguous_decode_attention(
                *contiguous, torch.ones_like(lens), window=bad, backend=backend
            )
    # An entry inside the window is still checked: the first sequence's last block.
    last = (int(lens[0]) - 1) // 4
    broken = tables.clone()
    broken[0, last] = -1
    with pytest.raises(IndexError, match=rf"block_tables\[0, {last}\]"):
        kernels.paged_decode_attention(*args[:3], broken, lens, window=1, backend=backend)


WINDOW_MUTANTS = {
    "window ignored": (
        "_decode_kernel",
        "first_key = tl.maximum(context_len - window, 0)",
        "first_key = context_len * 0",
    ),
    "window one token too wide": (
        "_decode_kernel",
        "first_key = tl.maximum(context_len - window, 0)",
        "first_key = tl.maximum(context_len - window - 1, 0)",
    ),
    "splits cut the capacity, not the window": (
        "_decode_kernel",
        "start = tl.minimum(first_key + split * tokens_per_split, context_len)",
        "start = tl.minimum(split * tokens_per_split, context_len)",
    ),
}


@pytest.mark.parametrize("mutation", list(WINDOW_MUTANTS), ids=list(WINDOW_MUTANTS))
def test_check_catches_planted_window_bug(mutation: str, tmp_path: Path) -> None:
    """A poisoned fixed run with a window of 5 at block size 4, three splits: the real kernel
    passes the dense check and the poison check; each mutant fails one of them."""
    mutant = load_mutant(triton_decode, *WINDOW_MUTANTS[mutation], tmp_path)
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 4, 64, torch.float32))

    def attention(query, k_cache, v_cache, tables, lens, scale, window=None) -> torch.Tensor:
        return mutant.launch(query, k_cache, v_cache, tables, lens, scale, 3, window)

    def poisoned_equal(launch: Callable[..., torch.Tensor]) -> None:
        _, tables, lens = cache.batch()
        starts = [window_start(int(n), 1, 5) for n in lens]
        k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, "nan")
        query = cache.randn(tables.shape[0], 8, 64)
        clean = launch(query, cache.k_cache, cache.v_cache, tables, lens, 0.125, window=5)
        dirty = launch(query, k_cache, v_cache, poisoned, lens, 0.125, window=5)
        assert torch.equal(dirty, clean), "poisoned blocks were read"

    def both(launch: Callable[..., torch.Tensor]) -> None:
        check_attention(cache, launch, window=5)
        poisoned_equal(launch)

    both(triton_attention(num_splits=3))
    with pytest.raises(AssertionError):
        both(attention)
