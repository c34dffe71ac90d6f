"""fp8 caches on every backend: a store writes ``spec.fp8.quantize``'s code bit for bit,
attention reads code value times scale (within the query dtype's tolerance of attention over
those values in an fp32 cache), a copy moves bytes; bad scales and dtypes are refused with
nothing written (the planted bugs: test_kernels_planted_bugs)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.spec import fp8 as spec
from properties.kernel_cases import DEVICE, assert_close

BACKENDS = ("reference", "numba", "triton")
FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
FP32 = st.floats(width=32, allow_nan=True)
SCALES = ("k_scale", "v_scale")
SCALE_VALUES = st.floats(2.0**-20, 2.0**20, width=32)


def nan_caches(dtype: torch.dtype, shape: tuple[int, ...]) -> list[torch.Tensor]:
    return [torch.full(shape, 0x7F, dtype=torch.uint8).view(dtype) for _ in "kv"]


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
    fp32 = {**args, "k_cache": k_fp32, "v_cache": v_fp32, "query": args["query"].float()}
    del fp32["k_scale"], fp32["v_scale"]  # the oracle reads the fp32 values, in fp32
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


REFUSED = [  # (function, change, error, match); "fp32_caches": the caches are fp32
    *(("store_kv", *case) for case in [
        ({"k_scale": 0.0}, ValueError, "k_scale"),
        ({"v_scale": math.nan}, ValueError, "v_scale"),
        ({"k_scale": True}, TypeError, "k_scale"),
        ({"k_scale": torch.tensor([1.0])}, ValueError, "k_scale"),
        ({"v_scale": torch.tensor([1.0, 1.0], dtype=torch.float64)}, TypeError, "v_scale"),
        ({"v_scale": torch.tensor([1.0, -1.0])}, ValueError, "v_scale"),
        ({"key": torch.zeros(2, 2, 16, dtype=torch.float8_e4m3fn)}, TypeError, "key"),
        ({"value": torch.zeros(2, 2, 16, dtype=torch.float16)}, TypeError, "value"),
        ({"fp32_caches": True, "k_scale": 1.0}, ValueError, "k_scale"),
    ]),
    *((function, *case) for function in ("paged_decode_attention", "paged_prefill_attention")
      for case in [
        ({"fp32_caches": True, "v_scale": 1.0}, ValueError, "v_scale"),
        ({"k_scale": torch.ones(3)}, ValueError, "k_scale"),
        ({"query": torch.zeros(1, 4, 16, dtype=torch.float8_e5m2)}, TypeError, "query"),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("function", "change", "error", "match"), REFUSED)
def test_bad_scales_and_dtypes_are_refused_with_nothing_written(
    function: str, change: dict, error: type[Exception], match: str
) -> None:
    caches = nan_caches(torch.float8_e4m3fn, (2, 4, 2, 16))
    change = dict(change)  # the parameter is shared between the cases
    if change.pop("fp32_caches", False):
        caches = [torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)]
    call = {"k_cache": caches[0], "v_cache": caches[1], **change}
    if function == "store_kv":
        rows = {"key": torch.ones(2, 2, 16), "value": torch.ones(2, 2, 16)}
        call = {**rows, "slot_mapping": torch.tensor([0, 1]), **call}
    else:
        call = {"query": torch.ones(1, 4, 16), "block_tables": torch.zeros(1, 1).int(), **call}
        call["context_lens"] = torch.zeros(1, dtype=torch.int32)
        if function == "paged_prefill_attention":
            call["cu_seqlens_q"] = torch.tensor([0, 1])
    before = [cache.view(torch.uint8).clone() for cache in caches]
    with pytest.raises(error, match=match):
        getattr(kernels, function)(**call)
    assert all(map(torch.equal, (cache.view(torch.uint8) for cache in caches), before))
