"""Shared pieces of the engine properties: the tiny model, logit tolerances, workloads drawn to
hit the hard cases often (preemption, chunking, prefix hits, forks, EOS) and a driver for them."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import lru_cache

import pytest
import torch
from hypothesis import currently_in_test_context, event
from hypothesis import strategies as st

from pagedkv.impl.serving.dense import DenseOutput, dense_generate
from pagedkv.impl.serving.engine import PagedAttentionEngine, RequestOutput
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.impl.serving.scheduler import SchedulerOutput
from pagedkv.spec.block_manager import blocks_needed
from properties.window_cases import check_window

CONFIG = ModelConfig()  # vocab 128, hidden 64, 2 layers, 4 query heads over 2 KV heads, dim 16
MODEL = CausalLM.from_seed(CONFIG, seed=0)

# |paged - dense| <= LOGIT_ATOL + LOGIT_RTOL * |dense|: both run the same fp32 layers, differing
# only in summation order (measured ~2e-6 on logits up to ~5); one wrong K/V row moves them 1e-2+.
LOGIT_ATOL = 1e-4
LOGIT_RTOL = 1e-4

FP8_FLIP = 0.25
"""Paged and dense attention sum in different orders, so with an fp8 cache a K or V value within
a rounding error of the midpoint between two codes takes either one, and the layers after it
move: in 25,554 drawn samples (2026-12-05, ``workloads()`` with an fp8 cache, numba) 89 samples'
logits moved past :data:`LOGIT_ATOL`, by up to 7.9e-3 and at most 0.090 of the format's own
error on the sequence (the fp8 oracle's logits against the fp32 oracle's, 0.024 or more). A
cache that skipped the quantization is off by all of it; a wrong block read is caught at
:data:`LOGIT_ATOL` in the drawn fp32 workloads."""


@contextmanager
def one_thread() -> Iterator[None]:
    """Torch on one thread: the model is tiny, and on a shared machine more threads contend."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="module")
def single_thread() -> Iterator[None]:
    """Import into a test module to run all its tests under :func:`one_thread`."""
    with one_thread():
        yield


# Mostly small block sizes (prefix hits and preemption need sequences of several), else 1..256.
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
    watermark_blocks: int = 0
    prefix_caching: bool = True
    eos_token_id: int | None = None
    model: CausalLM = MODEL
    kv_cache_dtype: str = "auto"  # an fp8 one: the dense oracle keeps its K/V in fp8 too
    kv_scales: tuple[float, float] | None = None  # an fp8 cache's (None: 1.0 each)

    def engine(self, **kwargs: object) -> PagedAttentionEngine:
        return PagedAttentionEngine(
            self.model, self.total_blocks, self.block_size, max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            watermark_blocks=self.watermark_blocks, enable_prefix_caching=self.prefix_caching,
            keep_logits=True, kv_cache_dtype=self.kv_cache_dtype, kv_scales=self.kv_scales,
            **kwargs,
        )  # fmt: skip

    def but(self, **changes: object) -> Workload:
        return replace(self, **changes)  # type: ignore[arg-type]


# A fixed workload sure to chunk prompts, hit prefixes, fork samples and preempt.
PRESSURE = Workload(
    tuple(
        Request((*range(40, 52), i, 2 * i + 1), 12, n=1 + i % 2, temperature=t, arrival=i)
        for i, t in enumerate([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ),
    block_size=4, total_blocks=12, max_num_seqs=6, max_num_batched_tokens=10, watermark_blocks=1,
)  # fmt: skip


@lru_cache(maxsize=4096)
def greedy_oracle(
    prompt: tuple[int, ...],
    new: int,
    model: CausalLM = MODEL,
    kv_cache_dtype: str = "auto",
    kv_scales: tuple[float, float] | None = None,
) -> DenseOutput:
    """The dense model's greedy continuation, without an end-of-sequence token."""
    scales = kv_scales or (1.0, 1.0)
    return dense_generate(model, prompt, new, kv_cache_dtype=kv_cache_dtype, kv_scales=scales)


@st.composite
def workloads(
    draw: st.DrawFn,
    max_requests: int = 5,
    max_new_tokens: int = 10,
    sampled: bool = True,
) -> Workload:
    """Shared prefixes, ``n`` <= 3, greedy and sampled, staggered, tight budgets and pools."""
    block_size = draw(BLOCK_SIZES)
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
    return Workload(
        requests=tuple(requests),
        block_size=block_size,
        total_blocks=largest + draw(st.integers(0, largest)),
        max_num_seqs=draw(st.integers(max(r.n for r in requests), 6)),
        max_num_batched_tokens=draw(st.sampled_from([2, 5, 16, 64, 512])),
        watermark_blocks=draw(st.integers(0, 2)),
        prefix_caching=draw(st.booleans()),
        kv_cache_dtype=draw(st.sampled_from(["auto", "auto", "fp8_e4m3", "fp8_e5m2"])),
        eos_token_id=draw(
            st.none() | st.sampled_from(greedy_oracle(first.prompt, first.max_new_tokens).tokens)
        ),
    )


def watch_window(engine: PagedAttentionEngine, window: int) -> list[int]:
    """:func:`check_window` after every schedule; the list gets each step's released total."""
    schedule, released = engine.scheduler.schedule, list[int]()

    def checked_schedule() -> SchedulerOutput:
        plan = schedule()
        released.append(check_window(engine.scheduler, window))
        return plan

    engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    return released


@dataclass(frozen=True)
class Run:
    engine: PagedAttentionEngine
    outputs: list[RequestOutput]  # by the workload's request index
    released: list[int] = field(default_factory=list)  # per step, with a window: watch_window's


def run(workload: Workload, **engine_kwargs: object) -> Run:
    """Play the workload, checking limits (and a window) every step; no request lost or doubled."""
    engine = workload.engine(**engine_kwargs)
    window = workload.model.config.sliding_window
    released = watch_window(engine, window) if window is not None else []
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
        event(f"preempted: {'yes' if any(m.preemptions for m in engine.metrics) else 'no'}")
        event(f"prefix hits: {'yes' if any(m.prefix_hit_tokens for m in engine.metrics) else 'no'}")
    by_index = sorted(outputs.values(), key=lambda out: index_of[out.request_id])
    return Run(engine, by_index, released)


def assert_logits_close(
    actual: torch.Tensor, expected: torch.Tensor, what: str, fp32_logits: torch.Tensor | None = None
) -> None:
    """Within the fp32 layers' tolerance; for an fp8 cache (``fp32_logits``: the same tokens' logits
    over an fp32 cache) also within :data:`FP8_FLIP` of the format's own error."""
    atol = (
        LOGIT_ATOL
        if fp32_logits is None
        else LOGIT_ATOL + FP8_FLIP * float((expected - fp32_logits).abs().max())
    )
    torch.testing.assert_close(
        actual, expected, atol=atol, rtol=LOGIT_RTOL, msg=lambda m: f"{what}: {m}"
    )


def check_against_oracle(workload: Workload, result: Run) -> None:
    """Greedy samples are the dense oracle's, with its logits; sampled: teacher-forced logits."""
    eos, fp8 = workload.eos_token_id, workload.kv_cache_dtype != "auto"
    kv = {"kv_cache_dtype": workload.kv_cache_dtype, "kv_scales": workload.kv_scales or (1.0, 1.0)}
    for request, out in zip(workload.requests, result.outputs, strict=True):
        assert len(out.outputs) == request.n
        assert out.logits is not None
        for sample, (tokens, logits) in enumerate(zip(out.outputs, out.logits, strict=True)):
            what = f"request {request} sample {sample}"
            if request.temperature == 0.0:
                oracle = greedy_oracle(
                    request.prompt, request.max_new_tokens, workload.model,
                    workload.kv_cache_dtype, workload.kv_scales,
                )  # fmt: skip
                expected = oracle.tokens
                if eos in expected:
                    expected = expected[: expected.index(eos) + 1]
                assert tokens == expected, f"{what}: paged {tokens} != dense {expected}"
                expected_logits = oracle.logits[: len(tokens)]
            else:
                assert len(tokens) == request.max_new_tokens or tokens[-1] == eos, what
                assert eos not in tokens[:-1], f"{what}: generated past EOS"
                expected_logits = dense_generate(
                    workload.model, request.prompt, 0, forced=tokens, **kv
                ).logits
            fp32 = dense_generate(workload.model, request.prompt, 0, forced=tokens) if fp8 else None
            assert_logits_close(
                logits, expected_logits, what, None if fp32 is None else fp32.logits
            )


def check_all_freed(engine: PagedAttentionEngine) -> None:
    """No table is live, every block free with reference count 0, the scheduler holds nothing."""
    store, manager = engine.store, engine.store.manager
    assert len(store) == 0
    assert manager.num_free_blocks == manager.total_blocks
    assert not manager.ref_counts().any()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert len(store.pop_copy_pairs()) == 0
