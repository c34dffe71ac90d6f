"""Prefix-caching machines: spec and impl managers in lockstep (results, errors, KV events, the
whole state), and the store machine's prefix API against the spec, on shared prompts (frequent
hits, revivals, evictions); keys compare by content (:func:`describe`); ``IMPL``/``STORE`` swap."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks import CapacityError
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.spec import OutOfBlocksError, blocks_needed
from properties.machines.block_manager import IntSubclass, assert_same_construction
from properties.machines.lockstep import Lockstep
from properties.machines.prefix_cache import ALPHABET, SALTS, SYSTEM_PROMPTS, colliding_hash
from properties.machines.store import StoreMachine, WindowStoreMachine
from properties.outcomes import outcome

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


def describe(key: Any) -> Any:
    """A key's content, root first: ``(tokens, extra, hash)`` per level; works across classes."""
    levels = []
    while key is not None:
        levels.append((key.tokens, key.extra, key.hash_value))
        key = key.parent
    return tuple(reversed(levels))


def describe_event(item: Any) -> tuple[str, Any, Any]:
    return (
        type(item).__name__,
        getattr(item, "block_id", None),
        describe(getattr(item, "key", None)),
    )


def prompts() -> st.SearchStrategy[list[int]]:
    return st.builds(
        lambda system, suffix: system + suffix,
        st.sampled_from(SYSTEM_PROMPTS),
        st.lists(ALPHABET, max_size=6),
    )


@dataclasses.dataclass(eq=False)
class Seq:
    table: list[int | None]  # None: released by a sliding window
    tokens: list[int]  # computed or not
    salt: object


class PrefixDifferentialMachine(Lockstep, RuleBasedStateMachine):
    IMPL: ClassVar[type] = PrefixCachingBlockManager

    def __init__(self) -> None:
        super().__init__()
        self.seqs: list[Seq] = []
        self.dead: list[list[int]] = []  # freed tables

    @initialize(
        total_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 3, 4]),
        collide=st.booleans(),
        events_on=st.booleans(),
    )
    def start(self, total_blocks: int, block_size: int, collide: bool, events_on: bool) -> None:
        kwargs: dict[str, Any] = {"hash_fn": colliding_hash} if collide else {}
        kwargs["enable_kv_events"] = events_on
        self.model = spec_pc.PrefixCachingBlockManager(total_blocks, block_size, **kwargs)
        self.impl = self.IMPL(total_blocks, block_size, **kwargs)
        self.total_blocks, self.block_size = total_blocks, block_size

    def view(self, value: Any) -> Any:
        return ("key", describe(value)) if hasattr(value, "hash_value") else value

    def after(self, name: str, args: tuple[Any, ...], expected: tuple[str, Any]) -> None:
        spec_events = list(map(describe_event, self.model.take_events()))
        impl_events = list(map(describe_event, self.impl.take_events()))
        assert impl_events == spec_events, f"{name}{args}: events {impl_events} != {spec_events}"
        if spec_events:
            event("kv events")

    def cache(self, seq: Seq, num_tokens: int | None = None) -> None:
        self.both("cache_blocks", seq.table, seq.tokens[:num_tokens], seq.salt)

    def pick(self, data: st.DataObject) -> Seq:
        return self.seqs[data.draw(st.integers(0, len(self.seqs) - 1), label="sequence")]

    def queries(self, tokens: list[int], salt: object) -> None:
        self.both("lookup", tokens, salt)
        self.both("blocks_to_allocate", tokens, salt)
        self.both("max_hit_blocks", len(tokens))
        kind, spec_keys = self.both("block_keys", tokens, salt)
        if kind == "ok":  # each side looks its own keys up
            impl_keys = self.impl.block_keys(tokens, salt)
            for spec_key, impl_key in zip(spec_keys, impl_keys, strict=True):
                assert self.model.cached_block(spec_key) == self.impl.cached_block(impl_key)

    @rule(tokens=prompts(), salt=st.sampled_from(SALTS), data=st.data(), as_tuple=st.booleans())
    def prompt(self, tokens: list[int], salt: object, data: st.DataObject, as_tuple: bool) -> None:
        self.submit(tokens, salt, data, as_tuple)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), message=st.lists(ALPHABET, max_size=4))
    def next_turn(self, data: st.DataObject, message: list[int]) -> None:
        """A conversation's next turn: the sequence ends, its tokens plus a message return."""
        seq = self.pick(data)
        self.seqs.remove(seq)
        self.both("free", seq.table)
        self.dead.append(seq.table)
        self.submit(seq.tokens + message, seq.salt, data, as_tuple=False)

    def submit(self, tokens: list[int], salt: object, data: st.DataObject, as_tuple: bool) -> None:
        """Query, allocate, then cache what was computed: all of it, a prefix, or nothing."""
        self.queries(tokens, salt)
        kind, hits = outcome(self.model.lookup, tokens, salt)
        revivable = kind == "ok" and any(self.model.ref_count(b) == 0 for b in hits)
        kind, result = self.both("allocate_prompt", tuple(tokens) if as_tuple else tokens, salt)
        event(f"prompt: {'out of blocks' if kind == 'raised' else 'ok'}")
        if kind == "ok":
            if result[1]:
                event("prompt: hit" + (" with revival" if revivable else ""))
            seq = Seq(result[0], tokens, salt)
            self.seqs.append(seq)
            computed = data.draw(st.sampled_from([len(tokens), len(tokens), 0, None]))
            if computed is None:  # a chunked prefill: only a prefix so far
                computed = data.draw(st.integers(result[1], len(tokens)), label="chunk")
            self.cache(seq, computed)

    @rule(num_blocks=st.integers(0, 4), cache=st.booleans())
    def allocate(self, num_blocks: int, cache: bool) -> None:
        """A plain allocation: evicts from the head, maybe caches filler content."""
        kind, table = self.both("allocate", num_blocks)
        if kind == "ok":
            seq = Seq(table, [FILLER] * (num_blocks * self.block_size), None)
            self.seqs.append(seq)
            if cache:
                self.cache(seq)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), new=st.lists(ALPHABET, min_size=0, max_size=5))
    def decode(self, data: st.DataObject, new: list[int]) -> None:
        """Write ``len(new)`` tokens (a decode step, a chunk, or a lookahead), then cache."""
        seq = self.pick(data)
        if self.write(seq, new):
            self.cache(seq)

    def write(self, seq: Seq, new: list[int]) -> bool:
        """``append_slot`` of ``new`` on both, then their copy pairs; whether it succeeded."""
        kind, table = self.both("append_slot", seq.table, len(seq.tokens) + len(new), len(new))
        self.both("pop_copy_pairs")
        if kind == "ok":
            seq.table, seq.tokens = table, seq.tokens + new
        return kind == "ok"

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), window=st.integers(1, 6), new=st.lists(ALPHABET, min_size=1, max_size=8))
    def decode_with_window(self, data: st.DataObject, window: int, new: list[int]) -> None:
        """Mistral's decode loop: write and cache each token, release what left the window."""
        seq = self.pick(data)
        for token in new:
            if not self.write(seq, [token]):
                return
            self.cache(seq)
            kind, table = self.both("release_outside_window", seq.table, len(seq.tokens), window)
            assert kind == "ok", table
            seq.table = table

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        kind, table = self.both("fork", seq.table)
        if kind == "ok":
            self.seqs.append(Seq(table, list(seq.tokens), seq.salt))

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
        length, capacity = len(seq.tokens), len(seq.table) * self.block_size
        count = data.draw(
            st.integers(max(0, length - self.block_size - 1), length)
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
        kind, table = self.both("append_slot", seq.table, len(seq.tokens) + 1)
        self.both("pop_copy_pairs")
        if kind == "ok":
            seq.table, seq.tokens = table, [*seq.tokens, token]
            self.cache(seq)

    def truncate(self, seq: Seq, count: object) -> None:
        kind, table = self.both("truncate", seq.table, count)
        if kind == "ok":
            seq.table = table
            del seq.tokens[count:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq = self.pick(data)
        self.seqs.remove(seq)
        self.both("free", seq.table)
        self.dead.append(seq.table)

    @rule()
    def reset_prefix_cache(self) -> None:
        _, done = self.both("reset_prefix_cache")
        event(f"reset: {'done' if done else 'refused'}")

    @rule()
    def take_stats(self) -> None:
        self.both("take_stats")

    @rule(
        tokens=prompts(),
        salt=st.sampled_from(SALTS),
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
        kind, result = self.both(call, tokens, salt)
        if kind == "ok" and call == "allocate_prompt":
            self.seqs.append(Seq(result[0], list(tokens), salt))

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
            tokens += [0] * data.draw(st.integers(1, self.block_size + 1))
        elif case == "bad tokens":
            tokens = data.draw(BAD_TOKEN_LISTS)
        elif case == "odd salt":
            salt = data.draw(ODD_SALTS)
        elif case == "other salt":
            salt = data.draw(st.sampled_from([s for s in SALTS if s != salt]))
        self.both("cache_blocks", seq.table, tokens, salt)

    @rule(data=st.data(), tokens=prompts())
    def odd_table(self, data: st.DataObject, tokens: list[int]) -> None:
        """``cache_blocks`` on a stale, repeated, forged or non-list table."""
        tables: list[Any] = [*self.dead, [s.table[0] for s in self.seqs if s.table]]
        tables += [[0, 0], [-1], [self.total_blocks], None, "ab", [True]]
        self.both("cache_blocks", data.draw(st.sampled_from(tables)), tokens)

    @rule(
        total_blocks=st.one_of(st.integers(-1, 3), st.sampled_from([1.0, None, True])),
        block_size=st.one_of(st.integers(-1, 3), st.sampled_from([2.0, None, False])),
    )
    def construct(self, total_blocks: object, block_size: object) -> None:
        assert_same_construction(
            spec_pc.PrefixCachingBlockManager, self.IMPL, total_blocks, block_size
        )

    @invariant()
    def same_state(self) -> None:
        """Queue, reference counts, keys, counters and (copies of) pending copy pairs agree."""
        spec, impl = self.model, self.impl
        if spec.stats.evictions:
            event("evicted")
        queue = impl.free_block_ids()
        assert queue == spec.free_block_ids()
        assert len(set(queue)) == len(queue), "a free block is queued twice"
        refs = impl.ref_counts().tolist()
        assert refs == [block.ref_count for block in spec.blocks]
        live = [b for seq in self.seqs for b in seq.table]
        assert refs == [live.count(b) for b in range(self.total_blocks)]
        keys = [impl.key_of(b) for b in range(self.total_blocks)]
        assert list(map(describe, keys)) == [describe(spec.key_of(b)) for b in range(len(keys))]
        assert impl.num_cached_blocks == spec.num_cached_blocks
        assert dataclasses.astuple(impl.stats) == dataclasses.astuple(spec.stats)
        assert impl.usage == spec.usage
        assert impl.num_free_blocks == spec.num_free_blocks
        assert impl.pending_copy_pairs() == spec.pending_copy_pairs()
        assert impl.waiting_for_copy == spec.waiting_for_copy
        for block_id, key in enumerate(keys):  # the key map is a bijection over cached blocks
            if key is not None:
                assert impl.cached_block(key) == block_id


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
