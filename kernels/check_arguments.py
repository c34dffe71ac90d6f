"""Checks of a kernel call's plain arguments: kinds, numbers, tensors, devices and memory.

Every check of ``kernels`` runs before any kernel launches, so a bad call raises and changes
nothing. Error types follow the spec: ``TypeError`` for a wrong kind or dtype, ``ValueError``
for a wrong shape, device or value, ``IndexError`` for a block id, slot, position or context
length outside what the cache or the block table holds. Every message names the offending
argument. The shapes a kernel's tensors must agree on are checked in ``kernels.check_shapes``,
the values it reads through them in ``kernels.check_values``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from pagedkv.spec.checks import MAX_INT32_BLOCKS, check_int
from pagedkv.spec.fp8 import to_fp32

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 64  # split-K ranges per sequence, at most
# Block ids are int32, so a pool has at most MAX_INT32_BLOCKS = 2**31 blocks; and slots are int64,
# so the largest slot, (2**31 - 1) * block_size + block_size - 1 = 2**31 * block_size - 1, fits
# for block sizes up to 2**32.
MAX_NUM_BLOCKS = MAX_INT32_BLOCKS
MAX_BLOCK_SIZE = 2**32


def check_int_range(name: str, value: object, minimum: int, maximum: int) -> int:
    """An int in ``[minimum, maximum]``: ``check_int``'s rule, and ``ValueError`` above
    ``maximum``."""
    checked = check_int(name, value, minimum)
    if checked > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {checked}")
    return checked


def check_bool(name: str, value: object) -> bool:
    """A flag is a plain ``bool``: ``TypeError`` naming it otherwise (``0``/``1`` included)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_number(name: str, value: object, *, allow_zero: bool) -> float:
    """A finite ``int`` or ``float`` (``bool`` is not a number here) above 0, or at least 0 with
    ``allow_zero``; returned as a float. ``TypeError``/``ValueError`` naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value}")
    return float(value)


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale, by default ``1 / sqrt(head_dim)``: a number that is finite and above 0
    in fp32, where the kernels apply it (so ``1e-50`` and ``1e39``, 0 and inf there, are
    refused; a subnormal fp32 scale is accepted)."""
    if scale is None:
        return head_dim**-0.5
    value = check_number("scale", scale, allow_zero=False)
    in_fp32 = to_fp32(value)  # the fp32 value, computed on the host without a tensor
    if not 0 < in_fp32 < math.inf:
        raise ValueError(f"scale must be finite and > 0 in fp32, got {scale}")
    return value


def check_num_splits(num_splits: object) -> int | None:
    """``None`` (choose automatically) or an int in ``[1, MAX_SPLITS]``."""
    if num_splits is None:
        return None
    check_int("num_splits", num_splits, 1)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {num_splits}")
    return num_splits


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """One of :data:`FLOAT_DTYPES` (``TypeError`` naming ``name`` otherwise)."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return dtype


def check_tensor(
    name: str, value: object, ndim: int, dtypes: tuple[torch.dtype, ...]
) -> torch.Tensor:
    """A ``torch.Tensor`` with ``ndim`` dimensions and one of ``dtypes``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if value.dtype not in dtypes:
        allowed = ", ".join(str(dtype) for dtype in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {value.dtype}")
    return value


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """``tensor.shape == expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """All tensors on one device, which holds values (not ``meta``, where no kernel can read or
    write); returns it."""
    devices = {name: tensor.device for name, tensor in tensors.items()}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name} is on {device} but {first_name} is on {first}")
    if first.type == "meta":
        raise ValueError(f"{first_name} is a meta tensor, which holds no values")
    return first


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[start, end)`` that ``tensor``'s elements can occupy, from its strides."""
    if tensor.numel() == 0:
        return 0, 0
    start = tensor.data_ptr()
    strides = zip(tensor.shape, tensor.stride(), strict=True)
    extent = sum((size - 1) * stride for size, stride in strides)
    return start, start + (extent + 1) * tensor.element_size()


def check_disjoint(first: str, a: torch.Tensor, second: str, b: torch.Tensor) -> None:
    """``a`` and ``b`` share no memory: ``ValueError`` naming both when their byte spans overlap
    (views of one buffer included). Meta tensors have no memory and never overlap."""
    if a.device != b.device or a.device.type == "meta":
        return
    (a_start, a_end), (b_start, b_end) = _byte_span(a), _byte_span(b)
    if a_start < b_end and b_start < a_end:
        raise ValueError(f"{first} and {second} must not share memory, but they overlap")
