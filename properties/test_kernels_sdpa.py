"""Properties: ``kernels.sdpa``, the CPU fast path of a step's attention, equals the reference.

``sdpa.plan`` plus ``sdpa.attention`` must give what ``kernels.paged_prefill_attention`` gives on
the reference backend, and what the spec's dense attention gives (``check_prefill`` of
``test_kernels_prefill``, which checks all three), on caches filled by spec runs (shuffled ids,
forks, copy-on-write, frees), for chunks over cached prefixes, decodes, whole prompts, sequences
with no query, padding rows, GQA and dtypes, with and without a sliding window; poisoning the
table entries of blocks wholly before each window changes nothing. ``sdpa.store`` writes what
``reference.store_kv`` writes. Planted bugs in the plan's mask, slots and query layout, and in
the store, are caught by the same checks.
"""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from pagedkv.kernels import reference, sdpa
from properties.kernel_cases import (
    DTYPES,
    GQA_RATIOS,
    KVCache,
    Shape,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    scenarios,
)
from properties.test_kernels_prefill import MUTANT_QUERY_LENS, check_prefill, draw_query_lens

SDPA_BLOCK_SIZES = (1, 2, 4, 16, 64)


def sdpa_prefill(module: ModuleType = sdpa) -> object:
    """``paged_prefill_attention``'s signature over ``module``'s plan and attention: the plan is
    made from the lengths as host ints, as ``PagedKVCache.step`` makes it."""

    def prefill(
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:
        query_lens = [b - a for a, b in pairwise(cu_seqlens_q.tolist())]
        group = query.shape[1] // k_cache.shape[2]
        plan = module.plan(
            block_tables, query_lens, context_lens.tolist(), k_cache.shape[1], group, window
        )
        return module.attention(plan, query, k_cache, v_cache, scale)

    return prefill


def draw_case(data: st.DataObject, block_size: int) -> tuple[KVCache, list[int], bool, int]:
    """A filled cache, a chunk length per sequence (at least one query: a step computes
    something), a padding row or not, extra table columns."""
    dtype = data.draw(st.sampled_from(DTYPES), label="dtype")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    cache = KVCache(
        data.draw(scenarios(block_size), label="scenario"),
        Shape(block_size, num_kv_heads, group, 64, dtype),
        backend="reference",
    )
    padding_row = data.draw(st.booleans(), label="padding_row")
    seqs, _, _ = cache.batch(padding_row=padding_row)
    assume(seqs and seqs[0] is not None)  # a live sequence: the script may free every one
    query_lens = draw_query_lens(data, seqs, block_size)
    if not any(query_lens):
        query_lens[0] = 1
    return cache, query_lens, padding_row, data.draw(st.integers(0, 2), label="extra_columns")


@pytest.mark.parametrize("block_size", SDPA_BLOCK_SIZES)
@settings(max_examples=kernel_examples(15), deadline=None)
@given(data=st.data())
def test_sdpa_matches_reference(block_size: int, data: st.DataObject) -> None:
    cache, query_lens, padding_row, extra = draw_case(data, block_size)
    check_prefill(cache, query_lens, sdpa_prefill(), extra, padding_row)


@pytest.mark.parametrize("block_size", SDPA_BLOCK_SIZES)
@settings(max_examples=kernel_examples(15), deadline=None)
@given(data=st.data())
def test_windowed_sdpa_matches_reference(block_size: int, data: st.DataObject) -> None:
    """With a window from 1 to past the longest context, poisoned entries before it unread."""
    cache, query_lens, padding_row, extra = draw_case(data, block_size)
    longest = max(seq.length for seq in cache.run.seqs)
    edges = st.sampled_from([1, 2, block_size, longest, longest + 1])
    window = data.draw(edges | st.integers(1, longest), label="window")
    poison = data.draw(st.sampled_from(["nan", "invalid"]), label="poison")
    check_prefill(
        cache, query_lens, sdpa_prefill(), extra, padding_row, window=window, poison=poison
    )


@settings(max_examples=kernel_examples(40), deadline=None)
@given(
    num_slots=st.integers(1, 64),
    data=st.data(),
    dtype=st.sampled_from(DTYPES),
)
def test_sdpa_store_matches_reference(
    num_slots: int, data: st.DataObject, dtype: torch.dtype
) -> None:
    """Distinct slots, any order: the caches after ``sdpa.store`` equal those after
    ``reference.store_kv``, NaN where nothing was written included."""
    check_store(sdpa.store, num_slots, data, dtype)


def check_store(store: object, num_slots: int, data: st.DataObject, dtype: torch.dtype) -> None:
    """``store`` and ``reference.store_kv`` leave equal caches (NaN compared equal)."""
    block_size = data.draw(st.sampled_from([1, 2, 4]), label="block_size")
    num_blocks = -(-num_slots // block_size)
    order = data.draw(st.permutations(range(num_blocks * block_size)), label="order")
    slots = torch.tensor(order[: data.draw(st.integers(0, num_slots))], dtype=torch.int64)
    generator = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    key, value = (torch.randn(slots.numel(), 2, 8, generator=generator).to(dtype) for _ in "kv")
    caches = [
        [torch.full((num_blocks, block_size, 2, 8), torch.nan, dtype=dtype) for _ in "kv"]
        for _ in range(2)
    ]
    reference.store_kv(key, value, *caches[0], slots)
    store(key, value, *caches[1], slots)  # type: ignore[operator]
    for expected, actual in zip(caches[0], caches[1], strict=True):
        assert torch.equal(expected.nan_to_num(7.0), actual.nan_to_num(7.0))


# ----------------------------------------------------------------------- planted bugs

SDPA_MUTANTS = {
    "causal mask lets a query see the next token": (
        "plan",
        "visible = tokens[:, None, :] <= positions",
        "visible = tokens[:, None, :] <= positions + 1",
    ),
    "window one key too wide": (
        "plan",
        "visible &= tokens[:, None, :] > positions - window",
        "visible &= tokens[:, None, :] >= positions - window",
    ),
    "padding columns read unwritten slots": (
        "plan",
        "read = torch.where(inside, tokens, torch.where(has_keys, key_starts[:, None], 0))",
        "read = tokens.clamp(max=block_tables.shape[1] * block_size - 1)",
    ),
    "wrong row inside a block": (
        "plan",
        "entries * block_size + read % block_size",
        "entries * block_size + (read + 1) % block_size",
    ),
    "chunk positions ignore the cached prefix": (
        "plan",
        "first = lens - num_queries",
        "first = lens * 0",
    ),
    "query heads interleaved over KV heads": (
        "attention",
        "q = padded.view(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)",
        "q = padded.view(batch, q_len, group, num_kv_heads, head_dim).permute(0, 3, 2, 1, 4)",
    ),
}
WINDOW = 5  # the fixed run's window for the window mutant


@pytest.mark.parametrize("mutation", list(SDPA_MUTANTS), ids=list(SDPA_MUTANTS))
def test_check_catches_planted_sdpa_bug(mutation: str, tmp_path: Path) -> None:
    """The fixed run at block size 16, GQA 4, with chunks over cached prefixes: windowed, so one
    check covers the window mutant too."""
    mutant = load_mutant(sdpa, *SDPA_MUTANTS[mutation], tmp_path)
    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32), backend="reference")
    window = WINDOW if "window" in mutation else None
    with pytest.raises(AssertionError):
        check_prefill(cache, MUTANT_QUERY_LENS, sdpa_prefill(mutant), 1, pad=0, window=window)


def test_fixed_run_passes_with_and_without_window() -> None:
    """The run the planted bugs use passes with the real module."""
    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 80, torch.float32), backend="reference")
    for window in (None, WINDOW):
        check_prefill(cache, MUTANT_QUERY_LENS, sdpa_prefill(), 1, pad=0, window=window)


def test_check_catches_planted_store_bug(tmp_path: Path) -> None:
    """A store that writes the keys into the value cache too is caught."""
    mutant = load_mutant(
        sdpa,
        "store",
        "((k_cache, key), (v_cache, value))",
        "((k_cache, key), (v_cache, key))",
        tmp_path,
    )

    @settings(max_examples=20, deadline=None, database=None)
    @given(data=st.data())
    def check(data: st.DataObject) -> None:
        check_store(mutant.store, 8, data, torch.float32)

    with pytest.raises(AssertionError):
        check()
