"""Executable specification of prefix caching on top of the block manager's reference counts.

A FULL block whose K/V has been computed can be *cached*: it is registered under a key naming its
exact content, ``key = (parent block's key, the block's token ids, extra key)``. The key chains
over the whole prefix, so equal keys mean equal prefixes. A later prompt whose leading full blocks
have cached keys reuses those physical blocks instead of computing them again.

Keys are compared structurally (``BlockKey.__eq__`` compares content), so a hash collision can
never return a block with other tokens; ``hash_fn`` is injectable to prove it. The default hash
is stable: the same key has the same hash in every process (a router may compare hashes sent by
other instances), where Python's ``hash()`` of a ``str`` is salted per process.

The extra key carries what else decides a block's content besides its tokens: a per-request
cache salt (two tenants with different salts never share a block), a LoRA adapter, ...

Opt-in KV events (``enable_kv_events``) report every key stored and removed, in order, so
another process can mirror the key set (KV-aware routing); ``reset_prefix_cache`` forgets every
key when no block is held, and ``take_stats`` reads the counters and starts them again.

Under a sliding window (``release_outside_window``) the blocks that leave the window are
released like a freed table's: a cached one stays cached in the free queue and can be hit by the
next prompt with the same prefix. A hit still needs every earlier block of the prefix cached
(the keys chain), and the blocks of a hit that lie wholly before the window of the prompt's
first computed token are released again by the caller's next ``release_outside_window``.

The FIFO free queue doubles as the LRU list: a cached block whose ``ref_count`` drops to 0 stays
in the queue with its key and can still be hit (a hit *revives* it); a block taken from the head
of the queue for a new owner loses its key (*eviction*, least recently freed first).
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from pagedkv.spec.block_manager import BlockManager, blocks_needed
from pagedkv.spec.checks import (
    BlockTableError,
    check_available,
    check_block_id,
    check_int,
    check_tokens,
)


def canonical_extra(extra: object) -> object:
    """Rule: the value the default hash encodes for an extra key, equal for equal keys, so that
    keys that are equal (and so the same key, ``BlockKey.__eq__``) hash equal.

    None, a str and bytes are themselves. A bool, an int and a float that equals an int are
    that int (``1``, ``True`` and ``1.0`` are ``1``; ``0.0`` and ``-0.0`` are ``0``); any other
    float (``1.5``, ``inf``, ``nan``) is itself. A subclass of int, float, str or bytes
    (``numpy.str_``, ``numpy.float64``) is taken as its base value first (``spec.checks``'
    rule). A tuple is the tuple of its parts' values. Anything else (a ``frozenset``, an
    object, a list, a complex) raises ``TypeError`` naming ``extra_key``: its ``repr`` is not
    the same in every process, or has no equal-for-equal form.
    """
    if extra is None or type(extra) is str or type(extra) is bytes:
        return extra
    if type(extra) is tuple:
        return tuple(canonical_extra(part) for part in extra)
    if isinstance(extra, int):  # bool included: True == 1
        return operator.index(extra)
    if isinstance(extra, float):
        value = float(extra)
        return int(value) if value.is_integer() else value
    if isinstance(extra, str):
        return str.__str__(extra)
    if isinstance(extra, bytes):
        return bytes(extra)
    raise TypeError(
        "extra_key must be None, a bool, int, float, str or bytes, or a tuple of them, for "
        f"a hash that is stable across processes; got {type(extra).__name__}"
    )


def default_block_hash(parent: BlockKey | None, tokens: tuple[int, ...], extra: Hashable) -> int:
    """Stable hash of a block key's parts (design.md §8 states the recipe): BLAKE2b with an
    8-byte digest (``digest_size=8``, not a longer digest cut short) over the UTF-8 bytes of
    ``repr((parent_hash, tokens, canonical_extra(extra)))``, the digest read as a
    little-endian signed 64-bit int. ``parent_hash`` is None for a prompt's first block.

    Rule: the same parts give the same hash in every process and on every run (no
    ``PYTHONHASHSEED``), so a block's hash names its content across instances; equal extra
    keys give equal hashes (:func:`canonical_extra`). The parent enters through its hash, which
    already covers the whole prefix before it.
    """
    parent_hash = None if parent is None else parent.hash_value
    data = repr((parent_hash, tokens, canonical_extra(extra))).encode("utf-8")
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def check_extra_key(extra_key: object, hash_fn: Callable[..., int]) -> None:
    """Rule: a key that the default hash cannot encode stably (:func:`canonical_extra`) is
    refused by the first call that receives it, before anything changes, even when the tokens
    fill no block and so no key is hashed. Under another ``hash_fn`` the extra key is that
    function's to judge."""
    if hash_fn is default_block_hash:
        canonical_extra(extra_key)


def _same(a: Hashable, b: Hashable) -> bool:
    """Equality as tuple members compare: identity first, then ``==``."""
    return a is b or a == b


@dataclass(frozen=True)
class BlockKey:
    """The content of a full block and of everything before it, chained through ``parent``.

    Equality is structural: two keys are equal exactly when their token prefixes and extra keys
    are equal, whatever their hashes (the class's own ``__eq__`` and ``__hash__``, which
    ``dataclass`` keeps).
    """

    parent: BlockKey | None
    tokens: tuple[int, ...]
    extra: Hashable
    hash_value: int

    def __hash__(self) -> int:
        return self.hash_value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlockKey):
            return NotImplemented
        mine: BlockKey | None = self
        theirs: BlockKey | None = other
        while mine is not theirs:  # walk both chains to the root, without recursion
            if mine is None or theirs is None:
                return False
            if mine.tokens != theirs.tokens or not _same(mine.extra, theirs.extra):
                return False
            mine, theirs = mine.parent, theirs.parent
        return True


@dataclass
class PrefixCacheStats:
    """Counters a scheduler and a benchmark read. Block granularity."""

    queried_blocks: int = 0  # full blocks looked up by allocate_prompt
    hit_blocks: int = 0  # of those, found in the cache
    evictions: int = 0  # cached blocks that lost their key when reused from the head
    resets: int = 0  # reset_prefix_cache calls that forgot the keys


@dataclass(frozen=True)
class BlockStored:
    """KV event: ``block_id`` is now cached under ``key`` (its K/V can be hit)."""

    block_id: int
    key: BlockKey


@dataclass(frozen=True)
class BlockRemoved:
    """KV event: ``block_id`` no longer carries ``key`` (evicted for a new owner, or about to be
    overwritten)."""

    block_id: int
    key: BlockKey


@dataclass(frozen=True)
class AllBlocksCleared:
    """KV event: ``reset_prefix_cache`` forgot every key."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class PrefixCachingBlockManager(BlockManager):
    """A ``BlockManager`` whose full blocks can be found again by content.

    Extra invariants, true between any two calls:

    * ``cached_block(key) == block_id`` exactly when ``key_of(block_id) == key``: the key map and
      the blocks' keys are a bijection over cached blocks;
    * a cached block is either held (``ref_count >= 1``), in the free queue, or waiting for a
      copy, once;
    * the tokens under a block's key are the tokens written in that block;
    * with KV events on, replaying every event taken so far and still pending, in order, on an
      empty key map gives exactly the map from cached keys to their blocks.
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int = 16,
        hash_fn: Callable[[BlockKey | None, tuple[int, ...], Hashable], int] = default_block_hash,
        enable_kv_events: bool = False,
    ) -> None:
        super().__init__(total_blocks, block_size)
        if not isinstance(enable_kv_events, bool):
            raise TypeError(
                f"enable_kv_events must be a bool, got {type(enable_kv_events).__name__}"
            )
        self.hash_fn = hash_fn
        self._key_of: dict[int, BlockKey] = {}  # block id -> key, cached blocks only
        self._block_of: dict[BlockKey, int] = {}  # key -> block id
        self.stats = PrefixCacheStats()
        self.enable_kv_events = enable_kv_events
        self._events: list[KVEvent] = []

    # ----------------------------------------------------------------- keys and lookup

    def block_keys(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids``, in order (a partial last block has none).

        Rule: every key is built, and its hash checked, before anything uses one, so a
        ``hash_fn`` that raises or returns a non-int (``TypeError``) fails the whole call
        before it changes anything.
        """
        tokens = check_tokens(token_ids)  # read only: the keys hold tuples of its tokens
        check_extra_key(extra_key, self.hash_fn)
        keys: list[BlockKey] = []
        parent = None
        for start in range(0, len(tokens) - self.block_size + 1, self.block_size):
            chunk = tuple(tokens[start : start + self.block_size])
            hash_value = self.hash_fn(parent, chunk, extra_key)
            if not isinstance(hash_value, int):  # Rule: what __hash__ may return (bool too)
                raise TypeError(f"hash_fn must return an int, got {type(hash_value).__name__}")
            parent = BlockKey(parent, chunk, extra_key, hash_value)
            keys.append(parent)
        return keys

    def lookup(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[int]:
        """Block ids of the longest cached prefix of full blocks, changing nothing.

        Rule: at most ``max_hit_blocks(len(token_ids))`` blocks can hit (the last token's logits
        must be computed). Rule: the search stops at the first block that misses.
        """
        keys = self.block_keys(token_ids, extra_key)[: self.max_hit_blocks(len(token_ids))]
        hits: list[int] = []
        for key in keys:
            if key not in self._block_of:
                break
            hits.append(self._block_of[key])
        return hits

    def max_hit_blocks(self, prompt_len: int) -> int:
        """Rule: the last prompt token is always recomputed, so at most this many blocks hit.

        Rule: ``prompt_len`` is an int >= 0 (``TypeError``/``ValueError`` otherwise).
        """
        return max(0, check_int("prompt_len", prompt_len, 0) - 1) // self.block_size

    def blocks_to_allocate(self, token_ids: Sequence[int], extra_key: Hashable = None) -> int:
        """Free blocks ``allocate_prompt`` would consume: fresh blocks plus revived cached ones
        that are in the free queue (one waiting for a copy is not a free block)."""
        hits = self.lookup(token_ids, extra_key)
        fresh = -(-len(token_ids) // self.block_size) - len(hits)
        revived = sum(  # Rule: reviving a free block consumes it, as a fresh one does.
            1
            for block_id in hits
            if self.blocks[block_id].ref_count == 0 and block_id not in self.waiting_for_copy
        )
        return fresh + revived

    def key_of(self, block_id: int) -> BlockKey | None:
        """The key a block is cached under, or None."""
        check_block_id(block_id, self.total_blocks)
        return self._key_of.get(block_id)

    def cached_block(self, key: BlockKey) -> int | None:
        """The block cached under ``key``, or None."""
        return self._block_of.get(key)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that currently carry a key (held or free)."""
        return len(self._key_of)

    def take_events(self) -> list[KVEvent]:
        """Return and forget the KV events since the last call, oldest first (always empty with
        ``enable_kv_events=False``)."""
        events, self._events = self._events, []
        return events

    def take_stats(self) -> PrefixCacheStats:
        """Return the counters and start new ones at zero. Rule: a snapshot resets when read."""
        stats, self.stats = self.stats, PrefixCacheStats()
        return stats

    # ----------------------------------------------------------------- operations

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key if no block is held; return whether it did.

        Rule: while any block is held (some table is live), nothing changes and the answer is
        False: a live sequence's blocks are registered as they fill, so a reset then (after a
        weight update, say) would still let stale K/V be cached. Rule: otherwise every key is
        forgotten, the free queue keeps its order, ``stats.resets`` counts it, and one
        ``AllBlocksCleared`` event is emitted (no ``BlockRemoved`` per key).
        """
        if self.num_free_blocks != self.total_blocks:  # Rule: refuse while any block is not free.
            return False
        self._key_of.clear()
        self._block_of.clear()
        self.stats.resets += 1
        self._emit(AllBlocksCleared())
        return True

    def allocate_prompt(
        self, token_ids: Sequence[int], extra_key: Hashable = None
    ) -> tuple[list[int], int]:
        """Build a table for a prompt, reusing its cached prefix; return (table, cached tokens).

        Rule: hit blocks get one more owner (``ref_count + 1``); a hit block that was free is
        revived (it leaves the free queue, the rest of the queue keeps its order), and so is
        one waiting for a copy (it leaves the waiting blocks). Rule: the
        remaining blocks come from the head of the queue (evicting their old keys). Rule:
        all-or-nothing: if ``blocks_to_allocate`` exceeds the free blocks, ``OutOfBlocksError``
        is raised and nothing changes (counters included).
        """
        hits = self.lookup(token_ids, extra_key)
        check_available(self.blocks_to_allocate(token_ids, extra_key), self.num_free_blocks)
        self.stats.queried_blocks += self.max_hit_blocks(len(token_ids))
        self.stats.hit_blocks += len(hits)
        for block_id in hits:
            if self.blocks[block_id].ref_count == 0 and block_id in self.waiting_for_copy:
                self.waiting_for_copy.remove(block_id)  # Rule: its content is still valid.
            elif self.blocks[block_id].ref_count == 0:
                self.free_queue.remove(block_id)  # Rule: the rest of the queue keeps its order.
            self.blocks[block_id].ref_count += 1
        fresh = self._take_from_head(-(-len(token_ids) // self.block_size) - len(hits))
        return hits + fresh, len(hits) * self.block_size

    def cache_blocks(
        self,
        block_table: Sequence[int | None],
        token_ids: Sequence[int],
        extra_key: Hashable = None,
    ) -> int:
        """Register the full blocks of a live table, now holding ``token_ids``; return how many.

        Call it once a block's K/V is written: after a prefill, and when decode fills a block.
        Rule: a block whose key is already cached in another block stays uncached (one physical
        copy per content). Rule: a block cached under a different key holds other tokens:
        ``BlockTableError``, nothing changes. Rule: released entries (sliding window) are
        skipped; the keys after them still chain over the whole prefix.
        """
        table = self.check_live_table(block_table)
        keys = self.block_keys(token_ids, extra_key)
        if len(token_ids) > len(table) * self.block_size:
            raise ValueError(
                f"{len(token_ids)} tokens do not fit a table of {len(table)} blocks "
                f"of {self.block_size}"
            )
        held = [(b, key) for b, key in zip(table, keys, strict=False) if b is not None]
        for block_id, key in held:  # Rule: released entries are skipped; they hold nothing.
            if self._key_of.get(block_id, key) != key:
                raise BlockTableError(f"block {block_id} is cached with other tokens")
        newly_cached = 0
        for block_id, key in held:
            if block_id not in self._key_of and key not in self._block_of:
                self._key_of[block_id] = key
                self._block_of[key] = block_id
                self._emit(BlockStored(block_id, key))  # Rule: in table order.
                newly_cached += 1
        return newly_cached

    def append_slot(
        self, block_table: Sequence[int], token_count: int, new_tokens: int = 1
    ) -> list[int]:
        """``BlockManager.append_slot``, and a cached block is never written in place.

        Rule: a written block that is cached and held by this table alone loses its key before
        the write (its content is about to change; this is not an eviction). A cached block
        with other holders is copied on write like any shared block, and keeps its key. Only
        after a ``truncate`` can a write reach a cached block: one whose other holders have let
        it go since.
        """
        table = super().append_slot(block_table, token_count, new_tokens)
        first = (token_count - new_tokens) // self.block_size
        end = blocks_needed(token_count, self.block_size) if new_tokens else first
        for block_id in table[first:end]:  # the written blocks (copies and growth are fresh)
            if block_id in self._key_of:
                self._remove_key(block_id)  # Rule: a cached block is never written in place.
        return table

    def truncate(self, block_table: Sequence[int | None], token_count: int) -> list[int | None]:
        """``BlockManager.truncate``: dropped cached blocks that reach 0 stay cached in the free
        queue (revivable), as with ``free``.

        Rule: a kept last block that ``token_count`` cuts into (``token_count % block_size !=
        0``), that is cached and that only this table holds, loses its key: its tail is about to
        be written with other tokens. This is not an eviction (``stats.evictions`` counts blocks
        reused from the head). Rule: a cut block that other tables hold keeps its key: the next
        write into it copies it, or, if by then this table holds it alone, removes the key
        (``append_slot``).
        """
        table = super().truncate(block_table, token_count)
        if token_count % self.block_size:  # the kept last block is cut into
            cut = table[-1]
            if cut is not None and self.blocks[cut].ref_count == 1 and cut in self._key_of:
                self._remove_key(cut)  # Rule: a cut block held alone loses its key.
        return table

    def _take_from_head(self, num_blocks: int) -> list[int]:
        """Rule: a block handed to a new owner loses its key (LRU eviction via the FIFO queue)."""
        taken = super()._take_from_head(num_blocks)
        for block_id in taken:
            if block_id in self._key_of:
                self._remove_key(block_id)
                self.stats.evictions += 1
        return taken

    def _remove_key(self, block_id: int) -> None:
        """Forget a cached block's key. Rule: a ``BlockRemoved`` event, in removal order."""
        key = self._key_of.pop(block_id)
        del self._block_of[key]
        self._emit(BlockRemoved(block_id, key))

    def _emit(self, event: KVEvent) -> None:
        """Rule: events are recorded only when enabled."""
        if self.enable_kv_events:
            self._events.append(event)
