"""A bounded exhaustive check (``python -m properties.exhaustive`` prints each pool's states):
breadth first from the empty pool, every sequence of operations up to a depth on spec, impl and
the independent model in lockstep. Results or exception classes agree; after each operation the
observable state agrees, reference counts are the live tables' holds and every position
translates alike. States are deduplicated by what they observably are (counters left out)."""

from __future__ import annotations

import copy
import itertools
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pagedkv.impl.blocks.manager as impl_manager
import pagedkv.impl.blocks.prefix_cache as impl_prefix
import pagedkv.spec.block_manager as spec_manager
import pagedkv.spec.prefix_cache as spec_prefix
from pagedkv.spec import BlockTableError
from properties.block_model import BlockModel, Outcome, observe
from properties.machines.prefix_cache import colliding_hash, content_of
from properties.prefix_model import PrefixCacheModel

Operation = tuple[Any, ...]
"""An operation's name and arguments, as printed in a counterexample."""


@dataclass
class Live:
    """A table the driver holds: its blocks, the tokens written, its salt."""

    table: list[int]
    tokens: list[int]
    salt: Hashable = None


@dataclass
class World:
    """The three systems and the driver's live tables, between two operations."""

    spec: Any
    impl: Any
    model: Any
    live: list[Live] = field(default_factory=list)
    freed: list[int] | None = None  # the table freed last, for a double free


def frozen(value: object) -> Hashable:
    """``value`` with every list turned into a tuple, so that it can be a set member."""
    if isinstance(value, (list, tuple)):
        return tuple(frozen(item) for item in value)
    return value  # type: ignore[return-value]


class Mismatch(AssertionError):
    """The systems disagreed; the message holds the operations that lead there."""


class System:
    """A pool under check: how to build it, its observables; a subclass's ``operations(world)``
    (all that can follow) and ``apply(world, operation)`` (on all three, asserting agreement)."""

    spec_cls: type
    impl_cls: type
    model_cls: type
    manager_kwargs: ClassVar[dict[str, Any]] = {}  # the spec's and impl's, not the model's

    def __init__(self, total_blocks: int, block_size: int) -> None:
        self.total_blocks, self.block_size = total_blocks, block_size

    def initial(self) -> World:
        args, kwargs = (self.total_blocks, self.block_size), self.manager_kwargs
        return World(
            self.spec_cls(*args, **kwargs), self.impl_cls(*args, **kwargs), self.model_cls(*args)
        )

    def observe(self, manager: Any) -> tuple[object, ...]:
        """Queue, reference counts, pending copy pairs and the sources waiting for them."""
        refs = [manager.ref_count(b) for b in range(self.total_blocks)]
        pairs = manager.pending_copy_pairs()
        return manager.free_block_ids(), refs, pairs, list(manager.waiting_for_copy)

    def model_view(self, model: Any) -> tuple[object, ...]:
        return model.queue, model.refs, model.copy_pairs, model.parked

    def check(self, world: World) -> Hashable:
        """The state's checks; returns its key (the observables and the live tables)."""
        seen = self.observe(world.spec)
        assert seen == self.observe(world.impl) == self.model_view(world.model), seen
        held = [b for live in world.live for b in live.table]
        assert world.model.refs == [held.count(b) for b in range(self.total_blocks)]
        for live in world.live:
            for pos in range(-1, len(live.table) * self.block_size + 1):
                self.same(world, "translate_slot", live.table, pos)
        tables = sorted(frozen((x.table, x.tokens, x.salt)) for x in world.live)
        return frozen((self.key_part(seen), tables, world.freed))

    def key_part(self, seen: tuple[object, ...]) -> tuple[object, ...]:
        return seen

    def same(self, world: World, name: str, *args: Any) -> Outcome:
        """``name(*args)`` on the three systems: one result, or one exception class."""
        outcomes = [observe(getattr(s, name), *args) for s in (world.spec, world.impl)]
        expected = getattr(world.model, name)(*args)
        outcomes.append(expected if isinstance(expected, Outcome) else Outcome(expected))
        spec = outcomes[0]
        for other in outcomes[1:]:
            assert (other.error, other.value) == (spec.error, spec.value), (name, args, outcomes)
        return spec

    def apply_shared(self, world: World, operation: Operation) -> bool:
        """Carry out a ``free``, ``fork`` or ``double free``; False for any other operation."""
        name, *args = operation
        if name == "free":
            live = world.live.pop(args[0])
            self.same(world, "free", live.table)
            world.freed = live.table
        elif name == "fork":
            parent = world.live[args[0]]
            table = self.same(world, "fork", parent.table).value
            world.live.append(Live(table, list(parent.tokens), parent.salt))
        elif name == "double free":  # refused, unless its blocks have owners again (then read)
            if self.same(world, "translate_slot", world.freed, 0).error is BlockTableError:
                self.same(world, "free", world.freed)
        else:
            return False
        return True


class BlockSystem(System):
    """The block manager: prompts of every length that fits and one past, decode steps,
    multi-block chunks, lookahead reservations, forks, frees, the copy pairs, a double free."""

    spec_cls = spec_manager.BlockManager
    impl_cls = impl_manager.BlockManager
    model_cls = BlockModel

    def operations(self, world: World) -> Iterator[Operation]:
        size, capacity = self.block_size, self.total_blocks * self.block_size
        for length in sorted({0, 1, size, size + 1, capacity, capacity + 1}):
            yield ("allocate", length)
        for index in range(len(world.live)):
            for kind in ("decode", "chunk", "reserve", "fork", "free"):
                yield (kind, index)
        yield ("pop_copy_pairs",)
        if world.freed is not None:
            yield ("double free",)

    def apply(self, world: World, operation: Operation) -> None:
        name, *args = operation
        if name == "allocate":
            length = args[0]
            blocks = -(-length // self.block_size)
            made = self.same(world, "allocate", blocks)
            if made.error is None:
                world.live.append(Live(made.value, [0] * length))
        elif name == "pop_copy_pairs":
            self.same(world, "pop_copy_pairs")
        elif not self.apply_shared(world, operation):
            live = world.live[args[0]]
            count = len(live.tokens)
            written = {"decode": 1, "chunk": self.block_size + 1, "reserve": 0}[name]
            target = count + max(written, 1)
            grown = self.same(world, "append_slot", live.table, target, written)
            if grown.error is None:
                live.table = grown.value
                live.tokens += [0] * written


class PrefixSystem(System):
    """Prefix caching over tokens ``{0, 1}`` under a colliding hash: every prompt up to
    ``block_size + 1`` tokens (two salted), prefilled and registered, decode steps of either
    token, forks and frees; every prompt's lookup and ``blocks_to_allocate`` in every state."""

    spec_cls = spec_prefix.PrefixCachingBlockManager
    impl_cls = impl_prefix.PrefixCachingBlockManager
    model_cls = PrefixCacheModel
    manager_kwargs: ClassVar[dict[str, Any]] = {"hash_fn": colliding_hash}

    def __init__(self, total_blocks: int, block_size: int) -> None:
        super().__init__(total_blocks, block_size)
        lengths = range(1, block_size + 2)
        self.prompts = [
            (list(tokens), None)
            for length in lengths
            for tokens in itertools.product((0, 1), repeat=length)
        ]
        self.prompts += [([0] * block_size + [1], "salt"), ([1] * (block_size + 1), "salt")]

    def observe(self, manager: Any) -> tuple[object, ...]:
        keys = tuple(content_of(manager.key_of(b)) for b in range(self.total_blocks))
        stats = manager.stats
        counters = (stats.queried_blocks, stats.hit_blocks, stats.evictions)
        return *super().observe(manager), keys, manager.num_cached_blocks, counters

    def model_view(self, model: Any) -> tuple[object, ...]:
        keys = tuple(model.content_of.get(b) for b in range(self.total_blocks))
        counters = (model.queried_blocks, model.hit_blocks, model.evictions)
        return *super().model_view(model), keys, len(model.content_of), counters

    def check(self, world: World) -> Hashable:
        key = super().check(world)
        for tokens, salt in self.prompts:
            self.same(world, "lookup", tokens, salt)
            self.same(world, "blocks_to_allocate", tokens, salt)
        return key

    def key_part(self, seen: tuple[object, ...]) -> tuple[object, ...]:
        """All observables but the counters, which only grow."""
        return seen[:-1]

    def operations(self, world: World) -> Iterator[Operation]:
        for number in range(len(self.prompts)):
            yield ("prompt", number)
        for index in range(len(world.live)):
            yield ("decode", index, 0)
            yield ("decode", index, 1)
            yield ("fork", index)
            yield ("free", index)
        if world.freed is not None:
            yield ("double free",)

    def apply(self, world: World, operation: Operation) -> None:
        name, *args = operation
        if name == "prompt":
            tokens, salt = self.prompts[args[0]]
            made = self.same(world, "allocate_prompt", tokens, salt)
            if made.error is None:
                live = Live(made.value[0], list(tokens), salt)
                world.live.append(live)
                self.same(world, "cache_blocks", live.table, live.tokens, salt)
        elif not self.apply_shared(world, operation):
            live = world.live[args[0]]
            grown = self.same(world, "append_slot", live.table, len(live.tokens) + 1, 1)
            self.same(world, "pop_copy_pairs")
            if grown.error is None:
                live.table, live.tokens = grown.value, [*live.tokens, args[1]]
                self.same(world, "cache_blocks", live.table, live.tokens, live.salt)


def explore(system: System, depth: int) -> int:
    """Check every state reachable in ``depth`` operations; the number of distinct states."""
    start = system.initial()
    seen = {system.check(start)}
    frontier: list[tuple[World, tuple[Operation, ...]]] = [(start, ())]
    for _ in range(depth):
        next_frontier = []
        for world, path in frontier:
            for operation in system.operations(world):
                successor = copy.deepcopy(world)
                try:
                    system.apply(successor, operation)
                    key = system.check(successor)
                except AssertionError as error:
                    steps = " -> ".join(map(repr, (*path, operation)))
                    raise Mismatch(f"{type(system).__name__} {steps}: {error}") from error
                if key not in seen:
                    seen.add(key)
                    next_frontier.append((successor, (*path, operation)))
        frontier = next_frontier
    return len(seen)


BLOCK_POOLS = [(total, size, 6 if total <= 2 else 5) for total in (1, 2, 3, 4) for size in (1, 2)]
"""``(total_blocks, block_size, depth)`` for the block manager: as deep as a minute allows."""

PREFIX_POOLS = [(1, 1, 5), (1, 2, 5), (2, 1, 5), (2, 2, 4), (3, 1, 4), (3, 2, 3), (4, 1, 3),
                (4, 2, 3)]  # fmt: skip
"""The same for prefix caching, whose states branch more (every prompt is an operation)."""


def main() -> int:
    """Run every pool; print the distinct states each visited."""
    for system_cls, pools in ((BlockSystem, BLOCK_POOLS), (PrefixSystem, PREFIX_POOLS)):
        for total, size, depth in pools:
            start = time.monotonic()
            states = explore(system_cls(total, size), depth)
            seconds = time.monotonic() - start
            print(
                f"{system_cls.__name__}: {total} blocks of {size}, depth {depth}: "
                f"{states} states ({seconds:.1f} s)",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
