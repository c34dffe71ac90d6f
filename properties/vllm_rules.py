"""Where vLLM's v1 KV-cache manager departs from pagedkv's spec: every divergence, named.

This module needs no vLLM. It holds two things the vLLM conformance machine
(``properties/machines/vllm.py``, run in ``.venv-vllm`` by ``properties/vllm_env.py``) uses:

* :data:`DIVERGENCES`: each known difference between vLLM 0.32 and the spec, with what each side
  does and how the adapter translates it. docs/design.md's "vLLM ↔ pagedkv" table has one row
  per entry (``properties/test_vllm_conformance.py`` checks it).
* :class:`VllmRules`: the spec's ``PrefixCachingBlockManager`` with the behavioural divergences
  switched on by name. With every rule off it is the spec, rule for rule: the rules only
  override what their rows describe, and everything else (the FIFO take from the head,
  all-or-nothing allocation, revival out of the middle of the queue, eviction on the take path,
  reference counts, the hit limit) is the spec's own code. The machine compares vLLM with this
  class exactly, so a difference that no rule names fails it.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedkv.spec.prefix_cache import BlockKey, PrefixCachingBlockManager

Content = tuple[Hashable, tuple[int, ...]]
"""What a cached block holds: ``(salt, the whole token prefix up to the block's end)``."""


@dataclass(frozen=True)
class Divergence:
    """One way vLLM departs from the spec."""

    name: str
    vllm: str  # what vLLM 0.32 does
    spec: str  # what pagedkv's spec does
    translation: str  # how the adapter or VllmRules accounts for it
    kind: str  # "rule" (VllmRules behaviour), "mapping" (adapter translation), "scope" (not driven)


NULL_BLOCK = "NULL_BLOCK"
UNCACHED_FREE_TO_HEAD = "UNCACHED_FREE_TO_HEAD"
DUPLICATES_CACHED = "DUPLICATES_CACHED"
NONE_ON_EXHAUSTION = "NONE_ON_EXHAUSTION"
FREE_BY_REQUEST = "FREE_BY_REQUEST"
HASH_IDENTITY = "HASH_IDENTITY"
HASH_GRANULARITY = "HASH_GRANULARITY"
SALT_IN_FIRST_BLOCK = "SALT_IN_FIRST_BLOCK"
REGISTER_ON_ALLOCATE = "REGISTER_ON_ALLOCATE"
TOKEN_COUNTERS = "TOKEN_COUNTERS"
EVICTIONS_AS_EVENTS = "EVICTIONS_AS_EVENTS"
NO_FORK = "NO_FORK"
NO_EMPTY_PROMPT = "NO_EMPTY_PROMPT"

DIVERGENCES: dict[str, Divergence] = {
    d.name: d
    for d in (
        Divergence(
            NULL_BLOCK,
            "BlockPool reserves block 0 as a placeholder (never allocated, never freed); a pool "
            "of n blocks holds n - 1 usable ones, ids 1 .. n - 1",
            "every block 0 .. n - 1 is usable",
            "vLLM gets n + 1 blocks for the spec's n; spec id = vLLM id - 1",
            "mapping",
        ),
        Divergence(
            UNCACHED_FREE_TO_HEAD,
            "a freed block with no hash (a partial block, or any block when caching is off) "
            "goes to the HEAD of the free queue, the table's last block at the very head; "
            "hashed blocks go to the tail, last block first",
            "every freed block goes to the tail, last block first",
            "VllmRules.free moves the freed blocks with no key from the tail to the head",
            "rule",
        ),
        Divergence(
            DUPLICATES_CACHED,
            "every full block is registered, even when another block already holds the same "
            "content; a hash maps to a list of blocks and a lookup returns the earliest "
            "registered one still cached",
            "a block whose content is already cached elsewhere stays uncached (one physical "
            "copy per content)",
            "VllmRules keeps its own key -> [blocks] registry, appends on registration, "
            "answers with the first block, removes a block when it is taken from the head",
            "rule",
        ),
        Divergence(
            NONE_ON_EXHAUSTION,
            "allocate_slots returns None when the free blocks do not cover the request, "
            "changing nothing",
            "OutOfBlocksError, changing nothing",
            "the adapter raises OutOfBlocksError for None; the machine checks vLLM's state is "
            "unchanged",
            "mapping",
        ),
        Divergence(
            FREE_BY_REQUEST,
            "free(request) looks the blocks up by request id; freeing a request again is a "
            "silent no-op",
            "free(table) takes the table; a stale table with a free block raises "
            "BlockTableError, and one whose blocks were all handed out again cannot be told "
            "from a live one",
            "the machine frees freed requests again and checks vLLM changes nothing; the spec "
            "is not called (its table API cannot express it)",
            "mapping",
        ),
        Divergence(
            HASH_IDENTITY,
            "a block's key is its hash (sha256 of parent hash, tokens, extra keys); equal "
            "hashes are taken as equal content",
            "keys compare structurally, so a collision can never return other tokens",
            "sha256 is used, under which no collision occurs; a planted colliding hash shows "
            "vLLM handing out a block with other tokens (test_a_hash_collision_...)",
            "scope",
        ),
        Divergence(
            HASH_GRANULARITY,
            "hashes are computed every hash_block_size tokens, which may be finer than the "
            "block size (then a prompt's last partial block can be hit, with copy-on-write)",
            "one key per full block; a partial block is never cached",
            "the adapter sets hash_block_size = block_size",
            "scope",
        ),
        Divergence(
            SALT_IN_FIRST_BLOCK,
            "the cache salt (a str) enters only the first block's hash, and reaches the rest "
            "through the chain",
            "the extra key is part of every block's key",
            "none needed: both make two salts share no block; the machine draws str salts",
            "scope",
        ),
        Divergence(
            REGISTER_ON_ALLOCATE,
            "allocate_slots registers the blocks the scheduled tokens fill, before their K/V "
            "is computed (or later with delay_cache_blocks and cache_blocks)",
            "cache_blocks is called once the block's K/V is written",
            "the adapter registers on the spec side right after each allocation, in the same "
            "order; bench_trace uses delay_cache_blocks to register after the step",
            "mapping",
        ),
        Divergence(
            TOKEN_COUNTERS,
            "PrefixCacheStats counts tokens: queries = the prompt's tokens, hits = the hit "
            "tokens, recorded by the scheduler at admission",
            "stats count blocks: queried_blocks = (len - 1) // block_size, hit_blocks",
            "hits = hit_blocks * block_size; queries = the admitted prompts' tokens",
            "mapping",
        ),
        Divergence(
            EVICTIONS_AS_EVENTS,
            "no eviction counter; each hash removed from a block is a BlockRemoved KV event "
            "(also when another block still holds that hash)",
            "stats.evictions counts cached blocks taken from the head",
            "evictions = the hashes in BlockRemoved events; a router must count stored and "
            "removed events per hash (a multiset), not keep a set",
            "mapping",
        ),
        Divergence(
            NO_FORK,
            "no fork or copy-on-write of a running request's blocks: n > 1 samples are separate "
            "requests that share the prompt through the prefix cache",
            "fork shares a table; append_slot copies a shared block on write, and a pending "
            "copy's source waits for its copy instead of joining the free queue",
            "the machine does not fork, so no pair is ever pending and no block waits",
            "scope",
        ),
        Divergence(
            NO_EMPTY_PROMPT,
            "an empty prompt is refused with ValueError: allocate_slots takes no 0 new "
            "tokens, and with caching on get_computed_blocks fails on it too",
            "lookup([]) == [] and allocate_prompt([]) == ([], 0)",
            "the machine admits prompts of at least one token and checks vLLM's lookup of an "
            "empty one raises ValueError where the spec answers []",
            "scope",
        ),
    )
}

BEHAVIOUR_RULES = frozenset(name for name, d in DIVERGENCES.items() if d.kind == "rule")
"""The divergences :class:`VllmRules` implements; the others are the adapter's mappings or
outside what the machine drives."""


def content_of_key(key: BlockKey) -> Content:
    """What a spec key names: ``(extra key, the whole token prefix)``."""
    levels: list[tuple[int, ...]] = []
    node: BlockKey | None = key
    while node is not None:
        levels.append(node.tokens)
        node = node.parent
    return key.extra, tuple(token for level in reversed(levels) for token in level)


class VllmRules(PrefixCachingBlockManager):
    """The spec with vLLM's behavioural divergences (:data:`BEHAVIOUR_RULES`) switched on by name.

    ``caching=False`` is vLLM with prefix caching off: nothing is looked up or registered, so
    the class is the spec's ``BlockManager`` (plus ``UNCACHED_FREE_TO_HEAD`` for every block).
    ``rules`` names the divergences in force; ``frozenset()`` is the spec unchanged.

    Contract: every public method keeps the spec's validation and all-or-nothing behaviour;
    only the rows' behaviours change.
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        caching: bool = True,
        rules: frozenset[str] = BEHAVIOUR_RULES,
    ) -> None:
        super().__init__(total_blocks, block_size)
        unknown = set(rules) - BEHAVIOUR_RULES
        if unknown:
            raise ValueError(f"not behavioural divergences: {sorted(unknown)}")
        self.caching = caching
        self.rules = frozenset(rules)
        # DUPLICATES_CACHED: content key -> the blocks registered under it, earliest first.
        self.registry: dict[BlockKey, list[int]] = {}
        self.registered_key: dict[int, BlockKey] = {}
        self.registry_evictions = 0

    # ------------------------------------------------------------ keys

    def is_cached(self, block_id: int) -> bool:
        """Whether a block carries a key (vLLM: has a block hash)."""
        if DUPLICATES_CACHED in self.rules:
            return block_id in self.registered_key
        return self.key_of(block_id) is not None

    def cached_contents(self) -> dict[Content, list[int]]:
        """Every cached content and the blocks that hold it, in lookup order."""
        if DUPLICATES_CACHED in self.rules:
            return {content_of_key(k): list(blocks) for k, blocks in self.registry.items()}
        contents: dict[Content, list[int]] = {}
        for block_id in range(self.total_blocks):
            key = self.key_of(block_id)
            if key is not None:
                contents[content_of_key(key)] = [block_id]
        return contents

    def content_of_block(self, block_id: int) -> Content | None:
        """The content a block is cached under, or None."""
        if DUPLICATES_CACHED in self.rules:
            key = self.registered_key.get(block_id)
        else:
            key = self.key_of(block_id)
        return None if key is None else content_of_key(key)

    @property
    def evictions(self) -> int:
        """Cached blocks that lost their key when taken from the head."""
        if DUPLICATES_CACHED in self.rules:
            return self.registry_evictions
        return self.stats.evictions

    def lookup(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[int]:
        """The spec's lookup; ``DUPLICATES_CACHED``: each key answers with its earliest block."""
        if not self.caching:
            return []
        if DUPLICATES_CACHED not in self.rules:
            return super().lookup(token_ids, extra_key)
        keys = self.block_keys(token_ids, extra_key)[: self.max_hit_blocks(len(token_ids))]
        hits: list[int] = []
        for key in keys:
            blocks = self.registry.get(key)
            if not blocks:  # Rule (spec): the search stops at the first miss.
                break
            hits.append(blocks[0])
        return hits

    def register(
        self, block_table: Sequence[int], token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """Register the table's full blocks now holding ``token_ids``; return how many.

        The spec's ``cache_blocks``; ``DUPLICATES_CACHED``: every full block without a key is
        appended to its content's list, whether or not another block holds that content.
        """
        if not self.caching:
            return 0
        if DUPLICATES_CACHED not in self.rules:
            return self.cache_blocks(block_table, token_ids, extra_key)
        table = self.check_live_table(block_table)
        keys = self.block_keys(token_ids, extra_key)
        if len(keys) > len(table):
            raise ValueError(f"{len(token_ids)} tokens do not fit a table of {len(table)} blocks")
        newly = 0
        for block_id, key in zip(table, keys, strict=False):
            if block_id in self.registered_key:
                continue  # a hit, or registered by an earlier step of this request
            self.registered_key[block_id] = key
            self.registry.setdefault(key, []).append(block_id)
            newly += 1
        return newly

    def _take_from_head(self, num_blocks: int) -> list[int]:
        """The spec's take (its eviction included); ``DUPLICATES_CACHED``: a taken block also
        leaves the registry, and another block of its content, if any, answers from now on."""
        taken = super()._take_from_head(num_blocks)
        for block_id in taken:
            key = self.registered_key.pop(block_id, None)
            if key is not None:
                blocks = self.registry[key]
                blocks.remove(block_id)
                if not blocks:
                    del self.registry[key]
                self.registry_evictions += 1
        return taken

    # ------------------------------------------------------------ free order

    def free(self, block_table: Sequence[int]) -> None:
        """The spec's free; ``UNCACHED_FREE_TO_HEAD``: the blocks it frees that carry no key go
        to the head instead of the tail, the table's last block at the very head."""
        before = set(self.free_block_ids())
        super().free(block_table)  # validates first: a refused free changes nothing
        if UNCACHED_FREE_TO_HEAD not in self.rules:
            return
        after = set(self.free_block_ids())
        freed = [b for b in reversed(list(block_table)) if b in after and b not in before]
        uncached = [b for b in freed if not self.is_cached(b)]
        for block_id in uncached:
            self.free_queue.remove(block_id)
        self.free_queue.extendleft(reversed(uncached))
