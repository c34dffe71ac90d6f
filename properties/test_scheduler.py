"""The ``Scheduler`` alone (a real store, a fake sampler), checked every step against a model of
the running order, the queue and the outputs: limits, preemption, FCFS admission, chunks cut only
by the budget, windows, metrics."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import event, example, given
from hypothesis import strategies as st

from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving.metrics import kv_occupancy
from pagedkv.impl.serving.scheduler import (
    RequestTooLargeError,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
    SeqStatus,
)
from pagedkv.spec.block_manager import blocks_needed, blocks_outside_window
from properties.window_cases import check_window

EOS = 0


class SpyStore(BlockTableStore):
    """Logs each preemption's victim, and whether the whole growth would have fit (needless)."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args)
        self.log: list[tuple[int, bool]] = []

    def grow_or_preempt(self, seqs, new_tokens=1):  # type: ignore[no-untyped-def]
        fits = not BlockTableStore.grow(copy.deepcopy(self), seqs, new_tokens, atomic=True)
        victims = super().grow_or_preempt(seqs, new_tokens)
        self.log.extend((seq_id, fits) for seq_id in victims)
        return victims


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_new_tokens: int
    n: int
    arrival: int
    eos: bool  # whether EOS stops it


@dataclass(frozen=True)
class Case:
    block_size: int
    total_blocks: int
    config: SchedulerConfig
    prefix_caching: bool
    requests: tuple[Req, ...]  # arrival order

    def scheduler(self) -> Scheduler:
        manager_class = PrefixCachingBlockManager if self.prefix_caching else BlockManager
        manager = manager_class(self.total_blocks, self.block_size)
        store = SpyStore(manager, self.config.max_num_seqs, self.total_blocks)
        return Scheduler(store, self.config)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    block_size = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    config = SchedulerConfig(
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 40)),
        watermark_blocks=draw(st.integers(0, 3)),
        sliding_window=draw(st.none() | st.integers(1, 12)),
    )
    system = draw(st.lists(st.integers(1, 3), min_size=0, max_size=20))
    suffixes = st.lists(st.integers(1, 3), min_size=1, max_size=12)
    request = st.builds(
        Req, prompt=suffixes.map(lambda suffix: (*system, *suffix)),
        max_new_tokens=st.integers(1, 12), n=st.integers(1, config.max_num_seqs),
        arrival=st.integers(0, 12), eos=st.booleans(),
    )  # fmt: skip
    requests = sorted(draw(st.lists(request, min_size=1, max_size=8)), key=lambda r: r.arrival)
    largest = max(blocks_needed(len(r.prompt) + r.max_new_tokens - 1, block_size) for r in requests)
    total_blocks = largest + draw(st.integers(0, largest))
    return Case(block_size, total_blocks, config, draw(st.booleans()), tuple(requests))


def recount_occupancy(store: BlockTableStore) -> tuple[int, int]:
    """``kv_occupancy`` the slow way: each held block's fill, the most over its holders."""
    fill: dict[int, int] = {}
    for seq_id in store.seq_ids:
        count = store.token_count(seq_id)
        for i, block in enumerate(store.table(seq_id)):
            if block is None:  # released by a sliding window: holds nothing
                continue
            rows = min(store.block_size, count - i * store.block_size)
            fill[block] = max(fill.get(block, 0), rows)
    return sum(fill.values()), len(fill)


def check_step(
    case: Case, scheduler: Scheduler, out: SchedulerOutput, running_before: list[int],
    waiting_before: list[int], log_start: int,
) -> list[int]:  # fmt: skip
    """Check one ``schedule()`` against the model; return the model's new running order."""
    store, config, bs = scheduler.store, case.config, case.block_size
    assert isinstance(store, SpyStore)  # preemption: newest first, each after a failed growth
    victims = [seq.seq_id for seq in out.preempted]
    assert victims == running_before[::-1][: len(victims)]
    assert [seq_id for seq_id, _ in store.log[log_start:]] == victims
    assert not any(fits for _, fits in store.log[log_start:]), "a needless preemption"
    for victim in out.preempted:
        assert victim.status is SeqStatus.WAITING and victim.num_computed == 0
        assert victim.seq_id not in store
    kept = running_before[: len(running_before) - len(victims)]
    # The batch: the oldest running sequences in order, then the admissions, in queue order.
    admitted = [seq.seq_id for seq in out.admitted]
    # A victim heads the queue and needs more blocks than the failed growth left: no thrashing.
    assert not (admitted and victims), "admitted in a step that preempted"
    batch = [item.seq.seq_id for item in out.items()]
    assert out.seq_ids.tolist() == batch
    assert batch[: len(batch) - len(admitted)] == kept[: len(batch) - len(admitted)]
    assert batch[len(batch) - len(admitted) :] == admitted
    queue = victims[::-1] + waiting_before
    assert admitted == queue[: len(admitted)]
    assert [seq.seq_id for seq in scheduler.waiting] == queue[len(admitted) :]
    # Limits, and every scheduled table holds its tokens.
    assert out.num_batched_tokens <= config.max_num_batched_tokens
    assert scheduler.num_running_seqs <= config.max_num_seqs
    for item in out.items():  # a chunk not reaching its sequence's end is cut by the budget
        assert item.samples == (item.end == item.seq.num_tokens)
        assert item.samples or out.num_batched_tokens == config.max_num_batched_tokens
        assert item.num_tokens >= 1 and item.end <= item.seq.num_tokens
        assert item.start == item.seq.num_computed
        assert store.token_count(item.seq.seq_id) == item.seq.num_tokens
    if admitted and (kept or len(admitted) > 1):
        assert store.manager.num_free_blocks >= config.watermark_blocks
    if running_before or waiting_before:
        assert out.seqs, "a step with work scheduled nothing"
    assert kv_occupancy(store) == recount_occupancy(store)
    window = config.sliding_window
    released = check_window(scheduler, window)
    if window is not None and scheduler.running:
        event("window: released blocks" if released else "window: nothing released")
    for item in out.items():
        if window and item.cached_tokens and blocks_outside_window(item.start, window, bs):
            event("window: prefix hits before the first computed token's window")
    return kept + admitted


def play(case: Case) -> None:
    """Drive the scheduler through the case, checking every step and every finished output."""
    scheduler = case.scheduler()
    store = scheduler.store
    assert isinstance(store, SpyStore)
    pending = list(enumerate(case.requests))
    running: list[int] = []  # the model: seq ids in admission order
    samples: dict[int, set[int]] = {}  # request id -> the finished samples' indices
    outputs: dict[int, list[int]] = {}  # the model: seq id -> the tokens sampled for it
    step = preempted = 0
    while pending or scheduler.has_unfinished():
        while pending and pending[0][1].arrival <= step:
            request_id, req = pending.pop(0)
            scheduler.add_request(
                request_id, list(req.prompt), req.max_new_tokens, n=req.n,
                eos_token_id=EOS if req.eos else None,
            )  # fmt: skip
            samples[request_id] = set()
        waiting_before, log_start = [seq.seq_id for seq in scheduler.waiting], len(store.log)
        out = scheduler.schedule()
        running = check_step(case, scheduler, out, running, waiting_before, log_start)
        store.pop_copy_pairs()  # an engine's copies: their waiting sources are free again
        preempted += len(out.preempted)
        assert out.sampling == [item.seq for item in out.items() if item.samples]
        sampled = [  # a fake sampler: deterministic tokens in 0..5, 0 is EOS
            (seq.request_id * 31 + (seq.sample_index + j) * 17 + seq.num_tokens * 7) % 6
            for seq in out.sampling
            for j in range(seq.num_samples)
        ]
        forks = [(seq, seq.num_samples, outputs.get(seq.seq_id, [])) for seq in out.sampling]
        forked, finished = scheduler.update(out, sampled)
        tokens, children = iter(sampled), iter(forked)
        for seq, num_samples, output in forks:  # its first token, each fork the next in order
            for sample in [seq, *(next(children) for _ in range(num_samples - 1))]:
                outputs[sample.seq_id] = [*output, next(tokens)]
        assert next(children, None) is None
        for seq in [*scheduler.running, *scheduler.waiting, *finished]:  # kept when preempted
            assert seq.output == outputs.get(seq.seq_id, [])
        running += [seq.seq_id for seq in forked if seq.status is SeqStatus.RUNNING]
        for seq in finished:
            if seq.seq_id in running:
                running.remove(seq.seq_id)
            assert seq.seq_id not in store, "a finished sequence kept its blocks"
            req, output = case.requests[seq.request_id], seq.output
            stops = [i for i, token in enumerate(output) if req.eos and token == EOS]
            assert stops == [len(output) - 1] if stops else len(output) == req.max_new_tokens
            assert seq.sample_index not in samples[seq.request_id]
            samples[seq.request_id].add(seq.sample_index)
        assert running == [seq.seq_id for seq in scheduler.running]
        assert len(store) == len(running)
        step += 1
        assert step < 10_000, "no progress"
    event(f"preempted: {'yes' if preempted else 'no'}")
    assert samples == {i: set(range(req.n)) for i, req in enumerate(case.requests)}, "lost"
    assert store.manager.num_free_blocks == store.manager.total_blocks
    assert not store.manager.ref_counts().any()


# Found by Hypothesis: with prefix caching, a victim's own freed blocks are hits, so without the
# no-admission-after-preemption rule it was readmitted in the step that preempted it.
READMITTED_VICTIM = Case(
    block_size=1, total_blocks=6, prefix_caching=True,
    config=SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=3, watermark_blocks=0),
    requests=(Req((1,), 1, 1, 0, False), Req((1, 1), 5, 1, 0, False), Req((1, 1), 2, 1, 1, False)),
)  # fmt: skip


@given(cases())
@example(READMITTED_VICTIM)
def test_scheduler_runs_every_request_within_its_limits(case: Case) -> None:
    play(case)


@given(
    block_size=st.integers(1, 8), total_blocks=st.integers(1, 8), max_num_seqs=st.integers(1, 4),
    prompt_len=st.integers(1, 40), max_new_tokens=st.integers(1, 40), n=st.integers(1, 6),
)  # fmt: skip
def test_a_request_that_can_never_fit_is_rejected_clearly(
    block_size: int, total_blocks: int, max_num_seqs: int, prompt_len: int,
    max_new_tokens: int, n: int,
) -> None:  # fmt: skip
    store = BlockTableStore(BlockManager(total_blocks, block_size), max_num_seqs, total_blocks)
    scheduler = Scheduler(store, SchedulerConfig(max_num_seqs=max_num_seqs))
    needed = blocks_needed(prompt_len + max_new_tokens - 1, block_size)
    if needed <= total_blocks and n <= max_num_seqs:
        scheduler.add_request(7, [1] * prompt_len, max_new_tokens, n=n)
        assert len(scheduler.waiting) == 1
        return
    with pytest.raises(RequestTooLargeError) as error:
        scheduler.add_request(7, [1] * prompt_len, max_new_tokens, n=n)
    message = str(error.value)
    assert "request 7" in message
    assert (f"needs up to {needed} blocks" in message) or (f"{n} samples" in message)
    assert not scheduler.waiting and not scheduler.running
    assert store.manager.num_free_blocks == total_blocks


def small_scheduler() -> Scheduler:
    return Case(1, 8, SchedulerConfig(3, 8, 0), False, ()).scheduler()


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ([5, 6], ValueError), ([5, 6, 7, 8], ValueError),  # the step samples 3 tokens
        ([5, -7, 6], ValueError), ([5, True, 6], TypeError), ([5, 1.0, 6], TypeError),
        ("xyz", TypeError), (np.array([5.0, 6.0, 7.0]), TypeError),
        (np.array([[5, 6, 7]]), TypeError), (np.array([5, -6, 7]), ValueError),
        ([5, 2**63, 6], ValueError),  # past int64, the step arrays' type
        (np.array([5, 2**64 - 1, 6], dtype=np.uint64), ValueError),  # not -1 (no EOS) in int64
    ],
)  # fmt: skip
def test_update_refuses_bad_sampled_tokens_and_changes_nothing(bad: object, error: type) -> None:
    """Refused before anything changes; then the good tokens fork the first request's sample."""
    scheduler = small_scheduler()
    first = scheduler.add_request(0, [1, 2], max_new_tokens=3, n=2)
    second = scheduler.add_request(1, [3, 4], max_new_tokens=3)
    out = scheduler.schedule()
    miscounted = isinstance(bad, list) and len(bad) != 3
    with pytest.raises(error, match="samples 3 tokens, got" if miscounted else None):
        scheduler.update(out, bad)
    assert (first.num_computed, second.num_computed) == (0, 0)
    assert (first.tokens, second.tokens) == ([1, 2], [3, 4])
    (child,), _ = scheduler.update(out, [5, 6, 7])
    assert (first.tokens, child.tokens, second.tokens) == ([1, 2, 5], [1, 2, 6], [3, 4, 7])
    assert scheduler.store.table(first.seq_id) == scheduler.store.table(child.seq_id)


def test_a_request_keeps_plain_ints_and_bad_ones_change_nothing() -> None:
    """An int-subclass prompt and EOS are kept as plain ints; an empty prompt, no new tokens, no
    samples or an EOS past int64 are refused, changing nothing (int64's largest is taken); a
    store with fewer rows than ``max_num_seqs`` is refused."""

    class Token(int):
        pass

    scheduler = small_scheduler()
    seq = scheduler.add_request(0, [Token(1), Token(2)], max_new_tokens=3, eos_token_id=Token(9))
    assert [type(t) for t in seq.tokens] == [int, int] and type(seq.eos_token_id) is int
    for args, kwargs in [(([], 3), {}), (([1], 0), {}), (([1], 2), {"n": 0})]:
        with pytest.raises(ValueError):
            scheduler.add_request(1, *args, **kwargs)
    with pytest.raises(ValueError, match="eos_token_id"):
        scheduler.add_request(1, [1, 2], max_new_tokens=3, eos_token_id=2**63)
    assert [s.request_id for s in scheduler.waiting] == [0]
    scheduler.add_request(2, [1, 2], max_new_tokens=3, eos_token_id=2**63 - 1)  # int64's largest
    assert [s.request_id for s in scheduler.waiting] == [0, 2]
    assert scheduler.schedule().seq_ids.dtype == np.int64
    with pytest.raises(ValueError, match="rows"):
        Scheduler(BlockTableStore(BlockManager(4, 2), 1, 4), SchedulerConfig(2))


def test_occupancy_leaves_out_a_block_waiting_for_its_copy() -> None:
    """A block waiting for its copy-on-write (its holders preempted) is not used (CI found it)."""
    store = BlockTableStore(BlockManager(5, 4), 4, 4)
    store.add(0, 5)  # blocks 0, 1; block 1 holds one token
    store.fork(0, 1)
    store.add(2, 4)  # block 2, full: its next token needs a block
    store.add(3, 4)  # block 3
    # 0 copies 1 -> 4, 2 finds no block: 1 is preempted (block 1 waits), then 3 (block 3 is
    # free again), and 2 takes block 3.
    assert store.grow_or_preempt([0, 2, 3, 1], 1) == [1, 3]
    assert store.num_free_blocks == 0 and store.num_waiting_blocks == 1
    assert kv_occupancy(store) == recount_occupancy(store) == (4 + 2 + 4 + 1, 4)
