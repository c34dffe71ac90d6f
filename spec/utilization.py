"""KV-cache memory: utilization of contiguous reservation versus paged allocation, and the bytes
a block takes.

Utilization is the fraction of the KV slots set aside for requests that actually hold a token's
K/V state: ``used_slots / reserved_slots``. Everything is computed from per-request token counts.
A KV byte budget holds as many blocks as :func:`bytes_per_block` divides into it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pagedkv.spec.block_manager import blocks_needed, check_int
from pagedkv.spec.fp8 import ALIASES, FORMATS


@dataclass(frozen=True)
class Usage:
    """Slots set aside for a batch of requests and how many of them hold token states."""

    reserved_slots: int
    used_slots: int
    waste_per_request: tuple[int, ...]

    @property
    def utilization(self) -> float:
        """Fraction of reserved slots that hold token states (1.0 for an empty batch)."""
        return self.used_slots / self.reserved_slots if self.reserved_slots else 1.0

    @property
    def wasted_slots(self) -> int:
        """Reserved slots that hold nothing."""
        return self.reserved_slots - self.used_slots


def _check_counts(token_counts: Sequence[int]) -> list[int]:
    return [check_int("token count", count, 0) for count in token_counts]


def contiguous_usage(token_counts: Sequence[int], max_len: int) -> Usage:
    """Rule: contiguous allocation reserves ``max_len`` slots per request, whatever it uses.

    A request longer than its reservation cannot exist, so ``token_count > max_len`` raises
    ``ValueError``.
    """
    counts = _check_counts(token_counts)
    check_int("max_len", max_len, 0)
    too_long = [count for count in counts if count > max_len]
    if too_long:
        raise ValueError(f"token counts {too_long} exceed the reservation max_len={max_len}")
    return Usage(
        reserved_slots=max_len * len(counts),
        used_slots=sum(counts),
        waste_per_request=tuple(max_len - count for count in counts),
    )


def paged_usage(token_counts: Sequence[int], block_size: int) -> Usage:
    """Rule: paged allocation holds ``ceil(count / block_size)`` blocks per request.

    The only waste is each request's last, partly filled block: at most ``block_size - 1`` slots.
    """
    counts = _check_counts(token_counts)
    check_int("block_size", block_size, 1)
    waste = tuple(blocks_needed(count, block_size) * block_size - count for count in counts)
    return Usage(
        reserved_slots=sum(counts) + sum(waste), used_slots=sum(counts), waste_per_request=waste
    )


KV_ELEMENT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2} | dict.fromkeys(FORMATS, 1)
"""Bytes a K or V element takes in the cache, by ``kv_cache_dtype`` (``fp8`` is ``fp8_e4m3``)."""


def bytes_per_block(
    block_size: int, num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str
) -> int:
    """Rule: a block holds K and V of ``block_size`` tokens for every layer and KV head:
    ``2 * num_layers * block_size * num_kv_heads * head_dim * element bytes``. An fp8 cache's
    scales are per layer (and KV head), outside the blocks."""
    sizes = [
        check_int(name, value, 1)
        for name, value in (
            ("block_size", block_size), ("num_layers", num_layers),
            ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
        )
    ]  # fmt: skip
    dtype = ALIASES.get(kv_cache_dtype, kv_cache_dtype) if isinstance(kv_cache_dtype, str) else None
    if dtype not in KV_ELEMENT_BYTES:
        accepted = sorted([*KV_ELEMENT_BYTES, *ALIASES])
        raise ValueError(f"kv_cache_dtype must be one of {accepted}, got {kv_cache_dtype!r}")
    return 2 * math.prod(sizes) * KV_ELEMENT_BYTES[dtype]


def blocks_in_budget(budget_bytes: int, block_bytes: int) -> int:
    """Rule: a KV byte budget holds ``floor(budget_bytes / block_bytes)`` blocks."""
    return check_int("budget_bytes", budget_bytes, 0) // check_int("block_bytes", block_bytes, 1)
