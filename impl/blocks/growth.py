"""Who grows when a batch cannot grow at once: the spec's per-sequence order, decided up front.

``BlockTableStore.grow`` is ``append_slot`` called once per sequence, in batch order, with
``OutOfBlocksError`` caught. When the pool holds enough blocks for every sequence and no shared
block is written twice, all of them grow and the order cannot matter. Otherwise the order
decides: :func:`plan_in_order` replays the spec's calls on counts alone (no block moves) and
says which sequences grow and which of those copy their shared last block on write.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray


def plan_in_order(
    growth: NDArray[np.int64],
    writes_last: NDArray[np.bool_],
    last: NDArray[np.int32],
    last_refs: NDArray[np.int32],
    free: int,
) -> tuple[NDArray[np.bool_], NDArray[np.bool_]]:
    """Decide, sequence by sequence as the spec would, who grows and who copies on write.

    Sequence ``i`` needs ``growth[i]`` new blocks; if ``writes_last[i]`` it writes into its last
    block ``last[i]``, whose reference count is ``last_refs[i]``. ``free`` blocks are free.
    Rules: a sequence writing a block that other owners still hold copies it first (one more
    fresh block) and drops its own hold, so once one owner is left that owner writes in place;
    a sequence grows only if all its blocks are free then, and otherwise changes nothing.
    Returns ``(grown, shared)``: which sequences grow, and which of them copy on write.
    """
    owners_left: dict[int, int] = {}  # a shared block's owners, as the calls so far left them
    grown = np.zeros(growth.size, dtype=np.bool_)
    shared = np.zeros(growth.size, dtype=np.bool_)
    for i, (blocks, writes, block, refs) in enumerate(
        zip(growth.tolist(), writes_last.tolist(), last.tolist(), last_refs.tolist(), strict=True)
    ):
        owners = owners_left.get(block, refs) if writes else 1
        need = blocks + (owners > 1)
        if need <= free:
            free -= need
            grown[i] = True
            if owners > 1:
                shared[i] = True
                owners_left[block] = owners - 1
    return grown, shared


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


def has_repeats(values: NDArray[np.integer]) -> bool:
    """Whether some value occurs twice."""
    if values.size < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())
