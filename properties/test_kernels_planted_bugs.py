"""Planted bugs: each kernel entry point's check, on fixed spec runs, catches one-line changes;
the real modules pass (mutants stay in ``MUTANT_DIR``, so numba's cache stays valid between runs).
"""

from __future__ import annotations

import re
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

import pytest
import torch

from pagedkv.kernels import (
    numba_attention,
    numba_cache,
    numba_fp8,
    reference,
    sdpa,
    triton_copy_blocks,
    triton_decode,
    triton_prefill,
    triton_slot_mapping,
    triton_store_kv,
)
from properties import kernel_cases as kc

MUTANT_DIR = Path(tempfile.gettempdir()) / "pagedkv-kernel-mutants"
MUTANT_QUERY_LENS = [17, 1, 19]  # fixed_scenario(16)'s live sequences hold 50, 51 and 19 tokens
# fixed_scenario(4)'s hold 14, 10 and 7: with window 4, the first two have blocks before it.
WINDOW_QUERY_LENS = [3, 1, 7]


def check_decode(decode: Callable[..., torch.Tensor]) -> None:
    """Block size 16 and 4, an extra column holding a real block (an off-by-one read stays in the
    caches); at block size 4 a window of 5, the entries before it poisoned with a NaN block."""
    kc.check_attention(kc.fixed_cache(16, 4, 80), decode, extra_columns=1, pad=0)
    cache = kc.fixed_cache(4, 4, 64)
    kc.check_attention(cache, decode, extra_columns=1, pad=0)
    kc.check_attention(cache, decode, extra_columns=1, pad=0, window=5, poison="nan")


def check_prefill_runs(prefill: Callable[..., torch.Tensor]) -> None:
    """Chunks over cached prefixes, and with a window of 4, poisoned before it."""
    cache = kc.fixed_cache(16, 4, 80)
    kc.check_attention(cache, prefill, MUTANT_QUERY_LENS, extra_columns=1, pad=0)
    kc.check_attention(kc.fixed_cache(4, 2, 64), prefill, WINDOW_QUERY_LENS, window=4, poison="nan")


def check_slots(slot_mapping: Callable[..., torch.Tensor]) -> None:
    """Every position of every live sequence of the fixed run at block size 4."""
    tables = [seq.table for seq in kc.fixed_scenario(4).play().seqs]
    tokens = [(b, p) for b, table in enumerate(tables) for p in range(len(table) * 4)]
    kc.check_slot_mapping(tables, tokens, 4, slot_mapping)


def check_store(store_kv: Callable[..., None]) -> None:
    """Four tokens into zeroed caches: one skipped (``-1``), one at slot 0."""
    key = torch.randn(4, 2, 80, generator=torch.Generator().manual_seed(0)).to(kc.DEVICE)
    kc.check_store_kv(
        torch.zeros(2, 3, 4, 2, 80, device=kc.DEVICE), key, -key, [5, 0, -1, 11], store_kv
    )


def check_copy(copy_blocks: Callable[..., None]) -> None:
    cache = torch.randn(2, 4, 16, 2, 80, generator=torch.Generator().manual_seed(0)).to(kc.DEVICE)
    kc.check_copy_blocks(cache, [(0, 1), (2, 3)], copy_blocks)


def check_fp8_store(store_codes: Callable[..., None]) -> None:
    """``store_codes(rows, uint8 caches [slots, heads, dim], slots, scales, fp8)`` writes the
    spec's codes of normal values under per-head scales."""
    for name in kc.FP8.values():
        rows = torch.randn(2, 4, 2, 16, generator=torch.Generator().manual_seed(3))
        scales = torch.tensor([0.3, 7.0]), torch.tensor([0.01, 1.0])
        codes = tuple(torch.full((4, 2, 16), 0x7F, dtype=torch.uint8) for _ in "kv")
        store_codes(tuple(rows), codes, torch.arange(4), scales, name)
        for stored, row, scale in zip(codes, rows, scales, strict=True):
            assert torch.equal(stored, kc.expected_codes(row, scale.tolist(), name)), name


def check_fp8_decode(
    decode: Callable[..., torch.Tensor], device: str | torch.device = "cpu"
) -> None:
    """``decode(query, k, v, tables, lens, scale, splits, window, scales=, fp8=)`` on the caches'
    ``uint8`` views, on ``device``, equals the reference over the fp32 cache of the same values."""
    for dtype, name in kc.FP8.items():
        args, k_fp32, v_fp32 = kc.fp8_attention_case(dtype, torch.float32, seed=4)
        tables, lens, query = args["block_tables"], args["context_lens"], args["query"]
        expected = reference.paged_decode_attention(query, k_fp32, v_fp32, tables, lens, 0.25)
        codes = [args[cache].view(torch.uint8) for cache in ("k_cache", "v_cache")]
        on = [tensor.to(device) for tensor in (query, *codes, tables, lens)]
        scales = tuple(args[s].contiguous().to(device) for s in ("k_scale", "v_scale"))  # as api
        actual = decode(*on, 0.25, 3, None, scales=scales, fp8=name)
        kc.assert_close(actual, expected, name)


def numba_fp8_decode(module: ModuleType) -> Callable[..., torch.Tensor]:
    """``numba_attention.decode`` reading fp8 codes with ``module`` (``numba_fp8`` or a copy)."""

    def decode(*args: object, **kwargs: object) -> torch.Tensor:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(numba_attention, "numba_fp8", module)
            return numba_attention.decode(*args, **kwargs)

    return decode


def reference_fp8_decode(module: ModuleType) -> Callable[..., torch.Tensor]:
    def decode(
        query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
        lens: torch.Tensor, scale: float, splits: int, window: int | None, *,
        scales: tuple[torch.Tensor, torch.Tensor], fp8: str,
    ) -> torch.Tensor:  # fmt: skip
        dtype = next(d for d, n in kc.FP8.items() if n == fp8)
        caches = k.view(dtype), v.view(dtype)
        return module.paged_decode_attention(query, *caches, tables, lens, scale, scales=scales)

    return decode


# Each entry point: its module, its check, and how to reach it in the module or a mutant of it.
Reach = Callable[[ModuleType], Callable[..., object]]
ENTRIES: dict[str, tuple[ModuleType, Callable[[Callable[..., object]], None], Reach]] = {
    "triton decode": (triton_decode, check_decode, lambda m: partial(m.launch, num_splits=3)),
    "numba decode": (numba_attention, check_decode, lambda m: partial(m.decode, num_splits=3)),
    "triton prefill": (triton_prefill, check_prefill_runs, lambda m: m.launch),
    "numba prefill": (numba_attention, check_prefill_runs, lambda m: m.prefill),
    "reference prefill": (reference, check_prefill_runs, lambda m: m.paged_prefill_attention),
    "sdpa prefill": (sdpa, check_prefill_runs, kc.sdpa_prefill),
    "triton slot mapping": (triton_slot_mapping, check_slots,
                            lambda m: lambda t, p, bs, s: m.launch(t, p.long(), s.long(), bs)),
    "numba slot mapping": (numba_cache, check_slots,
                           lambda m: lambda t, p, bs, s: m.slot_mapping(t, p, s, bs)),
    "triton store_kv": (triton_store_kv, check_store, lambda m: m.launch),
    "numba store_kv": (numba_cache, check_store, lambda m: m.store_kv),
    "sdpa store": (sdpa, check_store, lambda m: lambda key, value, k, v, s: m.store(  # no -1 slots
        key[s >= 0], value[s >= 0], k, v, s[s >= 0])),
    "triton copy_blocks": (triton_copy_blocks, check_copy, lambda m: m.launch),
    "numba copy_blocks": (numba_cache, check_copy, lambda m: m.copy_blocks),
    # fp8 caches: named so that none is skipped on a GPU (CPU tensors, Triton's on the device)
    "fp8 numba store": (numba_fp8, check_fp8_store, lambda m: m.store_codes),
    "fp8 triton decode": (
        triton_decode, partial(check_fp8_decode, device=kc.DEVICE), lambda m: m.launch),
    "fp8 numba decode": (numba_fp8, check_fp8_decode, numba_fp8_decode),
    "fp8 reference decode": (reference, check_fp8_decode, reference_fp8_decode),
}  # fmt: skip

# One planted bug per paragraph: "entry point: bug: function" (entry points and their functions
# joined by " | " when the same code is planted in each), then the code and the planted code, on
# two lines or as "code => planted" (none for a mutation-tool edit), as
# :func:`properties.mutants.replace_code` takes them.
PLANTED_BUGS = """
triton decode | triton prefill: table read off by one: _decode_kernel | _prefill_kernel
    block_tables_ptr + seq * table_stride + n // BLOCK_SIZE
    block_tables_ptr + seq * table_stride + n // BLOCK_SIZE + 1
triton decode | triton prefill: wrong row inside a block: _decode_kernel | _prefill_kernel
    rows = block_id * BLOCK_SIZE + n % BLOCK_SIZE
    rows = block_id * BLOCK_SIZE + (n + 1) % BLOCK_SIZE
triton decode: query heads interleaved over KV heads: _decode_kernel
    heads = kv_head * group + g => heads = kv_head + g * NUM_KV_HEADS
triton prefill: query heads interleaved over KV heads: _prefill_kernel
    heads = kv_head * group + g => heads = kv_head + g * NUM_KV_HEADS
triton decode: split-K merge ignores each split's denominator: _decode_kernel
    lse = tl.where(has_tokens, m + tl.log(safe_denom), float("-inf"))
    lse = tl.where(has_tokens, m, float("-inf"))
triton decode: window ignored: _decode_kernel
    first_key = tl.maximum(context_len - window, 0) => first_key = context_len * 0
triton decode: window one token too wide: _decode_kernel
    first_key = tl.maximum(context_len - window, 0)
    first_key = tl.maximum(context_len - window - 1, 0)
triton decode: splits cut the capacity, not the window: _decode_kernel
    start = tl.minimum(first_key + split * tokens_per_split, context_len)
    start = tl.minimum(split * tokens_per_split, context_len)
numba decode: table read off by one: _rows_of
    base = np.int64(tables[b, column]) * block_size
    base = np.int64(tables[b, column + 1]) * block_size
numba decode: wrong row inside a block: _rows_of
    rows[n - start + t] = base + row + t => rows[n - start + t] = base + (row + t + 1) % block_size
numba decode: query heads interleaved over KV heads: _decode_program
    q[g, d] = query[b, h0 + g, d] * scale * kv_scales[0, kv_head]
    q[g, d] = query[b, kv_head + g * num_kv_heads, d] * scale * kv_scales[0, kv_head]
numba decode: split-K merge ignores each split's denominator: _attend
    lse[r] = m + np.log(total) if total != 0 else -np.inf => lse[r] = m if total != 0 else -np.inf
numba decode: keys walked from 0 and masked: _decode_program
    first = max(length - window, 0) => first = 0
numba decode: splits cut the capacity, not the window: _decode_program
    start = min(first + split * split_len, length) => start = min(split * split_len, length)
triton prefill: causal mask lets a query see the next token: _prefill_kernel
    causal = n[None, :] <= positions[:, None] => causal = n[None, :] <= positions[:, None] + 1
triton prefill: chunk positions ignore the cached prefix: _prefill_kernel
    positions = context_len - q_len + i => positions = i
triton prefill: window one token too wide: _prefill_kernel
    in_window = n[None, :] > positions[:, None] - window
    in_window = n[None, :] >= positions[:, None] - window
triton prefill: keys walked from 0 and masked: _prefill_kernel
    range(first_key, end, BLOCK_N) => range(0, end, BLOCK_N)
triton prefill: window starts at the tile's last query: _prefill_kernel
    first_key = tl.maximum(tile_position - window + 1, 0)
    first_key = tl.maximum(tile_position + BLOCK_Q - window, 0)
numba prefill: window one token too wide: _attend
    lo = max(positions[r] - window + 1, start) - start
    lo = max(positions[r] - window, start) - start
numba prefill: causal mask lets a query see the next token: _attend
    hi = min(positions[r] + 1, end) - start => hi = min(positions[r] + 2, end) - start
numba prefill: chunk positions ignore the cached prefix: _prefill_program
    first = lens[b] - (cu_seqlens[b + 1] - cu_seqlens[b]) => first = lens[b] * 0
numba prefill: keys walked from 0 and masked: _prefill_program
    start = max(first + lo - window + 1, 0) => start = 0
reference prefill: table read off by one: gather_kv
    tokens // block_size => tokens // block_size + 1
reference prefill: wrong row inside a block: gather_kv
    entries * block_size + tokens % block_size => entries * block_size + (tokens + 1) % block_size
reference prefill: query heads interleaved over KV heads: masked_attention
    q = query.float().view(batch, num_queries, num_kv_heads, group, head_dim)
    q = query.float().view(batch, num_queries, group, num_kv_heads, head_dim).transpose(2, 3)
reference prefill: causal mask lets a query see the next token: masked_attention
    hidden = key_positions[:, None, :] > p => hidden = key_positions[:, None, :] > p + 1
reference prefill: chunk positions ignore the cached prefix: paged_prefill_attention
    first = lens - query_lens  # position of each sequence's first query token => first = lens * 0
reference prefill: window one token too wide: masked_attention
    hidden |= key_positions[:, None, :] <= p - window
    hidden |= key_positions[:, None, :] < p - window
reference prefill: keys gathered from 0 and masked: paged_prefill_attention
    starts = window_starts(lens, query_lens, window) => starts = torch.zeros_like(lens)
sdpa prefill: causal mask lets a query see the next token: plan
    visible = tokens[:, None, :] <= positions => visible = tokens[:, None, :] <= positions + 1
sdpa prefill: window one key too wide: plan
    visible &= tokens[:, None, :] > positions - window
    visible &= tokens[:, None, :] >= positions - window
sdpa prefill: padding columns read unwritten slots: plan
    read = torch.where(inside, tokens, torch.where(has_keys, key_starts[:, None], 0))
    read = tokens.clamp(max=block_tables.shape[1] * block_size - 1)
sdpa prefill: wrong row inside a block: plan
    entries * block_size + read % block_size => entries * block_size + (read + 1) % block_size
sdpa prefill: chunk positions ignore the cached prefix: plan
    first = lens - num_queries => first = lens * 0
sdpa prefill: query heads interleaved over KV heads: attention
    q = padded.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = padded.view(batch, q_len, group, num_kv_heads, head_dim).permute(0, 3, 2, 1, 4)
triton slot mapping: slot mapping ignores the table: _slot_mapping_kernel
    slot = tl.where(live, block_id * BLOCK_SIZE + pos % BLOCK_SIZE, -1)
    slot = tl.where(live, pos + 0 * block_id, -1)
numba slot mapping: slot mapping ignores the table: _slot_mapping
    out[t] = block_id * block_size + pos % block_size => out[t] = pos + 0 * block_id
triton store_kv: store skips slot 0: _store_kv_kernel
    (row_mask & (slots >= 0)) => (row_mask & (slots >= 1))
numba store_kv: store skips slot 0: _store_rows
    edit:0->1:if slot >= 0:
sdpa store: store writes the keys into the value cache: store
    ((k_cache, key), (v_cache, value)) => ((k_cache, key), (v_cache, key))
triton copy_blocks: copy reads dst where it should read src: _copy_blocks_kernel
    tl.load(pairs_ptr + 2 * pair) => tl.load(pairs_ptr + 2 * pair + 1)
numba copy_blocks: copy reads dst where it should read src: _copy_blocks
    src, dst = pairs[i, 0], pairs[i, 1] => src, dst = pairs[i, 1], pairs[i, 1]
fp8 numba store: scale applied twice on store: store_rows
    rows[t, h, d] / scale[h] => rows[t, h, d] / scale[h] / scale[h]
fp8 numba store: rounding toward zero on store: round_shift
    q + 1 if rest > half or (rest == half and q & 1) else q => q
fp8 triton decode: V's scale forgotten in decode: _decode_kernel
    out = out * code_scale(v_scale_ptr, kv_head, E5M2) => out = out
fp8 reference decode: K's scale forgotten in the reference read: read_kv
    fp8.dequantize(codes, scale, cache.dtype) => codes.view(cache.dtype).float()
fp8 numba decode: e5m2 read as e4m3: kernel_arguments
    DECODE_TABLES[fp8] => DECODE_TABLES['fp8_e4m3']
"""


def parse_bugs(table: str) -> dict[tuple[str, str], tuple[str, str, str]]:
    """``PLANTED_BUGS`` as ``{(entry point, bug): (function, code, planted code)}``."""
    bugs: dict[tuple[str, str], tuple[str, str, str]] = {}
    for paragraph in re.split(r"\n(?=\S)", table.strip()):
        header, *lines = paragraph.splitlines()
        entries, bug, functions = header.split(": ")
        code = [part.strip() for line in lines for part in line.split(" => ")]
        for entry, function in zip(entries.split(" | "), functions.split(" | "), strict=True):
            assert (entry, bug) not in bugs and 1 <= len(code) <= 2, header
            bugs[entry, bug] = (function, code[0], code[1] if code[1:] else "")
    return bugs


PLANTED = parse_bugs(PLANTED_BUGS)


@pytest.mark.parametrize(
    "entry",
    [pytest.param(entry, marks=[kc.ON_CPU] * entry.startswith("numba")) for entry in ENTRIES],
)
def test_the_real_code_passes_its_check(entry: str) -> None:
    module, check, reach = ENTRIES[entry]
    check(reach(module))


@pytest.mark.parametrize(
    ("entry", "bug"),
    [
        pytest.param(*key, marks=[kc.ON_CPU] * key[0].startswith("numba"), id=": ".join(key))
        for key in PLANTED
    ],
)
def test_the_check_catches_the_planted_bug(entry: str, bug: str) -> None:
    MUTANT_DIR.mkdir(exist_ok=True)
    module, check, reach = ENTRIES[entry]
    mutant = kc.load_mutant(module, *PLANTED[entry, bug], MUTANT_DIR)
    with pytest.raises(AssertionError):
        check(reach(mutant))
