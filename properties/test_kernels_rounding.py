"""The documented tolerances hold where a GPU rounds, not only in the exact interpreter.

A compiled kernel multiplies the cache-dtype operands natively with fp32 sums, scales the fp32
scores, and rounds the unnormalized softmax weights to the cache dtype before the PV product
(docs/kernels.md, Tolerances). The Triton interpreter computes the products exactly, so the
torch reference has a mode that rounds where the GPU does (``gpu_rounding=True``). Here: that
mode stays within ``TOLERANCES`` of exact attention and of the dense oracle, on spec-run caches,
for decode and prefill; the kernels agree with it too; and it really rounds (it differs from
the exact result), so the check is not vacuous. A planted rounding one step coarser (P in
fp8) breaks the tolerance, so the tolerance is tight enough to notice a wrong rounding point.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import reference
from properties.kernel_cases import (
    BLOCK_SIZES,
    GQA_RATIOS,
    KVCache,
    Shape,
    assert_close,
    dense_attention,
    fixed_scenario,
    kernel_examples,
    load_mutant,
    scenarios,
)

HALF = (torch.float16, torch.bfloat16)


def draw(data: st.DataObject, dtype: torch.dtype) -> KVCache:
    block_size = data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
    group = data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = data.draw(st.sampled_from([64, 128]), label="head_dim")
    scenario = data.draw(scenarios(block_size), label="scenario")
    return KVCache(scenario, Shape(block_size, 1, group, head_dim, dtype), backend="reference")


@pytest.mark.parametrize("dtype", HALF, ids=str)
@settings(max_examples=kernel_examples(30), deadline=None)
@given(data=st.data())
def test_gpu_rounding_stays_within_the_tolerance(dtype: torch.dtype, data: st.DataObject) -> None:
    """Decode and prefill with the GPU's rounding vs exact attention and the dense oracle."""
    cache = draw(data, dtype)
    seqs, tables, lens = cache.batch()
    scale = data.draw(st.sampled_from([cache.shape.head_dim**-0.5, 1.0]), label="scale")
    query = cache.randn(len(seqs), cache.shape.num_heads, cache.shape.head_dim)
    args = (query, cache.k_cache, cache.v_cache, tables, lens, scale)
    rounded = reference.paged_decode_attention(*args, gpu_rounding=True)
    exact = reference.paged_decode_attention(*args)
    assert_close(rounded, exact, "GPU rounding vs exact, decode")
    assert_close(rounded, dense_attention(query, seqs, scale), "GPU rounding vs dense, decode")

    query_lens = [data.draw(st.integers(0, s.length), label="q_len") for s in seqs]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    flat = cache.randn(int(starts[-1]), cache.shape.num_heads, cache.shape.head_dim)
    args = (flat, cache.k_cache, cache.v_cache, tables, starts, lens, scale)
    rounded = reference.paged_prefill_attention(*args, gpu_rounding=True)
    assert_close(rounded, reference.paged_prefill_attention(*args), "GPU rounding, prefill")


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_kernels_agree_with_the_gpu_rounding(dtype: torch.dtype) -> None:
    """The Triton kernels (which round P too, even interpreted) vs the rounding reference, and
    the rounding is real: it moves outputs away from the exact result."""
    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 128, dtype), backend="reference")
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 8, 128)
    args = (query, cache.k_cache, cache.v_cache, tables, lens, 128**-0.5)
    rounded = reference.paged_decode_attention(*args, gpu_rounding=True)
    for splits in (1, 3):
        triton = kernels.paged_decode_attention(*args, num_splits=splits, backend="triton")
        assert_close(triton, rounded, f"triton ({splits} splits) vs GPU rounding")
    assert not torch.equal(rounded, reference.paged_decode_attention(*args))


def test_a_coarser_rounding_breaks_the_tolerance(tmp_path: Path) -> None:
    """P rounded to fp8 (e4m3) instead of the cache dtype, planted in the reference, fails the
    fp16 tolerance: the property can tell a wrong rounding point."""
    mutant = load_mutant(
        reference,
        "masked_attention",
        "p.to(key.dtype).float()",
        "p.to(torch.float8_e4m3fn).float()",
        tmp_path,
    )
    cache = KVCache(fixed_scenario(16), Shape(16, 2, 4, 128, torch.float16), backend="reference")
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 8, 128)
    args = (query, cache.k_cache, cache.v_cache, tables, lens, 128**-0.5)
    exact = reference.paged_decode_attention(*args)
    assert_close(reference.paged_decode_attention(*args, gpu_rounding=True), exact, "real")
    with pytest.raises(AssertionError):
        assert_close(mutant.paged_decode_attention(*args, gpu_rounding=True), exact, "fp8 P")
