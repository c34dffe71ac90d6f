"""Time ``bench/bench_attention.py`` until every median is stable, or the sittings run out.

Run from the repository root, at real-time priority and pinned to one core on a shared machine
(``docs/results.md`` says why)::

    chrt -f 10 taskset -c 1 python -m bench.stable_attention --json .benchmarks/attention.json

The first sitting times every case (all contexts: ``-m long`` is not applied). A case whose
paged or contiguous rounds spread by ``SPREAD_LIMIT`` (10%) or more of their median
(``bench.reporting.run.case_spread``) is timed again, in a new process, up to ``--sittings``
sittings in all; each new sitting's result replaces the case's entry in the JSON, whose
``extra_info["sittings"]`` counts the sittings it took. A case's ratio and medians always come
from one sitting, in which its paged and contiguous rounds alternated. The report says how many
cases took more than one sitting and how many stay unstable. On this project's 2-core VM the
spread comes from the hypervisor, and the cases it hits differ from sitting to sitting: a case
that spreads in one sitting is usually steady in the next.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench.reporting.run import ROOT, SPREAD_LIMIT, Run

BENCH = "bench/bench_attention.py"


def sit(cases: Sequence[str], json_path: Path) -> None:
    """One sitting: time ``cases`` (pytest node ids; empty: the whole file) in a new process,
    writing their pytest-benchmark JSON to ``json_path``. ``SystemExit`` if a case fails."""
    command = [
        sys.executable, "-m", "pytest", "-q", "-o", "addopts=", "-p", "no:cacheprovider",
        f"--benchmark-json={json_path}", *(cases or [BENCH]),
    ]  # fmt: skip
    done = subprocess.run(command, cwd=ROOT, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{BENCH} failed ({done.returncode})")


def merge(run: dict, again: dict, sitting: int) -> None:
    """Replace each case of ``run`` (a pytest-benchmark JSON, as loaded) that ``again`` timed by
    ``again``'s entry, marked as taken in sitting number ``sitting``."""
    fresh = {b["fullname"]: b for b in again["benchmarks"]}
    for index, old in enumerate(run["benchmarks"]):
        new = fresh.get(old["fullname"])
        if new is not None:
            new["extra_info"]["sittings"] = sitting
            run["benchmarks"][index] = new


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: ``--json`` (where the merged run goes) and ``--sittings``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="the merged benchmark JSON")
    parser.add_argument("--sittings", type=int, default=3, help="at most this many per case")
    args = parser.parse_args(argv)
    if args.sittings < 1:
        parser.error("--sittings must be at least 1")
    path = args.json.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    sit([], path)
    for sitting in range(2, args.sittings + 1):
        unstable = Run.load(path).unstable_attention()
        print(f"sitting {sitting - 1}: {len(unstable)} case(s) at {SPREAD_LIMIT:.0%} or more")
        if not unstable:
            break
        with tempfile.TemporaryDirectory() as scratch:
            again = Path(scratch) / "again.json"
            sit(unstable, again)
            run = json.loads(path.read_text())
            merge(run, json.loads(again.read_text()), sitting)
        path.write_text(json.dumps(run, indent=4))
    left = Run.load(path).unstable_attention()
    print(f"{len(left)} case(s) still at {SPREAD_LIMIT:.0%} or more: {left}")


if __name__ == "__main__":
    main()
