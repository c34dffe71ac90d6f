"""A pytest-benchmark run of ``pytest bench``, and the figures the report reads from it, by key.

The report reads the ``extra_info`` of ``bench_utilization.py`` (``kind="lifetime"``) and
``bench_serving.py`` (``kind="serving"``), and the median timings and their spread of
``bench_attention.py`` (groups ``attention-bs{B}``).
Every accessor returns an empty result when the run lacks those benchmarks.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.reporting.labels import ORDER, PAGED, paged_block_size

ROOT = Path(__file__).resolve().parents[2]
"""The repository root: a run's ``source`` is given relative to it where it can be."""

Info = dict[str, Any]
"""One benchmark's ``extra_info``, with its median time in seconds added as ``median``."""

ServingKey = tuple[str, str, bool]
"""``(workload, policy, shared)`` of a ``bench_serving.py`` run."""

AttentionKey = tuple[str, int, int]
"""``(layout, batch, context)`` of a ``bench_attention.py`` case."""


SPREAD_LIMIT = 0.10
"""A timed median is stable when the interquartile range of its rounds is under this fraction of
it (issue 24's bar for the decode-latency table)."""


def case_spread(benchmark: dict[str, Any]) -> dict[str, float]:
    """Interquartile range / median of a ``bench_attention.py`` case's rounds, by layout: the
    paged rounds' (pytest-benchmark's) and the contiguous rounds' interleaved with them
    (``extra_info``)."""
    info = benchmark["extra_info"]
    paged = benchmark["stats"]["median"] / info["calls_per_round"]
    return {
        "paged": info["paged_iqr"] / paged,
        "contiguous": info["contiguous_iqr"] / info["contiguous_median"],
    }


@dataclass(frozen=True)
class Serving:
    """The ``bench_serving.py`` runs of a :class:`Run`, by :data:`ServingKey`."""

    rows: dict[ServingKey, Info]

    def __bool__(self) -> bool:
        return bool(self.rows)

    def get(self, workload: str, policy: str, shared: bool = False) -> Info | None:
        """The run of ``policy`` on ``workload``, or None if the run lacks it."""
        return self.rows.get((workload, policy, shared))

    def compared(self, workload: str) -> list[tuple[str, Info]]:
        """``(policy, info)`` of the :data:`~bench.reporting.labels.ORDER` policies that ran on
        ``workload`` without sharing, in that order."""
        found = ((policy, self.get(workload, policy)) for policy in ORDER)
        return [(policy, info) for policy, info in found if info is not None]

    def compares_all(self, workload: str) -> bool:
        """Whether every :data:`~bench.reporting.labels.ORDER` policy ran on ``workload``
        without sharing (the paper's comparison)."""
        return len(self.compared(workload)) == len(ORDER)

    def sweep(self, workload: str = "sharegpt") -> list[Info]:
        """The paged runs of ``workload`` without sharing, by increasing block size."""
        runs = [
            info
            for (w, policy, shared), info in self.rows.items()
            if w == workload and not shared and paged_block_size(policy) is not None
        ]
        return sorted(runs, key=lambda info: info["block_size"])

    def sharing(self) -> dict[str, tuple[Info, Info]]:
        """``workload: (on, off)``: the :data:`~bench.reporting.labels.PAGED` runs with and
        without sharing, for every workload that has both, in the run's order."""
        pairs: dict[str, tuple[Info, Info]] = {}
        for workload, _, _ in self.rows:
            on, off = self.get(workload, PAGED, True), self.get(workload, PAGED, False)
            if on is not None and off is not None:
                pairs[workload] = (on, off)
        return pairs


@dataclass(frozen=True)
class Run:
    """A pytest-benchmark JSON: its benchmarks, the machine and commit it ran on, the date
    (``YYYY-MM-DD``) and where it was read from."""

    benchmarks: list[dict[str, Any]]
    machine: dict[str, Any]
    commit: dict[str, Any]
    when: str
    source: str

    @classmethod
    def load(cls, path: Path) -> Run:
        """The run saved at ``path`` (``--benchmark-json`` or ``--benchmark-save``)."""
        data = json.loads(path.read_text())
        return cls(
            data["benchmarks"],
            data.get("machine_info", {}),
            data.get("commit_info", {}),
            data.get("datetime", "")[:10],
            str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        )

    def of_kind(self, kind: str) -> list[Info]:
        """``extra_info`` of every benchmark of that kind, with its median time added."""
        return [
            {**b["extra_info"], "median": b["stats"]["median"]}
            for b in self.benchmarks
            if b["extra_info"].get("kind") == kind
        ]

    def lifetime(self) -> dict[tuple[str, str], float]:
        """Lifetime utilization by ``(workload, policy)``, from ``bench_utilization.py``."""
        return {
            (workload, info["policy"]): utilization
            for info in self.of_kind("lifetime")
            for workload, utilization in info["utilization"].items()
        }

    def serving(self) -> Serving:
        """The ``bench_serving.py`` runs."""
        return Serving(
            {(i["workload"], i["policy"], i["shared"]): i for i in self.of_kind("serving")}
        )

    def _attention_benchmarks(self) -> list[dict[str, Any]]:
        return [b for b in self.benchmarks if (b["group"] or "").startswith("attention-bs")]

    def attention(self) -> dict[AttentionKey, dict[int, float]]:
        """Median seconds per call of ``bench_attention.py`` by ``(layout, batch, context)``, then
        block size: the paged rounds' (pytest-benchmark's median over the calls of a round) and
        the contiguous rounds' interleaved with them (``extra_info``)."""
        medians: dict[AttentionKey, dict[int, float]] = defaultdict(dict)
        for b in self._attention_benchmarks():
            info = b["extra_info"]
            n, context, size = info["batch"], info["context"], info["block_size"]
            medians["paged", n, context][size] = b["stats"]["median"] / info["calls_per_round"]
            medians["contiguous", n, context][size] = info["contiguous_median"]
        return dict(medians)

    def attention_spread(self) -> dict[AttentionKey, dict[int, float]]:
        """Interquartile range / median of the rounds behind each :meth:`attention` median."""
        spreads: dict[AttentionKey, dict[int, float]] = defaultdict(dict)
        for b in self._attention_benchmarks():
            info = b["extra_info"]
            n, context, size = info["batch"], info["context"], info["block_size"]
            spread = case_spread(b)
            spreads["paged", n, context][size] = spread["paged"]
            spreads["contiguous", n, context][size] = spread["contiguous"]
        return dict(spreads)

    def unstable_attention(self, limit: float = SPREAD_LIMIT) -> list[str]:
        """The ``fullname`` of each ``bench_attention.py`` case with a spread of ``limit`` or
        more in either layout, in the run's order."""
        return [
            b["fullname"]
            for b in self._attention_benchmarks()
            if max(case_spread(b).values()) >= limit
        ]

    def attention_sittings(self) -> list[int]:
        """How many sittings each ``bench_attention.py`` case took (``extra_info["sittings"]``,
        set by ``bench/stable_attention.py``; 1 for a case measured once)."""
        return [b["extra_info"].get("sittings", 1) for b in self._attention_benchmarks()]

    def attention_ratio(self) -> dict[tuple[int, int], dict[int, float]]:
        """Paged / contiguous by ``(context, batch)``, then block size: the median over rounds of
        each paged round's time over the contiguous round's just before it."""
        ratios: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
        for b in self._attention_benchmarks():
            info = b["extra_info"]
            ratios[info["context"], info["batch"]][info["block_size"]] = info["paired_ratio"]
        return dict(ratios)

    def attention_info(self) -> dict[str, Any]:
        """The ``extra_info`` of the first ``bench_attention.py`` benchmark (the shapes, dtype,
        backend and device all of them share); empty if there is none."""
        return next((b["extra_info"] for b in self._attention_benchmarks()), {})

    def attention_batches(self) -> list[tuple[int, int]]:
        """The ``(context, batch)`` pairs at which both the paged and the contiguous attention
        were timed."""
        attention = self.attention()
        return sorted(
            (context, n)
            for layout, n, context in attention
            if layout == "paged" and ("contiguous", n, context) in attention
        )

    def contiguous_spread(self) -> dict[tuple[int, int], tuple[float, float]]:
        """``(context, batch): (fastest, slowest)`` median seconds of the contiguous attention
        over the block sizes, for each of :meth:`attention_batches`. The contiguous call does not
        depend on the block size, so the spread is the machine's noise between benchmarks of the
        same work."""
        attention = self.attention()
        return {
            (context, n): (
                min(attention["contiguous", n, context].values()),
                max(attention["contiguous", n, context].values()),
            )
            for context, n in self.attention_batches()
        }
