"""Properties: every backend it applies to (Triton, numba on CPU, the reference, ``sdpa``) computes
what the spec, the torch reference and dense attention do, on caches it filled from spec runs;
fp8 caches store the spec's codes and are read as code value times scale."""

from __future__ import annotations

import itertools
from functools import partial

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import sdpa
from pagedkv.spec import fp8 as spec_fp8
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
def test_a_nan_key_reaches_the_output_at_every_split_count(backend: str) -> None:
    """A NaN split must not pass for an empty one in the merge (oracle: the reference's NaNs); and
    poisoning is not vacuous: a window of one block poisons entries, read without it they give
    NaN."""
    cache = kc.fixed_cache(4, 2, 64, backend=kc.fill_backend(backend))
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 4, 64)
    starts = [max(0, int(n) - 4) for n in lens]  # window 4, one query
    k_cache, v_cache, poisoned = kc.poison_outside_window(cache, tables, starts, "nan")
    assert int((poisoned != tables).sum()) >= 3
    out = kernels.paged_decode_attention(query, k_cache, v_cache, poisoned, lens, backend=backend)
    assert bool(out.isnan().any())
    # The shortest sequence: its keys lie in the first split, the others are empty.
    b = min(range(len(lens)), key=lambda i: int(lens[i]) if int(lens[i]) >= 2 else 10**9)
    k_cache = cache.k_cache.clone()
    k_cache[int(tables[b, 0]), 1] = torch.nan  # its position 1, every KV head
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


# fp8 caches: a store writes ``spec.fp8.quantize``'s code bit for bit, attention reads code value
# times scale, a copy moves bytes (their refusals: test_kernels_validation). Every backend runs on
# CPU tensors (numba too, on a GPU machine); Triton on the device where there is one.
FP32 = st.floats(width=32, allow_nan=True)
SCALE_VALUES = st.floats(2.0**-20, 2.0**20, width=32)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(list(kc.FP8)),
    row_dtype=st.sampled_from(kc.DTYPES),
    backend=st.sampled_from(ALL),
)
def test_an_fp8_store_writes_the_spec_code_bit_for_bit(
    data: st.DataObject, dtype: torch.dtype, row_dtype: torch.dtype, backend: str
) -> None:
    """Any fp32 values (subnormals, infinities, NaN of either sign, past the largest), per-head
    scales; skipped slots keep their NaN bytes."""
    key, value = (
        torch.tensor(data.draw(st.lists(FP32, min_size=12, max_size=12))).view(3, 2, 2)
        .to(row_dtype)
        for _ in range(2)
    )  # fmt: skip
    k_scales, v_scales = (
        data.draw(st.lists(SCALE_VALUES, min_size=2, max_size=2)) for _ in range(2)
    )
    k_cache, v_cache = (torch.full((2, 4, 2, 2), 0x7F, dtype=torch.uint8).view(dtype) for _ in "kv")
    kernels.store_kv(
        key, value, k_cache, v_cache, torch.tensor([5, -1, 0]), backend=backend,
        k_scale=torch.tensor(k_scales).repeat_interleave(2)[::2],  # strided: read as values
        v_scale=torch.tensor(v_scales),
    )  # fmt: skip
    for cache, rows, scales in ((k_cache, key, k_scales), (v_cache, value, v_scales)):
        stored = cache.view(torch.uint8).view(8, 2, 2)
        codes = kc.expected_codes(rows, scales, kc.FP8[dtype])
        assert torch.equal(stored[[5, 0]], codes[[0, 2]]), backend
        assert (stored[[1, 2, 3, 4, 6, 7]] == 0x7F).all()


def test_every_fp8_code_is_read_as_its_value_and_copied_as_its_byte() -> None:
    """All 256 codes of both formats as V: attention over one key (of value 0) reads each as
    its value times the scale, infinities and NaNs included; a copy moves each byte."""
    for dtype, name in kc.FP8.items():
        fmt = spec_fp8.fp8_format(name)
        v_cache = torch.arange(256, dtype=torch.uint8).view(dtype).view(256, 1, 1, 1)
        k_cache = torch.zeros(256, 1, 1, 1, dtype=torch.uint8).view(dtype)
        values = torch.tensor([spec_fp8.decode(code, fmt) * 2.0 for code in range(256)])
        for backend in ALL:
            out = kernels.paged_decode_attention(
                torch.zeros(256, 1, 1), k_cache, v_cache,
                torch.arange(256, dtype=torch.int32)[:, None], torch.ones(256, dtype=torch.int32),
                v_scale=2.0, backend=backend,
            ).flatten()  # fmt: skip
            assert torch.equal(out.isnan(), values.isnan()), (name, backend)
            finite = ~values.isnan()
            assert torch.equal(out[finite], values[finite]), (name, backend)
            copied = v_cache.clone(), k_cache.clone()
            kernels.copy_blocks(*copied, [(3, 7), (255, 0)], backend=backend)
            assert copied[0].view(torch.uint8).flatten()[[7, 0]].tolist() == [3, 255]


@pytest.mark.parametrize("dtype", list(kc.FP8), ids=str)
@pytest.mark.parametrize("query_dtype", kc.DTYPES, ids=str)
@pytest.mark.parametrize("backend", ALL)
def test_fp8_attention_reads_code_value_times_scale(
    dtype: torch.dtype, query_dtype: torch.dtype, backend: str
) -> None:
    """Decode (one split and three, a window of 5), its contiguous twin, and prefill (chunks
    over cached prefixes) equal the reference over the fp32 cache of the same values, within the
    query dtype's tolerance: every fp8 value is exact in the query dtype, the scales apply in
    fp32. V's scale comes as an expanded (stride 0) tensor. Triton runs compiled where there is
    a GPU (the fenced decode of kernels.md), the oracle on the CPU."""
    args, k_fp32, v_fp32 = kc.fp8_attention_case(dtype, query_dtype, seed=1)
    device = kc.DEVICE if backend == "triton" else torch.device("cpu")
    on = {name: tensor.to(device) for name, tensor in args.items()}
    fp32 = {**args, "k_cache": k_fp32, "v_cache": v_fp32, "query": args["query"].float()}
    del fp32["k_scale"], fp32["v_scale"]  # the oracle reads the fp32 values, in fp32
    for splits, window in ((1, None), (3, None), (3, 5)):
        options = {"num_splits": splits, "window": window}
        expected = kernels.paged_decode_attention(**fp32, window=window, backend="reference")
        actual = kernels.paged_decode_attention(**on, **options, backend=backend)
        kc.assert_close(actual, expected.to(query_dtype), f"decode {options}")
    rows = args["block_tables"][:, :2].clamp(min=0)  # two blocks a sequence, as contiguous rows
    contiguous = [args[c][rows].flatten(1, 2).to(device) for c in ("k_cache", "v_cache")]
    lens = args["context_lens"].clamp(max=8)
    scales = (args["k_scale"], args["v_scale"])
    values = [c.cpu().float() * s[:, None] for c, s in zip(contiguous, scales, strict=True)]
    expected = kernels.contiguous_decode_attention(fp32["query"], *values, lens)
    actual = kernels.contiguous_decode_attention(
        on["query"], *contiguous, lens.to(device), k_scale=on["k_scale"], v_scale=on["v_scale"],
        backend=backend,
    )  # fmt: skip
    kc.assert_close(actual, expected.to(query_dtype), "contiguous decode")
    chunks = {"cu_seqlens_q": torch.tensor([0, 4, 4, 7], dtype=torch.int32)}
    chunks["query"] = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(2))
    chunks["query"] = chunks["query"].to(query_dtype)
    fp32 |= {**chunks, "query": chunks["query"].float()}
    expected = kernels.paged_prefill_attention(**fp32, backend="reference")
    chunks = {name: tensor.to(device) for name, tensor in chunks.items()}
    actual = kernels.paged_prefill_attention(**{**on, **chunks}, backend=backend)
    kc.assert_close(actual, expected.to(query_dtype), "prefill")
