"""Where vLLM 0.32's v1 KV-cache manager departs from the spec: every divergence, named. No vLLM.

:data:`DIVERGENCES` names each known difference and its kind (docs/design.md's "vLLM ↔ pagedkv"
table has one row per entry, with how it is translated). :class:`VllmRules` is the spec with the
divergences of kind "rule" switched on by name and nothing else overridden, so the conformance
machine (``properties/machines/vllm.py``), comparing vLLM with it exactly, fails on any
difference no rule names.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from pagedkv.spec.prefix_cache import BlockKey, PrefixCachingBlockManager

Content = tuple[Hashable, tuple[int, ...]]
"""What a cached block holds: ``(salt, the whole token prefix up to the block's end)``."""

UNCACHED_FREE_TO_HEAD = "UNCACHED_FREE_TO_HEAD"
DUPLICATES_CACHED = "DUPLICATES_CACHED"

DIVERGENCES = {  # name -> kind: "rule" (VllmRules), "mapping" (the adapter), "scope" (not driven)
    "NULL_BLOCK": "mapping", UNCACHED_FREE_TO_HEAD: "rule", DUPLICATES_CACHED: "rule",
    "NONE_ON_EXHAUSTION": "mapping", "FREE_BY_REQUEST": "mapping", "HASH_IDENTITY": "scope",
    "HASH_GRANULARITY": "scope", "SALT_IN_FIRST_BLOCK": "scope",
    "REGISTER_ON_ALLOCATE": "mapping", "TOKEN_COUNTERS": "mapping",
    "EVICTIONS_AS_EVENTS": "mapping", "NO_FORK": "scope", "NO_EMPTY_PROMPT": "scope",
}  # fmt: skip
BEHAVIOUR_RULES = frozenset(name for name, kind in DIVERGENCES.items() if kind == "rule")
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
    """The spec with the divergences named in ``rules`` on (``frozenset()``: the spec itself);
    ``caching=False``: nothing is looked up or registered. Validation, all-or-nothing and all
    the rules do not name (FIFO take, revival, eviction on take, the hit limit) are the spec's."""

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
        """The spec's ``cache_blocks``; ``DUPLICATES_CACHED``: each full block without a key
        joins its content's list, whoever else holds it. How many blocks newly registered."""
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
        """The spec's take; ``DUPLICATES_CACHED``: a taken block leaves the registry, and
        another block of its content, if any, answers from now on."""
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
