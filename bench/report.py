"""Turn a pytest-benchmark JSON of ``pytest bench`` into docs/results.md tables and PNG plots.

Run from the repository root::

    python bench/report.py --run                 # run `pytest bench` (a progress bar), then render
    python bench/report.py --json RUN.json       # render a saved run, e.g. one of
                                                 # .benchmarks/*/0001_baseline.json
    python bench/report.py --diff [OLD NEW]      # which deterministic figures, and which
                                                 # timings beyond their bands, moved between two
                                                 # saved runs (default: the two newest); exit 1
                                                 # if a timing got slower beyond its band
    python bench/report.py --noise RUN RUN ...   # A/A: how far runs of the same code move
                                                 # (--write-bands: save bench/noise_bands.json)

``--run`` writes the run to ``.benchmarks/report.json``. What the report reads from a run is in
:mod:`bench.reporting.run`; it rewrites only its own section of ``docs/results.md`` and the PNGs
in ``docs/figures/`` (:mod:`bench.reporting.document`). The pieces are in ``bench/reporting/``;
this file is the command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.reporting.diff import newest_saved_runs, print_diff
from bench.reporting.document import write
from bench.reporting.noise import noise_table, write_bands
from bench.reporting.run import ROOT, Run
from bench.reporting.runner import run_benchmarks

RESULTS = ROOT / "docs" / "results.md"
FIGURES = ROOT / "docs" / "figures"
RUN_JSON = ROOT / ".benchmarks" / "report.json"


def main(argv: Sequence[str] | None = None) -> None:
    """The command line: exactly one of ``--run``, ``--json PATH``, ``--diff [OLD NEW]``,
    ``--noise RUN ...``; ``--results`` and ``--figures`` say where to write (docs/results.md,
    docs/figures/)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="store_true", help="run `pytest bench` first")
    source.add_argument("--json", type=Path, help="a pytest-benchmark JSON to render")
    source.add_argument("--diff", type=Path, nargs="*", metavar="JSON", help="OLD NEW, or none")
    source.add_argument("--noise", type=Path, nargs="+", metavar="JSON", help="runs, in order")
    parser.add_argument("--write-bands", action="store_true", help="with --noise")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args(argv)
    if args.write_bands and args.noise is None:
        parser.error("--write-bands goes with --noise")
    if args.diff is not None:
        if len(args.diff) not in (0, 2):
            parser.error("--diff takes two JSON files, or none for the two newest saved runs")
        raise SystemExit(print_diff(args.diff or newest_saved_runs()))
    if args.noise is not None:
        if len(args.noise) < 2:
            parser.error("--noise takes two runs or more")
        runs = [Run.load(path) for path in args.noise]
        print(noise_table(runs))
        if args.write_bands:
            write_bands(runs)
        return
    if args.run:
        run_benchmarks(RUN_JSON)
        path, command = RUN_JSON, "python bench/report.py --run"
    else:
        path = args.json.resolve()
        command = f"python bench/report.py --json {args.json}"
    write(Run.load(path), command, args.results, args.figures)
    print(f"wrote {args.results} and {args.figures}/")


if __name__ == "__main__":
    main()
