"""Shared pieces of the engine properties: the tiny model, the logit tolerances, workloads, and a
driver that plays a workload's arrivals on a ``PagedAttentionEngine``.

Workloads are built to hit the hard cases often: block sizes from 1 to 256 (small ones more
often), pools only just large enough for the largest request (so running sequences preempt each
other), small token budgets (so prompts are prefilled in chunks), prompts that share system
prefixes (so the prefix cache hits), ``n`` up to 3 (so prompts fork and copy on write), greedy
and sampled requests, staggered arrivals, and an end-of-sequence token that the model really
emits.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st

from pagedkv.impl.serving.dense import DenseOutput, dense_generate
from pagedkv.impl.serving.engine import PagedAttentionEngine, RequestOutput
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.spec.block_manager import blocks_needed

CONFIG = ModelConfig()  # vocab 128, hidden 64, 2 layers, 4 query heads over 2 KV heads, dim 16
MODEL = CausalLM.from_seed(CONFIG, seed=0)

# Logits of the paged engine and of the dense oracle agree within
# |paged - dense| <= LOGIT_ATOL + LOGIT_RTOL * |dense|. Both run the same layers in fp32; they
# differ only in summation order: GEMMs over a batch of rows vs one row, a token's K/V computed
# in a prompt's prefill vs a decode step (after a preemption both happen), a cached prefix's K/V
# computed in another batch. Measured differences are about 2e-6 on logits of magnitude up to
# ~5 (standard deviation ~1); reading one wrong K/V row moves them by 1e-2 or more.
LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4


@contextmanager
def one_thread() -> Iterator[None]:
    """Run torch on one thread: the model is tiny, so more threads only add overhead (and on a
    shared two-core machine, contention that makes each op ~10x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


# Small block sizes most of the time (prefix hits need prompts longer than a block, preemption
# needs sequences that grow into new blocks), any size from 1 to 256 otherwise.
BLOCK_SIZES = st.sampled_from([1, 2, 3, 4, 5, 8, 16, 0]).flatmap(
    lambda size: st.just(size) if size else st.integers(1, 256)
)


@dataclass(frozen=True)
class Request:
    prompt: tuple[int, ...]
    max_new_tokens: int
    n: int
    temperature: float  # 0: greedy, compared token for token; else sampled, scored by teacher
    arrival: int  # the engine step before which it is added


@dataclass(frozen=True)
class Workload:
    requests: tuple[Request, ...]  # in arrival order (ties: list order)
    block_size: int
    total_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    watermark_blocks: int
    prefix_caching: bool
    eos_token_id: int | None

    def engine(self, **kwargs: object) -> PagedAttentionEngine:
        return PagedAttentionEngine(
            MODEL, self.total_blocks, self.block_size,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            watermark_blocks=self.watermark_blocks,
            enable_prefix_caching=self.prefix_caching,
            keep_logits=True, **kwargs,
        )  # fmt: skip


@lru_cache(maxsize=4096)
def greedy_oracle(prompt: tuple[int, ...], max_new_tokens: int) -> DenseOutput:
    """The dense model's greedy continuation, without an end-of-sequence token."""
    return dense_generate(MODEL, prompt, max_new_tokens)


def truncate_at_eos(tokens: list[int], eos_token_id: int | None) -> list[int]:
    if eos_token_id in tokens:
        return tokens[: tokens.index(eos_token_id) + 1]
    return tokens


@st.composite
def workloads(
    draw: st.DrawFn,
    max_requests: int = 5,
    max_new_tokens: int = 10,
    block_sizes: st.SearchStrategy[int] = BLOCK_SIZES,
    sampled: bool = True,
) -> Workload:
    """A workload (see the module docstring) that fits the pool request by request."""
    block_size = draw(block_sizes)
    token = st.integers(0, CONFIG.vocab_size - 1)
    systems = draw(st.lists(st.lists(token, min_size=3, max_size=24), min_size=1, max_size=2))
    requests = []
    for _ in range(draw(st.integers(1, max_requests))):
        prefix = draw(st.sampled_from([*systems, *systems, []]))
        suffix = draw(st.lists(token, min_size=0 if prefix else 1, max_size=8))
        requests.append(
            Request(
                prompt=tuple(prefix + suffix),
                max_new_tokens=draw(st.integers(1, max_new_tokens)),
                n=draw(st.integers(1, 3)),
                temperature=draw(st.sampled_from([0.0, 0.0, 1.0])) if sampled else 0.0,
                arrival=draw(st.sampled_from([0, 1, 2, 4, 8])),
            )
        )
    requests.sort(key=lambda r: r.arrival)  # stable: the drawn order breaks ties
    largest = max(blocks_needed(len(r.prompt) + r.max_new_tokens - 1, block_size) for r in requests)
    first = requests[0]
    emitted = greedy_oracle(first.prompt, first.max_new_tokens).tokens
    return Workload(
        requests=tuple(requests),
        block_size=block_size,
        total_blocks=largest + draw(st.integers(0, largest)),
        max_num_seqs=draw(st.integers(max(r.n for r in requests), 6)),
        max_num_batched_tokens=draw(st.sampled_from([2, 5, 16, 64, 512])),
        watermark_blocks=draw(st.integers(0, 2)),
        prefix_caching=draw(st.booleans()),
        eos_token_id=draw(st.none() | st.sampled_from(emitted)),
    )


@dataclass(frozen=True)
class Run:
    engine: PagedAttentionEngine
    outputs: list[RequestOutput]  # by the workload's request index


def run(workload: Workload, **engine_kwargs: object) -> Run:
    """Play the workload: add each request before the step numbered by its arrival, and step
    until every request finished. Checks the scheduler's limits at every step."""
    engine = workload.engine(**engine_kwargs)
    index_of: dict[int, int] = {}
    outputs: dict[int, RequestOutput] = {}
    pending = list(enumerate(workload.requests))
    steps = 0
    limit = 1000 + 50 * sum(len(r.prompt) + r.n * r.max_new_tokens for r in workload.requests)
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][1].arrival <= steps:
            index, request = pending.pop(0)
            request_id = engine.add_request(
                list(request.prompt), request.max_new_tokens, n=request.n,
                temperature=request.temperature, eos_token_id=workload.eos_token_id,
            )  # fmt: skip
            index_of[request_id] = index
        if engine.has_unfinished_requests():
            out = engine.step()
            assert out.metrics.num_batched_tokens <= workload.max_num_batched_tokens
            assert out.metrics.num_running <= workload.max_num_seqs
            for result in out.finished:
                assert result.request_id not in outputs, "a request finished twice"
                outputs[result.request_id] = result
        steps += 1
        assert steps < limit, "the engine stopped making progress"
    assert sorted(outputs) == sorted(index_of), "a request was lost"
    if currently_in_test_context():
        preempted = any(m.preemptions for m in engine.metrics)
        event(f"preempted: {'yes' if preempted else 'no'}")
        event(f"prefix hits: {'yes' if any(m.prefix_hit_tokens for m in engine.metrics) else 'no'}")
    ordered = sorted(outputs.values(), key=lambda out: index_of[out.request_id])
    return Run(engine, ordered)


def assert_logits_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(
        actual, expected, atol=LOGIT_ATOL, rtol=LOGIT_RTOL, msg=lambda m: f"{what}: {m}"
    )


def check_against_oracle(workload: Workload, result: Run) -> None:
    """Greedy samples equal the dense oracle token for token, with close logits; sampled ones
    have, at every token, the logits the dense model gives the same prefix (teacher forcing)."""
    eos = workload.eos_token_id
    for request, out in zip(workload.requests, result.outputs, strict=True):
        assert len(out.outputs) == request.n
        assert out.logits is not None
        for sample, (tokens, logits) in enumerate(zip(out.outputs, out.logits, strict=True)):
            what = f"request {request} sample {sample}"
            if request.temperature == 0.0:
                oracle = greedy_oracle(request.prompt, request.max_new_tokens)
                expected = truncate_at_eos(oracle.tokens, eos)
                assert tokens == expected, f"{what}: paged {tokens} != dense {expected}"
                assert_logits_close(logits, oracle.logits[: len(tokens)], what)
            else:
                assert len(tokens) == request.max_new_tokens or tokens[-1] == eos, what
                assert eos not in tokens[:-1], f"{what}: generated past EOS"
                forced = dense_generate(MODEL, request.prompt, 0, forced=tokens)
                assert_logits_close(logits, forced.logits, what)


def check_all_freed(engine: PagedAttentionEngine) -> None:
    """After every request finished: no table is live, every block is free (cached or not)
    with reference count 0, and the scheduler holds nothing."""
    store, manager = engine.store, engine.store.manager
    assert len(store) == 0
    assert manager.num_free_blocks == manager.total_blocks
    assert not manager.ref_counts().any()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(store.pop_copy_pairs()) == 0
