"""The store machine's prefix API against the spec, on shared prompts (frequent hits, revivals,
evictions); keys compare by content (:func:`describe`); ``STORE`` swaps the store."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import CapacityError
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.spec import OutOfBlocksError, blocks_needed
from properties.machines.prefix_cache import (
    ALPHABET,
    BAD_TOKEN_LISTS,
    FILLER,
    SALTS,
    colliding_hash,
    describe,
    prompts,
)
from properties.machines.store import StoreMachine, WindowStoreMachine
from properties.outcomes import outcome


class PrefixStoreMachine(StoreMachine):
    """``StoreMachine`` on prefix-caching managers plus the prefix API; base rules add FILLER."""

    @initialize(
        total_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 2, 3, 4]),
        max_seqs=st.integers(1, 8), max_blocks=st.integers(1, 10), collide=st.booleans(),
    )  # fmt: skip
    def start(
        self, total_blocks: int, block_size: int, max_seqs: int, max_blocks: int, collide: bool
    ) -> None:
        super().start(total_blocks, block_size, max_seqs, max_blocks)
        kwargs = {"hash_fn": colliding_hash} if collide else {}
        self.spec = spec_pc.PrefixCachingBlockManager(total_blocks, block_size, **kwargs)
        manager = PrefixCachingBlockManager(total_blocks, block_size, **kwargs)
        self.store = self.STORE(manager, max_seqs, max_blocks)
        self.total_blocks = total_blocks
        self.tokens: dict[int, list[int]] = {}  # known tokens of the sequences added here
        self.salts: dict[int, object] = {}

    def snapshot(self) -> tuple[Any, ...]:
        manager = self.store.manager
        keys = tuple(describe(manager.key_of(b)) for b in range(self.total_blocks))
        return (*super().snapshot(), keys, dataclasses.astuple(manager.stats))

    def tokens_of(self, seq_id: int) -> list[int]:
        known = self.tokens.setdefault(seq_id, [])
        known += [FILLER] * (self.seqs[seq_id][1] - len(known))
        return known

    def cache_both(self, seq_id: int, tokens: Any, salt: object) -> None:
        """``store.cache_blocks`` is the spec's, but refuses more tokens than the sequence holds."""
        table, count = self.seqs[seq_id]
        if self.spec_refuses(tokens) is None and len(tokens) > count:
            expected = ("raised", ValueError)
        else:
            expected = outcome(self.spec.cache_blocks, table, tokens, salt)
        if expected[0] == "raised":
            self.refuses(expected[1], self.store.cache_blocks, seq_id, tokens, salt)
        else:
            actual = outcome(self.store.cache_blocks, seq_id, tokens, salt)
            assert actual == expected, f"cache_blocks: store {actual}, spec {expected}"

    def spec_refuses(self, tokens: Any) -> type[Exception] | None:
        kind, error = outcome(self.spec.lookup, tokens)
        return error if kind == "raised" else None

    @rule(seq_id=st.integers(0, 11), tokens=prompts(), salt=st.sampled_from(SALTS))
    def add_prompt(self, seq_id: int, tokens: list[int], salt: object) -> None:
        """``add_prompt`` is ``allocate_prompt``; then the computed blocks are cached."""
        needed = blocks_needed(len(tokens), self.block_size)
        assert self.store.blocks_to_allocate(tokens, salt) == self.spec.blocks_to_allocate(
            tokens, salt
        )
        if seq_id in self.seqs:
            self.refuses(ValueError, self.store.add_prompt, seq_id, tokens, salt)
        elif needed > self.max_blocks or len(self.seqs) == self.max_seqs:
            self.refuses(CapacityError, self.store.add_prompt, seq_id, tokens, salt)
        elif self.spec.blocks_to_allocate(tokens, salt) > self.spec.num_free_blocks:
            self.refuses(OutOfBlocksError, self.store.add_prompt, seq_id, tokens, salt)
        else:
            table, cached = self.spec.allocate_prompt(tokens, salt)
            assert self.store.add_prompt(seq_id, tokens, salt) == cached
            assert self.store.table(seq_id) == table
            assert self.store.token_count(seq_id) == len(tokens)
            assert cached % self.block_size == 0 and cached < max(1, len(tokens))
            self.seqs[seq_id] = (table, len(tokens))
            self.tokens[seq_id], self.salts[seq_id] = list(tokens), salt
            self.cache_both(seq_id, tokens, salt)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def decode_and_cache(self, data: st.DataObject) -> None:
        """A decode step over some sequences, then each caches what it now holds."""
        ids = self.some_live(data, min_size=1)
        counts = {seq_id: self.seqs[seq_id][1] for seq_id in ids}
        self.check_grow(data, ids, [1] * len(ids), 1)
        for seq_id in ids:
            if self.seqs[seq_id][1] > counts[seq_id]:
                tokens = self.tokens_of(seq_id)
                tokens[-1] = data.draw(ALPHABET)
                self.cache_both(seq_id, tokens, self.salts.get(seq_id))

    def truncated(self, ids: list[int], counts: list[int]) -> None:
        for seq_id, count in zip(ids, counts, strict=True):
            del self.tokens_of(seq_id)[count:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def speculate_and_cache(self, data: st.DataObject) -> None:
        """Speculate (maybe caching drafts), keep some, cache: rewritten drafts register anew."""
        ids = self.some_live(data, min_size=1)
        before = {seq_id: self.seqs[seq_id][1] for seq_id in ids}
        drafts = [data.draw(st.integers(0, 2 * self.block_size), label="k") for _ in ids]
        if any(
            blocks_needed(before[s] + 1 + k, self.block_size) > self.max_blocks
            for s, k in zip(ids, drafts, strict=True)
        ):
            return
        self.check_grow(data, ids, [1 + k for k in drafts], [1 + k for k in drafts])
        grown = [s for s in ids if self.seqs[s][1] > before[s]]
        kept = []
        for seq_id in grown:  # the step wrote the last token and the drafts
            written = self.seqs[seq_id][1] - before[seq_id]
            self.tokens_of(seq_id)[before[seq_id] :] = data.draw(
                st.lists(ALPHABET, min_size=written, max_size=written), label="written"
            )
            kept.append(before[seq_id] + 1 + data.draw(st.integers(0, written - 1), label="j"))
        drafted = {seq_id: list(self.tokens_of(seq_id)) for seq_id in grown}
        if data.draw(st.booleans(), label="cache the drafts"):
            for seq_id in grown:
                self.cache_both(seq_id, drafted[seq_id], self.salts.get(seq_id))
        self.check_truncate(data, grown, kept)
        again = data.draw(st.booleans(), label="write the dropped drafts again")
        if not again or data.draw(st.booleans(), label="cache in between"):
            for seq_id in grown:
                self.cache_both(seq_id, self.tokens_of(seq_id), self.salts.get(seq_id))
        if again:  # the same tokens: a block cut into lost its key, and must be registered
            again = [s for s in grown if len(drafted[s]) > self.seqs[s][1]]
            steps = [len(drafted[s]) - self.seqs[s][1] for s in again]
            self.check_grow(data, again, steps, steps)
            for seq_id in again:
                if self.seqs[seq_id][1] == len(drafted[seq_id]):  # it grew
                    self.tokens[seq_id] = list(drafted[seq_id])
                    self.cache_both(seq_id, drafted[seq_id], self.salts.get(seq_id))

    @precondition(lambda self: set(self.tokens) & set(self.seqs) and len(self.seqs) < self.max_seqs)
    @rule(
        data=st.data(),
        token=ALPHABET,
        fork=st.sampled_from(["none", "removed", "cut in the same batch"]),
    )
    def cut_a_cached_block_then_write(self, data: st.DataObject, token: int, fork: str) -> None:
        """A cached block cut into loses its key before a write lands (alone, or once a fork drops
        it); one refilled from the cut is registered anew under its content's key."""
        parent = data.draw(st.sampled_from(sorted(set(self.tokens) & set(self.seqs))))
        count = self.seqs[parent][1]
        bs, full = self.block_size, count // self.block_size
        old = list(self.tokens_of(parent))
        refill = full > 0 and bs > 1 and data.draw(st.booleans(), label="refill the block")
        kept = max(0, count - 1)  # into a full block (a cached one, if the parent cached it)
        if refill:  # its full blocks cached first, the last one then cut into
            self.cache_both(parent, old, self.salts.get(parent))
            kept = (full - 1) * bs + data.draw(st.integers(1, bs - 1))
        elif full and bs > 1:
            kept = data.draw(st.integers(0, full - 1)) * bs + data.draw(st.integers(1, bs - 1))
        child = min(set(range(12)) - set(self.seqs))
        if fork != "none":
            self.fork_both(parent, child)
        if fork == "cut in the same batch":  # the child keeps the blocks before the cut block
            below = max(0, blocks_needed(kept, bs) - 1) * bs
            self.check_truncate(data, [parent, child], [kept, min(below, kept)])
            last = self.seqs[parent][0][-1:]
            if kept % bs and last and last[0] is not None and self.spec.key_of(last[0]) is not None:
                event("a cut block left cached, held by one table")
        else:
            self.check_truncate(data, [parent], [kept])
        if fork == "removed":
            self.store.remove([child])
            self.spec.free(self.seqs.pop(child)[0])
        step = full * bs - kept if refill else 1
        self.check_grow(data, [parent], [step], step)
        tokens = self.tokens_of(parent)
        if refill and len(tokens) == full * bs:
            tokens[kept:] = old[kept : full * bs]
            if data.draw(st.booleans(), label="other content"):
                tokens[kept] = token  # the block's content may change: its key must too
        elif tokens:
            tokens[-1] = token
        if tokens:
            self.cache_both(parent, tokens, self.salts.get(parent))

    @precondition(lambda self: set(self.tokens) & set(self.seqs) and len(self.seqs) < self.max_seqs)
    @rule(data=st.data(), child=st.integers(0, 11))
    def fork_prompt(self, data: st.DataObject, child: int) -> None:
        """A fork that shares the parent's tokens (parallel sampling)."""
        parent = data.draw(st.sampled_from(sorted(set(self.tokens) & set(self.seqs))))
        if child in self.seqs:
            return
        self.fork_both(parent, child)
        self.tokens[child] = list(self.tokens_of(parent))
        self.salts[child] = self.salts.get(parent)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), case=st.sampled_from(["as is", "prefix", "wrong", "too long", "bad"]))
    def cache_blocks(self, data: st.DataObject, case: str) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.seqs)))
        tokens = list(self.tokens_of(seq_id))
        if case == "prefix":
            tokens = tokens[: data.draw(st.integers(0, len(tokens)))]
        elif case == "wrong" and tokens:
            tokens[data.draw(st.integers(0, len(tokens) - 1))] = data.draw(ALPHABET)
        elif case == "too long":
            tokens.append(0)
        elif case == "bad":
            tokens = data.draw(BAD_TOKEN_LISTS)
        self.cache_both(seq_id, tokens, self.salts.get(seq_id))

    @rule(data=st.data(), tokens=BAD_TOKEN_LISTS)
    def odd_add_prompt(self, data: st.DataObject, tokens: Any) -> None:
        """Bad sequence ids or token ids: the documented error, nothing changes."""
        seq_id = data.draw(st.sampled_from([True, 1.0, None, "3"]) | st.integers(0, 11))
        refused = self.spec_refuses(tokens)
        if type(seq_id) is not int:
            self.refuses(TypeError, self.store.add_prompt, seq_id, tokens)
        elif seq_id in self.seqs:
            self.refuses(ValueError, self.store.add_prompt, seq_id, tokens)
        else:
            self.refuses(KeyError, self.store.cache_blocks, seq_id, [])
            if refused is not None:
                self.refuses(refused, self.store.add_prompt, seq_id, tokens)
        if refused is not None:
            self.refuses(refused, self.store.blocks_to_allocate, tokens)

    @invariant()
    def same_cache(self) -> None:
        for seq_id in set(self.tokens) - set(self.seqs):  # removed by a base rule
            del self.tokens[seq_id]
            self.salts.pop(seq_id, None)
        manager = self.store.manager
        for block_id in range(self.total_blocks):
            assert describe(manager.key_of(block_id)) == describe(self.spec.key_of(block_id))
        assert manager.num_cached_blocks == self.spec.num_cached_blocks
        assert self.store.prefix_cache_stats == self.spec.stats


class WindowPrefixStoreMachine(PrefixStoreMachine, WindowStoreMachine):
    """The prefix store machine with sliding-window releases: released cached blocks stay cached."""
