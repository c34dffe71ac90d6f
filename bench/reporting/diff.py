"""The deterministic figures that moved between two saved runs (``bench/report.py --diff``).

pytest-benchmark's own comparison covers only timings; the ``extra_info`` figures of
:data:`DIFF_KEYS` are what a change to the memory management moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.reporting.run import ROOT, Run

DIFF_KEYS = (
    "utilization", "share_token_states", "share_reservation", "share_internal_fragmentation",
    "mean_batch", "peak_batch", "preemptions", "tokens_per_step", "tokens_per_slot",
    "memory_saving", "steps",
)  # fmt: skip


def diff(old: Run, new: Run) -> list[tuple[str, str, Any, Any]]:
    """``(benchmark, figure, old, new)`` for every ``extra_info`` figure of :data:`DIFF_KEYS`
    that differs between two runs of the same benchmark (by ``fullname``), in ``new``'s order."""
    before = {b["fullname"]: b["extra_info"] for b in old.benchmarks}
    return [
        (b["fullname"], key, before[b["fullname"]][key], b["extra_info"].get(key))
        for b in new.benchmarks
        if b["fullname"] in before
        for key in DIFF_KEYS
        if key in before[b["fullname"]] and before[b["fullname"]][key] != b["extra_info"].get(key)
    ]


def newest_saved_runs(root: Path = ROOT) -> list[Path]:
    """The two most recent runs saved under ``root/.benchmarks`` by ``--benchmark-save`` or
    ``--benchmark-autosave``, oldest first; exits with a message if there are fewer."""
    saved = sorted(root.glob(".benchmarks/*/*.json"), key=lambda path: path.stat().st_mtime)
    if len(saved) < 2:
        raise SystemExit("--diff needs two saved runs in .benchmarks/ (--benchmark-save=NAME)")
    return saved[-2:]


def print_diff(paths: Sequence[Path]) -> None:
    """Print :func:`diff` of the runs at ``paths`` (old, new), one moved figure a line."""
    old, new = (Run.load(path) for path in paths)
    changes = diff(old, new)
    print(f"{old.source} -> {new.source}: {len(changes)} deterministic figures moved")
    for fullname, key, before, after in changes:
        print(f"  {fullname.rsplit('/', 1)[-1]}  {key}: {before} -> {after}")
