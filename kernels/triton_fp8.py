"""Triton functions: ``spec.fp8``'s store and read rules by integer arithmetic on the bits.

The codes are ``uint8``, on every target: Triton's ``fp8e4nv`` compiles only for capability 89
and up, and the interpreter has no fp8 dtype, while integer arithmetic is one program for every
GPU and the interpreter, so each gives the same bytes. ``MANTISSA`` and ``BIAS`` are the format's
(3 and 7 for ``fp8_e4m3``, 2 and 15 for ``fp8_e5m2``); ``E5M2`` says which of the two it is.
"""

from __future__ import annotations

from pagedkv.kernels.triton_import import tl, triton


@triton.jit
def _round_shift(v, shift):
    """``v >> shift`` rounded to nearest, ties to the even result (``v >= 0``, ``1 <= shift <=
    31``)."""
    q = v >> shift
    rest = v - (q << shift)
    half = 1 << (shift - 1)
    return q + ((rest > half) | ((rest == half) & ((q & 1) == 1))).to(tl.int32)


@triton.jit
def fp8_encode(
    x, MANTISSA: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, MAX_BITS: tl.constexpr
):
    """The ``uint8`` codes of fp32 ``x`` (already divided by the scale): nearest value, ties to
    the even code, subnormals included; past the largest finite value (code ``MAX_CODE``, fp32
    bits ``MAX_BITS``) and +-inf saturate to it; NaN is ``0x7F``; the sign of zero is kept."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF  # |x|: its fp32 bits order as its value
    exponent = tl.maximum(a >> 23, 1)  # fp32's biased exponent (its subnormals' scale is 1's)
    significand = (a & 0x7FFFFF) | tl.where(a >= 0x800000, 0x800000, 0)
    rebiased = (exponent - 127 + BIAS).to(tl.int32)  # the exponent field fp8 would give x
    # Normal in fp8: round the rebased bits (a carry moves into the exponent, as it must).
    normal = _round_shift(a - ((127 - BIAS) << 23), 23 - MANTISSA)
    # Subnormal in fp8: the significand in units of the smallest subnormal, rounded.
    shift = tl.minimum(151 - BIAS - MANTISSA - exponent, 31)
    subnormal = _round_shift(significand, tl.maximum(shift, 1))
    code = tl.where(rebiased >= 1, normal, subnormal)
    code = tl.where(a > MAX_BITS, MAX_CODE, code) | sign
    return tl.where(a > 0x7F800000, 0x7F, code).to(tl.uint8)


@triton.jit
def fp8_to_fp16(codes, E5M2: tl.constexpr, SELECT_NAN: tl.constexpr = False):
    """Each ``uint8`` code as fp16 by a few integer operations on 16 bits (the attention kernels'
    K/V read): e5m2's value; e4m3's value divided by 2^8, its bits as fp16's, which
    :func:`code_scale` multiplies back with the scale. Exact either way: every e4m3 value / 2^8
    and every e5m2 value is an fp16 value (e4m3's smallest, 2^-9 / 2^8, is an fp16 subnormal).
    Leaving e4m3's 2^8 to the scale saves a multiply per element and the registers it took:
    fp16 queries' prefill with 8 query heads a KV head at head dims 80 and 96 on sm_80 then
    takes 96 registers, not 100 (occupancy 31.25%, not 25%).
    ``SELECT_NAN`` also selects e5m2's NaN codes as NaN (they are NaNs by their bits already):
    the same values, another register allocation. The decode kernel takes it: without it, it
    spills under its 48-register cap at head dims 80 and 96 on sm_90; prefill does not: with
    it, fp16 queries' prefill there takes 84 registers instead of 80 (occupancy 25%, not 37.5%)."""
    c = codes.to(tl.int16)
    magnitude = c & 0x7F
    if E5M2:  # e5m2 is fp16's top byte: same sign, exponent bias, infinities and NaNs
        fp16 = (c << 8).to(tl.float16, bitcast=True)
        return tl.where(magnitude > 0x7C, float("nan"), fp16) if SELECT_NAN else fp16
    # e4m3's 7 magnitude bits as fp16's exponent and top mantissa bits give its value / 2^8
    # (fp16's exponent bias is 8 more), subnormals included; S.1111.111 is its only NaN.
    units = ((magnitude << 7) | ((c & 0x80) << 8)).to(tl.float16, bitcast=True)
    return tl.where(magnitude == 0x7F, float("nan"), units)


@triton.jit
def code_scale(scale_ptr, kv_head, E5M2: tl.constexpr):
    """A KV head's K or V scale as the attention kernels apply it to :func:`fp8_to_fp16`'s
    values: e4m3's times 2^8 (an exact power of two, so the product rounds as the value times
    the scale would)."""
    scale = tl.load(scale_ptr + kv_head)
    return scale if E5M2 else scale * 256.0


@triton.jit
def fence(x):
    """16-bit ``x`` unchanged, through an identity instruction (two values a 32-bit register)
    that is not pure, so Triton's compiler cannot see through it (GPU only: the interpreter has
    no inline assembly). Without it Triton traces a dot operand back to its 8-bit load and moves
    the decode after shared memory, into the operand's register layout: no ``ldmatrix`` and
    about 40 more registers a thread (decode occupancy 31.25% instead of the fp16 cache's 56.25%
    on sm_90). With it the decoded 16-bit tile is what goes to shared memory, and the dot reads
    it as it reads an fp16 cache's."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=2
    )


@triton.jit
def read_kv_tile(
    pointers, mask, query_ptr, FP8: tl.constexpr, E5M2: tl.constexpr, FENCE: tl.constexpr,
    DOT_FP32: tl.constexpr, SELECT_NAN: tl.constexpr = False,
):  # fmt: skip
    """A K or V tile as the attention kernels' dots read it: loaded under ``mask`` (0 where
    masked); an fp8 cache's codes decoded exactly to the query's dtype (``fp8_to_fp16``) and,
    with ``FENCE``, passed through :func:`fence`; upcast to fp32 with ``DOT_FP32``."""
    tile = tl.load(pointers, mask=mask, other=0)
    if FP8:  # codes to their values in the query's dtype: exact (every fp8 value is one)
        tile = fp8_to_fp16(tile, E5M2, SELECT_NAN).to(query_ptr.dtype.element_ty)
        if FENCE:  # the dots read the decoded tile, not the codes
            tile = fence(tile)
    if DOT_FP32:
        tile = tile.to(tl.float32)
    return tile
