"""A ``BlockTableStore`` and the spec's per-sequence calls in lockstep, for directed examples;
:meth:`Both.check` compares tables, queue, reference counts, pending copy pairs, keys and
cache counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import numpy as np

import pagedkv.spec.block_manager as spec_bm
import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import BlockManager, BlockTableStore, PrefixCachingBlockManager


class Both:
    def __init__(
        self, total: int, block_size: int, max_seqs: int, max_blocks: int, prefix: bool = True
    ) -> None:
        impl_cls = PrefixCachingBlockManager if prefix else BlockManager
        self.manager: Any = impl_cls(total, block_size)
        self.store = BlockTableStore(self.manager, max_seqs, max_blocks)
        spec_cls = spec_pc.PrefixCachingBlockManager if prefix else spec_bm.BlockManager
        self.spec: Any = spec_cls(total, block_size)
        self.prefix, self.block_size = prefix, block_size
        self.tables: dict[int, list[int | None]] = {}

    def add(self, seq_id: int, prompt_len: int) -> None:
        self.store.add(seq_id, prompt_len)
        self.tables[seq_id] = self.spec.allocate(spec_bm.blocks_needed(prompt_len, self.block_size))

    def prompt(self, seq_id: int, tokens: list[int], extra: Hashable = None) -> int:
        cached = self.store.add_prompt(seq_id, tokens, extra)
        self.tables[seq_id], spec_cached = self.spec.allocate_prompt(tokens, extra)
        assert cached == spec_cached
        return cached

    def cache(self, seq_id: int, tokens: list[int], extra: Hashable = None) -> int:
        newly = self.store.cache_blocks(seq_id, tokens, extra)
        assert newly == self.spec.cache_blocks(self.tables[seq_id], tokens, extra)
        return newly

    def fork(self, parent: int, child: int) -> None:
        self.store.fork(parent, child)
        self.tables[child] = self.spec.fork(self.tables[parent])

    def remove(self, seq_id: int) -> None:
        self.store.remove([seq_id])
        self.spec.free(self.tables.pop(seq_id))

    def truncate(self, counts: dict[int, int]) -> None:
        self.store.truncate(list(counts), list(counts.values()))
        for seq_id, count in counts.items():
            self.tables[seq_id] = self.spec.truncate(self.tables[seq_id], count)

    def release(self, seq_id: int, window: int, count: int) -> None:
        """``release_outside_window`` of one sequence, its next query at ``count``."""
        self.store.release_outside_window([seq_id], window, [count])
        self.tables[seq_id] = self.spec.release_outside_window(self.tables[seq_id], count, window)

    def grow(self, steps: dict[int, int], method: str = "grow", decode: bool = False) -> list[int]:
        """The store's ``method`` (no victim expected) and ``append_slot`` per id; ids not grown.
        ``decode``: every step is 1, passed as one int (the store's decode step)."""
        assert not decode or set(steps.values()) == {1}
        result = getattr(self.store, method)(list(steps), 1 if decode else list(steps.values()))
        failed = []
        for seq_id, step in steps.items():
            count = self.store.token_count(seq_id) - (0 if seq_id in result else step)
            try:
                self.tables[seq_id] = self.spec.append_slot(self.tables[seq_id], count + step, step)
            except spec_bm.OutOfBlocksError:
                failed.append(seq_id)
        assert result == failed
        return result

    def check(self) -> None:
        assert {s: self.store.table(s) for s in self.tables} == self.tables
        assert self.manager.free_block_ids() == self.spec.free_block_ids()
        assert self.manager.ref_counts().tolist() == [b.ref_count for b in self.spec.blocks]
        pairs = [list(pair) for pair in self.spec.pending_copy_pairs()]
        assert self.store.pending_copy_pairs().tolist() == pairs
        if self.prefix:
            blocks = range(self.manager.total_blocks)
            for block in blocks:
                assert self.manager.key_of(block) == self.spec.key_of(block)
            keyed = {block for block in blocks if self.spec.key_of(block) is not None}
            assert self.manager.cached_among(np.arange(len(blocks))) == keyed
            assert dataclasses.astuple(self.manager.stats) == dataclasses.astuple(self.spec.stats)
