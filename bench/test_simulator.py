"""The serving simulator: it measures what the lifetime accounting predicts when nothing waits,
and it queues, preempts and shares as the scheduler and the policies say when memory is short."""

from __future__ import annotations

import pytest

from bench.simulator import ContiguousStore, ServingConfig, TokenCodec, simulate
from bench.utilization_policies import PAPER_CONTIGUOUS, Paged, lifetime_breakdown
from bench.workloads import Request, Workload, alpaca_like, chapter_toy, shared_prefix
from pagedkv.impl.blocks import BlockManager, BlockTableStore
from pagedkv.impl.serving.block_store import BlockStore

SMALL = alpaca_like(30)
ROOMY = ServingConfig(budget_slots=30 * 2048, max_num_seqs=30, max_num_batched_tokens=10**6)


@pytest.mark.parametrize(
    "policy", [Paged(1), Paged(16), Paged(256), *PAPER_CONTIGUOUS], ids=lambda p: p.name
)
def test_unconstrained_run_measures_the_lifetime_accounting(policy) -> None:
    """Every request is admitted at step 0 and runs to its end: the slot-steps the simulator
    measures through impl's scheduler and stores are exactly the static accounting's."""
    result = simulate(SMALL, policy, ROOMY)
    assert (result.saturated_steps, result.preemptions) == (0, 0)
    assert result.steps == max(o for r in SMALL.requests for o in r.output_lens)
    expected = lifetime_breakdown(SMALL, policy)
    measured = result.memory
    assert (measured.token_states, measured.reservation, measured.internal_fragmentation) == (
        expected.token_states,
        expected.reservation,
        expected.internal_fragmentation,
    )
    assert measured.total == ROOMY.budget_slots * result.steps
    assert result.peak_batch == len(SMALL)


def test_runs_are_deterministic() -> None:
    config = ServingConfig(budget_slots=1024)
    first, second = simulate(SMALL, Paged(16), config), simulate(SMALL, Paged(16), config)
    assert first.summary() == second.summary()
    assert (first.batch_series == second.batch_series).all()


def test_short_paged_memory_preempts_and_still_finishes_everything() -> None:
    result = simulate(SMALL, Paged(16), ServingConfig(budget_slots=512))
    assert result.preemptions > 0
    assert result.finished == SMALL.num_sequences
    assert result.saturated_steps > 0


def test_a_contiguous_reservation_holds_its_slots_until_the_request_ends() -> None:
    """Nine chapter requests, 400 slots, 50 reserved each: eight run, the ninth waits."""
    nine = Workload("nine", (*chapter_toy().requests, Request(8, 0, 10, (21,))), 50, "9 toys")
    config = ServingConfig(budget_slots=400)
    reserved = simulate(nine, PAPER_CONTIGUOUS[0], config)
    assert reserved.peak_batch == 8 and reserved.preemptions == 0
    assert reserved.steps == 2 * 21
    paged = simulate(nine, Paged(16), config)
    assert paged.peak_batch == 9 and paged.steps == 21


def test_idle_steps_until_an_arrival_are_skipped() -> None:
    trace = Workload("gap", (Request(0, 0, 4, (5,)), Request(1, 100, 4, (5,))), 64, "a gap")
    result = simulate(trace, Paged(4), ServingConfig(budget_slots=64))
    assert result.steps == 10 and result.finished == 2


def test_sharing_counts_shared_blocks_once() -> None:
    """Requests admitted after the first prefill find the system prompt in the prefix cache
    (a small token budget spreads admissions over steps)."""
    trace = shared_prefix(40, system_prompt_len=64)
    config = ServingConfig(ROOMY.budget_slots, max_num_seqs=40, max_num_batched_tokens=256)
    shared = simulate(trace, Paged(16), config, share=True)
    copied = simulate(trace, Paged(16), config)
    assert shared.tokens_per_slot > 1 and shared.memory_saving > 0
    assert copied.tokens_per_slot <= 1 and copied.memory_saving == 0
    assert shared.tokens_per_step < copied.tokens_per_step  # cached prompt blocks are skipped


def test_both_stores_are_what_the_scheduler_needs() -> None:
    """The paged store and the contiguous one both implement the scheduler's protocol, with no
    block manager behind the contiguous one."""
    contiguous = ContiguousStore(100, 4, 50, reservation_of=lambda tokens: 8)
    assert isinstance(contiguous, BlockStore) and not hasattr(contiguous, "manager")
    assert isinstance(BlockTableStore(BlockManager(8, 4), 2, 4), BlockStore)
    with pytest.raises(NotImplementedError, match="cannot be shared"):
        contiguous.fork(0, 1)


def test_contiguous_store_refuses_to_outgrow_a_reservation() -> None:
    store = ContiguousStore(100, 4, 50, reservation_of=lambda tokens: 8)
    assert store.add_prompt(0, [1] * 6) == 0
    assert store.grow([0], 2) == [] and store.token_count(0) == 8
    with pytest.raises(RuntimeError, match="outgrows its reservation"):
        store.grow([0], 1)
    with pytest.raises(RuntimeError, match="outgrows its reservation"):
        store.add_prompt(1, [1] * 9)
    store.remove([0])
    assert store.num_free_blocks == 100


def test_token_codec_names_every_sample() -> None:
    codec = TokenCodec(system_prompt_len=3, max_samples=4)
    request = Request(7, 0, 6, (2, 3, 4, 5))
    for sample in range(4):
        prompt = codec.prompt(request, sample)
        assert prompt[:3] == [1, 2, 3] and len(prompt) == 6
        assert codec.sample_of(prompt) == (7, sample)


def test_budget_must_be_whole_blocks() -> None:
    with pytest.raises(ValueError, match="whole blocks"):
        simulate(SMALL, Paged(16), ServingConfig(budget_slots=1000))


def test_downsampled_series() -> None:
    result = simulate(SMALL, Paged(16), ServingConfig(budget_slots=1024))
    series = result.downsampled(8)
    assert len(series["batch"]) == len(series["utilization"]) == 8
    assert series["step"][-1] == result.steps - 1
