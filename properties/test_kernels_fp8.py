"""fp8 caches on every backend: a store writes ``spec.fp8.quantize``'s code bit for bit,
attention reads code value times scale (within the query dtype's tolerance of attention over
those values in an fp32 cache), a copy moves bytes; bad scales and dtypes are refused with
nothing written; the planted bugs users of fp8 caches report are caught."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import numba_attention, numba_fp8, reference, triton_decode
from pagedkv.spec import fp8 as spec
from properties.kernel_cases import DEVICE, assert_close, load_mutant

BACKENDS = ("reference", "numba", "triton")
FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
FP32 = st.floats(width=32, allow_nan=True)
SCALES = ("k_scale", "v_scale")
SCALE_VALUES = st.floats(2.0**-20, 2.0**20, width=32)


def nan_caches(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    caches = tuple(torch.empty(shape, dtype=dtype) for _ in range(2))
    for cache in caches:
        cache.view(torch.uint8).fill_(0x7F)
    return caches  # type: ignore[return-value]


def expected_codes(rows: torch.Tensor, scales: list[float], name: str) -> torch.Tensor:
    """``spec.fp8.quantize`` of every element of ``rows`` ``[tokens, heads, dim]``."""
    fmt = spec.fp8_format(name)
    codes = [
        [[spec.quantize(x, scales[h], fmt) for x in head] for h, head in enumerate(token)]
        for token in rows.float().tolist()
    ]
    return torch.tensor(codes, dtype=torch.uint8)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    dtype=st.sampled_from(list(FP8)),
    row_dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    backend=st.sampled_from(BACKENDS),
)
def test_a_store_writes_the_spec_code_bit_for_bit(
    data: st.DataObject, dtype: torch.dtype, row_dtype: torch.dtype, backend: str
) -> None:
    """Any fp32 values (subnormals, infinities, NaN of either sign, past the largest), per-head
    scales; skipped slots keep their NaN bytes."""
    key, value = (
        torch.tensor(data.draw(st.lists(FP32, min_size=12, max_size=12)), dtype=torch.float32)
        .view(3, 2, 2)
        .to(row_dtype)
        for _ in range(2)
    )
    k_scales, v_scales = (
        data.draw(st.lists(SCALE_VALUES, min_size=2, max_size=2)) for _ in range(2)
    )
    k_cache, v_cache = nan_caches(dtype, (2, 4, 2, 2))
    slots = torch.tensor([5, -1, 0])
    kernels.store_kv(
        key, value, k_cache, v_cache, slots, backend=backend,
        k_scale=torch.tensor(k_scales).repeat_interleave(2)[::2],  # strided: read as values
        v_scale=torch.tensor(v_scales),
    )  # fmt: skip
    for cache, rows, scales in ((k_cache, key, k_scales), (v_cache, value, v_scales)):
        stored = cache.view(torch.uint8).view(8, 2, 2)
        codes = expected_codes(rows, scales, FP8[dtype])
        assert torch.equal(stored[[5, 0]], codes[[0, 2]]), backend
        assert (stored[[1, 2, 3, 4, 6, 7]] == 0x7F).all()


def test_every_code_is_read_as_its_value_and_copied_as_its_byte() -> None:
    """All 256 codes of both formats as V: attention over one key (of value 0) reads each as
    its value times the scale, infinities and NaNs included; a copy moves each byte."""
    for dtype, name in FP8.items():
        fmt = spec.fp8_format(name)
        v_cache = torch.arange(256, dtype=torch.uint8).view(dtype).view(256, 1, 1, 1)
        k_cache = torch.zeros(256, 1, 1, 1, dtype=torch.uint8).view(dtype)
        for backend in BACKENDS:
            query = torch.zeros(256, 1, 1)
            out = kernels.paged_decode_attention(
                query, k_cache, v_cache, torch.arange(256, dtype=torch.int32)[:, None],
                torch.ones(256, dtype=torch.int32), v_scale=2.0, backend=backend,
            ).flatten()  # fmt: skip
            values = torch.tensor([spec.decode(code, fmt) * 2.0 for code in range(256)])
            assert torch.equal(out.isnan(), values.isnan()), (name, backend)
            finite = ~values.isnan()
            assert torch.equal(out[finite], values[finite]), (name, backend)
            copied = v_cache.clone(), k_cache.clone()
            kernels.copy_blocks(*copied, [(3, 7), (255, 0)], backend=backend)
            assert copied[0].view(torch.uint8).flatten()[[7, 0]].tolist() == [3, 255]


def attention_case(
    dtype: torch.dtype, query_dtype: torch.dtype, seed: int
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A paged cache of random codes (NaN codes excluded) under per-head scales, a batch of
    three sequences; and the same values as an fp32 cache (code value times scale)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (8, 4, 2, 16)
    codes = torch.randint(0, 256, (2, *shape), dtype=torch.uint8, generator=generator)
    values = codes.view(dtype).float()
    codes[values.isnan() | values.isinf()] = 0x38  # 1.0 in e4m3, 0.5 in e5m2
    k_scale, v_scale = torch.tensor([0.02, 3.0]), torch.tensor(0.001).expand(2)
    k_cache, v_cache = codes.view(dtype)
    k_fp32 = k_cache.float() * k_scale[:, None]
    v_fp32 = v_cache.float() * v_scale[:, None]
    args = {
        "block_tables": torch.tensor([[3, 0, 5, 7], [5, 1, 2, -1], [6, -1, -1, -1]]).int(),
        "context_lens": torch.tensor([14, 9, 3], dtype=torch.int32),
        "k_scale": k_scale,
        "v_scale": v_scale,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "query": torch.randn(3, 4, 16, generator=generator).to(query_dtype),
    }
    return args, k_fp32, v_fp32


@pytest.mark.parametrize("dtype", list(FP8), ids=str)
@pytest.mark.parametrize("query_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_reads_code_value_times_scale(
    dtype: torch.dtype, query_dtype: torch.dtype, backend: str
) -> None:
    """Decode (one split and three, a window of 5), its contiguous twin, and prefill (chunks
    over cached prefixes) equal the reference over the fp32 cache of the same values, within the
    query dtype's tolerance: every fp8 value is exact in the query dtype, the scales apply in
    fp32. V's scale comes as an expanded (stride 0) tensor. Triton runs compiled where there is
    a GPU (the fenced decode of kernels.md), the oracle on the CPU."""
    args, k_fp32, v_fp32 = attention_case(dtype, query_dtype, seed=1)
    device = DEVICE if backend == "triton" else torch.device("cpu")
    on = {name: tensor.to(device) for name, tensor in args.items()}
    fp32 = {**args, "k_cache": k_fp32.to(query_dtype), "v_cache": v_fp32.to(query_dtype)}
    del fp32["k_scale"], fp32["v_scale"]
    if query_dtype != torch.float32:  # the oracle reads the fp32 values, in fp32
        fp32 = {**fp32, "k_cache": k_fp32, "v_cache": v_fp32, "query": args["query"].float()}
    for splits, window in ((1, None), (3, None), (3, 5)):
        options = {"num_splits": splits, "window": window}
        expected = kernels.paged_decode_attention(**fp32, window=window, backend="reference")
        actual = kernels.paged_decode_attention(**on, **options, backend=backend)
        assert_close(actual, expected.to(query_dtype), f"decode {options}")
    rows = args["block_tables"][:, :2].clamp(min=0)  # two blocks a sequence, as contiguous rows
    contiguous = [args[c][rows].flatten(1, 2).to(device) for c in ("k_cache", "v_cache")]
    lens = args["context_lens"].clamp(max=8)
    values = [c.cpu().float() * args[s][:, None] for c, s in zip(contiguous, SCALES, strict=True)]
    expected = kernels.contiguous_decode_attention(fp32["query"], *values, lens)
    actual = kernels.contiguous_decode_attention(
        on["query"], *contiguous, lens.to(device), k_scale=on["k_scale"], v_scale=on["v_scale"],
        backend=backend,
    )  # fmt: skip
    assert_close(actual, expected.to(query_dtype), "contiguous decode")
    chunks = {"cu_seqlens_q": torch.tensor([0, 4, 4, 7], dtype=torch.int32)}
    chunks["query"] = torch.randn(7, 4, 16, generator=torch.Generator().manual_seed(2))
    chunks["query"] = chunks["query"].to(query_dtype)
    fp32 |= {**chunks, "query": chunks["query"].float()}
    expected = kernels.paged_prefill_attention(**fp32, backend="reference")
    chunks = {name: tensor.to(device) for name, tensor in chunks.items()}
    actual = kernels.paged_prefill_attention(**{**on, **chunks}, backend=backend)
    assert_close(actual, expected.to(query_dtype), "prefill")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"k_scale": 0.0}, ValueError, "k_scale"),
        ({"v_scale": math.nan}, ValueError, "v_scale"),
        ({"k_scale": True}, TypeError, "k_scale"),
        ({"k_scale": torch.tensor([1.0])}, ValueError, "k_scale"),
        ({"v_scale": torch.tensor([1.0, 1.0], dtype=torch.float64)}, TypeError, "v_scale"),
        ({"v_scale": torch.tensor([1.0, -1.0])}, ValueError, "v_scale"),
        ({"key": torch.zeros(2, 2, 16, dtype=torch.float8_e4m3fn)}, TypeError, "key"),
        ({"value": torch.zeros(2, 2, 16, dtype=torch.float16)}, TypeError, "value"),
        ({"fp32_caches": True, "k_scale": 1.0}, ValueError, "k_scale"),
    ],
)
def test_bad_scales_and_dtypes_are_refused_with_nothing_written(
    change: dict, error: type[Exception], match: str
) -> None:
    k_cache, v_cache = nan_caches(torch.float8_e4m3fn, (2, 4, 2, 16))
    change = dict(change)  # the parameter is shared between the cases
    if change.pop("fp32_caches", False):
        k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    call = {"key": torch.ones(2, 2, 16), "value": torch.ones(2, 2, 16), **change}
    before = k_cache.clone(), v_cache.clone()
    with pytest.raises(error, match=match):
        kernels.store_kv(
            k_cache=k_cache, v_cache=v_cache, slot_mapping=torch.tensor([0, 1]), **call
        )
    after = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    assert all(torch.equal(a, b.view(torch.uint8)) for a, b in zip(after, before, strict=True))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"fp32_caches": True, "v_scale": 1.0}, ValueError, "v_scale"),
        ({"k_scale": torch.ones(3)}, ValueError, "k_scale"),
        ({"query": torch.zeros(1, 4, 16, dtype=torch.float8_e5m2)}, TypeError, "query"),
    ],
)
@pytest.mark.parametrize("function", ["paged_decode_attention", "paged_prefill_attention"])
def test_attention_refuses_bad_scales_and_dtypes(
    function: str, change: dict, error: type[Exception], match: str
) -> None:
    k_cache, v_cache = nan_caches(torch.float8_e4m3fn, (2, 4, 2, 16))
    change = dict(change)  # the parameter is shared between the cases
    if change.pop("fp32_caches", False):
        k_cache, v_cache = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    call = {"query": torch.ones(1, 4, 16), "k_cache": k_cache, "v_cache": v_cache, **change}
    call |= {"block_tables": torch.zeros(1, 1, dtype=torch.int32)}
    lens = {"context_lens": torch.zeros(1, dtype=torch.int32)}
    if function == "paged_prefill_attention":
        lens["cu_seqlens_q"] = torch.tensor([0, 1])
    with pytest.raises(error, match=match):
        getattr(kernels, function)(**call, **lens)


def check_store(store: Callable[..., None]) -> None:
    """``store(key, value, k_codes, v_codes, slots, scales, fp8)`` (the backends' trusted
    store on ``uint8`` views) writes the spec's codes of normal values under per-head scales."""
    for dtype, name in FP8.items():
        key, value = torch.randn(2, 4, 2, 16, generator=torch.Generator().manual_seed(3))
        scales = torch.tensor([0.3, 7.0]), torch.tensor([0.01, 1.0])
        k_cache, v_cache = nan_caches(dtype, (1, 4, 2, 16))
        codes = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        store(key, value, *codes, torch.arange(4), scales, name)
        for stored, rows, scale in zip(codes, (key, value), scales, strict=True):
            assert torch.equal(stored[0], expected_codes(rows, scale.tolist(), name)), name


def check_decode(decode: Callable[..., torch.Tensor]) -> None:
    """``decode(query, k_codes, v_codes, tables, lens, scale, scales, fp8)`` equals the
    reference over the fp32 cache of the same values."""
    for dtype, name in FP8.items():
        args, k_fp32, v_fp32 = attention_case(dtype, torch.float32, seed=4)
        tables, lens, query = args["block_tables"], args["context_lens"], args["query"]
        expected = reference.paged_decode_attention(query, k_fp32, v_fp32, tables, lens, 0.25)
        codes = (args[cache].view(torch.uint8) for cache in ("k_cache", "v_cache"))
        scales = args["k_scale"].contiguous(), args["v_scale"].contiguous()  # as api makes them
        actual = decode(query, *codes, tables, lens, 0.25, scales, name)
        assert_close(actual, expected, name)


def reference_decode(module: ModuleType) -> Callable[..., torch.Tensor]:
    def decode(query, k_codes, v_codes, tables, lens, scale, scales, name):
        dtype = next(d for d, n in FP8.items() if n == name)
        caches = k_codes.view(dtype), v_codes.view(dtype)
        return module.paged_decode_attention(query, *caches, tables, lens, scale, scales=scales)

    return decode


def store_through(module: ModuleType) -> Callable[..., None]:
    """``numba_cache.store_kv`` storing fp8 rows with ``module`` (``numba_fp8`` or a copy)."""

    def store(key, value, k_codes, v_codes, slots, scales, name):
        slots_of = (cache.view(-1, *cache.shape[2:]) for cache in (k_codes, v_codes))
        module.store_codes((key, value), tuple(slots_of), slots, scales, name)

    return store


def numba_decode_through(module: ModuleType) -> Callable[..., torch.Tensor]:
    """``numba_attention.decode`` reading fp8 codes with ``module`` (``numba_fp8`` or a copy)."""

    def decode(query, k_codes, v_codes, tables, lens, scale, scales, name):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(numba_attention, "numba_fp8", module)
            return numba_attention.decode(
                query, k_codes, v_codes, tables, lens, scale, 2, None, scales, name
            )

    return decode


PLANTED: dict[str, tuple[ModuleType, str, str, str, Callable, Callable]] = {
    "scale applied twice on store": (
        numba_fp8, "store_rows", "rows[t, h, d] / scale[h]",
        "rows[t, h, d] / scale[h] / scale[h]", check_store, store_through,
    ),
    "rounding toward zero on store": (
        numba_fp8, "round_shift", "q + 1 if rest > half or (rest == half and q & 1) else q",
        "q", check_store, store_through,
    ),
    "V's scale forgotten in decode": (
        triton_decode, "_decode_kernel", "out = out * tl.load(v_scale_ptr + kv_head)",
        "out = out", check_decode,
        lambda m: lambda q, k, v, t, n, s, sc, f: m.launch(q, k, v, t, n, s, 3, scales=sc, fp8=f),
    ),
    "K's scale forgotten in the reference read": (
        reference, "read_kv", "fp8.dequantize(codes, scale, cache.dtype)",
        "codes.view(cache.dtype).float()", check_decode, reference_decode,
    ),
    "e5m2 read as e4m3": (
        numba_fp8, "kernel_arguments", "DECODE_TABLES[fp8]", "DECODE_TABLES['fp8_e4m3']",
        check_decode,
        numba_decode_through,
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", PLANTED)
def test_the_fp8_checks_catch_the_planted_bug(name: str, tmp_path: Path) -> None:
    module, function, old, new, check, reach = PLANTED[name]
    check(reach(module))  # the real code passes
    with pytest.raises(AssertionError):
        check(reach(load_mutant(module, function, old, new, tmp_path)))
