"""Greedy speculative decoding through the engine is plain greedy decoding, for draft sources
always right, always wrong, partly right and a fixed guess; the drafts kept are exactly the
leading ones equal to the real continuation (so speculation silently doing nothing fails)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv.impl.serving.engine as engine_module
import pagedkv.impl.serving.scheduler as scheduler_module
import pagedkv.impl.serving.speculative as speculative_module
import properties.engine_cases as engine_cases
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.paged_kv import PagedStep
from pagedkv.impl.serving.speculative import accepted_drafts
from pagedkv.spec.block_manager import blocks_needed
from properties.engine_cases import (  # single_thread: an autouse fixture
    CONFIG,
    MODEL,
    Request,
    Run,
    Workload,
    check_against_oracle,
    check_all_freed,
    greedy_oracle,
    run,
    single_thread,  # noqa: F401
    workloads,
)
from properties.mutants import load_mutant

VOCAB = CONFIG.vocab_size
Source = Callable[[list[int], int], list[int]]


def oracle(tokens: list[int], k: int) -> list[int]:
    return list(greedy_oracle(tuple(tokens), k).tokens)


def wrong(tokens: list[int], k: int) -> list[int]:
    return [(token + 1) % VOCAB for token in oracle(tokens, k)]


def partly_right(right: int) -> Source:
    def draft(tokens: list[int], k: int) -> list[int]:
        return oracle(tokens, k)[:right] + wrong(tokens, k)[right:]

    draft.__name__ = f"first_{right}_right"
    return draft


def fixed_guess(tokens: list[int], k: int) -> list[int]:
    return [tokens[-1]] * k  # "the last token repeats": sometimes right


SOURCES = [oracle, wrong, partly_right(1), partly_right(2), fixed_guess]


@dataclass
class Recorder:
    """A draft source that records each call: the tokens it saw and the drafts it returned."""

    source: Source
    calls: list[tuple[tuple[int, ...], list[int]]] = field(default_factory=list)

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        drafts = self.source(tokens, k)
        assert len(drafts) <= k
        self.calls.append((tuple(tokens), drafts))
        return drafts

    def expected_accepted(self, result: Run, eos_token_id: int | None) -> int:
        """Per call, the leading drafts equal to the real continuation (none EOS): the kept ones."""
        samples = [(tuple(out.prompt), tuple(s)) for out in result.outputs for s in out.outputs]
        kept = 0
        for tokens, drafts in self.calls:
            real = max(
                (
                    output[len(tokens) - len(prompt) :]
                    for prompt, output in samples
                    if (prompt + output)[: len(tokens)] == tokens and len(tokens) >= len(prompt)
                ),
                key=len,
            )
            assert len(real) > len(drafts) or real[-1:] == (eos_token_id,), "drafts past the end"
            kept += accepted_drafts(drafts, real, eos_token_id)
        return kept


def ample(workload: Workload) -> Workload:
    """The workload in a pool that holds every sequence at its longest at once (no preemption)."""
    total = sum(
        r.n * blocks_needed(len(r.prompt) + r.max_new_tokens - 1, workload.block_size)
        for r in workload.requests
    )
    return workload.but(total_blocks=max(total, workload.total_blocks))


def speculate(
    workload: Workload, source: Source, k: int, exact: bool = True, **kwargs: object
) -> tuple[Run, Recorder]:
    """Dense outputs and logits, all freed; ``exact`` (no preemption): the expected drafts kept."""
    recorder = Recorder(source)
    result = run(workload, draft_source=recorder, num_speculative_tokens=k, **kwargs)
    engine = result.engine
    check_against_oracle(workload, result)
    check_all_freed(engine)
    assert engine.num_accepted_tokens <= engine.num_draft_tokens
    if exact:
        assert engine.num_draft_tokens == sum(len(drafts) for _, drafts in recorder.calls)
        kept = recorder.expected_accepted(result, workload.eos_token_id)
        assert engine.num_accepted_tokens == kept
    return result, recorder


PROMPTS = ((5, 6, 7, 8, 9, 10, 11), (5, 6, 7, 8, 1, 2), (40, 41, 42), (3,) * 13)


def fixed_workload(block_size: int, prefix_caching: bool, eos: int | None = None) -> Workload:
    requests = tuple(
        Request(prompt, max_new_tokens=9 + i, n=1 + (i == 1), temperature=0.0, arrival=i % 2)
        for i, prompt in enumerate(PROMPTS)
    )
    return ample(Workload(requests, block_size, 1, 6, 64, 0, prefix_caching, eos))


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.__name__)
@pytest.mark.parametrize(("block_size", "prefix_caching", "k"), [(4, True, 3), (3, False, 4)])
def test_speculative_decoding_is_greedy_decoding(
    source: Source, block_size: int, prefix_caching: bool, k: int
) -> None:
    """Every source gives the greedy tokens; the drafts kept are the ones the source got right."""
    workload = fixed_workload(block_size, prefix_caching)
    engine = speculate(workload, source, k)[0].engine
    assert engine.num_draft_tokens > 0
    if source is wrong:
        assert engine.num_accepted_tokens == 0
    if source is oracle:  # the dense oracle and the paged engine agree on every arg-max here
        assert engine.num_accepted_tokens == engine.num_draft_tokens
        plain = run(workload)
        assert len(engine.metrics) < len(plain.engine.metrics)  # fewer steps than plain decoding


def test_a_right_source_takes_one_step_per_k_plus_one_tokens() -> None:
    """10 tokens, 3 right drafts a step: steps give 4, 4 and 2 tokens (the last capped)."""
    prompt = (9, 8, 7, 6, 5)
    greedy = greedy_oracle(prompt, 10).tokens

    def right(tokens: list[int], k: int) -> list[int]:
        done = len(tokens) - len(prompt)
        return list(greedy[done : done + k])

    workload = Workload((Request(prompt, 10, 1, 0.0, 0),), 4, 8, 1, 64, prefix_caching=False)
    result, recorder = speculate(workload, right, 3)
    assert [len(drafts) for _, drafts in recorder.calls] == [3, 3, 1]
    assert (result.engine.num_draft_tokens, result.engine.num_accepted_tokens) == (7, 7)
    assert len(result.engine.metrics) == 3


def test_an_end_of_sequence_draft_ends_the_output() -> None:
    """An EOS draft is never kept: it comes as the bonus token and ends the sequence."""
    eos = greedy_oracle(PROMPTS[0], 9).tokens[2]  # among the first step's drafts: g0, g1, EOS
    speculate(fixed_workload(4, True, eos), oracle, 4)


@settings(max_examples=25, deadline=None)
@given(
    workloads(max_requests=3, max_new_tokens=8, sampled=False),
    st.sampled_from(SOURCES),
    st.integers(1, 5),
)
def test_drawn_workloads(workload: Workload, source: Source, k: int) -> None:
    """Drawn workloads (chunked prompts, forks, prefix hits, EOS) in an ample pool."""
    speculate(ample(workload), source, k)


@settings(max_examples=15, deadline=None)
@given(workloads(max_requests=4, max_new_tokens=8, sampled=False), st.integers(1, 4))
def test_tight_pools(workload: Workload, k: int) -> None:
    """Pools that preempt: drafts take free blocks or wait; the tokens are still greedy."""
    speculate(workload, oracle, k, exact=False)


def test_triton_kernels_verify_the_drafts() -> None:
    """The Triton kernels (the CPU interpreter) verify the drafts, with a fork and preemptions."""
    requests = (Request((5, 6, 7, 8, 9), 6, 2, 0.0, 0), Request((5, 6, 7, 8, 1, 2), 6, 1, 0.0, 0))
    workload = Workload(requests, block_size=2, total_blocks=7, max_num_seqs=3,
                        max_num_batched_tokens=16)  # fmt: skip
    result = speculate(workload, partly_right(1), 3, exact=False, backend="triton")[0]
    assert sum(m.preemptions for m in result.engine.metrics) > 0
    assert 0 < result.engine.num_accepted_tokens < result.engine.num_draft_tokens


def test_sampling_with_speculation_is_refused() -> None:
    engine = PagedAttentionEngine(MODEL, 16, 4, draft_source=oracle, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="greedy only"):
        engine.add_request([1, 2, 3], 4, temperature=0.7)
    with pytest.raises(ValueError, match="greedy only"):
        engine.generate([[1, 2, 3]], 4, temperature=1.0)
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("drafts", "error"),
    [({1, 2}, TypeError), ([1, 2, 3], ValueError), ([VOCAB], ValueError), ([1.0], TypeError)],
)
def test_a_bad_draft_fails_the_step_and_loses_nothing(drafts: object, error: type) -> None:
    """A bad draft fails the step, changing nothing; a good source then finishes greedily."""
    behaviour = {"bad": True}

    def source(tokens: list[int], k: int) -> object:
        return drafts if behaviour["bad"] else oracle(tokens, k)

    workload, engine = queued(4, source, 2)
    with pytest.raises(error):
        engine.step()
    behaviour["bad"] = False
    finish(workload, engine, [])


def queued(block_size: int, source: object, k: int) -> tuple[Workload, PagedAttentionEngine]:
    """The fixed workload's requests, all added to a speculative engine."""
    workload = fixed_workload(block_size, True)
    engine = workload.engine(draft_source=source, num_speculative_tokens=k)
    for request in workload.requests:
        engine.add_request(list(request.prompt), request.max_new_tokens, n=request.n)
    return workload, engine


def finish(workload: Workload, engine: PagedAttentionEngine, outputs: list) -> None:
    """Step the engine to the end: the greedy tokens, and every block freed."""
    while engine.has_unfinished_requests():
        outputs += engine.step().finished
    outputs.sort(key=lambda out: out.request_id)
    check_against_oracle(workload, Run(engine, outputs))
    check_all_freed(engine)


@pytest.mark.parametrize("where", ["model", "truncate", "update"])
def test_a_failed_speculative_step_loses_nothing(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in verify, rollback or update undoes the step's drafts; the engine then finishes."""
    workload, engine = queued(3, oracle, 3)
    target, name = {"model": (engine.model, "forward"), "truncate": (engine.store, "truncate"),
                    "update": (engine.scheduler, "update")}[where]  # fmt: skip
    original = getattr(target, name)
    fired = []

    def faulty(*args: object, **kwargs: object) -> object:
        ours = where != "model" or any(isinstance(a, PagedStep) for a in args)  # not the oracle's
        if ours and len(engine.metrics) == 2 and not fired:  # the third step: drafts verified
            fired.append(True)
            raise RuntimeError("injected")
        return original(*args, **kwargs)

    monkeypatch.setattr(target, name, faulty)
    outputs = engine.step().finished + engine.step().finished
    tokens = [list(seq.tokens) for seq in engine.scheduler.running]
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert fired
    running = engine.scheduler.running
    assert [seq.tokens for seq in running] == tokens  # the drafts left the tokens,
    assert engine.store.token_counts_of(None) == [len(t) for t in tokens]  # and the tables
    finish(workload, engine, outputs)


# Planted bugs in a copy of the engine; each fails one of the checks above.
VERIFY = "PagedAttentionEngine._verify"
KEPT = "kept = accepted_drafts(guess, greedy, seq.eos_token_id)"
ENGINE_BUGS = {
    "every draft is kept": (VERIFY, KEPT, "kept = len(guess)"),
    "an end-of-sequence draft is kept": (
        VERIFY, KEPT, "kept = accepted_drafts(guess, greedy, None)"),
    "the bonus token is the first draft's greedy token": (
        VERIFY, "sampled.append(greedy[kept])", "sampled.append(greedy[0])"),
}  # fmt: skip
# Planted bugs in a copy of pagedkv.impl.serving.speculative or of the scheduler's draft calls.
SPECULATIVE_BUGS = {
    "speculation silently off": (
        speculative_module, "draft",
        "if guess:\n    drafts[seq.seq_id] = guess\n    budget -= len(guess)", "pass"),
    "the rejected drafts keep their slots": (
        scheduler_module, "Scheduler.keep_drafts",
        "cast(DraftStore, self.store).truncate(list(kept), [end for _, end in kept.values()])",
        "pass"),
    "a failed step keeps its drafts' slots": (
        scheduler_module, "Scheduler.undo_drafts",
        "cast(DraftStore, self.store).undo_growth(list(before), [e for _, e in before.values()])",
        "pass"),
}  # fmt: skip
CAUGHT = {  # bug -> the failure that catches it: the greedy tokens, else as commented
    **dict.fromkeys(ENGINE_BUGS, (AssertionError, r"paged .* != dense")),
    "speculation silently off": (AssertionError, None),  # the draft count
    "a failed step keeps its drafts' slots": (AssertionError, None),  # the tables after it
    # The kept slots give the next step more positions than tokens: its kernels refuse them.
    "the rejected drafts keep their slots": (ValueError, "positions must have shape"),
}


@pytest.mark.parametrize("bug", sorted(CAUGHT))
def test_planted_engine_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug in ENGINE_BUGS:
        mutant = load_mutant(engine_module, *ENGINE_BUGS[bug], ("RequestOutput", "StepOutput"))
        monkeypatch.setattr(engine_cases, "PagedAttentionEngine", mutant.PagedAttentionEngine)
    elif SPECULATIVE_BUGS[bug][0] is speculative_module:
        monkeypatch.setattr(engine_module, "speculative", load_mutant(*SPECULATIVE_BUGS[bug]))
    else:
        mutant = load_mutant(*SPECULATIVE_BUGS[bug], ("RequestTooLargeError",))
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    error, words = CAUGHT[bug]
    with pytest.raises(error, match=words):
        for source in SOURCES:
            test_speculative_decoding_is_greedy_decoding(source, 4, True, 3)
        test_an_end_of_sequence_draft_ends_the_output()
        for where in ("model", "update"):
            test_a_failed_speculative_step_loses_nothing(where, monkeypatch)
