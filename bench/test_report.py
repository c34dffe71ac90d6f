"""bench/report.py rewrites only its own section of docs/results.md, renders a run's benchmarks
into tables and figures, and computes every verdict sentence from the numbers it describes: each
verdict test renders a synthetic run twice, with the comparison flipped, and the sentence flips."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.report import main
from bench.reporting.diff import diff
from bench.reporting.differences import differences_section
from bench.reporting.document import BEGIN, END, splice, write
from bench.reporting.figures import PLOTS
from bench.reporting.markdown import reflow
from bench.reporting.run import Run
from bench.reporting.sections import header_section, latency_section
from bench.reporting.serving import serving_section
from bench.reporting.verdicts import ordering, same_order, trend, within
from bench.simulator import ServingConfig, simulate
from bench.stable_attention import merge
from bench.utilization_policies import PAPER_CONTIGUOUS, Paged, lifetime_breakdown
from bench.workloads import CHAPTER_KV_SLOTS, chapter_toy

ORDER = (Paged(16), *PAPER_CONTIGUOUS)


def flat(markdown: str) -> str:
    """``markdown`` with every run of whitespace one space: sentences read across its line
    breaks."""
    return " ".join(markdown.split())


def rendered(section: Callable[..., str], *args: Any) -> str:
    """``section(*args)``, :func:`flat`."""
    return flat(section(*args))


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
    return {"group": group, "extra_info": info, "stats": {"median": 0.001, "iqr": 0.00002}}


def small_run() -> Run:
    """The chapter's toy, lifetime and simulated, and the same simulations relabelled as the
    ShareGPT-like and Alpaca-like runs (only the rendering is under test)."""
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
        for workload in ("chapter", "sharegpt", "alpaca")
        for result in results
    ]
    attention = [
        benchmark(
            {"block_size": b, "batch": 8, "context": 1024, "heads": "8q/2kv", "dtype": "float16",
             "backend": "triton", "device": "cuda", "calls_per_round": 1, "paged_iqr": 0.00002,
             "contiguous_median": 0.001, "contiguous_iqr": 0.00002, "paired_ratio": 1.0},
            group=f"attention-bs{b}",
        )
        for b in (1, 16)
    ]  # fmt: skip
    machine = {"cpu": {"brand_raw": "test", "count": 1}, "device": "cpu"}
    return Run(lifetime + serving + attention, machine, {"id": "abc"}, "today", "x")


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
    ):
        assert heading in text, heading
    assert "Engine decode step" not in text  # bench_engine.py reports its own comparison
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

    assert diff(run(0.98, 1.0), run(0.98, 2.0)) == []  # timings: noise.beyond_bands
    assert diff(run(0.98, 1.0), run(0.97, 1.0)) == [("bench/x.py::t", "utilization", 0.98, 0.97)]


def test_report_main_renders_a_saved_run(tmp_path: Path) -> None:
    """``python bench/report.py --json RUN`` (the command docs/results.md cites) renders it."""
    run = small_run()
    saved = tmp_path / "run.json"
    saved.write_text(
        json.dumps(
            {"benchmarks": run.benchmarks, "machine_info": run.machine, "commit_info": run.commit}
        )
    )
    results, figures = tmp_path / "results.md", tmp_path / "figures"
    main(["--json", str(saved), "--results", str(results), "--figures", str(figures)])
    assert f"`python bench/report.py --json {saved}`" in flat(results.read_text())


# ----------------------------------------------------------------- verdicts follow the numbers

Changes = dict[tuple[str, str], dict[str, Any]]


def changed(run: Run, changes: Changes) -> Run:
    """``run`` with the ``extra_info`` of the unshared serving runs ``(workload, policy)``
    updated by ``changes``."""
    benchmarks = []
    for b in run.benchmarks:
        info = b["extra_info"]
        key = (info.get("workload"), info.get("policy"))
        if info.get("kind") == "serving" and not info["shared"] and key in changes:
            b = {**b, "extra_info": {**info, **changes[key]}}
        benchmarks.append(b)
    return dataclasses.replace(run, benchmarks=benchmarks)


def added(run: Run, *infos: dict[str, Any]) -> Run:
    """``run`` with serving runs added: copies of its chapter paged run, updated by ``infos``."""
    serving = run.of_kind("serving")
    (paged,) = (i for i in serving if (i["workload"], i["policy"]) == ("chapter", "paged-bs16"))
    extra = [benchmark({**paged, **info}) for info in infos]
    return dataclasses.replace(run, benchmarks=[*run.benchmarks, *extra])


def batches(workload: str, paged: float, oracle: float, pow2: float, top: float) -> Changes:
    values = zip(("paged-bs16", "orca-oracle", "orca-pow2", "orca-max"), (paged, oracle, pow2, top),
                 strict=True)  # fmt: skip
    return {(workload, policy): {"mean_batch": value} for policy, value in values}


def test_order_sentence_sorts_the_measured_batches() -> None:
    ordered = rendered(serving_section, changed(small_run(), batches("sharegpt", 40, 20, 10, 5)))
    assert "By mean batch: paged 40.0 > Oracle 20.0 > Pow2 10.0 > Max 5.0;" in ordered
    assert "Max 7.00, the same order." in ordered
    flipped = rendered(serving_section, changed(small_run(), batches("sharegpt", 40, 20, 10, 50)))
    assert "By mean batch: Max 50.0 > paged 40.0 > Oracle 20.0 > Pow2 10.0;" in flipped
    assert "Max 7.00, a different order." in flipped
    tied = rendered(serving_section, small_run())  # the toy: every policy runs its 8 at once
    assert "By mean batch: paged 8.0 = Oracle 8.0 = Pow2 8.0 = Max 8.0;" in tied


SHAREGPT = batches("sharegpt", 40, 20, 10, 5)  # paged 2.0x Oracle's batch, 8.0x Max's


@pytest.mark.parametrize(
    ("changes", "verdict", "flipped_changes", "flipped_verdict"),
    [
        ({}, "lead over Oracle is smaller here:** 2.00x the batch",
         {("sharegpt", "orca-oracle"): {"mean_batch": 10}},
         "lead over Oracle is larger here:** 4.00x the batch"),
        ({}, "Paging's lead over Max is larger here:** 8.00x against 4.3x",
         {("sharegpt", "orca-max"): {"mean_batch": 20}},
         "Paging's lead over Max is smaller here:** 2.00x against 4.3x"),
        ({("sharegpt", "paged-bs16"): {"share_token_states": 0.965}},
         "Paged memory matches the paper's.** Token states fill 96.5% of the budget (paper: 96.3%,"
         " 0.2 points apart)",
         {("sharegpt", "paged-bs16"): {"share_token_states": 0.8}},
         "Paged memory holds fewer token states than the paper's.** Token states fill 80.0%"),
        ({("sharegpt", p): {"share_token_states": 0.9} for p in ("orca-oracle", "orca-pow2",
                                                                 "orca-max")},
         "Our contiguous baselines hold more token states than the paper's** (Oracle 90.0% against"
         " 38.2%",
         {("sharegpt", "orca-oracle"): {"share_token_states": 0.5},
          ("sharegpt", "orca-pow2"): {"share_token_states": 0.1},
          ("sharegpt", "orca-max"): {"share_token_states": 0.1}},
         "Our Oracle baseline holds more token states than the paper's, our Pow2 and Max fewer**"),
        ({("sharegpt", "paged-bs16"): {"preemptions": 3}},
         "Paging preempts; reservations never do.** Paged admission",
         {("sharegpt", "paged-bs16"): {"preemptions": 3},
          ("sharegpt", "orca-max"): {"preemptions": 2}},
         "Preemptions:** paged 3 preemptions by recompute for 8 requests; the contiguous baselines:"
         " Oracle 0, Pow2 0 and Max 2."),
        ({("alpaca", "paged-bs16"): {"peak_batch": 256}},
         "so paging's batch reaches the scheduler's 256-sequence limit",
         {}, "yet paging's batch stays under the scheduler's 256-sequence limit (peak 8)"),
        ({}, "the policies rank differently from the paper's Fig. 13b",
         batches("alpaca", 40, 20, 10, 5), "the policies rank as in the paper's Fig. 13b"),
    ],
)  # fmt: skip
def test_paper_comparison_verdicts_flip_with_the_numbers(
    changes: Changes, verdict: str, flipped_changes: Changes, flipped_verdict: str
) -> None:
    text = rendered(differences_section, changed(small_run(), {**SHAREGPT, **changes}))
    flipped = rendered(differences_section, changed(small_run(), {**SHAREGPT, **flipped_changes}))
    assert verdict in text and verdict not in flipped
    assert flipped_verdict in flipped and flipped_verdict not in text


def test_close_or_far_and_the_split_follow_the_numbers() -> None:
    close = {("sharegpt", "orca-oracle"): {"utilization": 0.603},
             ("sharegpt", "orca-pow2"): {"utilization": 0.459},
             ("sharegpt", "orca-max"): {"utilization": 0.224}}  # fmt: skip
    text = rendered(differences_section, changed(small_run(), close))
    assert "22.4% for Max, close to (within 0.0 points of) our 60.3%, 45.9% and 22.4%" in text
    far = {**close, ("sharegpt", "orca-oracle"): {"utilization": 0.9}}
    far_text = rendered(differences_section, changed(small_run(), far))
    assert "up to 29.7 points from our 90.0%" in far_text
    # The toy's Max reserves 50 for 30: more internal fragmentation than reservation, as the
    # paper's Max; flipped, it splits differently.
    assert "split as in the paper for Oracle and Max (" in text
    assert "Max: more internal fragmentation than reservation)" in text
    flipped = changed(
        small_run(), {("sharegpt", "orca-max"): {"share_internal_fragmentation": 0.01}}
    )
    flipped_text = rendered(differences_section, flipped)
    assert "split as in the paper for Oracle (" in flipped_text
    assert "Max: ours more reservation than internal fragmentation, the paper" in flipped_text


def test_sweep_sentence_follows_the_block_sizes() -> None:
    smaller = {"workload": "sharegpt", "policy": "paged-bs32", "block_size": 32}
    falls = rendered(serving_section, added(small_run(), {**smaller, "mean_batch": 6.0,
                                                          "utilization": 0.5}))  # fmt: skip
    assert ("From block 16 to 32, utilization falls (75.0% to 50.0%) and the mean batch falls (8.0"
            " to 6.0): larger blocks waste more") in falls  # fmt: skip
    assert "Block 16 holds the largest mean batch (8.0)" in falls
    rises = rendered(serving_section, added(small_run(), {**smaller, "mean_batch": 9.0,
                                                          "utilization": 0.8}))  # fmt: skip
    assert "utilization rises (75.0% to 80.0%) and the mean batch rises (8.0 to 9.0)." in rises
    assert "Block 32 holds the largest mean batch (9.0)" in rises
    assert "larger blocks waste more" not in rises


def test_sharing_sentence_follows_the_saving_and_the_batch() -> None:
    def section(saving: float, on_batch: float) -> str:
        on = {
            "workload": "alpaca-n4",
            "shared": True,
            "memory_saving": saving,
            "mean_batch": on_batch,
        }
        off = {"workload": "alpaca-n4", "shared": False, "memory_saving": 0.0, "mean_batch": 8.0}
        return rendered(serving_section, added(small_run(), on, off))

    within = "within the paper's 6.1% to 9.8% for Alpaca."
    raises = "sharing raises the mean batch from 8.0 to 10.0 (1.25x) and saves 7.0% of the blocks"
    assert f"On `alpaca-n4`, {raises}, {within}" in section(0.07, 10.0)
    lowers = "sharing lowers the mean batch from 8.0 to 6.0 (0.75x) and saves 20.0% of the blocks"
    assert f"{lowers}, above the paper's" in section(0.2, 6.0)
    keeps = "sharing keeps the mean batch at 8.0 and saves 1.0% of the blocks"
    assert f"{keeps}, below the paper's" in section(0.01, 8.0)


def slower_contiguous(run: Run, factor: float) -> Run:
    """``run`` with the block-16 contiguous attention's rounds multiplied by ``factor``."""
    benchmarks = [
        {**b, "extra_info": {
            **b["extra_info"],
            "contiguous_median": b["extra_info"]["contiguous_median"] * factor,
            "contiguous_iqr": b["extra_info"]["contiguous_iqr"] * factor,
            "paired_ratio": b["extra_info"]["paired_ratio"] / factor,
        }}
        if b["group"] == "attention-bs16"
        else b
        for b in run.benchmarks
    ]  # fmt: skip
    return dataclasses.replace(run, benchmarks=benchmarks)


def test_noise_and_latency_sentences_follow_the_timings() -> None:
    quiet = rendered(header_section, small_run(), "cmd")
    assert "span up to 1.00x (batch 8, context 1024)." in quiet
    noisy = rendered(header_section, slower_contiguous(small_run(), 2.0), "cmd")
    assert "span up to 2.00x (batch 8, context 1024)." in noisy
    even = rendered(latency_section, small_run())
    assert "Paged / contiguous ranges from 1.00x to 1.00x (median 1.00x)" in even
    assert "paged within 10% of contiguous, holds at 1 of the 1 points (worst 1.00x)" in even
    assert "is at most 2.0% (median 2.0%); 0 of the 4 medians have a spread of 10%" in even
    assert "| 16 | 1.000 (2.0%) | 1.000 (2.0%) | 1.00x |" in even
    faster = rendered(latency_section, slower_contiguous(small_run(), 0.5))
    assert "from 1.00x to 2.00x (median 1.50x). At block sizes of 16 and more" in faster
    assert "holds at 0 of the 1 points (worst 2.00x)" in faster


def test_unstable_cases_are_named_and_timed_again() -> None:
    """A case spreading by 10% or more in either layout is named for another sitting; the
    sitting's entry replaces it, and the report counts the cases timed again."""
    run = small_run()
    names = [f"bench/bench_attention.py::test_decode_attention[{b}-1024-8]" for b in (1, 16)]
    attention = [b for b in run.benchmarks if b["group"].startswith("attention-bs")]
    for name, b in zip(names, attention, strict=True):
        b["fullname"] = name
    assert run.unstable_attention() == [] and run.attention_sittings() == [1, 1]
    attention[1]["extra_info"]["contiguous_iqr"] = 0.00011  # 11% of the contiguous median
    assert run.unstable_attention() == [names[1]]
    assert run.unstable_attention(limit=0.12) == []
    data = {"benchmarks": list(run.benchmarks)}
    for index, other in enumerate(data["benchmarks"]):
        other.setdefault("fullname", f"bench/other.py::test[{index}]")
    again = {**attention[1], "extra_info": {**attention[1]["extra_info"], "contiguous_iqr": 0.0}}
    merge(data, {"benchmarks": [again]}, sitting=2)
    merged = dataclasses.replace(run, benchmarks=data["benchmarks"])
    assert merged.unstable_attention() == [] and merged.attention_sittings() == [1, 2]
    text = rendered(latency_section, merged)
    assert "1 of the 2 cases spread by 10% or more in their first sitting" in text
    assert "up to 2 sittings" in text
    assert "in their first sitting" not in rendered(latency_section, run)


def test_reference_attention_timings_are_not_tabulated() -> None:
    """On the torch reference the paged and contiguous calls share one gather: no table."""
    run = small_run()
    benchmarks = [
        {**b, "extra_info": {**b["extra_info"], "backend": "reference", "device": "cpu"}}
        if b["group"].startswith("attention-bs")
        else b
        for b in run.benchmarks
    ]
    text = rendered(latency_section, dataclasses.replace(run, benchmarks=benchmarks))
    assert "Not tabulated for this run: its backend was the torch reference on `cpu`" in text
    assert "paged / contiguous" not in text


def test_verdict_building_blocks() -> None:
    one = "{:.1f}".format
    assert ordering([("a", 1.0), ("b", 3.0), ("c", 1.0)], one) == "b 3.0 > a 1.0 = c 1.0"
    assert ordering([("a", 1.0), ("c", 1.04)], one) == "c 1.0 = a 1.0"  # the same, printed
    assert same_order([("a", 2.0), ("b", 1.0)], [("a", 5.0), ("b", 4.0)], one)
    assert not same_order([("a", 2.0), ("b", 1.0)], [("a", 4.0), ("b", 5.0)], one)
    assert [trend(v) for v in ([3, 2, 2], [1, 2], [1, 1], [1, 3, 2])] == [
        "falls", "rises", "does not change", "goes up and down"
    ]  # fmt: skip
    assert [within(v, 6.1, 9.8, 1) for v in (6.1, 9.84, 9.86, 6.0)] == [
        "within", "within", "above", "below"
    ]  # fmt: skip
