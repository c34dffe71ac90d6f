"""The dense oracle: the same model decoding one sequence alone with a contiguous KV cache.

:class:`ContiguousKVCache` is the other implementation of
``pagedkv.impl.serving.model.KVAttention``: one ``[1, max_len, num_kv_heads, head_dim]`` K and V per
layer, written at the sequence's next positions. A prompt attends with the same
``kernels.reference.causal_attention`` as the paged prefill, and a single token with
``kernels.contiguous_decode_attention``, the unpaged twin of ``paged_decode_attention``. So the
oracle and the engine share every layer and every attention formula; only where K/V live, and how
they are found, differs. A layer's sliding window is passed to both, so a windowed model (Mistral)
is checked too; the oracle keeps every token (it needs no release rule), the window only masks.
With ``kv_cache_dtype`` an fp8 format, its contiguous cache is fp8 too, written by
``kernels.store_kv`` under ``kv_scales`` (``(k_scale, v_scale)``, every layer) and read as code
value times scale.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv import kernels
from pagedkv.impl.serving.model import CausalLM
from pagedkv.impl.serving.paged_kv import nan_cache
from pagedkv.impl.serving.sampling import sample_token
from pagedkv.kernels import fp8
from pagedkv.kernels.reference import causal_attention


class ContiguousKVCache:
    """One sequence's K/V, contiguous: ``pagedkv.impl.serving.model.KVAttention`` for the dense
    oracle.

    ``length`` tokens are stored. ``attend`` writes the step's tokens at positions ``length ..
    length + T - 1`` of every layer; the caller adds ``T`` to ``length`` after the forward.
    """

    def __init__(
        self,
        model: CausalLM,
        max_len: int,
        backend: str | None = None,
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[float, float] = (1.0, 1.0),
    ) -> None:
        config = model.config
        shape = (config.num_layers, 1, max_len, config.num_kv_heads, config.head_dim)
        self.cache_dtype = fp8.kv_cache_dtype(kv_cache_dtype, model.dtype)
        self.k = nan_cache(shape, self.cache_dtype, model.device)
        self.v = nan_cache(shape, self.cache_dtype, model.device)
        self.fp8 = fp8.format_of(self.cache_dtype) is not None
        self.scales = dict(zip(("k_scale", "v_scale"), kv_scales, strict=True)) if self.fp8 else {}
        self.length = 0
        self.scale = config.head_dim**-0.5
        self.backend = backend

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write the step's K/V after the stored tokens, then attend causally (within
        ``window``) over everything stored."""
        end = self.length + query.shape[0]
        k_cache, v_cache = self.k[layer], self.v[layer]
        slots = torch.arange(self.length, end, device=query.device)
        kernels.store_kv(key, value, k_cache, v_cache, slots, backend="reference", **self.scales)
        if query.shape[0] > 1:  # an fp8 cache's values: its codes' times the scales
            k, v = (
                cache[0, :end].to(query.dtype) * self.scales.get(f"{name}_scale", 1.0)
                for cache, name in ((k_cache, "k"), (v_cache, "v"))
            )
            return causal_attention(query, k, v, self.scale, window=window)
        lens = torch.tensor([end], device=query.device)
        return kernels.contiguous_decode_attention(
            query, k_cache, v_cache, lens, self.scale, window=window, backend=self.backend,
            **self.scales,
        )  # fmt: skip


@dataclass(frozen=True)
class DenseOutput:
    """The oracle's tokens and the logits each was chosen from (``[len(tokens), vocab]``)."""

    tokens: list[int]
    logits: torch.Tensor


def dense_generate(
    model: CausalLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    forced: Sequence[int] | None = None,
    backend: str | None = None,
    kv_cache_dtype: str = "auto",
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> DenseOutput:
    """Decode one sequence alone: prefill ``prompt``, then one token per forward.

    Greedy, stopping after ``max_new_tokens`` tokens or at ``eos_token_id`` (kept). With
    ``forced``, the tokens are ``forced`` instead (teacher forcing): the logits are then those
    the model gives each of them, which scores a sampled output.
    """
    steps = len(forced) if forced is not None else max_new_tokens
    cache = ContiguousKVCache(model, len(prompt) + steps, backend, kv_cache_dtype, kv_scales)
    ids = torch.tensor(list(prompt), dtype=torch.int64, device=model.device)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    for i in range(steps):
        positions = torch.arange(cache.length, cache.length + ids.numel(), device=model.device)
        hidden = model(ids, positions, cache)
        cache.length += ids.numel()
        logits = model.compute_logits(hidden[-1:])[0]
        token = forced[i] if forced is not None else sample_token(logits)
        tokens.append(token)
        rows.append(logits)
        if forced is None and token == eos_token_id:
            break
        ids = torch.tensor([token], dtype=torch.int64, device=model.device)
    logits = torch.stack(rows) if rows else torch.empty(0, model.config.vocab_size)
    return DenseOutput(tokens, logits)
