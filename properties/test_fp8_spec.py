"""The fp8 storage rules of ``spec/fp8.py`` against two independent models: torch's fp8 dtypes
(the decode of every byte; the store where torch's cast follows the same rule) and arithmetic
rounding written here; and the KV byte budget of ``spec/utilization.py``."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from pagedkv.kernels import fp8 as kernels_fp8
from pagedkv.spec import fp8
from pagedkv.spec.utilization import blocks_in_budget, bytes_per_block

FORMATS = [fp8.FORMATS["fp8_e4m3"], fp8.FORMATS["fp8_e5m2"]]
TORCH_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FORMAT_IDS = [fmt.name for fmt in FORMATS]


def torch_values(fmt: fp8.Fp8Format) -> list[float]:
    """Every byte's value as torch reads it."""
    codes = torch.arange(256, dtype=torch.uint8).view(TORCH_DTYPES[fmt.name])
    return codes.float().tolist()


def rounded(value: float, fmt: fp8.Fp8Format) -> float:
    """The model: the rule's value by arithmetic. Saturate, then round ``value / quantum`` to an
    integer, ties to even, with the quantum of ``value``'s binade (the subnormals' below)."""
    largest = 448.0 if fmt.name == "fp8_e4m3" else 57344.0
    magnitude = min(abs(value), largest)
    if magnitude == 0:
        return math.copysign(0.0, value)
    exponent = max(math.frexp(magnitude)[1] - 1, 1 - fmt.bias)
    quantum = 2.0 ** (exponent - fmt.mantissa_bits)
    return math.copysign(round(magnitude / quantum) * quantum, value)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_every_byte_decodes_as_torch_reads_it(fmt: fp8.Fp8Format) -> None:
    for code, expected in enumerate(torch_values(fmt)):
        actual = fp8.decode(code, fmt)
        assert (math.isnan(actual) and math.isnan(expected)) or actual == expected, code


@pytest.mark.parametrize(
    ("name", "largest"), [("fp8", 448), ("fp8_e4m3", 448), ("fp8_e5m2", 57344)]
)
def test_names_and_largest_values(name: str, largest: float) -> None:
    fmt = fp8.fp8_format(name)
    assert fp8.largest_finite(fmt) == largest
    with pytest.raises(AttributeError):
        fmt.mantissa_bits = 1  # type: ignore[misc]  # a format is a frozen value


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_a_value_halfway_between_two_is_stored_as_the_even_code(fmt: fp8.Fp8Format) -> None:
    """Every midpoint of two neighbouring values, either sign: the even code, as torch casts."""
    values = fp8.finite_values(fmt)
    for low, high in itertools.pairwise(values):
        for sign in (1.0, -1.0):
            middle = sign * (low + high) / 2
            code = fp8.encode(middle, fmt)
            assert code % 2 == 0 and abs(fp8.decode(code, fmt)) in (low, high), middle
            cast = torch.tensor([middle]).to(TORCH_DTYPES[fmt.name]).view(torch.uint8).item()
            assert code == cast, middle


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@given(value=st.floats(allow_nan=False, width=32) | st.floats(-0.0078125, 0.0078125, width=32))
def test_a_store_is_the_nearest_value_ties_to_even_saturated(
    fmt: fp8.Fp8Format, value: float
) -> None:
    code = fp8.encode(value, fmt)
    expected = rounded(value, fmt)
    assert fp8.decode(code, fmt) == expected
    assert math.copysign(1.0, fp8.decode(code, fmt)) == math.copysign(1.0, value)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@given(value=st.floats(allow_nan=False, allow_infinity=False, width=32))
def test_within_range_a_store_is_torchs_cast(fmt: fp8.Fp8Format, value: float) -> None:
    """torch's cast rounds to nearest, ties to even; past the largest value e4m3fn's cast
    saturates, as the rule does, and e5m2's gives infinity, where the rule saturates."""
    largest = fp8.largest_finite(fmt)
    cast = torch.tensor([value]).to(TORCH_DTYPES[fmt.name]).view(torch.uint8).item()
    if abs(fp8.decode(cast, fmt)) <= largest:
        assert fp8.encode(value, fmt) == cast
    else:
        assert fp8.decode(fp8.encode(value, fmt), fmt) == math.copysign(largest, value)


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@given(data=st.data(), scale=st.sampled_from([3.0, 0.1, 0.007, 1.0, 17.5]))
def test_a_store_divides_in_fp32_then_rounds_as_torch_does(
    fmt: fp8.Fp8Format, data: st.DataObject, scale: float
) -> None:
    """``x / scale`` in fp32, then the cast: x near ``midpoint * scale`` (where multiplying by
    ``1 / scale``, or dividing in double, lands on the other side of the tie)."""
    values = fp8.finite_values(fmt)
    index = data.draw(st.integers(0, len(values) - 2))
    middle = (values[index] + values[index + 1]) / 2
    x = fp8.to_fp32(middle * scale) * data.draw(st.sampled_from([1.0, 1 + 2**-23, 1 - 2**-24]))
    x = fp8.to_fp32(x)
    tensors = torch.tensor([x]) / torch.tensor([scale])
    cast = tensors.to(TORCH_DTYPES[fmt.name]).view(torch.uint8).item()
    assert fp8.quantize(x, scale, fmt) == cast


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
def test_nan_infinity_and_signed_zero(fmt: fp8.Fp8Format) -> None:
    largest = fp8.largest_finite(fmt)
    assert fp8.encode(math.nan, fmt) == fp8.encode(-math.nan, fmt) == 0x7F
    assert fp8.decode(fp8.encode(math.inf, fmt), fmt) == largest
    assert fp8.decode(fp8.encode(-math.inf, fmt), fmt) == -largest
    assert fp8.encode(-0.0, fmt) == 0x80 and fp8.encode(0.0, fmt) == 0


@pytest.mark.parametrize("fmt", FORMATS, ids=FORMAT_IDS)
@given(
    x=st.floats(-8192, 8192, width=32),
    scale=st.floats(2**-10, 2**10, width=32),
)
def test_a_round_trip_is_within_half_a_step(fmt: fp8.Fp8Format, x: float, scale: float) -> None:
    """Within range, the read value is ``x`` to half the format's step at ``x / scale`` (the
    subnormal step below the smallest normal), times the scale, plus fp32's own rounding."""
    stored = fp8.to_fp32(fp8.to_fp32(x) / fp8.to_fp32(scale))
    assume(abs(stored) <= fp8.largest_finite(fmt))
    back = fp8.dequantize(fp8.quantize(x, scale, fmt), scale, fmt)
    exponent = max(math.frexp(abs(stored))[1] - 1, 1 - fmt.bias) if stored else 1 - fmt.bias
    step = 2.0 ** (exponent - fmt.mantissa_bits)
    assert abs(back - x) <= (step / 2) * scale * (1 + 2**-20) + abs(x) * 2**-22


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda: fp8.fp8_format("fp8_e4m3fn"), ValueError),
        (lambda: fp8.fp8_format(8), TypeError),
        (lambda: fp8.check_kv_scale("k_scale", 0.0), ValueError),
        (lambda: fp8.check_kv_scale("k_scale", -1.0), ValueError),
        (lambda: fp8.check_kv_scale("k_scale", math.nan), ValueError),
        (lambda: fp8.check_kv_scale("k_scale", math.inf), ValueError),
        (lambda: fp8.check_kv_scale("k_scale", 1e39), ValueError),  # inf in fp32
        (lambda: fp8.check_kv_scale("k_scale", 1e-50), ValueError),  # 0 in fp32
        (lambda: fp8.check_kv_scale("k_scale", 10**400), ValueError),  # past a double too
        (lambda: fp8.decode(256, fp8.FORMATS["fp8_e4m3"]), ValueError),
        (lambda: fp8.check_kv_scale("k_scale", True), TypeError),
        (lambda: fp8.check_kv_scale("k_scale", "1"), TypeError),
        (lambda: bytes_per_block(16, 1, 1, 64, "int8"), ValueError),
        (lambda: bytes_per_block(0, 1, 1, 64, "fp16"), ValueError),
        (lambda: blocks_in_budget(-1, 16), ValueError),
    ],
)
def test_bad_names_scales_and_sizes_are_refused_by_name(
    call: Callable[[], object], error: type
) -> None:
    with pytest.raises(error):
        call()


def test_valid_scales_and_the_smallest_sizes_are_taken() -> None:
    scales = [0.5, 1e-3, 2, 1e38]
    assert [fp8.check_kv_scale("v_scale", s) for s in scales] == [0.5, 1e-3, 2.0, 1e38]
    assert bytes_per_block(1, 1, 1, 1, "bf16") == 4 and bytes_per_block(1, 1, 1, 1, "fp8") == 2
    assert blocks_in_budget(0, 1) == 0 and blocks_in_budget(7, 1) == 7


def test_bytes_per_block_and_the_blocks_a_budget_holds() -> None:
    """Llama-3-8B's shape (32 layers, 8 KV heads of 128) at block size 16: 2 MiB a block in fp16,
    half in fp8; a 1 GiB budget holds 512 and 1,024 blocks."""
    fp16 = bytes_per_block(16, 32, 8, 128, "fp16")
    assert fp16 == 2 * 32 * 16 * 8 * 128 * 2 == 2**21
    assert (
        bytes_per_block(16, 32, 8, 128, "fp8")
        == fp16 // 2
        == bytes_per_block(16, 32, 8, 128, "fp8_e5m2")
    )
    assert bytes_per_block(16, 32, 8, 128, "fp32") == 2 * fp16
    assert blocks_in_budget(2**30, fp16) == 512
    assert blocks_in_budget(2**30, fp16 // 2) == 1024
    assert blocks_in_budget(2**30 - 1, 2**21) == 511


@given(st.sampled_from(FORMATS), st.floats(width=32, allow_nan=True))
@example(fp8.FORMATS["fp8_e4m3"], 224 * 2.0**-126).via("the smallest normal scale")
@example(fp8.FORMATS["fp8_e5m2"], fp8.to_fp32(28672 * 2.0**-126 * (1 - 2.0**-20))).via("below it")
def test_a_calibrated_scale_maps_the_largest_magnitude_to_half_the_format(
    fmt: fp8.Fp8Format, amax: float
) -> None:
    """Stored under its own calibrated scale (a normal fp32 number), ``amax`` is the code of
    half the largest value; without a finite nonzero magnitude, or for one so small that the
    scale would be subnormal, the scale is 1.0. torch's version (``kernels.fp8``) agrees."""
    scale = fp8.calibrated_scale(abs(amax), fmt)
    rows = torch.tensor([[[amax, 0.0]], [[-amax / 2, 1e-45]]], dtype=torch.float32)
    assert kernels_fp8.calibrated_scales(rows, TORCH_DTYPES[fmt.name]).tolist() == [scale]
    exact = fp8.to_fp32(abs(amax) / (fp8.largest_finite(fmt) / 2))  # amax is an fp32
    if not 2.0**-126 <= exact < math.inf:
        assert scale == 1.0
        return
    assert scale == exact
    half = fp8.encode(fp8.largest_finite(fmt) / 2, fmt)
    assert fp8.quantize(abs(amax), scale, fmt) == half
    assert fp8.quantize(-abs(amax), scale, fmt) == 0x80 | half


def test_a_magnitude_past_fp32_calibrates_to_the_default_scale() -> None:
    assert fp8.calibrated_scale(1e300, fp8.FORMATS["fp8_e4m3"]) == 1.0
