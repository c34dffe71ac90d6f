"""Properties: the numba backend computes what the spec, the torch reference and dense attention do.

The same checks as the Triton kernels' (``properties.kernel_cases``, ``check_prefill``): caches
filled by spec runs through the numba ``store_kv`` and ``copy_blocks`` (shuffled ids, forks,
copy-on-write, frees and reuse), then decode attention (every block size, GQA ratio, head dim,
split count and sliding window), its contiguous variant, and varlen prefill / mixed steps, each
against dense attention and the reference. Blocks wholly before a window are poisoned and must
change nothing. fp32 runs the numba kernels; fp16 and bf16 attention on this backend runs the
reference, which one case checks too. Slot mapping, ``store_kv``, ``copy_blocks`` and argument
validation on the numba backend are in ``test_kernels_slots``, ``test_kernels_copy`` and
``test_kernels_validation``.

Planted bugs, one-line changes to ``kernels/numba_attention.py`` and ``kernels/numba_cache.py``,
must each be caught by the same checks. A mutant is a module of its own, which numba compiles
(about 10 s each); it is written to ``MUTANT_DIR``, kept between runs, so that later runs load
its compiled kernels from numba's cache, as they do the real kernels' (``numba_runtime``).
"""

from __future__ import annotations

import itertools
import tempfile
from pathlib import Path
from types import ModuleType

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import numba_attention, numba_cache, numba_runtime
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
    check_attention,
    dense_attention,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    poison_outside_window,
    scenarios,
    window_start,
)
from properties.test_kernels_copy import check_copy_blocks
from properties.test_kernels_prefill import (
    MUTANT_QUERY_LENS,
    WINDOW_QUERY_LENS,
    check_prefill,
    draw_query_lens,
)
from properties.test_kernels_slots import check_slot_mapping, check_store_kv

pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the numba backend runs on CPU")
MUTANT_DIR = Path(tempfile.gettempdir()) / "pagedkv-numba-mutants"


def mutant_of(module: ModuleType, within: str, old: str, new: str) -> ModuleType:
    """``load_mutant`` into ``MUTANT_DIR``."""
    MUTANT_DIR.mkdir(exist_ok=True)
    return load_mutant(module, within, old, new, MUTANT_DIR)


def numba_decode(num_splits: int | None = None):
    """The public decode function on the numba backend, with ``num_splits`` fixed."""

    def attention(*args: torch.Tensor | float, window: int | None = None) -> torch.Tensor:
        return kernels.paged_decode_attention(
            *args, num_splits=num_splits, window=window, backend="numba"
        )

    return attention


def numba_prefill(*args: torch.Tensor | float, window: int | None = None) -> torch.Tensor:
    """The public prefill function on the numba backend."""
    return kernels.paged_prefill_attention(*args, window=window, backend="numba")


def numba_cache_of(scenario, shape: Shape) -> KVCache:
    """A cache filled through the numba ``store_kv`` and ``copy_blocks``."""
    return KVCache(scenario, shape, backend="numba")


def draw_numba_cache(data: st.DataObject, block_size: int) -> KVCache:
    """An fp32 cache filled through numba by a drawn scenario: drawn GQA ratio, head dim and
    one or two KV heads."""
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    scenario = data.draw(scenarios(block_size), label="scenario")
    return numba_cache_of(scenario, Shape(block_size, num_kv_heads, group, head_dim, torch.float32))


def draw_window(data: st.DataObject, cache: KVCache) -> int | None:
    """No window, or one from 1 to past the longest context."""
    longest = max((seq.length for seq in cache.run.seqs), default=1)
    edges = st.sampled_from([1, 2, longest, longest + 1])
    return data.draw(st.none() | edges | st.integers(1, max(1, longest)), label="window")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@settings(max_examples=kernel_examples(10))
@given(data=st.data())
def test_decode_matches_dense_for_every_block_size(block_size: int, data: st.DataObject) -> None:
    cache = draw_numba_cache(data, block_size)
    num_splits = data.draw(st.none() | st.integers(1, 5), label="num_splits")
    check_attention(
        cache,
        numba_decode(num_splits),
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        padding_row=data.draw(st.booleans(), label="padding_row"),
        window=draw_window(data, cache),
    )


@pytest.mark.parametrize(("group", "head_dim"), list(itertools.product(GQA_RATIOS, HEAD_DIMS)))
def test_decode_matches_dense_for_every_gqa_ratio_and_head_dim(group: int, head_dim: int) -> None:
    cache = numba_cache_of(fixed_scenario(8), Shape(8, 2, group, head_dim, torch.float32))
    check_attention(cache, numba_decode(), extra_columns=1, padding_row=True)
    check_attention(cache, numba_decode(3), window=9)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_runs_on_the_numba_backend(dtype: torch.dtype) -> None:
    """fp32 in the kernels; fp16 and bf16 through the reference (caches written by numba)."""
    cache = numba_cache_of(fixed_scenario(16), Shape(16, 2, 4, 80, dtype))
    check_attention(cache, numba_decode(), extra_columns=1, padding_row=True)
    seqs, _, _ = cache.batch()
    check_prefill(cache, [seq.length for seq in seqs if seq], numba_prefill)


@pytest.mark.parametrize("poison", ["nan", "invalid"])
@settings(max_examples=kernel_examples(10))
@given(data=st.data())
def test_blocks_outside_the_window_are_never_read(poison: str, data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    cache = numba_cache_of(
        data.draw(scenarios(block_size), label="scenario"),
        Shape(block_size, 2, 2, 64, torch.float32),
    )
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    longest = max((seq.length for seq in cache.run.seqs), default=1)
    window = data.draw(st.integers(1, longest), label="window")
    query = cache.randn(len(seqs), 4, 64)
    starts = [window_start(int(n), 1, window) for n in lens]
    k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, poison)
    attention = numba_decode(data.draw(st.none() | st.integers(1, 3), label="num_splits"))
    clean = attention(query, cache.k_cache, cache.v_cache, tables, lens, window=window)
    dirty = attention(query, k_cache, v_cache, poisoned, lens, window=window)
    assert bool(torch.isfinite(clean).all())
    assert torch.equal(dirty, clean)


@settings(max_examples=kernel_examples(10))
@given(
    batch=st.integers(1, 3),
    max_len=st.integers(1, 80),
    group=st.sampled_from(GQA_RATIOS),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_contiguous_decode_matches_dense(
    batch: int, max_len: int, group: int, seed: int, data: st.DataObject
) -> None:
    """The kernel compiled without the table lookup (the benchmark's baseline) is right too."""
    generator = torch.Generator().manual_seed(seed)
    key, value = (torch.randn(batch, max_len, 2, 64, generator=generator) for _ in "kv")
    query = torch.randn(batch, 2 * group, 64, generator=generator)
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    seqs = [Seq([], n, [(key[b, :n], value[b, :n])]) for b, n in enumerate(lens)]
    window = data.draw(st.none() | st.integers(1, max_len + 2), label="window")
    actual = kernels.contiguous_decode_attention(
        query, key, value, torch.tensor(lens), window=window, backend="numba",
        num_splits=data.draw(st.none() | st.integers(1, 3), label="num_splits"),
    )  # fmt: skip
    assert_close(actual, dense_attention(query, seqs, 64**-0.5, window), "contiguous vs dense")


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@settings(max_examples=kernel_examples(10))
@given(data=st.data())
def test_prefill_matches_spec_for_every_block_size(block_size: int, data: st.DataObject) -> None:
    """Chunks over cached prefixes (0 to the whole sequence), windows, poisoned blocks."""
    cache = draw_numba_cache(data, block_size)
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    query_lens = draw_query_lens(data, seqs, block_size)
    window = draw_window(data, cache)
    poison = None if window is None else data.draw(st.sampled_from(["nan", "invalid"]))
    check_prefill(cache, query_lens, numba_prefill, 1, padding_row, window=window, poison=poison)


@pytest.mark.parametrize("window", [None, 1, 6])
@pytest.mark.parametrize("block_size", [1, 16])
def test_a_step_of_decodes_equals_decode_attention(block_size: int, window: int | None) -> None:
    cache = numba_cache_of(fixed_scenario(block_size), Shape(block_size, 2, 4, 64, torch.float32))
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = cache.randn(len(seqs), 8, 64)
    offsets = torch.arange(len(seqs) + 1)
    offsets[-1] -= 1  # the padding row (length 0) has no query
    args = (cache.k_cache, cache.v_cache, tables)
    prefill = numba_prefill(query[:-1], *args, offsets, lens, 0.125, window=window)
    decode = numba_decode()(query, *args, lens, 0.125, window=window)
    assert_close(prefill, decode[:-1], "numba prefill vs decode")


def test_empty_batches_give_empty_outputs() -> None:
    cache = numba_cache_of(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    for batch in (0, 2):  # no sequences; sequences with no queries
        out = numba_prefill(
            cache.randn(0, 4, 64), cache.k_cache, cache.v_cache,
            torch.zeros(batch, 3, dtype=torch.int32), torch.zeros(batch + 1, dtype=torch.int32),
            torch.zeros(batch, dtype=torch.int32), 0.125,
        )  # fmt: skip
        assert out.shape == (0, 4, 64)
    empty = numba_decode()(
        cache.randn(0, 4, 64), cache.k_cache, cache.v_cache,
        torch.zeros(0, 3, dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
    )  # fmt: skip
    assert empty.shape == (0, 4, 64)


def test_splits_follow_the_threads_and_the_length() -> None:
    """One split once the batch gives every thread a program; else enough for the threads, each
    at least ``MIN_TOKENS_PER_SPLIT`` long."""
    choose = numba_attention.choose_num_splits
    assert choose(programs=64, max_tokens=4096, threads=16) == 1
    assert choose(programs=2, max_tokens=4096, threads=16) == 8
    assert choose(programs=2, max_tokens=300, threads=16) == 1
    assert choose(programs=1, max_tokens=10**9, threads=1000) == 64


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba's pool has one thread")
@pytest.mark.parametrize("block_size", [1, 16])
def test_the_parallel_drivers_equal_the_serial_ones(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every call here is below ``PARALLEL_MIN_BYTES``, so the tests above run the serial
    drivers; with the threshold at 0 and two threads the pool runs the same programs, and the
    outputs are the same, bit for bit (splits chosen by the thread count included)."""
    cache = numba_cache_of(fixed_scenario(block_size), Shape(block_size, 2, 4, 64, torch.float32))
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = cache.randn(len(seqs), 8, 64)
    query_lens = [seq.length if seq else 0 for seq in seqs]
    flat = cache.randn(sum(query_lens), 8, 64)
    offsets = torch.tensor([0, *query_lens]).cumsum(0)
    args = (cache.k_cache, cache.v_cache, tables)

    def both() -> tuple[torch.Tensor, ...]:
        return (
            numba_decode(2)(query, *args, lens, 0.125, window=5),
            numba_decode()(query, *args, lens, 0.125),
            numba_prefill(flat, *args, offsets, lens, 0.125, window=7),
        )

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        serial = both()
        monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_BYTES", 0)
        parallel = both()
        check_attention(cache, numba_decode(), extra_columns=1, padding_row=True)
        check_prefill(cache, query_lens[:-1], numba_prefill)
    finally:
        torch.set_num_threads(threads)
    for one, other in zip(serial, parallel, strict=True):
        assert torch.equal(one, other)


# ----------------------------------------------------------------------- planted bugs

DECODE_MUTANTS = {
    "table read off by one": (
        "_rows_of",
        "base = np.int64(tables[b, column]) * block_size",
        "base = np.int64(tables[b, column + 1]) * block_size",
    ),
    "wrong row inside a block": (
        "_rows_of",
        "rows[n - start + t] = base + row + t",
        "rows[n - start + t] = base + (row + t + 1) % block_size",
    ),
    "query heads interleaved over KV heads": (
        "_decode_program",
        "q[g, d] = query[b, h0 + g, d] * scale",
        "q[g, d] = query[b, kv_head + g * num_kv_heads, d] * scale",
    ),
    "split-K merge ignores each split's denominator": (
        "_attend",
        "lse[r] = m + np.log(total) if total != 0 else -np.inf",
        "lse[r] = m if total != 0 else -np.inf",
    ),
    "keys walked from 0 and masked": (
        "_decode_program",
        "first = max(length - window, 0)",
        "first = 0",
    ),
    "splits cut the capacity, not the window": (
        "_decode_program",
        "start = min(first + split * split_len, length)",
        "start = min(split * split_len, length)",
    ),
}
PREFILL_MUTANTS = {
    "window one token too wide": (
        "_attend",
        "lo = max(positions[r] - window + 1, start) - start",
        "lo = max(positions[r] - window, start) - start",
    ),
    "causal mask lets a query see the next token": (
        "_attend",
        "hi = min(positions[r] + 1, end) - start",
        "hi = min(positions[r] + 2, end) - start",
    ),
    "chunk positions ignore the cached prefix": (
        "_prefill_program",
        "first = lens[b] - (cu_seqlens[b + 1] - cu_seqlens[b])",
        "first = lens[b] * 0",
    ),
    "prefill keys walked from 0 and masked": (
        "_prefill_program",
        "start = max(first + lo - window + 1, 0)",
        "start = 0",
    ),
}


@pytest.mark.parametrize("mutation", list(DECODE_MUTANTS), ids=list(DECODE_MUTANTS))
def test_check_catches_planted_decode_bug(mutation: str) -> None:
    """Block size 4, a window of 5 and three splits, with the entries before each window
    poisoned; tables get one extra column holding a real block (``pad=0``), so an off-by-one
    read stays inside the caches. The real kernel passes; each mutant fails."""
    mutant = mutant_of(numba_attention, *DECODE_MUTANTS[mutation])
    cache = numba_cache_of(fixed_scenario(4), Shape(4, 2, 4, 64, torch.float32))

    def check(decode) -> None:
        check_attention(cache, decode, extra_columns=1, pad=0)
        check_attention(cache, decode, extra_columns=1, pad=0, window=5)
        _, tables, lens = cache.batch(extra_columns=1, pad=0)
        starts = [window_start(int(n), 1, 5) for n in lens]
        k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, "nan")
        query = cache.randn(tables.shape[0], 8, 64)
        clean = decode(query, cache.k_cache, cache.v_cache, tables, lens, 0.125, window=5)
        assert torch.equal(decode(query, k_cache, v_cache, poisoned, lens, 0.125, window=5), clean)

    def broken(query, k_cache, v_cache, tables, lens, scale, window=None) -> torch.Tensor:
        return mutant.decode(query, k_cache, v_cache, tables, lens, scale, 3, window)

    check(numba_decode(3))
    with pytest.raises(AssertionError):
        check(broken)


@pytest.mark.parametrize("mutation", list(PREFILL_MUTANTS), ids=list(PREFILL_MUTANTS))
def test_check_catches_planted_prefill_bug(mutation: str) -> None:
    """Chunks over cached prefixes at block size 16, then with a window of 4 at block size 4
    and the blocks before it poisoned: the real kernel passes, each mutant fails."""
    mutant = mutant_of(numba_attention, *PREFILL_MUTANTS[mutation])
    chunked = numba_cache_of(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32))
    windowed = numba_cache_of(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))

    def check(prefill) -> None:
        check_prefill(chunked, MUTANT_QUERY_LENS, prefill, extra_columns=1, pad=0)
        check_prefill(windowed, WINDOW_QUERY_LENS, prefill, window=4, poison="nan")

    check(numba_prefill)
    with pytest.raises(AssertionError):
        check(mutant.prefill)


def test_check_catches_slot_mapping_that_ignores_the_table() -> None:
    mutant = mutant_of(
        numba_cache,
        "_slot_mapping",
        "out[t] = block_id * block_size + pos % block_size",
        "out[t] = pos + 0 * block_id",
    )
    tables = [seq.table for seq in fixed_scenario(4).play().seqs]
    tokens = [(b, p) for b, table in enumerate(tables) for p in range(len(table) * 4)]

    def mapping(block_tables, positions, block_size, seq_ids) -> torch.Tensor:
        return mutant.slot_mapping(block_tables, positions, seq_ids, block_size)

    check_slot_mapping(tables, tokens, 4, lambda *a: kernels.slot_mapping(*a, backend="numba"))
    with pytest.raises(AssertionError):
        check_slot_mapping(tables, tokens, 4, mapping)


def test_check_catches_store_kv_that_skips_slot_zero() -> None:
    mutant = mutant_of(numba_cache, "_store_rows", "edit:0->1:if slot >= 0:", "")
    cache = torch.zeros(2, 3, 4, 2, 80)
    key = torch.randn(4, 2, 80)
    slots = [5, 0, -1, 11]
    check_store_kv(cache, key, -key, slots, lambda *a: kernels.store_kv(*a, backend="numba"))
    with pytest.raises(AssertionError):
        check_store_kv(cache, key, -key, slots, mutant.store_kv)


def test_check_catches_copy_that_reads_the_wrong_block() -> None:
    mutant = mutant_of(
        numba_cache,
        "_copy_blocks",
        "src, dst = pairs[i, 0], pairs[i, 1]",
        "src, dst = pairs[i, 1], pairs[i, 1]",
    )
    cache = torch.randn(2, 4, 16, 2, 80)
    pairs = [(0, 1), (2, 3)]
    check_copy_blocks(cache, pairs, lambda k, v, p: kernels.copy_blocks(k, v, p, backend="numba"))
    with pytest.raises(AssertionError):
        check_copy_blocks(cache, pairs, mutant.copy_blocks)


@numba.njit(fastmath=numba_runtime.FASTMATH)  # the kernels' flags, which exp32 must withstand
def _exp32_all(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = numba_runtime.exp32(values[i])
    return out


@numba.njit
def _sum_in_order_of(values: np.ndarray) -> np.float32:
    return numba_runtime.sum_in_order(values)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-100.0, 88.0, width=32), min_size=1, max_size=64))
def test_exp32_is_exp_within_its_bound(xs: list[float]) -> None:
    """The softmax's exp: within 1.5e-7 relative of float64's exp from fp32's smallest normal
    up to 88, exactly 0 below it."""
    values = np.array(xs, dtype=np.float32)
    got = _exp32_all(values).astype(np.float64)
    want = np.exp(values.astype(np.float64))
    normal = values >= numba_runtime.EXP_MIN
    assert np.all(np.abs(got[normal] - want[normal]) <= 1.5e-7 * want[normal])
    assert np.all(got[~normal] == 0.0)


def test_exp32_special_values() -> None:
    """1 at 0, 0 at -inf, NaN at NaN (a poisoned score must reach the output)."""
    got = _exp32_all(np.array([0.0, -np.inf, np.nan], dtype=np.float32))
    assert got[0] == 1.0 and got[1] == 0.0 and np.isnan(got[2])


@given(st.lists(st.floats(-1e3, 1e3, width=32), max_size=40))
def test_sum_in_order_adds_left_to_right(xs: list[float]) -> None:
    """Bit for bit the fp32 sum added in index order (what keeps the drivers' outputs equal)."""
    values = np.array(xs, dtype=np.float32)
    expected = np.float32(0.0)
    for value in values:
        expected = np.float32(expected + value)
    assert _sum_in_order_of(values) == expected
