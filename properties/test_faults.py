"""Nothing is lost under faults: an exception from any call a step makes, or from two of them,
leaves the engine (and the scheduler over its store) able to continue correctly.

The fault model: an injected call raises :class:`InjectedFault` *before* it runs (every store
call, kernel call, model call, draw and draft source call is atomic: it validates, then changes
state), and the step that made it raises. Up to two calls fail in one step: the second, when it
comes right after the first, hits the undo of what the first one failed if that undo crosses a
boundary (the store's undo calls, ``undo_fork`` and ``undo_growth``, check nothing and take no
block, so they cannot fail and are not injected). After every step, faulted or not, the
machines check that no request is lost or duplicated, no block leaks, every running sequence's
table holds its tokens and reads them back (so no copy-on-write pair was dropped and no draft
stayed), and (the engine) no sequence holds a token greedy decoding would not produce. At the
end they run every request to completion without faults (the engine must drain: no wedge) and
compare the outputs with a reference that never saw a fault, and every block is free.

* :class:`SchedulerFaultMachine` (fast): the scheduler over a real store, a plain or prefix
  cache, with a simulated K/V cache (each slot remembers the token written there) and a
  deterministic "model" (a token is a hash of the tokens before it and the sample index);
  ``n`` up to 4. Faults hit the store's methods and the simulated copy-on-write, K/V write
  and draw.
* :class:`EngineFaultMachine`: ``PagedAttentionEngine`` with the tiny seeded model, greedy,
  ``n`` up to 4, speculative (a partly right draft source, ``k`` up to 3) or not, compared
  with the dense oracle. Faults hit the kernels, every store call, the scheduler, the model,
  the sampler and the draft source.

Faults are drawn call by call (:func:`drawn_faults`). :func:`sweep` makes, over a fixed run,
every single fault and every pair of a fault and the call right after it, in each of its
first steps. Planted bugs (a lost copy-on-write pair, a lost request, a leaked block) are each
caught by the machines, and the old undo paths (checked store calls a second fault can fail)
by the sweeps. The ``long`` hunt runs the machines far longer.
"""

from __future__ import annotations

import collections
import functools
import itertools
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, ClassVar

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

import pagedkv.impl.blocks.growth
import pagedkv.impl.blocks.manager
import pagedkv.impl.blocks.pool
import pagedkv.impl.blocks.prefix_cache
import pagedkv.impl.blocks.store
import pagedkv.impl.serving.engine
import pagedkv.impl.serving.scheduler
import pagedkv.impl.serving.speculative
import pagedkv.kernels
from pagedkv.impl.blocks import BlockTableStore
from pagedkv.impl.serving.dense import dense_generate
from pagedkv.impl.serving.metrics import step_metrics
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig, SeqStatus
from pagedkv.spec.block_manager import translate_slot
from properties.engine_cases import MODEL, check_all_freed, greedy_oracle, one_thread
from properties.mutants import CONTROL_SEARCHES, FIND, load_copy, load_mutant
from properties.seams import installed, listed_seams

VOCAB = 8


class InjectedFault(RuntimeError):
    """The exception a fault injector raises."""


class FaultInjector:
    """Counts calls to the functions it wraps and makes up to two of them a step raise before
    they run. Each call of an armed step asks ``decide(name, first)`` whether it fails
    (``first``: no fault fired yet in the step): a machine draws the answer, so Hypothesis
    places the faults at any boundary, and a second fault right after a first one hits the
    undo of what the first one failed (if that undo crosses a boundary)."""

    MAX_FAULTS = 2

    def __init__(self, observe: Callable[[str], None] | None = None) -> None:
        self.calls = 0
        self.decide: Callable[[str, bool], bool] | None = None
        self.fired: list[str] = []
        self.observe = observe  # told of every call before it is made

    def wrap(self, name: str, function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def faulty(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            if self.observe is not None:
                self.observe(name)
            decide = self.decide
            if (
                decide is not None
                and len(self.fired) < self.MAX_FAULTS
                and decide(name, not self.fired)
            ):
                self.fired.append(name)
                raise InjectedFault(f"injected into call {self.calls}: {name}")
            return function(*args, **kwargs)

        return faulty

    @contextmanager
    def armed(self, decide: Callable[[str, bool], bool] | None) -> Iterator[None]:
        """Let ``decide`` fail the calls made in the block (None: none fails)."""
        self.calls, self.fired, self.decide = 0, [], decide
        try:
            yield
        finally:
            self.decide = None


def drawn_faults(data: st.DataObject) -> Callable[[str, bool], bool]:
    """Faults drawn call by call: a step's first fault at each call with chance about
    ``1 / rate``, the rate drawn once a step (a high one reaches the step's late calls), and
    a second one at each later call with chance about one half."""
    rate = data.draw(st.sampled_from([4, 16, 64]), label="one call in")

    def decide(name: str, first: bool) -> bool:
        if first:  # a middle value: Hypothesis draws the ends of a range far more often
            return data.draw(st.integers(0, rate - 1), label=f"fail {name}?") == rate // 2
        return data.draw(st.booleans(), label=f"fail {name} too?")

    return decide


HUNT_STATS: collections.Counter[tuple[str, str]] = collections.Counter()
"""Per machine class: ``steps`` run, ``chains`` (steps whose copy found a copy-on-write source
that every table had let go of: waiting for its copy under the rule, handed out again without
it) and ``faults`` injected."""


class Counted:
    """A fault machine's step counts in :data:`HUNT_STATS`."""

    chained = False

    def observe(self, name: str) -> None:
        """Before each wrapped call: at the step's copy, does a pair's source wait for it, or
        (without the rule) does a pair write a block an earlier pair reads?"""
        if name.endswith("pending_copy_pairs"):
            manager = self.engine_store().manager
            read: set[int] = set()
            for src, dst in manager.pending_copy_pairs():
                read.add(src)
                self.chained |= dst in read
            self.chained |= bool(manager.waiting_for_copy)

    def engine_store(self) -> Any:
        raise NotImplementedError

    def count_step(self, injector: FaultInjector) -> None:
        name = type(self).__name__
        HUNT_STATS[name, "steps"] += 1
        HUNT_STATS[name, "chains"] += self.chained
        HUNT_STATS[name, "faults"] += len(injector.fired)
        self.chained = False


def wrap_methods(injector: FaultInjector, target: Any, names: tuple[str, ...]) -> None:
    """Shadow ``target``'s methods ``names`` with faulty wrappers (instance attributes); for
    objects that do not call these methods themselves."""
    for name in names:
        setattr(target, name, injector.wrap(name, getattr(target, name)))


class FaultyStore:
    """A store as its callers see it: the methods ``names`` may fault; everything else, and
    the store's calls to its own methods, go to the real store untouched (faults hit the
    boundary, where each store call is atomic)."""

    def __init__(self, store: BlockTableStore, injector: FaultInjector, names: tuple[str, ...]):
        self._store = store
        for name in names:
            setattr(self, name, injector.wrap(name, getattr(store, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


STORE_CALLS = (
    "token_counts_of", "grow_or_preempt", "admit", "fork", "remove", "cache_blocks",
    "pending_copy_pairs", "pop_copy_pairs", "batch", "slot_mapping", "release_outside_window",
    "grow", "truncate", "resolve", "row",
)  # fmt: skip
"""Every store call the scheduler, the engine and its speculation make (the undo calls,
``undo_fork`` and ``undo_growth``, cannot fail: they check nothing and take no block)."""


def copy_blocks(kv: dict[int, int], pairs: list[list[int]], block_size: int) -> None:
    """Copy-on-write in the simulated cache: each ``dst`` block takes ``src``'s rows, in order."""
    for src, dst in pairs:
        for row in range(block_size):
            kv[dst * block_size + row] = kv.get(src * block_size + row, -1)


def next_token(tokens: list[int], sample: int) -> int:
    """The deterministic model: a token from the tokens before it and the sample index."""
    return hash((tuple(tokens), sample)) % VOCAB


def expected_outputs(prompt: list[int], max_new: int, n: int, eos: int | None) -> list[list[int]]:
    """What every sample of a request generates with :func:`next_token`, fault-free."""
    outputs = []
    for sample in range(n):
        tokens = list(prompt)
        while len(tokens) - len(prompt) < max_new:
            tokens.append(next_token(tokens, sample))
            if tokens[-1] == eos:
                break
        outputs.append(tokens[len(prompt) :])
    return outputs


SCHEDULER_SETUP = {
    "total_blocks": st.integers(4, 16),
    "block_size": st.sampled_from([1, 2, 4]),
    "prefix": st.booleans(),
    "max_num_seqs": st.integers(1, 4),
    "budget": st.integers(1, 12),
}
"""The pools, budgets and sequence limits the scheduler fault machines draw."""


class SchedulerFaultMachine(Counted, RuleBasedStateMachine):
    """The scheduler and a real store, a simulated K/V cache, and faults anywhere."""

    SCHEDULER: ClassVar[type] = Scheduler
    BLOCKS: ClassVar[Any] = pagedkv.impl.blocks.store  # its manager and store classes

    @initialize(**SCHEDULER_SETUP)
    def start(
        self, total_blocks: int, block_size: int, prefix: bool, max_num_seqs: int, budget: int
    ) -> None:
        self.set_up(total_blocks, block_size, prefix, max_num_seqs, budget, None)

    def set_up(
        self,
        total_blocks: int,
        block_size: int,
        prefix: bool,
        max_num_seqs: int,
        budget: int,
        window: int | None,
    ) -> None:
        blocks = self.BLOCKS
        manager_class = blocks.PrefixCachingBlockManager if prefix else blocks.BlockManager
        manager = manager_class(total_blocks, block_size)
        self.injector = FaultInjector(self.observe)
        store = blocks.BlockTableStore(manager, max_num_seqs, 64)
        self.store: Any = FaultyStore(store, self.injector, STORE_CALLS)
        config = SchedulerConfig(max_num_seqs, budget, 0, sliding_window=window)
        self.scheduler = self.SCHEDULER(self.store, config)
        self.window = window
        self.stage = self.injector.wrap("kv or draw", lambda: None)  # the engine's own work
        self.kv: dict[int, int] = {}  # slot -> the token whose K/V is there
        self.requests: dict[int, tuple[list[int], int, int]] = {}  # id -> prompt, max_new, n
        self.outputs: dict[int, dict[int, list[int]]] = {}  # request -> sample -> output
        self.eos = 0
        self.block_size, self.total_blocks = block_size, total_blocks

    @precondition(lambda self: len(self.requests) < 6)
    @rule(
        prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10),
        max_new=st.integers(1, 6),
        n=st.integers(1, 4),
    )
    def add_request(self, prompt: list[int], max_new: int, n: int) -> None:
        request_id = len(self.requests)
        try:
            self.scheduler.add_request(request_id, prompt, max_new, n=n, eos_token_id=self.eos)
        except ValueError:  # too large for this pool: refused, nothing queued
            return
        self.requests[request_id] = (prompt, max_new, n)

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One engine-like step, with up to two faults drawn call by call."""
        self.faulty_step(drawn_faults(data))

    def faulty_step(self, decide: Callable[[str, bool], bool] | None) -> None:
        with self.injector.armed(decide), suppress(InjectedFault):
            self.run_step()
        self.count_step(self.injector)

    def engine_store(self) -> Any:
        return self.store

    def run_step(self) -> None:
        scheduler, store = self.scheduler, self.store
        plan = scheduler.schedule()
        self.stage()
        copy_blocks(self.kv, store.pending_copy_pairs().tolist(), self.block_size)
        store.pop_copy_pairs()  # forgotten only once copied
        self.stage()
        for item in plan.items():  # write the step's K/V
            table = store.table(item.seq.seq_id)
            for position in range(item.start, item.end):
                self.kv[translate_slot(table, position, self.block_size)] = item.seq.tokens[
                    position
                ]
        sampled = []
        for seq in plan.sampling:
            self.stage()
            sampled += [
                next_token(seq.tokens, seq.sample_index + j) for j in range(seq.num_samples)
            ]
        _, finished = scheduler.update(plan, sampled)
        for seq in finished:
            outputs = self.outputs.setdefault(seq.request_id, {})
            assert seq.sample_index not in outputs, "a sample finished twice"
            outputs[seq.sample_index] = seq.output

    @invariant()
    def nothing_lost(self) -> None:
        scheduler, store = self.scheduler, self.store
        running = [seq.seq_id for seq in scheduler.running]
        assert running == list(store.seq_ids), "the running list is the store's live order"
        waiting = [seq.seq_id for seq in scheduler.waiting]
        assert not set(waiting) & set(running)
        assert all(seq.status.value == SeqStatus.WAITING.value for seq in scheduler.waiting)
        held = {b for seq_id in store.seq_ids for b in store.table(seq_id) if b is not None}
        waiting = len(store.manager.waiting_for_copy)  # sources of pairs a fault left pending
        assert store.num_free_blocks + len(held) + waiting == self.total_blocks, "a block leaked"
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

    def teardown(self) -> None:
        """Run to completion without faults; every sample is what a fault-free run makes."""
        if not hasattr(self, "scheduler"):
            return
        for _ in range(500):
            if not self.scheduler.has_unfinished():
                break
            self.run_step()
        assert not self.scheduler.has_unfinished()
        for request_id, (prompt, max_new, n) in self.requests.items():
            got = [self.outputs[request_id][i] for i in range(n)]
            assert got == expected_outputs(prompt, max_new, n, self.eos)
        assert self.store.num_free_blocks == self.total_blocks


TestSchedulerFaults = SchedulerFaultMachine.TestCase


class WindowSchedulerFaultMachine(SchedulerFaultMachine):
    """The same, under a sliding window: the scheduler releases blocks that left it, and a
    fault anywhere, ``release_outside_window`` included, still loses nothing. A subclass, so
    the base machine's search for its planted bugs stays as it was."""

    @initialize(**SCHEDULER_SETUP, window=st.integers(1, 6))
    def start(  # type: ignore[override]
        self,
        total_blocks: int,
        block_size: int,
        prefix: bool,
        max_num_seqs: int,
        budget: int,
        window: int,
    ) -> None:
        self.set_up(total_blocks, block_size, prefix, max_num_seqs, budget, window)


TestWindowSchedulerFaults = WindowSchedulerFaultMachine.TestCase


FORKING_REQUEST = {
    "prompt": st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=7),
    "max_new": st.integers(3, 6),
    "n": st.integers(2, 4),
}
"""Requests that fork and then grow: their samples copy the prompt's partly filled last block."""


class ChainRequests:
    """A rule for the chain machines: requests that chain copy-on-write on purpose."""

    VOCAB: ClassVar[int] = VOCAB
    block_size: int
    total_blocks: int
    requests: dict[int, Any]
    chained: bool
    add_request: Callable[..., None]  # the machine's own
    faulty_step: Callable[[Callable[[str, bool], bool] | None], None]

    @rule(seam=st.sampled_from(["pop_copy_pairs", "copy_blocks"]))
    def step_failing_after_a_chained_copy(self, seam: str) -> None:
        """A step that fails at ``seam`` (the copies' end, or a layer's copy) once it has
        copied a list whose source was waiting: the retry the rule is for."""
        self.faulty_step(lambda name, first: first and self.chained and name.endswith(seam))

    @precondition(lambda self: len(self.requests) < 4 and self.total_blocks >= 3)
    @rule(data=st.data())
    def add_two_requests_that_chain(self, data: st.DataObject) -> None:
        """Two requests that leave one block free: a pair of samples whose prompt ends in a
        partly filled block, then one whose prompt fills its blocks. Once both are prefilled
        (in one step), the first sample copies its shared block on write into the last free
        block, the second request needs a block for its next token, and the preemption frees
        the other sample, that block's last other holder: the block waits for its copy."""
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
        """Three samples, then two, each prompt ending in a partly filled block, leaving two
        blocks free (the issue's run). Once both are prefilled, each request's first sample
        copies its shared block on write, the next sample of the first finds no block, the
        preemption of the second request's other sample frees that request's shared block, and
        the copy on write that follows would take it, while a pending pair still reads it."""
        size = self.block_size
        first = data.draw(st.integers(1, self.total_blocks - 3), label="first's blocks")
        token = st.integers(0, self.VOCAB - 1)
        for blocks, n in ((first, 3), (self.total_blocks - 2 - first, 2)):
            tail = data.draw(st.integers(1, size - 1), label="its last block's tokens")
            length = blocks * size - size + tail
            prompt = data.draw(st.lists(token, min_size=length, max_size=length))
            self.add_request(prompt, data.draw(st.integers(2, 4), label="max_new"), n)


class ChainSchedulerFaultMachine(ChainRequests, SchedulerFaultMachine):
    """The same on workloads that chain copy-on-write: pools of 4 to 8 blocks, rows for every
    sample, and requests that fork into 2 to 4, so a preemption often frees, in the growth that
    copied it, a block its last other holder copied on write, which then waits for its copy
    (design.md §5, "Copy-on-write and retries"). A subclass, so the base machine's search for
    its planted bugs stays as it was."""

    @initialize(
        total_blocks=st.integers(4, 8),
        block_size=st.sampled_from([2, 3, 4]),
        prefix=st.booleans(),
        max_num_seqs=st.integers(6, 8),
        budget=st.integers(8, 32),
    )
    def start(  # type: ignore[override]
        self, total_blocks: int, block_size: int, prefix: bool, max_num_seqs: int, budget: int
    ) -> None:
        self.set_up(total_blocks, block_size, prefix, max_num_seqs, budget, None)

    @precondition(lambda self: len(self.requests) < 8)
    @rule(**FORKING_REQUEST)
    def add_forking_request(self, prompt: list[int], max_new: int, n: int) -> None:
        self.add_request(prompt, max_new, n)


TestChainSchedulerFaults = ChainSchedulerFaultMachine.TestCase


def test_the_chain_machine_chains() -> None:
    """Chains happen in the quick command: a fixed search of the chain machine meets at least
    one step whose copy finds a waiting source (results.md gives the rate)."""
    name = ChainSchedulerFaultMachine.__name__
    before = HUNT_STATS[name, "chains"]
    search = settings(
        max_examples=100, stateful_step_count=30, derandomize=True, database=None,
        deadline=None, suppress_health_check=[HealthCheck.too_slow],
    )  # fmt: skip
    run_state_machine_as_test(ChainSchedulerFaultMachine, settings=search)
    assert HUNT_STATS[name, "chains"] > before


# ----------------------------------------------------------------- the engine


MODELS = {w: MODEL if w is None else CausalLM.from_seed(ModelConfig(sliding_window=w), seed=0)
          for w in (None, 3, 5)}  # fmt: skip
"""The engine machine's models: the tiny one, and the same with a sliding window."""


class GreedyDrafts:
    """A draft source that is partly right: the greedy continuation of the tokens it is
    given, with the draft at a position picked by the tokens' hash shifted by one token id
    (none, if the pick is past the drafts). Reads continuations recorded ahead of time, so it
    never runs the model (whose calls the machine counts and faults) while a step runs."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model
        self.after: dict[tuple[int, ...], list[int]] = {}  # known tokens -> greedy tokens after

    def learn(self, prompt: list[int], max_new: int) -> None:
        tokens = [*prompt, *dense_tokens(self.model, tuple(prompt), max_new)]
        for end in range(len(prompt), len(tokens)):
            self.after[tuple(tokens[:end])] = tokens[end:]

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        guess = list(self.after.get(tuple(tokens), [])[:k])
        wrong = hash(tuple(tokens)) % (k + 1)
        if wrong < len(guess):
            guess[wrong] = (guess[wrong] + 1) % MODEL.config.vocab_size
        return guess


@functools.lru_cache(maxsize=4096)
def dense_tokens(model: CausalLM, prompt: tuple[int, ...], max_new: int) -> list[int]:
    """The dense model's greedy continuation (cached: the machine asks after every step)."""
    return dense_generate(model, prompt, max_new).tokens


ENGINE_SEAMS = listed_seams()
"""Where the engine machine injects: every seam a traced step crosses (properties/seams.py)."""


class EngineFaultMachine(Counted, RuleBasedStateMachine):
    """The engine on every backend, greedy or sampled, speculative or not, with a sliding
    window or not, parallel sampling up to ``n = 4``, and up to two faults a step at every
    traced seam (:data:`ENGINE_SEAMS`) and in the draft source."""

    ENGINE: ClassVar[type] = pagedkv.impl.serving.engine.PagedAttentionEngine

    @initialize(
        total_blocks=st.integers(6, 16),
        block_size=st.sampled_from([1, 2, 4]),
        prefix=st.booleans(),
        speculative=st.integers(0, 3),
        window=st.sampled_from([None, None, 3, 5]),
        backend=st.sampled_from(["numba", "reference", "triton"]),
    )
    def start(
        self,
        total_blocks: int,
        block_size: int,
        prefix: bool,
        speculative: int,
        window: int | None = None,
        backend: str = "numba",
        max_num_seqs: int = 4,
        max_num_batched_tokens: int = 16,
    ) -> None:
        self.injector = FaultInjector(self.observe)
        self.model = MODELS[window]
        self.drafts = GreedyDrafts(self.model)
        source = self.injector.wrap("draft_source", self.drafts) if speculative else None
        self.options = dict(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=prefix,
            max_model_len=64, draft_source=source, num_speculative_tokens=speculative,
            backend=backend,
        )  # fmt: skip
        self.engine = self.ENGINE(self.model, total_blocks, block_size, **self.options)
        self.seams = ExitStack()
        self.seams.enter_context(installed(ENGINE_SEAMS, self.injector.wrap))
        self.requests: dict[int, tuple[list[int], int, int, int | None]] = {}
        self.outputs: dict[int, list[list[int]]] = {}
        self.total_blocks, self.block_size = total_blocks, block_size

    def teardown(self) -> None:
        if not hasattr(self, "engine"):
            return
        try:
            for _ in range(500):
                if not self.engine.has_unfinished_requests():
                    break
                with one_thread():
                    self.collect(self.engine.step().finished)
            assert not self.engine.has_unfinished_requests(), "the engine is wedged"
            assert self.engine.store.num_free_blocks == self.total_blocks, "a block leaked"
            sampled = self.fault_free_samples()
            for request_id, (prompt, max_new, n, seed) in self.requests.items():
                if seed is None:
                    expected = dense_tokens(self.model, tuple(prompt), max_new)
                    assert self.outputs[request_id] == [expected] * n
                else:
                    assert self.outputs[request_id] == sampled[request_id], "a draw repeated"
        finally:
            self.seams.close()

    def fault_free_samples(self) -> dict[int, list[list[int]]]:
        """The sampled requests' outputs in a run of the same requests without faults."""
        if all(seed is None for *_, seed in self.requests.values()):
            return {}
        engine = self.ENGINE(self.model, self.total_blocks, self.block_size, **self.options)
        for prompt, max_new, n, seed in self.requests.values():
            temperature = 0.0 if seed is None else 1.0
            engine.add_request(prompt, max_new, n=n, temperature=temperature, seed=seed)
        with one_thread():
            finished = drain(engine)
        return {out.request_id: out.outputs for out in finished}

    def collect(self, finished: list[Any]) -> None:
        for result in finished:
            assert result.request_id not in self.outputs, "a request was returned twice"
            self.outputs[result.request_id] = result.outputs

    @precondition(lambda self: len(self.requests) < 4)
    @rule(
        prompt=st.lists(st.integers(0, MODEL.config.vocab_size - 1), min_size=1, max_size=9),
        max_new=st.integers(1, 5),
        n=st.integers(1, 4),
        sampled=st.booleans(),
    )
    def add_request(self, prompt: list[int], max_new: int, n: int, sampled: bool = False) -> None:
        """Greedy requests, or (without speculation) seeded sampled ones; ``n > 1`` forks, and
        its first write copies on write."""
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

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """One step, with up to two faults drawn call by call."""
        self.faulty_step(drawn_faults(data))

    def faulty_step(self, decide: Callable[[str, bool], bool] | None) -> None:
        with self.injector.armed(decide), one_thread(), suppress(InjectedFault):
            self.collect(self.engine.step().finished)
        self.count_step(self.injector)

    def engine_store(self) -> Any:
        return self.engine.store

    @invariant()
    def nothing_lost(self) -> None:
        store, scheduler = self.engine.store, self.engine.scheduler
        assert [seq.seq_id for seq in scheduler.running] == list(store.seq_ids)
        held = {b for seq_id in store.seq_ids for b in store.table(seq_id) if b is not None}
        waiting = len(store.manager.waiting_for_copy)  # sources of pairs a fault left pending
        assert store.num_free_blocks + len(held) + waiting == self.total_blocks, "a block leaked"
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
                greedy = dense_tokens(self.model, tuple(prompt), max_new)
                assert seq.output == greedy[: len(seq.output)], "a token greedy never gives"


ENGINE_SETTINGS = settings(
    max_examples=25,
    stateful_step_count=12,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

TestEngineFaults = EngineFaultMachine.TestCase
TestEngineFaults.settings = ENGINE_SETTINGS


class ChainEngineFaultMachine(ChainRequests, EngineFaultMachine):
    """The engine machine on workloads that chain copy-on-write (as
    :class:`ChainSchedulerFaultMachine`): pools of 4 to 8 blocks and rows for every sample."""

    VOCAB = MODEL.config.vocab_size

    @initialize(
        total_blocks=st.integers(4, 8),
        block_size=st.sampled_from([2, 3, 4]),
        prefix=st.booleans(),
        speculative=st.sampled_from([0, 0, 2]),
        window=st.sampled_from([None, None, 5]),
        backend=st.sampled_from(["numba", "reference", "triton"]),
    )
    def start(  # type: ignore[override]
        self,
        total_blocks: int,
        block_size: int,
        prefix: bool,
        speculative: int,
        window: int | None,
        backend: str,
    ) -> None:
        super().start(total_blocks, block_size, prefix, speculative, window, backend, 8, 32)

    @precondition(lambda self: len(self.requests) < 4)
    @rule(prompt=st.lists(st.integers(0, MODEL.config.vocab_size - 1), min_size=1, max_size=7),
          max_new=st.integers(3, 6), n=st.integers(2, 4))  # fmt: skip
    def add_forking_request(self, prompt: list[int], max_new: int, n: int) -> None:
        self.add_request(prompt, max_new, n)


HUNT = settings(
    max_examples=300, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
"""The long hunt: the second test command's."""


@pytest.mark.long
@pytest.mark.parametrize(
    "machine",
    [
        SchedulerFaultMachine, WindowSchedulerFaultMachine, ChainSchedulerFaultMachine,
        EngineFaultMachine, ChainEngineFaultMachine,
    ],
)  # fmt: skip
def test_long_fault_hunt(machine: type) -> None:
    """The fault machines above, far longer: up to two faults a step, anywhere. Prints what it
    ran (``-s``); the chain machines must meet chains."""
    hunt = HUNT if issubclass(machine, EngineFaultMachine) else settings(HUNT, max_examples=3000)
    run_state_machine_as_test(machine, settings=hunt)
    name = machine.__name__
    steps, chains, faults = (HUNT_STATS[name, key] for key in ("steps", "chains", "faults"))
    print(
        f"{name}: {steps} steps, {faults} faults injected, {chains} chained copies "
        f"({1000 * chains / steps:.1f} per 1,000 steps)"
    )
    assert chains > 0 or not issubclass(machine, ChainRequests)


# ----------------------------------------------------------------- every pair of faults


def sweep(
    machine_class: type, setup: dict[str, Any], requests: list[dict[str, Any]], steps: int
) -> int:
    """Every way to fail one call of one of the first ``steps`` steps of a fixed run, alone
    or together with the call right after it (the undo's, when the undo crosses a boundary):
    each run replays the steps before it fault-free, checks the machine's invariant after the
    faulty step, then drains without faults and checks the outputs and the pool. Returns the
    runs made."""

    def replay(faulty: int, decide: Callable[[str, bool], bool]) -> int:
        machine = machine_class()
        machine.start(**setup)
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
            replay(faulty, FaultsAt(call, twice))
            runs += 1
    return runs


class FaultsAt:
    """Fail the ``call``-th call of a step and, if ``twice``, the one right after it."""

    def __init__(self, call: int, twice: bool) -> None:
        self.call, self.twice, self.seen = call, twice, 0

    def __call__(self, name: str, first: bool) -> bool:
        self.seen += 1
        return self.seen == self.call or (self.twice and self.seen == self.call + 1)


# A request that forks into three (no sample is born done, so both children fork) beside one
# that does not; the pool is small enough that the run preempts.
SCHEDULER_SWEEP = (
    {"total_blocks": 8, "block_size": 2, "prefix": True, "max_num_seqs": 4, "budget": 6},
    [
        {"prompt": [1, 2, 3, 4, 6], "max_new": 3, "n": 3},
        {"prompt": [1, 2, 3], "max_new": 2, "n": 1},
    ],
)


def test_every_pair_of_faults_in_the_scheduler() -> None:
    assert sweep(SchedulerFaultMachine, *SCHEDULER_SWEEP, steps=6) > 50


ENGINE_SWEEP = (
    {"total_blocks": 12, "block_size": 2, "prefix": True, "speculative": 2, "backend": "reference"},
    [
        {"prompt": [5, 7, 9, 11, 13], "max_new": 4, "n": 3},
        {"prompt": [5, 7, 9], "max_new": 5, "n": 1},
    ],
)


def test_every_pair_of_faults_in_the_engine() -> None:
    """The same over the engine, speculative, with a request that forks into three."""
    assert sweep(EngineFaultMachine, *ENGINE_SWEEP, steps=3) > 50


# ----------------------------------------------------------------- teeth


PLANTED = {
    "a failed copy loses its copy-on-write pairs": (
        pagedkv.impl.serving.engine,
        "PagedAttentionEngine.step",
        "pairs = self.store.pending_copy_pairs()",
        "pairs = self.store.pop_copy_pairs()",
    ),
    "a failed admission loses its request": (
        pagedkv.impl.serving.scheduler,
        "Scheduler._admit_waiting",
        "seq = self.waiting[0]\ncached = self._admit(seq, seats, held)",
        "seq = self.waiting.popleft()\ncached = self._admit(seq, seats, held)",
    ),
    "a failed update leaks the blocks of its forks": (
        pagedkv.impl.serving.scheduler,
        "Scheduler._fork_and_finish",
        "            if forks:\n                self.store.undo_fork(forks)",
        "            if False:\n                self.store.undo_fork(forks)",
    ),
}
UNDO_PLANTED = {
    "the undo of a failed update's forks can fail (the old undo)": (
        pagedkv.impl.serving.scheduler,
        "Scheduler._fork_and_finish",
        "self.store.undo_fork(forks)",
        "self.store.remove(forks)",
    ),
    "the undo of a failed speculative step can fail (the old undo)": (
        pagedkv.impl.serving.speculative,
        "undraft",
        "scheduler.undo_drafts(plan, before)",
        "scheduler.keep_drafts(plan, before)",
    ),
}
"""The undo paths as they were (checked store calls, which a second fault can fail): only
two faults in one step find them, which the sweeps of every pair do."""


WITHOUT_THE_RETRY_RULE = {
    pagedkv.impl.blocks.pool: (
        "BlockPool._free",
        "waits = self.is_source.take(freed)",
        "waits = np.zeros(freed.size, dtype=np.bool_)",
    ),
    pagedkv.impl.blocks.growth: (
        "plan_in_order",
        "left == 0 and block not in sources",
        "left == 0",
    ),
}
"""The block layer as it was before the retry rule (design.md §5): a pending copy's source
joins the free queue when its last table lets go, and the growth plan counts it free."""


def chain_machine_over(edits: dict[Any, tuple[str, str, str]]) -> type:
    """:class:`ChainSchedulerFaultMachine` over a manager and store whose block layer has
    ``edits`` planted (module -> ``(function, old, new)``), every module above a planted one
    loaded again over the copies."""
    layer = [
        pagedkv.impl.blocks.pool, pagedkv.impl.blocks.manager, pagedkv.impl.blocks.prefix_cache,
        pagedkv.impl.blocks.growth, pagedkv.impl.blocks.store,
    ]  # fmt: skip
    shared = ("CapacityError", "OutOfBlocksError", "BlockTableError")
    copies: dict[str, Any] = {}
    for module in layer:
        names = tuple(name for name in shared if hasattr(module, name))
        if module in edits:
            within, old, new = edits[module]
            copy = load_mutant(module, within, old, new, names, using=dict(copies))
        else:
            copy = load_copy(module, names, using=dict(copies))
        copies[module.__name__] = copy
    blocks = copies[pagedkv.impl.blocks.store.__name__]
    return type("PlantedChainScheduler", (ChainSchedulerFaultMachine,), {"BLOCKS": blocks})


def test_the_chain_machine_catches_the_block_layer_without_the_retry_rule() -> None:
    with pytest.raises(Exception):  # noqa: B017 - an assertion or a crash inside a rule
        run_state_machine_as_test(chain_machine_over(WITHOUT_THE_RETRY_RULE), settings=FIND)


@pytest.mark.parametrize("search", CONTROL_SEARCHES)
def test_control_unmutated_block_layer_passes_the_chain_machine(search: settings) -> None:
    faithful = {
        module: (within, old, old) for module, (within, old, _) in WITHOUT_THE_RETRY_RULE.items()
    }
    run_state_machine_as_test(chain_machine_over(faithful), settings=search)


def planted_machine(module: Any, within: str, old: str, new: str) -> tuple[type, settings]:
    if module is pagedkv.impl.serving.speculative:  # an engine copy that calls the mutant
        engine = load_copy(pagedkv.impl.serving.engine, ("RequestOutput", "StepOutput"))
        engine.speculative = load_mutant(module, within, old, new)
        attrs = {"ENGINE": engine.PagedAttentionEngine}
        return type("PlantedEngine", (EngineFaultMachine,), attrs), ENGINE_FIND
    if module is pagedkv.impl.serving.engine:
        mutant = load_mutant(module, within, old, new, ("RequestOutput", "StepOutput"))
        attrs = {"ENGINE": mutant.PagedAttentionEngine}
        return type("PlantedEngine", (EngineFaultMachine,), attrs), ENGINE_FIND
    mutant = load_mutant(module, within, old, new, ("RequestTooLargeError",))
    attrs = {"SCHEDULER": mutant.Scheduler}
    return type("PlantedScheduler", (SchedulerFaultMachine,), attrs), FIND


ENGINE_FIND = settings(
    ENGINE_SETTINGS, max_examples=60, database=None, derandomize=True,
    report_multiple_bugs=False, phases=[Phase.generate],
)  # fmt: skip


@pytest.mark.parametrize("bug", sorted(PLANTED))
def test_planted_fault_bug_is_caught(bug: str) -> None:
    """Each planted bug fails its machine; the engine's also fails the copy scenario below."""
    machine, search = planted_machine(*PLANTED[bug])
    with pytest.raises(Exception):  # noqa: B017 - an assertion or a crash inside a rule
        if issubclass(machine, EngineFaultMachine):
            check_a_failed_copy_is_retried(machine.ENGINE)
        run_state_machine_as_test(machine, settings=search)


@pytest.mark.parametrize("bug", sorted(UNDO_PLANTED))
def test_planted_undo_bug_is_caught_by_the_sweep(bug: str) -> None:
    machine, _ = planted_machine(*UNDO_PLANTED[bug])
    with pytest.raises(Exception):  # noqa: B017 - an assertion or the engine wedged
        if issubclass(machine, EngineFaultMachine):
            sweep(machine, *ENGINE_SWEEP, steps=3)
        else:
            sweep(machine, *SCHEDULER_SWEEP, steps=6)


def test_control_unmutated_copies_pass() -> None:
    for module, within, snippet in (
        (
            pagedkv.impl.serving.engine,
            "PagedAttentionEngine.step",
            "pairs = self.store.pending_copy_pairs()",
        ),
        (
            pagedkv.impl.serving.scheduler,
            "Scheduler._fork_and_finish",
            "self.store.undo_fork(forks)",
        ),
    ):
        machine, search = planted_machine(module, within, snippet, snippet)
        if issubclass(machine, EngineFaultMachine):
            check_a_failed_copy_is_retried(machine.ENGINE)
        run_state_machine_as_test(machine, settings=search)


def check_a_failed_copy_is_retried(engine_class: type) -> None:
    """The issue's example: parallel samples whose copy-on-write fails once still equal the
    fault-free run (before the fix one sample came out as [92, 0, 0, 0])."""
    prompt, expected = [5, 7, 9], None
    original = pagedkv.kernels.copy_blocks
    for fail in (False, True):
        engine = engine_class(MODEL, 16, 4, max_num_seqs=4, max_model_len=64)
        engine.add_request(prompt, 4, n=2, temperature=1.0, seed=3)
        failed: list[bool] = []

        def copy_once_failing(
            *args: Any, fail: bool = fail, failed: list[bool] = failed, **kwargs: Any
        ) -> None:
            if fail and not failed:
                failed.append(True)
                raise InjectedFault("copy_blocks")
            original(*args, **kwargs)

        pagedkv.kernels.copy_blocks = copy_once_failing
        try:
            outputs = []
            while engine.has_unfinished_requests():
                with suppress(InjectedFault):
                    outputs += engine.step().finished
        finally:
            pagedkv.kernels.copy_blocks = original
        assert not fail or failed, "the copy never ran"
        result = outputs[0].outputs
        assert [len(tokens) for tokens in result] == [4, 4]
        if expected is None:
            expected = result
        assert result == expected


def test_a_failed_copy_is_retried_by_the_next_step() -> None:
    check_a_failed_copy_is_retried(pagedkv.impl.serving.engine.PagedAttentionEngine)


# ----------------------------------------------------------------- two faults: the undo is hit


def wrong_drafts(tokens: list[int], k: int) -> list[int]:
    """Drafts greedy decoding never keeps: its continuation, each token id shifted by one."""
    vocab = MODEL.config.vocab_size
    return [(token + 1) % vocab for token in greedy_oracle(tuple(tokens), k).tokens]


def failing_calls(target: Any, name: str, calls: tuple[int, ...]) -> list[int]:
    """Make ``target.name`` raise :class:`InjectedFault` at its ``calls``-th calls (counted
    from 1); returns the list of calls that raised."""
    original, count, fired = getattr(target, name), [0], []

    def faulty(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        if count[0] in calls:
            fired.append(count[0])
            raise InjectedFault(f"{name} call {count[0]}")
        return original(*args, **kwargs)

    setattr(target, name, faulty)
    return fired


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


def test_a_failed_rollback_and_undo_of_drafts_emit_no_unverified_token() -> None:
    """Finding 1: ``store.truncate`` raises on its 2nd and 3rd calls. At 5263599 those were a
    speculative step's rollback and the undo of its drafts, and the drafts (all wrong) stayed
    in the tokens and came out. Now the undo is ``store.undo_growth``, which cannot fail, so
    the 3rd call is a later step's rollback; either way the output is greedy decoding's and
    every block comes back."""
    engine = pagedkv.impl.serving.engine.PagedAttentionEngine(
        MODEL, 16, 4, max_num_seqs=4, max_model_len=64, draft_source=wrong_drafts,
        num_speculative_tokens=3,
    )  # fmt: skip
    prompt = [5, 7, 9]
    engine.add_request(prompt, 8)
    with one_thread():
        fired = failing_calls(engine.store, "truncate", (2, 3))
        outputs = drain(engine)
    assert fired, "the rollback never failed"
    assert [out.outputs for out in outputs] == [[greedy_oracle(tuple(prompt), 8).tokens]]
    check_all_freed(engine)


def test_a_failed_fork_and_undo_of_the_forks_do_not_wedge_the_engine() -> None:
    """Finding 2: with ``n = 3``, ``store.fork`` raises on its second call and the
    ``store.remove`` undoing the first fork raises too. The first child used to stay in the
    store but not in the running list, and every later step raised; now the step is retried
    and every sample is greedy decoding's."""
    engine = pagedkv.impl.serving.engine.PagedAttentionEngine(
        MODEL, 16, 4, max_num_seqs=4, max_model_len=64
    )
    prompt = [5, 7, 9, 11, 13]
    engine.add_request(prompt, 4, n=3)
    with one_thread():
        forks = failing_calls(engine.store, "fork", (2,))
        failing_calls(engine.store, "remove", (1,))
        outputs = drain(engine)
    assert forks, "no fork failed"
    assert [out.outputs for out in outputs] == [[greedy_oracle(tuple(prompt), 4).tokens] * 3]
    check_all_freed(engine)


def test_a_request_finished_in_a_step_whose_metrics_failed_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The last request finishes in a step whose metrics then fail: the engine still has it
    to return, so stepping until idle returns it (it used to be stranded: nothing was
    unfinished, so nothing stepped again)."""
    engine = pagedkv.impl.serving.engine.PagedAttentionEngine(
        MODEL, 16, 4, max_num_seqs=4, max_model_len=64
    )
    engine.add_request([5, 7, 9], 1)
    with monkeypatch.context() as patch, one_thread():
        patch.setattr(pagedkv.impl.serving.engine, "step_metrics", step_metrics)
        fired = failing_calls(pagedkv.impl.serving.engine, "step_metrics", (1,))
        outputs = drain(engine)
    assert fired
    assert [out.outputs for out in outputs] == [[greedy_oracle((5, 7, 9), 1).tokens]]
    check_all_freed(engine)
