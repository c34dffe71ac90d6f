"""Seeded request traces for the utilization and serving benchmarks. Nothing is downloaded.

A :class:`Workload` is a tuple of :class:`Request` s plus the model's maximum sequence length
(what Orca-Max reserves). Every trace is a pure function of its arguments and seed.

Length distributions. The vLLM paper (Kwon et al., SOSP 2023, Fig. 11) prints the mean input
and output lengths of the tokenized datasets it serves: ShareGPT 161.31 / 337.99 tokens, Alpaca
19.31 / 58.45 (ShareGPT's inputs are 8.4x and its outputs 5.8x longer, with higher variance).
Here each length is log-normal, truncated to ``[1, 1024]`` (so ``prompt + output <= 2048``, the
OPT models' maximum), with a log-space standard deviation ``sigma`` of our choosing (the paper
gives no variance) and ``mu`` solved so that the *truncated* distribution has the paper's mean.
Lengths are drawn by stratified inverse-CDF sampling: request ``i`` gets quantile
``(i + 0.5) / n`` of a seeded permutation, inputs and outputs permuted independently. A trace of a
few hundred requests therefore has the paper's means to within a percent or two (rounding to
whole tokens included), and the long tail is present in every trace rather than only on average.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np
from numpy.typing import NDArray

from pagedkv.spec.block_manager import check_int

_NORMAL = NormalDist()

OPT_MAX_LEN = 2048
"""The OPT models' maximum sequence length: what the paper's Orca (Max) reserves per request."""


@dataclass(frozen=True)
class LengthDistribution:
    """A log-normal token length truncated to ``[low, high]``, calibrated to a target mean.

    ``mu`` is solved (bisection on the closed-form truncated mean) so that the truncated
    distribution's mean is ``mean``; ``sigma`` sets the tail.
    """

    mean: float
    sigma: float
    low: int = 1
    high: int = 1024

    def truncated_mean(self, mu: float) -> float:
        """Mean of ``exp(N(mu, sigma^2))`` conditioned on ``[low, high]`` (closed form)."""
        s, a, b = self.sigma, math.log(self.low), math.log(self.high)
        mass = _NORMAL.cdf((b - mu) / s) - _NORMAL.cdf((a - mu) / s)
        shifted = _NORMAL.cdf((b - mu - s * s) / s) - _NORMAL.cdf((a - mu - s * s) / s)
        return math.exp(mu + s * s / 2) * shifted / mass

    @functools.cached_property
    def mu(self) -> float:
        """The log-space location whose truncated mean equals ``mean``."""
        if not self.low < self.mean < self.high:
            raise ValueError(f"mean {self.mean} must lie strictly inside [{self.low}, {self.high}]")
        lo, hi = math.log(self.low) - 10 * self.sigma, math.log(self.high) + 10 * self.sigma
        for _ in range(200):  # the truncated mean increases with mu
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.truncated_mean(mid) < self.mean else (lo, mid)
        return (lo + hi) / 2

    def sample(self, n: int, rng: np.random.Generator) -> NDArray[np.int64]:
        """``n`` lengths: the stratified quantiles ``(i + 0.5) / n`` in a seeded random order."""
        check_int("n", n, 0)
        s, mu = self.sigma, self.mu
        cdf_low = _NORMAL.cdf((math.log(self.low) - mu) / s)
        cdf_high = _NORMAL.cdf((math.log(self.high) - mu) / s)
        quantiles = (rng.permutation(n) + 0.5) / max(n, 1)
        lengths = [
            math.exp(mu + s * _NORMAL.inv_cdf(cdf_low + q * (cdf_high - cdf_low)))
            for q in quantiles.tolist()
        ]
        return np.clip(np.rint(lengths), self.low, self.high).astype(np.int64)


# The paper's Fig. 11 means; the sigmas are ours (a long tail for ShareGPT, a short one for Alpaca).
SHAREGPT_INPUT = LengthDistribution(mean=161.31, sigma=1.0)
SHAREGPT_OUTPUT = LengthDistribution(mean=337.99, sigma=0.9)
ALPACA_INPUT = LengthDistribution(mean=19.31, sigma=0.6)
ALPACA_OUTPUT = LengthDistribution(mean=58.45, sigma=0.8)


@dataclass(frozen=True)
class Request:
    """One request: when it arrives, its prompt, and how many tokens each sample generates.

    ``output_lens`` has one entry per sample; more than one is parallel sampling (every sample
    continues the same prompt). A sample ends with ``prompt_len + output_len`` tokens, of which
    ``prompt_len + output_len - 1`` have K/V: the last sampled token finishes the sequence and is
    never computed (as in ``pagedkv.impl.serving.scheduler``).
    """

    request_id: int
    arrival: int
    prompt_len: int
    output_lens: tuple[int, ...]

    def __post_init__(self) -> None:
        check_int("request_id", self.request_id, 0)
        check_int("arrival", self.arrival, 0)
        check_int("prompt_len", self.prompt_len, 1)
        if not self.output_lens:
            raise ValueError("a request needs at least one sample")
        for output_len in self.output_lens:
            check_int("output_len", output_len, 1)

    @property
    def num_samples(self) -> int:
        return len(self.output_lens)

    @property
    def final_lens(self) -> tuple[int, ...]:
        """Each sample's token count when it finishes: prompt plus its output."""
        return tuple(self.prompt_len + output_len for output_len in self.output_lens)

    @property
    def kv_lens(self) -> tuple[int, ...]:
        """Each sample's K/V slots when it finishes: ``final_len - 1``."""
        return tuple(final_len - 1 for final_len in self.final_lens)


@dataclass(frozen=True)
class Workload:
    """A named trace. ``max_len`` bounds every final length (what Orca-Max reserves).

    ``system_prompt_len > 0`` means every request's prompt starts with the same
    ``system_prompt_len`` tokens (one system prompt for many users).
    """

    name: str
    requests: tuple[Request, ...]
    max_len: int
    description: str
    system_prompt_len: int = 0

    def __post_init__(self) -> None:
        check_int("max_len", self.max_len, 1)
        check_int("system_prompt_len", self.system_prompt_len, 0)
        for request in self.requests:
            if max(request.final_lens) > self.max_len:
                raise ValueError(f"request {request.request_id} is longer than max_len")
            if request.prompt_len <= self.system_prompt_len:
                raise ValueError(f"request {request.request_id} has no tokens after the prefix")

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def num_sequences(self) -> int:
        """Sequences the trace runs: one per sample."""
        return sum(request.num_samples for request in self.requests)


def poisson_arrivals(n: int, rate: float | None, rng: np.random.Generator) -> list[int]:
    """Arrival steps of ``n`` requests: a Poisson process of ``rate`` requests per step,
    or all at step 0 when ``rate`` is None (a saturated queue)."""
    if rate is None:
        return [0] * n
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    return np.floor(np.cumsum(rng.exponential(1 / rate, n))).astype(np.int64).tolist()


def _trace(
    name: str,
    description: str,
    prompts: NDArray[np.int64],
    outputs: NDArray[np.int64],
    rate: float | None,
    rng: np.random.Generator,
    max_len: int = OPT_MAX_LEN,
    system_prompt_len: int = 0,
) -> Workload:
    """A workload from per-request prompt lengths and per-request rows of sample lengths."""
    outputs = outputs.reshape(len(prompts), -1)
    arrivals = poisson_arrivals(len(prompts), rate, rng)
    requests = tuple(
        Request(i, arrival, prompt, tuple(samples))
        for i, (arrival, prompt, samples) in enumerate(
            zip(arrivals, prompts.tolist(), outputs.tolist(), strict=True)
        )
    )
    return Workload(name, requests, max_len, description, system_prompt_len)


def sharegpt_like(num_requests: int = 500, seed: int = 0, rate: float | None = None) -> Workload:
    """ShareGPT-like conversations: mean input ~161, output ~338 tokens, long tails."""
    rng = np.random.default_rng([seed, 1])
    return _trace(
        "sharegpt",
        "ShareGPT-like: log-normal input (mean 161.31, sigma 1.0) and output (mean 337.99, "
        "sigma 0.9), each truncated to [1, 1024]",
        SHAREGPT_INPUT.sample(num_requests, rng),
        SHAREGPT_OUTPUT.sample(num_requests, rng),
        rate,
        rng,
    )


def alpaca_like(num_requests: int = 500, seed: int = 0, rate: float | None = None) -> Workload:
    """Alpaca-like instructions: mean input ~19, output ~58 tokens."""
    rng = np.random.default_rng([seed, 2])
    return _trace(
        "alpaca",
        "Alpaca-like: log-normal input (mean 19.31, sigma 0.6) and output (mean 58.45, "
        "sigma 0.8), each truncated to [1, 1024]",
        ALPACA_INPUT.sample(num_requests, rng),
        ALPACA_OUTPUT.sample(num_requests, rng),
        rate,
        rng,
    )


CHAPTER_REQUESTS, CHAPTER_PROMPT, CHAPTER_OUTPUT, CHAPTER_MAX_LEN = 8, 10, 21, 50
CHAPTER_KV_SLOTS = 400
"""The chapter's ``total_kv_slots``: 8 reservations of 50 fill it."""


def chapter_toy() -> Workload:
    """The design chapter's toy: 8 requests that each use 30 K/V slots of a 50-token maximum.

    The chapter gives only the totals; the split into a 10-token prompt and 21 output tokens
    (the last of which is never computed, see :class:`Request`) is ours. All arrive at step 0.
    """
    requests = tuple(
        Request(i, 0, CHAPTER_PROMPT, (CHAPTER_OUTPUT,)) for i in range(CHAPTER_REQUESTS)
    )
    return Workload(
        "chapter",
        requests,
        CHAPTER_MAX_LEN,
        "the chapter's toy: 8 requests holding 30 K/V slots (prompt 10 + output 21), max 50",
    )


def shared_prefix(
    num_requests: int = 500,
    system_prompt_len: int = 200,
    seed: int = 0,
    rate: float | None = None,
) -> Workload:
    """One system prompt for many users: each prompt is ``system_prompt_len`` shared tokens
    followed by an Alpaca-like question, answered with an Alpaca-like output."""
    check_int("system_prompt_len", system_prompt_len, 1)
    rng = np.random.default_rng([seed, 3])
    user = ALPACA_INPUT.sample(num_requests, rng)
    return _trace(
        f"prefix{system_prompt_len}",
        f"shared prefix: a {system_prompt_len}-token system prompt, then Alpaca-like "
        "input and output",
        system_prompt_len + user,
        ALPACA_OUTPUT.sample(num_requests, rng),
        rate,
        rng,
        system_prompt_len=system_prompt_len,
    )


def parallel_sampling(
    num_requests: int = 200,
    samples: int = 4,
    base: str = "alpaca",
    seed: int = 0,
    rate: float | None = None,
) -> Workload:
    """Parallel sampling: ``samples`` outputs per prompt, each its own length drawn from the
    base dataset's output distribution (``base`` is ``"alpaca"`` or ``"sharegpt"``)."""
    check_int("samples", samples, 1)
    inputs, outputs = {
        "alpaca": (ALPACA_INPUT, ALPACA_OUTPUT),
        "sharegpt": (SHAREGPT_INPUT, SHAREGPT_OUTPUT),
    }[base]
    rng = np.random.default_rng([seed, 4, samples])
    return _trace(
        f"{base}-n{samples}",
        f"parallel sampling: {samples} samples per {base}-like prompt, each with its own "
        f"{base}-like output length",
        inputs.sample(num_requests, rng),
        outputs.sample(num_requests * samples, rng),
        rate,
        rng,
    )


WORKLOADS: dict[str, Callable[[], Workload]] = {
    "sharegpt": functools.partial(sharegpt_like, 200),
    "alpaca": functools.partial(alpaca_like, 500),
    "chapter": chapter_toy,
    "prefix200": functools.partial(shared_prefix, 500),
    "alpaca-n4": functools.partial(parallel_sampling, 100),
}
"""The benchmark suite's workloads, by name. The sizes keep a simulated run of each within a few
seconds (its cost is one scheduler call per sequence per step); stratified sampling keeps even
200 ShareGPT-like requests within 0.1% of the paper's means."""
