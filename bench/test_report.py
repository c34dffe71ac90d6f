"""bench/report.py rewrites only its own section of docs/results.md, and renders a run's
benchmarks into tables and figures."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.report import BEGIN, END, PLOTS, Run, diff, reflow, splice, write
from bench.simulator import ServingConfig, simulate
from bench.utilization_policies import PAPER_CONTIGUOUS, Paged, lifetime_breakdown
from bench.workloads import CHAPTER_KV_SLOTS, chapter_toy

ORDER = (Paged(16), *PAPER_CONTIGUOUS)


def test_splice_replaces_only_the_generated_section() -> None:
    document = f"# results\n\nmine\n\n{BEGIN}\nold\n{END}\n\n## the lead's section\n"
    section = f"{BEGIN}\nnew\n{END}\n"
    spliced = splice(document, section)
    assert spliced == f"# results\n\nmine\n\n{BEGIN}\nnew\n{END}\n\n## the lead's section\n"
    assert splice(spliced, section) == spliced
    assert splice("# results\n\nmine\n", section) == f"# results\n\nmine\n\n{section}"


def test_reflow_wraps_prose_and_keeps_tables() -> None:
    prose = "word " * 60
    markdown = f"{prose}\n\n* **item** {prose}\n* second\n\n| a | b |\n|---|---|\n| {prose} | x |"
    lines = reflow(markdown).splitlines()
    assert max(len(line) for line in lines if not line.startswith("|")) <= 100
    assert sum(line.startswith("* ") for line in lines) == 2
    assert f"| {prose} | x |" in lines


def serving_info(workload: str, result: Any) -> dict[str, Any]:
    summary = result.summary()
    return {"kind": "serving", **summary, "workload": workload, "series": result.downsampled(8)}


def benchmark(info: dict[str, Any], group: str = "g") -> dict[str, Any]:
    return {"group": group, "extra_info": info, "stats": {"median": 0.001}}


def small_run() -> Run:
    """The chapter's toy, lifetime and simulated, and the same simulations relabelled as the
    ShareGPT-like runs (only the rendering is under test)."""
    toy = chapter_toy()
    lifetime = [
        benchmark({"kind": "lifetime", "policy": p.name,
                   "utilization": {"chapter": lifetime_breakdown(toy, p).utilization}})
        for p in (*(Paged(b) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)), *PAPER_CONTIGUOUS)
    ]  # fmt: skip
    config = ServingConfig(budget_slots=CHAPTER_KV_SLOTS)
    results = [simulate(toy, policy, config) for policy in ORDER]
    serving = [
        benchmark(serving_info(workload, result))
        for workload in ("chapter", "sharegpt")
        for result in results
    ]
    engine = [
        benchmark({"kind": "engine", "block_size": b, "batch": n, "context": 64, "model": "m"})
        for b in (1, 16)
        for n in (1, 32)
    ]
    attention = [
        benchmark(
            {"layout": layout, "block_size": b, "batch": 8, "context": 1024, "heads": "8q/2kv",
             "dtype": "float32", "backend": "reference", "device": "cpu"},
            group=f"attention-bs{b}",
        )
        for layout in ("paged", "contiguous")
        for b in (1, 16)
    ]  # fmt: skip
    machine = {"cpu": {"brand_raw": "test", "count": 1}, "device": "cpu"}
    return Run(lifetime + serving + engine + attention, machine, {"id": "abc"}, "today", "x")


def test_write_renders_every_section_and_figure(tmp_path: Path) -> None:
    results, figures = tmp_path / "results.md", tmp_path / "figures"
    results.write_text("# pagedkv results\n\nThe lead's text.\n")
    write(small_run(), "python bench/report.py --json x", results, figures)
    text = results.read_text()
    assert text.startswith("# pagedkv results\n\nThe lead's text.\n\n" + BEGIN)
    for heading in (
        "### Workloads",
        "### Utilization over each request's life",
        "#### ShareGPT-like: the paper's Fig. 2 and Fig. 13a",
        "#### The chapter's toy, 400 slots",
        "### Where our numbers differ from the paper's, and why",
        "#### Decode attention, paged against contiguous",
        "#### Engine decode step",
    ):
        assert heading in text, heading
    assert "| `chapter` | 40.0% | 47.6% | 66.7% | 100.0% |" in text
    assert len(list(figures.glob("*.png"))) == len(PLOTS)
    for link in text.split("](figures/")[1:]:
        assert (figures / link.split(")")[0]).exists()


def test_write_creates_the_file_and_leaves_out_what_the_run_lacks(tmp_path: Path) -> None:
    run = Run([], {}, {}, "today", "x")
    results = tmp_path / "results.md"
    write(run, "cmd", results, tmp_path / "figures")
    text = results.read_text()
    assert text.startswith("# pagedkv results") and "### Workloads" in text
    assert "### Serving" not in text and "](figures/" not in text


def test_diff_lists_the_deterministic_figures_that_moved() -> None:
    def run(utilization: float, median: float) -> Run:
        info = {"kind": "lifetime", "utilization": utilization, "policy": "paged-bs16"}
        bench = {"fullname": "bench/x.py::t", "extra_info": info, "stats": {"median": median}}
        return Run([bench], {}, {}, "today", "x")

    assert diff(run(0.98, 1.0), run(0.98, 2.0)) == []  # timings are pytest-benchmark's job
    assert diff(run(0.98, 1.0), run(0.97, 1.0)) == [("bench/x.py::t", "utilization", 0.98, 0.97)]
