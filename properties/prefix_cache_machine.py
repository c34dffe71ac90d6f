"""A Hypothesis state machine for prefix caching, over any class with the spec's API.

Prompts are drawn from a tiny alphabet after one of a few shared "system prompts", so hits,
revivals and evictions are frequent. The machine simulates the KV data as the ``BlockManager``
machine does, and checks after every step that cached keys describe exactly the tokens their
blocks hold, so a hit can never hand out a block with other tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv.spec import OutOfBlocksError
from pagedkv.spec.prefix_cache import PrefixCacheStats
from properties.block_model import observe

SYSTEM_PROMPTS = [[], [7, 7, 8, 9, 7, 8], [7, 7, 8, 9, 1, 2, 3, 4, 5], [5, 5, 5, 5, 5, 5, 5, 5]]
ALPHABET = st.integers(0, 2)
SALTS = [None, "tenant-b"]


def colliding_hash(parent: object, tokens: tuple[int, ...], extra: object) -> int:
    """A deliberately terrible hash: most keys collide."""
    return len(tokens) % 2


@dataclass
class Request:
    table: list[int]
    tokens: list[int]
    salt: str | None


def prefix_cache_machine(manager_cls: type) -> type[RuleBasedStateMachine]:
    """Return a state machine class checking ``manager_cls``'s prefix caching rules."""

    class PrefixCacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.requests: dict[int, Request] = {}
            # physical slot -> (extra key, token) written there: a block computed under one extra
            # key must never be read under another, even when the tokens agree
            self.cache: dict[int, tuple[str | None, int]] = {}
            self.names = itertools.count()

        @initialize(
            total_blocks=st.integers(1, 24),
            block_size=st.sampled_from([1, 2, 4]),
            collide=st.booleans(),
        )
        def make_manager(self, total_blocks: int, block_size: int, collide: bool) -> None:
            kwargs = {"hash_fn": colliding_hash} if collide else {}
            self.manager = manager_cls(total_blocks, block_size, **kwargs)
            self.size = block_size
            self.total = total_blocks
            self.queue = list(range(total_blocks))  # the queue the rules predict
            self.stats = PrefixCacheStats()  # the counters the rules predict

        # ------------------------------------------------------------ helpers

        def slot(self, table: list[int], pos: int) -> int:
            return table[pos // self.size] * self.size + pos % self.size

        def snapshot(self) -> tuple:
            keys = tuple(self.manager.key_of(b) for b in range(self.total))
            refs = tuple(self.manager.ref_count(b) for b in range(self.total))
            return self.manager.free_block_ids(), refs, keys, self.manager.num_cached_blocks

        def pick(self, data: st.DataObject) -> Request:
            return self.requests[data.draw(st.sampled_from(sorted(self.requests)))]

        def cached_blocks(self) -> set[int]:
            return {b for b in range(self.total) if self.manager.key_of(b) is not None}

        def take_from_head(self, count: int, cached_before: set[int]) -> None:
            """The rules' allocation: the head's blocks go, and cached ones are evicted."""
            self.stats.evictions += len(cached_before.intersection(self.queue[:count]))
            self.queue = self.queue[count:]

        def register(self, table: list[int], tokens: list[int], salt: str | None) -> None:
            """Cache the full blocks just written; with correct tokens this cannot fail."""
            outcome = observe(self.manager.cache_blocks, table, tokens, salt)
            assert outcome.error is None, f"cache_blocks refused the blocks' own tokens: {outcome}"

        def free_in_model(self, table: list[int]) -> None:
            for block_id in reversed(table):
                if self.manager.ref_count(block_id) == 0:
                    self.queue.append(block_id)

        # ------------------------------------------------------------ rules

        @rule(
            system=st.sampled_from(SYSTEM_PROMPTS),
            suffix=st.lists(ALPHABET, max_size=6),
            salt=st.sampled_from(SALTS),
        )
        def new_request(self, system: list[int], suffix: list[int], salt: str | None) -> None:
            tokens = system + suffix
            hits = self.manager.lookup(tokens, salt)
            needed = self.manager.blocks_to_allocate(tokens, salt)
            free_before = self.manager.num_free_blocks
            cached_before = self.cached_blocks()
            before = self.snapshot()
            outcome = observe(self.manager.allocate_prompt, tokens, salt)
            if needed > free_before:
                assert outcome.error is OutOfBlocksError
                assert self.snapshot() == before, "a refused prompt changed the cache"
                event("prefix: out of blocks")
                return
            assert outcome.error is None, outcome
            table, cached_tokens = outcome.value
            assert table[: len(hits)] == hits and cached_tokens == len(hits) * self.size
            assert cached_tokens < max(1, len(tokens)), "the last prompt token must be computed"
            assert self.manager.num_free_blocks == free_before - needed
            for pos in range(cached_tokens):  # a hit never returns a block with other tokens
                assert self.cache.get(self.slot(table, pos)) == (salt, tokens[pos])
            revived = [b for b in hits if b in self.queue]
            self.queue = [b for b in self.queue if b not in revived]
            self.take_from_head(len(table) - len(hits), cached_before)
            self.stats.queried_blocks += max(0, len(tokens) - 1) // self.size
            self.stats.hit_blocks += len(hits)
            if hits:
                event("prefix: hit" + (" with revival" if revived else ""))
            for pos in range(cached_tokens, len(tokens)):  # compute the rest of the prompt
                self.cache[self.slot(table, pos)] = (salt, tokens[pos])
            self.register(table, tokens, salt)
            self.requests[next(self.names)] = Request(table, tokens, salt)

        @precondition(lambda self: self.requests)
        @rule(data=st.data(), token=ALPHABET)
        def decode(self, data: st.DataObject, token: int) -> None:
            request = self.pick(data)
            tokens = [*request.tokens, token]
            cached_before = self.cached_blocks()
            outcome = observe(self.manager.append_slot, request.table, len(tokens))
            if outcome.error is not None:
                assert outcome.error is OutOfBlocksError
                return
            table = outcome.value
            pairs = self.manager.pop_copy_pairs()
            self.take_from_head(len(pairs) + len(table) - len(request.table), cached_before)
            for src, dst in pairs:
                for offset in range(self.size):
                    if src * self.size + offset in self.cache:
                        self.cache[dst * self.size + offset] = self.cache[src * self.size + offset]
            self.cache[self.slot(table, len(tokens) - 1)] = (request.salt, token)
            request.table, request.tokens = table, tokens
            self.register(table, tokens, request.salt)

        @precondition(lambda self: self.requests)
        @rule(data=st.data())
        def fork(self, data: st.DataObject) -> None:
            parent = self.pick(data)
            table = self.manager.fork(parent.table)
            self.requests[next(self.names)] = Request(table, list(parent.tokens), parent.salt)

        @precondition(lambda self: self.requests)
        @rule(data=st.data())
        def free(self, data: st.DataObject) -> None:
            name = data.draw(st.sampled_from(sorted(self.requests)))
            table = self.requests.pop(name).table
            self.manager.free(table)
            self.free_in_model(table)

        @precondition(lambda self: self.requests)
        @rule(data=st.data(), wrong=st.integers(10, 12))
        def cache_with_wrong_tokens(self, data: st.DataObject, wrong: int) -> None:
            """Claiming other tokens for a cached block is refused and changes nothing."""
            request = self.pick(data)
            if len(request.tokens) < self.size or self.manager.key_of(request.table[0]) is None:
                return
            tokens = [wrong, *request.tokens[1:]]
            before = self.snapshot()
            outcome = observe(self.manager.cache_blocks, request.table, tokens, request.salt)
            assert outcome.error is not None and issubclass(outcome.error, ValueError)
            assert self.snapshot() == before

        # ------------------------------------------------------------ invariants

        @invariant()
        def counters_follow_the_rules(self) -> None:
            stats = self.manager.stats
            actual = (stats.queried_blocks, stats.hit_blocks, stats.evictions)
            expected = (self.stats.queried_blocks, self.stats.hit_blocks, self.stats.evictions)
            assert actual == expected, (actual, expected)

        @invariant()
        def key_map_is_a_bijection_over_cached_blocks(self) -> None:
            cached = {b: self.manager.key_of(b) for b in range(self.total)}
            cached = {b: key for b, key in cached.items() if key is not None}
            assert self.manager.num_cached_blocks == len(cached)
            for block_id, key in cached.items():
                assert self.manager.cached_block(key) == block_id

        @invariant()
        def keys_describe_the_tokens_their_blocks_hold(self) -> None:
            for block_id in range(self.total):
                key = self.manager.key_of(block_id)
                if key is not None:
                    held = [self.cache.get(block_id * self.size + i) for i in range(self.size)]
                    expected = [(key.extra, token) for token in key.tokens]
                    assert held == expected, f"block {block_id} holds other tokens"

        @invariant()
        def queue_follows_the_rules_and_holds_free_blocks_once(self) -> None:
            queue = self.manager.free_block_ids()
            assert queue == self.queue
            assert len(set(queue)) == len(queue)
            held = [b for request in self.requests.values() for b in request.table]
            for block_id in range(self.total):
                assert self.manager.ref_count(block_id) == held.count(block_id)
                assert (block_id in queue) == (held.count(block_id) == 0)

        @invariant()
        def every_request_reads_its_own_tokens(self) -> None:
            for request in self.requests.values():
                for pos, token in enumerate(request.tokens):
                    slot = self.slot(request.table, pos)
                    assert self.cache.get(slot) == (request.salt, token)

    return PrefixCacheMachine
