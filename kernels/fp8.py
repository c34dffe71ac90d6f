"""fp8 KV caches in the kernels: which cache dtypes are fp8, the K/V scales a call takes, and the
torch reference of ``spec.fp8``'s store and read rules.

An fp8 cache is a ``torch.float8_e4m3fn`` (``fp8_e4m3``) or ``torch.float8_e5m2`` (``fp8_e5m2``)
tensor; the dtype names the format. Its K/V rows and queries are fp32, fp16 or bf16. A call on an
fp8 cache takes ``k_scale`` and ``v_scale``: a number (one scale for every KV head), or an fp32
tensor ``[num_kv_heads]`` (one per head) on the caches' device; ``None`` is 1.0. A store writes
the code of ``x / scale`` (``spec.fp8.quantize``); attention reads ``code value * scale``.
Every kernel sees an fp8 cache through a ``uint8`` view: torch's CPU indexing, SDPA and
``.numpy()`` do not take fp8 dtypes, nor do Triton's fp8 types load on every GPU.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.spec.fp8 import (
    SMALLEST_NORMAL_FP32,
    Fp8Format,
    check_kv_scale,
    encode,
    fp8_format,
    largest_finite,
)

FP8_DTYPES: dict[torch.dtype, str] = {
    torch.float8_e4m3fn: "fp8_e4m3",
    torch.float8_e5m2: "fp8_e5m2",
}


def kv_cache_dtype(name: object, compute_dtype: torch.dtype) -> torch.dtype:
    """The cache dtype ``kv_cache_dtype=name`` asks for, by vLLM's names: ``"auto"`` the
    model's own (``compute_dtype``), ``"fp8"``/``"fp8_e4m3"`` and ``"fp8_e5m2"`` the fp8
    formats. ``TypeError`` / ``ValueError`` naming ``kv_cache_dtype`` otherwise."""
    if not isinstance(name, str):
        raise TypeError(f"kv_cache_dtype must be a str, got {type(name).__name__}")
    if name == "auto":
        return compute_dtype
    try:
        fmt = fp8_format(name)
    except ValueError:
        raise ValueError(f"kv_cache_dtype must be 'auto' or an fp8 format: {name!r}") from None
    return next(dtype for dtype, format_name in FP8_DTYPES.items() if format_name == fmt.name)


def encode_limits(fmt: Fp8Format) -> tuple[int, int]:
    """``(largest code, its value's fp32 bits as an int32)``: where the compiled encoders
    saturate."""
    top = largest_finite(fmt)
    return encode(top, fmt), int(np.float32(top).view(np.int32))


def format_of(dtype: torch.dtype) -> Fp8Format | None:
    """The fp8 format a cache of ``dtype`` stores, or ``None`` for an fp32/fp16/bf16 cache."""
    name = FP8_DTYPES.get(dtype)
    return fp8_format(name) if name is not None else None


def check_kv_scales(
    k_scale: object, v_scale: object, cache: torch.Tensor, validate: bool
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The scales of a call on ``cache``'s K/V, as fp32 ``[num_kv_heads]`` tensors on its
    device; ``None`` for a cache that is not fp8, which takes none (``ValueError`` if given).

    A number must pass ``spec.fp8.check_kv_scale``; a tensor must be fp32 ``[num_kv_heads]`` on
    the caches' device (``TypeError`` / ``ValueError``), and with ``validate`` every entry
    positive and finite (``ValueError``; reading the values synchronizes a GPU)."""
    if format_of(cache.dtype) is None:
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
            if scale is not None:
                raise ValueError(f"{name} is for fp8 caches only; the caches are {cache.dtype}")
        return None
    num_kv_heads = cache.shape[2]
    return tuple(  # type: ignore[return-value]
        _scale_tensor(name, scale, num_kv_heads, cache.device, validate)
        for name, scale in (("k_scale", k_scale), ("v_scale", v_scale))
    )


def _scale_tensor(
    name: str, scale: object, num_kv_heads: int, device: torch.device, validate: bool
) -> torch.Tensor:
    """One of :func:`check_kv_scales`' scales, checked, as a tensor."""
    if not isinstance(scale, torch.Tensor):
        value = 1.0 if scale is None else check_kv_scale(name, scale)
        return torch.full((num_kv_heads,), value, dtype=torch.float32, device=device)
    if scale.dtype != torch.float32:
        raise TypeError(f"{name} must be a float or an fp32 tensor, got dtype {scale.dtype}")
    if tuple(scale.shape) != (num_kv_heads,):
        raise ValueError(
            f"{name} must have shape ({num_kv_heads},) (one per KV head), got {tuple(scale.shape)}"
        )
    if scale.device != device:
        raise ValueError(f"{name} is on {scale.device} but the caches are on {device}")
    if validate and not bool(((scale > 0) & torch.isfinite(scale)).all()):
        raise ValueError(f"{name} must be positive and finite, got {scale.tolist()}")
    return scale.contiguous()  # the kernels read head h's at element h


def quantize(rows: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The codes (``uint8``) that store ``rows`` (``[..., num_kv_heads, head_dim]``) under the
    per-head ``scale`` in a cache of ``dtype``: ``spec.fp8.quantize`` element by element, made of
    torch's own cast (nearest, ties to even) after saturating at the format's largest value."""
    fmt = format_of(dtype)
    assert fmt is not None
    top = largest_finite(fmt)
    x = rows.float() / scale[:, None]  # IEEE fp32 division
    codes = x.clamp(-top, top).to(dtype).view(torch.uint8)  # clamp keeps NaN; inf saturates
    return torch.where(torch.isnan(x), fmt.nan_code, codes).to(torch.uint8)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp32 values of ``codes`` (``uint8`` ``[..., num_kv_heads, n, head_dim]``, head-major
    as ``reference.gather_kv`` returns them) under the per-head ``scale``: code value times
    scale, in fp32."""
    return codes.view(dtype).float() * scale[:, None, None]


def calibrated_scales(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``spec.fp8.calibrated_scale`` of ``rows`` (``[tokens, num_kv_heads, head_dim]``, their
    largest magnitude by ``amax``: NaN if one is) for a cache of ``dtype``, as one fp32 scale
    repeated for every KV head; computed on the rows' device, nothing read back."""
    fmt = format_of(dtype)
    assert fmt is not None
    if rows.numel() == 0:  # no values: the default scale
        return torch.ones(rows.shape[1], dtype=torch.float32, device=rows.device)
    amax = rows.detach().float().abs().amax()
    scale = amax / (largest_finite(fmt) / 2)
    usable = (scale >= SMALLEST_NORMAL_FP32) & (scale < torch.inf)  # NaN compares false
    return torch.where(usable, scale, 1.0).expand(rows.shape[1]).contiguous()
