"""numba kernels for fp8 caches (``uint8`` codes): ``spec.fp8``'s store rule by integer
arithmetic on each quotient's bits, and the read through a 256-entry table of the codes' values.

The store divides each fp32 row by its KV head's scale (IEEE: these functions are compiled
without fastmath, whose reciprocals would change the quotient) and encodes the quotient
(:func:`encode_bits`). The attention kernels read a row of codes through :func:`read_row`.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, types
from numba.extending import overload

from pagedkv.kernels.fp8 import encode_limits
from pagedkv.kernels.numba_runtime import as_array
from pagedkv.spec.fp8 import FORMATS, Fp8Format, decode, fp8_format


@njit(cache=True)
def round_shift(v: int, shift: int) -> int:
    """``v >> shift`` rounded to nearest, ties to the even result (``v >= 0``)."""
    q = v >> shift
    rest = v - (q << shift)
    half = np.int64(1) << (shift - 1)
    return q + 1 if rest > half or (rest == half and q & 1) else q


@njit(cache=True)
def encode_bits(bits: int, mantissa: int, bias: int, max_code: int, max_bits: int) -> int:
    """The fp8 code of the fp32 whose bits are ``bits``: nearest value, ties to the even code,
    subnormals included; past the largest (``max_bits``, code ``max_code``) saturated; NaN
    ``0x7F``; the sign of zero kept."""
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF  # |x|: its fp32 bits order as its value
    if a > 0x7F800000:
        return 0x7F
    if a > max_bits:
        return max_code | sign
    exponent = max(a >> 23, 1)  # fp32's biased exponent (its subnormals' scale is 1's)
    if exponent - 127 + bias >= 1:  # normal in fp8: a rounding carry moves into the exponent
        return round_shift(a - ((127 - bias) << 23), 23 - mantissa) | sign
    significand = (a & 0x7FFFFF) | (0x800000 if a >= 0x800000 else 0)
    return round_shift(significand, min(151 - bias - mantissa - exponent, 62)) | sign


@njit(cache=True)
def store_rows(rows, codes, slots, scale, mantissa, bias, max_code, max_bits) -> None:
    """Token ``t``'s fp32 rows ``[tokens, heads, dim]``, each divided by its head's ``scale``,
    as codes into row ``slots[t]`` of ``codes`` ``[slots, heads, dim]``; ``-1`` skips."""
    quotient = np.empty(rows.shape[2], np.float32)
    bits = quotient.view(np.int32)
    for t in range(slots.shape[0]):
        slot = slots[t]
        if slot < 0:
            continue
        for h in range(rows.shape[1]):
            for d in range(rows.shape[2]):
                quotient[d] = rows[t, h, d] / scale[h]
            for d in range(rows.shape[2]):
                codes[slot, h, d] = encode_bits(
                    np.int64(bits[d]), mantissa, bias, max_code, max_bits
                )


def store_codes(
    rows: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    slots: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor],
    name: str,
) -> None:
    """K's and V's fp32 ``rows`` ``[tokens, heads, dim]`` as codes of fp8 format ``name`` into
    row ``slots[t]`` (int64; ``-1`` skips) of the ``uint8`` ``caches`` ``[slots, heads, dim]``,
    each under its per-head scale."""
    fmt = fp8_format(name)
    limits = encode_limits(fmt)
    for row, cache, scale in zip(rows, caches, scales, strict=True):
        store_rows(
            as_array(row), as_array(cache), as_array(slots), as_array(scale.contiguous()),
            fmt.mantissa_bits, fmt.bias, *limits,
        )  # fmt: skip


def read_row(rows: np.ndarray, row: int, head: int, table, decoded: np.ndarray) -> np.ndarray:
    """Row ``rows[row, head]`` as fp32: itself, or with a ``table`` its codes' values written
    into ``decoded``. Called in compiled code only, as its overload (one per kind of ``table``)."""
    raise NotImplementedError("read_row runs inside numba kernels only")


@overload(read_row, jit_options={"cache": True})
def _read_row(rows, row, head, table, decoded):
    if isinstance(table, types.NoneType):
        return lambda rows, row, head, table, decoded: rows[row, head]

    def decode_row(rows, row, head, table, decoded):
        for d in range(decoded.shape[0]):
            decoded[d] = table[rows[row, head, d]]
        return decoded

    return decode_row


def decode_table(fmt: Fp8Format) -> np.ndarray:
    """The fp32 value of each of the 256 codes of ``fmt`` (``spec.fp8.decode``)."""
    return np.array([decode(code, fmt) for code in range(256)], np.float32)


DECODE_TABLES = {name: decode_table(fmt) for name, fmt in FORMATS.items()}
"""Each format's table, made once, at import."""


def kernel_arguments(
    fp8: str | None, scales: tuple[torch.Tensor, torch.Tensor] | None, num_kv_heads: int
) -> tuple[np.ndarray | None, np.ndarray]:
    """The kernels' ``table`` and ``kv_scales`` for a cache of fp8 format ``fp8`` (``None``: no
    table, scales of 1)."""
    if fp8 is None or scales is None:
        return None, np.ones((2, num_kv_heads), np.float32)
    return DECODE_TABLES[fp8], as_array(torch.stack(scales).contiguous())
