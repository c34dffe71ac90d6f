"""How far two runs of the same code move apart, and the band a timing is compared within.

An A/A comparison (``bench/report.py --noise RUN RUN ...``, the runs in the order they ran)
reads, for each benchmark and each of its :func:`figures`, the ratio of every run to the one
before it. Per test function, :data:`MARGIN` times the 90th percentile of its benchmarks' moves
of :func:`compared_figure`, and at least :data:`FLOOR`, is the band (``--write-bands`` saves them
to :data:`BANDS_FILE`). The percentile, not the largest move: on a shared VM a few seconds of a
slow host can slow every round of a short benchmark (results.md, "Comparing two runs"), which
``report.py --diff`` handles by timing a flagged benchmark again, not by a wider band.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.reporting.run import ROOT, Run

MARGIN, FLOOR = 3.0, 0.10
"""A band is three times the 90th percentile of the A/A moves, and at least 10%."""

BANDS_FILE = ROOT / "bench" / "noise_bands.json"


def figures(benchmark: dict[str, Any]) -> dict[str, float]:
    """pytest-benchmark's ``min`` and ``median`` of the round times, and, for the attention
    benchmarks, ``paired_ratio`` (paged over contiguous rounds, timed alternately)."""
    found = {name: benchmark["stats"][name] for name in ("min", "median")}
    if benchmark["extra_info"].get("paired_ratio"):
        found["paired_ratio"] = benchmark["extra_info"]["paired_ratio"]
    return found


def compared_figure(*found: dict[str, float]) -> str:
    """What a compare reads from the :func:`figures` of a benchmark's runs: the in-run ratio
    where every one of them has it, else ``min``."""
    return "paired_ratio" if all("paired_ratio" in each for each in found) else "min"


def moves(old: Run, new: Run) -> dict[str, dict[str, float]]:
    """``new / old`` of every figure both runs recorded, by benchmark ``fullname``."""
    before = {b["fullname"]: figures(b) for b in old.benchmarks}
    result = {}
    for benchmark in new.benchmarks:
        name, after = benchmark["fullname"], figures(benchmark)
        if name in before:
            shared = after.keys() & before[name].keys()
            result[name] = {key: after[key] / before[name][key] for key in shared}
    return result


def family(fullname: str) -> str:
    """A benchmark's test function: ``bench/bench_trace.py::test_trace`` for all its cases."""
    return fullname.split("[", 1)[0]


def family_moves(runs: Sequence[Run]) -> dict[tuple[str, str], list[float]]:
    """``|ratio - 1|`` of every benchmark between consecutive runs, by (test function, figure)."""
    found: dict[tuple[str, str], list[float]] = defaultdict(list)
    for old, new in itertools.pairwise(runs):
        for name, ratios in moves(old, new).items():
            for key, ratio in ratios.items():
                found[family(name), key].append(abs(ratio - 1))
    return found


def percentile_90(values: list[float]) -> float:
    return (
        statistics.quantiles(values, n=10, method="inclusive")[-1] if len(values) > 1 else values[0]
    )


def noise_table(runs: Sequence[Run]) -> str:
    """Markdown: per test function and figure, the comparisons (benchmarks times pairs of
    consecutive runs), how many moved by more than 5%, 10% and 15%, the 90th percentile and the
    largest move."""
    lines = [
        "| benchmarks | figure | comparisons | > 5% | > 10% | > 15% | 90th percentile | largest |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for (test, key), values in sorted(family_moves(runs).items()):
        over = [sum(move > limit for move in values) for limit in (0.05, 0.10, 0.15)]
        lines.append(
            f"| `{test.rsplit('::', 1)[-1]}` | {key} | {len(values)} | "
            f"{' | '.join(map(str, over))} | {100 * percentile_90(values):.1f}% | "
            f"{100 * max(values):.1f}% |"
        )
    return "\n".join(lines)


def bands(runs: Sequence[Run]) -> dict[str, float]:
    """Each test function's band for its :func:`compared_figure`."""
    compared = {family(b["fullname"]): compared_figure(figures(b)) for b in runs[-1].benchmarks}
    return {
        test: round(max(FLOOR, MARGIN * percentile_90(values)), 3)
        for (test, key), values in family_moves(runs).items()
        if compared.get(test) == key
    }


def write_bands(runs: Sequence[Run], path: Path = BANDS_FILE) -> None:
    path.write_text(json.dumps(bands(runs), indent=1, sort_keys=True) + "\n")


def load_bands(path: Path = BANDS_FILE) -> dict[str, float]:
    return json.loads(path.read_text())


def beyond_bands(
    old: Run, news: Sequence[Run], band_of: dict[str, float]
) -> list[tuple[str, str, float, float]]:
    """``(benchmark, figure, ratio, band)`` of every benchmark of ``news[0]`` that ``old`` timed
    too and whose figure (``paired_ratio`` where both runs have it, else ``min``), the median
    over the ``news`` runs that timed it, moved beyond its test function's band (:data:`FLOOR`
    without one) or is not a finite number, in that order."""
    before = {b["fullname"]: figures(b) for b in old.benchmarks}
    found: dict[str, list[dict[str, float]]] = defaultdict(list)
    for run in news:
        for benchmark in run.benchmarks:
            found[benchmark["fullname"]].append(figures(benchmark))
    flagged = []
    for benchmark in news[0].benchmarks:
        name = benchmark["fullname"]
        if name not in before:
            continue
        key = compared_figure(before[name], found[name][0])
        ratio = statistics.median(f[key] for f in found[name] if key in f) / before[name][key]
        band = band_of.get(family(name), FLOOR)
        if not abs(ratio - 1) <= band:  # NaN too
            flagged.append((name, key, ratio, band))
    return flagged


def not_compared(old: Run, new: Run) -> list[str]:
    """The benchmarks one run timed and the other did not, ``old``'s first."""
    old_names = [b["fullname"] for b in old.benchmarks]
    new_names = [b["fullname"] for b in new.benchmarks]
    return [n for n in old_names if n not in new_names] + [
        n for n in new_names if n not in old_names
    ]
