"""Properties: every backend it applies to (Triton, numba on CPU, the reference, ``sdpa``) computes
what the spec, the torch reference and dense attention do, on caches it filled from spec runs."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import sdpa
from pagedkv.spec.block_manager import translate_slot
from properties import kernel_cases as kc

MAX_CHUNK = 64  # longest drawn prefill query chunk: the interpreter runs every query tile
ALL = ("triton", "numba", "reference")


def backends(*names: str) -> list[object]:
    """``names`` as pytest parameters; ``numba`` runs on CPU only."""
    return [pytest.param(name, marks=kc.ON_CPU) if name == "numba" else name for name in names]


KERNELS = backends("triton", "numba")  # decode kernels, checked against the reference
EVERY = backends(*ALL)
PREFILLS = backends("triton", "numba", "sdpa")


def draw_window(data: st.DataObject, cache: kc.KVCache) -> int | None:
    """No window, or one from 1 (the query alone) to past the longest context (no effect)."""
    longest = max((seq.length for seq in cache.run.seqs), default=1)
    edges = st.sampled_from([1, 2, cache.shape.block_size, longest, longest + 1, 10**6])
    return data.draw(st.none() | edges | st.integers(1, longest), label="window")


def draw_query_lens(
    data: st.DataObject, seqs: list[kc.Seq | None], block_size: int, at_least_one: bool = False
) -> list[int]:
    """A chunk length per sequence, edges likely; ``at_least_one`` (``sdpa.plan``'s contract)."""
    counts = []
    for seq in seqs:
        length = 0 if seq is None else seq.length
        cap = min(length, MAX_CHUNK)
        edges = sorted({n for n in (0, 1, block_size, block_size + 1, length) if n <= cap})
        counts.append(data.draw(st.sampled_from(edges) | st.integers(0, cap), label="query_len"))
    if at_least_one and not any(counts):
        assume(seqs and seqs[0] is not None)
        counts[0] = 1
    return counts


@settings(max_examples=kc.kernel_examples(100))
@given(
    block_size=st.sampled_from(kc.BLOCK_SIZES),
    extra_columns=st.integers(0, 2),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_slot_mapping_matches_spec(
    block_size: int, extra_columns: int, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    """Per token (a sequence id each), and one position per sequence (decode): its newest slot."""
    run = data.draw(kc.scenarios(block_size), label="scenario").play()
    assume(run.seqs)
    tables = [seq.table for seq in run.seqs]
    # One token: a sequence and a position inside its table, or padding (-1).
    token = st.integers(0, len(tables) - 1).flatmap(
        lambda b: st.tuples(st.just(b), st.integers(-1, len(tables[b]) * block_size - 1))
    )
    tokens = data.draw(st.lists(token, min_size=1, max_size=64), label="tokens")
    newest = [translate_slot(seq.table, seq.length - 1, block_size) for seq in run.seqs]
    positions = torch.tensor([s.length - 1 for s in run.seqs], dtype=index_dtype, device=kc.DEVICE)
    for backend in ALL:
        mapping = partial(
            kernels.slot_mapping, num_blocks=run.manager.total_blocks, backend=backend
        )
        kc.check_slot_mapping(tables, tokens, block_size, mapping, extra_columns, index_dtype)
        block_tables = kc.padded_tables(tables, extra_columns)
        slots = kernels.slot_mapping(block_tables, positions, block_size, backend=backend)
        assert slots.tolist() == newest, backend


@settings(max_examples=kc.kernel_examples(60))
@given(
    strided=st.booleans(), as_tensor=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data()
)
def test_store_kv_and_copy_blocks_write_what_they_must(
    strided: bool, as_tensor: bool, seed: int, data: st.DataObject
) -> None:
    """A store writes exactly its slots (``sdpa.store`` too, given only the tokens it writes); a
    copy of up to 8 pairs (chains, swaps, self-copies) equals the sequential loop."""
    size = data.draw(
        st.tuples(
            st.integers(1, 6), st.sampled_from(kc.BLOCK_SIZES), st.sampled_from([1, 2, 3]),
            st.sampled_from([*kc.HEAD_DIMS, 8]),
        ), label="num_blocks, block_size, num_kv_heads, head_dim",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    dtype = data.draw(st.sampled_from(kc.DTYPES), label="dtype")
    cache = torch.randn(2, *size, generator=generator).to(dtype).to(kc.DEVICE)
    num_blocks, block_size, num_kv_heads, head_dim = size
    num_slots = num_blocks * block_size
    written = data.draw(
        st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_slots, 48)),
        label="written",
    )
    skipped = data.draw(st.integers(0, 3), label="skipped")
    slots = data.draw(st.permutations(written + [-1] * skipped), label="slots")
    # Strided token rows, as when K and V are slices of one fused projection.
    rows = torch.randn(len(slots), num_kv_heads, 2 * head_dim, generator=generator)
    rows = rows.to(cache.dtype).to(kc.DEVICE)
    key = rows[..., ::2] if strided else rows[..., :head_dim].contiguous()
    value = rows[..., 1::2] if strided else rows[..., head_dim:]
    block = st.integers(0, num_blocks - 1)
    pairs = data.draw(st.lists(st.tuples(block, block), max_size=8), label="pairs")
    arg = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2) if as_tensor else pairs
    for backend in ALL:
        kc.check_store_kv(cache, key, value, slots, partial(kernels.store_kv, backend=backend))
        kc.check_copy_blocks(cache, arg, partial(kernels.copy_blocks, backend=backend))
    live = [t for t, slot in enumerate(slots) if slot >= 0]
    kc.check_store_kv(cache, key[live], value[live], [slots[t] for t in live], sdpa.store)


# Every block size x dtype, and every GQA ratio x head dim; a None is drawn.
Grid = tuple[int | None, torch.dtype | None, int | None, int | None]
DECODE_GRID: list[Grid] = [
    (b, d, None, None) for b, d in itertools.product(kc.BLOCK_SIZES, kc.DTYPES)
] + [(None, None, g, h) for g, h in itertools.product(kc.GQA_RATIOS, kc.HEAD_DIMS)]


@pytest.mark.parametrize(
    "grid", DECODE_GRID, ids=lambda grid: "-".join(str(v).removeprefix("torch.") for v in grid)
)
@pytest.mark.parametrize("backend", KERNELS)
@settings(max_examples=kc.kernel_examples(8))
@given(data=st.data())
def test_decode_matches_dense(backend: str, grid: Grid, data: st.DataObject) -> None:
    """Split counts up to 9; entries before a window poisoned change no output bit."""
    cache = kc.draw_cache(data, backend, *grid)
    window = draw_window(data, cache)
    poison = None if window is None else data.draw(st.sampled_from([None, "nan", "invalid"]))
    kc.check_attention(
        cache,
        kc.decode_on(backend, data.draw(st.none() | st.integers(1, 9), label="num_splits")),
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        padding_row=data.draw(st.booleans(), label="padding_row"),
        scale=data.draw(st.none() | st.sampled_from([0.05, 1.0]), label="scale"),
        window=window,
        poison=poison,
    )


@pytest.mark.parametrize("backend", EVERY)
@settings(max_examples=kc.kernel_examples(8))
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_contiguous_decode_matches_dense(backend: str, seed: int, data: st.DataObject) -> None:
    """The contiguous-cache baseline (the same kernel without the table) is right too."""
    batch, max_len, group, head_dim, dtype = data.draw(
        st.tuples(
            st.integers(1, 3), st.integers(1, 80), st.sampled_from(kc.GQA_RATIOS),
            st.sampled_from([64, 80]), st.sampled_from(kc.DTYPES),
        ), label="batch, max_len, group, head_dim, dtype",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    key, value = (
        torch.randn(2, batch, max_len, 2, head_dim, generator=generator).to(dtype).to(kc.DEVICE)
    )
    query = torch.randn(batch, 2 * group, head_dim, generator=generator).to(dtype).to(kc.DEVICE)
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    seqs = [kc.Seq([], n, [(key[b, :n], value[b, :n])]) for b, n in enumerate(lens)]
    window = data.draw(st.none() | st.integers(1, max_len + 2), label="window")
    actual = kernels.contiguous_decode_attention(
        query, key, value, torch.tensor(lens, dtype=torch.int32, device=kc.DEVICE), window=window,
        num_splits=data.draw(st.none() | st.integers(1, 3), label="num_splits"), backend=backend,
    )  # fmt: skip
    expected = kc.dense_attention(query, seqs, head_dim**-0.5, window)
    kc.assert_close(actual, expected, f"contiguous {backend} vs dense")


@pytest.mark.parametrize("backend", EVERY)
def test_poisoning_reaches_blocks_a_window_excludes(backend: str) -> None:
    """Not vacuous: a window of one block poisons entries, and without it the call gives NaN."""
    cache = kc.KVCache(
        kc.fixed_scenario(4), kc.Shape(4, 2, 2, 64, torch.float32), kc.fill_backend(backend)
    )
    _, tables, lens = cache.batch()
    starts = [max(0, int(n) - 4) for n in lens]  # window 4, one query
    k_cache, v_cache, poisoned = kc.poison_outside_window(cache, tables, starts, "nan")
    assert int((poisoned != tables).sum()) >= 3
    query = cache.randn(tables.shape[0], 4, 64)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, poisoned, lens, backend=backend)
    assert bool(out.isnan().any())


@pytest.mark.parametrize("backend", EVERY)
def test_a_nan_key_reaches_the_output_at_every_split_count(backend: str) -> None:
    """A NaN split must not pass for an empty one in the merge (oracle: the reference's NaNs)."""
    cache = kc.KVCache(
        kc.fixed_scenario(4), kc.Shape(4, 2, 2, 64, torch.float32), kc.fill_backend(backend)
    )
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


@pytest.mark.parametrize("block_size", kc.BLOCK_SIZES)
@pytest.mark.parametrize("backend", PREFILLS)
@settings(max_examples=kc.kernel_examples(12), deadline=None)
@given(data=st.data())
def test_prefill_matches_spec_for_every_block_size(
    backend: str, block_size: int, data: st.DataObject
) -> None:
    """Chunks over cached prefixes, windows; entries before a window poisoned change nothing."""
    cache = kc.draw_cache(data, backend, block_size)
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    query_lens = draw_query_lens(data, seqs, block_size, at_least_one=backend == "sdpa")
    extra_columns = data.draw(st.integers(0, 2), label="extra_columns")
    window = draw_window(data, cache)
    poison = None if window is None else data.draw(st.sampled_from(["nan", "invalid"]))
    kc.check_attention(
        cache, kc.prefill_on(backend), query_lens, extra_columns, padding_row, window=window,
        poison=poison,
    )  # fmt: skip


@pytest.mark.parametrize("backend", EVERY)
def test_empty_batches_give_empty_outputs(backend: str) -> None:
    k_cache, v_cache = torch.zeros(2, 3, 4, 2, 64, device=kc.DEVICE)
    query = torch.zeros(0, 4, 64, device=kc.DEVICE)
    ints = partial(torch.zeros, dtype=torch.int32, device=kc.DEVICE)
    for batch in (0, 2):  # no sequences; sequences with no queries
        out = kernels.paged_prefill_attention(
            query, k_cache, v_cache, ints(batch, 3), ints(batch + 1), ints(batch), backend=backend
        )
        assert out.shape == (0, 4, 64)
    out = kernels.paged_decode_attention(
        query, k_cache, v_cache, ints(0, 3), ints(0), backend=backend
    )
    assert out.shape == (0, 4, 64)
