"""Admission: a new sequence's first blocks, planned against the pool or the prefix cache and
placed in a free row.

:class:`Admission` carries out ``BlockTableStore.add``, ``add_prompt`` and ``admit``, whose
docstrings are the contract. Every check comes first (the prompt fits a table, a row is free,
the pool holds the blocks), so a call that raises or is refused changes nothing. With a
prefix-caching manager a prompt is planned once (``plan_prompt``): ``admit`` reuses a refused
prompt's block keys for its retry, and an admitted prompt's keys seed the sequence's
:mod:`~pagedkv.impl.blocks.block_hashes`.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np

from pagedkv.impl.blocks.batches import SeqIndex
from pagedkv.impl.blocks.block_hashes import BlockHashes
from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager, PromptPlan
from pagedkv.impl.blocks.tables import BlockTables, CapacityError
from pagedkv.spec.block_manager import blocks_needed
from pagedkv.spec.checks import OutOfBlocksError, check_int, check_tokens


class Admission:
    """Adds sequences to one store's ``tables`` and ``seqs``, taking blocks from ``pool`` (or,
    with ``prefix``, planning them against the prefix cache)."""

    def __init__(
        self,
        pool: BlockPool,
        prefix: PrefixCachingBlockManager | None,
        tables: BlockTables,
        seqs: SeqIndex,
        hashes: BlockHashes,
    ) -> None:
        self.pool = pool
        self.prefix = prefix
        self.tables = tables
        self.seqs = seqs
        self.hashes = hashes

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable) -> int:
        """Free blocks adding the prompt ``token_ids`` would take now."""
        if self.prefix is not None:
            return self.prefix.blocks_to_allocate(token_ids, extra_key)
        return blocks_needed(len(check_tokens(token_ids)), self.tables.block_size)

    def add(self, seq_id: int, prompt_len: int) -> None:
        """A sequence of ``prompt_len`` tokens in fresh blocks."""
        seq_id = self.seqs.check_new(seq_id)
        check_int("prompt_len", prompt_len, 0)
        needed = blocks_needed(prompt_len, self.tables.block_size)
        self._check_room(seq_id, needed, needed)
        self._place(seq_id, self.pool.take(needed), prompt_len)

    def add_prompt(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable) -> int:
        """A sequence holding the prompt ``token_ids``; returns its cached tokens."""
        seq_id = self.seqs.check_new(seq_id)
        if self.prefix is None:
            self.add(seq_id, len(check_tokens(token_ids)))
            return 0
        plan = self.prefix.plan_prompt(token_ids, extra_key)
        self._check_room(seq_id, plan.num_blocks, plan.needed)
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def admit(
        self, seq_id: int, token_ids: Sequence[int], headroom: int, extra_key: Hashable
    ) -> int | None:
        """``add_prompt`` if it leaves ``headroom`` blocks free and a row is free, else None."""
        seq_id = self.seqs.check_new(seq_id)
        check_int("headroom", headroom, 0)
        free = self.pool.num_free
        if self.prefix is None:
            needed = blocks_needed(len(check_tokens(token_ids)), self.tables.block_size)
            self._check_fits(needed, seq_id)
            if not self.tables.free_rows or free - needed < headroom:
                return None
            self._place(seq_id, self.pool.take(needed), len(token_ids))
            return 0
        known = self.hashes.keys_if_refused(token_ids, extra_key)
        plan = self.prefix.plan_prompt(token_ids, extra_key, known)
        self._check_fits(plan.num_blocks, seq_id)
        if not self.tables.free_rows or free - plan.needed < headroom:
            self.hashes.refuse(token_ids, extra_key, plan.keys)
            return None
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def _check_room(self, seq_id: int, num_blocks: int, free_blocks: int) -> None:
        """A new table of ``num_blocks`` blocks, ``free_blocks`` of them from the free queue."""
        self._check_fits(num_blocks, seq_id)
        if not self.tables.free_rows:
            raise CapacityError(f"all {self.tables.tables.shape[0]} rows hold live sequences")
        if free_blocks > self.pool.num_free:
            raise OutOfBlocksError(
                f"asked for {free_blocks} blocks but only {self.pool.num_free} are free"
            )

    def _check_fits(self, num_blocks: int, seq_id: int) -> None:
        if num_blocks > self.tables.width:
            raise CapacityError(
                f"sequence {seq_id} would need {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.tables.width}"
            )

    def _add_planned(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable, prompt: PromptPlan
    ) -> int:
        """Carry out a prompt plan just made (room checked); return the cached tokens."""
        fresh = self.prefix.apply_prompt_plan(prompt)  # type: ignore[union-attr]
        self._place(seq_id, np.concatenate((prompt.hits, fresh)), len(token_ids))
        self.hashes.admit(seq_id, token_ids, extra_key, prompt.keys)
        return prompt.cached_tokens

    def _place(self, seq_id: int, blocks: IdArray, token_count: int) -> None:
        """Give ``seq_id`` a free row holding ``blocks`` and ``token_count`` tokens."""
        self.seqs.add(seq_id, self.tables.place(blocks, token_count))
