"""Growing a batch of sequences: a pure plan of who grows, copies on write or is removed, and
applying it.

``BlockTableStore.grow`` is ``append_slot`` called once per sequence, in batch order, with
``OutOfBlocksError`` caught; ``grow_or_preempt`` is the same, except that a sequence that cannot
grow first removes the batch's last remaining sequence, until it fits or was itself removed.
:func:`plan` decides, reading the rows and the pool and changing nothing, and returns a
:data:`Plan`; :func:`apply` carries it out in the spec's order. Nothing here knows of prefix
caching: a store that caches prefixes passes the hook that takes fresh blocks
(``PrefixStore.take_fresh``).

Two branches of :func:`plan` decide common cases with a fixed number of numpy calls, each exact,
and each kept because the trace benchmark's store step was more than 10% slower without it
(docs/design.md §9 gives the figures): the decode step when no row's last block can be shared
(:class:`DecodePlan`, gated by the rows' tail-shared flags), and preemption of sequences that own
their blocks alone (:func:`preemption_stop`). Everything else is the planner's loop over the
batch (:func:`plan_in_order`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.impl.blocks.rows import PAD, CapacityError, Rows, SeqRows
from pagedkv.spec.checks import BlockTableError

Step = int | NDArray[np.int64]
"""New tokens: one count for every sequence, or one per sequence."""

TakeFresh = Callable[[NDArray[np.int64], NDArray[np.int32], NDArray[np.bool_]], IdArray]
"""``(num_fresh, last, in_place) -> fresh blocks``: takes each sequence's fresh blocks, where
the sequences ``in_place`` write their present ``last`` block in place (see
``PrefixStore.take_fresh``). Without one, :func:`apply` takes them all at once."""


class Growth(NamedTuple):
    """One batch's growth, read before anything changes (arrays in batch order)."""

    rows: Rows
    base: Rows  # flat row offsets
    lengths: NDArray[np.int32]  # blocks held now
    needed: NDArray[np.int64]  # blocks held after
    new_counts: NDArray[np.int64]
    growth: NDArray[np.int64]  # needed - lengths
    writes_last: NDArray[np.bool_]  # a write lands in the present last block
    last: NDArray[np.int32]  # the present last block (garbage where nothing is held)
    last_refs: NDArray[np.int32]
    shared: NDArray[np.bool_]  # writes_last and the last block has other owners


class DecodePlan(NamedTuple):
    """The decode step with no shared last block: every row of ``rows`` gains one token
    (``new_counts``); those at a block boundary (``growing``, holding ``lengths``) one fresh
    block each, at the flat entries ``entries``."""

    rows: Rows
    new_counts: NDArray[np.int32]
    growing: Rows
    lengths: NDArray[np.int32]
    entries: Rows


class GrowthPlan(NamedTuple):
    """Who copies on write (``copies``), who is removed (``victims``, batch indices in removal
    order), and ``steps``: who grows and is removed in the order to apply them, as runs of
    ``(grow, batch indices)``."""

    growth: Growth
    copies: NDArray[np.bool_]
    victims: list[int]
    steps: list[tuple[bool, list[int]]]

    def not_grown(self) -> list[int]:
        """The batch indices that do not grow, in batch order."""
        grown = {i for grows, indices in self.steps if grows for i in indices}
        return [i for i in range(len(self.copies)) if i not in grown]


Plan = DecodePlan | GrowthPlan
"""What :func:`plan` decides and :func:`apply` carries out."""


def plan(
    rows: SeqRows,
    pool: BlockPool,
    seq_ids: Sequence[int],
    batch_rows: Rows,
    base: Rows,
    step: Step,
    preempt: bool,
) -> Plan | None:
    """Decide growing the sequences ``seq_ids`` in ``batch_rows`` by ``step``, with
    ``preempt`` as ``grow_or_preempt``; None when nothing grows. Changes nothing; raises what
    :func:`growth_of` raises."""
    if isinstance(step, int) and step == 1:
        decode = decode_plan(rows, pool, batch_rows, base)
        if decode is not None:
            return decode
    g = growth_of(rows, pool, seq_ids, batch_rows, base, step)
    if g is None:
        return None
    if preempt and not g.shared.any():  # no copy on write: removals free what they hold
        alone = preemption_plan(g, pool.num_free, rows, pool)
        if alone is not None:
            return alone
    return plan_in_order(g, pool.num_free, preempt, rows, pool)


def decode_plan(rows: SeqRows, pool: BlockPool, batch_rows: Rows, base: Rows) -> DecodePlan | None:
    """The decode step, when no written last block can be shared (no row is flagged
    ``tail_shared``): only sequences at a block boundary take a block. None when the planner
    must decide (a flagged row, more sequences at a boundary than free blocks, a table at
    full width)."""
    if rows.tail_shared.take(batch_rows).any():
        return None
    counts = rows.token_counts.take(batch_rows)
    boundary = (counts % rows.block_size == 0).nonzero()[0]  # a new block each
    growing = batch_rows.take(boundary)
    lengths = rows.num_blocks.take(growing)
    if boundary.size and (boundary.size > pool.num_free or lengths.max() >= rows.width):
        return None
    return DecodePlan(batch_rows, counts + 1, growing, lengths, base.take(boundary) + lengths)


def growth_of(
    rows: SeqRows,
    pool: BlockPool,
    seq_ids: Sequence[int],
    batch_rows: Rows,
    base: Rows,
    step: Step,
) -> Growth | None:
    """What growing the sequences ``seq_ids`` in ``batch_rows`` by ``step`` needs, changing
    nothing; None if nothing grows. ``CapacityError`` if a sequence would outgrow its table,
    ``BlockTableError`` if one would write into a released entry."""
    if batch_rows.size == 0:
        return None
    bs, width = rows.block_size, rows.width
    counts = rows.token_counts.take(batch_rows).astype(np.int64)
    lengths = rows.num_blocks.take(batch_rows)
    new_counts = counts + step
    needed = (new_counts + (bs - 1)) // bs
    over = needed > width
    if over.any():
        ids = [seq_ids[i] for i in over.nonzero()[0].tolist()]
        raise CapacityError(f"sequences {ids} would need more than {width} blocks")
    if isinstance(step, int) and step == 0:
        return None
    # A live table holds exactly ceil(count / block_size) blocks, so the only present block
    # a write can reach is the last one, and only when it is partly filled.
    writes_last = counts % bs != 0
    if not isinstance(step, int):
        writes_last &= step > 0
    last = rows.tables.take(base + lengths - 1)  # index -1 only if not writes_last
    into_released = writes_last & (last == PAD)  # the spec's rule: never written
    if into_released.any():
        ids = np.array(seq_ids)[into_released].tolist()
        raise BlockTableError(f"sequences {ids} would write into a released block")
    last_refs = pool.refs_of(last)
    shared = writes_last & (last_refs > 1)
    return Growth(
        batch_rows, base, lengths, needed, new_counts, needed - lengths, writes_last, last,
        last_refs, shared,
    )  # fmt: skip


def preemption_plan(g: Growth, free: int, rows: SeqRows, pool: BlockPool) -> GrowthPlan | None:
    """The plan of ``grow_or_preempt`` when no sequence copies on write and every block a
    victim holds is its alone and read by no pending copy, so removing it frees all it
    holds; None otherwise."""
    n = g.rows.size
    held_counts = g.lengths - rows.num_released.take(g.rows)  # released entries: none
    stop = preemption_stop(g.growth, held_counts.astype(np.int64), free)
    victims = rows.tables[g.rows[stop:]]
    held = victims[victims != PAD].astype(np.intp)
    if held.size and (pool.refs_of(held).max() != 1 or pool.is_source.take(held).any()):
        return None
    removed = list(range(n - 1, stop - 1, -1))
    steps = [(False, removed), (True, list(range(stop)))]
    return GrowthPlan(g, g.shared, removed, [step for step in steps if step[1]])


def plan_in_order(
    g: Growth, free: int, preempt: bool, rows: SeqRows, pool: BlockPool
) -> GrowthPlan:
    """Decide, sequence by sequence as the spec's calls would, with ``free`` blocks free.

    Rules: a sequence writing a block that other owners still hold copies it first (one more
    fresh block) and drops its own hold, so once one owner is left that owner writes in place;
    a sequence grows only if all its blocks are free then. Otherwise, without ``preempt``, it
    changes nothing; with ``preempt`` the batch's last remaining sequence is removed (each of
    its blocks loses a hold, and those left with none are free again) until it grows or was
    itself the one removed, which ends the batch. A removed block that a pending copy reads
    (copied on write earlier in this plan, or before it) waits for the copy: it is not free.
    """
    n = g.rows.size
    refs: dict[int, int] = {}  # the blocks whose counts the plan has changed so far
    # Copy-on-write sources: of pairs already pending, then of the plan's own copies.
    sources = set(pool.pending_sources()) if pool.copy_pairs else set()
    copies = np.zeros(n, dtype=np.bool_)
    removed: list[int] = []
    steps: list[tuple[bool, list[int]]] = []
    tail = n - 1
    growth, writes_last = g.growth.tolist(), g.writes_last.tolist()
    last, last_refs = g.last.tolist(), g.last_refs.tolist()
    i = 0
    while i <= tail:  # past the tail, every sequence was removed
        while True:
            owners = refs.get(last[i], last_refs[i]) if writes_last[i] else 1
            need = growth[i] + (owners > 1)
            if need <= free or not preempt or tail < i:
                break
            victim, tail = tail, tail - 1
            removed.append(victim)
            _record(steps, False, victim)
            held = rows.held(int(g.rows[victim])).astype(np.intp)
            held_refs = pool.refs_of(held).tolist()
            for index, block in enumerate(held.tolist()):
                left = refs.get(block, held_refs[index]) - 1
                refs[block] = left
                # A pending copy's source waits for the copy instead of joining the queue.
                free += left == 0 and block not in sources
        if i <= tail and need <= free:  # not itself removed, and it fits
            free -= need
            _record(steps, True, i)
            if owners > 1:
                copies[i] = True
                refs[last[i]] = owners - 1
                sources.add(last[i])
        i += 1
    return GrowthPlan(g, copies, removed, steps)


def _record(steps: list[tuple[bool, list[int]]], grow: bool, index: int) -> None:
    """Append ``index`` to the last run if it is of the same kind, else start a run."""
    if steps and steps[-1][0] == grow:
        steps[-1][1].append(index)
    else:
        steps.append((grow, [index]))


def preemption_stop(growth: NDArray[np.int64], lengths: NDArray[np.int64], free: int) -> int:
    """Where preemption from the tail stops, for sequences that own all their blocks alone.

    Sequence ``i`` needs ``growth[i]`` new blocks and holds ``lengths[i]``; ``free`` are free.
    The spec's order: sequence ``i`` grows once the blocks freed by removing the last ``k``
    sequences cover what sequences ``0..i`` need, for the least such ``k``; if that takes
    sequence ``i`` itself, it is removed too and nothing after it is left. Returns ``stop``:
    sequences ``0 .. stop - 1`` grow, ``stop .. n - 1`` are removed. ``k`` only grows with
    ``i``, so ``stop`` is the first ``i`` with ``i + k_i >= n``.
    """
    n = growth.size
    freed = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths[::-1], out=freed[1:])  # freed[k]: blocks the last k sequences hold
    victims = np.searchsorted(freed, np.cumsum(growth) - free, side="left")
    cut = np.arange(n) + victims >= n
    return int(cut.argmax()) if cut.any() else n


def apply(
    decided: Plan,
    rows: SeqRows,
    pool: BlockPool,
    take_fresh: TakeFresh | None,
    remove: Callable[[list[int]], None],
) -> None:
    """Carry a plan out in the spec's order; ``remove`` removes the sequences at the given
    batch indices, in order."""
    if isinstance(decided, DecodePlan):
        if decided.growing.size:
            size = decided.growing.size
            rows.flat[decided.entries] = pool.take_one() if size == 1 else pool.take(size)
            rows.num_blocks[decided.growing] = decided.lengths + 1
        rows.token_counts[decided.rows] = decided.new_counts
        return
    g, copies = decided.growth, decided.copies
    for grows, indices in decided.steps:
        if not grows:
            remove(indices)
        elif len(indices) == g.rows.size:  # the whole batch
            grow(rows, pool, take_fresh, g, None, copies)
        else:
            chosen = np.array(indices, dtype=np.intp)
            grow(rows, pool, take_fresh, g, chosen, copies[chosen])


def grow(
    rows: SeqRows,
    pool: BlockPool,
    take_fresh: TakeFresh | None,
    g: Growth,
    keep: Rows | None,
    shared: NDArray[np.bool_],
) -> None:
    """Grow the sequences ``keep`` of ``g`` (all with None), all of which fit; ``shared``
    marks, among them, those that copy their last block on write.

    All fresh blocks are taken at once and placed per sequence, in batch order, as the
    spec's calls would take them: its copy-on-write block first (replacing its shared last
    block), then its growth blocks. After it no written sequence's last block is shared.
    """
    if keep is None:
        batch_rows, base, lengths, growth, last = g.rows, g.base, g.lengths, g.growth, g.last
        needed, new_counts, writes_last = g.needed, g.new_counts, g.writes_last
    else:
        batch_rows, base, lengths = g.rows[keep], g.base[keep], g.lengths[keep]
        growth, last, needed = g.growth[keep], g.last[keep], g.needed[keep]
        new_counts, writes_last = g.new_counts[keep], g.writes_last[keep]
    num_fresh = growth + shared
    if take_fresh is None:
        fresh = pool.take(int(num_fresh.sum()))
    else:  # only a flagged row's in-place write can reach a block with a key
        in_place = writes_last & ~shared & rows.tail_shared.take(batch_rows)
        fresh = take_fresh(num_fresh, last, in_place)
    if fresh.size:
        place_fresh(rows, pool, fresh, base, lengths, growth, last, shared)
    rows.num_blocks[batch_rows] = needed
    rows.token_counts[batch_rows] = new_counts
    # A write into the last block copied it or found it the row's own. (A flagged row's last
    # block is partly filled, so each growth of one writes it.)
    rows.tail_shared[batch_rows[writes_last]] = False


def place_fresh(
    rows: SeqRows,
    pool: BlockPool,
    fresh: IdArray,
    base: Rows,
    lengths: NDArray[np.int32],
    growth: NDArray[np.int64],
    last: NDArray[np.int32],
    shared: NDArray[np.bool_],
) -> None:
    """Write ``fresh`` into the tables: per sequence, its copy of a ``shared`` last block
    (recording the copy-on-write pair), then its ``growth`` blocks after its ``lengths``."""
    flat = rows.flat
    if fresh.size == np.count_nonzero(growth):  # no copy, and at most one block each
        growing = growth.nonzero()[0]
        flat[base.take(growing) + lengths.take(growing)] = fresh
        return
    num_fresh = growth + shared
    first_fresh = np.cumsum(num_fresh) - num_fresh
    copying = shared.nonzero()[0]
    if copying.size:
        dst = fresh[first_fresh[copying]]
        flat[base[copying] + lengths[copying] - 1] = dst
        pool.copy_on_write(last[copying].astype(np.intp), dst)
    owner = np.repeat(np.arange(growth.size), growth)
    within = np.arange(owner.size) - np.repeat(np.cumsum(growth) - growth, growth)
    flat[base[owner] + lengths[owner] + within] = fresh[(first_fresh + shared)[owner] + within]
