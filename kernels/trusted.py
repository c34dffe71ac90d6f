"""The trusted kernel entries: ``store_kv`` and paged attention with NO checks, on a resolved
backend.

Each public function of ``kernels.api`` checks its arguments (types, shapes, dtypes, devices,
memory overlap and, with ``validate``, values), resolves its backend and then calls the function
of the same name here, which only dispatches to that backend's kernel. These check NOTHING: a
caller passes exactly what the public function would after its checks (normalized ``scale``,
``num_splits`` and ``window``; ``backend`` from ``kernels.resolve_backend`` for the tensors'
device), or the kernels read and write outside the caches without an error.

They exist for a caller that checks a whole step once and then makes the same calls layer
after layer: ``PagedKVCache.step`` (``pagedkv.impl.serving.paged_kv``) takes a step's
tables from the store, which built them valid (its ``check_tables`` debug mode checks them),
and each layer's ``PagedStep.attend`` compares its query, key and
value with the shapes, dtype and device the step was checked for, going through the public
functions whenever they differ. The public functions' metadata checks cost tens of microseconds
a call, several calls a layer.
"""

from __future__ import annotations

import torch

from pagedkv.kernels import reference
from pagedkv.kernels.backend import Backend
from pagedkv.kernels.fp8 import FP8_DTYPES

Scales = tuple[torch.Tensor, torch.Tensor] | None
"""An fp8 cache's ``(k_scale, v_scale)``, fp32 ``[num_kv_heads]`` each; ``None`` for others."""


def _codes(cache: torch.Tensor) -> tuple[torch.Tensor, str | None]:
    """A cache as the compiled kernels see it: an fp8 cache's ``uint8`` view and its format's
    name, any other cache itself and ``None``."""
    name = FP8_DTYPES.get(cache.dtype)
    return (cache.view(torch.uint8), name) if name is not None else (cache, None)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    backend: Backend,
    scales: Scales = None,
) -> None:
    """``kernels.store_kv`` without its checks, on ``backend``."""
    (k_codes, fp8), (v_codes, _) = _codes(k_cache), _codes(v_cache)
    if backend == "reference":
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, scales)
    elif backend == "numba":
        from pagedkv.kernels import numba_cache

        numba_cache.store_kv(key, value, k_codes, v_codes, slot_mapping, scales, fp8)
    else:
        from pagedkv.kernels import triton_store_kv

        triton_store_kv.launch(key, value, k_codes, v_codes, slot_mapping, scales, fp8)


def paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
    window: int | None,
    max_context_len: int | None,
    backend: Backend,
    scales: Scales = None,
) -> torch.Tensor:
    """``kernels.paged_decode_attention`` without its checks, on ``backend`` (``block_tables``
    ``None``: ``kernels.contiguous_decode_attention``'s contiguous caches)."""
    if backend != "triton" and not (backend == "numba" and query.dtype == torch.float32):
        if block_tables is None:  # the reference, and numba's fp16 / bf16
            return reference.contiguous_decode_attention(
                query, k_cache, v_cache, context_lens, scale, window, scales
            )
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, window, scales=scales
        )
    (k_codes, fp8), (v_codes, _) = _codes(k_cache), _codes(v_cache)
    if backend == "numba":
        from pagedkv.kernels import numba_attention

        return numba_attention.decode(
            query, k_codes, v_codes, block_tables, context_lens, scale, num_splits, window,
            scales, fp8,
        )  # fmt: skip
    from pagedkv.kernels import triton_decode

    return triton_decode.launch(
        query, k_codes, v_codes, block_tables, context_lens, scale, num_splits, window,
        max_context_len=max_context_len, scales=scales, fp8=fp8,
    )  # fmt: skip


def paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None,
    max_query_len: int | None,
    backend: Backend,
    scales: Scales = None,
) -> torch.Tensor:
    """``kernels.paged_prefill_attention`` without its checks, on ``backend``."""
    if backend != "triton" and not (backend == "numba" and query.dtype == torch.float32):
        return reference.paged_prefill_attention(  # the reference, and numba's fp16 / bf16
            query, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window,
            scales=scales,
        )  # fmt: skip
    (k_codes, fp8), (v_codes, _) = _codes(k_cache), _codes(v_cache)
    if backend == "numba":
        from pagedkv.kernels import numba_attention

        return numba_attention.prefill(
            query, k_codes, v_codes, block_tables, cu_seqlens_q, context_lens, scale, window,
            scales, fp8,
        )  # fmt: skip
    from pagedkv.kernels import triton_prefill

    return triton_prefill.launch(
        query, k_codes, v_codes, block_tables, cu_seqlens_q, context_lens, scale, window,
        max_query_len, scales=scales, fp8=fp8,
    )  # fmt: skip
