"""Everything the store does only under prefix caching, as a few hooks, and each sequence's
block keys.

:class:`PrefixStore` is what :class:`~pagedkv.impl.blocks.store.BlockTableStore` holds when its
manager caches prefixes (None otherwise), so rows, growth and the window know nothing of keys:

* **admit a planned prompt**: :meth:`~PrefixStore.plan` plans it once against the cache (a
  refused prompt's keys are reused for its retry), :meth:`~PrefixStore.admit` carries the plan
  out and seeds the sequence's keys, :meth:`~PrefixStore.refuse` keeps a refused one's keys;
* **before an in-place write**: :meth:`~PrefixStore.take_fresh` takes a growth's fresh blocks,
  removing the keys of cached blocks about to be written in place, in the spec's order;
* **after a cut**: :meth:`~PrefixStore.truncate` removes the key of a cut cached block held by
  its row alone, and cuts the sequence's own keys.

Each sequence's keys (:class:`SeqKeys`) let ``cache_blocks`` register incrementally: a call
whose tokens extend the previous call's (one list comparison) hashes only the blocks filled
since, and registers only those plus any earlier block left uncached because its content was
cached in another block. Any other call starts over, exactly as the spec walks every block.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import IdArray
from pagedkv.impl.blocks.prefix_cache import BlockKey, PrefixCachingBlockManager, PromptPlan
from pagedkv.impl.blocks.rows import PAD, Rows, SeqRows
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


class PrefixStore:
    """One store's prefix-caching side, over ``manager`` (whose pool the store drives)."""

    def __init__(self, manager: PrefixCachingBlockManager) -> None:
        self.manager = manager
        self.pool = manager.pool
        self.block_size = manager.block_size
        self.by_seq: dict[int, SeqKeys] = {}
        self.refused: RefusedPrompt | None = None

    # ----------------------------------------------------------------- admitting a prompt

    def plan(self, token_ids: Sequence[int], extra: Hashable, retry: bool) -> PromptPlan:
        """The prompt's plan (``plan_prompt``); a ``retry`` of the refused prompt reuses its
        keys."""
        known = self.keys_if_refused(token_ids, extra) if retry else None
        return self.manager.plan_prompt(token_ids, extra, known)

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

    def refuse(self, token_ids: Sequence[int], extra: Hashable, plan: PromptPlan) -> None:
        """Remember a refused prompt's keys (forgetting the previous one's)."""
        self.refused = RefusedPrompt(list(token_ids), extra, plan.keys)

    def admit(
        self, seq_id: int, token_ids: Sequence[int], extra: Hashable, plan: PromptPlan
    ) -> IdArray:
        """Carry out a prompt plan (room checked): its blocks, hits first; the prompt's full
        blocks' keys become the sequence's, none registered yet."""
        fresh = self.manager.apply_prompt_plan(plan)
        keyed = list(token_ids[: len(plan.keys) * self.block_size])
        self.by_seq[seq_id] = SeqKeys(extra, list(plan.keys), tokens=keyed)
        self.refused = None
        return np.concatenate((plan.hits, fresh))

    # ----------------------------------------------------------------- a sequence's keys

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child starts with a copy of the parent's keys."""
        if parent_id in self.by_seq:
            self.by_seq[child_id] = self.by_seq[parent_id].copy()

    def forget(self, seq_ids: Sequence[int]) -> None:
        for seq_id in seq_ids:
            self.by_seq.pop(seq_id, None)

    # ----------------------------------------------------------------- writes and cuts

    def take_fresh(
        self, num_fresh: NDArray[np.int64], last: NDArray[np.int32], in_place: NDArray[np.bool_]
    ) -> IdArray:
        """A growth's fresh blocks (``num_fresh`` per sequence, in batch order), where the
        sequences ``in_place`` write their present ``last`` block in place: taken at once if
        none of those blocks is cached, else per sequence in the spec's order, its fresh
        blocks, then its written block's key removal (a cached block is never written in
        place; the removals happen even when no block is taken)."""
        manager = self.manager
        cached = (
            manager.cached_among(last[in_place].astype(np.intp))
            if manager.num_cached_blocks
            else None
        )
        if not cached:
            return self.pool.take(int(num_fresh.sum()))
        keyed = in_place & np.isin(last, list(cached))
        parts = []
        for index, count in enumerate(num_fresh.tolist()):
            parts.append(self.pool.take(count))
            if keyed[index]:
                manager.remove_keys([int(last[index])])
        return np.concatenate(parts)

    def truncate(
        self, rows: SeqRows, batch_rows: Rows, seq_ids: Sequence[int], counts: NDArray[np.int64]
    ) -> None:
        """``SeqRows.truncate`` with the key rule: a kept last block cut into that is cached
        and then held by its row alone loses its key (the rule reads each cut block's count
        between the releases, so those rows are cut one at a time). Each sequence's own keys
        are cut to its kept full blocks."""
        cut, last = rows.cut_into(batch_rows, counts)
        if self.manager.cached_among(last):
            held = last != PAD  # a released kept last block holds nothing: no key to remove
            cut_block = dict(np.stack((cut[held], last[held]), axis=1).tolist())
            for i in range(batch_rows.size):
                rows.truncate(batch_rows[i : i + 1], counts[i : i + 1], self.pool)
                block = cut_block.get(i)
                if block is not None and self.pool.refs_of(np.array([block]))[0] == 1:
                    self.manager.remove_keys([block])
        else:
            rows.truncate(batch_rows, counts, self.pool)
        for index, count in enumerate(counts.tolist()):
            state = self.by_seq.get(seq_ids[index])
            if state is not None:  # a cut at or past the keyed tokens keeps them all
                state.cut(count // self.block_size, self.block_size)

    # ----------------------------------------------------------------- registering blocks

    def cache_blocks(
        self,
        seq_id: int,
        token_ids: Sequence[int],
        extra: Hashable,
        row: NDArray[np.int32],
        count: int,
        released: int,
    ) -> int:
        """``BlockTableStore.cache_blocks`` for the live sequence whose table ``row`` holds
        ``count`` tokens after ``released`` released entries: the tokens are checked (only
        those past the keyed ones), then registered (:meth:`register`)."""
        if not isinstance(token_ids, (list, tuple)):
            check_tokens(token_ids)  # the TypeError
        state = self.by_seq.get(seq_id)
        if state is None or state.extra is not extra or not state.extends(token_ids):
            state = SeqKeys(extra)  # start over: every block is hashed and checked
        tail = token_ids[len(state.tokens) :]  # the keyed tokens were checked before
        checked = check_tokens(tail)
        if checked is not tail:  # int subclasses in it: from here on, the plain ints
            token_ids = [*state.tokens, *checked]
        if len(token_ids) > count:
            raise ValueError(f"{len(token_ids)} tokens, but sequence {seq_id} holds {count}")
        return self.register(seq_id, state, token_ids, row, released)

    def register(
        self,
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
        new_keys = self.manager.extend_block_keys(state.keys, token_ids, state.extra)
        full = len(token_ids) // bs
        keys = state.keys + new_keys if new_keys else state.keys
        # Ascending and below full: retry holds keyed blocks (below done), and a call that
        # extends the keyed tokens has full >= len(state.keys) >= done.
        indices = [i for i in state.retry if i >= released]
        indices += range(max(state.done, released), full)
        blocks = row.take(indices).tolist()
        newly_cached, skipped = self.manager.register_table_blocks(
            blocks, [keys[i] for i in indices]
        )
        # Registered: record what the keys now cover (in place: O(new blocks)).
        state.tokens.extend(token_ids[len(state.tokens) : len(keys) * bs])
        state.keys = keys
        state.retry = [indices[i] for i in skipped]  # ascending, as indices are
        state.done = full
        self.by_seq[seq_id] = state
        return newly_cached
