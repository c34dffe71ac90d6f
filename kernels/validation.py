"""Argument checks that run before any kernel launches, so a bad call raises and changes nothing.

Error types follow the spec: ``TypeError`` for a wrong kind or dtype, ``ValueError`` for a wrong
shape, device or value, ``IndexError`` for a block id, slot, position or context length outside
what the cache or the block table holds. Every message names the offending argument.

These checks are what keeps every kernel inside the caches: a kernel only reads the block-table
entries below ``ceil(context_len / block_size)`` (with a sliding window, only those from the
block of the window's first key on), and every such entry is checked here to lie in
``[0, num_blocks)``. Data-dependent checks read the tensors' values on the host, in numpy, which
synchronizes a GPU.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from numpy.typing import NDArray

from pagedkv.spec.checks import INT32_MAX, INT64_MAX, MAX_INT32_BLOCKS, check_int

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INDEX_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 64  # split-K ranges per sequence, at most
# Block ids are int32, so a pool has at most MAX_INT32_BLOCKS = 2**31 blocks; and slots are int64,
# so the largest slot, (2**31 - 1) * block_size + block_size - 1 = 2**31 * block_size - 1, fits
# for block sizes up to 2**32.
MAX_NUM_BLOCKS = MAX_INT32_BLOCKS
MAX_BLOCK_SIZE = 2**32


@dataclass(frozen=True)
class CacheShape:
    """``[num_blocks, block_size, num_kv_heads, head_dim]`` of a K/V cache pair."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int


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


def check_float_dtype(name: str, dtype: object) -> torch.dtype:
    """One of :data:`FLOAT_DTYPES` (``TypeError`` naming ``name`` otherwise)."""
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {dtype!r}")
    return dtype


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


def check_shape(name: str, tensor: torch.Tensor, expected: Sequence[int]) -> None:
    """``tensor.shape == expected``."""
    if tuple(tensor.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(tensor.shape)}")


def check_caches(k_cache: object, v_cache: object) -> CacheShape:
    """Two contiguous float caches of one shape, dtype and device."""
    k = check_tensor("k_cache", k_cache, 4, FLOAT_DTYPES)
    v = check_tensor("v_cache", v_cache, 4, FLOAT_DTYPES)
    check_shape("v_cache", v, k.shape)
    if v.dtype != k.dtype:
        raise TypeError(f"v_cache has dtype {v.dtype} but k_cache has {k.dtype}")
    check_same_device(k_cache=k, v_cache=v)
    for name, cache in (("k_cache", k), ("v_cache", v)):
        if not cache.is_contiguous():
            raise ValueError(f"{name} must be contiguous [num_blocks, block_size, heads, dim]")
    check_disjoint("k_cache", k, "v_cache", v)
    num_blocks, block_size, num_kv_heads, head_dim = k.shape
    for name, size in (("block_size", block_size), ("num_kv_heads", num_kv_heads)):
        if size < 1:
            raise ValueError(f"k_cache {name} must be >= 1, got shape {tuple(k.shape)}")
    if head_dim < 1:
        raise ValueError(f"k_cache head_dim must be >= 1, got shape {tuple(k.shape)}")
    return CacheShape(num_blocks, block_size, num_kv_heads, head_dim)


def _host(tensor: torch.Tensor) -> NDArray[np.integer]:
    """``tensor``'s values as a numpy array on the host, in its own dtype: a view of a CPU
    tensor, else a copy (for a GPU tensor, the one device-to-host read a value check needs).
    The value checks run in numpy, where an operation on a step's few hundred entries costs
    about a microsecond against torch's several."""
    return tensor.detach().cpu().numpy()


def _values(tensor: torch.Tensor) -> NDArray[np.int64]:
    """:func:`_host` widened to int64, for arithmetic (a block table is only compared and
    indexed, so it is read with :func:`_host`, not copied)."""
    return _host(tensor).astype(np.int64, copy=False)


def _first_true(mask: NDArray[np.bool_]) -> tuple[int, ...]:
    """Index of the first true element of ``mask`` (which has at least one), in row-major
    order."""
    return tuple(int(i) for i in np.unravel_index(int(mask.argmax()), mask.shape))


def check_block_tables(block_tables: object, batch: int) -> torch.Tensor:
    """An int32 ``[batch, max_blocks]`` table."""
    table = check_tensor("block_tables", block_tables, 2, (torch.int32,))
    if table.shape[0] != batch:
        raise ValueError(
            f"block_tables must have one row per sequence ({batch}), got shape {tuple(table.shape)}"
        )
    return table


def check_context_lens(context_lens: object, batch: int) -> torch.Tensor:
    """An integer ``[batch]`` tensor (its values are checked by ``check_context_values``)."""
    lens = check_tensor("context_lens", context_lens, 1, INDEX_DTYPES)
    check_shape("context_lens", lens, (batch,))
    return lens


def window_starts(
    lens: torch.Tensor, query_lens: torch.Tensor | int, window: int | None
) -> torch.Tensor:
    """The first key position each sequence's attention reads (int64 ``[batch]``).

    Sequence ``b``'s queries are its last ``query_lens[b]`` tokens (an int: the same count for
    every sequence), so its first query sits at ``f = lens[b] - query_lens[b]`` and, with window
    ``w``, reads keys from ``max(0, f - w + 1)``; without a window, from 0. A sequence with no
    queries reads nothing; its start is that of a query at ``f = lens[b]`` (the position it
    would compute next), so its blocks are held to the same rule.
    """
    lens64 = lens.to(torch.int64)
    if window is None:
        return torch.zeros_like(lens64)
    return (lens64 - query_lens - window + 1).clamp(min=0)


def check_context_values(
    lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_blocks: int,
    starts: torch.Tensor | None = None,
) -> None:
    """Lengths in ``[0, capacity]``, and every table entry they reach in ``[0, num_blocks)``.

    A length of 0 marks a padding sequence; its table row is never read. With ``starts`` (int64
    ``[batch]``, from :func:`window_starts`) sequence ``b`` reaches only the entries of the
    blocks that hold positions ``starts[b] .. lens[b] - 1``: entries below ``starts[b] //
    block_size`` belong to blocks wholly outside the window, which no kernel reads, so they
    may hold anything (a released block's id, ``-1``, another sequence's block).
    """
    batch, max_blocks = block_tables.shape
    if batch == 0:
        return
    lens_, tables = _values(lens), _host(block_tables)
    negative = lens_ < 0
    if negative.any():
        (b,) = _first_true(negative)
        raise ValueError(f"context_lens[{b}] = {int(lens_[b])} is negative")
    capacity = max_blocks * block_size
    too_long = lens_ > min(capacity, INT64_MAX)  # no int64 length exceeds a larger capacity
    if too_long.any():
        (b,) = _first_true(too_long)
        raise IndexError(
            f"context_lens[{b}] = {int(lens_[b])} exceeds the block table's capacity of "
            f"{capacity} tokens ({max_blocks} blocks of {block_size})"
        )
    beyond_int32 = lens_ > INT32_MAX  # the decode kernel counts tokens in int32
    if beyond_int32.any():
        (b,) = _first_true(beyond_int32)
        raise ValueError(f"context_lens[{b}] = {int(lens_[b])} exceeds {INT32_MAX} (int32)")
    used_blocks = (lens_ + block_size - 1) // block_size
    columns = np.arange(max_blocks)
    read = columns[None, :] < used_blocks[:, None]
    if starts is not None:
        read &= columns[None, :] >= (_values(starts) // block_size)[:, None]
    bad = read & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        b, j = _first_true(bad)
        raise IndexError(
            f"block_tables[{b}, {j}] = {int(tables[b, j])} is outside the cache's "
            f"blocks [0, {num_blocks}) (read for context_lens[{b}] = {int(lens_[b])})"
        )


def check_decode_query(query: object, caches: CacheShape, dtype: torch.dtype) -> torch.Tensor:
    """A ``[batch, num_heads, head_dim]`` query matching the caches; heads a multiple of KV's."""
    q = check_tensor("query", query, 3, FLOAT_DTYPES)
    if q.dtype != dtype:
        raise TypeError(f"query has dtype {q.dtype} but the caches have {dtype}")
    _, num_heads, head_dim = q.shape
    if head_dim != caches.head_dim:
        raise ValueError(f"query head_dim {head_dim} != cache head_dim {caches.head_dim}")
    if num_heads < 1 or num_heads % caches.num_kv_heads:
        raise ValueError(
            f"query num_heads ({num_heads}) must be a positive multiple of the caches' "
            f"num_kv_heads ({caches.num_kv_heads})"
        )
    return q


def check_num_splits(num_splits: object) -> int | None:
    """``None`` (choose automatically) or an int in ``[1, MAX_SPLITS]``."""
    if num_splits is None:
        return None
    check_int("num_splits", num_splits, 1)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits must be <= {MAX_SPLITS}, got {num_splits}")
    return num_splits


def check_scale(scale: object, head_dim: int) -> float:
    """The softmax scale, by default ``1 / sqrt(head_dim)``: a number that is finite and above 0
    in fp32, where the kernels apply it (so ``1e-50`` and ``1e39``, 0 and inf there, are
    refused; a subnormal fp32 scale is accepted)."""
    if scale is None:
        return head_dim**-0.5
    value = check_number("scale", scale, allow_zero=False)
    try:  # the fp32 value, computed on the host without a tensor
        in_fp32 = struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:  # beyond fp32's largest finite value: inf there
        in_fp32 = math.inf
    if not 0 < in_fp32 < math.inf:
        raise ValueError(f"scale must be finite and > 0 in fp32, got {scale}")
    return value


def check_number(name: str, value: object, *, allow_zero: bool) -> float:
    """A finite ``int`` or ``float`` (``bool`` is not a number here) above 0, or at least 0 with
    ``allow_zero``; returned as a float. ``TypeError``/``ValueError`` naming it otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value}")
    return float(value)


def check_kv_rows(
    key: object, value: object, caches: CacheShape, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``key`` and ``value`` of shape ``[tokens, num_kv_heads, head_dim]`` in the caches' dtype."""
    k = check_tensor("key", key, 3, FLOAT_DTYPES)
    v = check_tensor("value", value, 3, FLOAT_DTYPES)
    expected = (k.shape[0], caches.num_kv_heads, caches.head_dim)
    check_shape("key", k, expected)
    check_shape("value", v, expected)
    for name, tensor in (("key", k), ("value", v)):
        if tensor.dtype != dtype:
            raise TypeError(f"{name} has dtype {tensor.dtype} but the caches have {dtype}")
    return k, v


def check_sources_apart(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """The rows ``store_kv`` reads share no memory with the caches it writes (``key`` and
    ``value`` may overlap each other: both are only read)."""
    for source, tensor in (("key", key), ("value", value)):
        for cache, target in (("k_cache", k_cache), ("v_cache", v_cache)):
            check_disjoint(source, tensor, cache, target)


def check_slots(slot_mapping: object, num_tokens: int) -> torch.Tensor:
    """An integer ``[num_tokens]`` tensor (its values are checked by ``check_slot_values``)."""
    slots = check_tensor("slot_mapping", slot_mapping, 1, INDEX_DTYPES)
    check_shape("slot_mapping", slots, (num_tokens,))
    return slots


def check_slot_values(slots: torch.Tensor, num_slots: int) -> None:
    """Slots in ``[-1, num_slots)``, ``-1`` meaning skip; the other slots are distinct."""
    if slots.numel() == 0:
        return
    values = _values(slots)
    bad = (values < -1) | (values >= num_slots)
    if bad.any():
        (t,) = _first_true(bad)
        raise IndexError(
            f"slot_mapping[{t}] = {int(values[t])} is outside the cache's slots "
            f"[0, {num_slots}) (-1 skips a token)"
        )
    written = np.sort(values[values >= 0])
    if (written[1:] == written[:-1]).any():
        raise ValueError("slot_mapping writes one slot twice; the result would be undefined")


def check_token_index(
    positions: object, seq_ids: object, batch: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` ``[batch]``, or ``[tokens]`` with ``seq_ids`` ``[tokens]``; both as int64.

    Without ``seq_ids`` token ``b`` belongs to sequence ``b``.
    """
    pos = check_tensor("positions", positions, 1, INDEX_DTYPES)
    if seq_ids is None:
        check_shape("positions", pos, (batch,))
        seq = torch.arange(batch, device=pos.device)
    else:
        seq = check_tensor("seq_ids", seq_ids, 1, INDEX_DTYPES)
        check_shape("seq_ids", seq, pos.shape)
        check_same_device(positions=pos, seq_ids=seq)
    return pos.to(torch.int64), seq.to(torch.int64)


def check_position_values(
    pos: torch.Tensor,
    seq: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
    num_blocks: int | None,
) -> None:
    """Positions in ``[-1, capacity)`` (``-1`` is padding) and the table entries they reach.

    Every entry a non-padding position reaches must be ``>= 0`` and, when ``num_blocks`` is
    given, ``< num_blocks``; its ``seq_ids`` entry must name a row of the table.
    """
    batch, max_blocks = block_tables.shape
    pos_, seq_ = _values(pos), _values(seq)
    below = pos_ < -1
    if below.any():
        (t,) = _first_true(below)
        raise ValueError(f"positions[{t}] = {int(pos_[t])} is negative (-1 marks padding)")
    live = pos_ >= 0
    if not live.any():  # padding only (or no tokens): no table entry is read
        return
    bad_seq = live & ((seq_ < 0) | (seq_ >= batch))
    if bad_seq.any():
        (t,) = _first_true(bad_seq)
        raise IndexError(f"seq_ids[{t}] = {int(seq_[t])} is outside the batch [0, {batch})")
    capacity = max_blocks * block_size
    if capacity <= INT64_MAX:  # a larger capacity holds every int64 position
        beyond = pos_ >= capacity
        if beyond.any():
            (t,) = _first_true(beyond)
            raise IndexError(
                f"positions[{t}] = {int(pos_[t])} is beyond the block table's capacity of "
                f"{capacity} slots"
            )
    safe_seq = np.where(live, seq_, 0)
    entries = _host(block_tables)[safe_seq, np.where(live, pos_, 0) // block_size]
    bad = live & (entries < 0)
    if num_blocks is not None:
        bad |= live & (entries >= num_blocks)
    if bad.any():
        (t,) = _first_true(bad)
        row, column = int(safe_seq[t]), int(pos_[t]) // block_size
        limit = f"[0, {num_blocks})" if num_blocks is not None else "[0, inf)"
        raise IndexError(
            f"block_tables[{row}, {column}] = {int(entries[t])} (reached by positions[{t}]) "
            f"is outside {limit}"
        )


def check_pairs(pairs: object, num_blocks: int) -> list[tuple[int, int]]:
    """``(src, dst)`` block-id pairs, each id in ``[0, num_blocks)``.

    Accepts a sequence of pairs or an integer tensor of shape ``[num_pairs, 2]``.
    """
    if isinstance(pairs, torch.Tensor):
        if pairs.dtype not in INDEX_DTYPES:
            raise TypeError(f"pairs must have an integer dtype, got {pairs.dtype}")
        if pairs.dim() != 2 or pairs.shape[1] != 2:
            raise ValueError(f"pairs must have shape [num_pairs, 2], got {tuple(pairs.shape)}")
        pairs = pairs.tolist()
    if not isinstance(pairs, Sequence) or isinstance(pairs, (str, bytes)):
        raise TypeError(f"pairs must be a sequence of (src, dst), got {type(pairs).__name__}")
    checked: list[tuple[int, int]] = []
    for index, pair in enumerate(pairs):
        if not isinstance(pair, Sequence) or len(pair) != 2:
            raise ValueError(f"pairs[{index}] must be a (src, dst) pair, got {pair!r}")
        for role, block_id in zip(("src", "dst"), pair, strict=True):
            if isinstance(block_id, bool) or not isinstance(block_id, int):
                raise TypeError(
                    f"pairs[{index}] {role} must be an int, got {type(block_id).__name__}"
                )
            if not 0 <= block_id < num_blocks:
                raise IndexError(
                    f"pairs[{index}] {role} = {block_id} is outside the cache's blocks "
                    f"[0, {num_blocks})"
                )
        checked.append((pair[0], pair[1]))
    return checked


def check_cu_seqlens(cu_seqlens_q: object, batch: int) -> torch.Tensor:
    """An integer ``[batch + 1]`` tensor of query offsets (values: ``check_cu_seqlens_values``)."""
    starts = check_tensor("cu_seqlens_q", cu_seqlens_q, 1, INDEX_DTYPES)
    check_shape("cu_seqlens_q", starts, (batch + 1,))
    return starts


def check_max_query_len(max_query_len: int | None, query_lens: torch.Tensor) -> None:
    """A given ``max_query_len`` equals the largest of ``query_lens`` (0 for no sequence):
    ``ValueError`` naming both otherwise. ``None`` passes."""
    if max_query_len is None:
        return
    actual = int(query_lens.max()) if query_lens.numel() else 0
    if max_query_len != actual:
        raise ValueError(
            f"max_query_len = {max_query_len}, but the longest query chunk in cu_seqlens_q has "
            f"{actual} tokens"
        )


def check_max_context_len(max_context_len: int | None, lens: torch.Tensor) -> None:
    """A given ``max_context_len`` equals the largest of ``context_lens`` (0 for no sequence):
    ``ValueError`` naming both otherwise. ``None`` passes."""
    if max_context_len is None:
        return
    actual = int(lens.max()) if lens.numel() else 0
    if max_context_len != actual:
        raise ValueError(
            f"max_context_len = {max_context_len}, but the longest context in context_lens has "
            f"{actual} tokens"
        )


def check_cu_seqlens_values(starts: torch.Tensor, lens: torch.Tensor, num_tokens: int) -> None:
    """Offsets that cut the ``num_tokens`` flat queries into the batch's sequences, in order.

    ``starts[0] == 0``, ``starts[-1] == num_tokens``, non-decreasing, and each sequence's query
    count ``starts[b + 1] - starts[b]`` at most its ``context_lens[b]`` (its queries are its last
    tokens). ``ValueError`` naming the first bad index otherwise.
    """
    offsets = _values(starts)
    first, last = int(offsets[0]), int(offsets[-1])
    if first != 0 or last != num_tokens:
        raise ValueError(
            f"cu_seqlens_q must run from 0 to the query's {num_tokens} tokens, got {first} .. "
            f"{last}"
        )
    query_lens = np.diff(offsets)
    negative = query_lens < 0
    if negative.any():
        (b,) = _first_true(negative)
        raise ValueError(
            f"cu_seqlens_q must not decrease: cu_seqlens_q[{b + 1}] = {int(offsets[b + 1])} < "
            f"cu_seqlens_q[{b}] = {int(offsets[b])}"
        )
    lens_ = _values(lens)
    beyond = query_lens > lens_
    if beyond.any():
        (b,) = _first_true(beyond)
        raise ValueError(
            f"sequence {b} has {int(query_lens[b])} query tokens (cu_seqlens_q) but "
            f"context_lens[{b}] = {int(lens_[b])}: its queries are its last tokens"
        )
