"""vLLM's v1 KV-cache manager against pagedkv's spec, in lockstep: the conformance machine.

Run in ``.venv-vllm`` (``python -m properties.vllm_env``; the main suite's
``properties/test_vllm_conformance.py`` does it). The file is not named ``test_*.py`` so the main
environment, which has no vLLM, never collects it.

:class:`VllmConformance` drives :class:`~properties.vllm_adapter.VllmKVCache` (vLLM's
``KVCacheManager`` and ``BlockPool``) and :class:`~properties.vllm_rules.VllmRules` (the spec
with vLLM's named divergences) through the same operations: admit a prompt (lookup, allocate,
register), decode one token, free, free again, look up. It compares every result and every
exception class, and after every step all they share, exactly: each live request's blocks, the
free queue in order (so reuse and eviction order), every reference count, which block holds
which content and in which lookup order, the eviction count, the router's view built from vLLM's
KV events, and the prefix-hit counters. A refused call must leave vLLM's state unchanged. It
also checks the spec's invariants directly on vLLM: reference counts equal live references, a
block is free exactly when unheld, the placeholder block is never handed out, every request
reads back its own tokens through vLLM's tables, and every cached block holds the tokens its
hash names (the machine simulates the K/V data).

Below the machine: planted bugs in vLLM (monkeypatched) that it must catch, each behavioural
divergence switched off (the machine must then fail, so every rule is needed), and one small
example per mapping divergence.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
    run_state_machine_as_test,
)

from pagedkv.spec import BlockTableError, OutOfBlocksError
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager
from properties.block_model import observe
from properties.machines.prefix_cache import ALPHABET, SALTS, SYSTEM_PROMPTS
from properties.mutants import FIND
from properties.vllm_adapter import VllmKVCache, VllmRequest
from properties.vllm_rules import (
    BEHAVIOUR_RULES,
    VllmRules,
)


@dataclass(eq=False)
class Live:
    """A request both sides hold: vLLM's handle, the spec's table, its tokens and salt."""

    handle: VllmRequest
    table: list[int]
    tokens: list[int]
    salt: str | None


Adapter = Callable[[int, int, bool], VllmKVCache]


def conformance_machine(
    rules: frozenset[str] = BEHAVIOUR_RULES, adapter: Adapter = VllmKVCache
) -> type[RuleBasedStateMachine]:
    """The machine comparing ``adapter`` (vLLM) with the spec under ``rules``."""

    class VllmConformance(RuleBasedStateMachine):
        live = Bundle("live")
        freed = Bundle("freed")

        def __init__(self) -> None:
            super().__init__()
            self.requests: list[Live] = []
            self.kv: dict[int, tuple[str | None, int]] = {}  # vLLM slot -> (salt, token)

        @initialize(
            total_blocks=st.integers(1, 12) | st.integers(13, 32),
            block_size=st.sampled_from([1, 2, 4]),
            caching=st.booleans(),
        )
        def make(self, total_blocks: int, block_size: int, caching: bool) -> None:
            self.spec = VllmRules(total_blocks, block_size, caching, rules)
            self.vllm = adapter(total_blocks, block_size, caching)
            self.size = block_size
            self.caching = caching

        # ------------------------------------------------------------ helpers

        def write(self, live: Live, start: int) -> None:
            """Compute positions ``start ..`` of a request into vLLM's blocks."""
            raw = self.vllm.raw_table(live.handle)
            for pos in range(start, len(live.tokens)):
                slot = raw[pos // self.size] * self.size + pos % self.size
                self.kv[slot] = (live.salt, live.tokens[pos])

        def note(self, evictions: int) -> None:
            """Label the example with the divergences this step exercised."""
            if self.spec.evictions > evictions:
                event("eviction")
            if any(len(blocks) > 1 for blocks in self.spec.cached_contents().values()):
                event("a content cached in two blocks")

        def same_outcome(self, what: str, expected: Any, actual: Any) -> None:
            assert actual.error == expected.error, (
                f"{what}: vLLM {actual}, the spec under the named divergences {expected}"
            )

        # ------------------------------------------------------------ rules

        @rule(
            target=live,
            system=st.sampled_from(SYSTEM_PROMPTS),
            suffix=st.lists(ALPHABET, max_size=6),
            salt=st.sampled_from(SALTS),
        )
        def admit(self, system: list[int], suffix: list[int], salt: str | None) -> object:
            """Look up, allocate and register a prompt on both sides."""
            tokens = system + suffix
            if not tokens:  # NO_EMPTY_PROMPT: vLLM refuses it, the spec gives an empty table
                before = self.vllm.snapshot()
                assert observe(self.vllm.admit, tokens, salt).error is ValueError
                assert self.spec.allocate_prompt(tokens, salt) == ([], 0)
                assert self.vllm.snapshot() == before, "a refused admission changed vLLM"
                return multiple()
            hits = self.spec.lookup(tokens, salt)
            assert self.vllm.lookup(tokens, salt) == hits, "prefix hits differ"
            hit_blocks = self.spec.stats.hit_blocks
            before = self.vllm.snapshot()
            expected = observe(self.spec.allocate_prompt, tokens, salt)
            actual = observe(self.vllm.admit, tokens, salt)
            self.same_outcome(f"admit {tokens}", expected, actual)
            if expected.error is not None:
                assert expected.error is OutOfBlocksError
                assert self.vllm.snapshot() == before, "a refused admission changed vLLM"
                event("admit: out of blocks")
                return multiple()
            table, cached = expected.value
            handle, hit_tokens = actual.value
            assert hit_tokens == cached, f"cached tokens: vLLM {hit_tokens}, spec {cached}"
            if cached:
                event("admit: prefix hit")
            queries_hits = self.vllm.take_counters()  # TOKEN_COUNTERS
            hit_delta = (self.spec.stats.hit_blocks - hit_blocks) * self.size
            assert queries_hits == ((len(tokens), hit_delta) if self.caching else (0, 0))
            evictions = self.spec.evictions
            self.spec.register(table, tokens, salt)
            self.vllm.take_events()
            self.note(evictions)
            request = Live(handle, table, tokens, salt)
            assert self.vllm.table(handle) == table, "tables differ"
            self.write(request, cached)
            self.requests.append(request)
            return request

        @rule(request=live, token=ALPHABET)
        def decode(self, request: Live, token: int) -> None:
            """One sampled token: grow, register a filled block."""
            tokens = [*request.tokens, token]
            before, evictions = self.vllm.snapshot(), self.spec.evictions
            expected = observe(self.spec.append_slot, request.table, len(tokens))
            actual = observe(self.vllm.decode, request.handle, token)
            self.same_outcome("decode", expected, actual)
            if expected.error is not None:
                assert expected.error is OutOfBlocksError
                assert self.vllm.snapshot() == before, "a refused decode changed vLLM"
                event("decode: out of blocks")
                return
            assert self.spec.pop_copy_pairs() == []  # NO_FORK: nothing is ever shared-written
            request.table, request.tokens = expected.value, tokens
            assert self.vllm.table(request.handle) == request.table, "tables differ"
            self.spec.register(request.table, tokens, request.salt)
            self.vllm.take_events()
            self.note(evictions)
            self.write(request, len(tokens) - 1)

        @rule(target=freed, request=consumes(live))
        def free(self, request: Live) -> Live:
            """The request ends on both sides."""
            head = self.spec.free_block_ids()[:1]
            expected = observe(self.spec.free, request.table)
            actual = observe(self.vllm.free, request.handle)
            self.same_outcome("free", expected, actual)
            assert expected.error is None
            queue = self.spec.free_block_ids()
            if queue[:1] != head and self.spec.content_of_block(queue[0]) is None:
                event("free: a block with no hash went to the head")
            self.vllm.take_events()
            self.requests.remove(request)
            return request

        @rule(request=freed)
        def free_again(self, request: Live) -> None:
            """FREE_BY_REQUEST: freeing a finished request again changes nothing in vLLM."""
            before = self.vllm.snapshot()
            self.vllm.free(request.handle)
            assert self.vllm.snapshot() == before, "a second free changed vLLM"

        @rule(
            system=st.sampled_from(SYSTEM_PROMPTS),
            suffix=st.lists(ALPHABET),
            salt=st.sampled_from(SALTS),
        )
        def lookup(self, system: list[int], suffix: list[int], salt: str | None) -> None:
            """A lookup alone, which changes nothing."""
            tokens = system + suffix
            before = self.vllm.snapshot()
            actual = observe(self.vllm.lookup, tokens, salt)
            if tokens or not self.caching:
                assert actual.value == self.spec.lookup(tokens, salt), "prefix hits differ"
            else:  # NO_EMPTY_PROMPT: vLLM's lookup refuses it, the spec finds nothing
                assert (actual.error, self.spec.lookup(tokens, salt)) == (ValueError, [])
            assert self.vllm.snapshot() == before, "a lookup changed vLLM"

        # ------------------------------------------------------------ invariants

        @invariant()
        def vllm_follows_the_spec_and_the_named_divergences(self) -> None:
            vllm, spec = self.vllm, self.spec
            blocks = range(spec.total_blocks)
            assert vllm.free_block_ids() == spec.free_block_ids(), "free queues differ"
            assert vllm.num_free_blocks == spec.num_free_blocks
            assert vllm.ref_counts() == [spec.ref_count(b) for b in blocks], "ref counts differ"
            assert vllm.block_contents() == [spec.content_of_block(b) for b in blocks]
            assert vllm.cached_contents() == spec.cached_contents(), "cached contents differ"
            for request in self.requests:
                assert vllm.table(request.handle) == request.table

        @invariant()
        def kv_events_mirror_the_cache(self) -> None:
            """EVICTIONS_AS_EVENTS: the router's view (stored minus removed) is the cache."""
            view = +self.vllm.log.contents
            assert view == Counter({c: len(b) for c, b in self.spec.cached_contents().items()})
            assert self.vllm.log.removed == self.spec.evictions, "evictions differ"

        @invariant()
        def vllm_keeps_the_spec_invariants(self) -> None:
            """Reference counts equal live references; free exactly when unheld; block 0 is
            never handed out."""
            held = Counter(b for r in self.requests for b in self.vllm.raw_table(r.handle))
            pool = self.vllm.pool
            assert 0 not in held, "the placeholder block is in a table"
            refs = {block.block_id: block.ref_cnt for block in pool.blocks[1:]}
            assert refs == {b: held.get(b, 0) for b in refs}, "ref counts != live references"
            queue = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
            assert len(queue) == len(set(queue)) == pool.get_num_free_blocks()
            assert set(queue) == {b for b, count in refs.items() if count == 0}

        @invariant()
        def every_request_reads_its_own_tokens(self) -> None:
            for request in self.requests:
                raw = self.vllm.raw_table(request.handle)
                for pos, token in enumerate(request.tokens):
                    slot = raw[pos // self.size] * self.size + pos % self.size
                    assert self.kv.get(slot) == (request.salt, token), (pos, slot)

        @invariant()
        def cached_blocks_hold_the_tokens_they_name(self) -> None:
            for block in self.vllm.pool.blocks[1:]:
                content = self.vllm.content_of(block.block_hash)
                if content is None:
                    continue
                salt, prefix = content
                start = block.block_id * self.size
                held = [self.kv.get(start + i) for i in range(self.size)]
                assert held == [(salt, t) for t in prefix[-self.size :]], block.block_id

    return VllmConformance


TestVllmConformance = conformance_machine().TestCase


def run_machine(machine: type[RuleBasedStateMachine]) -> None:
    run_state_machine_as_test(machine, settings=FIND)


# ----------------------------------------------------------------- planted bugs in vLLM


def _planted_bugs() -> dict[str, Callable[[pytest.MonkeyPatch], None]]:
    """Each entry breaks one vLLM behaviour the spec (or a named divergence) fixes."""
    from vllm.v1.core import block_pool, kv_cache_coordinator, kv_cache_utils
    from vllm.v1.core import single_type_kv_cache_manager as single

    queue_cls = kv_cache_utils.FreeKVCacheBlockQueue
    pool_cls = block_pool.BlockPool

    def prepend_at_tail(mp: pytest.MonkeyPatch) -> None:
        mp.setattr(queue_cls, "prepend_n", queue_cls.append_n)

    def free_in_table_order(mp: pytest.MonkeyPatch) -> None:
        def free(self: Any, request_id: str) -> None:
            self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

        mp.setattr(single.SingleTypeKVCacheManager, "free", free)

    def no_eviction(mp: pytest.MonkeyPatch) -> None:
        mp.setattr(pool_cls, "_maybe_evict_cached_block", lambda self, block: False)

    def revival_left_in_queue(mp: pytest.MonkeyPatch) -> None:
        def touch(self: Any, blocks: Any) -> None:
            for block in blocks:
                block.ref_cnt += 1

        mp.setattr(pool_cls, "touch", touch)

    def hit_covers_last_token(mp: pytest.MonkeyPatch) -> None:
        coordinator = kv_cache_coordinator.UnitaryKVCacheCoordinator
        original = coordinator.find_longest_cache_hit

        def find(self: Any, block_hashes: Any, max_cache_hit_length: int) -> Any:
            return original(self, block_hashes, max_cache_hit_length + 1)

        mp.setattr(coordinator, "find_longest_cache_hit", find)

    def admission_undercounts(mp: pytest.MonkeyPatch) -> None:
        coordinator = kv_cache_coordinator.KVCacheCoordinator
        original = coordinator.get_num_blocks_to_allocate

        def count(self: Any, *args: Any, **kwargs: Any) -> int:
            return max(0, original(self, *args, **kwargs) - 1)

        mp.setattr(coordinator, "get_num_blocks_to_allocate", count)

    def free_leaks_a_block(mp: pytest.MonkeyPatch) -> None:
        original = pool_cls.free_blocks

        def free_blocks(self: Any, ordered_blocks: Any) -> None:
            blocks = list(ordered_blocks)
            original(self, blocks[1:])
            for block in blocks[:1]:
                block.ref_cnt -= 1

        mp.setattr(pool_cls, "free_blocks", free_blocks)

    return {
        "uncached blocks freed to the tail": prepend_at_tail,
        "blocks freed in table order": free_in_table_order,
        "a reused block keeps its hash": no_eviction,
        "a revived block stays in the free queue": revival_left_in_queue,
        "a hit covers the prompt's last token": hit_covers_last_token,
        "allocation counts one block too few": admission_undercounts,
        "free drops a block": free_leaks_a_block,
    }


@pytest.mark.parametrize("bug", sorted(_planted_bugs()))
def test_planted_vllm_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _planted_bugs()[bug](monkeypatch)
    with pytest.raises(AssertionError):
        run_machine(conformance_machine())


def test_control_the_machine_passes_on_unpatched_vllm_with_the_same_search() -> None:
    run_machine(conformance_machine())


# ----------------------------------------------------------------- every divergence is needed


@pytest.mark.parametrize("rule_name", sorted(BEHAVIOUR_RULES))
def test_without_a_behavioural_divergence_the_machine_fails(rule_name: str) -> None:
    """The spec alone disagrees with vLLM exactly where each rule says."""
    with pytest.raises(AssertionError):
        run_machine(conformance_machine(rules=BEHAVIOUR_RULES - {rule_name}))


def test_without_the_null_block_offset_the_machine_fails() -> None:
    identity = functools.partial(VllmKVCache, to_spec=lambda vllm_id: vllm_id)
    with pytest.raises(AssertionError):
        run_machine(conformance_machine(adapter=identity))


def test_with_every_rule_off_the_rules_are_the_spec() -> None:
    """``VllmRules`` with no rule answers as ``PrefixCachingBlockManager`` does, call for call."""
    plain, spec = VllmRules(6, 2, rules=frozenset()), PrefixCachingBlockManager(6, 2)
    for manager in (plain, spec):
        a, _ = manager.allocate_prompt([1, 2, 3, 4, 5])
        manager.cache_blocks(a, [1, 2, 3, 4, 5])
        manager.free(a)
        b, _ = manager.allocate_prompt([1, 2, 3, 4, 9])
        manager.cache_blocks(b, [1, 2, 3, 4, 9])
    assert plain.free_block_ids() == spec.free_block_ids() == [4, 5, 2]
    assert [plain.key_of(i) for i in range(6)] == [spec.key_of(i) for i in range(6)]


# ----------------------------------------------------------------- one example per divergence


def test_free_order_example() -> None:
    """UNCACHED_FREE_TO_HEAD, on vLLM and on the rules: 9 tokens of block size 4 hold two full
    (cached) blocks and one partial; freeing puts the partial at the head, the rest at the
    tail, last block first. The spec puts all three at the tail."""
    tokens = list(range(9))
    vllm, rules = VllmKVCache(6, 4, caching=True), VllmRules(6, 4)
    spec = PrefixCachingBlockManager(6, 4)
    handle, _ = vllm.admit(tokens, None)
    table, _ = rules.allocate_prompt(tokens)
    rules.register(table, tokens)
    rules.free(table)
    table, _ = spec.allocate_prompt(tokens)
    spec.cache_blocks(table, tokens)
    spec.free(table)
    vllm.free(handle)
    assert vllm.free_block_ids() == rules.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert spec.free_block_ids() == [3, 4, 5, 2, 1, 0]


def test_duplicates_example() -> None:
    """DUPLICATES_CACHED: an 8-token prompt of block size 4 hits only its first block (the last
    token is recomputed), so its second block is computed again: vLLM caches the copy too."""
    tokens = list(range(8))
    vllm = VllmKVCache(6, 4, caching=True)
    first, _ = vllm.admit(tokens, None)
    second, hit_tokens = vllm.admit(tokens, None)
    assert hit_tokens == 4
    assert vllm.table(first) == [0, 1] and vllm.table(second) == [0, 2]
    assert vllm.cached_contents()[(None, tuple(tokens))] == [1, 2]  # the spec caches only 1


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    """NONE_ON_EXHAUSTION, on vLLM's own API."""
    vllm = VllmKVCache(2, 4, caching=True)
    before = vllm.snapshot()
    request = vllm._request(list(range(9)), None)
    computed, hit_tokens, _ = vllm.manager.get_computed_blocks(request)
    assert vllm.manager.allocate_slots(request, 9, hit_tokens, computed) is None
    assert vllm.snapshot() == before
    with pytest.raises(OutOfBlocksError):
        vllm.admit(list(range(9)), None)


def test_null_block_is_reserved() -> None:
    """NULL_BLOCK: block 0 is vLLM's placeholder, outside the free queue."""
    vllm = VllmKVCache(3, 4, caching=False)
    assert vllm.pool.null_block.block_id == 0 and vllm.pool.null_block.is_null
    assert [b.block_id for b in vllm.pool.free_block_queue.get_all_free_blocks()] == [1, 2, 3]
    assert vllm.free_block_ids() == [0, 1, 2]


def test_free_again_is_a_no_op_where_the_spec_refuses() -> None:
    """FREE_BY_REQUEST."""
    vllm, spec = VllmKVCache(3, 4, caching=False), PrefixCachingBlockManager(3, 4)
    handle, _ = vllm.admit([1, 2, 3], None)
    table, _ = spec.allocate_prompt([1, 2, 3])
    vllm.free(handle)
    spec.free(table)
    before = vllm.snapshot()
    vllm.free(handle)
    assert vllm.snapshot() == before
    with pytest.raises(BlockTableError):
        spec.free(table)


def test_registration_happens_on_allocation() -> None:
    """REGISTER_ON_ALLOCATE: right after allocate_slots, before any K/V exists, another
    request already hits the block."""
    vllm = VllmKVCache(4, 2, caching=True)
    vllm.admit([1, 2, 3], None)
    assert vllm.lookup([1, 2, 3], None) == [0]


def test_counters_are_in_tokens() -> None:
    """TOKEN_COUNTERS: queries are the prompt's tokens, hits the hit tokens."""
    vllm = VllmKVCache(6, 2, caching=True)
    vllm.admit([1, 2, 3, 4, 5], None)
    vllm.admit([1, 2, 3, 4, 6], None)
    assert vllm.take_counters() == (10, 4)


def test_salts_share_no_block() -> None:
    """SALT_IN_FIRST_BLOCK: the salt enters the first hash only, yet no later block is shared."""
    vllm = VllmKVCache(8, 2, caching=True)
    vllm.admit([1, 2, 3, 4, 5], "a")
    assert vllm.lookup([1, 2, 3, 4, 5], "b") == []
    assert vllm.lookup([1, 2, 3, 4, 5], "a") == [0, 1]


def test_an_empty_prompt_is_refused() -> None:
    """NO_EMPTY_PROMPT: vLLM refuses zero new tokens; the spec allocates an empty table."""
    for caching in (False, True):
        vllm = VllmKVCache(2, 4, caching=caching)
        with pytest.raises(ValueError):
            vllm.admit([], None)
    with pytest.raises(ValueError):
        vllm.lookup([], None)
    spec = PrefixCachingBlockManager(2, 4)
    assert (spec.lookup([]), spec.allocate_prompt([])) == ([], ([], 0))


def test_a_hash_collision_hands_out_a_block_with_other_tokens() -> None:
    """HASH_IDENTITY, the one vLLM behaviour here that breaks a spec invariant ("a hit never
    returns a block with other tokens"), under a hash that collides on purpose. Minimal
    reproduction: block size 2, prompt [1, 2, 3] is cached; [8, 9, 3] then hits its block.
    The spec, under the same colliding hash, compares the tokens and misses."""
    vllm = VllmKVCache(4, 2, caching=True, hash_fn=lambda parts: b"\x01" * 32)
    first, _ = vllm.admit([1, 2, 3], None)
    assert vllm.lookup([8, 9, 3], None) == vllm.table(first)[:1]  # tokens [1, 2], not [8, 9]
    spec = PrefixCachingBlockManager(4, 2, hash_fn=lambda parent, tokens, extra: 1)
    table, _ = spec.allocate_prompt([1, 2, 3])
    spec.cache_blocks(table, [1, 2, 3])
    assert spec.lookup([8, 9, 3]) == []
    VllmKVCache(1, 1, caching=True)  # puts the sha256 seed back for later tests
