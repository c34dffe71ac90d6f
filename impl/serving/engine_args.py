"""The checks :class:`pagedkv.impl.serving.engine.PagedAttentionEngine` makes of its own
arguments and of each request's, beyond those the scheduler and the block layer make: pure
functions that raise ``TypeError``/``ValueError`` naming the argument, or return it checked.
"""

from __future__ import annotations

from collections import abc

import torch

from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.serving.sampling import check_temperature
from pagedkv.kernels.check_arguments import check_bool
from pagedkv.kernels.fp8 import format_of, kv_cache_dtype
from pagedkv.spec.block_manager import check_int
from pagedkv.spec.checks import check_tokens
from pagedkv.spec.fp8 import check_kv_scale


def check_speculation(draft_source: object, num_speculative_tokens: object) -> None:
    """``draft_source`` is None or callable, and ``num_speculative_tokens`` an int, >= 1 with a
    source and 0 without."""
    check_int("num_speculative_tokens", num_speculative_tokens, 0)
    if draft_source is not None and not callable(draft_source):
        raise TypeError(f"draft_source must be callable, got {type(draft_source).__name__}")
    if (draft_source is None) != (num_speculative_tokens == 0):
        raise ValueError("draft_source and num_speculative_tokens >= 1 go together")


def block_manager(
    total_blocks: int, block_size: int, prefix_caching: object, kv_events: object
) -> BlockManager | PrefixCachingBlockManager:
    """The pool's manager, prefix-caching (recording KV events with ``kv_events``) or not.
    Both flags are bools (``enable_prefix_caching`` and ``enable_kv_events``), and KV events
    need prefix caching; the manager raises for a bad pool."""
    check_bool("enable_prefix_caching", prefix_caching)
    check_bool("enable_kv_events", kv_events)
    if kv_events and not prefix_caching:
        raise ValueError("enable_kv_events needs enable_prefix_caching: events report cache keys")
    if prefix_caching:
        return PrefixCachingBlockManager(total_blocks, block_size, enable_kv_events=kv_events)
    return BlockManager(total_blocks, block_size)


def check_prompt(prompt: abc.Sequence[int], vocab_size: int) -> list[int]:
    """A prompt of ints in ``[0, vocab_size)`` (the scheduler's checks follow), as plain ints."""
    tokens = check_tokens(prompt)
    if any(token >= vocab_size for token in tokens):
        raise ValueError(f"prompt tokens must lie in [0, {vocab_size})")
    return tokens


def check_options(
    temperature: object,
    eos_token_id: object,
    seed: object,
    vocab_size: int,
    num_speculative_tokens: int,
) -> tuple[float, int | None]:
    """A request's options: a temperature by ``sampling.check_temperature``'s rule, and 0 when
    decoding speculatively (``num_speculative_tokens >= 1``); ``eos_token_id`` None or in
    ``[0, vocab_size)``; ``seed`` None or an int >= 0. Returns the temperature as a float and
    the seed as a plain int (or None)."""
    temperature = check_temperature(temperature)
    if temperature and num_speculative_tokens:
        raise ValueError(
            "speculative decoding is greedy only: temperature must be 0 with "
            f"num_speculative_tokens={num_speculative_tokens}, got {temperature}"
        )
    if seed is not None:
        seed = check_int("seed", seed, 0)
    if eos_token_id is not None and check_int("eos_token_id", eos_token_id, 0) >= vocab_size:
        raise ValueError(f"eos_token_id must lie in [0, {vocab_size}), got {eos_token_id}")
    return temperature, seed  # type: ignore[return-value]


def check_kv_cache(
    name: object, kv_scales: object, compute_dtype: torch.dtype
) -> tuple[torch.dtype, tuple[float, float] | str | None]:
    """The KV cache's dtype (``fp8.kv_cache_dtype``'s rule for ``kv_cache_dtype``) and, for an
    fp8 cache, its ``(k_scale, v_scale)``: ``kv_scales``, a pair of numbers each positive and
    finite in fp32 (``None``: 1.0 each, as vLLM's default), or ``"calculate"``: each layer's,
    from the first forward's K/V (``PagedKVCache``); a cache that is not fp8 takes none
    (``ValueError``)."""
    dtype = kv_cache_dtype(name, compute_dtype)
    if format_of(dtype) is None:
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for fp8 caches only; kv_cache_dtype is {name!r}")
        return dtype, None
    if kv_scales is None:
        return dtype, (1.0, 1.0)
    if isinstance(kv_scales, str) and kv_scales == "calculate":
        return dtype, "calculate"
    if not isinstance(kv_scales, tuple) or len(kv_scales) != 2:
        raise TypeError(f"kv_scales must be (k_scale, v_scale) or 'calculate', got {kv_scales!r}")
    return dtype, (check_kv_scale("k_scale", kv_scales[0]), check_kv_scale("v_scale", kv_scales[1]))
