"""Any class with the spec's prefix API in lockstep with the independent ``PrefixCacheModel``: the
whole state, simulated KV data (each request reads its own tokens), KV events in order (a mirror
rebuilt from them is the key map); shared prompts and a colliding hash make hits frequent."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

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
)

from pagedkv.spec import BlockTableError
from pagedkv.spec.prefix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from properties.machines.lockstep import Lockstep
from properties.prefix_model import Content, Event, PrefixCacheModel

SYSTEM_PROMPTS = [[], [7, 7, 8, 9, 7, 8], [7, 7, 8, 9, 1, 2, 3, 4, 5], [5, 5, 5, 5, 5, 5, 5, 5]]
ALPHABET = st.integers(0, 2)
SALTS = [None, "tenant-b"]
SALT_DRAWS = st.sampled_from(SALTS) | st.builds(lambda: "".join(["tenant", "-b"]))
"""A salt of ``SALTS``, or an equal new string: equal salts share blocks whatever their identity."""
WRONG_TOKEN = 10  # a token no prompt holds
OTHER_SALT = "tenant-z"  # a salt no request uses


def colliding_hash(parent: object, tokens: tuple[int, ...], extra: object) -> int:
    """A deliberately terrible hash: most keys collide."""
    return len(tokens) % 2


def content_of(key: Any) -> Content | None:
    """What a key of any class names, as the model does: ``(extra, the whole token prefix)``."""
    if key is None:
        return None
    levels = []
    extra = key.extra
    while key is not None:
        levels.append(key.tokens)
        key = key.parent
    return extra, tuple(token for level in reversed(levels) for token in level)


def event_of(item: KVEvent) -> Event:
    if isinstance(item, BlockStored):
        return ("stored", item.block_id, content_of(item.key))
    if isinstance(item, BlockRemoved):
        return ("removed", item.block_id, content_of(item.key))
    assert isinstance(item, AllBlocksCleared), item
    return ("cleared", None, None)


@dataclass(eq=False)
class Request:
    table: list[int | None]  # None: released by a sliding window
    tokens: list[int]
    salt: Hashable


def prefix_cache_machine(manager_cls: type) -> type[RuleBasedStateMachine]:

    class PrefixCacheMachine(Lockstep, RuleBasedStateMachine):
        requests = Bundle("requests")

        def __init__(self) -> None:
            super().__init__()
            self.live: list[Request] = []
            # slot -> (salt, token): a block computed under one salt is never read under another
            self.kv: dict[int, tuple[Hashable, int]] = {}

        @initialize(
            total_blocks=st.integers(1, 24),
            block_size=st.sampled_from([1, 2, 4]),
            collide=st.booleans(),
            events_on=st.booleans(),
        )
        def make_manager(
            self, total_blocks: int, block_size: int, collide: bool, events_on: bool
        ) -> None:
            kwargs: dict[str, Any] = {"hash_fn": colliding_hash} if collide else {}
            self.impl = manager_cls(total_blocks, block_size, enable_kv_events=events_on, **kwargs)
            self.model = PrefixCacheModel(total_blocks, block_size)
            self.size = block_size
            self.events_on = events_on
            self.mirror: dict[Content, int] = {}  # the key map, rebuilt from events alone

        def slot(self, table: list[int], pos: int) -> int:
            return table[pos // self.size] * self.size + pos % self.size

        def snapshot(self) -> tuple[object, ...]:
            manager = self.impl
            blocks = range(self.model.total_blocks)
            stats = manager.stats
            return (
                manager.free_block_ids(), [manager.ref_count(b) for b in blocks],
                [content_of(manager.key_of(b)) for b in blocks], manager.num_cached_blocks,
                (stats.queried_blocks, stats.hit_blocks, stats.evictions, stats.resets),
                manager.pending_copy_pairs(), list(manager.waiting_for_copy),
                manager.usage,
            )  # fmt: skip

        def expected_snapshot(self) -> tuple[object, ...]:
            model = self.model
            return (
                model.queue, model.refs,
                [model.content_of.get(b) for b in range(model.total_blocks)], len(model.content_of),
                (model.queried_blocks, model.hit_blocks, model.evictions, model.resets),
                model.copy_pairs, model.parked,
                (model.total_blocks - len(model.queue)) / model.total_blocks,
            )  # fmt: skip

        def expect(self, name: str, *args: object) -> tuple[str, object]:
            if name == "append_slot" and len(args) == 2:
                args = (*args, 1)  # impl's default new_tokens
            expected = getattr(self.model, "reset" if name == "reset_prefix_cache" else name)(*args)
            if name in ("lookup", "blocks_to_allocate"):  # the model's answer itself
                return "ok", expected
            return ("raised", expected.error) if expected.error else ("ok", expected.value)

        def after(self, name: str, args: tuple, expected: tuple[str, object]) -> None:
            """Take the call's KV events, compare them with the model's, replay them."""
            taken = [event_of(item) for item in self.impl.take_events()]
            expected = self.model.events if self.events_on else []
            assert taken == expected, f"{name}: events {taken}, the rules say {expected}"
            self.model.events = []
            for kind, block_id, content in taken:
                if kind == "stored":
                    self.mirror[content] = block_id
                elif kind == "removed":
                    assert self.mirror.pop(content) == block_id, f"{name}: removed unknown key"
                else:
                    self.mirror.clear()

        def view(self, value: Any) -> Any:
            if hasattr(value, "queried_blocks"):
                return value.queried_blocks, value.hit_blocks, value.evictions, value.resets
            return value

        def register(self, request: Request) -> None:
            """Cache the blocks just written; then claims of other content are refused."""
            self.both("cache_blocks", request.table, request.tokens, request.salt)
            cached = [i for i, b in enumerate(request.table) if b in self.model.content_of]
            if cached:
                wrong = list(request.tokens)
                wrong[cached[-1] * self.size] = WRONG_TOKEN
                for claim in (
                    (request.table, wrong, request.salt),
                    (request.table, request.tokens, OTHER_SALT),
                ):
                    assert self.both("cache_blocks", *claim) == ("raised", BlockTableError)

        @rule(
            target=requests,
            system=st.sampled_from(SYSTEM_PROMPTS),
            suffix=st.lists(ALPHABET, max_size=6),
            salt=SALT_DRAWS,
        )
        def new_request(self, system: list[int], suffix: list[int], salt: Hashable) -> object:
            """Look up, allocate, compute the rest of the prompt, register its full blocks."""
            tokens = system + suffix
            _, hits = self.both("lookup", tokens, salt)
            self.both("blocks_to_allocate", tokens, salt)
            revived = [b for b in hits if self.model.refs[b] == 0]
            kind, result = self.both("allocate_prompt", tokens, salt)
            if kind == "raised":
                event("prefix: out of blocks")
                return multiple()
            table, cached_tokens = result
            if cached_tokens:
                event("prefix: hit" + (" with revival" if revived else ""))
            for pos in range(cached_tokens, len(tokens)):  # compute the rest of the prompt
                self.kv[self.slot(table, pos)] = (salt, tokens[pos])
            request = Request(table, tokens, salt)
            self.live.append(request)
            self.register(request)
            return request

        @rule(request=requests, token=ALPHABET)
        def decode(self, request: Request, token: int) -> None:
            """One token: the table grows or copies on write, the caller copies, then caches."""
            tokens = [*request.tokens, token]
            kind, table = self.both("append_slot", request.table, len(tokens))
            if kind == "raised":
                event("decode: out of blocks")
                return
            self.take_pairs()
            self.kv[self.slot(table, len(tokens) - 1)] = (request.salt, token)
            request.table, request.tokens = table, tokens
            self.register(request)

        @rule(request=requests, data=st.data())
        def roll_back(self, request: Request, data: st.DataObject) -> None:
            """Truncate to fewer tokens (or past the table's capacity: refused)."""
            capacity, length = len(request.table) * self.size, len(request.tokens)
            near_end = st.integers(max(0, length - self.size - 1), length)
            count = data.draw(near_end | st.integers(0, length) | st.just(capacity + 1))
            self.truncate(request, count)

        @rule(request=requests, cut=st.integers(1, 3), token=ALPHABET)
        def write_where_a_fork_was(self, request: Request, cut: int, token: int) -> None:
            """Fork, cut into a shared block, free the fork, write there: it loses its key first."""
            self.both("fork", request.table)
            fork = list(request.table)
            self.truncate(request, max(0, len(request.tokens) - cut))
            self.both("free", fork)
            self.decode(request, token)

        @rule(request=requests, guesses=st.lists(ALPHABET, min_size=1, max_size=6), data=st.data())
        def speculate(self, request: Request, guesses: list[int], data: st.DataObject) -> None:
            """Write the next token and drafts in one step, keep ``1 + j`` of them, register."""
            count = len(request.tokens) + len(guesses)
            kind, table = self.both("append_slot", request.table, count, len(guesses))
            if kind == "raised":
                return
            self.take_pairs()
            for pos, token in enumerate(guesses, start=len(request.tokens)):
                self.kv[self.slot(table, pos)] = (request.salt, token)
            request.table = table
            kept = 1 + data.draw(st.integers(0, len(guesses) - 1), label="j")
            request.tokens = request.tokens + guesses
            self.truncate(request, len(request.tokens) - len(guesses) + kept)
            self.register(request)

        def truncate(self, request: Request, count: int) -> None:
            cached = [b for b in request.table if b in self.model.content_of]
            kind, table = self.both("truncate", request.table, count)
            if kind == "ok":
                if [b for b in cached if b not in self.model.content_of]:
                    event("truncate: a cut block lost its key")
                request.table = table
                del request.tokens[count:]

        def take_pairs(self) -> None:
            """The caller takes the copy-on-write pairs and copies the simulated K/V."""
            pairs = list(self.model.copy_pairs)
            self.both("pop_copy_pairs")
            for src, dst in pairs:
                for offset in range(self.size):
                    if src * self.size + offset in self.kv:
                        self.kv[dst * self.size + offset] = self.kv[src * self.size + offset]

        @rule(
            request=requests,
            window=st.integers(1, 6),
            tokens=st.lists(ALPHABET, min_size=1, max_size=8),
        )
        def decode_with_window(self, request: Request, window: int, tokens: list[int]) -> None:
            """Mistral's decode loop: write and cache each token, release what left the window."""
            for token in tokens:
                self.decode(request, token)
                self.slide(request, window)

        @rule(request=requests, window=st.integers(1, 6))
        def slide(self, request: Request, window: int) -> None:
            """Blocks no later query reads are released like a freed table's; cached ones stay."""
            _, table = self.both(
                "release_outside_window", request.table, len(request.tokens), window
            )
            if table != request.table:
                event("window: released blocks")
            request.table = table

        @rule(target=requests, parent=requests)
        def fork(self, parent: Request) -> Request:
            """A parallel sample shares every block of its parent."""
            self.both("fork", parent.table)
            child = Request(list(parent.table), list(parent.tokens), parent.salt)
            self.live.append(child)
            return child

        @rule(request=consumes(requests))
        def free(self, request: Request) -> None:
            """The request ends: its blocks join the queue's tail (last block first), keys kept."""
            self.both("free", request.table)
            self.live.remove(request)

        @rule()
        def reset_prefix_cache(self) -> None:
            """Every key is forgotten, but only while no block is held."""
            _, done = self.both("reset_prefix_cache")
            event(f"reset: {'done' if done else 'refused'}")

        @rule()
        def read_stats(self) -> None:
            """The counters so far; reading them starts them again at zero."""
            self.both("take_stats")

        @invariant()
        def events_rebuild_the_key_map(self) -> None:
            """A mirror fed only the KV events knows every cached key and its block."""
            if self.events_on:
                assert self.mirror == self.model.block_of

        @invariant()
        def state_follows_the_model(self) -> None:
            """Queue order, reference counts, keys, counters and pending pairs are the model's."""
            assert self.snapshot() == self.expected_snapshot()

        @invariant()
        def key_map_is_a_bijection_over_cached_blocks(self) -> None:
            for block_id in self.model.content_of:
                key = self.impl.key_of(block_id)
                assert self.impl.cached_block(key) == block_id

        @invariant()
        def ref_counts_equal_live_references(self) -> None:
            held = [b for request in self.live for b in request.table if b is not None]
            assert self.model.refs == [held.count(b) for b in range(self.model.total_blocks)]

        @invariant()
        def cached_blocks_hold_the_tokens_they_name(self) -> None:
            for block_id, (salt, prefix) in self.model.content_of.items():
                held = [self.kv.get(block_id * self.size + i) for i in range(self.size)]
                assert held == [(salt, token) for token in prefix[-self.size :]], block_id

        @invariant()
        def every_request_reads_its_own_tokens(self) -> None:
            for request in self.live:
                for pos, token in enumerate(request.tokens):
                    if request.table[pos // self.size] is not None:  # not released
                        assert self.kv.get(self.slot(request.table, pos)) == (request.salt, token)

    return PrefixCacheMachine
