"""Prefix caching of ``spec.prefix_cache``, on the array-backed block manager.

For any sequence of calls, :class:`PrefixCachingBlockManager` returns what the spec's class
returns, raises the spec's exception classes in the spec's precedence, and leaves the same free
queue, reference counts, cached keys and counters. Keys are the spec's own
:class:`spec.prefix_cache.BlockKey` objects (structural equality, injectable ``hash_fn``), so
``key_of`` and ``cached_block`` are interchangeable between spec and impl.

What differs is cost (docs/design.md §9, "Prefix caching", gives each figure): revival is an
O(1) free-queue removal, lookup is O(prompt length) because computed keys take the cached key
objects (:meth:`PrefixCachingBlockManager._chain`), registration skips hashing a block that
already carries its key, and eviction is the pool's hook (:meth:`PrefixCachingBlockManager.evict`).

State beyond the block manager's arrays: two dicts over cached blocks only (block id -> key,
key -> block id), and the counters. A manager with nothing cached costs what a plain one does.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.pool import IdArray
from pagedkv.spec.block_manager import blocks_needed
from pagedkv.spec.checks import (
    BlockTableError,
    check_available,
    check_block_id,
    check_int,
    check_tokens,
)
from pagedkv.spec.prefix_cache import (
    AllBlocksCleared,
    BlockKey,
    BlockRemoved,
    BlockStored,
    KVEvent,
    PrefixCacheStats,
    check_extra_key,
    default_block_hash,
)

__all__ = [
    "AllBlocksCleared",
    "BlockKey",
    "BlockRemoved",
    "BlockStored",
    "KVEvent",
    "PrefixCacheStats",
    "PrefixCachingBlockManager",
]

HashFn = Callable[[BlockKey | None, tuple[int, ...], Hashable], int]


class PromptPlan(NamedTuple):
    """What ``allocate_prompt`` will do for one prompt, decided before anything changes."""

    hits: IdArray  # the cached prefix's blocks, in table order
    revived: IdArray  # those of the hits that no table holds (ref_count 0)
    num_waiting: int  # of those, how many wait for a copy (not in the free queue)
    num_blocks: int  # the prompt's table length, ceil(len / block_size)
    queried: int  # full blocks that count as looked up (max_hit_blocks)
    cached_tokens: int  # len(hits) * block_size
    keys: tuple[BlockKey, ...]  # every full block's key, cached objects where cached

    @property
    def needed(self) -> int:
        """Free blocks consumed: the fresh ones plus the revived ones from the free queue."""
        return self.num_blocks - self.hits.size + self.revived.size - self.num_waiting


class PrefixCachingBlockManager:
    """``spec.prefix_cache.PrefixCachingBlockManager``'s behaviour, composed of a
    :class:`~pagedkv.impl.blocks.manager.BlockManager` (``blocks``) and the key maps.

    The block manager's API is ``blocks``'s, on the same ``pool``, whose eviction hook is this
    manager: every block taken for a new owner loses its key. ``append_slot`` and ``truncate``
    add the spec's key rules to it.

    Invariants (as in the spec): ``cached_block(key) == b`` exactly when ``key_of(b) == key``;
    a cached block is held, in the free queue or waiting for a copy, once. Additionally, a
    cached key's parent is the cached key object of its parent block whenever that parent
    content was cached when the key was registered (which keeps comparisons one level deep).

    ``hash_fn`` must depend only on the content of its arguments, as any ``__hash__`` must:
    impl passes it a cached parent key where the spec passes an equal fresh one, and does not
    call it again for a key a block of the table being registered already carries.

    :class:`pagedkv.impl.blocks.store.BlockTableStore` drives it through the unchecked methods
    at the end of the class (their contract is written there).
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        hash_fn: HashFn = default_block_hash,
        enable_kv_events: bool = False,
    ) -> None:
        self.blocks = BlockManager(total_blocks, block_size)
        self.total_blocks = self.blocks.total_blocks
        self.block_size = self.blocks.block_size
        self.pool = self.blocks.pool
        if not isinstance(enable_kv_events, bool):
            raise TypeError(
                f"enable_kv_events must be a bool, got {type(enable_kv_events).__name__}"
            )
        self.pool.evictor = self  # every block handed to a new owner loses its key
        self.hash_fn = hash_fn
        self._key_of: dict[int, BlockKey] = {}  # block id -> key, cached blocks only
        self._block_of: dict[BlockKey, int] = {}  # key -> block id
        self.stats = PrefixCacheStats()
        self.enable_kv_events = enable_kv_events
        self._events: list[KVEvent] = []

    # ----------------------------------------------------------------- the block manager's
    # BlockManager's operations on ``blocks`` (so on the same pool, whose evictor this is).

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue, cached ones included (``BlockManager.num_free_blocks``)."""
        return self.blocks.num_free_blocks

    @property
    def usage(self) -> float:
        """``BlockManager.usage``: the fraction of the pool not free."""
        return self.blocks.usage

    def can_allocate(self, num_blocks: int) -> bool:
        return self.blocks.can_allocate(num_blocks)

    def ref_count(self, block_id: int) -> int:
        return self.blocks.ref_count(block_id)

    def ref_counts(self) -> NDArray[np.int32]:
        return self.blocks.ref_counts()

    def free_block_ids(self) -> list[int]:
        return self.blocks.free_block_ids()

    @property
    def waiting_for_copy(self) -> list[int]:
        return self.blocks.waiting_for_copy

    def pending_copy_pairs(self) -> list[tuple[int, int]]:
        return self.blocks.pending_copy_pairs()

    def pop_copy_pairs(self) -> list[tuple[int, int]]:
        return self.blocks.pop_copy_pairs()

    def allocate(self, num_blocks: int) -> list[int]:
        """``BlockManager.allocate``: the taken blocks lose their keys."""
        return self.blocks.allocate(num_blocks)

    def fork(self, block_table: Sequence[int | None]) -> list[int | None]:
        return self.blocks.fork(block_table)

    def free(self, block_table: Sequence[int | None]) -> None:
        """``BlockManager.free``: freed cached blocks stay cached, revivable."""
        self.blocks.free(block_table)

    def release_outside_window(
        self, block_table: Sequence[int | None], token_count: int, window: int
    ) -> list[int | None]:
        """``BlockManager.release_outside_window``: released cached blocks stay cached."""
        return self.blocks.release_outside_window(block_table, token_count, window)

    def translate_slot(self, block_table: Sequence[int | None], token_pos: int) -> int:
        return self.blocks.translate_slot(block_table, token_pos)

    # ----------------------------------------------------------------- keys and lookup

    def block_keys(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids``, in order (a partial last block has none)."""
        return self._chain(check_tokens(token_ids), extra_key)[0]

    def lookup(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[int]:
        """Block ids of the longest cached prefix of full blocks, changing nothing.

        At most ``max_hit_blocks(len(token_ids))`` blocks; the search stops at the first miss.
        """
        return self.plan_prompt(token_ids, extra_key).hits.tolist()

    def max_hit_blocks(self, prompt_len: int) -> int:
        """Rule: the last prompt token is always recomputed, so at most this many blocks hit.
        ``prompt_len`` is an int >= 0 (``TypeError``/``ValueError`` otherwise), as in the spec."""
        return max(0, check_int("prompt_len", prompt_len, 0) - 1) // self.block_size

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Free blocks ``allocate_prompt`` would consume: fresh blocks plus revived cached ones."""
        return self.plan_prompt(token_ids, extra_key).needed

    def key_of(self, block_id: int) -> BlockKey | None:
        """The key a block is cached under, or None."""
        return self._key_of.get(check_block_id(block_id, self.total_blocks))

    def cached_block(self, key: BlockKey) -> int | None:
        """The block cached under ``key``, or None."""
        return self._block_of.get(key)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a key (held or free)."""
        return len(self._key_of)

    def take_events(self) -> list[KVEvent]:
        """Return and forget the KV events since the last call, oldest first (always empty with
        ``enable_kv_events=False``): the spec's events, in the spec's order."""
        events, self._events = self._events, []
        return events

    def take_stats(self) -> PrefixCacheStats:
        """Return the counters and start new ones at zero (a snapshot resets when read)."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    def plan_prompt(
        self,
        token_ids: Sequence[int],
        extra_key: Hashable = None,
        keys: Sequence[BlockKey] | None = None,
    ) -> PromptPlan:
        """Validate a prompt and find its hits: what ``allocate_prompt`` would do, changing
        nothing. ``TypeError``/``ValueError`` for token ids that are not non-negative ints.

        ``keys``, from an earlier plan of the same tokens and ``extra_key``, skips hashing:
        the lookup is then one dict probe per block (an unchecked argument: they must be that
        plan's keys).
        """
        tokens = check_tokens(token_ids)
        queried = self.max_hit_blocks(len(tokens))
        if keys is None:
            chain, cached = self._chain(tokens, extra_key)
            keys = tuple(chain)
        else:
            cached = [self._block_of.get(key) for key in keys[:queried]]
        cached = cached[:queried]
        num_hits = cached.index(None) if None in cached else len(cached)
        hits = np.array(cached[:num_hits], dtype=np.intp)
        revived = hits[self.pool.refs[hits] == 0]
        waiting = self.pool.waiting
        num_waiting = sum(b in waiting for b in revived.tolist()) if waiting else 0
        num_blocks = blocks_needed(len(tokens), self.block_size)
        return PromptPlan(
            hits, revived, num_waiting, num_blocks, queried, num_hits * self.block_size,
            tuple(keys),
        )  # fmt: skip

    # ----------------------------------------------------------------- operations

    def reset_prefix_cache(self) -> bool:
        """The spec's ``reset_prefix_cache``: forget every cached key if no block is held."""
        if self.pool.num_free != self.total_blocks:
            return False
        self._key_of.clear()
        self._block_of.clear()
        self.stats.resets += 1
        if self.enable_kv_events:
            self._events.append(AllBlocksCleared())
        return True

    def allocate_prompt(
        self, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> tuple[list[int], int]:
        """The spec's ``allocate_prompt``: a table for a prompt, reusing its cached prefix;
        returns (table, cached tokens). All-or-nothing."""
        plan = self.plan_prompt(token_ids, extra_key)
        check_available(plan.needed, self.pool.num_free)
        fresh = self.apply_prompt_plan(plan)
        return plan.hits.tolist() + fresh.tolist(), plan.cached_tokens

    def cache_blocks(
        self,
        block_table: Sequence[int | None],
        token_ids: Sequence[int],
        extra_key: Hashable = None,
    ) -> int:
        """The spec's ``cache_blocks``: register the full blocks of a live table, now holding
        ``token_ids``; return how many were newly cached."""
        released, ids, _ = self.blocks.read_live_table(block_table)
        tokens = check_tokens(token_ids)
        table = [None] * released + ids.tolist()
        keys = self._chain(tokens, extra_key, table)[0]
        if len(tokens) > len(table) * self.block_size:
            raise ValueError(
                f"{len(tokens)} tokens do not fit a table of {len(table)} blocks "
                f"of {self.block_size}"
            )
        held = table[released : len(keys)]
        return self.register_table_blocks(held, keys[released:])[0]

    def append_slot(
        self, block_table: Sequence[int], token_count: int, new_tokens: int = 1
    ) -> list[int]:
        """The spec's ``append_slot``: a cached block is never written in place."""
        table = self.blocks.append_slot(block_table, token_count, new_tokens)
        if self._key_of:
            first = (token_count - new_tokens) // self.block_size
            end = blocks_needed(token_count, self.block_size) if new_tokens else first
            self.remove_keys(table[first:end])
        return table

    def truncate(self, block_table: Sequence[int | None], token_count: int) -> list[int | None]:
        """The spec's ``truncate``: a cut cached block held by this table alone loses its key."""
        table = self.blocks.truncate(block_table, token_count)
        cut = table[-1] if token_count % self.block_size else None  # the kept block cut into
        if cut is not None and self._key_of and self.pool.refs[cut] == 1:
            self.remove_keys([cut])
        return table

    # ----------------------------------------------------------------- internals

    def _chain(
        self, tokens: Sequence[int], extra_key: Hashable, table: Sequence[int] = ()
    ) -> tuple[list[BlockKey], list[int | None]]:
        """The full blocks' keys and, for each, the block cached under it (or None); first
        :func:`check_extra_key`, as the spec's ``block_keys`` does.

        A key found in the cache is replaced by the cached object, so the next key's parent is
        that object and comparing it with its cached equal stops after one level. Where
        ``table``'s block at the same index already carries this key (the same parent and
        extra objects, equal tokens), that key is taken without hashing, so registering again a
        sequence whose prefix is cached costs a tuple comparison per cached block.
        """
        check_extra_key(extra_key, self.hash_fn)
        size = self.block_size
        keys: list[BlockKey] = []
        cached: list[int | None] = []
        parent = None
        for index, start in enumerate(range(0, len(tokens) - size + 1, size)):
            chunk = tuple(tokens[start : start + size])
            held = self._key_of.get(table[index]) if index < len(table) else None
            if (
                held is not None
                and held.parent is parent
                and held.extra is extra_key
                and held.tokens == chunk
            ):
                key, block_id = held, table[index]
            else:
                key = BlockKey(parent, chunk, extra_key, self.hash_fn(parent, chunk, extra_key))
                block_id = self._block_of.get(key)
                if block_id is not None:
                    key = self._key_of[block_id]
            keys.append(key)
            cached.append(block_id)
            parent = key
        return keys, cached

    # ----------------------------------------------------------------- unchecked API
    #
    # Contract, as for the pool (pagedkv.impl.blocks.pool): no argument is checked. Safe for
    # BlockTableStore because it applies a plan in the same call that made it (nothing changes
    # in between), after comparing ``plan.needed`` with ``num_free_blocks``, and registers only
    # ids read from one of its own live tables, with token ids that ``check_tokens`` passed.

    def apply_prompt_plan(self, plan: PromptPlan) -> IdArray:
        """Carry out the plan just made by :meth:`plan_prompt`, with no change to the manager
        since and ``plan.needed <= num_free_blocks``; return the fresh blocks, in table order."""
        self.stats.queried_blocks += plan.queried
        self.stats.hit_blocks += plan.hits.size
        self.pool.revive(plan.hits, plan.revived)  # distinct: one block per key
        return self.pool.take(plan.num_blocks - plan.hits.size)

    def extend_block_keys(
        self, keys: Sequence[BlockKey], tokens: Sequence[int], extra_key: Hashable
    ) -> list[BlockKey]:
        """The keys of ``tokens``' full blocks after the first ``len(keys)``, chained from
        ``keys[-1]`` (``keys``: the keys of those first blocks, for the same ``extra_key``;
        ``tokens``: checked). A key found in the cache is the cached object. Changes nothing."""
        size = self.block_size
        parent = keys[-1] if keys else None
        new: list[BlockKey] = []
        for start in range(len(keys) * size, len(tokens) - size + 1, size):
            chunk = tuple(tokens[start : start + size])
            key = BlockKey(parent, chunk, extra_key, self.hash_fn(parent, chunk, extra_key))
            holder = self._block_of.get(key)
            parent = key if holder is None else self._key_of[holder]
            new.append(parent)
        return new

    def register_table_blocks(
        self, blocks: Sequence[int], keys: Sequence[BlockKey]
    ) -> tuple[int, list[int]]:
        """``cache_blocks``'s rule for the held blocks ``blocks[i]``, whose content is
        ``keys[i]``: a block cached under its key already stays; one whose key is cached in
        another block stays uncached (its index is returned, to retry when that block is
        evicted); any other is registered. ``BlockTableError``, changing nothing, if a block
        is cached under another key. Returns (blocks newly cached, indices left uncached)."""
        holders = [self._block_of.get(key) for key in keys]
        for index, block_id in enumerate(blocks):
            if holders[index] != block_id and block_id in self._key_of:
                raise BlockTableError(f"block {block_id} is cached with other tokens")
        newly_cached, skipped = 0, []
        events = self._events if self.enable_kv_events else None
        for index, block_id in enumerate(blocks):
            key, holder = keys[index], holders[index]
            if holder is None:
                self._key_of[block_id] = key
                self._block_of[key] = block_id
                if events is not None:
                    events.append(BlockStored(block_id, key))
                newly_cached += 1
            elif holder != block_id:
                skipped.append(index)
        return newly_cached, skipped

    def cached_among(self, ids: IdArray) -> set[int]:
        """The blocks among ``ids`` (in range) that carry a key: one C-level set intersection."""
        return self._key_of.keys() & ids.tolist() if self._key_of else set()

    def remove_keys(self, blocks: Sequence[int]) -> None:
        """Each of the held ``blocks`` that is cached loses its key, in order (not an
        eviction): the key rule of ``append_slot`` for blocks about to be written in place, and
        of ``truncate`` for a cut block held by one table alone."""
        for block_id in blocks:
            if block_id in self._key_of:
                self._remove_key(block_id)

    def evict_one(self, block_id: int) -> None:
        """:meth:`evict` for one block."""
        if block_id in self._key_of:
            self._remove_key(block_id)
            self.stats.evictions += 1

    def evict(self, taken: IdArray) -> None:
        """Rule: a block handed to a new owner loses its key (LRU eviction via the FIFO queue).
        The pool calls it with every block it hands out, in queue order."""
        if self._key_of:
            ids = taken.tolist()
            evicted = self._key_of.keys() & ids
            if evicted and self.enable_kv_events:  # the events follow the queue's order
                evicted = [block_id for block_id in ids if block_id in evicted]
            for block_id in evicted:
                self._remove_key(block_id)
            self.stats.evictions += len(evicted)

    def _remove_key(self, block_id: int) -> None:
        """Forget a cached block's key, with its ``BlockRemoved`` event when events are on."""
        key = self._key_of.pop(block_id)
        del self._block_of[key]
        if self.enable_kv_events:
            self._events.append(BlockRemoved(block_id, key))
