"""The vLLM paper's KV-cache allocation policies, and where their memory goes over a trace.

Policies (Kwon et al., SOSP 2023, §6.1; the contiguous three are the paper's Orca baselines):

* **Orca (Max)** reserves the model's maximum sequence length (``max_len``) per sequence.
* **Orca (Pow2)** reserves the prompt plus the next power of two of the true output length
  ("over-reserves the space for outputs by at most 2x: if the true output length is 25, it
  reserves 32 positions"), capped at ``max_len``.
* **Orca (Oracle)** reserves exactly the slots the sequence will fill, ``prompt + output - 1``
  (the last sampled token is never computed), which no real system knows in advance.
* **Paged** (vLLM) holds ``blocks_needed(count, block_size)`` blocks, the spec's rule, growing a
  block at a time.

A contiguous policy reserves at admission and never grows; a paged one grows with its tokens.

Lifetime accounting (:func:`lifetime_breakdown`). A sequence with prompt ``p`` and output ``o`` is
alive for ``o`` steps, as ``pagedkv.impl.serving.scheduler`` runs it without preemption: after step
``j`` (``j = 0`` is the prefill, which samples the first output token) the cache holds ``p + j``
tokens, ending at ``L = p + o - 1`` (the last sampled token finishes the sequence uncomputed). Each
step, the slots ``A`` allocated to it split into

* **token states** ``p + j``: slots holding a token's K/V;
* **reservation** ``min(A, L) - (p + j)``: slots it will fill later, idle until then;
* **internal fragmentation** ``A - min(A, L)``: slots it will never fill (the unfilled tail of
  a paged sequence's last block; everything past ``L`` of a contiguous reservation).

Summed over every step of every sequence's life (slot-steps), these give the share of
allocated KV memory that holds token states, independently of scheduling: the static
counterpart of what ``bench/simulator.py`` measures under a memory budget. Samples of a
parallel-sampling request and shared system prompts are counted as independent sequences here
(no sharing); the simulator measures sharing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
from numpy.typing import NDArray

from bench.workloads import Workload
from pagedkv.spec.block_manager import blocks_needed, check_int

IntArray = NDArray[np.int64]

PAPER_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def next_power_of_two(values: IntArray) -> IntArray:
    """The smallest power of two ``>= v`` for each ``v >= 1`` (exact: ``frexp`` of ``v - 1``)."""
    values = np.asarray(values, dtype=np.int64)
    if values.size and values.min() < 1:
        raise ValueError("next_power_of_two needs values >= 1")
    return np.left_shift(1, np.frexp(values - 1)[1].astype(np.int64))


class Policy(Protocol):
    """How many KV slots a sequence holds, as a function of where it is in its life."""

    @property
    def name(self) -> str: ...

    @property
    def label(self) -> str: ...

    def allocated_slots(
        self, prompt: IntArray, output: IntArray, count: IntArray, max_len: int
    ) -> IntArray:
        """Slots held by sequences of these prompt/output lengths when they hold ``count``
        tokens (arrays broadcast together)."""
        ...


CONTIGUOUS_LABELS = {"max": "Orca (Max)", "pow2": "Orca (Pow2)", "oracle": "Orca (Oracle)"}


@dataclass(frozen=True)
class Contiguous:
    """A contiguous reservation made at admission: ``kind`` is ``max``, ``pow2`` or ``oracle``."""

    kind: str

    def __post_init__(self) -> None:
        if self.kind not in CONTIGUOUS_LABELS:
            raise ValueError(f"unknown contiguous policy {self.kind!r}")

    @property
    def name(self) -> str:
        return f"orca-{self.kind}"

    @property
    def label(self) -> str:
        return CONTIGUOUS_LABELS[self.kind]

    def reservation(self, prompt: IntArray, output: IntArray, max_len: int) -> IntArray:
        """Slots reserved at admission for sequences of these prompt and output lengths."""
        prompt, output = np.asarray(prompt, np.int64), np.asarray(output, np.int64)
        if self.kind == "max":
            return np.full(np.broadcast(prompt, output).shape, max_len, dtype=np.int64)
        if self.kind == "pow2":
            return np.minimum(prompt + next_power_of_two(output), max_len)
        return prompt + output - 1

    def allocated_slots(
        self, prompt: IntArray, output: IntArray, count: IntArray, max_len: int
    ) -> IntArray:
        reserved = self.reservation(prompt, output, max_len)
        return np.broadcast_to(reserved, np.broadcast(reserved, count).shape)


@dataclass(frozen=True)
class Paged:
    """Paged allocation (vLLM): ``blocks_needed(count, block_size)`` blocks, grown on demand."""

    block_size: int = 16

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)

    @property
    def name(self) -> str:
        return f"paged-bs{self.block_size}"

    @property
    def label(self) -> str:
        return f"paged, block {self.block_size}"

    def allocated_slots(
        self, prompt: IntArray, output: IntArray, count: IntArray, max_len: int
    ) -> IntArray:
        return blocks_needed(np.asarray(count, np.int64), self.block_size) * self.block_size


PAPER_CONTIGUOUS: tuple[Contiguous, ...] = tuple(Contiguous(kind) for kind in CONTIGUOUS_LABELS)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Where KV memory goes, in slots (or slot-steps when summed over time).

    ``unallocated`` is budget nobody holds (the simulator's; 0 for lifetime accounting). The
    paper's Fig. 2 splits memory the same way, except that its last bar, "external
    fragmentation & others", also holds the buddy allocator's holes, which no policy here has.
    """

    token_states: int
    reservation: int
    internal_fragmentation: int
    unallocated: int = 0

    @property
    def allocated(self) -> int:
        """Slots held by sequences."""
        return self.token_states + self.reservation + self.internal_fragmentation

    @property
    def total(self) -> int:
        return self.allocated + self.unallocated

    @property
    def utilization(self) -> float:
        """Share of allocated slots that hold token states (1.0 when nothing is allocated)."""
        return self.token_states / self.allocated if self.allocated else 1.0

    def shares(self) -> dict[str, float]:
        """Each part as a fraction of ``total`` (the paper's Fig. 2 bars)."""
        total = self.total or 1
        return {
            "token_states": self.token_states / total,
            "reservation": self.reservation / total,
            "internal_fragmentation": self.internal_fragmentation / total,
            "unallocated": self.unallocated / total,
        }


def sequence_lengths(workload: Workload) -> tuple[IntArray, IntArray]:
    """Prompt and output length of every sequence (one per sample), in request order."""
    prompts = [r.prompt_len for r in workload.requests for _ in r.output_lens]
    outputs = [o for r in workload.requests for o in r.output_lens]
    return np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64)


def split_slots(
    allocated: IntArray, counts: IntArray, final_lens: IntArray
) -> tuple[int, int, int]:
    """``(token_states, reservation, internal_fragmentation)`` of sequences holding
    ``allocated`` slots and ``counts`` tokens, which will end holding ``final_lens`` tokens."""
    if (allocated < counts).any():
        raise ValueError("a sequence holds fewer slots than tokens")
    will_fill = np.minimum(allocated, final_lens)
    return (
        int(counts.sum()),
        int((will_fill - counts).sum()),
        int((allocated - will_fill).sum()),
    )


def lifetime_breakdown(workload: Workload, policy: Policy) -> MemoryBreakdown:
    """Slot-steps of every sequence's life under ``policy`` (see the module docstring)."""
    prompts, steps = sequence_lengths(workload)  # a sequence lives one step per output token
    starts = np.cumsum(steps) - steps
    prompt, output = np.repeat(prompts, steps), np.repeat(steps, steps)
    counts = prompt + np.arange(int(steps.sum())) - np.repeat(starts, steps)
    allocated = policy.allocated_slots(prompt, output, counts, workload.max_len)
    return MemoryBreakdown(*split_slots(allocated, counts, prompt + output - 1))
