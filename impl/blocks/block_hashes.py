"""Each live sequence's block keys (prefix caching), and the keys of the last prompt refused.

:class:`BlockHashes` lets :class:`pagedkv.impl.blocks.store.BlockTableStore` register a
sequence's full blocks incrementally: a ``cache_blocks`` call whose tokens extend the previous
call's (one list comparison) hashes only the blocks filled since, and registers only those plus
any earlier block left uncached because its content was cached in another block. Any other call
starts over, exactly as the spec walks every block. A prompt that ``admit`` refused keeps its
keys for the next call with equal tokens and the same extra key (a waiting request retried
every step), which then skips hashing.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.prefix_cache import BlockKey, PrefixCachingBlockManager
from pagedkv.spec.checks import check_tokens


@dataclass
class SeqKeys:
    """A sequence's block keys so far: ``keys[i]`` is full block ``i``'s content, for
    ``extra``, made from ``tokens``; blocks ``0 .. done - 1`` went through registration, and
    those in ``retry`` stayed uncached because their content was cached in another block."""

    extra: Hashable
    keys: list[BlockKey] = field(default_factory=list)
    done: int = 0
    retry: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # the keyed blocks' tokens

    def extends(self, token_ids: Sequence[int]) -> bool:
        """Whether ``token_ids`` start with the keyed tokens (one C-level list comparison), so
        the keys still hold and only what follows needs hashing."""
        known = len(self.tokens)
        if len(token_ids) < known:
            return False
        return (token_ids if len(token_ids) == known else token_ids[:known]) == (
            self.tokens if isinstance(token_ids, list) else tuple(self.tokens)
        )

    def cut(self, full: int, block_size: int) -> None:
        """Keep the keys of the first ``full`` blocks only (a truncate kept those whole)."""
        del self.keys[full:]
        del self.tokens[full * block_size :]
        self.done = min(self.done, full)
        self.retry = [index for index in self.retry if index < full]

    def copy(self) -> SeqKeys:
        return SeqKeys(self.extra, list(self.keys), self.done, list(self.retry), list(self.tokens))


class RefusedPrompt(NamedTuple):
    """The last prompt ``admit`` refused: its tokens, extra key and block keys (which depend
    on nothing else, so any sequence admitting the same prompt can reuse them)."""

    tokens: list[int]
    extra: Hashable
    keys: tuple[BlockKey, ...]


class BlockHashes:
    """Block keys by sequence id, and the refused-prompt memo, for one store."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.by_seq: dict[int, SeqKeys] = {}
        self.refused: RefusedPrompt | None = None

    def keys_if_refused(
        self, token_ids: Sequence[int], extra: Hashable
    ) -> tuple[BlockKey, ...] | None:
        """The refused prompt's keys, if ``(token_ids, extra)`` is that prompt."""
        refused = self.refused
        if (
            refused is not None
            and refused.extra is extra
            and isinstance(token_ids, (list, tuple))  # else plan_prompt's TypeError
            and list(token_ids) == refused.tokens  # one C-level compare
        ):
            return refused.keys
        return None

    def refuse(self, token_ids: Sequence[int], extra: Hashable, keys: tuple[BlockKey, ...]) -> None:
        """Remember a refused prompt's keys (forgetting the previous one's)."""
        self.refused = RefusedPrompt(list(token_ids), extra, keys)

    def admit(
        self, seq_id: int, token_ids: Sequence[int], extra: Hashable, keys: tuple[BlockKey, ...]
    ) -> None:
        """A prompt became a sequence: its full blocks' keys, none registered yet."""
        keyed = list(token_ids[: len(keys) * self.block_size])
        self.by_seq[seq_id] = SeqKeys(extra, list(keys), tokens=keyed)
        self.refused = None

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts with a copy of the parent's keys."""
        if parent_id in self.by_seq:
            self.by_seq[child_id] = self.by_seq[parent_id].copy()

    def forget(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)

    def cut(self, seq_id: int, count: int) -> None:
        """A truncate to ``count`` tokens: keep the keys of the blocks it kept whole."""
        state = self.by_seq.get(seq_id)
        if state is not None:  # a cut at or past the keyed tokens keeps them all
            state.cut(count // self.block_size, self.block_size)

    def state_for(self, seq_id: int, token_ids: Sequence[int], extra: Hashable) -> SeqKeys:
        """The keys a ``cache_blocks`` call of ``token_ids`` can build on: the sequence's own
        if the tokens extend its keyed tokens under the same extra key, else none."""
        state = self.by_seq.get(seq_id)
        if state is None or state.extra is not extra or not state.extends(token_ids):
            return SeqKeys(extra)  # start over: every block is hashed and checked
        return state

    def cache_blocks(
        self,
        prefix: PrefixCachingBlockManager | None,
        seq_id: int,
        token_ids: Sequence[int],
        extra: Hashable,
        row: NDArray[np.int32],
        count: int,
        released: int,
    ) -> int:
        """``BlockTableStore.cache_blocks`` for the live sequence whose table ``row`` holds
        ``count`` tokens after ``released`` released entries: the tokens are checked (only
        those past the keyed ones), then registered (:meth:`register`; with no ``prefix``: 0)."""
        if not isinstance(token_ids, (list, tuple)):
            check_tokens(token_ids)  # the TypeError
        state = self.state_for(seq_id, token_ids, extra)
        tail = token_ids[len(state.tokens) :]  # the keyed tokens were checked before
        checked = check_tokens(tail)
        if checked is not tail:  # int subclasses in it: from here on, the plain ints
            token_ids = [*state.tokens, *checked]
        if len(token_ids) > count:
            raise ValueError(f"{len(token_ids)} tokens, but sequence {seq_id} holds {count}")
        if prefix is None:
            return 0
        return self.register(prefix, seq_id, state, token_ids, row, released)

    def register(
        self,
        prefix: PrefixCachingBlockManager,
        seq_id: int,
        state: SeqKeys,
        token_ids: Sequence[int],
        row: NDArray[np.int32],
        released: int,
    ) -> int:
        """Register the sequence's full blocks, held in ``row`` after ``released`` released
        entries, whose K/V holds the checked ``token_ids``; return how many were newly cached.

        Only the blocks filled since ``state``'s, and earlier ones to retry, are registered;
        released entries hold nothing and are skipped. ``BlockTableError``, changing nothing,
        as ``register_table_blocks`` raises it.
        """
        bs = self.block_size
        new_keys = prefix.extend_block_keys(state.keys, token_ids, state.extra)
        full = len(token_ids) // bs
        keys = state.keys + new_keys if new_keys else state.keys
        # Ascending and below full: retry holds keyed blocks (below done), and a call that
        # extends the keyed tokens has full >= len(state.keys) >= done.
        indices = [i for i in state.retry if i >= released]
        indices += range(max(state.done, released), full)
        blocks = row.take(indices).tolist()
        newly_cached, skipped = prefix.register_table_blocks(blocks, [keys[i] for i in indices])
        # Registered: record what the keys now cover (in place: O(new blocks)).
        state.tokens.extend(token_ids[len(state.tokens) : len(keys) * bs])
        state.keys = keys
        state.retry = [indices[i] for i in skipped]  # ascending, as indices are
        state.done = full
        self.by_seq[seq_id] = state
        return newly_cached
