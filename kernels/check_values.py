"""Checks of the values a kernel reads through its tensors: block ids, lengths, slots, positions.

These checks are what keeps every kernel inside the caches: a kernel only reads the block-table
entries below ``ceil(context_len / block_size)`` (with a sliding window, only those from the
block of the window's first key on), and every such entry is checked here to lie in
``[0, num_blocks)``. They read the tensors' values on the host, in numpy, which synchronizes a
GPU; errors as in ``kernels.check_arguments``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from numpy.typing import NDArray

from pagedkv.kernels.check_arguments import INDEX_DTYPES
from pagedkv.spec.checks import INT32_MAX, INT64_MAX


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
