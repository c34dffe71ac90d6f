"""vLLM's v1 KV-cache manager against the spec in lockstep (``.venv-vllm`` only, run by
``properties/test_vllm_conformance.py``). :class:`VllmConformance` drives vLLM and
:class:`~properties.vllm_rules.VllmRules` through admit, decode, free, free again and lookup: the
same results and exception classes, then the same tables, queue order, reference counts,
contents, lookup order, evictions, KV-event view and hit counters; a refused call changes nothing;
the spec's invariants hold on vLLM itself (simulated K/V). Below: planted vLLM bugs, each rule
switched off, one example per divergence."""

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
from properties.vllm_adapter import Request, VllmKVCache
from properties.vllm_rules import BEHAVIOUR_RULES, VllmRules


@dataclass(eq=False)
class Live:
    """A request both sides hold: vLLM's handle, the spec's table, its tokens and salt."""

    handle: Request
    table: list[int]
    tokens: list[int]
    salt: str | None


def conformance_machine(
    rules: frozenset[str] = BEHAVIOUR_RULES,
    adapter: Callable[[int, int, bool], VllmKVCache] = VllmKVCache,
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

        def slot(self, raw: list[int], pos: int) -> int:
            return raw[pos // self.size] * self.size + pos % self.size

        def write(self, live: Live, start: int) -> None:
            """Compute positions ``start ..`` of a request into vLLM's blocks."""
            raw = self.vllm.raw_table(live.handle)
            for pos in range(start, len(live.tokens)):
                self.kv[self.slot(raw, pos)] = (live.salt, live.tokens[pos])

        def unchanged(self, call: Callable[[], Any], what: str) -> Any:
            """``call()``'s outcome, which must leave vLLM's state as it was."""
            before = self.vllm.snapshot()
            outcome = observe(call)
            assert self.vllm.snapshot() == before, f"{what} changed vLLM"
            return outcome

        def lockstep(
            self, spec_call: Callable[[], Any], vllm_call: Callable[[], Any], what: str
        ) -> tuple[Any, Any] | None:
            """Both refuse with OutOfBlocksError, vLLM unchanged (None), or both grant (answers)."""
            expected = observe(spec_call)
            if expected.error is not None:
                assert expected.error is OutOfBlocksError
                actual = self.unchanged(vllm_call, f"a refused {what}")
                assert actual.error is OutOfBlocksError, f"{what}: vLLM {actual}"
                event(f"{what}: out of blocks")
                return None
            actual = observe(vllm_call)
            assert actual.error is None, f"{what}: vLLM {actual}, the rules {expected}"
            return expected.value, actual.value

        def registered(self, live: Live, evictions: int, computed: int) -> None:
            """After a grant: same table, register on both sides, label, write the K/V."""
            assert self.vllm.table(live.handle) == live.table, "tables differ"
            self.spec.register(live.table, live.tokens, live.salt)
            self.vllm.take_events()
            if self.spec.evictions > evictions:
                event("eviction")
            if any(len(blocks) > 1 for blocks in self.spec.cached_contents().values()):
                event("a content cached in two blocks")
            self.write(live, computed)

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
                refused = self.unchanged(lambda: self.vllm.admit(tokens, salt), "an empty prompt")
                assert refused.error is ValueError
                assert self.spec.allocate_prompt(tokens, salt) == ([], 0)
                return multiple()
            hits = self.spec.lookup(tokens, salt)
            assert self.vllm.lookup(tokens, salt) == hits, "prefix hits differ"
            hit_blocks, evictions = self.spec.stats.hit_blocks, self.spec.evictions
            both = self.lockstep(
                lambda: self.spec.allocate_prompt(tokens, salt),
                lambda: self.vllm.admit(tokens, salt),
                "admit",
            )
            if both is None:
                return multiple()
            (table, cached), (handle, hit_tokens) = both
            assert hit_tokens == cached, f"cached tokens: vLLM {hit_tokens}, spec {cached}"
            if cached:
                event("admit: prefix hit")
            hit_delta = (self.spec.stats.hit_blocks - hit_blocks) * self.size  # TOKEN_COUNTERS
            counters = (len(tokens), hit_delta) if self.caching else (0, 0)
            assert self.vllm.take_counters() == counters
            request = Live(handle, table, tokens, salt)
            self.registered(request, evictions, cached)
            self.requests.append(request)
            return request

        @rule(request=live, token=ALPHABET)
        def decode(self, request: Live, token: int) -> None:
            """One sampled token: grow, register a filled block."""
            tokens, evictions = [*request.tokens, token], self.spec.evictions
            both = self.lockstep(
                lambda: self.spec.append_slot(request.table, len(tokens)),
                lambda: self.vllm.decode(request.handle, token),
                "decode",
            )
            if both is None:
                return
            assert self.spec.pop_copy_pairs() == []  # NO_FORK: nothing is ever shared-written
            request.table, request.tokens = both[0], tokens
            self.registered(request, evictions, len(tokens) - 1)

        @rule(target=freed, request=consumes(live))
        def free(self, request: Live) -> Live:
            """The request ends on both sides."""
            head = self.spec.free_block_ids()[:1]
            expected = observe(self.spec.free, request.table)
            actual = observe(self.vllm.free, request.handle)
            assert expected.error is actual.error is None, f"free: vLLM {actual}, rules {expected}"
            queue = self.spec.free_block_ids()
            if queue[:1] != head and self.spec.content_of_block(queue[0]) is None:
                event("free: a block with no hash went to the head")
            self.vllm.take_events()
            self.requests.remove(request)
            return request

        @rule(request=freed)
        def free_again(self, request: Live) -> None:
            """FREE_BY_REQUEST: freeing a finished request again changes nothing in vLLM."""
            outcome = self.unchanged(lambda: self.vllm.free(request.handle), "a second free")
            assert outcome.error is None

        @rule(
            system=st.sampled_from(SYSTEM_PROMPTS),
            suffix=st.lists(ALPHABET),
            salt=st.sampled_from(SALTS),
        )
        def lookup(self, system: list[int], suffix: list[int], salt: str | None) -> None:
            """A lookup alone, which changes nothing."""
            tokens = system + suffix
            actual = self.unchanged(lambda: self.vllm.lookup(tokens, salt), "a lookup")
            if tokens or not self.caching:
                assert actual.value == self.spec.lookup(tokens, salt), "prefix hits differ"
            else:  # NO_EMPTY_PROMPT: vLLM's lookup refuses it, the spec finds nothing
                assert (actual.error, self.spec.lookup(tokens, salt)) == (ValueError, [])

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
            view = +self.vllm.router
            assert view == Counter({c: len(b) for c, b in self.spec.cached_contents().items()})
            assert self.vllm.removed == self.spec.evictions, "evictions differ"

        @invariant()
        def vllm_keeps_the_spec_invariants(self) -> None:
            """Ref counts are live references, free iff unheld, block 0 never handed out."""
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
                    slot = self.slot(raw, pos)
                    assert self.kv.get(slot) == (request.salt, token), (pos, slot)

        @invariant()
        def cached_blocks_hold_the_tokens_they_name(self) -> None:
            for block in self.vllm.pool.blocks[1:]:
                if (content := self.vllm.content_of(block.block_hash)) is not None:
                    salt, prefix = content
                    start = block.block_id * self.size
                    held = [self.kv.get(start + i) for i in range(self.size)]
                    assert held == [(salt, t) for t in prefix[-self.size :]], block.block_id

    return VllmConformance


TestVllmConformance = conformance_machine().TestCase


def run_machine(machine: type[RuleBasedStateMachine]) -> None:
    run_state_machine_as_test(machine, settings=FIND)


def planted_bugs() -> dict[str, tuple[type, str, Any]]:
    """``(class, attribute, replacement)``: each breaks vLLM where the spec or a rule is fixed."""
    from vllm.v1.core import block_pool, kv_cache_utils
    from vllm.v1.core import kv_cache_coordinator as coordinators
    from vllm.v1.core import single_type_kv_cache_manager as single

    pool, queue = block_pool.BlockPool, kv_cache_utils.FreeKVCacheBlockQueue
    unitary, coordinator = coordinators.UnitaryKVCacheCoordinator, coordinators.KVCacheCoordinator
    find, count = unitary.find_longest_cache_hit, coordinator.get_num_blocks_to_allocate
    free_blocks, single_type = pool.free_blocks, single.SingleTypeKVCacheManager

    def touch_in_queue(self: Any, blocks: Any) -> None:
        for block in blocks:
            block.ref_cnt += 1

    def free_but_one(self: Any, ordered_blocks: Any) -> None:
        blocks = list(ordered_blocks)
        free_blocks(self, blocks[1:])
        for block in blocks[:1]:
            block.ref_cnt -= 1

    def free_in_table_order(self: Any, request_id: str) -> None:
        self.block_pool.free_blocks(self.pop_blocks_for_free(request_id))

    return {
        "uncached blocks freed to the tail": (queue, "prepend_n", queue.append_n),
        "blocks freed in table order": (single_type, "free", free_in_table_order),
        "a reused block keeps its hash": (pool, "_maybe_evict_cached_block", lambda *_: False),
        "a revived block stays in the free queue": (pool, "touch", touch_in_queue),
        "a hit covers the prompt's last token": (
            unitary,
            "find_longest_cache_hit",
            lambda self, hashes, limit: find(self, hashes, limit + 1),
        ),
        "allocation counts one block too few": (
            coordinator,
            "get_num_blocks_to_allocate",
            lambda self, *args, **kwargs: max(0, count(self, *args, **kwargs) - 1),
        ),
        "free drops a block": (pool, "free_blocks", free_but_one),
    }


@pytest.mark.parametrize("bug", sorted(planted_bugs()))
def test_planted_vllm_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(*planted_bugs()[bug])
    with pytest.raises(AssertionError):
        run_machine(conformance_machine())


def test_control_the_machine_passes_on_unpatched_vllm_with_the_same_search() -> None:
    run_machine(conformance_machine())


@pytest.mark.parametrize("rule_name", sorted(BEHAVIOUR_RULES))
def test_without_a_behavioural_divergence_the_machine_fails(rule_name: str) -> None:
    """The spec alone disagrees with vLLM exactly where each rule says: every rule is needed."""
    with pytest.raises(AssertionError):
        run_machine(conformance_machine(rules=BEHAVIOUR_RULES - {rule_name}))


def test_without_the_null_block_offset_the_machine_fails() -> None:
    identity = functools.partial(VllmKVCache, to_spec=lambda vllm_id: vllm_id)
    with pytest.raises(AssertionError):
        run_machine(conformance_machine(adapter=identity))


def test_free_order_example() -> None:
    """UNCACHED_FREE_TO_HEAD: 9 tokens, blocks of 4: vLLM and the rules free the partial block to
    the head, the two cached ones to the tail, last first; the spec frees all three to the tail."""
    tokens = list(range(9))
    vllm = VllmKVCache(6, 4, caching=True)
    vllm.free(vllm.admit(tokens, None)[0])
    rules, spec = VllmRules(6, 4), PrefixCachingBlockManager(6, 4)
    for manager, register in ((rules, rules.register), (spec, spec.cache_blocks)):
        table, _ = manager.allocate_prompt(tokens)
        register(table, tokens)
        manager.free(table)
    assert vllm.free_block_ids() == rules.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert spec.free_block_ids() == [3, 4, 5, 2, 1, 0]


def test_duplicates_example() -> None:
    """DUPLICATES_CACHED: 8 tokens in blocks of 4 hit only the first block (the last token is
    recomputed): the second is computed again, and vLLM caches the copy too."""
    tokens = list(range(8))
    vllm = VllmKVCache(6, 4, caching=True)
    (first, _), (second, hit_tokens) = vllm.admit(tokens, None), vllm.admit(tokens, None)
    assert (hit_tokens, vllm.table(first), vllm.table(second)) == (4, [0, 1], [0, 2])
    assert vllm.cached_contents()[(None, tuple(tokens))] == [1, 2]  # the spec caches only 1


def test_exhaustion_returns_none_and_changes_nothing() -> None:
    """NONE_ON_EXHAUSTION, on vLLM's own API, and the adapter's OutOfBlocksError."""
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


def test_registration_counters_and_salts() -> None:
    """REGISTER_ON_ALLOCATE: a block is hit right after allocate_slots, before its K/V exists.
    TOKEN_COUNTERS: queries, hits in tokens. SALT_IN_FIRST_BLOCK: still no later block shared."""
    vllm = VllmKVCache(4, 2, caching=True)
    vllm.admit([1, 2, 3], None)
    assert vllm.lookup([1, 2, 3], None) == [0]
    vllm = VllmKVCache(6, 2, caching=True)
    vllm.admit([1, 2, 3, 4, 5], None)
    vllm.admit([1, 2, 3, 4, 6], None)
    assert vllm.take_counters() == (10, 4)
    vllm = VllmKVCache(8, 2, caching=True)
    vllm.admit([1, 2, 3, 4, 5], "a")
    assert (vllm.lookup([1, 2, 3, 4, 5], "b"), vllm.lookup([1, 2, 3, 4, 5], "a")) == ([], [0, 1])


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
    """HASH_IDENTITY: under a colliding hash, [8, 9, 3] hits the block of [1, 2] (blocks of 2),
    against the spec's "a hit never returns other tokens"; the spec compares tokens and misses."""
    vllm = VllmKVCache(4, 2, caching=True, hash_fn=lambda parts: b"\x01" * 32)
    first, _ = vllm.admit([1, 2, 3], None)
    assert vllm.lookup([8, 9, 3], None) == vllm.table(first)[:1]  # tokens [1, 2], not [8, 9]
    spec = PrefixCachingBlockManager(4, 2, hash_fn=lambda parent, tokens, extra: 1)
    table, _ = spec.allocate_prompt([1, 2, 3])
    spec.cache_blocks(table, [1, 2, 3])
    assert spec.lookup([8, 9, 3]) == []
    VllmKVCache(1, 1, caching=True)  # puts the sha256 seed back for later tests
