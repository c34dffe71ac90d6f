"""The paged KV cache: every layer's K/V in blocks, written and read only through block tables.

:class:`PagedKVCache` owns one K and one V tensor per layer, each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (the layout of ``kernels``). For one engine step,
:meth:`PagedKVCache.step` returns a :class:`PagedStep`, the model's :class:`KVAttention` for that
step. Per layer it writes the step's new K/V with ``kernels.store_kv`` at the step's slot
mapping, then attends:

* a sequence with one new token (decode) reads its context with
  ``kernels.paged_decode_attention``, all such sequences in one call;
* a sequence with several new tokens (a prompt, a prompt chunk, or a preempted sequence being
  recomputed) gathers its whole context, cached prefix included, through its block table
  (``kernels.reference.gather_kv``) and runs causal attention over it
  (``kernels.reference.causal_attention``).

Either way every K/V row a query reads comes out of the cache through the block table; nothing
is kept on the side. The caches start as NaN, so reading a slot no token was written to poisons
the output instead of passing unnoticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv import kernels
from pagedkv.impl.serving.model import ModelConfig
from pagedkv.kernels.reference import causal_attention, gather_kv


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
        decode = lens == 1
        prefills = [
            (end - n, end, block_tables[b], context_len)
            for b, (n, end, context_len) in enumerate(
                zip(query_lens, ends.tolist(), context_lens, strict=True)
            )
            if n > 1
        ]
        return PagedStep(
            self, positions, slots, (ends - 1)[decode], block_tables[decode], contexts[decode],
            prefills,
        )  # fmt: skip


@dataclass(frozen=True)
class PagedStep:
    """One step's view of a :class:`PagedKVCache`: implements
    ``pagedkv.impl.serving.model.KVAttention``."""

    cache: PagedKVCache
    positions: torch.Tensor  # int64 [T]: each flat token's position in its sequence
    slot_mapping: torch.Tensor  # int64 [T]
    decode_tokens: torch.Tensor  # flat index of each one-token sequence's token
    decode_tables: torch.Tensor  # int32 [D, max_blocks]: their block tables
    decode_context_lens: torch.Tensor  # [D]
    prefills: list[tuple[int, int, torch.Tensor, int]]  # (first token, end, table, context len)

    def attend(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        cache = self.cache
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        kernels.store_kv(key, value, k_cache, v_cache, self.slot_mapping, backend=cache.backend)
        out = torch.empty_like(query)
        if self.decode_tokens.numel():
            out[self.decode_tokens] = kernels.paged_decode_attention(
                query[self.decode_tokens], k_cache, v_cache, self.decode_tables,
                self.decode_context_lens, cache.scale, backend=cache.backend,
            )  # fmt: skip
        for start, end, table, context_len in self.prefills:
            out[start:end] = causal_attention(
                query[start:end],
                gather_kv(k_cache, table, context_len),
                gather_kv(v_cache, table, context_len),
                cache.scale,
            )
        return out
