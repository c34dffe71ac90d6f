"""Admission: a new sequence's first blocks, planned against the pool or the prefix cache and
placed in a free row.

:class:`Admission` carries out ``BlockTableStore.add``, ``add_prompt`` and ``admit``, whose
docstrings are the contract. Every check comes first (the prompt fits a table, a row is free,
the pool holds the blocks), so a call that raises or is refused changes nothing. With prefix
caching a prompt is planned once by the store's
:class:`~pagedkv.impl.blocks.prefix_store.PrefixStore`, which also carries the plan out.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedkv.impl.blocks.pool import BlockPool
from pagedkv.impl.blocks.prefix_cache import PromptPlan
from pagedkv.impl.blocks.prefix_store import PrefixStore
from pagedkv.impl.blocks.rows import CapacityError, SeqRows
from pagedkv.spec.block_manager import blocks_needed
from pagedkv.spec.checks import OutOfBlocksError, check_int, check_tokens


class Admission:
    """Adds sequences to one store's ``rows``, taking blocks from ``pool`` (or, with
    ``prefix``, planning them against the prefix cache)."""

    def __init__(self, pool: BlockPool, prefix: PrefixStore | None, rows: SeqRows) -> None:
        self.pool = pool
        self.prefix = prefix
        self.rows = rows

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable) -> int:
        """Free blocks adding the prompt ``token_ids`` would take now."""
        if self.prefix is not None:
            return self.prefix.manager.blocks_to_allocate(token_ids, extra_key)
        return blocks_needed(len(check_tokens(token_ids)), self.rows.block_size)

    def add(self, seq_id: int, prompt_len: int) -> None:
        """A sequence of ``prompt_len`` tokens in fresh blocks."""
        seq_id = self.rows.check_new(seq_id)
        check_int("prompt_len", prompt_len, 0)
        needed = blocks_needed(prompt_len, self.rows.block_size)
        self._check_room(seq_id, needed, needed)
        self.rows.place(seq_id, self.pool.take(needed), prompt_len)

    def add_prompt(self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable) -> int:
        """A sequence holding the prompt ``token_ids``; returns its cached tokens."""
        seq_id = self.rows.check_new(seq_id)
        if self.prefix is None:
            self.add(seq_id, len(check_tokens(token_ids)))
            return 0
        plan = self.prefix.plan(token_ids, extra_key, retry=False)
        self._check_room(seq_id, plan.num_blocks, plan.needed)
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def admit(
        self, seq_id: int, token_ids: Sequence[int], headroom: int, extra_key: Hashable
    ) -> int | None:
        """``add_prompt`` if it leaves ``headroom`` blocks free and a row is free, else None."""
        seq_id = self.rows.check_new(seq_id)
        check_int("headroom", headroom, 0)
        free = self.pool.num_free
        if self.prefix is None:
            needed = blocks_needed(len(check_tokens(token_ids)), self.rows.block_size)
            self._check_fits(needed, seq_id)
            if not self.rows.free_rows or free - needed < headroom:
                return None
            self.rows.place(seq_id, self.pool.take(needed), len(token_ids))
            return 0
        plan = self.prefix.plan(token_ids, extra_key, retry=True)
        self._check_fits(plan.num_blocks, seq_id)
        if not self.rows.free_rows or free - plan.needed < headroom:
            self.prefix.refuse(token_ids, extra_key, plan)
            return None
        return self._add_planned(seq_id, token_ids, extra_key, plan)

    def _check_room(self, seq_id: int, num_blocks: int, free_blocks: int) -> None:
        """A new table of ``num_blocks`` blocks, ``free_blocks`` of them from the free queue."""
        self._check_fits(num_blocks, seq_id)
        if not self.rows.free_rows:
            raise CapacityError(f"all {self.rows.tables.shape[0]} rows hold live sequences")
        if free_blocks > self.pool.num_free:
            raise OutOfBlocksError(
                f"asked for {free_blocks} blocks but only {self.pool.num_free} are free"
            )

    def _check_fits(self, num_blocks: int, seq_id: int) -> None:
        if num_blocks > self.rows.width:
            raise CapacityError(
                f"sequence {seq_id} would need {num_blocks} blocks, more than "
                f"max_blocks_per_seq={self.rows.width}"
            )

    def _add_planned(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable, prompt: PromptPlan
    ) -> int:
        """Carry out a prompt plan just made (room checked); return the cached tokens."""
        blocks = self.prefix.admit(seq_id, token_ids, extra_key, prompt)  # type: ignore[union-attr]
        self.rows.place(seq_id, blocks, len(token_ids))
        return prompt.cached_tokens
