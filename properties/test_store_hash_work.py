"""The store hashes each full block once as tokens extend (keys from admission and earlier
``cache_blocks`` are kept; a fork starts with its parent's): ``hash_fn``'s call count is counted."""

from __future__ import annotations

from collections.abc import Hashable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.prefix_cache import BlockKey, PrefixCachingBlockManager, default_block_hash
from pagedkv.impl.blocks.store import BlockTableStore

BLOCK_SIZE = 4


class CountingHash:
    def __init__(self) -> None:
        self.calls = 0
        self.token_types: set[type] = set()

    def __call__(self, parent: BlockKey | None, tokens: tuple[int, ...], extra: Hashable) -> int:
        self.calls += 1
        self.token_types.update(map(type, tokens))
        return default_block_hash(parent, tokens, extra)


class Token(int):
    """An int subclass: taken at the door as the plain int it equals."""


def make_store() -> tuple[BlockTableStore, CountingHash]:
    counting = CountingHash()
    manager = PrefixCachingBlockManager(512, BLOCK_SIZE, hash_fn=counting)
    return BlockTableStore(manager, 8, 64), counting


def test_the_store_reports_whether_it_caches_prefixes() -> None:
    assert make_store()[0].prefix_caching
    assert not BlockTableStore(BlockManager(16, BLOCK_SIZE), 2, 4).prefix_caching


@given(
    prompt_len=st.integers(BLOCK_SIZE, 40),
    growth=st.lists(st.integers(1, 9), max_size=6),
    via_admit=st.booleans(),
    token=st.sampled_from([int, Token]),
)
def test_each_full_block_is_hashed_once(
    prompt_len: int, growth: list[int], via_admit: bool, token: type[int]
) -> None:
    """Admission hashes the full blocks; each later cache_blocks only those filled since.
    Int-subclass tokens reach ``hash_fn`` as plain ints."""
    store, counting = make_store()
    tokens = [token(t) for t in range(100, 100 + prompt_len)]
    if via_admit:
        assert store.admit(0, tokens) is not None
    else:
        store.add_prompt(0, tokens)
    assert counting.calls == prompt_len // BLOCK_SIZE
    store.cache_blocks(0, tokens)
    for step in growth:
        store.grow([0], step)
        tokens += map(token, range(len(tokens), len(tokens) + step))
        store.cache_blocks(0, tokens)
    assert counting.calls == len(tokens) // BLOCK_SIZE
    assert counting.token_types == {int}


@given(
    prompt_len=st.integers(BLOCK_SIZE, 40), child_growth=st.integers(0, 9), cut=st.integers(0, 40)
)
def test_a_forked_child_keeps_its_parents_keys(
    prompt_len: int, child_growth: int, cut: int
) -> None:
    """A child hashes only its own blocks, and after a truncate none it kept whole."""
    store, counting = make_store()
    tokens = list(range(100, 100 + prompt_len))
    store.add_prompt(0, tokens)
    store.cache_blocks(0, tokens)
    store.fork(0, 1)
    store.cache_blocks(1, tokens)
    assert counting.calls == prompt_len // BLOCK_SIZE
    store.grow([1], child_growth)
    child = tokens + [7] * child_growth  # the child's own tokens after the shared ones
    store.cache_blocks(1, child)
    hashed = counting.calls
    assert hashed == len(child) // BLOCK_SIZE
    kept = min(cut, len(child))
    store.truncate([1], kept)
    store.cache_blocks(1, child[:kept])
    assert counting.calls == hashed


@given(
    prompt_len=st.integers(BLOCK_SIZE, 40),
    retry_id=st.sampled_from([0, 5]),
    refusals=st.integers(1, 3),
)
def test_a_refused_prompt_is_not_hashed_again(
    prompt_len: int, retry_id: int, refusals: int
) -> None:
    """A refused prompt's retry (any id) and caching hash nothing more; another prompt is hashed."""
    store, counting = make_store()
    twin, _ = make_store()  # the same calls without the refusals: the plan to match
    cached = list(range(100, 100 + BLOCK_SIZE))  # a block both find cached
    for each in (store, twin):
        each.add_prompt(7, [*cached, 1])
        each.cache_blocks(7, [*cached, 1])
        each.remove([7])
    counting.calls = 0
    tokens = cached + list(range(200, 200 + prompt_len))
    for _ in range(refusals):
        assert store.admit(0, tokens, headroom=10_000) is None
    assert counting.calls == len(tokens) // BLOCK_SIZE
    assert store.admit(retry_id, tokens) == twin.admit(retry_id, tokens) == BLOCK_SIZE
    assert store.table(retry_id) == twin.table(retry_id)
    store.cache_blocks(retry_id, tokens)
    assert counting.calls == len(tokens) // BLOCK_SIZE
    other = [t + 1 for t in tokens]
    assert store.admit(9, other, headroom=10_000) is None
    assert counting.calls == 2 * (len(tokens) // BLOCK_SIZE)


def test_after_a_refusal_a_bad_prompt_gets_the_token_error() -> None:
    """The refused-prompt memo never reads a non-list prompt: the token TypeError, no change."""
    store, _ = make_store()
    assert store.admit(0, list(range(8)), headroom=10_000) is None
    free = store.num_free_blocks
    with pytest.raises(TypeError, match="token_ids must be a list of ints"):
        store.admit(0, 5)  # type: ignore[arg-type]
    assert store.num_free_blocks == free and 0 not in store
