"""The prefix-caching managers in lockstep: impl (``IMPL``) against the spec (``SPEC``), with the
same results or exception classes and KV events (keys by content and hash, :func:`describe`),
then the whole state, and both against the independent ``PrefixCacheModel`` (for the calls it
models, on well-typed arguments or ones the spec accepts). Shared prompts, equal new salts and a
colliding hash make hits, revivals and evictions frequent; bad input is fed too (wrong types,
int subclasses, unhashable salts, stale and forged tables, other tokens). KV data is simulated:
each request reads its own tokens, and each cached block holds those its key names (but blocks
forged by bad input and the requests that hit them). A mirror fed only the KV events is the key
map. Also the prompt strategies other machines share."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.spec import BlockTableError
from pagedkv.spec.prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from properties.block_model import Outcome
from properties.machines.block_manager import IntSubclass, assert_same_construction
from properties.machines.lockstep import Lockstep, same_outcome
from properties.outcomes import outcome
from properties.prefix_model import Content, Event, PrefixCacheModel, hashable

SYSTEM_PROMPTS = [[], [7, 7, 8, 9, 7, 8], [7, 7, 8, 9, 1, 2, 3, 4, 5], [5, 5, 5, 5, 5, 5, 5, 5]]
ALPHABET = st.integers(0, 2)
SALTS = [None, "tenant-b"]
SALT_DRAWS = st.sampled_from(SALTS) | st.builds(lambda: "".join(["tenant", "-b"]))
"""A salt of ``SALTS``, or an equal new string: equal salts share blocks whatever their identity."""
WRONG_TOKEN = 10  # a token no prompt holds
OTHER_SALT = "tenant-z"  # a salt no request uses
FILLER = 9  # the token a sequence holds where no rule chose one (outside ALPHABET)
BAD_TOKEN_LISTS = st.one_of(
    st.sampled_from(["012", None, 3, range(4), {0, 1}, b"\x00\x01"]),
    st.lists(
        st.one_of(
            ALPHABET,
            st.sampled_from([-1, True, 1.0, None, "1", 2**70, IntSubclass(1), IntSubclass(-1)]),
        ),
        max_size=6,
    ),
)
ODD_SALTS = st.sampled_from([[1], {1}, frozenset({1}), (None,), 0, b"x"])
ODD_TYPES = ("bad tokens", "odd salt")  # odd_cache's cases the model does not rule on


def colliding_hash(parent: object, tokens: tuple[int, ...], extra: object) -> int:
    """A deliberately terrible hash: most keys collide."""
    return len(tokens) % 2


def prompts() -> st.SearchStrategy[list[int]]:
    return st.builds(
        lambda system, suffix: system + suffix,
        st.sampled_from(SYSTEM_PROMPTS),
        st.lists(ALPHABET, max_size=6),
    )


def describe(key: Any) -> Any:
    """A key's content, root first: ``(tokens, extra, hash)`` per level; works across classes."""
    levels = []
    while key is not None:
        levels.append((key.tokens, key.extra, key.hash_value))
        key = key.parent
    return tuple(reversed(levels))


def content_of(key: Any) -> Content | None:
    """What a key of any class names, as the model does: ``(extra, the whole token prefix)``."""
    if key is None:
        return None
    levels = describe(key)
    return hashable(levels[-1][1]), tuple(token for tokens, _, _ in levels for token in tokens)


def event_of(item: KVEvent) -> Event:
    if isinstance(item, BlockStored):
        return ("stored", item.block_id, content_of(item.key))
    if isinstance(item, BlockRemoved):
        return ("removed", item.block_id, content_of(item.key))
    assert isinstance(item, AllBlocksCleared), item
    return ("cleared", None, None)


def describe_event(item: Any) -> tuple[str, Any, Any]:
    key = getattr(item, "key", None)
    return type(item).__name__, getattr(item, "block_id", None), describe(key)


def plain(value: Any) -> Any:
    """Counters as a tuple (the model's ``take_stats``), anything else as it is."""
    return dataclasses.astuple(value) if dataclasses.is_dataclass(value) else value


@dataclasses.dataclass(eq=False)
class Seq:
    table: list[int | None]  # None: released by a sliding window
    tokens: list[int]  # computed or not
    salt: Hashable
    trusted: bool = True  # it never hit a forged block: it reads its own tokens


class PrefixCacheMachine(Lockstep, RuleBasedStateMachine):
    SPEC: ClassVar[type] = spec_pc.PrefixCachingBlockManager
    IMPL: ClassVar[type] = PrefixCachingBlockManager

    @initialize(
        total_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 3, 4]),
        collide=st.booleans(),
        events_on=st.booleans(),
    )
    def start(self, total_blocks: int, block_size: int, collide: bool, events_on: bool) -> None:
        kwargs: dict[str, Any] = {"hash_fn": colliding_hash} if collide else {}
        kwargs["enable_kv_events"] = events_on
        self.model = self.SPEC(total_blocks, block_size, **kwargs)
        self.impl = self.IMPL(total_blocks, block_size, **kwargs)
        self.rules = PrefixCacheModel(total_blocks, block_size)
        self.total_blocks, self.size, self.events_on = total_blocks, block_size, events_on
        self.seqs: list[Seq] = []
        self.dead: list[list[int]] = []  # freed tables
        self.kv: dict[int, tuple[Hashable, int]] = {}  # slot -> (salt, token)
        self.mirror: dict[Content, int] = {}  # the key map, rebuilt from KV events alone
        self.forged: set[tuple[int, Content]] = set()  # registered by bad input: other tokens
        self.typed = True  # the arguments are the model's: it rules on refusals too

    def state(self, manager: Any) -> tuple[object, ...]:
        blocks = range(self.total_blocks)
        return (
            manager.free_block_ids(), [manager.ref_count(b) for b in blocks],
            [content_of(manager.key_of(b)) for b in blocks], manager.num_cached_blocks,
            plain(manager.stats), manager.pending_copy_pairs(), list(manager.waiting_for_copy),
            manager.usage, manager.num_free_blocks,
        )  # fmt: skip

    def snapshot(self) -> tuple[object, ...]:
        return self.state(self.model), self.state(self.impl)

    def expect(self, name: str, *args: Any) -> tuple[str, Any]:
        """The spec's outcome, which must be the model's where it rules."""
        expected = outcome(getattr(self.model, name), *args)
        call = getattr(self.rules, "reset" if name == "reset_prefix_cache" else name, None)
        if call is None or not (self.typed or expected[0] == "ok"):
            return expected
        rules = call(*args)
        rules = rules if isinstance(rules, Outcome) else Outcome(rules)  # lookup's: the value
        ruled = ("raised", rules.error) if rules.error else ("ok", rules.value)
        assert same_outcome(ruled, expected, plain), f"{name}{args}: model {ruled}, {expected}"
        return expected

    def view(self, value: Any) -> Any:
        """Keys by content and hash, counters by class name and values (a copy's class)."""
        if hasattr(value, "hash_value"):
            return "key", describe(value)
        return (type(value).__name__, plain(value)) if hasattr(value, "hit_blocks") else value

    def after(self, name: str, args: tuple[Any, ...], expected: tuple[str, Any]) -> None:
        """The call's KV events: impl's are the spec's, and the model's; a mirror replays them."""
        spec_events, impl_events = self.model.take_events(), self.impl.take_events()
        described = list(map(describe_event, spec_events))
        assert list(map(describe_event, impl_events)) == described, f"{name}{args}: events"
        taken = list(map(event_of, spec_events))
        ruled = self.rules.events if self.events_on else []
        assert taken == ruled, f"{name}: events {taken}, the model's {ruled}"
        self.rules.events = []
        for kind, block_id, content in taken:
            event("kv events")
            if kind == "stored":
                self.mirror[content] = block_id
            elif kind == "removed":
                assert self.mirror.pop(content) == block_id, f"{name}: removed unknown key"
            else:
                self.mirror.clear()

    def odd(self, name: str, *args: Any, typed: bool = False) -> tuple[str, Any]:
        """A call with bad input: the model follows (unless ``typed``) only where the spec
        accepts it, and what it registers is forged (its blocks hold other tokens)."""
        before = set(self.rules.content_of.items())
        self.typed = typed
        try:
            return self.both(name, *args)
        finally:
            self.typed = True
            self.forged |= set(self.rules.content_of.items()) - before

    def slot(self, table: list[int | None], pos: int) -> int:
        return table[pos // self.size] * self.size + pos % self.size  # type: ignore[operator]

    def compute(self, seq: Seq, first: int) -> None:
        """The K/V of positions ``first`` on are written (a prefill, a decode step, drafts)."""
        for pos in range(first, len(seq.tokens)):
            self.kv[self.slot(seq.table, pos)] = (hashable(seq.salt), seq.tokens[pos])

    def pick(self, data: st.DataObject) -> Seq:
        return self.seqs[data.draw(st.integers(0, len(self.seqs) - 1), label="sequence")]

    def cache(self, seq: Seq, num_tokens: int | None = None) -> None:
        """Cache the blocks written; then claims of other content for a cached one are refused."""
        tokens = seq.tokens[:num_tokens]
        self.both("cache_blocks", seq.table, tokens, seq.salt)
        full = seq.table[: len(tokens) // self.size]
        cached = [i for i, b in enumerate(full) if b in self.rules.content_of]
        if cached:
            wrong = list(tokens)
            wrong[cached[-1] * self.size] = WRONG_TOKEN
            for claim in ((seq.table, wrong, seq.salt), (seq.table, tokens, OTHER_SALT)):
                assert self.both("cache_blocks", *claim) == ("raised", BlockTableError)

    def queries(self, tokens: list[int], salt: object) -> None:
        self.both("lookup", tokens, salt)
        self.both("blocks_to_allocate", tokens, salt)
        self.both("max_hit_blocks", len(tokens))
        kind, spec_keys = self.both("block_keys", tokens, salt)
        if kind == "ok":  # each side looks its own keys up
            impl_keys = self.impl.block_keys(tokens, salt)
            for spec_key, impl_key in zip(spec_keys, impl_keys, strict=True):
                assert self.model.cached_block(spec_key) == self.impl.cached_block(impl_key)

    def admitted(self, result: tuple[list[int], int], tokens: Any, salt: object) -> Seq:
        """A prompt's sequence: the rest of the prompt computed; untrusted if it hit forgery."""
        table, cached = result
        hits = {(b, self.rules.content_of.get(b)) for b in table[: cached // self.size]}
        seq = Seq(table, list(tokens), salt, trusted=not hits & self.forged)
        self.seqs.append(seq)
        self.compute(seq, cached)
        return seq

    @rule(tokens=prompts(), salt=SALT_DRAWS, data=st.data(), as_tuple=st.booleans())
    def prompt(self, tokens: list[int], salt: object, data: st.DataObject, as_tuple: bool) -> None:
        self.submit(tokens, salt, data, as_tuple)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), message=st.lists(ALPHABET, max_size=4))
    def next_turn(self, data: st.DataObject, message: list[int]) -> None:
        """A conversation's next turn: the sequence ends, its tokens plus a message return."""
        seq = self.pick(data)
        self.free(data, seq)
        self.submit(seq.tokens + message, seq.salt, data, as_tuple=False)

    def submit(self, tokens: list[int], salt: object, data: st.DataObject, as_tuple: bool) -> None:
        """Query, allocate, then cache what was computed: all of it, a prefix, or nothing."""
        self.queries(tokens, salt)
        hits = self.rules.lookup(tokens, salt)
        revivable = any(self.rules.refs[b] == 0 for b in hits)
        kind, result = self.both("allocate_prompt", tuple(tokens) if as_tuple else tokens, salt)
        event(f"prompt: {'out of blocks' if kind == 'raised' else 'ok'}")
        if kind == "ok":
            if result[1]:
                event("prompt: hit" + (" with revival" if revivable else ""))
            seq = self.admitted(result, tokens, salt)
            computed = data.draw(st.sampled_from([len(tokens), len(tokens), 0, None]))
            if computed is None:  # a chunked prefill: only a prefix so far
                computed = data.draw(st.integers(result[1], len(tokens)), label="chunk")
            self.cache(seq, computed)

    @rule(num_blocks=st.integers(0, 4), cache=st.booleans())
    def allocate(self, num_blocks: int, cache: bool) -> None:
        """A plain allocation: evicts from the head, maybe caches filler content."""
        kind, table = self.both("allocate", num_blocks)
        if kind == "ok":
            self.admitted((table, 0), [FILLER] * (num_blocks * self.size), None)
            if cache:
                self.cache(self.seqs[-1])

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(ALPHABET, min_size=0, max_size=5))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        """Write ``len(new)`` tokens (a decode step, a chunk, or a lookahead), then cache."""
        seq = self.pick(data)
        if self.write(seq, new):
            self.cache(seq)

    def write(self, seq: Seq, new: list[int], default: bool = False) -> bool:
        """``append_slot`` of ``new`` (one token: ``new_tokens`` left at its default), the copies
        of its new pairs, then the writes; whether it did. The pairs stay pending (their sources
        waiting when freed) until they are taken."""
        pending = len(self.rules.copy_pairs)
        count = [len(new)] if len(new) != 1 or not default else []
        kind, table = self.both("append_slot", seq.table, len(seq.tokens) + len(new), *count)
        for src, dst in self.rules.copy_pairs[pending:]:
            for offset in range(self.size):
                if src * self.size + offset in self.kv:
                    self.kv[dst * self.size + offset] = self.kv[src * self.size + offset]
        if kind == "ok":
            seq.table, seq.tokens = table, seq.tokens + new
            self.compute(seq, len(seq.tokens) - len(new))
        return kind == "ok"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), window=st.integers(1, 6), new=st.lists(ALPHABET, min_size=0, max_size=8))
    def decode_with_window(self, data: st.DataObject, window: int, new: list[int]) -> None:
        """Mistral's decode loop: write and cache each token, release what left the window (no
        token: a window slid alone)."""
        seq = self.pick(data)
        for token in new or [None]:
            if token is not None and not self.write(seq, [token], default=True):
                return
            self.cache(seq)
            kind, table = self.both("release_outside_window", seq.table, len(seq.tokens), window)
            assert kind == "ok", table
            if table != seq.table:
                event("window: released blocks")
            seq.table = table

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        kind, table = self.both("fork", seq.table)
        if kind == "ok":
            self.seqs.append(Seq(table, list(seq.tokens), seq.salt, seq.trusted))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(ALPHABET, min_size=1, max_size=5))
    def speculate(self, data: st.DataObject, new: list[int]) -> None:
        """Write the next token and drafts, keep ``1 + j`` of them (a rollback), then cache."""
        seq = self.pick(data)
        before = len(seq.tokens)
        if self.write(seq, new):
            kept = before + 1 + data.draw(st.integers(0, len(new) - 1), label="j")
            self.truncate(seq, kept)
            self.cache(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def roll_back(self, data: st.DataObject) -> None:
        """Truncate to any count: into the last blocks, anywhere, past capacity, or not an int."""
        seq = self.pick(data)
        length, capacity = len(seq.tokens), len(seq.table) * self.size
        count = data.draw(
            st.integers(max(0, length - self.size - 1), length)
            | st.integers(-1, capacity + 2)
            | st.sampled_from([True, 1.0, None, IntSubclass(1)]),
            label="count",
        )
        self.truncate(seq, count)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), cut=st.integers(1, 3), token=ALPHABET)
    def write_where_a_fork_was(self, data: st.DataObject, cut: int, token: int) -> None:
        """Fork, cut into a shared block, free the fork, write there: the block loses its key."""
        seq = self.pick(data)
        _, fork = self.both("fork", seq.table)
        self.truncate(seq, max(0, len(seq.tokens) - cut))
        self.both("free", fork)
        if self.write(seq, [token], default=True):
            self.cache(seq)

    def truncate(self, seq: Seq, count: object) -> None:
        cached = [b for b in seq.table if b in self.rules.content_of]
        kind, table = self.both("truncate", seq.table, count)
        if kind == "ok":
            if any(b not in self.rules.content_of for b in cached):
                event("truncate: a cut block lost its key")
            seq.table = table
            del seq.tokens[count:]  # type: ignore[misc]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject, seq: Seq | None = None) -> None:
        """The sequence ends: its blocks join the queue's tail (last block first), keys kept."""
        seq = seq or self.pick(data)
        self.seqs.remove(seq)
        self.both("free", seq.table)
        self.dead.append(seq.table)

    @rule()
    def pop_copy_pairs(self) -> None:
        self.both("pop_copy_pairs")

    @rule()
    def reset_prefix_cache(self) -> None:
        """Every key is forgotten, but only while no block is held."""
        _, done = self.both("reset_prefix_cache")
        event(f"reset: {'done' if done else 'refused'}")

    @rule()
    def take_stats(self) -> None:
        """The counters so far; reading them starts them again at zero."""
        self.both("take_stats")

    @rule(
        tokens=prompts(),
        salt=SALT_DRAWS,
        block_id=st.one_of(st.integers(-2, 26), st.sampled_from([True, 1.0, None, 2**70])),
    )
    def query(self, tokens: list[int], salt: object, block_id: object) -> None:
        self.queries(tokens, salt)
        self.both("key_of", block_id)
        self.both("ref_count", block_id)
        self.both("can_allocate", block_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), pos=st.integers(-1, 40))
    def translate(self, data: st.DataObject, pos: int) -> None:
        """A slot of a live table, or the error for a position past it or released."""
        self.both("translate_slot", self.pick(data).table, pos)

    @rule(
        tokens=BAD_TOKEN_LISTS,
        salt=st.one_of(st.sampled_from(SALTS), ODD_SALTS),
        call=st.sampled_from(["allocate_prompt", "lookup", "blocks_to_allocate", "block_keys"]),
    )
    def odd_prompt(self, tokens: Any, salt: object, call: str) -> None:
        """Wrong types, negative or huge tokens, int subclasses, unhashable salts."""
        kind, result = self.odd(call, tokens, salt)
        if kind == "ok" and call == "allocate_prompt":
            self.admitted(result, tokens, salt)

    @precondition(lambda self: self.seqs)
    @rule(
        data=st.data(),
        case=st.sampled_from(["wrong token", "too long", "bad tokens", "odd salt", "other salt"]),
    )
    def odd_cache(self, data: st.DataObject, case: str) -> None:
        """``cache_blocks`` with other tokens or salt, too many tokens, or bad input."""
        seq = self.pick(data)
        tokens, salt = list(seq.tokens), seq.salt
        if case == "wrong token" and tokens:
            position = data.draw(st.integers(0, len(tokens) - 1))
            tokens[position] = data.draw(st.sampled_from([0, 1, 2, FILLER]))
        elif case == "too long":
            tokens += [0] * data.draw(st.integers(1, self.size + 1))
        elif case == "bad tokens":
            tokens = data.draw(BAD_TOKEN_LISTS)
        elif case == "odd salt":
            salt = data.draw(ODD_SALTS)
        elif case == "other salt":
            salt = data.draw(st.sampled_from([s for s in SALTS if s != salt]))
        self.odd("cache_blocks", seq.table, tokens, salt, typed=case not in ODD_TYPES)

    @rule(data=st.data(), tokens=prompts())
    def odd_table(self, data: st.DataObject, tokens: list[int]) -> None:
        """``cache_blocks`` on a stale, repeated, forged or non-list table."""
        tables: list[Any] = [*self.dead, [s.table[0] for s in self.seqs if s.table]]
        tables += [[0, 0], [-1], [self.total_blocks], None, "ab", [True]]
        self.odd("cache_blocks", data.draw(st.sampled_from(tables)), tokens, typed=True)

    @rule(
        total_blocks=st.one_of(st.integers(-1, 3), st.sampled_from([1.0, None, True])),
        block_size=st.one_of(st.integers(-1, 3), st.sampled_from([2.0, None, False])),
    )
    def construct(self, total_blocks: object, block_size: object) -> None:
        assert_same_construction(self.SPEC, self.IMPL, total_blocks, block_size)

    @invariant()
    def same_state(self) -> None:
        """Queue, reference counts, keys (content and hashes), counters and pending copy pairs:
        spec and impl agree, and with the model; the key map is a bijection over cached blocks;
        each reference count is the live tables' holds; the events rebuilt the key map."""
        spec, impl, rules, total = self.model, self.impl, self.rules, self.total_blocks
        if spec.stats.evictions:
            event("evicted")
        assert self.state(spec) == self.state(impl) == (
            rules.queue, rules.refs, [rules.content_of.get(b) for b in range(total)],
            len(rules.content_of), (rules.queried_blocks, rules.hit_blocks, rules.evictions,
            rules.resets), rules.copy_pairs, rules.parked, (total - len(rules.queue)) / total,
            len(rules.queue),
        )  # fmt: skip
        assert len(set(rules.queue)) == len(rules.queue), "a free block is queued twice"
        assert impl.ref_counts().tolist() == [block.ref_count for block in spec.blocks]
        held = [b for seq in self.seqs for b in seq.table if b is not None]
        assert rules.refs == [held.count(b) for b in range(total)]
        for manager in (spec, impl):  # the key map is a bijection over cached blocks
            keys = filter(None, map(manager.key_of, range(total)))
            assert [manager.cached_block(key) for key in keys] == sorted(rules.content_of)
        assert [describe(impl.key_of(b)) for b in range(total)] == [
            describe(spec.key_of(b)) for b in range(total)
        ]
        assert not self.events_on or self.mirror == rules.block_of

    @invariant()
    def requests_read_their_own_tokens(self) -> None:
        """Each cached block holds the tokens its key names (unless forged), and each trusted
        sequence reads back its own tokens where it holds blocks."""
        self.forged &= set(self.rules.content_of.items())
        for block_id, (salt, prefix) in self.rules.content_of.items():
            if (block_id, (salt, prefix)) not in self.forged:
                held = [self.kv.get(block_id * self.size + i) for i in range(self.size)]
                assert held == [(salt, token) for token in prefix[-self.size :]], block_id
        for seq in filter(lambda seq: seq.trusted, self.seqs):
            salt = hashable(seq.salt)
            for pos, token in enumerate(seq.tokens):
                if seq.table[pos // self.size] is not None:  # not released
                    assert self.kv.get(self.slot(seq.table, pos)) == (salt, token), pos
