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
from properties.kernel_cases import (
    BLOCK_SIZES,
    DEVICE,
    DTYPES,
    GQA_RATIOS,
    HEAD_DIMS,
    ON_CPU,
    KVCache,
    Seq,
    Shape,
    assert_close,
    check_attention,
    check_copy_blocks,
    check_slot_mapping,
    check_store_kv,
    decode_on,
    dense_attention,
    fixed_scenario,
    kernel_examples,
    padded_tables,
    poison_outside_window,
    prefill_on,
    scenarios,
    window_start,
)

MAX_CHUNK = 64  # longest drawn prefill query chunk: the interpreter runs every query tile
ALL = ("triton", "numba", "reference")


def backends(*names: str) -> list[object]:
    """``names`` as pytest parameters; ``numba`` runs on CPU only."""
    return [pytest.param(name, marks=ON_CPU) if name == "numba" else name for name in names]


KERNELS = backends("triton", "numba")  # decode kernels, checked against the reference
EVERY = backends(*ALL)
PREFILLS = backends("triton", "numba", "sdpa")


def fill_backend(backend: str) -> str:
    """The backend that fills the caches for a check of ``backend`` (the reference for sdpa)."""
    return backend if backend in ("triton", "numba") else "reference"


def draw_cache(
    data: st.DataObject,
    backend: str,
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    group: int | None = None,
    head_dim: int | None = None,
) -> KVCache:
    """A cache filled through ``fill_backend(backend)`` by a drawn scenario; ``None``: drawn."""
    block_size = block_size or data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
    dtype = dtype or data.draw(st.sampled_from(DTYPES), label="dtype")
    group = group or data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = head_dim or data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    scenario = data.draw(scenarios(block_size), label="scenario")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    shape = Shape(block_size, num_kv_heads, group, head_dim, dtype)
    return KVCache(scenario, shape, backend=fill_backend(backend))


def longest_context(cache: KVCache) -> int:
    """The longest live sequence's length (1 when the scenario freed every sequence)."""
    return max((seq.length for seq in cache.run.seqs), default=1)


def draw_window(data: st.DataObject, cache: KVCache) -> int | None:
    """No window, or one from 1 (the query alone) to past the longest context (no effect)."""
    longest = longest_context(cache)
    edges = st.sampled_from([1, 2, cache.shape.block_size, longest, longest + 1, 10**6])
    return data.draw(st.none() | edges | st.integers(1, longest), label="window")


def draw_query_lens(
    data: st.DataObject, seqs: list[Seq | None], block_size: int, at_least_one: bool = False
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


def draw_caches(
    data: st.DataObject, seed: int, kv_heads: list[int], head_dims: list[int]
) -> tuple[torch.Tensor, torch.Generator]:
    """Seeded K and V caches ``[2, blocks, block_size, kv_heads, head_dim]`` drawn; their RNG."""
    size = data.draw(
        st.tuples(
            st.integers(1, 6), st.sampled_from(BLOCK_SIZES), st.sampled_from(kv_heads),
            st.sampled_from(head_dims),
        ), label="num_blocks, block_size, num_kv_heads, head_dim",
    )  # fmt: skip
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(2, *size, generator=generator).to(dtype).to(DEVICE), generator


@settings(max_examples=kernel_examples(100))
@given(
    block_size=st.sampled_from(BLOCK_SIZES),
    extra_columns=st.integers(0, 2),
    index_dtype=st.sampled_from([torch.int32, torch.int64]),
    data=st.data(),
)
def test_slot_mapping_matches_spec(
    block_size: int, extra_columns: int, index_dtype: torch.dtype, data: st.DataObject
) -> None:
    """Per token (a sequence id each), and one position per sequence (decode): its newest slot."""
    run = data.draw(scenarios(block_size), label="scenario").play()
    assume(run.seqs)
    tables = [seq.table for seq in run.seqs]
    # One token: a sequence and a position inside its table, or padding (-1).
    token = st.integers(0, len(tables) - 1).flatmap(
        lambda b: st.tuples(st.just(b), st.integers(-1, len(tables[b]) * block_size - 1))
    )
    tokens = data.draw(st.lists(token, min_size=1, max_size=64), label="tokens")
    newest = [translate_slot(seq.table, seq.length - 1, block_size) for seq in run.seqs]
    positions = torch.tensor([seq.length - 1 for seq in run.seqs], dtype=index_dtype, device=DEVICE)
    for backend in ALL:
        mapping = partial(
            kernels.slot_mapping, num_blocks=run.manager.total_blocks, backend=backend
        )
        check_slot_mapping(tables, tokens, block_size, mapping, extra_columns, index_dtype)
        block_tables = padded_tables(tables, extra_columns)
        slots = kernels.slot_mapping(block_tables, positions, block_size, backend=backend)
        assert slots.tolist() == newest, backend


@settings(max_examples=kernel_examples(60))
@given(strided=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_store_kv_writes_exactly_the_given_slots(
    strided: bool, seed: int, data: st.DataObject
) -> None:
    """Every backend, and ``sdpa.store`` on the tokens it is given (it takes no ``-1``)."""
    cache, generator = draw_caches(data, seed, [1, 2, 3], [*HEAD_DIMS, 8])
    _, num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    num_slots = num_blocks * block_size
    written = data.draw(
        st.lists(st.integers(0, num_slots - 1), unique=True, max_size=min(num_slots, 48)),
        label="written",
    )
    skipped = data.draw(st.integers(0, 3), label="skipped")
    slots = data.draw(st.permutations(written + [-1] * skipped), label="slots")
    # Strided token rows, as when K and V are slices of one fused projection.
    rows = torch.randn(len(slots), num_kv_heads, 2 * head_dim, generator=generator)
    rows = rows.to(cache.dtype).to(DEVICE)
    key = rows[..., ::2] if strided else rows[..., :head_dim].contiguous()
    value = rows[..., 1::2] if strided else rows[..., head_dim:]
    for backend in ALL:
        check_store_kv(cache, key, value, slots, partial(kernels.store_kv, backend=backend))
    live = [t for t, slot in enumerate(slots) if slot >= 0]
    check_store_kv(cache, key[live], value[live], [slots[t] for t in live], sdpa.store)


@settings(max_examples=kernel_examples(40))
@given(as_tensor=st.booleans(), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_copy_blocks_matches_sequential_copies(
    as_tensor: bool, seed: int, data: st.DataObject
) -> None:
    """Up to 8 pairs, chains (a block copied into is copied from later), swaps, self-copies."""
    cache, _ = draw_caches(data, seed, [1, 2], [8, 80])
    block = st.integers(0, cache.shape[1] - 1)
    pairs = data.draw(st.lists(st.tuples(block, block), max_size=8), label="pairs")
    arg = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2) if as_tensor else pairs
    for backend in ALL:
        check_copy_blocks(cache, arg, partial(kernels.copy_blocks, backend=backend))


# Every block size x dtype, and every GQA ratio x head dim; a None is drawn.
Grid = tuple[int | None, torch.dtype | None, int | None, int | None]
DECODE_GRID: list[Grid] = [
    (b, d, None, None) for b, d in itertools.product(BLOCK_SIZES, DTYPES)
] + [(None, None, g, h) for g, h in itertools.product(GQA_RATIOS, HEAD_DIMS)]


@pytest.mark.parametrize(
    "grid", DECODE_GRID, ids=lambda grid: "-".join(str(v).removeprefix("torch.") for v in grid)
)
@pytest.mark.parametrize("backend", KERNELS)
@settings(max_examples=kernel_examples(8))
@given(data=st.data())
def test_decode_matches_dense(backend: str, grid: Grid, data: st.DataObject) -> None:
    cache = draw_cache(data, backend, *grid)
    check_attention(
        cache,
        decode_on(backend, data.draw(st.none() | st.integers(1, 5), label="num_splits")),
        extra_columns=data.draw(st.integers(0, 2), label="extra_columns"),
        padding_row=data.draw(st.booleans(), label="padding_row"),
        scale=data.draw(st.none() | st.sampled_from([0.05, 1.0]), label="scale"),
        window=draw_window(data, cache),
    )


@pytest.mark.parametrize("backend", KERNELS)
@settings(max_examples=kernel_examples(25))
@given(data=st.data())
def test_split_k_matches_single_pass(backend: str, data: st.DataObject) -> None:
    cache = draw_cache(data, backend, head_dim=64)
    num_splits = data.draw(st.integers(2, 9), label="num_splits")
    _, tables, lens = cache.batch(extra_columns=data.draw(st.integers(0, 2)), padding_row=True)
    query = cache.randn(tables.shape[0], cache.shape.num_heads, cache.shape.head_dim)
    args = (query, cache.k_cache, cache.v_cache, tables, lens)
    single = decode_on(backend, num_splits=1)(*args)
    split = decode_on(backend, num_splits=num_splits)(*args)
    assert not split.isnan().any()
    assert_close(split, single, f"{num_splits} splits vs single pass")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("backend", KERNELS)
def test_fixed_run_matches_dense(backend: str, block_size: int, dtype: torch.dtype) -> None:
    """The fixed run the planted-bug tests use passes with the real kernel."""
    shape = Shape(block_size, 2, 4, 80, dtype)
    cache = KVCache(fixed_scenario(block_size), shape, backend=backend)
    check_attention(cache, decode_on(backend), extra_columns=1, padding_row=True)


@pytest.mark.parametrize("backend", EVERY)
@settings(max_examples=kernel_examples(8))
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_contiguous_decode_matches_dense(backend: str, seed: int, data: st.DataObject) -> None:
    """The contiguous-cache baseline (the same kernel without the table) is right too."""
    batch, max_len, group, head_dim, dtype = data.draw(
        st.tuples(
            st.integers(1, 3), st.integers(1, 80), st.sampled_from(GQA_RATIOS),
            st.sampled_from([64, 80]), st.sampled_from(DTYPES),
        ), label="batch, max_len, group, head_dim, dtype",
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    key, value = (
        torch.randn(2, batch, max_len, 2, head_dim, generator=generator).to(dtype).to(DEVICE)
    )
    query = torch.randn(batch, 2 * group, head_dim, generator=generator).to(dtype).to(DEVICE)
    lens = data.draw(st.lists(st.integers(0, max_len), min_size=batch, max_size=batch))
    seqs = [Seq([], n, [(key[b, :n], value[b, :n])]) for b, n in enumerate(lens)]
    window = data.draw(st.none() | st.integers(1, max_len + 2), label="window")
    actual = kernels.contiguous_decode_attention(
        query, key, value, torch.tensor(lens, dtype=torch.int32, device=DEVICE), window=window,
        num_splits=data.draw(st.none() | st.integers(1, 3), label="num_splits"), backend=backend,
    )  # fmt: skip
    expected = dense_attention(query, seqs, head_dim**-0.5, window)
    assert_close(actual, expected, f"contiguous {backend} vs dense")


@pytest.mark.parametrize("poison", ["nan", "invalid"])
@pytest.mark.parametrize("backend", EVERY)
@settings(max_examples=kernel_examples(8))
@given(data=st.data())
def test_blocks_outside_the_window_are_never_read(
    backend: str, poison: str, data: st.DataObject
) -> None:
    """Entries before the window name a NaN block, or ``-1``: accepted, outputs bit for bit."""
    block_size = data.draw(st.sampled_from([1, 2, 4, 16]), label="block_size")
    cache = draw_cache(data, backend, block_size, torch.float32, 2, 64)
    window = data.draw(st.integers(1, longest_context(cache)), label="window")
    attention = decode_on(backend, data.draw(st.none() | st.integers(1, 3), label="num_splits"))
    check_attention(cache, attention, None, 1, padding_row=True, window=window, poison=poison)


@pytest.mark.parametrize("backend", EVERY)
def test_poisoning_reaches_blocks_a_window_excludes(backend: str) -> None:
    """Not vacuous: a window of one block poisons entries, and without it the call gives NaN."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32), fill_backend(backend))
    _, tables, lens = cache.batch()
    starts = [window_start(int(n), 1, 4) for n in lens]
    k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, "nan")
    assert int((poisoned != tables).sum()) >= 3
    query = cache.randn(tables.shape[0], 4, 64)
    out = kernels.paged_decode_attention(query, k_cache, v_cache, poisoned, lens, backend=backend)
    assert bool(out.isnan().any())


@pytest.mark.parametrize("backend", EVERY)
def test_a_nan_key_reaches_the_output_at_every_split_count(backend: str) -> None:
    """A NaN split must not pass for an empty one in the merge (oracle: the reference's NaNs)."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32), fill_backend(backend))
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


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("backend", PREFILLS)
@settings(max_examples=kernel_examples(12), deadline=None)
@given(data=st.data())
def test_prefill_matches_spec_for_every_block_size(
    backend: str, block_size: int, data: st.DataObject
) -> None:
    """Chunks over cached prefixes, windows; entries before a window poisoned change nothing."""
    cache = draw_cache(data, backend, block_size)
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    query_lens = draw_query_lens(data, seqs, block_size, at_least_one=backend == "sdpa")
    extra_columns = data.draw(st.integers(0, 2), label="extra_columns")
    window = draw_window(data, cache)
    poison = None if window is None else data.draw(st.sampled_from(["nan", "invalid"]))
    check_attention(
        cache, prefill_on(backend), query_lens, extra_columns, padding_row, window=window,
        poison=poison,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("block_size", "window"), list(itertools.product([1, 4, 16], [None, 1, 6, 1000]))
)
@pytest.mark.parametrize("backend", EVERY)
def test_a_step_of_decodes_equals_decode_attention(
    backend: str, block_size: int, window: int | None
) -> None:
    """Query length 1 everywhere: the prefill function is the decode function."""
    shape = Shape(block_size, 2, 4, 64, torch.float32)
    cache = KVCache(fixed_scenario(block_size), shape, fill_backend(backend))
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = cache.randn(len(seqs), cache.shape.num_heads, cache.shape.head_dim)
    offsets = torch.arange(len(seqs) + 1, device=DEVICE)
    offsets[-1] -= 1  # the padding row (length 0) has no query
    args = (cache.k_cache, cache.v_cache, tables)
    prefill = kernels.paged_prefill_attention(
        query[:-1], *args, offsets, lens, window=window, backend=backend
    )
    decode = kernels.paged_decode_attention(query, *args, lens, window=window, backend=backend)
    assert_close(prefill, decode[:-1], f"{backend} prefill vs decode")


@pytest.mark.parametrize("backend", EVERY)
def test_empty_batches_give_empty_outputs(backend: str) -> None:
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32), fill_backend(backend))
    query = cache.randn(0, 4, 64)
    for batch in (0, 2):  # no sequences; sequences with no queries
        out = kernels.paged_prefill_attention(
            query, cache.k_cache, cache.v_cache,
            torch.zeros(batch, 3, dtype=torch.int32, device=DEVICE),
            torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE),
            torch.zeros(batch, dtype=torch.int32, device=DEVICE), backend=backend,
        )  # fmt: skip
        assert out.shape == (0, 4, 64)
    empty = kernels.paged_decode_attention(
        query, cache.k_cache, cache.v_cache, torch.zeros(0, 3, dtype=torch.int32, device=DEVICE),
        torch.zeros(0, dtype=torch.int32, device=DEVICE), backend=backend,
    )  # fmt: skip
    assert empty.shape == (0, 4, 64)
