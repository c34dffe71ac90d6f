"""fp8 KV-cache storage: the two formats, and how a K/V value is stored and read back.

Rules (every backend matches them bit for bit; docs/kernels.md, "An fp8 cache", gives the reasons):

- Formats. ``fp8_e4m3`` is OCP E4M3FN: a sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
  infinity; largest finite 448; NaN is ``S.1111.111``. ``fp8`` names it too, as vLLM's
  ``--kv-cache-dtype fp8`` does. ``fp8_e5m2`` is IEEE-like: 5 exponent bits (bias 15), 2 mantissa
  bits; largest finite 57,344; ``S.11111.00`` is infinity and ``S.11111.xx`` (xx not 00) NaN.
  Exponent field 0 holds the subnormals (no implicit leading 1).
- Scale. Each layer has one scale for K and one for V (optionally one per KV head): a positive
  float, finite in fp32. The stored value is ``x / scale``; the read value is the code's value
  times ``scale``.
- Store (:func:`quantize`): ``x / scale`` is computed in fp32 (round to nearest even), then
  rounded to the nearest value of the format, ties to the even code (the one whose lowest bit is
  0), subnormals included. A finite value past the largest finite one, and an infinity, is
  stored as the largest finite value of its sign: a cache entry is never infinite. NaN, of either
  sign, is stored as the NaN ``0x7F`` (as the GPU's conversion writes it; torch's cast keeps a
  NaN's sign): the caches are NaN-initialised, so that attention reading a slot no step wrote
  shows. The sign of zero is kept.
- Read (:func:`dequantize`): the code's value, times the scale, in fp32.
- Calibration (:func:`calibrated_scale`): a scale computed from values (a layer's K or V of the
  first forward) maps their largest magnitude to half the format's largest value, leaving room
  for larger values later; values with no finite nonzero magnitude, or so small that the scale
  would not be a normal fp32 number, give the scale 1.0.
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass


@dataclass(frozen=True)
class Fp8Format:
    """One fp8 format's bit layout."""

    name: str
    exponent_bits: int
    mantissa_bits: int
    has_infinity: bool

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent_bits - 1) - 1

    @property
    def nan_code(self) -> int:
        """The NaN a store writes: every bit but the sign set (``0x7F``) in both formats."""
        return 0x7F


FORMATS = {
    "fp8_e4m3": Fp8Format("fp8_e4m3", exponent_bits=4, mantissa_bits=3, has_infinity=False),
    "fp8_e5m2": Fp8Format("fp8_e5m2", exponent_bits=5, mantissa_bits=2, has_infinity=True),
}
ALIASES = {"fp8": "fp8_e4m3"}  # as vLLM's ``--kv-cache-dtype``
SMALLEST_NORMAL_FP32 = 2.0**-126


def fp8_format(name: str) -> Fp8Format:
    """The format named ``name`` (``fp8``, ``fp8_e4m3`` or ``fp8_e5m2``); ``ValueError``
    naming the accepted names otherwise, ``TypeError`` for a non-str."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(name).__name__}")
    key = ALIASES.get(name, name)
    if key not in FORMATS:
        accepted = sorted([*FORMATS, *ALIASES])
        raise ValueError(f"kv_cache_dtype must be one of {accepted}, got {name!r}")
    return FORMATS[key]


def decode(code: int, fmt: Fp8Format) -> float:
    """The value of the byte ``code`` (0 to 255) in ``fmt``."""
    if not 0 <= code <= 0xFF:
        raise ValueError(f"an fp8 code is a byte, 0 to 255, got {code}")
    sign = -1.0 if code & 0x80 else 1.0
    exponent = (code >> fmt.mantissa_bits) & (2**fmt.exponent_bits - 1)
    mantissa = code & (2**fmt.mantissa_bits - 1)
    top = 2**fmt.exponent_bits - 1
    if exponent == top and fmt.has_infinity:  # e5m2: infinity, or NaN
        return sign * math.inf if mantissa == 0 else math.nan
    if exponent == top and mantissa == 2**fmt.mantissa_bits - 1:  # e4m3fn: S.1111.111 only
        return math.nan
    if exponent == 0:  # subnormal: 0.mantissa x 2^(1 - bias)
        return sign * mantissa * 2.0 ** (1 - fmt.bias - fmt.mantissa_bits)
    return (
        sign * (2**fmt.mantissa_bits + mantissa) * 2.0 ** (exponent - fmt.bias - fmt.mantissa_bits)
    )


def finite_values(fmt: Fp8Format) -> list[float]:
    """The values of the non-negative finite codes, in code order (which is value order)."""
    return [value for code in range(0x80) if math.isfinite(value := decode(code, fmt))]


def largest_finite(fmt: Fp8Format) -> float:
    """448 for ``fp8_e4m3``, 57,344 for ``fp8_e5m2``."""
    return finite_values(fmt)[-1]


def to_fp32(value: float) -> float:
    """``value`` rounded to the nearest fp32 (ties to even; past fp32's range, its infinity)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def encode(value: float, fmt: Fp8Format) -> int:
    """The code that stores ``value`` (already divided by the scale): the rules above."""
    if math.isnan(value):
        return fmt.nan_code  # Rule: NaN stays NaN.
    negative = math.copysign(1.0, value) == -1.0  # Rule: the sign (of zero too) is kept.
    values = finite_values(fmt)
    magnitude = min(abs(value), values[-1])  # Rule: past the largest finite (or inf): saturate.
    above = bisect.bisect_left(values, magnitude)  # the first code whose value >= magnitude
    # Rule: the nearest value; of two equally near, the even code.
    _, _, code = min((abs(values[c] - magnitude), c % 2, c) for c in (above - 1, above) if c >= 0)
    return 0x80 | code if negative else code


def quantize(x: float, scale: float, fmt: Fp8Format) -> int:
    """Store ``x`` under ``scale``: ``x / scale`` in fp32, then :func:`encode`."""
    return encode(to_fp32(to_fp32(x) / to_fp32(scale)), fmt)


def dequantize(code: int, scale: float, fmt: Fp8Format) -> float:
    """Read a code back under ``scale``: its value times the scale, in fp32."""
    return to_fp32(decode(code, fmt) * to_fp32(scale))


def check_kv_scale(name: str, scale: object) -> float:
    """A K or V scale is a real number (not a bool) that is positive and finite in fp32, where
    the kernels apply it: ``TypeError`` / ``ValueError`` naming ``name`` otherwise."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(scale).__name__}")
    try:
        in_fp32 = to_fp32(float(scale))
    except OverflowError:  # an int past a double's range
        in_fp32 = math.inf
    if not 0 < in_fp32 < math.inf:
        raise ValueError(f"{name} must be positive and finite in fp32, got {scale}")
    return float(scale)


def calibrated_scale(amax: float, fmt: Fp8Format) -> float:
    """The scale calibrated from values whose largest magnitude is ``amax``: ``amax`` over half
    the largest finite value, in fp32; 1.0 when that is not a normal fp32 number (an ``amax``
    of 0, infinite or NaN, or too small or too large)."""
    scale = to_fp32(to_fp32(amax) / (largest_finite(fmt) / 2))  # Rule: amax maps to max / 2.
    return scale if SMALLEST_NORMAL_FP32 <= scale < math.inf else 1.0  # Rule: else the default.
