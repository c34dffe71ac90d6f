"""Prefix caching: what sharing saves, and what lookup and revival cost, ``spec`` against ``impl``.

Sharing scenarios (block size 16) drive a manager's prefix-caching API the way an engine does:
``allocate_prompt``, ``cache_blocks`` after the prefill and whenever decode fills a block,
``append_slot`` per decoded token, ``fork``, ``free``. Each runs on ``spec`` and on ``impl``;
both must produce exactly the metrics the scenario's closed form predicts (asserted, and stored
in ``extra_info``):

* ``hit_ratio``: ``stats.hit_blocks / stats.queried_blocks``;
* ``prefill_tokens_skipped``: prompt tokens whose K/V was not computed (``allocate_prompt``'s
  cached tokens; for a fork, the whole shared prompt), and ``skip_ratio`` = that / prompt tokens;
* ``blocks_saved``: for concurrent requests (a shared system prompt, parallel samples), the
  physical blocks that sharing saves when all are live: the sum of table lengths minus the
  distinct blocks; for a conversation, whose turns run one at a time, the blocks a turn took
  over from earlier turns instead of filling new ones (its hits).

Groups (``benchmark.group``; ``extra_info["side"]`` is ``spec``, ``impl`` or ``impl-store``):

* ``share-system-k{k}``: ``k`` = 1, 2, 4, ..., 64 users, each the same 1000-token system prompt
  plus 50 tokens of their own, all live at once.
* ``share-turns-t{t}``: one conversation of ``t`` turns; turn ``i``'s prompt is turn ``i - 1``'s
  prompt + its 120-token answer + a 50-token message; each turn ends before the next starts.
* ``share-samples-{fork,cache}-n{n}``: ``n`` = 2..8 samples of one 1000-token prompt, each
  decoding 100 tokens of its own; the samples ``fork`` the first one's table, or (as engines
  without fork do) each is a new request that hits the cache.
* ``revive-2k-queue{Q}``: ``allocate_prompt`` of a 2048-token prompt whose 127 cached blocks are
  free at the tail of a ``Q``-block free queue: 127 revivals from deep in the queue. The spec's
  ``deque.remove`` is O(Q) per revival, impl's ``FreeBlockQueue.remove`` O(1). ``impl-store``
  is ``BlockTableStore.add_prompt``.
* ``lookup-2k``: ``lookup`` of that prompt while its blocks are held (no revival): the spec's
  fresh key chain compares O(n^2) levels for ``n`` blocks, impl's O(n).
* ``test_prefix_manager_memory``: a 1,000,000-block impl prefix manager with nothing cached
  stays within the plain manager's 16 MB; each cached block costs a few hundred bytes.

Under ``--benchmark-disable`` each case runs once and every assertion still runs.
``python bench/bench_prefix_cache.py`` runs the suites and prints the spec/impl ratios and the
sharing metrics.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import pytest
from bench_block_manager import MEMORY_LIMIT_BYTES, print_ratios, traced_bytes

import pagedkv.spec.prefix_cache as spec_pc
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.store import BlockTableStore

BLOCK_SIZE = 16
SYSTEM = [1000 + i for i in range(1000)]  # 62 full blocks and 8 tokens
MESSAGE_LEN, ANSWER_LEN, SAMPLE_LEN = 50, 120, 100
USERS = (1, 2, 4, 8, 16, 32, 64)
TURNS = (2, 4, 8, 16)
SAMPLES = tuple(range(2, 9))
LONG_PROMPT = [5000 + i for i in range(2048)]  # 128 blocks: 127 can hit
QUEUE_SIZES = (1024, 32768)
SHARE_ROUNDS, REVIVE_ROUNDS, LOOKUP_ROUNDS = 5, 20, 200
SIDES: dict[str, type] = {
    "spec": spec_pc.PrefixCachingBlockManager,
    "impl": PrefixCachingBlockManager,
}


def own_tokens(owner: int, count: int) -> list[int]:
    """``count`` tokens no other owner (message, answer or sample) has."""
    return [100_000 + owner * 1000 + i for i in range(count)]


# ----------------------------------------------------------------- sharing scenarios


@dataclass(frozen=True)
class Sharing:
    """A scenario's outcome; the metrics are defined in the module docstring."""

    hit_blocks: int
    queried_blocks: int
    prompt_tokens: int
    prefill_tokens_skipped: int
    blocks_saved: int

    def report(self) -> dict[str, float]:
        return {
            **asdict(self),
            "hit_ratio": self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0,
            "skip_ratio": self.prefill_tokens_skipped / self.prompt_tokens,
        }


def prefill(manager: Any, prompt: list[int]) -> tuple[list[int], int]:
    """Allocate a prompt, compute what is not cached, register its full blocks."""
    table, cached = manager.allocate_prompt(prompt)
    manager.cache_blocks(table, prompt)
    return table, cached


def decode(manager: Any, table: list[int], tokens: list[int], new: list[int]) -> list[int]:
    """Write ``new`` one token at a time (``tokens`` grows); cache each block it fills."""
    for token in new:
        tokens.append(token)
        table = manager.append_slot(table, len(tokens))
        if len(tokens) % manager.block_size == 0:
            manager.cache_blocks(table, tokens)
    manager.pop_copy_pairs()  # a real engine copies these blocks now
    return table


def blocks_saved(tables: list[list[int]]) -> int:
    return sum(map(len, tables)) - len({b for table in tables for b in table})


def system_prompt_users(manager: Any, users: int) -> Sharing:
    """``users`` requests, each the system prompt plus a message of its own, all live."""
    prompts = [SYSTEM + own_tokens(user, MESSAGE_LEN) for user in range(users)]
    tables, skipped = zip(*(prefill(manager, prompt) for prompt in prompts), strict=True)
    return sharing(manager, prompts, sum(skipped), blocks_saved(list(tables)))


def conversation(manager: Any, turns: int) -> Sharing:
    """One conversation; each turn's prompt is the last prompt, its answer and a new message.

    The K/V of a turn's last answer token is never computed (that token is sampled, not fed
    back), so a turn leaves ``len(prompt) + ANSWER_LEN - 1`` tokens behind.
    """
    prompts, history, skipped = [], [], 0
    for turn in range(turns):
        prompt = history + own_tokens(2 * turn, MESSAGE_LEN)
        table, cached = prefill(manager, prompt)
        answer = own_tokens(2 * turn + 1, ANSWER_LEN)
        manager.free(decode(manager, table, list(prompt), answer[:-1]))
        prompts.append(prompt)
        history, skipped = prompt + answer, skipped + cached
    return sharing(manager, prompts, skipped, skipped // manager.block_size)


def parallel_samples(manager: Any, samples: int, via: str) -> Sharing:
    """``samples`` continuations of the system prompt, each decoding tokens of its own."""
    if via == "fork":
        first, _ = prefill(manager, SYSTEM)
        tables = [first] + [manager.fork(first) for _ in range(samples - 1)]
        prompts, skipped = [SYSTEM] * samples, (samples - 1) * len(SYSTEM)
    else:
        tables, cached = zip(*(prefill(manager, SYSTEM) for _ in range(samples)), strict=True)
        prompts, skipped = [SYSTEM] * samples, sum(cached)
    tables = [
        decode(manager, table, list(SYSTEM), own_tokens(i, SAMPLE_LEN))
        for i, table in enumerate(tables)
    ]
    return sharing(manager, prompts, skipped, blocks_saved(tables))


def sharing(manager: Any, prompts: list[list[int]], skipped: int, saved: int) -> Sharing:
    stats = manager.stats
    return Sharing(stats.hit_blocks, stats.queried_blocks, sum(map(len, prompts)), skipped, saved)


def expected_system_prompt_users(users: int) -> Sharing:
    shared = len(SYSTEM) // BLOCK_SIZE  # every later user hits the system prompt's full blocks
    prompt_len = len(SYSTEM) + MESSAGE_LEN
    queried = users * ((prompt_len - 1) // BLOCK_SIZE)
    later = users - 1
    skipped = later * shared * BLOCK_SIZE
    return Sharing(later * shared, queried, users * prompt_len, skipped, later * shared)


def expected_conversation(turns: int) -> Sharing:
    hits = queried = prompt_tokens = 0
    left_behind = 0  # tokens whose K/V the previous turn wrote
    for _ in range(turns):
        prompt_len = left_behind + 1 + MESSAGE_LEN if left_behind else MESSAGE_LEN
        queried += (prompt_len - 1) // BLOCK_SIZE
        hits += left_behind // BLOCK_SIZE
        prompt_tokens += prompt_len
        left_behind = prompt_len + ANSWER_LEN - 1
    return Sharing(hits, queried, prompt_tokens, hits * BLOCK_SIZE, hits)


def expected_parallel_samples(samples: int, via: str) -> Sharing:
    full = len(SYSTEM) // BLOCK_SIZE  # stay shared; the partial block is copied on write
    queried = (len(SYSTEM) - 1) // BLOCK_SIZE
    later = samples - 1
    prompt_tokens = samples * len(SYSTEM)
    if via == "fork":
        return Sharing(0, queried, prompt_tokens, later * len(SYSTEM), later * full)
    skipped = later * full * BLOCK_SIZE
    return Sharing(later * full, samples * queried, prompt_tokens, skipped, later * full)


SCENARIOS: dict[str, tuple[Callable[..., Sharing], Callable[..., Sharing], list[tuple]]] = {
    "system": (system_prompt_users, expected_system_prompt_users, [(k,) for k in USERS]),
    "turns": (conversation, expected_conversation, [(t,) for t in TURNS]),
    "samples": (
        parallel_samples,
        expected_parallel_samples,
        [(n, via) for via in ("fork", "cache") for n in SAMPLES],
    ),
}
CASES = [(name, args) for name, (_, _, cases) in SCENARIOS.items() for args in cases]


def case_id(name: str, args: tuple) -> str:
    if name == "samples":
        return f"share-samples-{args[1]}-n{args[0]}"
    return f"share-{name}-{'k' if name == 'system' else 't'}{args[0]}"


def pool_for(name: str, args: tuple) -> int:
    """A pool large enough that no scenario evicts (so the closed forms hold)."""
    return 64 * 80 if name == "system" else 8 * 80 if name == "samples" else 16 * 150


@pytest.mark.parametrize("side", list(SIDES))
@pytest.mark.parametrize(("name", "args"), CASES, ids=[case_id(*c) for c in CASES])
def test_sharing(benchmark: Any, side: str, name: str, args: tuple) -> None:
    """A scenario's bookkeeping, timed; its metrics equal the closed form."""
    run, expected, _ = SCENARIOS[name]

    def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (SIDES[side](pool_for(name, args), BLOCK_SIZE), *args), {}

    benchmark.group = case_id(name, args)
    result = benchmark.pedantic(run, setup=setup, rounds=SHARE_ROUNDS)
    benchmark.extra_info.update(side=side, scenario=name, args=list(args), **result.report())
    assert result == expected(*args)


# ----------------------------------------------------------------- lookup and revival


def deep_cached_prompt(side: str, queue: int) -> tuple[Any, Callable[[], int], Callable[[], None]]:
    """A manager whose free queue ends with LONG_PROMPT's cached blocks; (manager, add, free)."""
    manager = SIDES["impl" if side == "impl-store" else side](queue, BLOCK_SIZE)
    manager.free(prefill(manager, LONG_PROMPT)[0])
    if side == "impl-store":
        store = BlockTableStore(manager, 1, len(LONG_PROMPT) // BLOCK_SIZE)
        return manager, lambda: store.add_prompt(0, LONG_PROMPT), lambda: store.remove([0])
    held: list[list[int]] = []

    def add() -> int:
        table, cached = manager.allocate_prompt(LONG_PROMPT)
        held.append(table)
        return cached

    return manager, add, lambda: manager.free(held.pop())


@pytest.mark.parametrize("side", ["spec", "impl", "impl-store"])
@pytest.mark.parametrize("queue", QUEUE_SIZES)
def test_revive_deep_in_queue(benchmark: Any, side: str, queue: int) -> None:
    """127 revivals from the tail of a ``queue``-block free queue, then one fresh block."""
    manager, add, free = deep_cached_prompt(side, queue)
    rounds: list[int] = []

    def setup() -> None:
        if rounds:
            free()
        rounds.append(len(rounds))

    benchmark.group = f"revive-2k-queue{queue}"
    benchmark.extra_info.update(side=side, op="revive", queue=queue, revived=127)
    cached = benchmark.pedantic(add, setup=setup, rounds=REVIVE_ROUNDS)
    assert cached == 127 * BLOCK_SIZE
    assert manager.num_free_blocks == queue - 128 and manager.stats.evictions == 0


@pytest.mark.parametrize("side", list(SIDES))
def test_lookup(benchmark: Any, side: str) -> None:
    """``lookup`` of a 2048-token prompt whose 127 hit blocks are held."""
    manager = SIDES[side](1024, BLOCK_SIZE)
    prefill(manager, LONG_PROMPT)
    benchmark.group = "lookup-2k"
    benchmark.extra_info.update(side=side, op="lookup", blocks=127)
    hits = benchmark.pedantic(manager.lookup, args=(LONG_PROMPT,), rounds=LOOKUP_ROUNDS)
    assert hits == list(range(127))


# ----------------------------------------------------------------- memory


def cached_bytes_per_block(cls: type, num_blocks: int = 16_000) -> float:
    """Bytes a cached block adds (key, token tuple, two dict entries), tokens owned elsewhere."""
    tokens = list(range(num_blocks * BLOCK_SIZE + 1))

    def cached_manager() -> Any:
        manager = cls(num_blocks + 1, BLOCK_SIZE)
        prefill(manager, tokens)
        return manager

    empty, _ = traced_bytes(lambda: cls(num_blocks + 1, BLOCK_SIZE))
    cached, _ = traced_bytes(cached_manager)
    return (cached - empty) / num_blocks


def test_prefix_manager_memory(record_property: Any) -> None:
    """Nothing cached: the plain manager's footprint. Cached blocks: well under 1 KB each."""
    current, peak = traced_bytes(lambda: PrefixCachingBlockManager(1_000_000, BLOCK_SIZE))
    per_block = cached_bytes_per_block(PrefixCachingBlockManager)
    record_property("impl_prefix_bytes_1m", current)
    record_property("impl_bytes_per_cached_block", per_block)
    assert current <= MEMORY_LIMIT_BYTES and peak <= MEMORY_LIMIT_BYTES
    assert per_block < 1024


# ----------------------------------------------------------------- report


def print_sharing() -> None:
    """The sharing metrics of every scenario (impl; spec's are asserted equal)."""
    header = ("scenario", "hit ratio", "skip ratio", "tokens skipped", "blocks saved")
    print("{:<24} {:>9} {:>10} {:>14} {:>12}".format(*header))
    for name, args in CASES:
        run = SCENARIOS[name][0]
        report = run(PrefixCachingBlockManager(pool_for(name, args), BLOCK_SIZE), *args).report()
        print(
            f"{case_id(name, args):<24} {report['hit_ratio']:>9.3f} {report['skip_ratio']:>10.3f}"
            f" {report['prefill_tokens_skipped']:>14} {report['blocks_saved']:>12}"
        )


if __name__ == "__main__":
    json_path = "/tmp/pagedkv-bench-prefix-cache.json"
    code = pytest.main([__file__, "-q", "-p", "no:cacheprovider", f"--benchmark-json={json_path}"])
    if code == 0:
        print_ratios(json_path)
        print_sharing()
        per_block = cached_bytes_per_block(PrefixCachingBlockManager)
        print(f"impl bytes per cached block: {per_block:.0f}")
    sys.exit(code)
