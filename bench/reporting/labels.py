"""The allocation policies the report compares, and how it names them.

Policy names are those of ``bench.utilization_policies``: ``paged-bs{B}`` and ``orca-{kind}``.
"""

from __future__ import annotations

from bench.utilization_policies import CONTIGUOUS_LABELS

CONTIGUOUS = ("orca-max", "orca-pow2", "orca-oracle")
"""The paper's three Orca baselines, in the lifetime table's column order."""

ORDER = ("paged-bs16", "orca-oracle", "orca-pow2", "orca-max")
"""The serving comparison's policies, in the order the paper's Fig. 13 draws them."""

PAGED = ORDER[0]
"""The paged policy the serving comparison puts against the Orca baselines."""


def paged_block_size(policy: str) -> int | None:
    """The block size of a ``paged-bs{B}`` policy; None for any other policy."""
    if policy.startswith("paged-bs"):
        return int(policy.removeprefix("paged-bs"))
    return None


def label(policy: str) -> str:
    """The name in tables and legends: ``paged, block 16``, ``Orca (Max)``."""
    block_size = paged_block_size(policy)
    if block_size is not None:
        return f"paged, block {block_size}"
    return CONTIGUOUS_LABELS[policy.removeprefix("orca-")]


def short_label(policy: str) -> str:
    """The name in running text: ``paged`` (whatever its block size; the text around it says
    which), ``Max``, ``Pow2``, ``Oracle``."""
    if paged_block_size(policy) is not None:
        return "paged"
    return policy.removeprefix("orca-").capitalize()
