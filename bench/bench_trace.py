"""One seeded trace through every bookkeeping system, side by side, against a bare-deque floor.

The trace is ShareGPT-like (``sharegpt_like(TRACE_REQUESTS)``, every request at step 0). The
policy is the same for every system: at most ``MAX_BATCH`` sequences; each step every running
sequence decodes one token, oldest admission first, and a sequence that cannot get a block
preempts the most recently admitted one by recompute (its blocks are freed, it goes back to the
front of the queue with its tokens) until it fits or it was itself the victim; a step that
preempted admits nothing; otherwise waiting sequences are admitted first come, first served,
while their blocks fit; a sequence finishes when its K/V reaches its prompt plus output, less
one. Block size 16; the roomy pool never preempts, the tight one often does.

Systems (``extra_info["system"]``):

* ``floor``: a ``deque`` free list and Python-list tables, written here: the least any
  bookkeeping can do (grow, slot of each new token). ``floor-prefix`` adds the least prefix
  cache that behaves like the spec's (hashed block keys, FIFO reuse, revival).
* ``manager``: ``pagedkv.impl.blocks.BlockManager``'s checked per-call API: ``append_slot`` and
  ``translate_slot`` once per sequence.
* ``store``: ``BlockTableStore.grow_or_preempt`` + ``slot_mapping`` + the block-tables tensor,
  once per step for the whole batch, and ``add`` per admission; ``store-prefix`` admits with
  ``admit`` (the prompt's tokens) and adds ``cache_blocks`` for each filled block.
* ``scheduler``: ``pagedkv.impl.serving.scheduler.Scheduler`` (``schedule`` + ``update``) over
  the store, with an unbounded token budget (so it follows the same policy);
  ``scheduler-prefix`` with prefix caching. Prefix variants prepend a shared 64-token system
  prompt to every prompt.
* ``vllm`` and ``vllm-prefix``, only where vLLM is installed (``.venv-vllm``): vLLM 0.32's
  ``KVCacheManager`` (:class:`VllmManager`), with prefix caching off and on.

Every system must take identical steps: per step, the sequences decoded, the victims in order,
the admissions and the free blocks after it (asserted, also under ``--benchmark-disable``). The
timed quantity is one whole replay; ``extra_info["us_per_step"]`` is it divided by the steps.

Sweeps: ``store-pool`` times the store's decode step on pools of 1k, 10k and 100k blocks, and
``store-len`` with sequences of 1k to 32k tokens (the table width fixed by the model length),
so a cost that grows with either shows up. ``trusted-block`` times one unchecked single-block
take plus release (``BlockPool.take_one``, ``release``) on a 100k-block pool.

``python -m bench.bench_trace`` (from the repository root) runs the suite and prints each ratio
to the floor, and to vLLM's system where vLLM ran; ``python -m properties.vllm_env --bench`` runs
it in ``.venv-vllm``.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import pytest
import torch

from bench.workloads import sharegpt_like
from pagedkv.impl.blocks import BlockManager, BlockTableStore, PrefixCachingBlockManager
from pagedkv.impl.blocks.page_tables import block_tables
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig
from pagedkv.spec.block_manager import OutOfBlocksError, blocks_needed

BLOCK_SIZE = 16
MAX_BATCH = 256
TRACE_REQUESTS = 500
SYSTEM_PROMPT_LEN = 64
POOLS = {"roomy": 20_000, "tight": 3_000}
ROUNDS = 3

Record = tuple[int, tuple[int, ...], int, int]  # decoded, victims, admitted, free blocks after


@dataclass(frozen=True)
class TraceRequest:
    request_id: int
    prompt_len: int  # system prompt included
    output_len: int

    @property
    def kv_len(self) -> int:
        """The K/V a finished sequence holds: its last sampled token is never computed."""
        return self.prompt_len + self.output_len - 1

    def tokens(self, count: int, prefix: bool, start: int = 0) -> list[int]:
        """Token ids ``start .. count - 1``: the shared system prompt, then the request's own."""
        shared = min(count, SYSTEM_PROMPT_LEN) if prefix else 0
        own = [1000 + self.request_id] * (count - max(start, shared))
        return list(range(start + 1, shared + 1)) + own


@functools.lru_cache(maxsize=2)
def trace(prefix: bool) -> tuple[TraceRequest, ...]:
    """The trace's requests (made once: building them is no system's cost)."""
    extra = SYSTEM_PROMPT_LEN if prefix else 0
    return tuple(
        TraceRequest(r.request_id, r.prompt_len + extra, r.output_lens[0])
        for r in sharegpt_like(TRACE_REQUESTS).requests
    )


# ----------------------------------------------------------------- the policy, for the memories


class Memory(Protocol):
    """One system's bookkeeping, driven by :func:`replay`."""

    def decode(self, running: list[int]) -> list[int]:
        """Grow each running sequence (in order) by one token, preempting from the tail;
        return the victims in order."""
        ...

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        """Admit a sequence holding ``tokens`` tokens if its blocks fit; False changes nothing."""
        ...

    def computed(self, admitted: list[int]) -> None:
        """The step's K/V is written: register the full blocks it filled (the decoded
        sequences', then the admitted ones', as the scheduler's ``update`` does)."""
        ...

    def finish(self, seq_ids: list[int]) -> None: ...

    def free_blocks(self) -> int: ...


@dataclass
class Progress:
    """A running sequence's count is implicit: ``count0 + (step - step0)``."""

    count0: int
    step0: int


def replay(memory: Memory, requests: tuple[TraceRequest, ...]) -> list[Record]:
    """Run the trace's policy over ``memory``; return every step's record."""
    waiting: deque[tuple[TraceRequest, int]] = deque((r, r.prompt_len) for r in requests)
    running: list[int] = []
    progress: dict[int, Progress] = {}
    finish_at: dict[int, list[tuple[int, int]]] = {}  # step -> (seq, its admission's step0)
    records: list[Record] = []
    for step in itertools.count():
        if not (waiting or running):
            return records
        victims = memory.decode(running) if running else []
        decoded = len(running) - len(victims)
        for victim in victims:
            assert running.pop() == victim
            state = progress.pop(victim)
            count = state.count0 + step - state.step0  # before this step's token
            waiting.appendleft((requests[victim], count + 1))
        admitted: list[int] = []
        if not victims:
            while waiting and len(running) < MAX_BATCH and memory.admit(*waiting[0]):
                request, tokens = waiting.popleft()
                running.append(request.request_id)
                admitted.append(request.request_id)
                progress[request.request_id] = Progress(tokens, step + 1)
                finish_at.setdefault(step + request.kv_len - tokens, []).append(
                    (request.request_id, step + 1)
                )
        memory.computed(admitted)
        done = [  # an entry made before a preemption no longer matches its sequence's progress
            s
            for s, step0 in finish_at.pop(step, ())
            if s in progress and progress[s].step0 == step0
        ]
        if done:
            memory.finish(done)
            gone = set(done)
            running = [s for s in running if s not in gone]
            for seq_id in done:
                del progress[seq_id]
        records.append((decoded, tuple(victims), len(admitted), memory.free_blocks()))
    raise AssertionError("unreachable")


# ----------------------------------------------------------------- the floor


class Uncached:
    """What a memory without a prefix cache does at the end of a step: register nothing, and
    free each finished sequence with its own ``_release``."""

    def _release(self, seq_id: int) -> None:
        raise NotImplementedError

    def computed(self, admitted: list[int]) -> None:
        pass  # nothing is cached

    def finish(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)


class DequeFloor(Uncached):
    """A ``deque`` of free blocks and a Python list per table: the least bookkeeping."""

    def __init__(self, total_blocks: int) -> None:
        self.free = deque(range(total_blocks))
        self.tables: dict[int, list[int]] = {}
        self.counts: dict[int, int] = {}
        self.slots: list[int] = []

    def decode(self, running: list[int]) -> list[int]:
        tables, counts, bs = self.tables, self.counts, BLOCK_SIZE
        slots: list[int] = []
        victims: list[int] = []
        end = len(running)
        for index, seq_id in enumerate(running):
            if index >= end:
                break
            count = counts[seq_id]
            if count % bs == 0:
                while not self.free_blocks() and end > index:
                    end -= 1
                    victims.append(running[end])
                    self._release(running[end])
                if end == index:  # the sequence preempted itself
                    break
                tables[seq_id].append(self._take_one())
            counts[seq_id] = count + 1
            slots.append(tables[seq_id][count // bs] * bs + count % bs)
        self.slots = slots
        return victims

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        needed = blocks_needed(tokens, BLOCK_SIZE)
        if needed > len(self.free):
            return False
        self.tables[request.request_id] = [self.free.popleft() for _ in range(needed)]
        self.counts[request.request_id] = tokens
        return True

    def free_blocks(self) -> int:
        return len(self.free)

    def _take_one(self) -> int:
        return self.free.popleft()

    def _release(self, seq_id: int) -> None:
        self.free.extend(reversed(self.tables.pop(seq_id)))
        del self.counts[seq_id]


class PrefixFloor(DequeFloor):
    """The floor plus the least prefix cache with the spec's rules: chained block hashes, hits
    up to the first miss (never the last token's block), revival out of the free queue, a
    reused block losing its key, and registration of each block as it fills."""

    def __init__(self, total_blocks: int) -> None:
        super().__init__(total_blocks)
        self.queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(total_blocks))
        self.refs = [0] * total_blocks
        self.block_of: dict[int, int] = {}  # block hash -> block
        self.hash_of: dict[int, int] = {}  # block -> its hash
        self.hashes: dict[int, list[int]] = {}  # seq -> hash of each full block
        self.requests: dict[int, TraceRequest] = {}
        self.filled: list[int] = []  # sequences whose last block filled this step

    def _chain(self, request: TraceRequest, count: int, hashes: list[int]) -> list[int]:
        """``hashes`` (the first blocks' chained hashes) extended to ``count`` tokens."""
        start = len(hashes) * BLOCK_SIZE
        tokens, parent = request.tokens(count, True, start), hashes[-1] if hashes else 0
        for offset in range(0, count - start - BLOCK_SIZE + 1, BLOCK_SIZE):
            parent = hash((parent, tuple(tokens[offset : offset + BLOCK_SIZE])))
            hashes.append(parent)
        return hashes

    def _take(self, n: int) -> list[int]:
        taken = []
        for _ in range(n):
            block, _ = self.queue.popitem(last=False)
            if block in self.hash_of:
                del self.block_of[self.hash_of.pop(block)]
            self.refs[block] = 1
            taken.append(block)
        return taken

    def _register(self, seq_id: int, index: int, block: int) -> None:
        key = self.hashes[seq_id][index]
        if block not in self.hash_of and key not in self.block_of:
            self.block_of[key] = block
            self.hash_of[block] = key

    def decode(self, running: list[int]) -> list[int]:
        victims = super().decode(running)
        survivors = running[: len(running) - len(victims)]
        self.filled = [s for s in survivors if self.counts[s] % BLOCK_SIZE == 0]
        return victims

    def _take_one(self) -> int:
        return self._take(1)[0]

    def computed(self, admitted: list[int]) -> None:
        for seq_id in self.filled:  # a block filled: register it
            count = self.counts[seq_id]
            self._chain(self.requests[seq_id], count, self.hashes[seq_id])
            self._register(seq_id, count // BLOCK_SIZE - 1, self.tables[seq_id][-1])
        for seq_id in admitted:
            for index, block in enumerate(self.tables[seq_id][: len(self.hashes[seq_id])]):
                self._register(seq_id, index, block)
        self.filled = []

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        hashes = self._chain(request, tokens, [])
        hits = []
        for key in hashes[: (tokens - 1) // BLOCK_SIZE]:
            if key not in self.block_of:
                break
            hits.append(self.block_of[key])
        revived = [b for b in hits if self.refs[b] == 0]
        fresh = blocks_needed(tokens, BLOCK_SIZE) - len(hits)
        if fresh + len(revived) > len(self.queue):
            return False
        for block in revived:
            del self.queue[block]
        for block in hits:
            self.refs[block] += 1
        seq_id = request.request_id
        self.tables[seq_id] = hits + self._take(fresh)
        self.counts[seq_id] = tokens
        self.hashes[seq_id] = hashes
        self.requests[seq_id] = request
        return True

    def free_blocks(self) -> int:
        return len(self.queue)

    def _release(self, seq_id: int) -> None:
        for block in reversed(self.tables.pop(seq_id)):
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.queue[block] = None
        del self.counts[seq_id]
        del self.hashes[seq_id]


# ----------------------------------------------------------------- pagedkv's systems


class ManagerPerCall(Uncached):
    """``BlockManager``'s checked API, once per sequence."""

    def __init__(self, total_blocks: int) -> None:
        self.manager = BlockManager(total_blocks, BLOCK_SIZE)
        self.tables: dict[int, list[int]] = {}
        self.counts: dict[int, int] = {}

    def decode(self, running: list[int]) -> list[int]:
        manager, tables, counts = self.manager, self.tables, self.counts
        victims: list[int] = []
        end = len(running)
        for index, seq_id in enumerate(running):
            if index >= end:
                break
            count = counts[seq_id]
            while True:
                try:
                    tables[seq_id] = manager.append_slot(tables[seq_id], count + 1)
                    break
                except OutOfBlocksError:
                    end -= 1
                    victims.append(running[end])
                    self._release(running[end])
                    if end == index:
                        return victims
            counts[seq_id] = count + 1
            manager.translate_slot(tables[seq_id], count)
        return victims

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        needed = blocks_needed(tokens, BLOCK_SIZE)
        if not self.manager.can_allocate(needed):
            return False
        self.tables[request.request_id] = self.manager.allocate(needed)
        self.counts[request.request_id] = tokens
        return True

    def free_blocks(self) -> int:
        return self.manager.num_free_blocks

    def _release(self, seq_id: int) -> None:
        self.manager.free(self.tables.pop(seq_id))
        del self.counts[seq_id]


class BatchedStore:
    """``BlockTableStore``: one batched call per step; the running list is the store's."""

    def __init__(self, total_blocks: int, prefix: bool = False) -> None:
        manager = (PrefixCachingBlockManager if prefix else BlockManager)(total_blocks, BLOCK_SIZE)
        width = blocks_needed(2048 + SYSTEM_PROMPT_LEN, BLOCK_SIZE)
        self.store = BlockTableStore(manager, MAX_BATCH, width)
        self.prefix = prefix
        self.requests: dict[int, TraceRequest] = {}
        self.tokens: dict[int, list[int]] = {}  # with prefix caching: tokens up to a boundary

    def decode(self, running: list[int]) -> list[int]:
        store = self.store
        victims = store.grow_or_preempt(None, 1)
        torch.from_numpy(store.slot_mapping(None))
        torch.from_numpy(block_tables(store, None))
        return victims

    def computed(self, admitted: list[int]) -> None:
        if not self.prefix:
            return
        store, fresh = self.store, set(admitted)
        live = store.resolve(None)
        counts = store.token_counts.take(live.rows)
        for i in np.flatnonzero(counts % BLOCK_SIZE == 0).tolist():
            seq_id = live.seq_ids[i]
            if seq_id not in fresh:  # a decode filled a block: its tokens catch up to it
                tokens = self.tokens[seq_id]
                tokens += self.requests[seq_id].tokens(int(counts[i]), True, len(tokens))
                store.cache_blocks(seq_id, tokens)
        for seq_id in admitted:
            store.cache_blocks(seq_id, self.tokens[seq_id])

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        store = self.store
        if not self.prefix:  # no cache: a count is all a table needs
            if blocks_needed(tokens, BLOCK_SIZE) > store.num_free_blocks:
                return False
            store.add(request.request_id, tokens)
            return True
        token_ids = request.tokens(tokens, True)
        if store.admit(request.request_id, token_ids) is None:
            return False
        self.requests[request.request_id] = request
        self.tokens[request.request_id] = token_ids
        return True

    def finish(self, seq_ids: list[int]) -> None:
        self.store.remove(seq_ids)

    def free_blocks(self) -> int:
        return self.store.num_free_blocks


def replay_scheduler(
    requests: tuple[TraceRequest, ...], total_blocks: int, prefix: bool
) -> list[Record]:
    """The real ``Scheduler`` over the store; its own loop is the policy."""
    system = BatchedStore(total_blocks, prefix)
    config = SchedulerConfig(MAX_BATCH, 10**9, 0)
    scheduler = Scheduler(system.store, config)
    for request in requests:
        seq = scheduler.add_request(
            request.request_id, request.tokens(request.prompt_len, prefix), request.output_len
        )
        assert seq.seq_id == request.request_id  # so a row's seq id names its request
    records: list[Record] = []
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, 1000 + out.seq_ids[out.samples])  # one token per sampling row
        records.append(
            (
                len(out.seqs) - len(out.admitted),
                tuple(seq.seq_id for seq in out.preempted),
                len(out.admitted),
                system.store.num_free_blocks,
            )
        )
    return records


# ----------------------------------------------------------------- vLLM's KVCacheManager


def vllm_importable() -> bool:
    """Whether vLLM is installed here (``.venv-vllm``; ``python -m properties.vllm_env``)."""
    return importlib.util.find_spec("vllm") is not None


if vllm_importable():  # imported once here, so no timed replay pays for importing vLLM
    from properties.vllm_adapter import make_manager, request_factory


class VllmManager:
    """vLLM's ``KVCacheManager`` (vLLM 0.32, CPU build): ``allocate_slots`` for each decode
    and admission, ``free`` for each finished or preempted sequence, and the slot of each new
    token from the blocks it holds, as the floor computes it.

    Each admission builds vLLM's ``Request`` (with prefix caching that hashes its prompt);
    ``vllm-prefix`` looks the prompt up with ``get_computed_blocks`` and registers filled
    blocks once the step's K/V is written (``delay_cache_blocks`` and ``cache_blocks``), when
    the floor registers them. The pool has one more block than the others, vLLM's reserved
    placeholder (``NULL_BLOCK`` in docs/design.md), so the usable blocks are the same.
    """

    def __init__(self, total_blocks: int, prefix: bool = False) -> None:
        self.manager = make_manager(total_blocks, BLOCK_SIZE, caching=prefix)
        self.pool = self.manager.block_pool
        self.prefix = prefix
        self.make_request = request_factory(BLOCK_SIZE, caching=prefix)
        self.requests: dict[int, Any] = {}
        self.tables: dict[int, list[int]] = {}
        self.filled: list[int] = []
        self.slots: list[int] = []

    def decode(self, running: list[int]) -> list[int]:
        manager, requests, tables, bs = self.manager, self.requests, self.tables, BLOCK_SIZE
        delay = self.prefix
        slots: list[int] = []
        victims: list[int] = []
        filled: list[int] = []
        end = len(running)
        for index, seq_id in enumerate(running):
            if index >= end:
                break
            request = requests[seq_id]
            count = request.num_computed_tokens
            request.append_output_token_ids(1000 + seq_id)
            while (new := manager.allocate_slots(request, 1, delay_cache_blocks=delay)) is None:
                end -= 1
                victims.append(running[end])
                self._release(running[end])
                if end == index:  # the sequence preempted itself
                    self.slots, self.filled = slots, filled
                    return victims
            if new.blocks[0]:
                tables[seq_id].extend(block.block_id for block in new.blocks[0])
            request.num_computed_tokens = count + 1
            slots.append(tables[seq_id][count // bs] * bs + count % bs)
            if (count + 1) % bs == 0:
                filled.append(seq_id)
        self.slots, self.filled = slots, filled
        return victims

    def admit(self, request: TraceRequest, tokens: int) -> bool:
        manager = self.manager
        seq_id = request.request_id
        vllm_request = self.make_request(str(seq_id), request.tokens(tokens, self.prefix))
        if self.prefix:
            computed, hit_tokens, _ = manager.get_computed_blocks(vllm_request)
            new = manager.allocate_slots(
                vllm_request, tokens - hit_tokens, hit_tokens, computed, delay_cache_blocks=True
            )
        else:
            new = manager.allocate_slots(vllm_request, tokens)
        if new is None:
            return False
        vllm_request.num_computed_tokens = tokens
        self.requests[seq_id] = vllm_request
        self.tables[seq_id] = manager.get_block_ids(str(seq_id))[0]
        return True

    def computed(self, admitted: list[int]) -> None:
        if not self.prefix:
            return
        requests, manager = self.requests, self.manager
        for seq_id in self.filled:  # a decode filled a block
            if seq_id in requests:
                manager.cache_blocks(requests[seq_id], requests[seq_id].num_computed_tokens)
        for seq_id in admitted:
            manager.cache_blocks(requests[seq_id], requests[seq_id].num_computed_tokens)
        self.filled = []

    def finish(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._release(seq_id)

    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def _release(self, seq_id: int) -> None:
        self.manager.free(self.requests.pop(seq_id))
        del self.tables[seq_id]


# ----------------------------------------------------------------- the benchmarks


SYSTEMS: dict[str, Callable[[int], Memory]] = {
    "floor": DequeFloor,
    "manager": ManagerPerCall,
    "store": BatchedStore,
    "floor-prefix": PrefixFloor,
    "store-prefix": lambda total: BatchedStore(total, prefix=True),
    "vllm": VllmManager,
    "vllm-prefix": lambda total: VllmManager(total, prefix=True),
}
VLLM_SYSTEMS = ["vllm", "vllm-prefix"] if vllm_importable() else []
"""vLLM's systems run where vLLM is installed (``python -m properties.vllm_env --bench``)."""


@dataclass
class Expected:
    """The floor's records, computed once per trace and pool."""

    records: dict[tuple[bool, str], list[Record]] = field(default_factory=dict)

    def of(self, prefix: bool, pool: str) -> list[Record]:
        if (prefix, pool) not in self.records:
            floor = PrefixFloor if prefix else DequeFloor
            self.records[prefix, pool] = replay(floor(POOLS[pool]), trace(prefix))
        return self.records[prefix, pool]


EXPECTED = Expected()


def run_system(system: str, pool: str) -> list[Record]:
    prefix = system.endswith("prefix")
    if system.startswith("scheduler"):
        return replay_scheduler(trace(prefix), POOLS[pool], prefix)
    return replay(SYSTEMS[system](POOLS[pool]), trace(prefix))


@pytest.mark.parametrize("pool", sorted(POOLS))
@pytest.mark.parametrize(
    "system",
    [
        "floor",
        "manager",
        "store",
        "scheduler",
        "floor-prefix",
        "store-prefix",
        "scheduler-prefix",
        *VLLM_SYSTEMS,
    ],
)
def test_trace(benchmark: Any, system: str, pool: str) -> None:
    """One replay of the trace; identical steps to the floor's, asserted."""
    prefix = system.endswith("prefix")
    expected = EXPECTED.of(prefix, pool)
    benchmark.group = f"trace-{pool}{'-prefix' if prefix else ''}"
    records = benchmark.pedantic(run_system, args=(system, pool), rounds=ROUNDS, iterations=1)
    assert records == expected
    preemptions = sum(len(victims) for _, victims, _, _ in records)
    assert (preemptions > 0) == (pool == "tight")
    benchmark.extra_info.update(
        system=system, pool=pool, steps=len(records), preemptions=preemptions,
        decodes=sum(decoded for decoded, *_ in records),
    )  # fmt: skip


# ----------------------------------------------------------------- size sweeps


def decoding_store(total_blocks: int, batch: int, length: int, width: int) -> BlockTableStore:
    """A store holding ``batch`` sequences of ``length`` tokens each."""
    store = BlockTableStore(BlockManager(total_blocks, BLOCK_SIZE), batch, width)
    for seq_id in range(batch):
        store.add(seq_id, length)
    return store


def decode_steps(store: BlockTableStore, steps: int) -> None:
    for _ in range(steps):
        assert store.grow_or_preempt(None, 1) == []
        torch.from_numpy(store.slot_mapping(None))
        torch.from_numpy(block_tables(store, None))


SWEEP_STEPS = 64


@pytest.mark.parametrize("total_blocks", [1_000, 10_000, 100_000])
def test_store_step_by_pool_size(benchmark: Any, total_blocks: int) -> None:
    """32 sequences of 200 tokens decode 64 steps: the cost must not follow the pool size."""
    benchmark.group = "store-pool"
    benchmark.extra_info.update(system="store", total_blocks=total_blocks, steps=SWEEP_STEPS)
    benchmark.pedantic(
        decode_steps,
        setup=lambda: ((decoding_store(total_blocks, 32, 200, 128), SWEEP_STEPS), {}),
        rounds=5,
    )


@pytest.mark.parametrize("length", [1_024, 4_096, 16_384, 32_768])
def test_store_step_by_sequence_length(benchmark: Any, length: int) -> None:
    """8 sequences of ``length`` tokens decode 64 steps, the table width set by a 33k model
    length: the cost must not follow the sequences' length."""
    benchmark.group = "store-len"
    width = blocks_needed(33_000, BLOCK_SIZE)
    benchmark.extra_info.update(system="store", length=length, steps=SWEEP_STEPS)
    benchmark.pedantic(
        decode_steps,
        setup=lambda: ((decoding_store(17_000, 8, length, width), SWEEP_STEPS), {}),
        rounds=5,
    )


def test_trusted_single_block(benchmark: Any) -> None:
    """One unchecked take of a single block plus its release, on a 100k-block pool."""
    manager = BlockManager(100_000, BLOCK_SIZE)
    pool = manager.pool
    benchmark.group = "trusted-block"
    benchmark.extra_info.update(system="manager", total_blocks=100_000)

    def take_and_release() -> None:
        pool.release(np.array([pool.take_one()], dtype=np.intp))

    benchmark(take_and_release)
    assert manager.num_free_blocks == 100_000
    assert np.count_nonzero(manager.ref_counts()) == 0


# ----------------------------------------------------------------- ratios


def print_ratios(json_path: str) -> None:
    """Print µs per step and the ratio to the floor for every trace group (and to vLLM's
    system of the group, where vLLM ran), and the sweeps."""
    import json

    with open(json_path) as file:
        results = json.load(file)["benchmarks"]
    by_group: dict[str, dict[str, dict[str, Any]]] = {}
    for result in results:
        by_group.setdefault(result["group"], {})[result["name"]] = result
    for group, runs in sorted(by_group.items()):
        if group.startswith("trace"):
            floors = [r for r in runs.values() if r["extra_info"]["system"].startswith("floor")]
            floor = floors[0]["stats"]["median"] / floors[0]["extra_info"]["steps"]
            vllms = [r for r in runs.values() if r["extra_info"]["system"].startswith("vllm")]
            vllm = vllms[0]["stats"]["median"] / vllms[0]["extra_info"]["steps"] if vllms else 0
            for result in runs.values():
                info = result["extra_info"]
                per_step = result["stats"]["median"] / info["steps"]
                versus = f" {per_step / vllm:6.2f}x vllm" if vllm else ""
                print(
                    f"{group:<22} {info['system']:<17} {per_step * 1e6:8.1f} us/step "
                    f"{per_step / floor:6.2f}x floor{versus}  ({info['steps']} steps, "
                    f"{info['preemptions']} preemptions)"
                )
        else:
            for name, result in sorted(runs.items()):
                steps = result["extra_info"].get("steps", 1)
                print(f"{group:<22} {name:<50} {result['stats']['median'] / steps * 1e6:8.2f} us")


if __name__ == "__main__":
    json_path = "/tmp/pagedkv-bench-trace.json"
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", f"--benchmark-json={json_path}"])
    if code == 0:
        print_ratios(json_path)
