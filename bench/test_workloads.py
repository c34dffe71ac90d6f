"""The traces: seeded, shaped as documented, with the paper's mean lengths."""

from __future__ import annotations

import numpy as np
import pytest

from bench.paper import FIG11_MEAN_LENGTHS
from bench.workloads import (
    ALPACA_INPUT,
    OPT_MAX_LEN,
    SHAREGPT_OUTPUT,
    WORKLOADS,
    LengthDistribution,
    Request,
    Workload,
    alpaca_like,
    chapter_toy,
    parallel_sampling,
    poisson_arrivals,
    shared_prefix,
    sharegpt_like,
)


def mean_lengths(workload: Workload) -> tuple[float, float]:
    prompts = [r.prompt_len for r in workload.requests]
    outputs = [o for r in workload.requests for o in r.output_lens]
    return float(np.mean(prompts)), float(np.mean(outputs))


@pytest.mark.parametrize(("make", "name"), [(sharegpt_like, "sharegpt"), (alpaca_like, "alpaca")])
@pytest.mark.parametrize("num_requests", [200, 1000])
def test_traces_have_the_papers_mean_lengths(make, name: str, num_requests: int) -> None:
    mean_input, mean_output = mean_lengths(make(num_requests))
    paper_input, paper_output = FIG11_MEAN_LENGTHS[name]
    assert mean_input == pytest.approx(paper_input, rel=0.01)
    assert mean_output == pytest.approx(paper_output, rel=0.01)


def test_sharegpt_is_long_tailed_and_alpaca_is_short() -> None:
    sharegpt, alpaca = sharegpt_like(1000), alpaca_like(1000)
    outputs = np.array([r.output_lens[0] for r in sharegpt.requests])
    assert np.median(outputs) < 0.85 * outputs.mean()  # right-skewed
    assert outputs.max() > 2.5 * outputs.mean()  # a tail
    assert max(max(r.final_lens) for r in sharegpt.requests) <= OPT_MAX_LEN
    assert max(r.prompt_len for r in alpaca.requests) < max(r.prompt_len for r in sharegpt.requests)


def test_truncated_mean_is_calibrated() -> None:
    for distribution in (ALPACA_INPUT, SHAREGPT_OUTPUT):
        assert distribution.truncated_mean(distribution.mu) == pytest.approx(distribution.mean)
    with pytest.raises(ValueError, match="strictly inside"):
        _ = LengthDistribution(mean=2000, sigma=1.0).mu


def test_traces_are_seeded() -> None:
    assert sharegpt_like(50, seed=3) == sharegpt_like(50, seed=3)
    assert sharegpt_like(50, seed=3) != sharegpt_like(50, seed=4)
    for name, make in WORKLOADS.items():
        assert make() == make()
        assert make().name == name  # the report joins benchmarks and traces by this name


def test_chapter_toy() -> None:
    toy = chapter_toy()
    assert len(toy) == 8 and toy.max_len == 50
    assert {r.kv_lens for r in toy.requests} == {(30,)}
    assert {r.arrival for r in toy.requests} == {0}


def test_shared_prefix_and_parallel_sampling() -> None:
    prefixed = shared_prefix(100, system_prompt_len=200)
    assert prefixed.system_prompt_len == 200
    assert all(r.prompt_len > 200 for r in prefixed.requests)
    sampled = parallel_sampling(50, samples=3)
    assert {r.num_samples for r in sampled.requests} == {3}
    assert sampled.num_sequences == 150
    assert len({r.output_lens for r in sampled.requests}) > 1


def test_poisson_arrivals() -> None:
    rng = np.random.default_rng(0)
    arrivals = poisson_arrivals(2000, 0.5, rng)
    assert arrivals == sorted(arrivals)
    assert 2000 / arrivals[-1] == pytest.approx(0.5, rel=0.1)
    assert poisson_arrivals(3, None, rng) == [0, 0, 0]
    assert sharegpt_like(20, rate=0.1).requests[-1].arrival > 0
    with pytest.raises(ValueError, match="positive"):
        poisson_arrivals(3, 0.0, rng)


def test_requests_and_workloads_are_validated() -> None:
    with pytest.raises(ValueError, match="at least one sample"):
        Request(0, 0, 5, ())
    with pytest.raises(ValueError, match=">= 1"):
        Request(0, 0, 0, (3,))
    with pytest.raises(ValueError, match="longer than max_len"):
        Workload("w", (Request(0, 0, 40, (20,)),), 50, "too long")
    with pytest.raises(ValueError, match="no tokens after the prefix"):
        Workload("w", (Request(0, 0, 10, (5,)),), 50, "prefix only", system_prompt_len=10)
