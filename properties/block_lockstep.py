"""A ``BlockTableStore`` and the spec's per-sequence calls in lockstep, for directed examples:
each call compares the two results (and ``expect``, where given); :meth:`Both.check` compares
tables, token counts, queue, reference counts, pending copy pairs, keys and cache counters."""

from __future__ import annotations

import copy
import dataclasses
import operator
from collections.abc import Hashable
from typing import Any

import numpy as np

import pagedkv.spec.block_manager as spec_bm
import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import BlockManager, BlockTableStore, PrefixCachingBlockManager
from properties.outcomes import outcome

ANY: Any = object()
"""``expect``'s default: no stated result, only the store's and the spec's compared."""


def expected(result: Any, expect: Any, raised: bool = False) -> Any:
    """``result``, asserted equal to ``expect`` unless that is :data:`ANY`; an error class
    (``raised``) only where one is expected."""
    assert not (raised and expect is ANY), f"raised {result} where no error was expected"
    assert expect is ANY or result == expect, (result, expect)
    return result


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
        self.counts: dict[int, int] = {}  # token counts

    def add(self, seq_id: int, prompt_len: int) -> None:
        self.store.add(seq_id, prompt_len)
        self.tables[seq_id] = self.spec.allocate(spec_bm.blocks_needed(prompt_len, self.block_size))
        self.counts[seq_id] = prompt_len

    def prompt(
        self, seq_id: int, tokens: list[int], extra: Hashable = None, expect: Any = ANY
    ) -> int:
        cached = self.store.add_prompt(seq_id, tokens, extra)
        self.tables[seq_id], spec_cached = self.spec.allocate_prompt(tokens, extra)
        self.counts[seq_id] = len(tokens)
        assert cached == spec_cached
        return expected(cached, expect)

    def admit(
        self, seq_id: int, tokens: list[int], headroom: int = 0, extra: Hashable = None,
        expect: Any = ANY,
    ) -> int | None:  # fmt: skip
        """``admit``: the spec's ``allocate_prompt`` if ``headroom`` blocks stay free, else None."""
        cached = self.store.admit(seq_id, tokens, headroom, extra)
        if self.spec.num_free_blocks - self.spec.blocks_to_allocate(tokens, extra) < headroom:
            assert cached is None
        else:
            self.tables[seq_id], spec_cached = self.spec.allocate_prompt(tokens, extra)
            self.counts[seq_id] = len(tokens)
            assert cached == spec_cached
        return expected(cached, expect)

    def cache(
        self, seq_id: int, tokens: list[int], extra: Hashable = None, expect: Any = ANY
    ) -> Any:
        """``cache_blocks``: the blocks newly cached, or the error class (messages compared)."""
        done = outcome(self.store.cache_blocks, seq_id, tokens, extra, message=True)
        assert done == outcome(
            self.spec.cache_blocks, self.tables[seq_id], tokens, extra, message=True
        )
        raised = done[0] == "raised"
        return expected(done[1][0] if raised else done[1], expect, raised)

    def fork(self, parent: int, child: int) -> None:
        self.store.fork(parent, child)
        self.tables[child] = self.spec.fork(self.tables[parent])
        self.counts[child] = self.counts[parent]

    def remove(self, seq_id: int) -> None:
        self.store.remove([seq_id])
        self.spec.free(self.tables.pop(seq_id))
        del self.counts[seq_id]

    def truncate(self, counts: dict[int, int]) -> None:
        self.store.truncate(list(counts), list(counts.values()))
        for seq_id, count in counts.items():
            self.tables[seq_id] = self.spec.truncate(self.tables[seq_id], count)
            self.counts[seq_id] = count

    def release(self, seq_id: int, window: int, count: int | None = None) -> None:
        """``release_outside_window`` of one sequence, its next query at ``count`` (by default
        its token count, the store's default)."""
        self.store.release_outside_window([seq_id], window, None if count is None else [count])
        count = self.counts[seq_id] if count is None else count
        self.tables[seq_id] = self.spec.release_outside_window(self.tables[seq_id], count, window)

    def grow(
        self, steps: dict[int, int], method: str = "grow", decode: bool = False, expect: Any = ANY
    ) -> Any:
        """The store's ``method`` (no victim expected) against ``append_slot`` per id, planned on
        a copy of the spec: the ids not grown, or the error class both raise. ``decode``: every
        step is 1, passed as one int (the store's decode step)."""
        assert not decode or set(steps.values()) == {1}
        spec, tables, counts = copy.deepcopy(self.spec), dict(self.tables), dict(self.counts)

        def plan() -> list[int]:
            failed = []
            for seq_id, step in steps.items():
                try:
                    tables[seq_id] = spec.append_slot(tables[seq_id], counts[seq_id] + step, step)
                    counts[seq_id] += step
                except spec_bm.OutOfBlocksError:
                    failed.append(seq_id)
            return failed

        planned = outcome(plan)
        grow = getattr(self.store, method)
        assert outcome(grow, list(steps), 1 if decode else list(steps.values())) == planned
        if planned[0] == "ok":
            self.spec, self.tables, self.counts = spec, tables, counts
        return expected(planned[1], expect, planned[0] == "raised")

    def pop(self, expect: Any = ANY) -> list[list[int]]:
        pairs = self.store.pop_copy_pairs().tolist()
        assert pairs == [list(pair) for pair in self.spec.pop_copy_pairs()]
        return expected(pairs, expect)

    def lookup(self, tokens: list[int], expect: Any = ANY) -> list[int]:
        found = self.manager.lookup(tokens)
        assert found == self.spec.lookup(tokens)
        return expected(found, expect)

    def attr(self, name: str, expect: Any = ANY) -> Any:
        """A manager attribute (dotted names too), the same on both."""
        value = operator.attrgetter(name)(self.manager)
        assert value == operator.attrgetter(name)(self.spec)
        return expected(value, expect)

    def check(self) -> None:
        assert {s: self.store.table(s) for s in self.tables} == self.tables
        assert {s: self.store.token_count(s) for s in self.counts} == self.counts
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
