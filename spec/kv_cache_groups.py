"""Executable specification of KV-cache groups: one pool for layers that attend differently.

A hybrid model's layers do not all read the same positions: a full-attention layer reads every
earlier token, a sliding-window layer of window ``W`` only the last ``W``. One block table for
all layers must keep every block a full layer reads, so the sliding layers' blocks outside their
window stay held for nothing. Groups fix that (vLLM's hybrid KV-cache manager, decided here on
our own rules):

* The layers are partitioned into *KV-cache groups* of equal size (:func:`group_layers`); every
  layer of a group attends the same way, ``None`` (full) or a window ``W`` (``check_window``).
* One pool of blocks serves all groups. A block holds ``block_size`` tokens of one group's layers;
  groups have the same number of layers, so every block has the same bytes and any free block
  can go to any group (``spec.utilization.bytes_per_block`` with ``num_layers`` the group size).
* The same ``block_size`` for every group: position ``p`` is entry ``p // block_size`` of each
  group's table, so a step's growth, a fork's point and a prefix hit are one token count for
  all groups, and a group's slot is the chapter's formula on its own table
  (:meth:`GroupedBlockManager.translate_slot`).
* A sequence holds one table per group, ``tables[g]``. A sliding group gives back the blocks
  outside its window as the single-table spec does (``release_outside_window``: the entries stay,
  released, as ``None``); a full group never releases.
* A held block belongs to one group: the group that took it from the queue. A table passed for
  another group that holds it is refused, since the block's bytes are that group's layers'.
* Every operation acts on all groups **atomically**: all arguments are checked first, and if the
  pool cannot supply every group, ``OutOfBlocksError`` is raised and nothing changes. Groups act
  in order: group 0's blocks are taken from the queue's head first (its copies, then its
  growth), then group 1's; a release gives back group 0's table first (each table's last block
  first, as ``BlockManager.free`` does).

The window convention is the project's (``check_window``): the query at ``p`` reads
``p - W < j <= p``, itself and ``W - 1`` earlier tokens; transformers' sliding mask
(``kv_idx > q_idx - W``) is the same. Pure Python, standard library only.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import TypeVar

from pagedkv.spec.block_manager import BlockManager, blocks_needed, held_ids
from pagedkv.spec.checks import BlockTableError, check_capacity, check_int, check_window
from pagedkv.spec.utilization import blocks_in_budget, bytes_per_block

Tables = list[list[int | None]]
"""A sequence's tables, one per group, in group order."""

Result = TypeVar("Result")


def check_windows(windows: object) -> tuple[int | None, ...]:
    """Rule: groups are a non-empty list or tuple, each ``None`` (full attention) or a window."""
    if not isinstance(windows, (list, tuple)) or not windows:
        raise TypeError(f"windows must be a non-empty list of windows or None, got {windows!r}")
    return tuple(None if window is None else check_window(window) for window in windows)


def group_layers(layer_windows: Sequence[int | None]) -> tuple[list[int | None], list[list[int]]]:
    """Rule: the KV-cache groups of a model whose layer ``i`` attends with ``layer_windows[i]``.

    Returns each group's window and its layers. Layers attending the same way form a kind, kinds
    in the order their first layer appears. Every group has ``size`` layers, ``size`` being the
    smallest kind's layer count, so one block's bytes fit any group: a kind of ``n`` layers is
    cut, in layer order, into ``ceil(n / size)`` groups; a last group with fewer layers wastes
    the rest of its blocks' bytes. A 5:1 model of 36 layers: five sliding groups and one full
    group of 6 layers each; one kind only: one group of all layers.
    """
    windows = check_windows(layer_windows)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)  # Rule: kinds by first appearance.
    size = min(len(layers) for layers in kinds.values())  # Rule: the smallest kind's count.
    groups = [
        (window, layers[start : start + size])
        for window, layers in kinds.items()
        for start in range(0, len(layers), size)  # Rule: a kind cut in layer order.
    ]
    return [window for window, _ in groups], [layers for _, layers in groups]


def grouped_blocks_in_budget(
    budget_bytes: int,
    layer_windows: Sequence[int | None],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    kv_cache_dtype: str,
) -> int:
    """Rule: the blocks a KV byte budget holds when the layers are grouped: a block holds one
    group's layers, so its bytes are ``bytes_per_block`` with ``num_layers`` the group size
    (:func:`group_layers`), not the model's layer count; ``floor(budget / block bytes)``."""
    group_size = max(map(len, group_layers(layer_windows)[1]))  # Rule: every group's size.
    block_bytes = bytes_per_block(block_size, group_size, num_kv_heads, head_dim, kv_cache_dtype)
    return blocks_in_budget(budget_bytes, block_bytes)


def serves_hit(window: int | None, cached: Sequence[bool], blocks: int, block_size: int) -> bool:
    """Rule: whether a group whose prompt blocks are ``cached`` (``cached[k]``: block ``k``'s key,
    chained over the whole prefix and keyed by the group, is in the cache) can serve a prefix
    hit of ``blocks`` blocks, ``L = blocks * block_size`` tokens: a full group needs every block
    before ``L``; a sliding group of window ``W`` only those its next query, at ``L``, reads:
    the blocks of positions ``L - W + 1`` to ``L - 1``."""
    first = 0 if window is None else max(0, blocks * block_size - window + 1) // block_size
    return all(cached[first:blocks])


def longest_hit(
    windows: Sequence[int | None], cached: Sequence[Sequence[bool]], block_size: int
) -> int:
    """Rule: the prefix hit of a prompt across groups, in blocks: the largest ``n`` that every
    group serves (:func:`serves_hit`), ``n`` at most each group's ``len(cached[g])`` (the caller
    leaves out the block of the prompt's last token, which is always computed). A sliding
    group's servability is not monotone in ``n`` (at ``n`` it needs blocks that at a smaller
    ``n`` lie outside its window), so ``n`` is found by a search from the longest down, not as
    the least of each group's own longest hit."""
    if len(cached) != len(windows):
        raise ValueError(f"cached must hold one list per group ({len(windows)}), got {len(cached)}")
    longest = min(len(group_cached) for group_cached in cached)
    for blocks in range(longest, 0, -1):  # Rule: the longest hit every group serves.
        if all(serves_hit(windows[g], cached[g], blocks, block_size) for g in range(len(cached))):
            return blocks
    return 0  # Rule: no hit is always served.


class GroupedBlockManager:
    """One pool (the single-table spec's ``BlockManager``, whose rules hold unchanged per
    table) and the group rules above it.

    Invariants, true between any two calls, besides the pool's own:

    * a block's reference count is the number of live tables of any group that hold it;
    * every held block belongs to the group that took it, and only that group's tables hold it;
    * a sliding group's table holds at most :meth:`held_bound` blocks once a step released.
    """

    def __init__(self, total_blocks: int, block_size: int, windows: Sequence[int | None]) -> None:
        self.windows = check_windows(windows)
        self.pool = BlockManager(total_blocks, block_size)
        self.block_size = self.pool.block_size
        # Rule: the group that took each block from the queue (current while it is held).
        self.group_of: dict[int, int] = {}

    def can_allocate(self, token_count: int) -> bool:
        """Rule: a new sequence of ``token_count`` tokens takes that many tokens' blocks in
        every group, so it fits when the queue holds all of them."""
        count = blocks_needed(check_int("token_count", token_count, 0), self.block_size)
        return count * len(self.windows) <= self.pool.num_free_blocks

    def pop_copy_pairs(self) -> list[tuple[int, int]]:
        """The pool's copy-on-write pairs (a pair's blocks are one group's: a fork copies a
        table within its group, so the caller copies the block in every layer buffer)."""
        return self.pool.pop_copy_pairs()

    def held_bound(self, group: int, token_count: int, new_tokens: int) -> int:
        """Rule: the most blocks ``group``'s table holds once a step that writes ``new_tokens``
        tokens up to ``token_count`` has released what its first query cannot read (the table
        as long as the tokens need): every block for a full group; for a window ``W``, the
        blocks of positions ``token_count - new_tokens - W + 1`` to ``token_count - 1``, at
        most ``ceil((W + new_tokens - 2) / block_size) + 1``."""
        needed = blocks_needed(token_count, self.block_size)
        window = self.windows[group]
        if window is None:
            return needed
        span = window + new_tokens - 1  # Rule: the first query's window and the step's writes.
        return min(needed, blocks_needed(span - 1, self.block_size) + 1)

    # ----------------------------------------------------------------- validation

    def check_tables(self, tables: object) -> Tables:
        """Rule: a sequence's tables are a list with one live table per group, of one length,
        and each holds only blocks of its own group."""
        if not isinstance(tables, (list, tuple)) or len(tables) != len(self.windows):
            raise TypeError(f"tables must be a list of {len(self.windows)} block tables")
        checked = [self.pool.check_live_table(table) for table in tables]
        for group, table in enumerate(checked):
            foreign = [b for b in held_ids(table) if self.group_of[b] != group]
            if foreign:  # Rule: a block's bytes are its group's layers'.
                raise BlockTableError(f"group {group}'s table holds other groups' blocks {foreign}")
        if len({len(table) for table in checked}) > 1:  # Rule: entry p // block_size in each.
            raise BlockTableError("a sequence's tables must have one length")
        return checked  # (so no block is in two of them: it has one group)

    def _atomically(self, action: Callable[[], Result]) -> Result:
        """Rule: all or nothing: if ``action`` raises, the pool is as it was before."""
        saved = copy.deepcopy((self.pool, self.group_of))
        try:
            return action()
        except Exception:
            self.pool, self.group_of = saved
            raise

    def _claim(self, group: int, before: Sequence[int | None], after: list[int | None]) -> None:
        """Rule: the blocks ``after`` holds that ``before`` did not are fresh: ``group``'s."""
        for block_id in set(held_ids(after)) - set(held_ids(before)):
            self.group_of[block_id] = group

    # ----------------------------------------------------------------- operations

    def allocate(self, token_count: int) -> Tables:
        """Tables for a new sequence of ``token_count`` tokens: each group takes
        ``ceil(token_count / block_size)`` blocks, group 0 first (a sliding group releases
        what its window leaves only through :meth:`release_outside_window`)."""
        count = blocks_needed(check_int("token_count", token_count, 0), self.block_size)

        def allocate_all() -> Tables:
            tables: Tables = []
            for group in range(len(self.windows)):
                table: list[int | None] = list(self.pool.allocate(count))
                self._claim(group, [], table)
                tables.append(table)
            return tables

        return self._atomically(allocate_all)

    def append_slot(self, tables: object, token_count: int, new_tokens: int = 1) -> Tables:
        """Every group's ``BlockManager.append_slot``, in group order, all or nothing."""
        checked = self.check_tables(tables)

        def append_all() -> Tables:  # group 0's append checks the counts before any change
            grown: Tables = []
            for group, table in enumerate(checked):
                grown.append(list(self.pool.append_slot(table, token_count, new_tokens)))
                self._claim(group, table, grown[-1])  # Rule: copies and growth are its own.
            return grown

        return self._atomically(append_all)

    def release_outside_window(self, tables: object, token_count: int) -> Tables:
        """Each sliding group's ``BlockManager.release_outside_window`` with its window, in
        group order; full groups' tables unchanged."""
        checked = self.check_tables(tables)
        check_int("token_count", token_count, 0)  # Rule: checked with no sliding group too.
        check_capacity(len(checked[0]), token_count, self.block_size)
        release = self.pool.release_outside_window

        def release_all() -> Tables:
            released: Tables = []
            for group, table in enumerate(checked):
                window = self.windows[group]  # Rule: a full group never releases.
                released.append(table if window is None else release(table, token_count, window))
            return released

        return self._atomically(release_all)

    def fork(self, tables: object) -> Tables:
        """Every group's table forked: a child shares each group's blocks within that group."""
        return [self.pool.fork(table) for table in self.check_tables(tables)]

    def truncate(self, tables: object, token_count: int) -> Tables:
        """Every group's ``BlockManager.truncate`` in group order, all or nothing."""
        checked = self.check_tables(tables)
        return self._atomically(lambda: [self.pool.truncate(t, token_count) for t in checked])

    def free(self, tables: object) -> None:
        """Every group's table freed, group 0 first (each last block first)."""
        for table in self.check_tables(tables):
            self.pool.free(table)

    def translate_slot(self, tables: object, group: int, token_pos: int) -> int:
        """The slot of ``token_pos`` for the layers of ``group``: the chapter's formula on that
        group's table (a released entry refused, as ``BlockManager.translate_slot`` does)."""
        checked = self.check_tables(tables)
        check_int("group", group, 0)
        if group >= len(self.windows):
            raise ValueError(f"group must be below {len(self.windows)}, got {group}")
        return self.pool.translate_slot(checked[group], token_pos)
