"""KV memory utilization over each request's life: the paper's policies, every workload.

For every workload of ``bench.workloads.WORKLOADS``, :func:`lifetime_breakdown` splits the slots
each policy holds over every step of every sequence's life into token states, reservation and
internal fragmentation (see ``bench/utilization_policies.py``). No scheduling, no budget: this
is the memory each policy needs for the same work.

One benchmark per policy, timing the accounting of all the workloads (numpy; about 6 ms, long
enough for a stable median): groups ``utilization-bs{B}`` (paged at block size ``B``) and
``utilization-orca-{max,pow2,oracle}``. ``extra_info`` holds each workload's utilization and
shares; they are deterministic, and asserted below.
"""

from __future__ import annotations

import functools
from typing import Any

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
