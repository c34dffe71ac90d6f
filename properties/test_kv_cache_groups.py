"""KV-cache groups: the spec's rules against the independent model, step by step
(:mod:`properties.machines.kv_cache_groups`), and the layer partition into groups."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pagedkv.spec.kv_cache_groups import GroupedBlockManager, group_layers, longest_hit
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
