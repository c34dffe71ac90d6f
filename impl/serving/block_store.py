"""What the scheduler needs from a store of block tables: the :class:`BlockStore` protocol.

:class:`pagedkv.impl.blocks.store.BlockTableStore` implements it over a paged pool; the
serving simulator's contiguous store (``bench/simulator.py``) implements it over contiguous
reservations. The scheduler calls nothing else, so any store with these members can be
scheduled, and the scheduler never reaches a block manager.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
from numpy.typing import NDArray


class LiveRows(Protocol):
    """The rows of a store's live sequences, in the order added."""

    @property
    def rows(self) -> NDArray[np.intp]: ...


@runtime_checkable
class BlockStore(Protocol):
    """Block tables of sequences keyed by int ids, over a pool of ``total_blocks`` blocks.

    Contract (``BlockTableStore`` documents each in full): a call that raises changes nothing;
    ``admit`` counts what the prompt takes from ``num_free_blocks`` after prefix-cache hits.
    The live sequences keep the order they were added in (a removal keeps the others' order),
    which is the scheduler's running order.
    """

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        ...

    @property
    def max_seqs(self) -> int:
        """Sequences the store can hold at once."""
        ...

    @property
    def max_blocks_per_seq(self) -> int:
        """Blocks one sequence's table can hold."""
        ...

    @property
    def total_blocks(self) -> int:
        """Blocks in the pool."""
        ...

    @property
    def num_free_blocks(self) -> int:
        """Blocks free now."""
        ...

    @property
    def prefix_caching(self) -> bool:
        """Whether ``cache_blocks`` registers anything: without a prefix cache the scheduler
        skips it."""
        ...

    def row(self, seq_id: int) -> int:
        """The row that holds the live sequence ``seq_id`` (``KeyError`` for another), kept
        until it is removed: the index of the scheduler's step columns."""
        ...

    def resolve(self, seqs: None) -> LiveRows:
        """``None``: the rows of every live sequence, in the order added."""
        ...

    def token_counts_of(self, seqs: Sequence[int] | None) -> Sequence[int]:
        """Tokens each of ``seqs`` holds; ``None`` is every live sequence in the order added."""
        ...

    def admit(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        headroom: int = 0,
        extra_key: Hashable = None,
    ) -> int | None:
        """Add a sequence holding the prompt if at least ``headroom`` blocks stay free; return
        how many leading tokens are cached, or None (nothing changed). Only blocks cached
        under the same ``extra_key`` (a cache salt) can hit."""
        ...

    def grow_or_preempt(
        self, seqs: Sequence[int] | None, new_tokens: int | Sequence[int] = 1
    ) -> list[int]:
        """Grow each sequence in order, removing the last remaining one while one cannot grow
        (until it fits or was itself removed); return the removed ids, in removal order.
        ``None`` is every live sequence in the order added."""
        ...

    def fork(self, parent_id: int, child_id: int) -> None:
        """Add ``child_id`` sharing ``parent_id``'s blocks."""
        ...

    def remove(self, seqs: Sequence[int]) -> None:
        """Free the sequences' tables and forget them."""
        ...

    def undo_fork(self, child_ids: Sequence[int]) -> None:
        """Undo this step's ``fork`` calls that made ``child_ids``, as ``remove`` would; it
        cannot fail (no check, no block taken): the scheduler's undo when a later store call
        of its ``update`` fails."""
        ...

    def cache_blocks(
        self, seq_id: int, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Register the sequence's full blocks with a prefix cache, under ``extra_key`` (the
        one it was admitted with); return how many were new."""
        ...

    def release_outside_window(
        self,
        seqs: Sequence[int] | None,
        window: int,
        token_counts: int | Sequence[int] | None = None,
    ) -> None:
        """Sliding window: give back each sequence's leading blocks that no query from its
        next position on reads (``spec.block_manager.blocks_outside_window`` of that position,
        ``window`` and ``block_size``); ``token_counts`` gives each sequence's next position
        (default: its token count). The blocks are released as ``remove`` releases them and
        the table keeps its length; a later write into one of them raises. Releasing again at
        the same positions changes nothing. ``None`` is every live sequence in the order
        added."""
        ...


@runtime_checkable
class DraftStore(BlockStore, Protocol):
    """A :class:`BlockStore` that speculative decoding can draft into: tables grow by drafts
    and are cut back to the tokens kept (``BlockTableStore`` implements it)."""

    def grow(self, seqs: Sequence[int], new_tokens: Sequence[int]) -> list[int]:
        """Grow each sequence by its count, or leave it unchanged if the pool cannot; return
        the ids left unchanged."""
        ...

    def truncate(self, seqs: Sequence[int], token_counts: Sequence[int]) -> None:
        """Cut each sequence back to its count of tokens (never more than it holds)."""
        ...

    def undo_growth(self, seq_ids: Sequence[int], token_counts: Sequence[int]) -> None:
        """Undo this step's ``grow`` calls, as ``truncate`` would; it cannot fail (no check, no
        block taken): the undo of a failed speculative step."""
        ...
