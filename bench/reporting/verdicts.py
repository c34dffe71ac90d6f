"""Words and orderings computed from numbers: the building blocks of every sentence of the report
that judges a figure, so that the sentence follows the figure.

Comparisons are made at the precision the report prints (``decimals``), so a sentence never
calls two printed numbers different when they read the same, or the same when they do not.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Literal

Sign = Literal[-1, 0, 1]


def compare(ours: float, theirs: float, decimals: int) -> Sign:
    """-1, 0 or 1 as ``ours`` is below, equal to or above ``theirs`` once both are rounded to
    ``decimals`` decimals."""
    a, b = round(ours, decimals), round(theirs, decimals)
    return 1 if a > b else -1 if a < b else 0


def word(sign: Sign, above: str, below: str, equal: str) -> str:
    """The word for a :func:`compare` result."""
    return {1: above, -1: below, 0: equal}[sign]


def within(value: float, low: float, high: float, decimals: int) -> str:
    """``within``, ``below`` or ``above`` the range ``[low, high]``, at ``decimals`` decimals."""
    if compare(value, low, decimals) < 0:
        return "below"
    if compare(value, high, decimals) > 0:
        return "above"
    return "within"


Ranked = tuple[tuple[str, ...], ...]
"""Names grouped by value, the largest value first; a group holds names whose values print the
same."""


def rank(values: Sequence[tuple[str, float]], fmt: Callable[[float], str]) -> Ranked:
    """``values`` (name, value) grouped by printed value, largest first; ties keep their order."""
    groups: list[list[str]] = []
    printed: list[str] = []
    for name, value in sorted(values, key=lambda item: -item[1]):
        if printed and fmt(value) == printed[-1]:
            groups[-1].append(name)
        else:
            groups.append([name])
            printed.append(fmt(value))
    return tuple(tuple(group) for group in groups)


def ordering(values: Sequence[tuple[str, float]], fmt: Callable[[float], str]) -> str:
    """``values`` (name, value) sorted largest first: ``paged 37.8 > Oracle 23.1 = Pow2 23.1``
    (``=`` where the printed values are the same)."""
    by_name = dict(values)
    return " > ".join(
        " = ".join(f"{name} {fmt(by_name[name])}" for name in group) for group in rank(values, fmt)
    )


def same_order(
    ours: Sequence[tuple[str, float]],
    theirs: Sequence[tuple[str, float]],
    fmt: Callable[[float], str],
) -> bool:
    """Whether the names rank the same way (ties included) in both."""
    return rank(ours, fmt) == rank(theirs, fmt)


def trend(values: Sequence[float]) -> str:
    """How ``values`` move in order: ``falls`` (never up, and down overall), ``rises``,
    ``does not change``, or ``goes up and down``."""
    steps = [b - a for a, b in pairwise(values)]
    if all(step == 0 for step in steps):
        return "does not change"
    if all(step <= 0 for step in steps):
        return "falls"
    if all(step >= 0 for step in steps):
        return "rises"
    return "goes up and down"
