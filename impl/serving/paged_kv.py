"""The paged KV cache: every layer's K/V in blocks, written and read only through block tables.

:class:`PagedKVCache` owns one K and one V tensor per layer, each ``[num_blocks, block_size,
num_kv_heads, head_dim]`` (the layout of ``kernels``). For one engine step,
:meth:`PagedKVCache.step` returns a :class:`PagedStep`, the model's :class:`KVAttention` for that
step. Per layer it writes the step's new K/V at the step's slot mapping, then attends over
the whole step at once: decodes (one new token), prompts, prompt
chunks over a cached prefix and preempted sequences being recomputed are all variable-length
query chunks of one batch, each reading its whole context, cached prefix included, through its
block table; with the model's sliding window, only the part of it in the window, so the table
entries of blocks wholly before the window of a sequence's first query in the step are never
read and may name released blocks. On the triton and numba backends the layer calls
``store_kv`` and then, for a step of decodes only (one query per sequence), the split-K
``paged_decode_attention``, for any other step ``paged_prefill_attention``, all from
``kernels.trusted``
(vLLM routes pure decode to its split kernel the same way); on the reference backend, their CPU
fast path ``kernels.sdpa`` (one plan per step; per layer two ``index_copy_``, two row gathers and
one SDPA call).

Everything a step's layers need is made once, in :meth:`PagedKVCache.step`, before the first
layer runs: its positions and slots, from tables and lengths it trusts (a ``BlockTableStore``
made and validated them; the ``check_tables`` debug mode checks them all again), and the
layers call the kernels' trusted entries, which check nothing (each layer first compares its
query, key and value with the step's shapes, dtype and device: a few tuple comparisons). The
device copy of the tables is a persistent buffer (:class:`DeviceBlockTables`) into which only
the rows that changed since the previous step are uploaded, from pinned host memory when the
device is CUDA. So no layer reads a tensor's value on the host: on a GPU, the layer loop
never waits for the device.

Every K/V row a query reads comes out of the cache through the block table; nothing
is kept on the side. The caches start as NaN, so reading a slot no token was written to poisons
the output instead of passing unnoticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkv import kernels
from pagedkv.impl.serving.model import ModelConfig
from pagedkv.kernels import fp8, sdpa, trusted
from pagedkv.kernels.check_arguments import check_bool
from pagedkv.kernels.check_values import (
    check_context_values,
    check_cu_seqlens_values,
    check_slot_values,
    window_starts,
)
from pagedkv.kernels.fp8 import FP8_DTYPES
from pagedkv.kernels.trusted import Scales
from pagedkv.spec.checks import int32_window


def nan_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A cache of ``dtype`` whose every element is NaN (an fp8 cache: the code ``0x7F``)."""
    if dtype in FP8_DTYPES:
        cache = torch.empty(shape, dtype=dtype, device=device)
        cache.view(torch.uint8).fill_(0x7F)
        return cache
    return torch.full(shape, torch.nan, dtype=dtype, device=device)


class DeviceBlockTables:
    """A persistent ``[rows, max_blocks]`` int32 block-table buffer on ``device``.

    :meth:`update` makes its first ``batch`` rows equal a step's host tables by copying only
    the rows that differ from what the buffer holds (a numpy comparison with its host mirror).
    On the CPU the mirror is the buffer; on CUDA the rows are uploaded from pinned memory.
    ``num_uploaded_rows`` counts the rows copied so far.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._host = np.empty((0, 0), dtype=np.int32)  # what the buffer holds
        self._buffer = self._new_buffer()
        self.num_uploaded_rows = 0

    def _new_buffer(self) -> torch.Tensor:
        if self.device.type == "cpu":
            return torch.from_numpy(self._host)
        return torch.from_numpy(self._host).to(self.device)

    def update(self, tables: torch.Tensor) -> torch.Tensor:
        """The device tables for host ``tables`` (int32 ``[batch, max_blocks]``, CPU): a view of
        the buffer's first ``batch`` rows, which equal ``tables`` once the copy is done (in
        stream order: kernels queued after it see it)."""
        host_tables = tables.numpy()
        batch, width = host_tables.shape
        if width != self._host.shape[1] or batch > self._host.shape[0]:
            self._host = np.full((max(batch, self._host.shape[0]), width), -1, dtype=np.int32)
            self._buffer = self._new_buffer()
        changed = np.flatnonzero((self._host[:batch] != host_tables).any(axis=1))
        if changed.size:
            self._host[changed] = host_tables[changed]
            if self.device.type != "cpu":  # torch's pinned allocator keeps them until copied
                index, rows = (
                    torch.from_numpy(array).pin_memory().to(self.device, non_blocking=True)
                    for array in (changed, self._host[changed])
                )
                self._buffer.index_copy_(0, index, rows)
            self.num_uploaded_rows += changed.size
        return self._buffer[:batch]


class PagedKVCache:
    """K/V caches of every layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` each.

    ``backend`` (``None``: ``PAGEDKV_BACKEND`` or auto) is resolved once, when the cache is made
    (``kernels.resolve_backend``'s errors): every step and layer runs on that backend.

    ``cache_dtype`` (default ``dtype``, the model's) is the caches' storage; an fp8 one keeps
    K/V as codes under ``kv_scales``: ``(k_scale, v_scale)`` for every layer and KV head, or
    ``"calculate"``: in the first step's forward each layer's K and V scale is
    ``spec.fp8.calibrated_scale`` of that step's K or V (``fp8.calibrated_scales``), fixed once
    the last layer has attended (a forward failing before that leaves none: the next step
    calibrates again; a step failing after it writes its K/V again under them). Its reference
    backend runs ``kernels.reference``, not the ``sdpa`` fast path. Both are trusted as
    ``engine_args.check_kv_cache`` returns them.

    ``check_tables`` (a bool, default False) is a debug mode: every :meth:`step` then checks
    the tables, lengths and slots it is given before anything changes, instead of trusting
    them as the tables of a ``BlockTableStore``, which validated them as it built them."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        backend: str | None = None,
        check_tables: bool = False,
        cache_dtype: torch.dtype | None = None,
        kv_scales: tuple[float, float] | str | None = None,
    ) -> None:
        self.check_tables = check_bool("check_tables", check_tables)
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        layers = range(config.num_layers)
        self.cache_dtype = cache_dtype or dtype
        self.k = [nan_cache(shape, self.cache_dtype, device) for _ in layers]
        self.v = [nan_cache(shape, self.cache_dtype, device) for _ in layers]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.group = config.num_heads // config.num_kv_heads
        self.window = int32_window(config.sliding_window)  # only a checked window: None if huge
        self.scale = config.head_dim**-0.5
        self.device = self.k[0].device
        # The backend is resolved once, here: every step and layer runs on it.
        self.backend = kernels.resolve_backend(backend, self.device)
        # Slots mapped on the host (those of a CPU cache, and checked ones) are mapped by the
        # backend when it runs on the host, else by the reference.
        on_host = self.backend in ("numba", "reference")
        self.host_backend: kernels.Backend = self.backend if on_host else "reference"
        self.tables = DeviceBlockTables(self.device)
        # An fp8 cache's (k_scale, v_scale) of each layer, per KV head: the given pair for every
        # layer, or (kv_scales "calculate") None until a step's forward has calibrated them all.
        self.fp8 = fp8.format_of(self.cache_dtype) is not None
        self.scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        if self.fp8 and kv_scales != "calculate":
            pair = tuple(
                torch.full((config.num_kv_heads,), s, dtype=torch.float32, device=self.device)
                for s in (kv_scales or (1.0, 1.0))
            )
            self.scales = [pair] * config.num_layers  # type: ignore[list-item]

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

        Sequence ``b`` (row ``b`` of ``block_tables``, int32 ``[B, max_blocks]`` on the host)
        contributes ``query_lens[b]`` consecutive tokens to the flat step, in batch order: its
        positions ``context_lens[b] - query_lens[b] .. context_lens[b] - 1``. Its table must
        already hold ``context_lens[b]`` tokens, with ``0 <= query_lens[b] <= context_lens[b]``
        and no slot written twice: the tables and lengths are trusted (a ``BlockTableStore``
        validated them), and only their place is checked (``ValueError`` off the host). The
        slots are mapped once (``kernels.slot_mapping``): on the host for a CPU cache or with
        ``check_tables``, else on the device. With ``check_tables`` everything is checked
        first, before anything changes (:meth:`_check_lengths_and_entries`, :meth:`_host_slots`).
        """
        if block_tables.device.type != "cpu":
            raise ValueError(f"block_tables must be on the host, got {block_tables.device}")
        # The step's index arrays in numpy (an op costs a microsecond, a torch op several),
        # shared with torch without a copy.
        counts = np.array(query_lens, dtype=np.int64)
        lens = np.array(context_lens, dtype=np.int64)
        offsets = np.zeros(len(counts) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])  # sequence b's flat tokens: offsets[b] .. [b + 1]
        num_queries, contexts, cu_seqlens = map(torch.from_numpy, (counts, lens, offsets))
        if self.check_tables:
            self._check_lengths_and_entries(block_tables, num_queries, contexts, cu_seqlens)
        owner = np.repeat(np.arange(len(counts)), counts)
        rows = torch.from_numpy(owner)
        positions = torch.from_numpy(np.arange(offsets[-1]) - offsets[1:][owner] + lens[owner])
        host_slots = None
        if self.check_tables or self.device.type == "cpu":
            host_slots = self._host_slots(block_tables, positions, rows)
        tables = self.tables.update(block_tables)
        positions, rows, cu_seqlens, contexts = self._to_device(
            positions, rows, cu_seqlens, contexts
        )
        if host_slots is None:
            slots = kernels.slot_mapping(
                tables, positions, self.block_size, rows, backend=self.backend, validate=False
            )
        else:
            (slots,) = self._to_device(host_slots)
        plan = None
        if self.backend == "reference" and not self.fp8:  # fp8: the reference kernels
            plan = sdpa.plan(
                tables, counts.tolist(), lens.tolist(), self.block_size, self.group, self.window
            )
        return PagedStep(
            self, positions, slots, tables, cu_seqlens, contexts, int(counts.max(initial=0)),
            int(lens.max(initial=0)), bool((counts == 1).all()), plan, self.backend,
        )  # fmt: skip

    def _check_lengths_and_entries(
        self,
        block_tables: torch.Tensor,
        query_lens: torch.Tensor,
        context_lens: torch.Tensor,
        cu_seqlens: torch.Tensor,
    ) -> None:
        """``check_tables``: the lengths (``0 <= query_lens[b] <= context_lens[b]``) and every
        table entry the step reads (with the model's window, only those in it), checked by
        ``kernels.check_values`` (``IndexError``/``ValueError`` naming the bad entry)."""
        check_cu_seqlens_values(cu_seqlens, context_lens, int(cu_seqlens[-1]))
        window = self.window
        starts = None if window is None else window_starts(context_lens, query_lens, window)
        check_context_values(context_lens, block_tables, self.block_size, self.num_blocks, starts)

    def _host_slots(
        self, block_tables: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """The slots of the tokens at ``positions`` of table ``rows``, mapped on the host by
        ``host_backend``; with ``check_tables``, checked to be distinct and in the pool. Every
        position lies inside its table's entries (that the step's checks cover), so the
        mapping's own position check would repeat them."""
        slots = kernels.slot_mapping(
            block_tables, positions, self.block_size, rows,
            num_blocks=self.num_blocks, backend=self.host_backend, validate=False,
        )  # fmt: skip
        if self.check_tables:
            check_slot_values(slots, self.num_blocks * self.block_size)
        return slots

    def _to_device(self, *tensors: torch.Tensor) -> list[torch.Tensor]:
        """Host ``tensors`` on the cache's device: themselves on the CPU, else copied from
        pinned memory in stream order (kernels queued after the copies see them)."""
        if self.device.type == "cpu":
            return list(tensors)
        return [tensor.pin_memory().to(self.device, non_blocking=True) for tensor in tensors]


@dataclass(frozen=True)
class PagedStep:
    """One step's view of a :class:`PagedKVCache`: implements
    ``pagedkv.impl.serving.model.KVAttention``. Every tensor is on the caches' device, made by
    :meth:`PagedKVCache.step`."""

    cache: PagedKVCache
    positions: torch.Tensor  # int64 [T]: each flat token's position in its sequence
    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    cu_seqlens_q: torch.Tensor  # int64 [B + 1]: sequence b's flat tokens start at [b]
    context_lens: torch.Tensor  # int64 [B]
    max_query_len: int  # the longest query chunk, on the host
    max_context_len: int  # the longest context, on the host
    decode: bool  # every sequence has exactly one query: the split-K decode kernel runs
    plan: sdpa.SdpaPlan | None  # the reference backend's attention layout; else None
    backend: kernels.Backend  # the backend the step's kernels run on
    calibrated: dict[int, Scales] = field(default_factory=dict)  # layer -> scales, calibrating

    def _layer_scales(self, layer: int, key: torch.Tensor, value: torch.Tensor) -> Scales:
        """``layer``'s fp8 scales (``None``: not fp8): fixed, or while the cache calibrates,
        computed from this step's K/V (:meth:`attend` fixes them after the last layer)."""
        cache = self.cache
        if cache.scales is not None or not cache.fp8:
            return cache.scales[layer] if cache.scales is not None else None
        pair = tuple(fp8.calibrated_scales(rows, cache.cache_dtype) for rows in (key, value))
        self.calibrated[layer] = pair  # type: ignore[assignment]
        return pair  # type: ignore[return-value]

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """Write the step's K/V for ``layer``, then attend through the block tables within the
        model's sliding window (``ValueError`` for any other ``window``: the step was validated for
        that one). ``query`` must be ``[tokens, num_heads, head_dim]`` and ``key`` and ``value``
        ``[tokens, num_kv_heads, head_dim]``, new tensors (not views of the caches) of the model's
        dtype (an fp8 cache's too) on the caches' device (``ValueError`` naming the first that is
        not). The step's tables, lengths and slots were made once, from tables the store validated,
        so the layer calls the kernels' trusted entries (``kernels.trusted``): nothing here reads a
        value on the host."""
        cache = self.cache
        if window != cache.window:
            raise ValueError(
                f"window must be the model's sliding window ({cache.window}), got {window}"
            )
        tokens = self.positions.shape[0]
        for name, tensor, heads in (
            ("query", query, cache.num_heads), ("key", key, cache.num_kv_heads),
            ("value", value, cache.num_kv_heads),
        ):  # fmt: skip
            if (
                not isinstance(tensor, torch.Tensor)
                or tensor.shape != (tokens, heads, cache.head_dim)
                or tensor.dtype != cache.dtype
                or tensor.device != cache.device
            ):
                raise ValueError(
                    f"{name} must be a {cache.dtype} tensor of shape "
                    f"{(tokens, heads, cache.head_dim)} on {cache.device}"
                )
        k_cache, v_cache = cache.k[layer], cache.v[layer]
        if self.plan is not None:
            sdpa.store(key, value, k_cache, v_cache, self.slot_mapping)
            return sdpa.attention(self.plan, query, k_cache, v_cache, cache.scale)
        scales = self._layer_scales(layer, key, value)
        trusted.store_kv(key, value, k_cache, v_cache, self.slot_mapping, self.backend, scales)
        if self.decode:  # query [B, heads, dim]: one token per sequence
            out = trusted.paged_decode_attention(
                query, k_cache, v_cache, self.block_tables, self.context_lens, cache.scale,
                None, window, self.max_context_len, self.backend, scales,
            )  # fmt: skip
        else:
            out = trusted.paged_prefill_attention(
                query, k_cache, v_cache, self.block_tables, self.cu_seqlens_q, self.context_lens,
                cache.scale, window, self.max_query_len, self.backend, scales,
            )  # fmt: skip
        if len(self.calibrated) == len(cache.k):  # Rule: fixed once every layer has run on them
            cache.scales = [self.calibrated[i] for i in range(len(cache.k))]  # type: ignore[misc]
        return out
