"""What moved between two saved runs (``bench/report.py --diff``): the deterministic figures
of :data:`DIFF_KEYS` (what a change to the memory management moves), and the timings that moved
beyond the band two runs of the same code stay within (:mod:`bench.reporting.noise`). A timing
beyond its band is timed :data:`RETIMES` more times in this tree (the new code) and stays
flagged only if the median of the new run and the re-timings is still beyond it: a slow stretch
of the machine during one benchmark is not a regression.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.reporting.noise import beyond_bands, load_bands, not_compared
from bench.reporting.run import ROOT, Run

RETIMES = 2
RETIME_SECONDS = 900

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


def plain_environment() -> dict[str, str]:
    """This process's environment without pytest-xdist's worker variables: with them (``diff``
    run inside an xdist worker, as the long test does) pytest-benchmark in the child believes it
    is a worker too and saves nothing."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}


def retimed(names: Sequence[str], times: int = RETIMES) -> list[Run]:
    """The benchmarks ``names`` (their pytest node ids) timed ``times`` more times, each time in
    a fresh ``pytest`` process from the repository root; ``RuntimeError`` with the end of its
    output if one fails."""
    runs = []
    with tempfile.TemporaryDirectory() as folder:
        for attempt in range(times):
            path = Path(folder) / f"retimed-{attempt}.json"
            options = ["-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--benchmark-json={path}"]
            command = [sys.executable, "-m", "pytest", *names, *options]
            done = subprocess.run(
                command, cwd=ROOT, env=plain_environment(), capture_output=True, text=True,
                timeout=RETIME_SECONDS,
            )  # fmt: skip
            if done.returncode != 0 or not path.exists():
                raise RuntimeError(f"timing {names} again failed:\n{done.stdout[-2000:]}")
            runs.append(Run.load(path))
    return runs


def this_tree_ran(run: Run) -> bool:
    """Whether ``run`` ran the commit checked out here (a re-time times this tree)."""
    head = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    return bool(head) and run.commit.get("id") == head


def timings_moved(old: Run, new: Run, retime: bool) -> list[tuple[str, str, float, float]]:
    """:func:`~bench.reporting.noise.beyond_bands`; with ``retime`` (``new`` ran this tree's
    commit: :func:`this_tree_ran`) the slower ones are timed again, else they stand as
    measured."""
    bands = load_bands()
    flagged = beyond_bands(old, [new], bands)
    slower = [name for name, _, ratio, _ in flagged if not ratio <= 1]
    if not slower or not retime:
        return flagged
    again = beyond_bands(old, [new, *retimed(slower)], bands)
    return [row for row in again if row[0] in slower] + [
        row for row in flagged if row[0] not in slower
    ]


def print_diff(paths: Sequence[Path]) -> int:
    """Print :func:`diff`, the benchmarks only one run timed, and :func:`timings_moved` between
    the runs at ``paths`` (old, new), one a line; 1 if a timing got slower beyond its band (or
    could not be timed again), else 0."""
    old, new = (Run.load(path) for path in paths)
    changes = diff(old, new)
    print(f"{old.source} -> {new.source}: {len(changes)} deterministic figures moved")
    for fullname, key, before, after in changes:
        print(f"  {fullname.rsplit('/', 1)[-1]}  {key}: {before} -> {after}")
    missing = not_compared(old, new)
    print(f"{len(missing)} benchmarks timed by one run only (not compared)")
    for fullname in missing:
        print(f"  {fullname.rsplit('/', 1)[-1]}")
    retime = this_tree_ran(new)
    try:
        moved = timings_moved(old, new, retime)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        print(f"a timing beyond its band could not be timed again: {error}")
        return 1
    if not retime:
        print(
            "the new run is not of this tree's commit: timings beyond their bands stand as measured"
        )
    for slower, what in (
        (True, f"slower: flagged (each timed {RETIMES} more times, the median of {RETIMES + 1})"),
        (False, "faster: a speed-up, or a slow old run"),
    ):
        rows = [row for row in moved if (not row[2] <= 1) == slower]
        print(f"{len(rows)} timings {what} beyond their bands")
        for fullname, key, ratio, band in rows:
            print(f"  {fullname.rsplit('/', 1)[-1]}  {key} {ratio:.2f}x (band {band:.0%})")
    return int(any(not ratio <= 1 for *_, ratio, _ in moved))
