"""KV-cache groups: the spec's rules against the independent model, step by step
(:mod:`properties.machines.kv_cache_groups`), and the layer partition into groups."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.spec.kv_cache_groups import (
    GroupedBlockManager,
    group_layers,
    grouped_blocks_in_budget,
    longest_hit,
)
from pagedkv.spec.utilization import blocks_in_budget, bytes_per_block
from properties.machines.kv_cache_groups import GroupsMachine

TestGroups = GroupsMachine.TestCase


@pytest.mark.parametrize(
    ("layer_windows", "windows", "layers"),
    [
        ([None] * 3, [None], [[0, 1, 2]]),  # one kind: one group of every layer
        ([8, None] * 2, [8, None], [[0, 2], [1, 3]]),  # gpt-oss's alternation
        ([4] * 5 + [None] + [4] * 5 + [None], [4, 4, 4, 4, 4, None],
         [[0, 1], [2, 3], [4, 6], [7, 8], [9, 10], [5, 11]]),  # Gemma 3's 5:1: groups of 2
        ([None, 4, 4], [None, 4, 4], [[0], [1], [2]]),
        ([4, 4, 4, None, None], [4, 4, None], [[0, 1], [2], [3, 4]]),  # a short last group
    ],
)  # fmt: skip
def test_layers_are_cut_into_equal_groups_by_kind(layer_windows, windows, layers) -> None:
    assert group_layers(layer_windows) == (windows, layers)


@pytest.mark.parametrize(
    ("windows", "error"),
    [([], TypeError), (None, TypeError), ((4, 0), ValueError), ([None, 2.0], TypeError)],
)
def test_groups_are_a_list_of_windows_or_none(windows, error) -> None:
    with pytest.raises(error, match="window"):
        group_layers(windows)
    with pytest.raises(error, match="window"):
        GroupedBlockManager(8, 4, windows)


def served_by_positions(window: int | None, cached: list[bool], hit: int, size: int) -> bool:
    """The model: every position the query at ``hit * size`` reads below it lies in a cached
    block (all of them for full attention)."""
    end = hit * size
    start = 0 if window is None else max(0, end - window + 1)
    return all(cached[pos // size] for pos in range(start, end))


@given(
    size=st.integers(1, 4),
    groups=st.lists(
        st.tuples(st.none() | st.integers(1, 12), st.lists(st.booleans(), max_size=10)),
        min_size=1, max_size=4,
    ),
)  # fmt: skip
def test_the_hit_is_the_longest_every_group_serves(size, groups) -> None:
    windows, cached = [w for w, _ in groups], [c for _, c in groups]
    longest = min(map(len, cached))
    served = [n for n in range(longest + 1)
              if all(served_by_positions(w, c, n, size) for w, c in groups)]  # fmt: skip
    assert longest_hit(windows, cached, size) == max(served)


def test_a_hit_is_searched_not_the_least_longest() -> None:
    """Window 4, blocks of 2: the sliding group serves 4 blocks (it reads blocks 2 and 3) but
    not 3 (block 1 is gone); the full group serves 3: together only no hit."""
    sliding, full = [False, False, True, True], [True, True, True, False]
    assert longest_hit([4, None], [sliding, full], 2) == 0
    assert longest_hit([4], [sliding], 2) == 4
    assert longest_hit([5], [[False, True, True]], 1) == 0  # short of the window: reads block 0
    with pytest.raises(ValueError, match="cached"):
        longest_hit([3, None], [sliding], 2)


def test_a_sliding_group_holds_the_first_query_s_window_and_the_step_s_writes() -> None:
    """``held_bound`` is ceil((W + q - 2) / block_size) + 1 once the tokens are that long, every
    token's block before (a full group's bound is every block)."""
    for size, window, new in itertools.product(range(1, 5), range(1, 9), range(1, 6)):
        manager = GroupedBlockManager(1, size, [window, None])
        assert manager.held_bound(0, 200, new) == -(-(window + new - 2) // size) + 1
        assert manager.held_bound(0, 1, 1) == 1  # no more than the tokens' blocks
        assert manager.held_bound(1, 200, new) == -(-200 // size)


def test_a_grouped_pool_serves_five_times_the_sequences_of_one_table_at_5_to_1() -> None:
    """The issue's arithmetic, from the rules: 36 layers, 30 sliding (window 1,024) and 6 full,
    blocks of 16, 8 KV heads of 128, fp16, every sequence at 32k tokens: a block holds one
    group's 6 layers, so the budget holds 6 times the blocks; a sequence holds its full group's
    2,048 and 65 in each sliding group after a decode step's release: 5.18 times the sequences."""
    layers, shape, budget = [1024] * 5 * 6 + [None] * 6, (16, 8, 128, "fp16"), 80 * 2**30
    grouped = grouped_blocks_in_budget(budget, layers, *shape)
    single = blocks_in_budget(budget, bytes_per_block(16, 36, 8, 128, "fp16"))
    assert grouped == grouped_blocks_in_budget(budget, [None] * 6, *shape)  # 6-layer blocks
    assert 6 * single <= grouped < 6 * single + 6  # a sixth of the bytes, floored
    short_last = grouped_blocks_in_budget(budget, [4, 4, 4, None, None], *shape)  # 2, 1, 2 layers
    assert short_last == blocks_in_budget(budget, bytes_per_block(16, 2, 8, 128, "fp16"))
    windows, _ = group_layers(layers)
    manager = GroupedBlockManager(1, 16, windows)
    per_sequence = sum(manager.held_bound(g, 32 * 1024, 1) for g in range(len(windows)))
    assert per_sequence == 2048 + 5 * 65
    assert (grouped // per_sequence) >= 4 * (single // 2048)  # the floor: 4x
    assert 5.17 < (grouped / per_sequence) / (single / 2048) < 5.19  # before the floors
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        grouped_blocks_in_budget(budget, layers, 16, 8, 128, "fp4")
    with pytest.raises(TypeError, match="windows"):
        grouped_blocks_in_budget(budget, [], *shape)
