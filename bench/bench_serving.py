"""The serving simulator under a fixed KV budget: the paper's batch-size and memory comparison.

Every run is ``bench.simulator.simulate`` (impl's ``Scheduler`` over impl's ``BlockTableStore``,
or over ``ContiguousStore`` for the Orca baselines) on a workload of
``bench.workloads.WORKLOADS``, with the OPT-13B budget of 15,616 slots (the chapter's toy: its
400 slots). The timing is one whole simulation, ``ROUNDS`` times (one round left a single
sample for a compare to read): it moves with the cost of the scheduler and the block
tables. Everything the run measured is in ``extra_info``
(``ServingResult.summary``, and 64-point batch and utilization series), and the deterministic
figures are asserted by the tests at the end of this file, which reuse the benchmarks' runs.

Groups: ``serving-{workload}-bs{B}`` (paged; with sharing on and off for the sharing workloads)
and ``serving-{workload}-contiguous`` (the three Orca policies); ``serving-kv-dtype``: ShareGPT at
block size 16 in one KV byte budget (OPT-13B's 15,616 fp16 slots) kept in fp32, fp16 or fp8, so
the pool holds ``spec.utilization.blocks_in_budget`` blocks of each, with ``max_num_seqs`` and
the token budget above what fp8's pool holds.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.paper import FIG13A_BATCH_RATIOS, FIG15_PARALLEL_SAVING
from bench.simulator import OPT_13B_KV_SLOTS, ServingConfig, ServingResult, simulate
from bench.utilization_policies import PAPER_CONTIGUOUS, Contiguous, Paged
from bench.workloads import CHAPTER_KV_SLOTS, WORKLOADS
from pagedkv.spec.utilization import blocks_in_budget, bytes_per_block

ORDER = ("paged-bs16", "orca-oracle", "orca-pow2", "orca-max")
POLICY_RUNS = [(w, p) for w in ("sharegpt", "alpaca", "chapter") for p in ORDER]
SWEEP_BLOCK_SIZES = (16, 32, 64, 128, 256)
SWEEP_RUNS = [("sharegpt", f"paged-bs{b}") for b in SWEEP_BLOCK_SIZES[1:]]
SHARING_RUNS = [(w, share) for w in ("prefix200", "alpaca-n4") for share in (True, False)]

_RESULTS: dict[tuple[str, str, bool], ServingResult] = {}
ROUNDS = 3
OPT_13B = {"num_layers": 40, "num_kv_heads": 40, "head_dim": 128}  # K/V of every layer, per token
KV_BUDGET_BYTES = OPT_13B_KV_SLOTS * bytes_per_block(1, **OPT_13B, kv_cache_dtype="fp16")
KV_DTYPES = ("fp32", "fp16", "fp8_e4m3")
_BY_DTYPE: dict[str, ServingResult] = {}


def kv_dtype_config(kv_cache_dtype: str) -> ServingConfig:
    """The ShareGPT server whose KV byte budget is kept in ``kv_cache_dtype``: as many blocks
    of 16 as the budget holds, and limits above fp8's concurrency."""
    block_bytes = bytes_per_block(16, **OPT_13B, kv_cache_dtype=kv_cache_dtype)
    slots = blocks_in_budget(KV_BUDGET_BYTES, block_bytes) * 16
    return ServingConfig(budget_slots=slots, max_num_seqs=1024, max_num_batched_tokens=8192)


def policy_of(name: str) -> Paged | Contiguous:
    if name.startswith("paged-bs"):
        return Paged(int(name.removeprefix("paged-bs")))
    return next(policy for policy in PAPER_CONTIGUOUS if policy.name == name)


def config_of(workload_name: str) -> ServingConfig:
    if workload_name == "chapter":
        return ServingConfig(budget_slots=CHAPTER_KV_SLOTS)
    return ServingConfig()


def run(workload_name: str, policy_name: str, share: bool = False) -> ServingResult:
    """The simulation, computed once per session (the benchmark's run, when it ran first)."""
    key = (workload_name, policy_name, share)
    if key not in _RESULTS:
        policy, config = policy_of(policy_name), config_of(workload_name)
        _RESULTS[key] = simulate(WORKLOADS[workload_name](), policy, config, share=share)
    return _RESULTS[key]


def benchmark_run(benchmark: Any, workload_name: str, policy_name: str, share: bool) -> None:
    policy, config = policy_of(policy_name), config_of(workload_name)
    trace = WORKLOADS[workload_name]()
    kind = f"bs{policy.block_size}" if isinstance(policy, Paged) else "contiguous"
    benchmark.group = f"serving-{workload_name}-{kind}"
    result = benchmark.pedantic(
        simulate, args=(trace, policy, config), kwargs={"share": share}, rounds=ROUNDS
    )
    _RESULTS[(workload_name, policy_name, share)] = result
    benchmark.extra_info.update(kind="serving", **result.summary(), series=result.downsampled())


@pytest.mark.parametrize(("workload_name", "policy_name"), POLICY_RUNS + SWEEP_RUNS)
def test_serving(benchmark: Any, workload_name: str, policy_name: str) -> None:
    benchmark_run(benchmark, workload_name, policy_name, share=False)


@pytest.mark.parametrize(("workload_name", "share"), SHARING_RUNS)
def test_serving_sharing(benchmark: Any, workload_name: str, share: bool) -> None:
    benchmark_run(benchmark, workload_name, "paged-bs16", share=share)


@pytest.mark.parametrize("kv_cache_dtype", KV_DTYPES)
def test_serving_kv_dtype(benchmark: Any, kv_cache_dtype: str) -> None:
    benchmark.group = "serving-kv-dtype"
    config = kv_dtype_config(kv_cache_dtype)
    result = benchmark.pedantic(
        simulate, args=(WORKLOADS["sharegpt"](), Paged(16), config), rounds=ROUNDS
    )
    _BY_DTYPE[kv_cache_dtype] = result
    benchmark.extra_info.update(kind="serving", kv_cache_dtype=kv_cache_dtype, **result.summary())


def test_fp8_serves_at_least_1_9x_the_concurrent_sequences_of_fp16() -> None:
    """Issue 34's target, measured: in one byte budget, the saturated steps' mean batch of an
    fp8 cache over fp16's (and fp16's over fp32's, the same halving of bytes)."""
    for dtype in KV_DTYPES:
        if dtype not in _BY_DTYPE:
            _BY_DTYPE[dtype] = simulate(WORKLOADS["sharegpt"](), Paged(16), kv_dtype_config(dtype))
    fp32, fp16, fp8 = (_BY_DTYPE[dtype].mean_batch for dtype in KV_DTYPES)
    assert fp8 >= 1.9 * fp16 and fp16 >= 1.9 * fp32, (fp32, fp16, fp8)
    assert _BY_DTYPE["fp8_e4m3"].peak_batch >= 1.9 * _BY_DTYPE["fp16"].peak_batch


# ----------------------------------------------------------------- the paper's shape


def test_sharegpt_paged_bs16_holds_at_least_96_percent_token_states() -> None:
    """Of the slots it holds, and (the paper's Fig. 2 measure, 96.3%) of the whole budget."""
    paged = run("sharegpt", "paged-bs16")
    assert paged.utilization >= 0.96
    assert paged.memory.shares()["token_states"] >= 0.96


@pytest.mark.parametrize("workload_name", ["sharegpt", "alpaca"])
def test_batch_and_utilization_order_paged_oracle_pow2_max(workload_name: str) -> None:
    results = [run(workload_name, name) for name in ORDER]
    for metric in ("mean_batch", "utilization"):
        values = [getattr(result, metric) for result in results]
        assert values == sorted(values, reverse=True), metric
        assert len(set(values)) == len(values), metric


def test_sharegpt_batch_ratios_against_the_paper() -> None:
    """The paper: 4.3x Max, 2.2x Oracle. Here Max's ratio is at least the paper's; Oracle's is
    lower (about 1.6x): our contiguous allocator has no external fragmentation (see
    docs/results.md)."""
    paged = run("sharegpt", "paged-bs16").mean_batch
    assert paged / run("sharegpt", "orca-max").mean_batch >= FIG13A_BATCH_RATIOS["orca-max"]
    assert paged / run("sharegpt", "orca-oracle").mean_batch >= 1.5
    for name in ORDER:
        assert run("sharegpt", name).saturated_steps > run("sharegpt", name).steps / 2


def test_only_paged_memory_preempts() -> None:
    """Contiguous reservations never grow, so they never preempt; paged growth does."""
    assert run("sharegpt", "paged-bs16").preemptions > 0
    for policy in PAPER_CONTIGUOUS:
        assert run("sharegpt", policy.name).preemptions == 0


def test_sharegpt_batch_and_utilization_fall_with_block_size() -> None:
    results = [run("sharegpt", f"paged-bs{b}") for b in SWEEP_BLOCK_SIZES]
    for metric in ("mean_batch", "utilization"):
        values = [getattr(result, metric) for result in results]
        assert values == sorted(values, reverse=True), metric


def test_chapter_toy_paged_leaves_room_that_max_reserves() -> None:
    """All 8 requests run at once either way; reserving 50 each fills the chapter's 400 slots,
    while paging leaves most of them free for more requests."""
    paged, reserved = run("chapter", "paged-bs16"), run("chapter", "orca-max")
    assert paged.peak_batch == reserved.peak_batch == 8
    assert reserved.memory.shares()["unallocated"] < 0.05
    assert paged.memory.shares()["unallocated"] > 0.45


def test_shared_system_prompt_is_held_once() -> None:
    shared, copied = run("prefix200", "paged-bs16", True), run("prefix200", "paged-bs16")
    assert shared.tokens_per_slot > 3 > 1 > copied.tokens_per_slot
    assert shared.memory_saving > 0.5 and copied.memory_saving == 0
    assert shared.mean_batch > 3 * copied.mean_batch


def test_parallel_sampling_saves_what_the_paper_reports() -> None:
    """4 samples per Alpaca-like prompt share the prompt's full blocks. The paper saves 6.1% to
    9.8% on Alpaca with 2 to 6 samples; 4 samples here save about 7%."""
    shared = run("alpaca-n4", "paged-bs16", True)
    low, high = FIG15_PARALLEL_SAVING["alpaca"]
    assert low / 100 <= shared.memory_saving <= high / 100
    assert shared.tokens_per_slot > run("alpaca-n4", "paged-bs16").tokens_per_slot
