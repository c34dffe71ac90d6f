"""The Triton backend's own properties: launch configs, the compile gate, GPU rounding (modelled
by the reference's ``gpu_rounding=True``), copy waves (the interpreter runs programs in order, so
only a model can catch a bad wave)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.impl.serving.model import ModelConfig
from pagedkv.impl.serving.paged_kv import PagedKVCache
from pagedkv.kernels import compile_check, reference, trusted
from pagedkv.kernels.check_arguments import MAX_SPLITS
from pagedkv.kernels.compile_budgets import GATED_TARGETS, budget_failures
from pagedkv.kernels.launch_config import TARGETS, Call, occupancy, programs_per_sm, tiles
from pagedkv.kernels.triton_copy_blocks import hazard_free_waves
from pagedkv.spec.checks import INT32_MAX
from properties import kernel_cases as kc

HALF = kc.DTYPES[1:]
triton_decode = pytest.importorskip("pagedkv.kernels.triton_decode")
triton_prefill = pytest.importorskip("pagedkv.kernels.triton_prefill")
triton_store_kv = pytest.importorskip("pagedkv.kernels.triton_store_kv")


@settings(max_examples=500)
@given(
    longest=st.integers(1, INT32_MAX),
    window=st.none() | st.integers(1, INT32_MAX),
    num_splits=st.integers(1, MAX_SPLITS),
    dtype=st.sampled_from(kc.DTYPES),
    head_dim=st.sampled_from([48, 64, 128, 256]),
)
def test_every_split_has_work_for_the_longest_context(
    longest: int, window: int | None, num_splits: int, dtype: torch.dtype, head_dim: int
) -> None:
    """Whole-tile splits, at most those asked for, cover ``[max(0, L - w), L)``, each inside it."""
    reads = min(longest, window or longest)
    call = Call(2, 8, 2, head_dim, dtype, torch.int64, block_size=16, table_stride=4)
    config = triton_decode.decode_config(
        call, rows_per_seq=1, paged=True, max_tokens=reads, num_splits=num_splits
    )
    splits, per_split = config.grid[2], config.scalars["tokens_per_split"]
    assert 1 <= splits <= num_splits
    assert per_split % config.constexprs["BLOCK_N"] == 0
    assert splits * per_split >= reads, "the splits cover the range"
    assert (splits - 1) * per_split < reads, "the last split starts before the range's end"
    assert config.scalars["num_splits"] == splits


@given(
    programs=st.integers(1, 4096),
    tokens=st.integers(1, INT32_MAX),
    sm_count=st.integers(1, 256),
    resident=st.integers(0, 32),
)
def test_the_automatic_split_fills_the_resident_programs(
    programs: int, tokens: int, sm_count: int, resident: int
) -> None:
    """Enough splits for the SMs' resident programs, none shorter than the minimum (but one)."""
    splits = triton_decode.auto_num_splits(programs, tokens, sm_count, resident)
    assert 1 <= splits <= MAX_SPLITS
    assert splits == 1 or tokens // splits >= triton_decode.MIN_TOKENS_PER_SPLIT
    want = max(1, resident) * sm_count
    assert (
        splits == MAX_SPLITS
        or programs * splits >= want
        or splits == max(1, tokens // triton_decode.MIN_TOKENS_PER_SPLIT)
    )


def test_the_launchers_launch_their_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Launched with exactly the config (the gate's input); splits cut over ``max_context_len``."""
    launched = []
    real_run = triton_decode.run

    def record(kernel, config, *tensors):
        launched.append(config)
        real_run(kernel, config, *tensors)

    for module in (triton_decode, triton_prefill, triton_store_kv):
        monkeypatch.setattr(module, "run", record)
    generator = torch.Generator().manual_seed(0)
    k_cache, v_cache = torch.randn(2, 8, 4, 2, 64, generator=generator).half()
    query = torch.randn(2, 8, 64, generator=generator).half()
    tables = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [7, 6, 5, 4, 3, 2, 1, 0]], dtype=torch.int32)
    lens = torch.tensor([9, 5])
    kernels.paged_decode_attention(
        query, k_cache, v_cache, tables, lens, num_splits=4, max_context_len=9, backend="triton"
    )
    call = Call(2, 8, 2, 64, torch.float16, torch.int64, 4, table_stride=8, interpreted=True)
    expected = triton_decode.decode_config(
        call, rows_per_seq=4, paged=True, max_tokens=9, num_splits=4, scale=0.125
    )
    assert launched == [expected], "9 tokens are one 32-key tile: one split, no merge"
    assert expected.grid[2] == 1
    launched.clear()
    starts = torch.tensor([0, 3, 5])
    kernels.paged_prefill_attention(
        torch.randn(5, 8, 64, generator=generator).half(), k_cache, v_cache, tables, starts,
        lens, max_query_len=3, backend="triton",
    )  # fmt: skip
    expected = triton_prefill.prefill_config(call, window=32, max_query_len=3, scale=0.125)
    assert launched == [expected]
    kernels.store_kv(query[:, :2], query[:, 2:4], k_cache, v_cache, lens, backend="triton")
    dtypes, strides = (torch.float16, torch.float16, torch.int64), (512, 64, 1) * 2
    assert launched[1] == triton_store_kv.store_config((2, 2, 64), dtypes, strides, None)


def test_pure_decode_steps_run_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decodes only: the (trusted) decode kernel with the host's longest context; else prefill."""
    calls: list[tuple[str, tuple]] = []
    for name in ("paged_decode_attention", "paged_prefill_attention"):
        real = getattr(trusted, name)

        def spy(*args, _name=name, _real=real):
            calls.append((_name, args))
            return _real(*args)

        monkeypatch.setattr(trusted, name, spy)
    config = ModelConfig(num_layers=1)  # 4 query heads over 2 KV heads, head dim 16
    cache = PagedKVCache(config, num_blocks=6, block_size=2, backend="triton")
    tables = torch.tensor([[0, 1, 2], [3, 4, -1]], dtype=torch.int32)
    head_dim = config.head_dim

    def attend(query_lens: list[int], context_lens: list[int]) -> None:
        step = cache.step(tables, query_lens, context_lens)
        tokens = sum(query_lens)
        q = torch.randn(tokens, 4, head_dim)
        kv = torch.randn(tokens, 2, head_dim)
        step.attend(0, q, kv, kv, window=None)

    attend([5, 3], [5, 3])
    attend([1, 1], [6, 4])
    assert [name for name, _ in calls] == ["paged_prefill_attention", "paged_decode_attention"]
    assert calls[1][1][-3:] == (6, "triton", None)  # max_context_len, the backend, no fp8 scales


def test_programs_per_sm_follows_the_limits() -> None:
    """Register-, shared-memory- and warp-bound cases, against hand-worked figures: 56
    registers round to 1792 per warp, 36 warps, 9 programs of 4 warps (56.25%); 139 registers
    (144 allocated) give 14 warps, 3 programs; 44.5 KB bounds sm_80 to 3."""
    sm90, sm80 = TARGETS[90], TARGETS[80]
    assert programs_per_sm(sm90, 56, 12800, 4) == 9
    assert occupancy(sm90, 9, 4) == 0.5625
    assert programs_per_sm(sm90, 139, 45568, 4) == 3
    assert programs_per_sm(sm90, 72, 0, 4) == 7
    assert programs_per_sm(sm80, 32, 45568, 4) == 3
    assert programs_per_sm(sm90, 16, 0, 1) == 32  # the program-slot limit
    assert programs_per_sm(sm90, 255, 300 * 1024, 4) == 0


def row(**overrides) -> dict:
    """A gate row that meets every budget, with ``overrides``."""
    base = {
        "kernel": "decode", "dtype": "fp16", "head_dim": 128, "block_size": 16, "group": 4,
        "target": 90, "registers": 56, "spill_stores": 0, "spill_loads": 0, "shared": 12800,
        "mma": "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "programs": 9,
        "occupancy": 0.5625,
    }  # fmt: skip
    return {**base, **overrides}


FP32_PREFILL = {"kernel": "prefill", "dtype": "fp32", "mma": "FMA", "spill_stores": 4}


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        ({"spill_stores": 8}, "spills"),
        ({"mma": "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32"}, "native 16-bit"),
        ({"mma": "FMA"}, "native 16-bit"),
        ({"dtype": "bf16"}, "native 16-bit"),
        ({"occupancy": 0.375}, "occupancy"),
        ({"target": 80, "occupancy": 0.25}, "occupancy"),
        (FP32_PREFILL, "spills"),
        # Left alone (docs/kernels.md's exceptions): sm_100 is reported, not gated; prefill has
        # no occupancy floor; head dims 48 and 256 are reported, so they may spill.
        ({"target": 100, "occupancy": 0.1}, None),
        ({"kernel": "prefill", "occupancy": 0.25}, None),
        ({**FP32_PREFILL, "head_dim": 256}, None),
        ({"head_dim": 256, "spill_stores": 16}, None),
    ],
)
def test_the_budgets_catch_what_they_forbid(overrides: dict, why: str | None) -> None:
    assert budget_failures([row()]) == []
    failures = budget_failures([row(**overrides)])
    assert len(failures) == (why is not None) and all(why in failure for failure in failures)


def test_an_fp8_cache_keeps_the_occupancy_of_the_query_dtypes_cache_or_its_floor() -> None:
    fp16, fp8 = row(target=80), row(target=80, dtype="fp16+fp8_e4m3", occupancy=0.5)
    assert budget_failures([fp16, {**fp8, "occupancy": 0.5625}]) == [] != budget_failures([fp8])
    assert [f[-30:] for f in budget_failures([fp16, fp8])] == ["50.0% < the fp16 cache's 56.2%"]
    fp16, fp8 = ({**r, "kernel": "prefill", "target": 90} for r in (fp16, fp8))
    assert budget_failures([fp16, {**fp8, "occupancy": 0.25}])  # D128: no floor listed
    fp16, fp8 = ({**r, "head_dim": 80} for r in (fp16, fp8))  # FP8_SHORTFALLS: 25%
    assert budget_failures([fp16, {**fp8, "occupancy": 0.25}]) == []
    assert len(budget_failures([fp16, {**fp8, "occupancy": 0.1875}])) == 1


def test_the_tile_table_is_total() -> None:
    head_dims = (1, 48, 64, 80, 96, 128, 200, 256, 512)
    for kernel, dtype, head_dim in itertools.product(("decode", "prefill"), kc.DTYPES, head_dims):
        tile = tiles(kernel, dtype, head_dim, 90)
        assert tile.block_n >= 16 and tile.rows >= 16 and tile.num_warps in (4, 8)
    with pytest.raises(ValueError, match="kernel"):
        tiles("merge", torch.float16, 64, 90)


def test_the_compile_gate_sample_meets_the_budgets() -> None:
    """Seven variants on sm_80 and sm_90: 16-bit MMA, no spills, vLLM's occupancy, fp32 on FMA,
    an fp8 cache's decode and store at the fp16 cache's occupancy."""
    rows = compile_check.measure(sample=True, targets=(80, 90))
    assert len(rows) == 14
    assert budget_failures(rows) == []
    fp32 = [r for r in rows if r["dtype"] == "fp32"]
    assert fp32 and all(r["mma"] == "FMA" and not r["spill_stores"] for r in fp32)
    for r in rows:
        assert r["registers"] > 0 and (r["shared"] > 0) != (r["kernel"] == "store")
        assert 0 < r["occupancy"] <= 1


@pytest.mark.long
def test_the_compile_gate_meets_the_budgets_over_the_ci_grid() -> None:
    """Every dtype (fp8 caches: both formats), budgeted head dim and GQA group at block size 16
    on sm_80 and sm_90."""
    grid = compile_check.Grid(
        compile_check.CI_LABELS, compile_check.CI_HEAD_DIMS, compile_check.CI_BLOCK_SIZES
    )
    rows = compile_check.measure(targets=GATED_TARGETS, grid=grid)
    assert {r["target"] for r in rows} == set(GATED_TARGETS)
    assert {r["dtype"] for r in rows} == set(compile_check.CI_LABELS)
    assert {r["head_dim"] for r in rows} == set(compile_check.CI_HEAD_DIMS)
    assert budget_failures(rows) == []


@pytest.mark.parametrize("dtype", HALF, ids=str)
@settings(max_examples=kc.kernel_examples(30), deadline=None)
@given(data=st.data())
def test_gpu_rounding_stays_within_the_tolerance(dtype: torch.dtype, data: st.DataObject) -> None:
    """Decode and prefill with the GPU's rounding vs exact attention and the dense oracle."""
    head_dim = data.draw(st.sampled_from([64, 128]), label="head_dim")
    cache = kc.draw_cache(data, "reference", dtype=dtype, head_dim=head_dim)
    seqs, tables, lens = cache.batch()
    scale = data.draw(st.sampled_from([head_dim**-0.5, 1.0]), label="scale")
    query = cache.randn(len(seqs), cache.shape.num_heads, head_dim)
    args = (query, cache.k_cache, cache.v_cache, tables, lens, scale)
    rounded = reference.paged_decode_attention(*args, gpu_rounding=True)
    kc.assert_close(rounded, reference.paged_decode_attention(*args), "GPU rounding vs exact")
    kc.assert_close(
        rounded, kc.dense_attention(query, seqs, scale), "GPU rounding vs dense, decode"
    )

    query_lens = [data.draw(st.integers(0, s.length), label="q_len") for s in seqs]
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    flat = cache.randn(int(starts[-1]), cache.shape.num_heads, head_dim)
    args = (flat, cache.k_cache, cache.v_cache, tables, starts, lens, scale)
    rounded = reference.paged_prefill_attention(*args, gpu_rounding=True)
    kc.assert_close(rounded, reference.paged_prefill_attention(*args), "GPU rounding, prefill")


def rounding_case(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Decode arguments on the fixed run at block size 16, head dim 128."""
    cache = kc.fixed_cache(16, 4, 128, dtype)
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 8, 128)
    return query, cache.k_cache, cache.v_cache, tables, lens, 128**-0.5


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_the_kernels_agree_with_the_gpu_rounding(dtype: torch.dtype, tmp_path: Path) -> None:
    """The kernels round P (even interpreted) as the reference does, and that moves outputs
    within the tolerance; P rounded to fp8 instead, planted in the reference, breaks it."""
    args = rounding_case(dtype)
    exact = reference.paged_decode_attention(*args)
    rounded = reference.paged_decode_attention(*args, gpu_rounding=True)
    assert not torch.equal(rounded, exact)
    kc.assert_close(rounded, exact, "GPU rounding vs exact")
    for splits in (1, 3):
        triton = kernels.paged_decode_attention(*args, num_splits=splits, backend="triton")
        kc.assert_close(triton, rounded, f"triton ({splits} splits) vs GPU rounding")
    old, new = "p.to(query.dtype).float()", "p.to(torch.float8_e4m3fn).float()"
    mutant = kc.load_mutant(reference, "masked_attention", old, new, tmp_path)
    with pytest.raises(AssertionError):
        kc.assert_close(mutant.paged_decode_attention(*args, gpu_rounding=True), exact, "fp8 P")


Waves = Callable[[list[tuple[int, int]]], list[list[tuple[int, int]]]]


def check_waves(pairs: list[tuple[int, int]], order: random.Random, waves_of: Waves) -> None:
    """Each wave run at once (as on a GPU) equals any serial order; all waves, the sequence."""
    waves = waves_of(pairs)
    assert [pair for wave in waves for pair in wave] == pairs
    sequential = list(range(5))  # block b holds the value b
    for src, dst in pairs:
        sequential[dst] = sequential[src]
    state = list(range(5))
    for wave in waves:
        simultaneous = list(state)
        for src, dst in wave:
            simultaneous[dst] = state[src]
        serial = list(state)
        for src, dst in order.sample(wave, len(wave)):
            serial[dst] = serial[src]
        assert simultaneous == serial, f"wave {wave} is not safe to run in parallel"
        state = simultaneous
    assert state == sequential


@settings(max_examples=kc.kernel_examples(300))
@given(
    pairs=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 4)), max_size=8),
    order=st.randoms(use_true_random=False),
)
def test_waves_are_safe_to_run_in_parallel(
    pairs: list[tuple[int, int]], order: random.Random
) -> None:
    check_waves(pairs, order, hazard_free_waves)


@pytest.mark.parametrize("pairs", [[(0, 1), (1, 2)], [(1, 2), (0, 1)], [(0, 1), (2, 1)]])
def test_check_catches_one_wave_for_dependent_pairs(pairs: list[tuple[int, int]]) -> None:
    """Planted bug: read-after-write, write-after-read or write-after-write pairs in one wave."""

    class Reversed(random.Random):
        def sample(self, population, k):  # type: ignore[override]
            return list(reversed(population))[:k]

    with pytest.raises(AssertionError):
        check_waves(pairs, Reversed(), lambda pairs: [list(pairs)])
