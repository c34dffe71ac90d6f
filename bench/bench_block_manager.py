"""Block-manager latency and memory: ``spec`` (pure Python) against ``impl`` (numpy, batched).

Suites (``benchmark.group`` names them; ``extra_info`` says which side and which parameters):

* ``decode-bs{B}-batch{N}``: one scheduler decode step over ``N`` running sequences: grow each
  by one token, compute the step's ``slot_mapping`` and the int32 block-tables tensor. ``spec``
  loops ``append_slot`` + ``translate_slot`` per sequence and builds the tensors from lists;
  ``impl`` makes a ``SeqBatch`` and calls ``grow``, ``slot_mapping`` and
  ``page_tables.block_tables`` once each. Every ``DECODE_STEPS`` rounds the trace restarts
  (untimed).
* ``pool-{allocate,free}-n{n}``: vLLM-style pool microbenchmarks on a 100k-block pool. ``spec``
  and ``impl`` use the spec's list API; ``impl-array`` uses ``allocate_array``/``free_array``.
* ``test_impl_memory_1m_blocks``: tracemalloc footprint of a 1,000,000-block ``impl`` manager,
  asserted <= 16 MB.

Under ``--benchmark-disable`` each benchmark runs once and the equivalence checks still run.
``python bench/bench_block_manager.py`` runs the suites and prints the spec/impl ratios.
"""

from __future__ import annotations

import functools
import sys
import tracemalloc
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch

import pagedkv.spec.block_manager as spec_bm
from pagedkv.impl.blocks import BlockTableStore, SeqBatch
from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.page_tables import block_tables

BLOCK_SIZES = (1, 4, 16, 64, 256)
BATCHES = (1, 32, 256)
POOL_SIZES = (1, 100, 1000)
POOL_BLOCKS = 100_000
DECODE_STEPS = 32  # decode steps per trace before it restarts
PROMPT_LENS = (16, 512)  # prompt lengths are drawn from this range, per sequence
DECODE_ROUNDS = 64
POOL_ROUNDS = 2000
MEMORY_LIMIT_BYTES = 16_000_000  # "16 MB", read strictly


# ----------------------------------------------------------------- decode trace


def trace_shape(block_size: int, batch: int) -> tuple[list[int], int, int]:
    """Prompt lengths, max blocks per sequence and pool size of a decode trace."""
    rng = np.random.default_rng(batch * 1000 + block_size)
    prompts = rng.integers(*PROMPT_LENS, size=batch).tolist()
    max_blocks = spec_bm.blocks_needed(PROMPT_LENS[1] + DECODE_STEPS, block_size)
    return prompts, max_blocks, batch * max_blocks


@dataclass
class SpecDecode:
    """The trace driven through the spec, one call per sequence."""

    manager: spec_bm.BlockManager
    tables: list[list[int]]
    counts: list[int]
    max_blocks: int

    @classmethod
    def start(cls, block_size: int, batch: int) -> SpecDecode:
        prompts, max_blocks, pool = trace_shape(block_size, batch)
        manager = spec_bm.BlockManager(pool, block_size)
        tables = [manager.allocate(spec_bm.blocks_needed(n, block_size)) for n in prompts]
        return cls(manager, tables, list(prompts), max_blocks)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        slots = []
        for i, table in enumerate(self.tables):
            count = self.counts[i] + 1
            table = self.manager.append_slot(table, count)
            self.tables[i], self.counts[i] = table, count
            slots.append(self.manager.translate_slot(table, count - 1))
        slot_mapping = torch.tensor(slots, dtype=torch.int32)
        padded = [table + [-1] * (self.max_blocks - len(table)) for table in self.tables]
        return slot_mapping, torch.tensor(padded, dtype=torch.int32)


@dataclass
class ImplDecode:
    """The trace driven through ``BlockTableStore``: three calls per step.

    The running set is fixed during a trace, so the ``SeqBatch`` made at its start serves
    every step, as an engine keeps one while its running set is unchanged. With
    ``resolve_each_step`` the batch is resolved from the ids on every step instead.
    """

    store: BlockTableStore
    seq_ids: list[int]
    batch: SeqBatch
    resolve_each_step: bool = False

    @classmethod
    def start(cls, block_size: int, batch: int, resolve_each_step: bool = False) -> ImplDecode:
        prompts, max_blocks, pool = trace_shape(block_size, batch)
        store = BlockTableStore(BlockManager(pool, block_size), batch, max_blocks)
        for seq_id, prompt_len in enumerate(prompts):
            store.add(seq_id, prompt_len)
        seq_ids = list(range(batch))
        return cls(store, seq_ids, store.batch(seq_ids), resolve_each_step)

    def step(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = self.store.batch(self.seq_ids) if self.resolve_each_step else self.batch
        failed = self.store.grow(batch, 1)
        assert not failed
        return (
            torch.from_numpy(self.store.slot_mapping(batch)),
            torch.from_numpy(block_tables(self.store, batch)),
        )


DECODE_SIDES = {
    "spec": SpecDecode.start,
    "impl": ImplDecode.start,
    "impl+batch": functools.partial(ImplDecode.start, resolve_each_step=True),
}


def test_decode_trace_matches_spec() -> None:
    """Every side of the decode benchmark computes the same tensors, step after step."""
    for block_size in BLOCK_SIZES:
        sides = [start(block_size, 32) for start in DECODE_SIDES.values()]
        for _ in range(DECODE_STEPS):
            expected, *others = [side.step() for side in sides]
            for actual in others:
                assert all(map(torch.equal, expected, actual))


@pytest.mark.parametrize("side", list(DECODE_SIDES))
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_decode_step(benchmark: Any, side: str, batch: int, block_size: int) -> None:
    """One decode step's bookkeeping: grow + slot_mapping + block-tables tensor."""
    start = DECODE_SIDES[side]
    state: dict[str, Any] = {"trace": start(block_size, batch), "steps": 0}

    def restart_when_done() -> None:
        if state["steps"] == DECODE_STEPS:
            state["trace"], state["steps"] = start(block_size, batch), 0
        state["steps"] += 1

    benchmark.group = f"decode-bs{block_size}-batch{batch}"
    benchmark.extra_info.update(side=side, op="decode", block_size=block_size, batch=batch)
    slot_mapping, block_tables = benchmark.pedantic(
        lambda: state["trace"].step(), setup=restart_when_done, rounds=DECODE_ROUNDS
    )
    assert slot_mapping.shape == (batch,) and block_tables.shape[0] == batch


# ----------------------------------------------------------------- pool microbenchmarks

POOL_SIDES = {
    "spec": (spec_bm.BlockManager, "allocate", "free"),
    "impl": (BlockManager, "allocate", "free"),
    "impl-array": (BlockManager, "allocate_array", "free_array"),
}


@pytest.mark.parametrize("side", list(POOL_SIDES))
@pytest.mark.parametrize("n", POOL_SIZES)
@pytest.mark.parametrize("op", ["allocate", "free"])
def test_pool(benchmark: Any, side: str, n: int, op: str) -> None:
    """``allocate(n)`` or ``free`` of an n-block table on a 100k-block pool (other op untimed)."""
    cls, allocate_name, free_name = POOL_SIDES[side]
    manager = cls(POOL_BLOCKS, 16)
    allocate, free = getattr(manager, allocate_name), getattr(manager, free_name)
    held: list[Any] = []

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        if op == "allocate":
            while held:
                free(held.pop())
            return (n,), {}
        return (allocate(n),), {}

    def target(arg: Any) -> None:
        if op == "allocate":
            held.append(allocate(arg))
        else:
            free(arg)

    benchmark.group = f"pool-{op}-n{n}"
    benchmark.extra_info.update(side=side, op=op, n=n, pool_blocks=POOL_BLOCKS)
    benchmark.pedantic(target, setup=setup, rounds=POOL_ROUNDS)
    while held:
        free(held.pop())
    assert manager.num_free_blocks == POOL_BLOCKS


def test_pool_queue_order_matches_spec() -> None:
    """After the same allocate/free sequence both free queues are identical."""
    managers = [spec_bm.BlockManager(1000, 16), BlockManager(1000, 16)]
    for manager in managers:
        tables = [manager.allocate(n) for n in (1, 100, 300, 7)]
        for table in (tables[2], tables[0], tables[3], tables[1]):
            manager.free(table)
        manager.allocate(550)
    assert managers[0].free_block_ids() == managers[1].free_block_ids()


# ----------------------------------------------------------------- memory


def traced_bytes(build: Any) -> tuple[int, int]:
    """(current, peak) bytes tracemalloc sees while ``build()`` runs and its result lives."""
    tracemalloc.start()
    try:
        kept = build()
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    del kept
    return current, peak


def impl_workload(total_blocks: int) -> BlockManager:
    manager = BlockManager(total_blocks, 16)
    tables = [manager.allocate_array(1000) for _ in range(100)]
    for table in tables[::2]:
        manager.free_array(table)
    return manager


def test_impl_memory_1m_blocks(record_property: Any) -> None:
    """impl's own footprint for a 1,000,000-block pool is <= 16 MB (spec: ~170 B per block)."""
    current, peak = traced_bytes(lambda: impl_workload(1_000_000))
    spec_current, _ = traced_bytes(lambda: spec_bm.BlockManager(100_000, 16))
    record_property("impl_bytes_1m", current)
    record_property("impl_peak_bytes_1m", peak)
    record_property("spec_bytes_per_block", spec_current / 100_000)
    assert current <= MEMORY_LIMIT_BYTES, f"impl holds {current} bytes for 1M blocks"
    assert peak <= MEMORY_LIMIT_BYTES, f"impl peaked at {peak} bytes for 1M blocks"
    assert spec_current / 100_000 > 10 * current / 1_000_000


# ----------------------------------------------------------------- ratios


def print_ratios(json_path: str) -> None:
    """Print each group's mean times and spec/side ratios from a pytest-benchmark JSON."""
    import json

    with open(json_path) as file:
        results = json.load(file)["benchmarks"]
    by_group: dict[str, dict[str, float]] = {}
    for result in results:
        side = result["extra_info"]["side"]
        by_group.setdefault(result["group"], {})[side] = result["stats"]["mean"] * 1e6
    for group, means in sorted(by_group.items()):
        spec_us = means.pop("spec")
        others = "  ".join(
            f"{side} {us:.1f} us ({spec_us / us:.1f}x)" for side, us in sorted(means.items())
        )
        print(f"{group:<24} spec {spec_us:.1f} us  {others}")


if __name__ == "__main__":
    json_path = "/tmp/pagedkv-bench-block-manager.json"
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", f"--benchmark-json={json_path}"])
    if code == 0:
        print_ratios(json_path)
        impl_bytes, impl_peak = traced_bytes(lambda: impl_workload(1_000_000))
        spec_bytes, _ = traced_bytes(lambda: spec_bm.BlockManager(100_000, 16))
        print(
            f"memory, 1M blocks: impl {impl_bytes / 1e6:.2f} MB (peak {impl_peak / 1e6:.2f} MB), "
            f"spec {spec_bytes / 100_000:.0f} B/block = {spec_bytes * 10 / 1e6:.0f} MB"
        )
    sys.exit(code)
