"""A serving simulator: discrete steps, no model, impl's scheduler and block tables.

Each step calls :meth:`pagedkv.impl.serving.scheduler.Scheduler.schedule`, pretends the model
computed the scheduled tokens and sampled the next ones (the trace says how long each sample is),
calls :meth:`~pagedkv.impl.serving.scheduler.Scheduler.update`, and measures where the KV memory
went. The KV budget is fixed, in slots. Memory is one of:

* **paged**: :class:`pagedkv.impl.blocks.store.BlockTableStore` over ``budget_slots //
  block_size`` blocks of an :class:`pagedkv.impl.blocks.manager.BlockManager` (with ``share=True``,
  a :class:`pagedkv.impl.blocks.prefix_cache.PrefixCachingBlockManager`: a shared system prompt is
  served from the prefix cache, and parallel samples fork the prompt's blocks);
* **contiguous** (the paper's Orca baselines): :class:`ContiguousStore`, which offers the
  scheduler the same methods but reserves a policy's slots per sequence at admission and never
  grows. Contiguous memory cannot be shared, so every sample runs as its own request.

The same :class:`~pagedkv.impl.serving.scheduler.Scheduler` drives all of them: FCFS admission under
the token budget, ``max_num_seqs`` and (paged) the watermark, chunked prefill, and preemption of the
most recently admitted sequence by recompute. Only the memory differs.

Token ids mean nothing to the scheduler except as prefix-cache keys, so the simulator uses them
to name sequences: the system prompt is tokens ``1..P``; every other token of sample ``s`` of
request ``r`` is :meth:`TokenCodec.token` ``(r, s)``; ``EOS`` (0) ends a sample when it reaches
its output length. Samples' tokens differ, so a preempted sample re-admitted with its output
never hits another sample's blocks in the prefix cache.

Measurements, per step, of the memory while the step computes (after ``schedule``, before ``update``
frees the sequences it finishes): the batch (sequences computed), tokens computed, preemptions, and
a :class:`bench.utilization_policies.MemoryBreakdown` of the budget: token states (slots whose K/V
exist once the step has run), reservation (slots a sequence will still fill), internal fragmentation
(slots it never will), unallocated. Without preemption a sequence is measured exactly as
``lifetime_breakdown`` accounts it. Blocks shared by several tables count once; their token states
are ``pagedkv.impl.serving.metrics.kv_occupancy``'s filled slots. Summaries average over the
**saturated** steps, those in which an arrived request waits: there memory, not arrivals, bounds the
batch, which is the regime the paper's batch-size comparison is about. Idle steps (nothing arrived
yet) are skipped and not counted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from bench.utilization_policies import Contiguous, MemoryBreakdown, Paged, split_slots
from bench.workloads import Request, Workload
from pagedkv.impl.blocks.manager import BlockManager, OutOfBlocksError
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving.metrics import kv_occupancy
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pagedkv.impl.serving.scheduler import Sequence as Seq
from pagedkv.spec.block_manager import blocks_needed, check_int

EOS = 0

OPT_13B_KV_SLOTS = 15_616
"""KV budget of the paper's OPT-13B on one A100-40GB: Table 1 gives ~15.7K token slots (12 GB at
800 KB per token); 15,616 = 61 x 256 divides into whole blocks of every size up to 256."""


@dataclass(frozen=True)
class ServingConfig:
    """The simulated server: KV budget in slots and the scheduler's limits.

    ``watermark`` is the fraction of paged blocks an admission must leave free (vLLM's
    default 1%); contiguous reservations never grow, so they need none.
    """

    budget_slots: int = OPT_13B_KV_SLOTS
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    watermark: float = 0.01

    def __post_init__(self) -> None:
        check_int("budget_slots", self.budget_slots, 1)
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must lie in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class TokenCodec:
    """The simulator's token ids (see the module docstring)."""

    system_prompt_len: int
    max_samples: int

    def token(self, request_id: int, sample: int) -> int:
        """Every prompt token after the system prompt, and every output token, of a sample."""
        return 1 + self.system_prompt_len + request_id * self.max_samples + sample

    def sample_of(self, tokens: Sequence[int]) -> tuple[int, int]:
        """``(request_id, sample)`` of an unfinished sequence, from its last token."""
        return divmod(tokens[-1] - 1 - self.system_prompt_len, self.max_samples)

    def prompt(self, request: Request, sample: int) -> list[int]:
        system = list(range(1, self.system_prompt_len + 1))
        return system + [self.token(request.request_id, sample)] * (
            request.prompt_len - self.system_prompt_len
        )


class ContiguousStore:
    """Contiguous KV regions, one per sequence, behind the scheduler's
    :class:`pagedkv.impl.serving.block_store.BlockStore` protocol (``fork`` raises: contiguous
    memory cannot be shared). A "block" is one slot.

    ``add_prompt`` reserves ``reservation_of(tokens)`` slots at once; ``grow`` only moves the
    token count inside the reservation. A growth past it means the policy under-reserved, which
    is a bug, not memory pressure: it raises ``RuntimeError`` instead of asking for preemption.
    """

    block_size = 1
    prefix_caching = False

    def __init__(
        self,
        budget_slots: int,
        max_seqs: int,
        max_len: int,
        reservation_of: Callable[[Sequence[int]], int],
    ) -> None:
        self.total_blocks = budget_slots
        self.num_free_blocks = budget_slots
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_len
        self._reservation_of = reservation_of
        self.reserved: dict[int, int] = {}
        self.counts: dict[int, int] = {}
        self.rows: dict[int, int] = {}  # seq id -> row, in the order added
        self._free_rows = list(range(max_seqs - 1, -1, -1))

    def blocks_to_allocate(self, token_ids: Sequence[int]) -> int:
        return self._reservation_of(token_ids)

    def add_prompt(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Reserve the sequence's region and hold its prompt; nothing is ever cached (0)."""
        reserved = self._reservation_of(token_ids)
        if reserved > self.num_free_blocks:
            raise OutOfBlocksError(
                f"asked for {reserved} slots but only {self.num_free_blocks} are free"
            )
        if len(token_ids) > reserved:
            raise RuntimeError(f"sequence {seq_id} outgrows its reservation of {reserved}")
        self.num_free_blocks -= reserved
        self.reserved[seq_id] = reserved
        self.counts[seq_id] = len(token_ids)
        self.rows[seq_id] = self._free_rows.pop()
        return 0

    def admit(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        headroom: int = 0,
        extra_key: Hashable = None,
    ) -> int | None:
        """Reserve the region if at least ``headroom`` slots stay free; None otherwise (nothing
        is cached, so ``extra_key`` changes nothing)."""
        if self.num_free_blocks - self._reservation_of(token_ids) < headroom:
            return None
        return self.add_prompt(seq_id, token_ids)

    def token_count(self, seq_id: int) -> int:
        return self.counts[seq_id]

    def row(self, seq_id: int) -> int:
        return self.rows[seq_id]

    def resolve(self, seqs: None) -> LiveRows:
        return LiveRows(np.fromiter(self.rows.values(), dtype=np.intp, count=len(self.rows)))

    def token_counts_of(self, seq_ids: Sequence[int] | None) -> list[int]:
        counts = self.counts
        return list(counts.values()) if seq_ids is None else [counts[s] for s in seq_ids]

    def grow_or_preempt(
        self, seq_ids: Sequence[int] | None, new_tokens: int | Sequence[int] = 1
    ) -> list[int]:
        """A reservation always covers its sequence: nothing is ever preempted."""
        return self.grow(list(self.counts) if seq_ids is None else seq_ids, new_tokens)

    def grow(
        self, seq_ids: Sequence[int], new_tokens: int | Sequence[int] = 1, *, atomic: bool = False
    ) -> list[int]:
        """A reservation always covers its sequence, so growth never fails (``atomic`` is moot)."""
        steps = [new_tokens] * len(seq_ids) if isinstance(new_tokens, int) else list(new_tokens)
        for seq_id, step in zip(seq_ids, steps, strict=True):
            if self.counts[seq_id] + step > self.reserved[seq_id]:
                raise RuntimeError(f"sequence {seq_id} outgrows its reservation")
        for seq_id, step in zip(seq_ids, steps, strict=True):
            self.counts[seq_id] += step
        return []

    def remove(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.num_free_blocks += self.reserved.pop(seq_id)
            del self.counts[seq_id]
            self._free_rows.append(self.rows.pop(seq_id))

    def pop_copy_pairs(self) -> NDArray[np.int32]:
        """No copy-on-write pair: nothing is shared."""
        return np.empty((0, 2), dtype=np.int32)

    def fork(self, parent_id: int, child_id: int) -> None:
        """Contiguous memory cannot be shared: the simulator runs every sample as a request."""
        raise NotImplementedError("a contiguous reservation cannot be shared by a fork")

    def undo_fork(self, child_ids: Sequence[int]) -> None:
        """As ``remove`` (dict updates only); unreachable, as no fork ever succeeds here."""
        self.remove(child_ids)

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        return 0

    def release_outside_window(
        self,
        seq_ids: Sequence[int] | None,
        window: int,
        token_counts: int | Sequence[int] | None = None,
    ) -> None:
        """A contiguous region is given back only whole, at ``remove``: releases nothing."""


@dataclass(frozen=True)
class LiveRows:
    """The rows of a :class:`ContiguousStore`'s live sequences, in the order added."""

    rows: NDArray[np.intp]


Store = BlockTableStore | ContiguousStore
FloatArray = NDArray[np.float64]


@dataclass(frozen=True)
class ServingResult:
    """What a simulated run measured. ``mean_batch``, ``memory`` and ``logical_tokens`` cover
    the saturated steps (all steps if none was saturated); ``tokens_per_step``,
    ``memory_saving`` (the paper's Fig. 15 metric: blocks saved by sharing over the blocks the
    tables would hold without it) and the ``*_series`` cover every step."""

    workload: str
    policy: str
    label: str
    block_size: int | None
    shared: bool
    budget_slots: int
    steps: int
    saturated_steps: int
    finished: int
    preemptions: int
    peak_batch: int
    mean_batch: float
    tokens_per_step: float
    memory: MemoryBreakdown  # slot-steps over the window
    logical_tokens: int  # tokens as sequences see them, over the window (shared ones per owner)
    memory_saving: float  # 1 - physical / logical blocks over all steps (0 without sharing)
    batch_series: NDArray[np.int64]
    utilization_series: FloatArray  # token states / allocated slots, per step

    @property
    def utilization(self) -> float:
        """Share of allocated slots holding token states."""
        return self.memory.utilization

    @property
    def tokens_per_slot(self) -> float:
        """Logical tokens per allocated slot: above 1 only when blocks are shared."""
        return self.logical_tokens / self.memory.allocated if self.memory.allocated else 1.0

    def summary(self) -> dict[str, float | int | str | None]:
        """Every scalar, rounded for a benchmark's ``extra_info`` and the report."""
        shares = {k: round(v, 4) for k, v in self.memory.shares().items()}
        return {
            "workload": self.workload,
            "policy": self.policy,
            "label": self.label,
            "block_size": self.block_size,
            "shared": self.shared,
            "budget_slots": self.budget_slots,
            "steps": self.steps,
            "saturated_steps": self.saturated_steps,
            "finished": self.finished,
            "preemptions": self.preemptions,
            "peak_batch": self.peak_batch,
            "mean_batch": round(self.mean_batch, 2),
            "tokens_per_step": round(self.tokens_per_step, 1),
            "utilization": round(self.utilization, 4),
            "tokens_per_slot": round(self.tokens_per_slot, 4),
            "memory_saving": round(self.memory_saving, 4),
            **{f"share_{k}": v for k, v in shares.items()},
        }

    def downsampled(self, points: int = 64) -> dict[str, list[float]]:
        """Batch size and utilization averaged over ``points`` equal slices of the run."""
        slices = np.array_split(np.arange(self.steps), min(points, self.steps))
        return {
            "step": [int(s[-1]) for s in slices],
            "batch": [round(float(self.batch_series[s].mean()), 2) for s in slices],
            "utilization": [round(float(self.utilization_series[s].mean()), 4) for s in slices],
        }


def simulate(
    workload: Workload,
    policy: Paged | Contiguous,
    config: ServingConfig = ServingConfig(),
    *,
    share: bool = False,
) -> ServingResult:
    """Serve ``workload`` to completion under ``policy``; see the module docstring.

    ``share`` (paged only) turns on sharing: prefix caching and forked parallel samples.
    Raises ``ValueError`` if the budget cannot hold whole blocks or a request can never fit.
    """
    sharing = share and isinstance(policy, Paged)
    codec = TokenCodec(workload.system_prompt_len, max(r.num_samples for r in workload.requests))
    requests = {r.request_id: r for r in workload.requests}
    kv_len = {(r.request_id, s): n for r in workload.requests for s, n in enumerate(r.kv_lens)}
    store = _make_store(workload, policy, config, codec, requests, sharing)
    scheduler = Scheduler(store, _scheduler_config(policy, config))
    arrivals = deque(sorted(workload.requests, key=lambda r: (r.arrival, r.request_id)))
    records: list[tuple[int, ...]] = []
    finished = step = 0
    while arrivals or scheduler.has_unfinished():
        while arrivals and arrivals[0].arrival <= step:
            _submit(scheduler, arrivals.popleft(), codec, sharing)
        if not scheduler.has_unfinished():
            step = arrivals[0].arrival  # idle until the next arrival
            continue
        output = scheduler.schedule()
        store.pop_copy_pairs()  # an engine copies them now; their sources are then free
        records.append(_measure(scheduler, output, codec, kv_len))
        sampled = [t for seq in output.sampling for t in _sample(seq, codec, requests)]
        finished += len(scheduler.update(output, sampled)[1])
        step += 1
    if finished != workload.num_sequences:
        raise RuntimeError(f"{finished} of {workload.num_sequences} sequences finished")
    return _summarize(workload, policy, config, sharing, np.array(records), finished)


def _scheduler_config(policy: Paged | Contiguous, config: ServingConfig) -> SchedulerConfig:
    watermark = 0
    if isinstance(policy, Paged):
        watermark = int(config.watermark * (config.budget_slots // policy.block_size))
    return SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens, watermark)


def _make_store(
    workload: Workload,
    policy: Paged | Contiguous,
    config: ServingConfig,
    codec: TokenCodec,
    requests: dict[int, Request],
    sharing: bool,
) -> Store:
    if isinstance(policy, Contiguous):

        def reservation_of(tokens: Sequence[int]) -> int:
            request_id, sample = codec.sample_of(tokens)
            request = requests[request_id]
            reserved = policy.reservation(
                np.int64(request.prompt_len),
                np.int64(request.output_lens[sample]),
                workload.max_len,
            )
            return int(reserved)

        return ContiguousStore(
            config.budget_slots, config.max_num_seqs, workload.max_len, reservation_of
        )
    bs = policy.block_size
    if config.budget_slots % bs:
        raise ValueError(f"budget of {config.budget_slots} slots is not whole blocks of {bs}")
    manager_class = PrefixCachingBlockManager if sharing else BlockManager
    manager = manager_class(config.budget_slots // bs, bs)
    return BlockTableStore(manager, config.max_num_seqs, blocks_needed(workload.max_len, bs))


def _submit(scheduler: Scheduler, request: Request, codec: TokenCodec, sharing: bool) -> None:
    """Queue a request: one scheduler request with ``n`` samples when sharing, else one per
    sample (each with its own copy of the prompt)."""
    max_new = max(request.output_lens)
    if sharing:
        prompt = codec.prompt(request, 0)
        scheduler.add_request(
            request.request_id, prompt, max_new, n=request.num_samples, eos_token_id=EOS
        )
        return
    for sample, output_len in enumerate(request.output_lens):
        prompt = codec.prompt(request, sample)
        scheduler.add_request(request.request_id, prompt, output_len, eos_token_id=EOS)


def _sample(seq: Seq, codec: TokenCodec, requests: dict[int, Request]) -> list[int]:
    """The tokens "sampled" after ``seq``'s step: one per sample still to fork; ``EOS`` for a
    sample whose output is now complete."""
    request_id, first = codec.sample_of(seq.tokens)
    output_lens = requests[request_id].output_lens
    produced = seq.num_tokens - seq.prompt_len
    return [
        EOS if produced + 1 == output_lens[sample] else codec.token(request_id, sample)
        for sample in range(first, first + seq.num_samples)
    ]


def _measure(
    scheduler: Scheduler,
    output: SchedulerOutput,
    codec: TokenCodec,
    kv_len: dict[tuple[int, int], int],
) -> tuple[int, ...]:
    """The record of the step ``output`` plans: batch, tokens, waiting, preempted, the memory
    breakdown in slots, logical tokens, logical and physical blocks."""
    store = scheduler.store
    running = scheduler.running
    final = np.array([kv_len[codec.sample_of(seq.tokens)] for seq in running], dtype=np.int64)
    computed = dict(zip(output.seq_ids.tolist(), output.ends.tolist(), strict=True))
    counts = np.array([computed.get(seq.seq_id, seq.num_computed) for seq in running], np.int64)
    ids = [seq.seq_id for seq in running]
    if isinstance(store, ContiguousStore):
        allocated = np.array([store.reserved[i] for i in ids], dtype=np.int64)
        logical_blocks = physical_blocks = 0
    else:
        num_blocks = store.num_blocks[store.batch(ids).rows].astype(np.int64)
        allocated = num_blocks * store.block_size
        logical_blocks = int(num_blocks.sum())
        physical_blocks = store.total_blocks - store.num_free_blocks
    token, reservation, internal = split_slots(allocated, counts, final)
    held = int(allocated.sum())
    if physical_blocks != logical_blocks:  # shared blocks: count each once
        token, _ = kv_occupancy(store)
        held = physical_blocks * store.block_size
        # Per-sequence tails double count only a partly filled block that is still shared (a
        # forked sample whose first write has not copied it yet): cap the reservation so the
        # parts add up to the slots held.
        reservation = min(reservation, held - token)
        internal = held - token - reservation
    budget = store.total_blocks * store.block_size
    return (
        len(output.seqs),
        output.num_batched_tokens,
        len(scheduler.waiting),
        len(output.preempted),
        token,
        reservation,
        internal,
        budget - held,
        int(counts.sum()),
        logical_blocks,
        physical_blocks,
    )


def _summarize(
    workload: Workload,
    policy: Paged | Contiguous,
    config: ServingConfig,
    sharing: bool,
    records: NDArray[np.int64],
    finished: int,
) -> ServingResult:
    batch, tokens, waiting, preempted, token, reservation, internal, unallocated = records[:, :8].T
    logical_tokens, logical_blocks, physical_blocks = records[:, 8:].T
    saturated = waiting > 0
    window = saturated if saturated.any() else np.ones_like(saturated)
    allocated = token + reservation + internal
    utilization = np.divide(token, allocated, out=np.ones(len(token)), where=allocated > 0)
    logical = int(logical_blocks.sum())
    return ServingResult(
        workload=workload.name,
        policy=policy.name,
        label=policy.label,
        block_size=policy.block_size if isinstance(policy, Paged) else None,
        shared=sharing,
        budget_slots=config.budget_slots,
        steps=len(records),
        saturated_steps=int(saturated.sum()),
        finished=finished,
        preemptions=int(preempted.sum()),
        peak_batch=int(batch.max()),
        mean_batch=float(batch[window].mean()),
        tokens_per_step=float(tokens.mean()),
        memory=MemoryBreakdown(
            int(token[window].sum()),
            int(reservation[window].sum()),
            int(internal[window].sum()),
            int(unallocated[window].sum()),
        ),
        logical_tokens=int(logical_tokens[window].sum()),
        memory_saving=1 - int(physical_blocks.sum()) / logical if logical else 0.0,
        batch_series=batch,
        utilization_series=utilization,
    )
