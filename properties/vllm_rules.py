"""Where vLLM 0.32's v1 KV-cache manager departs from the spec: every divergence, named. No vLLM.

:data:`DIVERGENCES` holds each known difference (what vLLM does, what the spec does, how the
adapter or :class:`VllmRules` translates it); docs/design.md's "vLLM ↔ pagedkv" table has one
row per entry. :class:`VllmRules` is the spec's ``PrefixCachingBlockManager`` with the
behavioural divergences switched on by name and nothing else overridden, so the conformance
machine (``properties/machines/vllm.py``), comparing vLLM with it exactly, fails on any
difference no rule names.
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


UNCACHED_FREE_TO_HEAD = "UNCACHED_FREE_TO_HEAD"
DUPLICATES_CACHED = "DUPLICATES_CACHED"

# Each entry: "NAME kind", then its vllm, spec and translation ("how") lines; an indented line
# continues the one above.
TABLE = """
NULL_BLOCK mapping
vllm: BlockPool reserves block 0 as a placeholder (never allocated, never freed); a pool of n
  blocks holds n - 1 usable ones, ids 1 .. n - 1
spec: every block 0 .. n - 1 is usable
how: vLLM gets n + 1 blocks for the spec's n; spec id = vLLM id - 1

UNCACHED_FREE_TO_HEAD rule
vllm: a freed block with no hash (a partial block, or any block when caching is off) goes to the
  HEAD of the free queue, the table's last block at the very head; hashed blocks go to the
  tail, last block first
spec: every freed block goes to the tail, last block first
how: VllmRules.free moves the freed blocks with no key from the tail to the head

DUPLICATES_CACHED rule
vllm: every full block is registered, even when another block already holds the same content;
  a hash maps to a list of blocks and a lookup returns the earliest registered one still cached
spec: a block whose content is already cached elsewhere stays uncached (one physical copy per
  content)
how: VllmRules keeps its own key -> [blocks] registry, appends on registration, answers with the
  first block, removes a block when it is taken from the head

NONE_ON_EXHAUSTION mapping
vllm: allocate_slots returns None when the free blocks do not cover the request, changing
  nothing
spec: OutOfBlocksError, changing nothing
how: the adapter raises OutOfBlocksError for None; the machine checks vLLM's state is unchanged

FREE_BY_REQUEST mapping
vllm: free(request) looks the blocks up by request id; freeing a request again is a silent no-op
spec: free(table) takes the table; a stale table with a free block raises BlockTableError, and
  one whose blocks were all handed out again cannot be told from a live one
how: the machine frees freed requests again and checks vLLM changes nothing; the spec is not
  called (its table API cannot express it)

HASH_IDENTITY scope
vllm: a block's key is its hash (sha256 of parent hash, tokens, extra keys); equal hashes are
  taken as equal content
spec: keys compare structurally, so a collision can never return other tokens
how: sha256 is used, under which no collision occurs; a planted colliding hash shows vLLM
  handing out a block with other tokens (test_a_hash_collision_...)

HASH_GRANULARITY scope
vllm: hashes are computed every hash_block_size tokens, which may be finer than the block size
  (then a prompt's last partial block can be hit, with copy-on-write)
spec: one key per full block; a partial block is never cached
how: the adapter sets hash_block_size = block_size

SALT_IN_FIRST_BLOCK scope
vllm: the cache salt (a str) enters only the first block's hash, and reaches the rest through
  the chain
spec: the extra key is part of every block's key
how: none needed: both make two salts share no block; the machine draws str salts

REGISTER_ON_ALLOCATE mapping
vllm: allocate_slots registers the blocks the scheduled tokens fill, before their K/V is
  computed (or later with delay_cache_blocks and cache_blocks)
spec: cache_blocks is called once the block's K/V is written
how: the adapter registers on the spec side right after each allocation, in the same order;
  bench_trace uses delay_cache_blocks to register after the step

TOKEN_COUNTERS mapping
vllm: PrefixCacheStats counts tokens: queries = the prompt's tokens, hits = the hit tokens,
  recorded by the scheduler at admission
spec: stats count blocks: queried_blocks = (len - 1) // block_size, hit_blocks
how: hits = hit_blocks * block_size; queries = the admitted prompts' tokens

EVICTIONS_AS_EVENTS mapping
vllm: no eviction counter; each hash removed from a block is a BlockRemoved KV event (also when
  another block still holds that hash)
spec: stats.evictions counts cached blocks taken from the head
how: evictions = the hashes in BlockRemoved events; a router must count stored and removed
  events per hash (a multiset), not keep a set

NO_FORK scope
vllm: no fork or copy-on-write of a running request's blocks: n > 1 samples are separate
  requests that share the prompt through the prefix cache
spec: fork shares a table; append_slot copies a shared block on write, and a pending copy's
  source waits for its copy instead of joining the free queue
how: the machine does not fork, so no pair is ever pending and no block waits

NO_EMPTY_PROMPT scope
vllm: an empty prompt is refused with ValueError: allocate_slots takes no 0 new tokens, and with
  caching on get_computed_blocks fails on it too
spec: lookup([]) == [] and allocate_prompt([]) == ([], 0)
how: the machine admits prompts of at least one token and checks vLLM's lookup of an empty one
  raises ValueError where the spec answers []
"""


def _divergences(table: str) -> dict[str, Divergence]:
    entries = {}
    for entry in table.strip().split("\n\n"):
        head, *lines = entry.replace("\n  ", " ").splitlines()
        name, kind = head.split()
        text = dict(line.split(": ", 1) for line in lines)
        entries[name] = Divergence(name, text["vllm"], text["spec"], text["how"], kind)
    return entries


DIVERGENCES: dict[str, Divergence] = _divergences(TABLE)
BEHAVIOUR_RULES = frozenset(name for name, d in DIVERGENCES.items() if d.kind == "rule")
"""The divergences :class:`VllmRules` implements; the rest are mappings or out of scope."""


def content_of_key(key: BlockKey) -> Content:
    """What a spec key names: ``(extra key, the whole token prefix)``."""
    levels: list[tuple[int, ...]] = []
    node: BlockKey | None = key
    while node is not None:
        levels.append(node.tokens)
        node = node.parent
    return key.extra, tuple(token for level in reversed(levels) for token in level)


class VllmRules(PrefixCachingBlockManager):
    """The spec with the divergences named in ``rules`` on (``frozenset()``: the spec itself).

    ``caching=False`` is vLLM with prefix caching off: nothing is looked up or registered. Every
    public method keeps the spec's validation and all-or-nothing behaviour; everything the
    rules do not name (FIFO take, revival, eviction on take, the hit limit) is the spec's code.
    """

    def __init__(
        self,
        total_blocks: int,
        block_size: int,
        caching: bool = True,
        rules: frozenset[str] = BEHAVIOUR_RULES,
    ) -> None:
        super().__init__(total_blocks, block_size)
        if unknown := set(rules) - BEHAVIOUR_RULES:
            raise ValueError(f"not behavioural divergences: {sorted(unknown)}")
        self.caching = caching
        self.duplicates = DUPLICATES_CACHED in rules
        self.uncached_to_head = UNCACHED_FREE_TO_HEAD in rules
        # DUPLICATES_CACHED: content key -> the blocks registered under it, earliest first.
        self.registry: dict[BlockKey, list[int]] = {}
        self.registered_key: dict[int, BlockKey] = {}
        self.registry_evictions = 0

    def _key(self, block_id: int) -> BlockKey | None:
        """The key a block is cached under (vLLM: its block hash), or None."""
        return self.registered_key.get(block_id) if self.duplicates else self.key_of(block_id)

    def content_of_block(self, block_id: int) -> Content | None:
        key = self._key(block_id)
        return None if key is None else content_of_key(key)

    def cached_contents(self) -> dict[Content, list[int]]:
        """Every cached content and the blocks that hold it, in lookup order."""
        if self.duplicates:
            return {content_of_key(k): list(blocks) for k, blocks in self.registry.items()}
        keys = ((b, self.key_of(b)) for b in range(self.total_blocks))
        return {content_of_key(key): [b] for b, key in keys if key is not None}

    @property
    def evictions(self) -> int:
        """Cached blocks that lost their key when taken from the head."""
        return self.registry_evictions if self.duplicates else self.stats.evictions

    def lookup(self, token_ids: Sequence[int], extra_key: Hashable = None) -> list[int]:
        """The spec's lookup; ``DUPLICATES_CACHED``: each key answers with its earliest block."""
        if not self.caching:
            return []
        if not self.duplicates:
            return super().lookup(token_ids, extra_key)
        keys = self.block_keys(token_ids, extra_key)[: self.max_hit_blocks(len(token_ids))]
        hits: list[int] = []
        for key in keys:
            if not (blocks := self.registry.get(key)):  # the spec's rule: stop at a miss
                break
            hits.append(blocks[0])
        return hits

    def register(
        self, block_table: Sequence[int], token_ids: Sequence[int], extra_key: Hashable = None
    ) -> int:
        """The spec's ``cache_blocks`` (how many blocks newly registered); ``DUPLICATES_CACHED``:
        each full block without a key joins its content's list, whoever else holds it."""
        if not self.caching:
            return 0
        if not self.duplicates:
            return self.cache_blocks(block_table, token_ids, extra_key)
        table = self.check_live_table(block_table)
        keys = self.block_keys(token_ids, extra_key)
        if len(keys) > len(table):
            raise ValueError(f"{len(token_ids)} tokens do not fit a table of {len(table)} blocks")
        newly = 0
        for block_id, key in zip(table, keys, strict=False):
            if block_id not in self.registered_key:  # else a hit, or registered earlier
                self.registered_key[block_id] = key
                self.registry.setdefault(key, []).append(block_id)
                newly += 1
        return newly

    def _take_from_head(self, num_blocks: int) -> list[int]:
        """The spec's take; ``DUPLICATES_CACHED``: a taken block leaves the registry, and another
        block of its content, if any, answers from now on."""
        taken = super()._take_from_head(num_blocks)
        for block_id in taken:
            if (key := self.registered_key.pop(block_id, None)) is not None:
                self.registry[key].remove(block_id)
                if not self.registry[key]:
                    del self.registry[key]
                self.registry_evictions += 1
        return taken

    def free(self, block_table: Sequence[int]) -> None:
        """The spec's free; ``UNCACHED_FREE_TO_HEAD``: the freed blocks with no key go to the
        head instead, the table's last block at the very head."""
        before = set(self.free_block_ids())
        super().free(block_table)  # validates first: a refused free changes nothing
        if not self.uncached_to_head:
            return
        after = set(self.free_block_ids())
        freed = [b for b in reversed(list(block_table)) if b in after and b not in before]
        uncached = [b for b in freed if self._key(b) is None]
        for block_id in uncached:
            self.free_queue.remove(block_id)
        self.free_queue.extendleft(reversed(uncached))
