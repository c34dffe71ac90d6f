"""The rules every layer checks its input by, and the limits they check against: one home each.

The spec, the optimized blocks layer, the serving layer and the kernels all import these, so a
rule decided here holds the same everywhere it is checked. Pure Python, standard library only.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

INT32_MAX = 2**31 - 1
"""The largest int32: token counts and slot ids the arrays of ``impl`` and the kernels hold."""

INT64_MAX = 2**63 - 1
"""The largest int64: token ids, lengths and positions held in int64 arrays stay at or below it."""

MAX_INT32_BLOCKS = 2**31
"""The most blocks a pool may have where block ids are int32 (the kernels' tables):
ids ``0 .. 2**31 - 1``."""


class OutOfBlocksError(RuntimeError):
    """Raised when a request needs more free blocks than the free queue holds."""


class BlockTableError(ValueError):
    """Raised for a block table that is not a live table of this manager."""


def check_int(name: str, value: object, minimum: int) -> int:
    """Rule: counts and positions are ints (not bool, not float, not a numpy scalar, which is
    no int subclass) at or above ``minimum``. Returns the plain int the value equals: an int
    subclass is taken as its base value at the door (the rule for subclasses, design.md's input
    rules), so no layer below ever sees one."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return operator.index(value)


def check_str(name: str, value: object) -> str:
    """Rule: a text argument is a str (``TypeError`` otherwise). Returns the plain str it
    equals: a subclass (``numpy.str_``) is taken as its base value at the door, like an int
    subclass in :func:`check_int`."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, got {type(value).__name__}")
    return str.__str__(value)


def check_block_id(block_id: object, total_blocks: int) -> int:
    """Rule: a block id is an int (not bool) in ``[0, total_blocks)``; an int subclass is taken
    as the plain int it equals (so only plain ints ever enter a free queue)."""
    if isinstance(block_id, bool) or not isinstance(block_id, int):
        raise TypeError(f"block id must be an int, got {type(block_id).__name__}")
    if not 0 <= block_id < total_blocks:
        raise BlockTableError(
            f"unknown block id {block_id}: this manager has blocks 0..{total_blocks - 1}"
        )
    return int(block_id)


def check_available(num_blocks: int, num_free: int) -> None:
    """Rule: allocation is all-or-nothing; too few free blocks raises before any change."""
    if num_blocks > num_free:
        raise OutOfBlocksError(f"asked for {num_blocks} blocks but only {num_free} are free")


def check_capacity(num_entries: int, token_count: int, block_size: int) -> None:
    """Rule: a token count names only slots a table of ``num_entries`` entries holds,
    ``num_entries * block_size`` (``ValueError`` otherwise)."""
    if token_count > num_entries * block_size:
        raise ValueError(
            f"token_count {token_count} exceeds the table's capacity of "
            f"{num_entries * block_size} slots"
        )


def check_tokens(token_ids: object) -> Sequence[int]:
    """Rule: token ids are a list or tuple of non-negative ints. Returns them: the argument
    itself, not a copy, when it holds tokens and all are plain ints (a long prompt is not
    copied); otherwise a new list of the same tokens as plain ints. Every layer, spec and
    impl alike, only reads what this returns; one that keeps tokens keeps a copy of them.

    The common case is checked in C; otherwise each token is checked in order, so the first bad
    one decides between ``TypeError`` and ``ValueError``.
    """
    if not isinstance(token_ids, (list, tuple)):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    if set(map(type, token_ids)) == {int} and min(token_ids) >= 0:
        return token_ids
    return [check_int("token id", token, 0) for token in token_ids]


def check_window(window: object) -> int:
    """Rule: a sliding window is an int >= 1, in tokens: the query at position ``p`` reads the
    positions ``p - window < j <= p`` (``window = 1``: the query alone). Any such int is a
    window, however wide: ``2**64`` is accepted and, over any context, hides nothing."""
    return check_int("window", window, 1)


def int32_window(window: object) -> int | None:
    """Rule: the window a layer that counts positions in int32 (the store, the kernels, the
    engine's attention) works with: ``None`` (no window) for ``None`` or a window above
    ``INT32_MAX``, which is wider than any context such a layer holds and so hides nothing,
    exactly as :func:`blocks_outside_window` releases nothing for it; otherwise the checked
    window (:func:`check_window`'s errors)."""
    if window is None:
        return None
    checked = check_window(window)
    return None if checked > INT32_MAX else checked


def blocks_outside_window(token_count: int, window: int, block_size: int) -> int:
    """Rule: how many leading blocks of a table holding ``token_count`` tokens no query from
    position ``token_count`` on can read under a sliding window of ``window`` tokens.

    The query at position ``p`` reads the positions ``p - window < j <= p``; for every
    ``p >= token_count`` that excludes all ``j <= token_count - window``. Block ``k`` holds the
    positions ``k * block_size .. (k + 1) * block_size - 1``, so it is outside exactly when
    ``(k + 1) * block_size <= token_count - window + 1``.
    """
    return max(0, token_count - window + 1) // block_size
