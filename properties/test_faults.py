"""Nothing is lost under faults (docs/design.md §10): an injected call raises before it runs and
its step raises; a second fault right after hits the undo of what the first failed (``undo_fork``
and ``undo_growth`` cannot fail: not injected). After each step nothing is lost or duplicated, no
block leaks, tables read back, greedy tokens are dense decoding's; the end drains fault-free,
matches a fault-free run and frees every block. The engine machine faults every traced seam."""

from __future__ import annotations

import collections
import functools
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any, ClassVar
from unittest.mock import patch

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pagedkv import kernels
from pagedkv.impl.blocks import BlockTableStore, growth, manager, pool, prefix_cache
from pagedkv.impl.blocks import store as blocks_store
from pagedkv.impl.serving import engine as serving_engine
from pagedkv.impl.serving import scheduler as serving_scheduler
from pagedkv.impl.serving import speculative
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig, SeqStatus
from pagedkv.spec.block_manager import translate_slot
from properties.engine_cases import MODEL, check_all_freed, greedy_oracle, one_thread
from properties.mutants import CONTROL_SEARCHES, FIND, load_copy, load_mutant
from properties.seams import installed, listed_seams, repeat_last, trace_engine

VOCAB = 8
Decide = Callable[[str, bool], bool]
"""Whether a call fails, given its name and whether no fault fired yet in the step."""


class InjectedFault(RuntimeError):
    """The exception a fault injector raises."""


class FaultInjector:
    """Counts the calls of the functions it wraps; in an armed step, up to two of them raise
    before they run, where ``decide`` says; ``observe`` is told of each call before it."""

    MAX_FAULTS = 2

    def __init__(self, observe: Callable[[str], None]) -> None:
        self.calls, self.observe = 0, observe
        self.fired: list[str] = []
        self.decide: Decide | None = None

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.observe(name)
            decide = self.decide
            if decide and len(self.fired) < self.MAX_FAULTS and decide(name, not self.fired):
                self.fired.append(name)
                raise InjectedFault(f"injected into call {self.calls}: {name}")
            return function(*args, **kwargs)

        return faulty

    @contextmanager
    def armed(self, decide: Decide | None) -> Iterator[None]:
        """Let ``decide`` fail the calls made in the block (None: none fails)."""
        self.calls, self.fired, self.decide = 0, [], decide
        try:
            yield
        finally:
            self.decide = None


def drawn_faults(data: st.DataObject) -> Decide:
    """A step's first fault at each call with chance about ``1 / rate`` (the rate drawn once a
    step: a high one reaches late calls), a second at each later call with chance one half."""
    rate = data.draw(st.sampled_from([4, 16, 64]), label="one call in")

    def decide(name: str, first: bool) -> bool:
        if first:  # a middle value: Hypothesis draws the ends of a range far more often
            return data.draw(st.integers(0, rate - 1), label=f"fail {name}?") == rate // 2
        return data.draw(st.booleans(), label=f"fail {name} too?")

    return decide


def add_requests(engine: Any, requests: Iterable[tuple[list[int], int, int, int | None]]) -> None:
    """Add ``(prompt, max_new, n, seed)`` requests: greedy where ``seed`` is None."""
    for prompt, max_new, n, seed in requests:
        temperature = 0.0 if seed is None else 1.0
        engine.add_request(prompt, max_new, n=n, temperature=temperature, seed=seed)


def drain(engine: Any) -> list[Any]:
    """Step ``engine`` until idle, through injected faults; return the outputs in id order."""
    outputs = []
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        with suppress(InjectedFault):
            outputs += engine.step().finished
    assert not engine.has_unfinished_requests(), "the engine is wedged"
    return sorted(outputs, key=lambda out: out.request_id)


HUNT_STATS: collections.Counter[tuple[str, str]] = collections.Counter()
"""Per machine class: ``steps``, ``faults`` and ``chains`` (steps whose copy found a source every
table had let go of)."""


def started(**strategies: st.SearchStrategy[Any]) -> Callable[..., None]:
    """A machine's ``initialize`` rule: draws ``strategies`` and passes them to ``set_up``."""

    @initialize(**strategies)
    def start(self: Any, **setup: Any) -> None:
        self.set_up(**setup)

    return start


def forking_requests(vocab: int, most: int) -> Callable[..., None]:
    """A rule adding up to ``most`` requests that fork, then grow: their samples copy the
    prompt's partly filled last block on write."""

    @precondition(lambda self: len(self.requests) < most)
    @rule(prompt=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=7),
          max_new=st.integers(3, 6), n=st.integers(2, 4))  # fmt: skip
    def add_forking_request(self: Any, prompt: list[int], max_new: int, n: int) -> None:
        self.add_request(prompt, max_new, n)

    return add_forking_request


class FaultMachine(RuleBasedStateMachine):
    """What the fault machines share: steps with drawn faults, the block accounting, the fault-free
    drain. A subclass's ``set_up`` sets ``injector``, ``store``, ``scheduler``, ``unfinished`` (a
    step is still to run), ``requests``, ``total_blocks``, ``block_size``; it defines
    ``add_request``, ``run_step`` and ``check_outputs`` (after the drain: a fault-free run's)."""

    VOCAB: ClassVar[int]
    chained = False

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One step, with up to two faults drawn call by call."""
        self.faulty_step(drawn_faults(data))

    def faulty_step(self, decide: Decide | None) -> None:
        with self.injector.armed(decide), suppress(InjectedFault):
            self.run_step()
        name = type(self).__name__
        HUNT_STATS[name, "steps"] += 1
        HUNT_STATS[name, "chains"] += self.chained
        HUNT_STATS[name, "faults"] += len(self.injector.fired)
        self.chained = False

    def observe(self, name: str) -> None:
        """Before each wrapped call: at the step's copy, does a pair's source wait for it, or
        (without the rule) does a pair write a block an earlier pair reads?"""
        if name.endswith("pending_copy_pairs"):
            manager = self.store.manager
            read: set[int] = set()
            for src, dst in manager.pending_copy_pairs():
                read.add(src)
                self.chained |= dst in read
            self.chained |= bool(manager.waiting_for_copy)

    @invariant()
    def nothing_lost(self) -> None:
        store = self.store
        running = [seq.seq_id for seq in self.scheduler.running]
        assert running == list(store.seq_ids), "the running list is the store's live order"
        held = {b for seq_id in store.seq_ids for b in store.table(seq_id) if b is not None}
        waiting = len(store.manager.waiting_for_copy)  # sources of pairs a fault left pending
        assert store.num_free_blocks + len(held) + waiting == self.total_blocks, "a block leaked"

    def teardown(self) -> None:
        """Run to completion without faults; the outputs are a fault-free run's, blocks free."""
        if not hasattr(self, "store"):
            return
        for _ in range(500):
            if not self.unfinished():
                break
            self.run_step()
        assert not self.unfinished(), "wedged"
        self.check_outputs()
        assert self.store.num_free_blocks == self.total_blocks, "a block leaked"


class FaultyStore:
    """A store as its callers see it: the :data:`STORE_CALLS` may fault; the rest, and the
    store's calls to its own methods, reach the real store untouched (each call is atomic)."""

    def __init__(self, store: BlockTableStore, injector: FaultInjector) -> None:
        self._store = store
        for name in STORE_CALLS:
            setattr(self, name, injector.wrap(name, getattr(store, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


STORE_CALLS = (
    "token_counts_of", "grow_or_preempt", "admit", "fork", "remove", "cache_blocks",
    "pending_copy_pairs", "pop_copy_pairs", "batch", "slot_mapping", "release_outside_window",
    "grow", "truncate", "resolve", "row",
)  # fmt: skip
"""Every store call the scheduler, the engine and its speculation make (but the undo calls)."""


def copy_blocks(kv: dict[int, int], pairs: list[list[int]], block_size: int) -> None:
    """Copy-on-write in the simulated cache: each ``dst`` block takes ``src``'s rows, in order."""
    for src, dst in pairs:
        for row in range(block_size):
            kv[dst * block_size + row] = kv.get(src * block_size + row, -1)


def next_token(tokens: list[int], sample: int) -> int:
    """The deterministic model: a token from the tokens before it and the sample index."""
    return hash((tuple(tokens), sample)) % VOCAB


SCHEDULER_SETUP = {
    "total_blocks": st.integers(4, 16), "block_size": st.sampled_from([1, 2, 4]),
    "prefix": st.booleans(), "max_num_seqs": st.integers(1, 4), "budget": st.integers(1, 12),
}  # fmt: skip


class SchedulerFaultMachine(FaultMachine):
    """The scheduler over a real store (plain or prefix caching), ``n`` up to 4; the simulated
    cache remembers the token written to each slot, :func:`next_token` is the model."""

    VOCAB = VOCAB
    EOS = 0
    SCHEDULER: ClassVar[type] = Scheduler
    BLOCKS: ClassVar[Any] = blocks_store  # its manager and store classes
    start = started(**SCHEDULER_SETUP)

    def set_up(
        self, total_blocks: int, block_size: int, prefix: bool, max_num_seqs: int, budget: int,
        window: int | None = None,
    ) -> None:  # fmt: skip
        blocks = self.BLOCKS
        manager_class = blocks.PrefixCachingBlockManager if prefix else blocks.BlockManager
        manager = manager_class(total_blocks, block_size)
        self.injector = FaultInjector(self.observe)
        self.store = FaultyStore(blocks.BlockTableStore(manager, max_num_seqs, 64), self.injector)
        config = SchedulerConfig(max_num_seqs, budget, 0, sliding_window=window)
        self.scheduler = self.SCHEDULER(self.store, config)
        self.unfinished = self.scheduler.has_unfinished
        self.stage = self.injector.wrap("kv or draw", lambda: None)  # the engine's own work
        self.kv: dict[int, int] = {}  # slot -> the token whose K/V is there
        self.requests: dict[int, tuple[list[int], int, int]] = {}  # id -> prompt, max_new, n
        self.outputs: dict[int, dict[int, list[int]]] = {}  # request -> sample -> output
        self.window, self.block_size, self.total_blocks = window, block_size, total_blocks

    @precondition(lambda self: len(self.requests) < 6)
    @rule(prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
          max_new=st.integers(1, 6), n=st.integers(1, 4))  # fmt: skip
    def add_request(self, prompt: list[int], max_new: int, n: int) -> None:
        request_id = len(self.requests)
        try:
            self.scheduler.add_request(request_id, prompt, max_new, n=n, eos_token_id=self.EOS)
        except ValueError:  # too large for this pool: refused, nothing queued
            return
        self.requests[request_id] = (prompt, max_new, n)

    def run_step(self) -> None:
        scheduler, store, size = self.scheduler, self.store, self.block_size
        plan = scheduler.schedule()
        self.stage()
        copy_blocks(self.kv, store.pending_copy_pairs().tolist(), size)
        store.pop_copy_pairs()  # forgotten only once copied
        self.stage()
        for item in plan.items():  # write the step's K/V
            table = store.table(item.seq.seq_id)
            for position in range(item.start, item.end):
                self.kv[translate_slot(table, position, size)] = item.seq.tokens[position]
        sampled = []
        for seq in plan.sampling:
            self.stage()
            first = seq.sample_index
            sampled += [next_token(seq.tokens, first + j) for j in range(seq.num_samples)]
        for seq in scheduler.update(plan, sampled)[1]:
            outputs = self.outputs.setdefault(seq.request_id, {})
            assert seq.sample_index not in outputs, "a sample finished twice"
            outputs[seq.sample_index] = seq.output

    @invariant()
    def nothing_lost(self) -> None:
        super().nothing_lost()
        scheduler, store = self.scheduler, self.store
        assert not {seq.seq_id for seq in scheduler.waiting} & set(store.seq_ids)
        assert all(seq.status.value == SeqStatus.WAITING.value for seq in scheduler.waiting)
        kv = dict(self.kv)  # as the next step will see it: after the pending copies
        copy_blocks(kv, store.pending_copy_pairs().tolist(), self.block_size)
        for seq in scheduler.running:  # every computed token's K/V reads back: no lost pair
            table = store.table(seq.seq_id)
            # with a window, what the next query can read (earlier blocks may be released)
            first = 0 if self.window is None else max(0, seq.num_computed - self.window + 1)
            for position in range(first, seq.num_computed):
                slot = translate_slot(table, position, self.block_size)
                assert kv.get(slot) == seq.tokens[position], "K/V that was never written"
        live = {seq.request_id for seq in [*scheduler.running, *scheduler.waiting]}
        for request_id, (_, _, n) in self.requests.items():
            done = len(self.outputs.get(request_id, {}))
            assert request_id in live or done == n, f"request {request_id} was lost"

    def check_outputs(self) -> None:
        """Every sample is what :func:`next_token` makes without faults."""
        for request_id, (prompt, max_new, n) in self.requests.items():
            for sample in range(n):
                out: list[int] = []
                while len(out) < max_new and out[-1:] != [self.EOS]:
                    out.append(next_token([*prompt, *out], sample))
                assert self.outputs[request_id][sample] == out


TestSchedulerFaults = SchedulerFaultMachine.TestCase


class WindowSchedulerFaultMachine(SchedulerFaultMachine):
    """The same under a sliding window, ``release_outside_window`` faulted too (a subclass: the
    base machine's search for planted bugs stays as it was)."""

    start = started(**SCHEDULER_SETUP, window=st.integers(1, 6))


TestWindowSchedulerFaults = WindowSchedulerFaultMachine.TestCase


class ChainRequests(FaultMachine):
    """Rules for the chain machines: requests that chain copy-on-write on purpose."""

    @rule(seam=st.sampled_from(["pop_copy_pairs", "copy_blocks"]))
    def step_failing_after_a_chained_copy(self, seam: str) -> None:
        """A step failing at ``seam`` (the copies' end, or a layer's copy) once it copied a list
        whose source was waiting: the retry the rule is for."""
        self.faulty_step(lambda name, first: first and self.chained and name.endswith(seam))

    @precondition(lambda self: len(self.requests) < 4 and self.total_blocks >= 3)
    @rule(data=st.data())
    def add_two_requests_that_chain(self, data: st.DataObject) -> None:
        """Two samples whose prompt ends in a partly filled block, then a request filling its
        blocks, leaving one free. Once both are prefilled, the first sample copies its shared
        block on write into the free one, the other request's growth preempts the other sample,
        the block's last other holder, and the block waits for its copy."""
        size = self.block_size
        forked = data.draw(st.integers(1, self.total_blocks - 2), label="its blocks")
        tail = data.draw(st.integers(1, size - 1), label="its last block's tokens")
        filled = (self.total_blocks - 1 - forked) * size
        token = st.integers(0, self.VOCAB - 1)
        for length, n in ((forked * size - size + tail, 2), (filled, 1)):
            prompt = data.draw(st.lists(token, min_size=length, max_size=length))
            self.add_request(prompt, data.draw(st.integers(2, 4), label="max_new"), n)

    @precondition(lambda self: len(self.requests) < 4 and self.total_blocks >= 4)
    @rule(data=st.data())
    def add_two_forking_requests_that_chain(self, data: st.DataObject) -> None:
        """Three samples, then two, each prompt ending in a partly filled block, two blocks free
        (the issue's run): a preemption frees the second request's shared block while a
        pending pair still reads it, and the next copy on write would take it."""
        size = self.block_size
        first = data.draw(st.integers(1, self.total_blocks - 3), label="first's blocks")
        token = st.integers(0, self.VOCAB - 1)
        for blocks, n in ((first, 3), (self.total_blocks - 2 - first, 2)):
            tail = data.draw(st.integers(1, size - 1), label="its last block's tokens")
            length = blocks * size - size + tail
            prompt = data.draw(st.lists(token, min_size=length, max_size=length))
            self.add_request(prompt, data.draw(st.integers(2, 4), label="max_new"), n)


class ChainSchedulerFaultMachine(ChainRequests, SchedulerFaultMachine):
    """The scheduler machine on workloads that chain copy-on-write (design.md §5): small pools,
    rows for every sample, requests that fork (a subclass, as above)."""

    start = started(
        total_blocks=st.integers(4, 8), block_size=st.sampled_from([2, 3, 4]), prefix=st.booleans(),
        max_num_seqs=st.integers(6, 8), budget=st.integers(8, 32),
    )  # fmt: skip
    add_forking_request = forking_requests(VOCAB, 8)


TestChainSchedulerFaults = ChainSchedulerFaultMachine.TestCase


# ----------------------------------------------------------------- the engine


MODELS = {w: MODEL if w is None else CausalLM.from_seed(ModelConfig(sliding_window=w), seed=0)
          for w in (None, 3, 5)}  # fmt: skip
"""The tiny model, and the same with a sliding window."""


class GreedyDrafts:
    """A partly right draft source: the greedy continuation, the draft at a position the tokens'
    hash picks shifted by one token id (none if past the drafts). It reads continuations
    learnt ahead, so it never runs the model (whose calls are faulted) inside a step."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.after: dict[tuple[int, ...], list[int]] = {}  # known tokens -> greedy tokens after

    def learn(self, prompt: list[int], max_new: int) -> None:
        tokens = [*prompt, *greedy_oracle(tuple(prompt), max_new, self.model).tokens]
        for end in range(len(prompt), len(tokens)):
            self.after[tuple(tokens[:end])] = tokens[end:]

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        guess = list(self.after.get(tuple(tokens), [])[:k])
        wrong = hash(tuple(tokens)) % (k + 1)
        if wrong < len(guess):
            guess[wrong] = (guess[wrong] + 1) % MODEL.config.vocab_size
        return guess


ENGINE_SEAMS = listed_seams()
"""Where the engine machine injects: every seam a traced step crosses."""


class EngineFaultMachine(FaultMachine):
    """The engine on every backend, greedy or sampled, speculative or not, windowed or not, and
    up to two faults a step at every :data:`ENGINE_SEAMS` seam and in the draft source."""

    VOCAB = MODEL.config.vocab_size
    ENGINE: ClassVar[type] = PagedAttentionEngine
    LIMITS: ClassVar[dict[str, int]] = {"max_num_seqs": 4, "max_num_batched_tokens": 16}
    SETUP: ClassVar[dict[str, st.SearchStrategy[Any]]] = {
        "total_blocks": st.integers(6, 16), "block_size": st.sampled_from([1, 2, 4]),
        "prefix": st.booleans(), "speculative": st.integers(0, 3),
        "window": st.sampled_from([None, None, 3, 5]),
        "backend": st.sampled_from(["numba", "reference", "triton"]), "fp8": st.booleans(),
    }  # fmt: skip
    start = started(**SETUP)

    def set_up(
        self, total_blocks: int, block_size: int, prefix: bool, speculative: int,
        window: int | None = None, backend: str = "numba", fp8: bool = False,
    ) -> None:  # fmt: skip
        self.injector = FaultInjector(self.observe)
        self.model = MODELS[window]
        self.drafts = GreedyDrafts(self.model)
        source = self.injector.wrap("draft_source", self.drafts) if speculative else None
        # An fp8 cache, K's and V's scales apart; the oracle keeps its K/V the same way.
        self.kv = ("fp8_e4m3", (0.5, 2.0)) if fp8 else ("auto", None)
        self.options = dict(
            **self.LIMITS, enable_prefix_caching=prefix, max_model_len=64, draft_source=source,
            num_speculative_tokens=speculative, backend=backend, kv_cache_dtype=self.kv[0],
            kv_scales=self.kv[1],
        )  # fmt: skip
        self.engine = self.ENGINE(self.model, total_blocks, block_size, **self.options)
        self.store, self.scheduler = self.engine.store, self.engine.scheduler
        self.unfinished = self.engine.has_unfinished_requests
        self.seams = ExitStack()
        self.seams.enter_context(installed(ENGINE_SEAMS, self.injector.wrap))
        self.requests: dict[int, tuple[list[int], int, int, int | None]] = {}
        self.outputs: dict[int, list[list[int]]] = {}
        self.total_blocks, self.block_size = total_blocks, block_size

    @precondition(lambda self: len(self.requests) < 4)
    @rule(prompt=st.lists(st.integers(0, MODEL.config.vocab_size - 1), min_size=1, max_size=9),
          max_new=st.integers(1, 5), n=st.integers(1, 4), sampled=st.booleans())  # fmt: skip
    def add_request(self, prompt: list[int], max_new: int, n: int, sampled: bool = False) -> None:
        """Greedy requests, or (without speculation) seeded sampled ones; ``n > 1`` forks."""
        speculative = self.options["num_speculative_tokens"]
        seed = len(self.requests) if sampled and not speculative else None
        try:
            request_id = self.engine.add_request(
                prompt, max_new, n=n, temperature=0.0 if seed is None else 1.0, seed=seed
            )
        except ValueError:
            return
        self.requests[request_id] = (prompt, max_new, n, seed)
        self.drafts.learn(prompt, max_new)

    def run_step(self) -> None:
        with one_thread():
            for result in self.engine.step().finished:
                assert result.request_id not in self.outputs, "a request was returned twice"
                self.outputs[result.request_id] = result.outputs

    @invariant()
    def nothing_lost(self) -> None:
        super().nothing_lost()
        scheduler, store = self.scheduler, self.store
        live = {seq.request_id for seq in [*scheduler.running, *scheduler.waiting]}
        for request_id in self.requests:
            assert not (request_id in live and request_id in self.outputs), "duplicated"
            if request_id not in live | set(self.outputs):  # finished in a failed step:
                assert self.engine.has_unfinished_requests(), "lost"  # the next returns it
        for seq in scheduler.running:  # a table holds the tokens, or all but the last sampled
            assert 0 <= seq.num_tokens - store.token_count(seq.seq_id) <= 1, "a draft stayed"
        for seq in [*scheduler.running, *scheduler.waiting]:
            prompt, max_new, _, seed = self.requests[seq.request_id]
            if seed is None:
                greedy = greedy_oracle(tuple(prompt), max_new, self.model, *self.kv).tokens
                assert seq.output == greedy[: len(seq.output)], "a token greedy never gives"

    def teardown(self) -> None:
        if hasattr(self, "seams"):
            with self.seams:
                super().teardown()

    def check_outputs(self) -> None:
        """Greedy requests give dense decoding's tokens, sampled ones a fault-free run's."""
        sampled: dict[int, list[list[int]]] = {}
        if any(seed is not None for *_, seed in self.requests.values()):
            engine = self.ENGINE(self.model, self.total_blocks, self.block_size, **self.options)
            add_requests(engine, self.requests.values())
            with one_thread():
                sampled = {out.request_id: out.outputs for out in drain(engine)}
        for request_id, (prompt, max_new, n, seed) in self.requests.items():
            if seed is None:
                expected = greedy_oracle(tuple(prompt), max_new, self.model, *self.kv).tokens
                assert self.outputs[request_id] == [expected] * n
            else:
                assert self.outputs[request_id] == sampled[request_id], "a draw repeated"


ENGINE_SETTINGS = settings(max_examples=25, stateful_step_count=12, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow])  # fmt: skip

TestEngineFaults = EngineFaultMachine.TestCase
TestEngineFaults.settings = ENGINE_SETTINGS


class ChainEngineFaultMachine(ChainRequests, EngineFaultMachine):
    """The engine machine on workloads that chain copy-on-write."""

    LIMITS: ClassVar[dict[str, int]] = {"max_num_seqs": 8, "max_num_batched_tokens": 32}
    SETUP: ClassVar[dict[str, st.SearchStrategy[Any]]] = {
        **EngineFaultMachine.SETUP, "total_blocks": st.integers(4, 8),
        "block_size": st.sampled_from([2, 3, 4]), "speculative": st.sampled_from([0, 0, 2]),
        "window": st.sampled_from([None, None, 5]),
    }  # fmt: skip
    start = started(**SETUP)
    add_forking_request = forking_requests(MODEL.config.vocab_size, 4)


HUNT = settings(max_examples=300, stateful_step_count=30, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
"""The engine machines' hunt; the scheduler machines' (a step about a tenth of the cost) runs
1,000 examples."""


@pytest.mark.long
@pytest.mark.parametrize("machine", [
    SchedulerFaultMachine, WindowSchedulerFaultMachine, ChainSchedulerFaultMachine,
    EngineFaultMachine, ChainEngineFaultMachine,
])  # fmt: skip
def test_long_fault_hunt(machine: type) -> None:
    """The machines far longer; prints what they ran (``-s``); the chain machines meet chains."""
    if issubclass(machine, EngineFaultMachine):  # on numba and reference only: the Triton
        # interpreter's step costs ten times theirs and crosses the same block-management seams;
        # its own seams are the quick machine's (one example in three) and the seam trace's
        setup = {**machine.SETUP, "backend": st.sampled_from(["numba", "reference"])}
        hunt, machine = HUNT, type(machine.__name__, (machine,), {"start": started(**setup)})
    else:
        hunt = settings(HUNT, max_examples=1000)
    run_state_machine_as_test(machine, settings=hunt)
    name = machine.__name__
    steps, chains, faults = (HUNT_STATS[name, key] for key in ("steps", "chains", "faults"))
    print(f"{name}: {steps} steps, {faults} faults injected, {chains} chained copies "
          f"({1000 * chains / steps:.1f} per 1,000 steps)")  # fmt: skip
    assert chains > 0 or not issubclass(machine, ChainRequests)


# ----------------------------------------------------------------- the seams


def test_the_machine_injects_at_every_traced_seam_and_no_other() -> None:
    """The seams traced on every backend are ``fault_seams.txt``'s, and the scheduler machine's
    store wraps every store method among them (the engine machine faults the properties it
    reads). Triton's interpreter is traced in a subprocess: ``TRITON_INTERPRET`` must be set
    before triton is imported."""
    listed, prefix = listed_seams(), "pagedkv.impl.blocks.store:BlockTableStore."
    called = {callee.removeprefix(prefix) for _, callee in listed if callee.startswith(prefix)}
    methods = {name for name in called if not isinstance(getattr(BlockTableStore, name), property)}
    assert methods <= set(STORE_CALLS), sorted(methods - set(STORE_CALLS))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "properties.seams", "triton"]
    out = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, check=True)
    traced = trace_engine("numba") | trace_engine("reference")
    traced |= {tuple(line.split()) for line in out.stdout.splitlines()}  # type: ignore[misc]
    assert not traced - listed, f"seams no machine injects at: {sorted(traced - listed)}"
    assert not listed - traced, f"listed seams no step reaches: {sorted(listed - traced)}"


# ----------------------------------------------------------------- every pair of faults


def sweep(
    machine_class: type, setup: dict[str, Any], requests: list[dict[str, Any]], steps: int
) -> int:
    """Every way to fail one call of one of the first ``steps`` steps of a fixed run, alone or
    with the call right after it (the undo's): each run replays the steps before fault-free,
    checks the invariant after the faulty step, then drains and checks. Returns the runs made."""

    def replay(faulty: int, decide: Decide) -> int:
        machine = machine_class()
        machine.start(**setup)
        with getattr(machine, "seams", ExitStack()):  # uninstalled even if a check fails
            for request in requests:
                machine.add_request(**request)
            for _ in range(faulty):
                machine.faulty_step(None)
            machine.faulty_step(decide)
            machine.nothing_lost()
            machine.teardown()
        return machine.injector.calls

    runs = 0
    for faulty in range(steps):
        calls = replay(faulty, lambda name, first: False)  # the calls that step makes
        for call, twice in itertools.product(range(1, calls + 1), (False, True)):
            replay(faulty, faults_at(call, twice))
            runs += 1
    return runs


def faults_at(call: int, twice: bool) -> Decide:
    """Fail the ``call``-th call of a step and, if ``twice``, the one right after it."""
    seen = itertools.count(1)
    return lambda name, first: (i := next(seen)) == call or (twice and i == call + 1)


SWEEPS: dict[type, tuple[dict[str, Any], list[dict[str, Any]], int]] = {
    # A request that forks into three (no sample is born done, so both children fork) beside
    # one that does not; the scheduler's pool is small enough that the run preempts.
    SchedulerFaultMachine: (
        {"total_blocks": 8, "block_size": 2, "prefix": True, "max_num_seqs": 4, "budget": 6},
        [{"prompt": [1, 2, 3, 4, 6], "max_new": 3, "n": 3},
         {"prompt": [1, 2, 3], "max_new": 2, "n": 1}], 6),
    EngineFaultMachine: (  # speculative
        {"total_blocks": 12, "block_size": 2, "prefix": True, "speculative": 2,
         "backend": "reference"},
        [{"prompt": [5, 7, 9, 11, 13], "max_new": 4, "n": 3},
         {"prompt": [5, 7, 9], "max_new": 5, "n": 1}], 3),
}  # fmt: skip
"""Each machine's sweep: its set-up, its requests, and the steps faulted."""


@pytest.mark.parametrize("machine", list(SWEEPS), ids=lambda machine: machine.__name__)
def test_every_pair_of_faults(machine: type) -> None:
    assert sweep(machine, *SWEEPS[machine]) > 50


# ----------------------------------------------------------------- teeth

PLANTED = {
    "a failed copy loses its copy-on-write pairs": [(serving_engine, "PagedAttentionEngine.step",
        "pairs = self.store.pending_copy_pairs()", "pairs = self.store.pop_copy_pairs()")],
    "a failed admission loses its request": [(serving_scheduler, "Scheduler._admit_waiting",
        "seq = self.waiting[0]\ncached = self._admit(seq, seats, held)",
        "seq = self.waiting.popleft()\ncached = self._admit(seq, seats, held)")],
    "a failed update leaks the blocks of its forks": [(serving_scheduler,
        "Scheduler._fork_and_finish", "if forks:\n    self.store.undo_fork(forks)",
        "if False:\n    self.store.undo_fork(forks)")],
    # The block layer before the retry rule (design.md §5): a pending copy's source joins the
    # free queue when its last table lets go, and the growth plan counts it free.
    "the block layer without the retry rule": [
        (pool, "BlockPool._free", "waits = self.is_source.take(freed)",
         "waits = np.zeros(freed.size, dtype=np.bool_)"),
        (growth, "plan_in_order", "left == 0 and block not in sources", "left == 0")],
    # The undo paths as they were: checked store calls, which a second fault can fail.
    "the undo of a failed update's forks can fail (the old undo)": [(serving_scheduler,
        "Scheduler._fork_and_finish", "self.store.undo_fork(forks)", "self.store.remove(forks)")],
    "the undo of a failed speculative step can fail (the old undo)": [(speculative, "undraft",
        "scheduler.undo_drafts(plan, before)", "scheduler.keep_drafts(plan, before)")],
}  # fmt: skip
"""Planted bugs, each as its edits: ``(module, function, old, new)``."""
UNDO = {bug for bug in PLANTED if bug.endswith("(the old undo)")}
"""The bugs only two faults in one step find: the sweeps of every pair catch them."""
LOSES_PAIRS = "a failed copy loses its copy-on-write pairs"
RETRY_RULE = "the block layer without the retry rule"

ENGINE_FIND = settings(
    ENGINE_SETTINGS, max_examples=60, database=None, derandomize=FIND.derandomize,
    report_multiple_bugs=False, phases=[Phase.generate],
)  # fmt: skip


def planted_machine(edits: list[tuple[Any, str, str, str]]) -> tuple[type, settings]:
    """The machine over copies of the code with ``edits`` planted, and the search that hunts
    them: the scheduler's, the engine's, or the chain machine's over the block layer (every
    module above a planted one loaded again over the copies)."""
    (module, *edit), shared = edits[0], ("RequestOutput", "StepOutput")
    if module is serving_scheduler:
        attrs = {"SCHEDULER": load_mutant(module, *edit, ("RequestTooLargeError",)).Scheduler}
        return type("PlantedScheduler", (SchedulerFaultMachine,), attrs), FIND
    if module in (serving_engine, speculative):
        if module is speculative:  # an engine copy that calls the mutant
            engine = load_copy(serving_engine, shared)
            engine.speculative = load_mutant(module, *edit)
        else:
            engine = load_mutant(module, *edit, shared)
        attrs = {"ENGINE": engine.PagedAttentionEngine}
        return type("PlantedEngine", (EngineFaultMachine,), attrs), ENGINE_FIND
    planted, copies = {module: edit for module, *edit in edits}, dict[str, Any]()
    for module in (pool, manager, prefix_cache, growth, blocks_store):
        names = [name for name in ("CapacityError", "OutOfBlocksError", "BlockTableError")
                 if hasattr(module, name)]  # fmt: skip
        if module in planted:
            copy = load_mutant(module, *planted[module], names, using=dict(copies))
        else:
            copy = load_copy(module, names, using=dict(copies))
        copies[module.__name__] = copy
    attrs = {"BLOCKS": copies[blocks_store.__name__]}
    return type("PlantedChainScheduler", (ChainSchedulerFaultMachine,), attrs), FIND


def catcher(bug: str, control: bool = False) -> Callable[..., None]:
    """What catches ``bug`` over its copies (``control``: unmutated): an old undo path, its
    machine's sweeps of every pair; the others, its machine's search (the engine's after the
    failed-copy run), or ``search``."""
    edits = PLANTED[bug]
    if control:
        edits = [(module, within, old, old) for module, within, old, _ in edits]
    machine, found_by = planted_machine(edits)
    engine = issubclass(machine, EngineFaultMachine)

    def run(search: settings | None = None) -> None:
        if bug in UNDO:
            sweep(machine, *SWEEPS[EngineFaultMachine if engine else SchedulerFaultMachine])
            return
        if engine:
            check_found(RETRIED_COPY, machine.ENGINE)
        run_state_machine_as_test(machine, settings=search or found_by)

    return run


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_fault_bug_is_caught(bug: str) -> None:
    run = catcher(bug)
    with pytest.raises(Exception):  # noqa: B017 - an assertion, a crash or the engine wedged
        run()


@pytest.mark.parametrize(("bug", "search"), [
    *(pytest.param(bug, None, id=bug) for bug in [LOSES_PAIRS, *sorted(UNDO)]),
    *(pytest.param(RETRY_RULE, *p.values, marks=p.marks, id=f"block layer-{p.id}")
      for p in CONTROL_SEARCHES),
])  # fmt: skip
def test_control_unmutated_copies_pass(bug: str, search: settings | None) -> None:
    catcher(bug, control=True)(search)


# ----------------------------------------------------------------- faults found once


def wrong_drafts(tokens: list[int], k: int) -> list[int]:
    """Drafts greedy decoding never keeps: its continuation, each token id shifted by one."""
    vocab = MODEL.config.vocab_size
    return [(token + 1) % vocab for token in greedy_oracle(tuple(tokens), k).tokens]


RETRIED_COPY = "a failed copy-on-write is retried by the next step"
FOUND = {
    # The example: before the fix one sample came out as [92, 0, 0, 0].
    RETRIED_COPY: ({}, [([5, 7, 9], 4, 2, 3)], [(kernels, "copy_blocks", (1,))]),
    # At 5263599 the 2nd and 3rd truncate were a speculative step's rollback and the undo of
    # its (wrong) drafts, which stayed and came out. The undo is now ``undo_growth``, which
    # cannot fail, so the 3rd is a later step's rollback.
    "a failed rollback and undo of drafts emit no unverified token": (
        {"draft_source": wrong_drafts, "num_speculative_tokens": 3}, [([5, 7, 9], 8, 1, None)],
        [("store", "truncate", (2, 3))],
    ),
    # With n = 3, the 2nd fork and the remove undoing the first raised: the first child stayed
    # in the store but not in the running list, and every later step raised.
    "a failed fork and undo of the forks do not wedge the engine": (
        {}, [([5, 7, 9, 11, 13], 4, 3, None)], [("store", "fork", (2,)), ("store", "remove", (1,))],
    ),
    # The last request finished in a step whose metrics failed: nothing was unfinished any
    # more, so nothing stepped again to return it.
    "a request finished in a step whose metrics failed comes back": (
        {}, [([5, 7, 9], 1, 1, None)], [(serving_engine, "step_metrics", (1,))],
    ),
    # Copy-on-write pairs that chain (design.md §5), then a step failing after the copy. The
    # issue's run: pending [(1, 3), (2, 4), (1, 2)] before the retry rule; request 1's sample 0
    # came out [29, 123, 83, 58, 120] where dense decoding gives [29, 72, 120, 47, 29].
    "a chain, then a failed pop_copy_pairs": (
        {"total_blocks": 5, "block_size": 2, "max_num_seqs": 6, "max_num_batched_tokens": 4},
        [([92, 99, 71], 4, 3, None), ([7], 5, 2, None), ([59, 65, 101, 88, 76], 3, 2, None)],
        [("store", "pop_copy_pairs", (2,))],
    ),
    "a chain, then a failed copy of the second layer": (
        {"total_blocks": 4, "block_size": 4, "max_num_seqs": 5, "max_num_batched_tokens": 6},
        [([4, 40, 51], 4, 3, None), ([86, 109], 3, 2, None),
         ([24, 97, 88, 124, 60, 16], 2, 1, None)],
        [(kernels, "copy_blocks", (2,))],
    ),
    "a chain in a sliding window, then a failed pop_copy_pairs": (
        {"window": 5, "total_blocks": 7, "block_size": 4, "max_num_seqs": 6,
         "max_num_batched_tokens": 7},
        [([64, 107, 3, 22, 48], 3, 1, None), ([38, 47, 69, 81, 68], 2, 3, None),
         ([116], 2, 2, None), ([121], 3, 2, None)],
        [("store", "pop_copy_pairs", (3,))],
    ),
    "a chain while speculating, then a failed pop_copy_pairs": (
        {"total_blocks": 4, "block_size": 4, "max_num_seqs": 7, "max_num_batched_tokens": 4,
         "draft_source": repeat_last, "num_speculative_tokens": 1},
        [([92], 6, 3, None), ([84, 99, 37], 6, 3, None)],
        [("store", "pop_copy_pairs", (2,))],
    ),
}  # fmt: skip
"""Faults found once: the engine's options (16 blocks of 4 and 4 sequences unless given;
``window``: the model's), the requests (prompt, max_new, n, seed: None is greedy), and the calls
(of the engine's store, or of a module) that fail, counted from 1."""


def drain_failing(engine: Any, failing: list[Any]) -> tuple[list[Any], list[str]]:
    """:func:`drain`, each ``(target, name, calls)`` raising at its ``calls``-th calls (from 1;
    target ``"store"``: the engine's); also the names of the calls that raised."""
    names = [name for _, name, _ in failing]  # counted by name: one target each, so say so
    assert len(set(names)) == len(names), f"a FOUND case fails one name twice: {names}"
    made: collections.Counter[str] = collections.Counter()
    injector, fails = FaultInjector(lambda name: made.update([name])), dict[str, Any]()
    assert sum(map(len, (calls for *_, calls in failing))) <= injector.MAX_FAULTS, failing
    with ExitStack() as stack, one_thread():
        for at, name, calls in failing:
            target, fails[name] = engine.store if at == "store" else at, calls
            faulty = injector.wrap(name, getattr(target, name))
            stack.enter_context(patch.object(target, name, faulty))
        with injector.armed(lambda name, _: made[name] in fails[name]):
            return drain(engine), injector.fired


def check_found(case: str, engine_class: type = PagedAttentionEngine) -> None:
    """The first fault fires, the outputs are full and a fault-free run's (greedy ones dense
    decoding's), and every block comes back."""
    options, requests, faults = FOUND[case]
    options = {"total_blocks": 16, "block_size": 4, "max_num_seqs": 4, **options}
    model = MODELS[options.pop("window", None)]
    results = []
    for failing in (faults, []):
        engine = engine_class(model, max_model_len=64, **options)
        add_requests(engine, requests)
        finished, fired = drain_failing(engine, failing)
        assert not failing or failing[0][1] in fired, "the first fault never fired"
        outputs = [output.outputs for output in finished]
        lengths = [[len(tokens) for tokens in samples] for samples in outputs]
        assert lengths == [[max_new] * n for _, max_new, n, _ in requests]
        check_all_freed(engine)
        results.append(outputs)
    assert results[0] == results[1]
    for (prompt, max_new, n, seed), samples in zip(requests, results[0], strict=True):
        if seed is None:
            assert samples == [greedy_oracle(tuple(prompt), max_new, model).tokens] * n


@pytest.mark.parametrize("case", sorted(FOUND))
def test_a_fault_found_once_loses_nothing(case: str) -> None:
    check_found(case)
