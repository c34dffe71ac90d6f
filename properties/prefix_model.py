"""An independent model of prefix caching (docs/design.md section 8), sharing nothing with the
spec but its exceptions: a block's content is a plain ``(salt, whole token prefix)`` tuple."""

from __future__ import annotations

from collections.abc import Hashable

from pagedkv.spec import BlockTableError, OutOfBlocksError
from properties.block_model import BlockModel, Outcome

Content = tuple[Hashable, tuple[int, ...]]
"""What a cached block holds: ``(salt, the whole token prefix up to the block's end)``."""

Event = tuple[str, int | None, Content | None]
"""A KV event: ``("stored" | "removed", block, content)`` or ``("cleared", None, None)``."""


def hashable(salt: object) -> Hashable:
    """An unhashable salt's stand-in (another ``hash_fn`` may accept one), equal where it is."""
    if isinstance(salt, set):
        return frozenset(salt)
    return (list, *salt) if isinstance(salt, list) else salt  # type: ignore[return-value]


class PrefixCacheModel(BlockModel):
    """Prefix caching as the rules state it, for valid token lists (non-negative ints)."""

    def __init__(self, total_blocks: int, block_size: int) -> None:
        super().__init__(total_blocks, block_size)
        self.block_of: dict[Content, int] = {}
        self.content_of: dict[int, Content] = {}
        self.queried_blocks = 0
        self.hit_blocks = 0
        self.evictions = 0
        self.resets = 0
        self.events: list[Event] = []  # every key stored and removed since the last take

    def contents(self, tokens: list[int], salt: Hashable = None) -> list[Content]:
        full = len(tokens) // self.block_size
        return [(hashable(salt), tuple(tokens[: (i + 1) * self.block_size])) for i in range(full)]

    def max_hits(self, prompt_len: int) -> int:
        """The last prompt token is always computed, so only blocks before it can hit."""
        return (prompt_len - 1) // self.block_size if prompt_len else 0

    def lookup(self, tokens: list[int], salt: Hashable = None) -> list[int]:
        """The cached blocks of the prompt's longest cached prefix, stopping at the first miss."""
        hits = []
        for content in self.contents(tokens, salt)[: self.max_hits(len(tokens))]:
            if content not in self.block_of:
                break
            hits.append(self.block_of[content])
        return hits

    def blocks_to_allocate(self, tokens: list[int], salt: Hashable = None) -> int:
        """Fresh blocks plus hits in the queue (reviving consumes a free block; parked is not)."""
        hits = self.lookup(tokens, salt)
        table_len = -(-len(tokens) // self.block_size)
        return table_len - len(hits) + sum(b in self.queue for b in hits)

    def _take(self, count: int) -> list[int]:
        """Blocks taken from the head lose their content: eviction."""
        taken = super()._take(count)
        for block_id in taken:
            if block_id in self.content_of:
                content = self.content_of.pop(block_id)
                del self.block_of[content]
                self.events.append(("removed", block_id, content))
                self.evictions += 1
        return taken

    def forget(self, block_id: int) -> None:
        """The block is about to be written over: it loses its content (not an eviction)."""
        content = self.content_of.pop(block_id)
        del self.block_of[content]
        self.events.append(("removed", block_id, content))

    def append_slot(self, table: list[int], token_count: int, new_tokens: int = 1) -> Outcome:
        """A cached block written into (held alone: shared ones were copied) forgets its content."""
        outcome = super().append_slot(table, token_count, new_tokens)
        if outcome.error is None:
            for pos in range(token_count - new_tokens, token_count):
                block_id = outcome.value[pos // self.block_size]
                if block_id in self.content_of:
                    self.forget(block_id)
        return outcome

    def truncate(self, table: list[int], token_count: int) -> Outcome:
        """Dropped blocks keep their content; a kept last block cut into, held alone, forgets it."""
        outcome = super().truncate(table, token_count)
        if outcome.error is None and token_count % self.block_size:
            last = outcome.value[-1]
            if last is not None and self.refs[last] == 1 and last in self.content_of:
                self.forget(last)
        return outcome

    def allocate_prompt(self, tokens: list[int], salt: Hashable = None) -> Outcome:
        """Hits first (free ones leave the queue where they stand), then fresh blocks."""
        if self.blocks_to_allocate(tokens, salt) > len(self.queue):
            return Outcome(error=OutOfBlocksError)
        hits = self.lookup(tokens, salt)
        self.queried_blocks += self.max_hits(len(tokens))
        self.hit_blocks += len(hits)
        for block_id in hits:
            if self.refs[block_id] == 0:  # free, or parked for a pending copy
                (self.parked if block_id in self.parked else self.queue).remove(block_id)
            self.refs[block_id] += 1
        fresh = self._take(-(-len(tokens) // self.block_size) - len(hits))
        return Outcome(value=(hits + fresh, len(hits) * self.block_size))

    def cache_blocks(self, table: list[int], tokens: list[int], salt: Hashable = None) -> Outcome:
        """Register the table's full held blocks; a block holding other content refuses them all."""
        if error := self.table_error(table):
            return Outcome(error=error)
        if len(tokens) > len(table) * self.block_size:
            return Outcome(error=ValueError)
        contents = self.contents(tokens, salt)
        pairs = [(b, c) for b, c in zip(table, contents, strict=False) if b is not None]
        if any(self.content_of.get(b, c) != c for b, c in pairs):
            return Outcome(error=BlockTableError)
        registered = 0
        for block_id, content in pairs:
            if block_id not in self.content_of and content not in self.block_of:
                self.content_of[block_id] = content
                self.block_of[content] = block_id
                self.events.append(("stored", block_id, content))
                registered += 1
        return Outcome(value=registered)

    def reset(self) -> Outcome:
        """Forget every content, only when no block is held; the queue keeps its order."""
        if len(self.queue) != self.total_blocks:
            return Outcome(value=False)
        self.block_of.clear()
        self.content_of.clear()
        self.resets += 1
        self.events.append(("cleared", None, None))
        return Outcome(value=True)

    def take_stats(self) -> Outcome:
        """The counters ``(queried, hits, evictions, resets)``; they start again at zero."""
        stats = (self.queried_blocks, self.hit_blocks, self.evictions, self.resets)
        self.queried_blocks = self.hit_blocks = self.evictions = self.resets = 0
        return Outcome(value=stats)
