"""Growing a batch of sequences: what each needs, one planner in the spec's order, and applying it.

``BlockTableStore.grow`` is ``append_slot`` called once per sequence, in batch order, with
``OutOfBlocksError`` caught; ``grow_or_preempt`` is the same, except that a sequence that cannot
grow first removes the batch's last remaining sequence, until it fits or was itself removed.
:func:`growth_of` reads what each sequence needs (changing nothing), :func:`plan` decides, on
counts alone, who grows, who copies its shared last block on write and who is removed, and
:func:`carry_out` carries the plan out in the spec's order (:func:`apply_growth` grows).
:func:`grow_decode` is the decode step when no written block can be shared.

Two shortcuts decide common cases with a fixed number of numpy calls, each exact, and each kept
because the trace benchmark's store step was more than 10% slower without it (docs/design.md §9
gives the figures): the decode step when no row's last block can be shared (:func:`grow_decode`,
gated by the rows' tail-shared flags), and preemption of sequences that own their blocks alone
(:func:`plan_preemption`). Everything else is the planner's loop over the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.blocks.pool import BlockPool, IdArray
from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager
from pagedkv.impl.blocks.tables import PAD, BlockTables, CapacityError, Rows
from pagedkv.spec.checks import BlockTableError

Step = int | NDArray[np.int64]
"""New tokens: one count for every sequence, or one per sequence."""


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


class Plan(NamedTuple):
    """Who grows (``grown``) and copies on write (``copies``), who is removed (``victims``,
    batch indices in removal order), and ``steps``: the order to apply them in, as runs of
    ``(grow, batch indices)``."""

    grown: NDArray[np.bool_]
    copies: NDArray[np.bool_]
    victims: list[int]
    steps: list[tuple[bool, list[int]]]


def decide(
    tables: BlockTables,
    pool: BlockPool,
    seq_ids: Sequence[int],
    rows: Rows,
    base: Rows,
    step: Step,
    preempt: bool,
) -> tuple[Growth, Plan] | None:
    """Decide growing the sequences ``seq_ids`` in ``rows`` by ``step``, with ``preempt`` as
    ``grow_or_preempt``. The decode step is carried out at once when it can be
    (:func:`grow_decode`); then, and when nothing grows, None. Raises what :func:`growth_of`
    raises, changing nothing."""
    if isinstance(step, int) and step == 1 and grow_decode(tables, pool, rows, base):
        return None
    g = growth_of(tables, pool, seq_ids, rows, base, step)
    if g is None:
        return None
    return g, plan(g, pool.num_free, preempt, tables, pool)


def growth_of(
    tables: BlockTables,
    pool: BlockPool,
    seq_ids: Sequence[int],
    rows: Rows,
    base: Rows,
    step: Step,
) -> Growth | None:
    """What growing the sequences ``seq_ids`` in ``rows`` by ``step`` needs, changing nothing;
    None if nothing grows. ``CapacityError`` if a sequence would outgrow its table,
    ``BlockTableError`` if one would write into a released entry."""
    if rows.size == 0:
        return None
    bs, width = tables.block_size, tables.width
    counts = tables.token_counts.take(rows).astype(np.int64)
    lengths = tables.num_blocks.take(rows)
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
    last = tables.tables.take(base + lengths - 1)  # index -1 only if not writes_last
    into_released = writes_last & (last == PAD)  # the spec's rule: never written
    if into_released.any():
        ids = np.array(seq_ids)[into_released].tolist()
        raise BlockTableError(f"sequences {ids} would write into a released block")
    last_refs = pool.refs_of(last)
    shared = writes_last & (last_refs > 1)
    return Growth(
        rows, base, lengths, needed, new_counts, needed - lengths, writes_last, last,
        last_refs, shared,
    )  # fmt: skip


def plan(g: Growth, free: int, preempt: bool, tables: BlockTables, pool: BlockPool) -> Plan:
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
    if preempt and not g.shared.any():  # no copy on write: removals free what they hold
        held_counts = g.lengths - tables.num_released.take(g.rows)  # released entries: none
        stop = plan_preemption(g.growth, held_counts.astype(np.int64), free)
        victims = tables.tables[g.rows[stop:]]
        held = victims[victims != PAD].astype(np.intp)
        # Each frees all it holds, and none of it waits for a pending copy.
        if held.size == 0 or (
            pool.refs_of(held).max() == 1
            and not (pool.copy_pairs and pool.is_source.take(held).any())
        ):
            grown = np.arange(n) < stop
            removed = list(range(n - 1, stop - 1, -1))
            steps = [(False, removed), (True, list(range(stop)))]
            return Plan(grown, g.shared & grown, removed, steps)
    refs: dict[int, int] = {}  # the blocks whose counts the plan has changed so far
    # Copy-on-write sources: of pairs already pending, then of the plan's own copies.
    sources = set(pool.pending_sources()) if pool.copy_pairs else set()
    grown = np.zeros(n, dtype=np.bool_)
    copies = np.zeros(n, dtype=np.bool_)
    removed: list[int] = []
    steps: list[tuple[bool, list[int]]] = []
    tail = n - 1
    growth, writes_last = g.growth.tolist(), g.writes_last.tolist()
    last, last_refs = g.last.tolist(), g.last_refs.tolist()
    for i in range(n):
        if i > tail:  # every later sequence was removed
            break
        while True:
            owners = refs.get(last[i], last_refs[i]) if writes_last[i] else 1
            need = growth[i] + (owners > 1)
            if need <= free or not preempt or tail < i:
                break
            victim, tail = tail, tail - 1
            removed.append(victim)
            _record(steps, False, victim)
            held = tables.held(int(g.rows[victim])).astype(np.intp)
            held_refs = pool.refs_of(held).tolist()
            for index, block in enumerate(held.tolist()):
                left = refs.get(block, held_refs[index]) - 1
                refs[block] = left
                # A pending copy's source waits for the copy instead of joining the queue.
                free += left == 0 and block not in sources
        if tail < i:  # it was itself removed
            break
        if need <= free:
            free -= need
            grown[i] = True
            _record(steps, True, i)
            if owners > 1:
                copies[i] = True
                refs[last[i]] = owners - 1
                sources.add(last[i])
    return Plan(grown, copies, removed, steps)


def _record(steps: list[tuple[bool, list[int]]], grow: bool, index: int) -> None:
    """Append ``index`` to the last run if it is of the same kind, else start a run."""
    if steps and steps[-1][0] == grow:
        steps[-1][1].append(index)
    else:
        steps.append((grow, [index]))


def plan_preemption(growth: NDArray[np.int64], lengths: NDArray[np.int64], free: int) -> int:
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


def carry_out(
    tables: BlockTables,
    pool: BlockPool,
    prefix: PrefixCachingBlockManager | None,
    g: Growth,
    decided: Plan,
    remove: Callable[[list[int]], None],
) -> None:
    """Apply a plan in the spec's order; ``remove`` removes the sequences at the given batch
    indices, in order."""
    if not decided.victims:
        everyone = bool(decided.grown.all())
        keep = None if everyone else decided.grown.nonzero()[0]
        copies = decided.copies if keep is None else decided.copies[keep]
        apply_growth(tables, pool, prefix, g, keep, copies)
        return
    for grows, indices in decided.steps:
        if grows:
            chosen = np.array(indices, dtype=np.intp)
            apply_growth(tables, pool, prefix, g, chosen, decided.copies[chosen])
        else:
            remove(indices)


def apply_growth(
    tables: BlockTables,
    pool: BlockPool,
    prefix: PrefixCachingBlockManager | None,
    g: Growth,
    keep: Rows | None,
    shared: NDArray[np.bool_],
) -> None:
    """Grow the sequences ``keep`` of ``g`` (all with None), all of which fit; ``shared``
    marks, among them, those that copy their last block on write.

    All fresh blocks are taken at once and placed per sequence, in batch order, as the
    spec's calls would take them: its copy-on-write block first (replacing its shared last
    block), then its growth blocks. After it no written sequence's last block is shared,
    and none written in place is cached (:func:`_keyed_in_place`).
    """
    if keep is None:
        rows, base, lengths, growth, last = g.rows, g.base, g.lengths, g.growth, g.last
        needed, new_counts, writes_last = g.needed, g.new_counts, g.writes_last
    else:
        rows, base, lengths, growth = g.rows[keep], g.base[keep], g.lengths[keep], g.growth[keep]
        last, needed, new_counts = g.last[keep], g.needed[keep], g.new_counts[keep]
        writes_last = g.writes_last[keep]
    num_fresh = growth + shared
    total = int(num_fresh.sum())
    keyed = _keyed_in_place(tables, prefix, rows, last, writes_last & ~shared)
    if prefix is None or keyed is None:
        fresh = pool.take(total)
    else:
        fresh = _take_in_spec_order(pool, prefix, num_fresh, last, keyed)
    if total:
        flat = tables.flat
        # total counts the copies too, so this is: no copy, and at most one block each.
        if total == np.count_nonzero(growth):
            growing = growth.nonzero()[0]
            flat[base.take(growing) + lengths.take(growing)] = fresh
        else:
            first_fresh = np.cumsum(num_fresh) - num_fresh
            copying = shared.nonzero()[0]
            if copying.size:
                dst = fresh[first_fresh[copying]]
                flat[base[copying] + lengths[copying] - 1] = dst
                pool.copy_on_write(last[copying].astype(np.intp), dst)
            owner = np.repeat(np.arange(growth.size), growth)
            within = np.arange(owner.size) - np.repeat(np.cumsum(growth) - growth, growth)
            flat[base[owner] + lengths[owner] + within] = fresh[
                (first_fresh + shared)[owner] + within
            ]
    tables.num_blocks[rows] = needed
    tables.token_counts[rows] = new_counts
    # A write copied or filled the last block, or passed it.
    tables.clear_tail_shared(rows[writes_last | (growth > 0)])


def _keyed_in_place(
    tables: BlockTables,
    prefix: PrefixCachingBlockManager | None,
    rows: Rows,
    last: NDArray[np.int32],
    in_place: NDArray[np.bool_],
) -> NDArray[np.bool_] | None:
    """Among the sequences whose write lands in their present last block (``in_place``),
    those whose block is cached, or None if none is. Only a flagged row's can be: a
    truncate cut into a cached block that other tables held then."""
    if prefix is None or not prefix.num_cached_blocks:
        return None
    candidates = in_place & tables.tail_shared.take(rows)
    cached = prefix.cached_among(last[candidates].astype(np.intp))
    return candidates & np.isin(last, list(cached)) if cached else None


def _take_in_spec_order(
    pool: BlockPool,
    prefix: PrefixCachingBlockManager,
    num_fresh: NDArray[np.int64],
    last: NDArray[np.int32],
    keyed: NDArray[np.bool_],
) -> IdArray:
    """The sequences' fresh blocks (``num_fresh`` each), in batch order, taken in the spec's
    order when some written last block is cached (``keyed``, see :func:`_keyed_in_place`):
    per sequence, its fresh blocks, then its written block's key removal (a cached block is
    never written in place). The removals happen even when no block is taken."""
    parts = []
    for index, count in enumerate(num_fresh.tolist()):
        parts.append(pool.take(count))
        if keyed[index]:
            prefix.remove_keys([int(last[index])])
    return np.concatenate(parts)


def grow_decode(tables: BlockTables, pool: BlockPool, rows: Rows, base: Rows) -> bool:
    """The decode step: every sequence in ``rows`` gains one token, and no written last block
    can be shared (no row is flagged ``tail_shared``). Only sequences at a block boundary
    touch the pool. Returns False, changing nothing, when :func:`plan` must decide (a flagged
    row, more sequences at a boundary than free blocks, a table at full width)."""
    if tables.tail_shared.take(rows).any():
        return False
    counts = tables.token_counts.take(rows)
    boundary = (counts % tables.block_size == 0).nonzero()[0]  # a new block each
    if boundary.size:
        if boundary.size > pool.num_free:
            return False
        growing = rows.take(boundary)
        lengths = tables.num_blocks.take(growing)
        if lengths.max() >= tables.width:
            return False
        fresh = pool.take_one() if boundary.size == 1 else pool.take(boundary.size)
        tables.flat[base.take(boundary) + lengths] = fresh
        tables.num_blocks[growing] = lengths + 1
    tables.token_counts[rows] = counts + 1
    return True
