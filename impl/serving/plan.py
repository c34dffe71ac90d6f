"""One step's plan: the limits it keeps (:class:`SchedulerConfig`), :class:`SchedulerOutput`,
what ``Scheduler.schedule`` asks the caller to compute, as arrays with one row per scheduled
sequence, the rule for the tokens the caller samples from it (:func:`check_sampled`), and the
drafted rows of a speculative step (:data:`Drafted`)."""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.serving.sequence import Sequence
from pagedkv.spec.block_manager import check_int
from pagedkv.spec.checks import INT64_MAX, check_tokens


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits: sequences running at once (each sample counts), tokens computed per step, and
    the free blocks an admission must leave for running sequences to grow into; and the model's
    sliding window (``None``: full attention), whose blocks outside it are released."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    watermark_blocks: int = 0
    sliding_window: int | None = None
    max_model_len: int | None = None  # the longest prompt plus output served; None: no limit

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("watermark_blocks", self.watermark_blocks, 0)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)


Drafted = dict[int, tuple[int, int]]
"""Drafted sequences by id: each one's row in the plan, and an end (its tokens before its drafts,
or those it keeps)."""


@dataclass(frozen=True)
class Sampled:
    """A step's sampled tokens, checked (:func:`check_sampled`): flat, and each sampling
    sequence's first one, as its position in ``tokens`` and as the token."""

    tokens: abc.Sequence[int]
    firsts: abc.Sequence[int]
    first_tokens: NDArray[np.int64]


def check_sampled(sampled: object, per_seq: NDArray[np.int64]) -> Sampled:
    """Rule: a step's sampled tokens are a list or tuple of non-negative ints, or a 1-D integer
    array of them, each at most int64's largest, ``per_seq[i]`` of them for sampling sequence
    ``i`` in turn (``TypeError``/``ValueError`` otherwise)."""
    if isinstance(sampled, np.ndarray):
        if sampled.ndim != 1 or sampled.dtype.kind not in "iu":
            raise TypeError(f"sampled tokens must be a 1-D integer array, got {sampled.dtype}")
        if sampled.size and sampled.min() < 0:
            check_tokens(sampled.tolist())  # the ValueError naming the token
        tokens = sampled.tolist()
    else:
        tokens = check_tokens(sampled)
    if tokens and max(tokens) > INT64_MAX:
        raise ValueError(f"sampled token {max(tokens)} exceeds int64's largest, {INT64_MAX}")
    array = np.array(tokens, dtype=np.int64)
    expected = int(per_seq.sum())
    if len(tokens) != expected:
        raise ValueError(f"the step samples {expected} tokens, got {len(tokens)}")
    if expected == len(per_seq):  # no sequence forks
        return Sampled(tokens, range(expected), array)
    firsts = (np.cumsum(per_seq) - per_seq).tolist()
    return Sampled(tokens, firsts, array[firsts])


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` to compute this step, from position ``start``: one row
    of a :class:`SchedulerOutput`, as an object (:meth:`SchedulerOutput.items`)."""

    seq: Sequence
    start: int
    num_tokens: int
    cached_tokens: int = 0  # prefix-cache hits when admitted this step
    samples: bool = True  # the step computes the sequence's last known token: it samples

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan as arrays, one row per scheduled sequence, in batch order (running
    sequences first, then new admissions): row ``b`` computes ``num_tokens[b]`` tokens of
    ``seqs[b]`` from position ``starts[b]``, of which ``cached_tokens[b]`` leading ones were
    prefix-cache hits when it was admitted this step; ``samples[b]`` says whether the row
    computes the sequence's last known token, so its logits give the next one (false for a
    prompt chunk short of the end). Also the sequences preempted while making it (already back
    in the waiting queue, in the order they were preempted), and those admitted (the batch's
    last ``len(admitted)`` rows). The arrays are int64 (``samples`` bool) and read-only."""

    seqs: list[Sequence]
    seq_ids: NDArray[np.int64]
    starts: NDArray[np.int64]
    num_tokens: NDArray[np.int64]
    cached_tokens: NDArray[np.int64]
    samples: NDArray[np.bool_]
    preempted: list[Sequence]
    admitted: list[Sequence]

    def __post_init__(self) -> None:
        for array in (self.seq_ids, self.starts, self.num_tokens, self.cached_tokens):
            array.flags.writeable = False
        self.samples.flags.writeable = False

    @property
    def ends(self) -> NDArray[np.int64]:
        """One past each row's last computed position."""
        return self.starts + self.num_tokens

    @property
    def num_batched_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def prefix_hit_tokens(self) -> int:
        return int(self.cached_tokens.sum())

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences of the rows that sample, in batch order: ``update`` takes their
        sampled tokens in this order."""
        return [self.seqs[i] for i in np.flatnonzero(self.samples).tolist()]

    def items(self) -> list[ScheduledSeq]:
        """The rows as objects, in batch order (for readers, not the step's hot path)."""
        return [
            ScheduledSeq(seq, start, count, cached, samples)
            for seq, start, count, cached, samples in zip(
                self.seqs, self.starts.tolist(), self.num_tokens.tolist(),
                self.cached_tokens.tolist(), self.samples.tolist(), strict=True,
            )
        ]  # fmt: skip


def step_plan(
    visited: list[Sequence],
    visited_ids: NDArray[np.int64],
    starts: NDArray[np.int64],
    counts: NDArray[np.int64],
    samples: NDArray[np.bool_],
    preempted: list[Sequence],
    admitted: list[Sequence],
    planned: list[tuple[int, int, bool]],
) -> SchedulerOutput:
    """The plan of a step that computes ``counts[i]`` tokens of running sequence ``visited[i]``
    (id ``visited_ids[i]``) from ``starts[i]`` (``samples[i]``: whether it samples), then of
    each ``admitted`` sequence its ``planned`` first position (its prefix-cache hits), tokens
    and whether it samples."""
    seqs, hits, seq_ids = visited + admitted, np.zeros(len(visited), np.int64), visited_ids
    if planned:
        seq_ids = np.append(seq_ids, [seq.seq_id for seq in admitted])
        new_starts, new_counts, new_samples = map(list, zip(*planned, strict=True))
        starts = np.append(starts, new_starts)
        counts = np.append(counts, new_counts)
        hits = np.append(hits, new_starts)  # an admission starts at its hits
        samples = np.append(samples, new_samples)
    return SchedulerOutput(seqs, seq_ids, starts, counts, hits, samples, preempted, admitted)


@dataclass
class UpdateOutcome:
    """What the store calls of ``Scheduler.update`` did: every child made; those that run, each
    with its store row and computed tokens; the sequences that finished (in batch order:
    children born done, then their parent); and the running positions that finish."""

    children: list[Sequence] = field(default_factory=list)
    placed: list[tuple[Sequence, int, int]] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)
    finishing: list[int] = field(default_factory=list)
