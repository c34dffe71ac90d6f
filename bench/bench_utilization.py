"""KV memory utilization over each request's life: the paper's policies, every workload.

For every workload of ``bench.workloads.WORKLOADS``, :func:`lifetime_breakdown` splits the slots
each policy holds over every step of every sequence's life into token states, reservation and
internal fragmentation (see ``bench/utilization_policies.py``). No scheduling, no budget: this
is the memory each policy needs for the same work.

One benchmark per policy, timing the accounting of all the workloads (numpy; about 6 ms, long
enough for a stable median): groups ``utilization-bs{B}`` (paged at block size ``B``) and
``utilization-orca-{max,pow2,oracle}``. ``extra_info`` holds each workload's utilization and
shares; they are deterministic, and asserted below.

Sliding window (group ``window``, ``kind="window"``): :func:`window_run` serves long generations
(contexts of 4k to 32k tokens from 1k-token prompts, blocks of 16) through impl's real
``Scheduler`` and ``BlockTableStore``, bookkeeping only, with Mistral's window of 4096 and with
full attention, and measures the blocks each sequence holds after every schedule (while its step
computes) over its whole life, and the pool's peak. ``python -m bench.bench_utilization`` prints
the table docs/results.md shows.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from bench.utilization_policies import (
    PAPER_BLOCK_SIZES,
    PAPER_CONTIGUOUS,
    Contiguous,
    MemoryBreakdown,
    Paged,
    Policy,
    lifetime_breakdown,
    next_power_of_two,
)
from bench.workloads import WORKLOADS, Workload, chapter_toy
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig
from pagedkv.spec.block_manager import blocks_needed
from pagedkv.spec.utilization import contiguous_usage, paged_usage

POLICIES: dict[str, Policy] = {
    policy.name: policy for policy in (*(Paged(b) for b in PAPER_BLOCK_SIZES), *PAPER_CONTIGUOUS)
}
ROUNDS = 30


@functools.cache
def workload(name: str) -> Workload:
    return WORKLOADS[name]()


@functools.cache
def breakdown(workload_name: str, policy_name: str) -> MemoryBreakdown:
    return lifetime_breakdown(workload(workload_name), POLICIES[policy_name])


def account_all(policy: Policy) -> dict[str, MemoryBreakdown]:
    return {name: lifetime_breakdown(workload(name), policy) for name in WORKLOADS}


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_lifetime_utilization(benchmark: Any, policy_name: str) -> None:
    policy = POLICIES[policy_name]
    suffix = f"bs{policy.block_size}" if isinstance(policy, Paged) else policy.name
    benchmark.group = f"utilization-{suffix}"
    results = benchmark.pedantic(account_all, args=(policy,), rounds=ROUNDS)
    assert results == {name: breakdown(name, policy_name) for name in WORKLOADS}
    benchmark.extra_info.update(
        kind="lifetime",
        policy=policy.name,
        label=policy.label,
        block_size=getattr(policy, "block_size", None),
        utilization={name: round(r.utilization, 4) for name, r in results.items()},
        shares={
            name: {k: round(v, 4) for k, v in r.shares().items() if k != "unallocated"}
            for name, r in results.items()
        },
    )


# ----------------------------------------------------------------- deterministic figures


def test_chapter_toy_lifetime_figures_by_hand() -> None:
    """10-token prompt, 21 outputs: 21 steps holding 10..30 tokens, 420 token-slot-steps.

    Max holds 50 each step (1050): reservation sum(30 - c) = 210, internal 21 * 20 = 420.
    Paged (16): 16 slots for 10..16 (7 steps), 32 for 17..30 (14 steps) = 560; its last block
    never fills 2 slots during those 14 steps = 28. Oracle holds 30 (630); Pow2 10 + 32 = 42.
    """
    per_request = {
        "orca-max": (420, 210, 420),
        "orca-oracle": (420, 210, 0),
        "orca-pow2": (420, 210, 21 * 12),
        "paged-bs16": (420, 112, 28),
    }
    for policy_name, parts in per_request.items():
        assert breakdown("chapter", policy_name) == MemoryBreakdown(*(8 * x for x in parts))
    assert breakdown("chapter", "orca-max").utilization == pytest.approx(0.4)
    assert breakdown("chapter", "paged-bs16").utilization == pytest.approx(0.75)


def test_chapter_toy_final_state_is_the_chapters_60_and_94_percent() -> None:
    """At completion the toy's sequences hold 30 slots each: the chapter's utilization table."""
    kv_lens = [n for request in chapter_toy().requests for n in request.kv_lens]
    assert kv_lens == [30] * 8
    assert contiguous_usage(kv_lens, chapter_toy().max_len).utilization == pytest.approx(0.60)
    assert paged_usage(kv_lens, 16).utilization == pytest.approx(0.9375)


def test_lifetime_paged_allocation_is_spec_paged_usage() -> None:
    """The vectorized accounting allocates what ``spec.utilization.paged_usage`` reserves for
    the same token counts (every step of every sequence of a small trace)."""
    trace = WORKLOADS["alpaca"]()
    counts = [
        request.prompt_len + j
        for request in trace.requests[:40]
        for output_len in request.output_lens
        for j in range(output_len)
    ]
    small = Workload("small", trace.requests[:40], trace.max_len, "first 40 requests")
    for block_size in PAPER_BLOCK_SIZES:
        result = lifetime_breakdown(small, Paged(block_size))
        usage = paged_usage(counts, block_size)
        assert (result.allocated, result.token_states) == (usage.reserved_slots, usage.used_slots)


def test_paper_contiguous_reservations() -> None:
    """Pow2 reserves the next power of two of the output ("25 -> 32 positions"); Oracle the
    slots the sequence fills; Max the model's maximum; Pow2 never exceeds Max."""
    assert next_power_of_two([1, 2, 3, 25, 32, 33, 1024]).tolist() == [1, 2, 4, 32, 32, 64, 1024]
    reservations = {c.kind: int(c.reservation(100, 25, 2048)) for c in PAPER_CONTIGUOUS}
    assert reservations == {"max": 2048, "pow2": 132, "oracle": 124}
    assert int(Contiguous("pow2").reservation(1500, 600, 2048)) == 2048
    with pytest.raises(ValueError, match="unknown contiguous policy"):
        Contiguous("buddy")


def test_sharegpt_paged_bs16_holds_at_least_96_percent_token_states() -> None:
    assert breakdown("sharegpt", "paged-bs16").utilization >= 0.96


@pytest.mark.parametrize("workload_name", ["sharegpt", "alpaca"])
def test_utilization_orders_paged_oracle_pow2_max(workload_name: str) -> None:
    order = ["paged-bs16", "orca-oracle", "orca-pow2", "orca-max"]
    utilization = [breakdown(workload_name, name).utilization for name in order]
    assert utilization == sorted(utilization, reverse=True)
    assert len(set(utilization)) == len(utilization)


@pytest.mark.parametrize("workload_name", list(WORKLOADS))
def test_paged_utilization_falls_with_block_size(workload_name: str) -> None:
    """Doubling the block can only round a table up further, so utilization never rises."""
    utilization = [breakdown(workload_name, f"paged-bs{b}").utilization for b in PAPER_BLOCK_SIZES]
    assert utilization == sorted(utilization, reverse=True)
    assert utilization[0] == 1.0


# ----------------------------------------------------------------- sliding window

WINDOW = 4096  # Mistral 7B's sliding_window
WINDOW_BLOCK_SIZE = 16
WINDOW_PROMPT_LEN = 1024
WINDOW_CONTEXTS = (4096, 8192, 16384, 32768)  # prompt plus output, one request each


@dataclass(frozen=True)
class HeldOverLife:
    """The blocks one sequence held after every schedule of its life (its table's entries less
    the released ones): the most, and the mean over those steps."""

    context: int  # prompt plus output tokens
    max_blocks: int
    mean_blocks: float


@dataclass(frozen=True)
class WindowRun:
    """One :func:`window_run`: each sequence's blocks over its life, the most blocks the pool
    had in use after a schedule, and the steps."""

    window: int | None
    sequences: tuple[HeldOverLife, ...]
    peak_pool_blocks: int
    steps: int


def window_run(
    window: int | None,
    contexts: tuple[int, ...] = WINDOW_CONTEXTS,
    prompt_len: int = WINDOW_PROMPT_LEN,
    block_size: int = WINDOW_BLOCK_SIZE,
) -> WindowRun:
    """Serve one request per context length (``prompt_len`` prompt tokens, the rest generated,
    no EOS) with impl's ``Scheduler`` (``sliding_window=window``) over a ``BlockTableStore``
    whose pool holds every sequence whole, so nothing is preempted and both runs do the same
    steps. After every ``schedule()`` (the memory while the step computes) it records the blocks
    each running sequence holds."""
    pool = sum(blocks_needed(context, block_size) for context in contexts)
    store = BlockTableStore(
        BlockManager(pool, block_size), len(contexts), blocks_needed(max(contexts), block_size)
    )
    scheduler = Scheduler(store, SchedulerConfig(len(contexts), 2048, 0, window))
    for request_id, context in enumerate(contexts):
        scheduler.add_request(request_id, [1] * prompt_len, context - prompt_len + 1)
    most = np.zeros(len(contexts), dtype=np.int64)
    total = np.zeros(len(contexts), dtype=np.int64)
    steps = np.zeros(len(contexts), dtype=np.int64)
    peak = 0
    while scheduler.has_unfinished():
        plan = scheduler.schedule()
        rows = store.resolve(None).rows
        held = (store.num_blocks[rows] - store.num_released[rows]).astype(np.int64)
        seqs = np.array(store.seq_ids, dtype=np.intp)  # the request ids: one sequence each
        np.maximum.at(most, seqs, held)
        np.add.at(total, seqs, held)
        np.add.at(steps, seqs, 1)
        peak = max(peak, store.total_blocks - store.num_free_blocks)
        scheduler.update(plan, [1] * int(plan.samples.sum()))  # one token per sampling row
    life = tuple(
        HeldOverLife(context, int(m), float(t / n))
        for context, m, t, n in zip(contexts, most, total, steps, strict=True)
    )
    return WindowRun(window, life, peak, int(steps.max()))


def test_sliding_window_bounds_blocks_held(benchmark: Any) -> None:
    """The figures docs/results.md quotes. With the window every sequence holds at most the
    window's 256 blocks plus one (the scheduler releases before it grows;
    ``blocks_needed(window - 1, 16) + 1 = 257``); with full attention it holds its whole
    context. The pool's peak falls from the 32k sequence's 2048 blocks to 1024 (the four
    sequences' windows); the 32k sequence's mean falls below a quarter of its full-attention
    mean; the 4k sequence, never longer than the window, is unchanged. Timing: the bookkeeping
    of both runs."""
    benchmark.group = "window"
    window, full = benchmark.pedantic(lambda: (window_run(WINDOW), window_run(None)), rounds=1)
    bs = WINDOW_BLOCK_SIZE
    for windowed, whole in zip(window.sequences, full.sequences, strict=True):
        assert whole.max_blocks == blocks_needed(whole.context, bs)
        assert windowed.max_blocks == min(
            blocks_needed(windowed.context, bs), blocks_needed(WINDOW - 1, bs) + 1
        )
    assert (full.peak_pool_blocks, window.peak_pool_blocks) == (2048, 1024)
    assert full.steps == window.steps
    assert window.sequences[0] == full.sequences[0]
    assert window.sequences[-1].mean_blocks < full.sequences[-1].mean_blocks / 4
    benchmark.extra_info.update(
        kind="window",
        window=WINDOW,
        block_size=bs,
        prompt_len=WINDOW_PROMPT_LEN,
        contexts=list(WINDOW_CONTEXTS),
        **{
            f"{name}_{field}": value
            for name, run in (("window", window), ("full", full))
            for field, value in (
                ("max_blocks", [seq.max_blocks for seq in run.sequences]),
                ("mean_blocks", [round(seq.mean_blocks, 1) for seq in run.sequences]),
                ("peak_pool_blocks", run.peak_pool_blocks),
                ("steps", run.steps),
            )
        },
    )


def window_table() -> str:
    """The markdown table of both runs, as docs/results.md shows it."""
    full, window = window_run(None), window_run(WINDOW)
    lines = [
        f"| context (tokens) | full attention: max / mean blocks | window {WINDOW}: max / mean "
        "blocks |",
        "|---|---|---|",
    ]
    for a, b in zip(full.sequences, window.sequences, strict=True):
        lines.append(
            f"| {a.context} | {a.max_blocks} / {a.mean_blocks:.1f} | "
            f"{b.max_blocks} / {b.mean_blocks:.1f} |"
        )
    lines.append(
        f"| pool peak (blocks in use) | {full.peak_pool_blocks} | {window.peak_pool_blocks} |"
    )
    lines.append(f"| steps | {full.steps} | {window.steps} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(window_table())
