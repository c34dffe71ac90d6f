"""The paged KV cache: every layer's K/V in blocks, written and read only through block tables.

:class:`PagedKVCache` owns one K and one V tensor per layer, each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (the layout of ``kernels``). For one engine step,
:meth:`PagedKVCache.step` returns a :class:`PagedStep`, the model's :class:`KVAttention` for that
step. Per layer it writes the step's new K/V with ``kernels.store_kv`` at the step's slot
mapping, then attends with one ``kernels.paged_prefill_attention`` call over the whole step:
decodes (one new token), prompts, prompt chunks over a cached prefix and preempted sequences
being recomputed are all variable-length query chunks of one batch, each reading its whole
context, cached prefix included, through its block table; with a sliding window (the layer's
``window``), only the part of it in the window, so the table entries of blocks wholly before
the window of a sequence's first query in the step are never read and may name released
blocks.

Every K/V row a query reads comes out of the cache through the block table; nothing
is kept on the side. The caches start as NaN, so reading a slot no token was written to poisons
the output instead of passing unnoticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv import kernels
from pagedkv.impl.serving.model import ModelConfig


class PagedKVCache:
    """K/V caches of every layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | None = None,
    ) -> None:
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        self.k = [torch.full(shape, torch.nan, dtype=dtype, device=device) for _ in layers]
        self.v = [torch.full(shape, torch.nan, dtype=dtype, device=device) for _ in layers]
        self.block_size = block_size
        self.scale = config.head_dim**-0.5
        self.backend = backend

    def copy_blocks(self, pairs: torch.Tensor) -> None:
        """Copy-on-write: copy block ``src`` over ``dst`` for each ``(src, dst)`` row, every layer,
        in order (``kernels.copy_blocks``). Run before the step writes any K/V."""
        if len(pairs):
            for k_cache, v_cache in zip(self.k, self.v, strict=True):
                kernels.copy_blocks(k_cache, v_cache, pairs, backend=self.backend)

    def step(
        self,
        block_tables: torch.Tensor,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
    ) -> PagedStep:
        """The attention of one step over a batch of sequences.

        Sequence ``b`` (row ``b`` of ``block_tables``, int32 ``[B, max_blocks]``) contributes
        ``query_lens[b]`` consecutive tokens to the flat step, in batch order: its positions
        ``context_lens[b] - query_lens[b] .. context_lens[b] - 1``. Its table must already hold
        ``context_lens[b]`` tokens. The slots come from ``kernels.slot_mapping``.
        """
        device = self.k[0].device
        block_tables = block_tables.to(device)
        lens = torch.tensor(query_lens, dtype=torch.int64, device=device)
        contexts = torch.tensor(context_lens, dtype=torch.int64, device=device)
        rows = torch.repeat_interleave(torch.arange(len(query_lens), device=device), lens)
        ends = torch.cumsum(lens, 0)  # one past each sequence's last flat token
        positions = torch.arange(rows.numel(), device=device) - ends[rows] + contexts[rows]
        slots = kernels.slot_mapping(
            block_tables, positions, self.block_size, rows, backend=self.backend
        )
        cu_seqlens = torch.cat([ends.new_zeros(1), ends])
        return PagedStep(self, positions, slots, block_tables, cu_seqlens, contexts)


@dataclass(frozen=True)
class PagedStep:
    """One step's view of a :class:`PagedKVCache`: implements
    ``pagedkv.impl.serving.model.KVAttention``."""

    cache: PagedKVCache
    positions: torch.Tensor  # int64 [T]: each flat token's position in its sequence
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor  # int64 [B + 1]: sequence b's flat tokens start at [b]
    context_lens: torch.Tensor  # int64 [B]
    # The windows whose table entries this step has validated (filled by attend).
    checked_windows: set[int | None] = field(default_factory=set)

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write the step's K/V for ``layer``, then attend through the block tables, within
        ``window`` when it is given (``kernels.paged_prefill_attention``'s ``window``). The
        step's slots, tables and lengths are the same in every layer, so their values are
        checked only in the first layer that attends with each window (``validate=``): the
        table entries a window reaches depend on the window."""
        cache, validate = self.cache, window not in self.checked_windows
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        kernels.store_kv(
            key, value, k_cache, v_cache, self.slot_mapping,
            backend=cache.backend, validate=validate,
        )  # fmt: skip
        out = kernels.paged_prefill_attention(
            query, k_cache, v_cache, self.block_tables, self.cu_seqlens_q, self.context_lens,
            cache.scale, window=window, backend=cache.backend, validate=validate,
        )  # fmt: skip
        self.checked_windows.add(window)
        return out
