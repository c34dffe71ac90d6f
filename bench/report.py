"""Turn a pytest-benchmark JSON of ``pytest bench`` into docs/results.md tables and PNG plots.

Run from the repository root::

    python bench/report.py --run                 # run `pytest bench` (a progress bar), then render
    python bench/report.py --json RUN.json       # render a saved run, e.g. one of
                                                 # .benchmarks/*/0001_baseline.json
    python bench/report.py --diff [OLD NEW]      # which deterministic figures moved between
                                                 # two saved runs (default: the two newest)

``--run`` writes the run to ``.benchmarks/report.json``. The report reads the ``extra_info`` of
``bench_utilization.py`` (``kind="lifetime"``), ``bench_serving.py`` (``kind="serving"``) and
``bench_engine.py`` (``kind="engine"``), and the timings of ``bench_attention.py`` and
``bench_engine.py``. It rewrites only its own section of ``docs/results.md``, between
:data:`BEGIN` and :data:`END` (appended if absent; the file is created if missing), and the PNGs
in ``docs/figures/``. Sections whose benchmarks are not in the run are left out.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script: make the repository's packages importable
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.paper import (  # noqa: E402
    FIG2_MEMORY_SHARES,
    FIG11_MEAN_LENGTHS,
    FIG13_MEAN_BATCH,
    FIG13_REQUEST_RATES,
    FIG13A_BATCH_RATIOS,
    FIG15_PARALLEL_SAVING,
    PAPER,
)
from bench.simulator import ServingConfig  # noqa: E402
from bench.utilization_policies import CONTIGUOUS_LABELS, PAPER_BLOCK_SIZES  # noqa: E402
from bench.workloads import CHAPTER_KV_SLOTS, WORKLOADS  # noqa: E402

BEGIN = "<!-- BEGIN generated: bench/report.py -->"
END = "<!-- END generated: bench/report.py -->"
RESULTS = ROOT / "docs" / "results.md"
FIGURES = ROOT / "docs" / "figures"
RUN_JSON = ROOT / ".benchmarks" / "report.json"
CONTIGUOUS = ("orca-max", "orca-pow2", "orca-oracle")
ORDER = ("paged-bs16", "orca-oracle", "orca-pow2", "orca-max")
SHARES = ("token_states", "reservation", "internal_fragmentation", "unallocated")
COLORS = {
    "token_states": "#2e8b57",
    "reservation": "#e0a030",
    "internal_fragmentation": "#c0504d",
    "unallocated": "#a0a0a0",
}
WORKLOAD_COLUMNS = ["workload", "requests", "sequences", "mean prompt", "mean output",
                    "longest p + o", "distribution"]  # fmt: skip
PAPER_COLUMNS = ["policy", "token states", "reservation", "internal frag.",
                 "external frag. & others"]  # fmt: skip
HEADER = """# pagedkv results

Every figure here was produced by the command shown next to it.
"""


# ----------------------------------------------------------------- the run


@dataclass(frozen=True)
class Run:
    """A pytest-benchmark JSON: its benchmarks, the machine and commit it ran on."""

    benchmarks: list[dict[str, Any]]
    machine: dict[str, Any]
    commit: dict[str, Any]
    when: str
    source: str

    @classmethod
    def load(cls, path: Path) -> Run:
        data = json.loads(path.read_text())
        return cls(
            data["benchmarks"],
            data.get("machine_info", {}),
            data.get("commit_info", {}),
            data.get("datetime", "")[:10],
            str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path),
        )

    def lifetime(self) -> dict[tuple[str, str], float]:
        """Lifetime utilization by ``(workload, policy)``, from ``bench_utilization.py``."""
        return {
            (workload, info["policy"]): utilization
            for info in self.of_kind("lifetime")
            for workload, utilization in info["utilization"].items()
        }

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        """``extra_info`` of every benchmark of that kind, with its median time added."""
        return [
            {**b["extra_info"], "median": b["stats"]["median"]}
            for b in self.benchmarks
            if b["extra_info"].get("kind") == kind
        ]

    def attention(self) -> dict[tuple[str, int], dict[int, float]]:
        """Median seconds of ``bench_attention.py`` by (layout, batch), then block size."""
        medians: dict[tuple[str, int], dict[int, float]] = defaultdict(dict)
        for b in self.benchmarks:
            if (b["group"] or "").startswith("attention-bs"):
                info = b["extra_info"]
                medians[info["layout"], info["batch"]][info["block_size"]] = b["stats"]["median"]
        return dict(medians)


class _Progress:
    """A pytest plugin driving a tqdm bar: one tick per test; failures are printed."""

    def __init__(self, bar: tqdm) -> None:
        self.bar = bar
        self.failed: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.bar.reset(total=len(session.items))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.failed:
            self.failed.append(report.nodeid)
            tqdm.write(f"FAILED {report.nodeid}\n{report.longreprtext[-2000:]}")
        if report.when == "teardown":
            self.bar.set_postfix_str(report.nodeid.rsplit("::", 1)[-1][:48], refresh=False)
            self.bar.update(1)


def run_benchmarks(json_path: Path) -> None:
    """``pytest bench --benchmark-json=json_path`` in this process, with a progress bar."""
    json_path.parent.mkdir(parents=True, exist_ok=True)
    # The bar replaces pytest's terminal output (and addopts' terminal options with it).
    quiet = ["-p", "no:terminal", "-o", "addopts=", "-p", "no:cacheprovider"]
    args = ["bench", *quiet, f"--benchmark-json={json_path}"]
    with tqdm(desc="pytest bench", unit="test") as bar:
        progress = _Progress(bar)
        code = pytest.main(args, plugins=[progress])
    if code != 0:
        raise SystemExit(f"pytest bench failed ({code}): {progress.failed}")


# ----------------------------------------------------------------- markdown


def reflow(markdown: str, width: int = 100) -> str:
    """Re-wrap the paragraphs and bullet items of ``markdown`` to ``width`` columns (the text
    is written with numbers substituted in, so its line lengths vary); tables, headings,
    images and comments are kept as they are."""

    def fill(text: str, indent: str = "") -> str:
        return textwrap.fill(
            text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )

    blocks = []
    for block in markdown.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines or lines[0].startswith(("|", "#", "![", "<!--")):
            blocks.append(block.strip("\n"))
        elif lines[0].startswith("* "):
            items: list[list[str]] = []
            for line in lines:
                if line.startswith("* "):
                    items.append([])
                items[-1].append(line.strip())
            blocks.append("\n".join(fill(" ".join(item), "  ") for item in items))
        else:
            blocks.append(fill(" ".join(line.strip() for line in lines)))
    return "\n\n".join(blocks) + "\n"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def label(policy: str) -> str:
    if policy.startswith("paged-bs"):
        return f"paged, block {policy.removeprefix('paged-bs')}"
    return CONTIGUOUS_LABELS[policy.removeprefix("orca-")]


def index(rows: list[dict[str, Any]], *keys: str) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {tuple(row[key] for key in keys): row for row in rows}


def header_section(run: Run, command: str) -> str:
    cpu = run.machine.get("cpu", {})
    machine = (
        f"{cpu.get('brand_raw', '?')} x{cpu.get('count', '?')}, {run.machine.get('device', '?')}"
        f"; Python {run.machine.get('python_version', '?')}, torch {run.machine.get('torch', '?')}"
    )
    commit = run.commit.get("id", "?")[:10]
    if run.commit.get("dirty"):
        commit += " plus uncommitted changes"
    return f"""## Utilization, serving simulation and decode latency

Generated by `bench/report.py` from a `pytest bench` run: `{command}` ({run.when}, commit
{commit}; {machine}). The benchmark JSON was `{run.source}`. Regenerate this section and
`docs/figures/` with the same command; the rest of this file is left as it is.

Workflow for a change: `pytest bench --benchmark-save=baseline` before it, then `pytest bench
--benchmark-compare --benchmark-compare-fail=median:15% --benchmark-save=change` after it. The
second run fails if any benchmark's median is 15% slower than the baseline's, and `python
bench/report.py --diff` then lists the utilization, batch and preemption figures that moved
between the two saved runs (pytest-benchmark compares only timings). `bench/conftest.py` keeps
only the stable keys of `machine_info`, so the comparison does not warn about a different host
name or clock. On a shared 2-core VM, medians can move by more than 15% between two runs of the
same code (see the decode attention table below): compare on a quiet machine, or one file at a
time. CI runs `pytest --benchmark-disable`: every benchmark once, as a test, with every
assertion. Utilization and batch figures are deterministic and asserted in
`bench/bench_utilization.py` and `bench/bench_serving.py`; timings are this machine's.
"""


def workloads_section() -> str:
    rows = []
    for name, make in WORKLOADS.items():
        trace = make()
        prompts = np.array([r.prompt_len for r in trace.requests])
        outputs = np.array([o for r in trace.requests for o in r.output_lens])
        rows.append(
            [
                f"`{name}`",
                len(trace),
                trace.num_sequences,
                f"{prompts.mean():.1f}",
                f"{outputs.mean():.1f}",
                int(prompts.max() + outputs.max()),
                trace.description,
            ]
        )
    (sg_in, sg_out), (al_in, al_out) = FIG11_MEAN_LENGTHS["sharegpt"], FIG11_MEAN_LENGTHS["alpaca"]
    return f"""### Workloads (`bench/workloads.py`)

Seeded, nothing downloaded. Lengths are log-normal, truncated to [1, 1024] tokens, with `mu`
solved so that the truncated mean is the paper's (Fig. 11 of {PAPER}: ShareGPT {sg_in} input /
{sg_out} output tokens, Alpaca {al_in} / {al_out}). The paper gives no variance; the log-space
sigmas are ours. Stratified sampling puts every trace's means within 1% of the targets.
A sequence with a prompt of `p` and `o` output tokens ends holding `p + o - 1` K/V slots: its
last sampled token is never computed. All requests arrive at step 0.

{table(WORKLOAD_COLUMNS, rows)}
"""


def lifetime_section(run: Run) -> str:
    rows = run.lifetime()
    if not rows:
        return ""
    policies = [*CONTIGUOUS, *(f"paged-bs{b}" for b in PAPER_BLOCK_SIZES)]
    body = [
        [f"`{w}`"] + [pct(rows[(w, p)]) for p in policies]
        for w in WORKLOADS
        if all((w, p) in rows for p in policies)
    ]
    header = ["workload", "Max", "Pow2", "Oracle", *(f"bs {b}" for b in PAPER_BLOCK_SIZES)]
    return f"""### Utilization over each request's life (`bench/bench_utilization.py`)

Token states as a share of the slots a policy holds, summed over every step of every sequence's
life (`bench/utilization_policies.py`). No scheduling and no budget: the memory each policy
needs for the same work. Max reserves the model's 2048 tokens (the toy: 50), Pow2 the prompt
plus the next power of two of the output, Oracle exactly what the sequence fills; paged holds
`ceil(count / block size)` blocks. Sharing is not counted here (see the simulator).

{table(header, body)}

![utilization vs block size](figures/utilization_vs_block_size.png)
"""


def serving_table(rows: dict[tuple[Any, ...], dict[str, Any]], workload: str) -> str:
    paged = rows.get((workload, "paged-bs16", False))
    body = []
    for policy in ORDER:
        r = rows.get((workload, policy, False))
        if r is None:
            continue
        ratio = f"{paged['mean_batch'] / r['mean_batch']:.2f}x" if paged else "-"
        paper = FIG13_MEAN_BATCH.get(workload, {}).get(policy)
        body.append(
            [
                label(policy),
                pct(r["share_token_states"]),
                pct(r["share_reservation"]),
                pct(r["share_internal_fragmentation"]),
                pct(r["share_unallocated"]),
                pct(r["utilization"]),
                f"{r['mean_batch']:.1f}",
                "-" if paper is None else f"{paper:.2f}",
                ratio,
                r["peak_batch"],
                r["preemptions"],
                f"{r['tokens_per_step']:.1f}",
                r["steps"],
            ]
        )
    header = [
        "policy", "token states", "reservation", "internal frag.", "unallocated",
        "utilization", "mean batch", "paper's mean batch (Fig. 13)", "paged / this",
        "peak batch", "preemptions",
        "tokens / step", "steps",
    ]  # fmt: skip
    return table(header, body)


def paged_sweep(rows: dict[tuple[Any, ...], dict[str, Any]]) -> list[dict[str, Any]]:
    """The ShareGPT-like paged runs without sharing, by block size."""
    runs = [r for (w, p, s), r in rows.items() if w == "sharegpt" and p.startswith("paged")]
    return sorted((r for r in runs if not r["shared"]), key=lambda r: r["block_size"])


def has_sharegpt(rows: dict[tuple[Any, ...], dict[str, Any]]) -> bool:
    """Whether the run holds the four policies' ShareGPT-like runs (the paper's comparison)."""
    return all(("sharegpt", policy, False) in rows for policy in ORDER)


def serving_section(run: Run) -> str:
    rows = index(run.of_kind("serving"), "workload", "policy", "shared")
    if not rows:
        return ""
    paper = [
        [label(p)]
        + [
            f"{FIG2_MEMORY_SHARES[p][k]:.1f}%" if k in FIG2_MEMORY_SHARES[p] else "-"
            for k in ("token_states", "reservation", "internal", "external")
        ]
        for p in ORDER
    ]
    config = ServingConfig()
    parts = [
        f"""### Serving under a fixed KV budget (`bench/bench_serving.py`)

`bench/simulator.py` runs impl's `Scheduler` (FCFS admission, chunked prefill, watermark,
preemption of the newest sequence by recompute) over impl's `BlockTableStore` for paged memory,
or over `ContiguousStore`, which reserves a policy's slots per sequence at admission, for the
Orca baselines. The model is not run; the trace says how long each sample is. The budget is the
paper's OPT-13B on one A100 (Table 1, ~15.7K slots): {config.budget_slots:,} slots (whole
blocks at every size up to 256); {config.max_num_seqs} sequences and
{config.max_num_batched_tokens} tokens per step at most; paged admissions keep
{config.watermark:.0%} of the blocks free. The chapter's toy runs in its {CHAPTER_KV_SLOTS}
slots. Averages cover the **saturated** steps,
while some request waits for memory, so the batch is what the memory holds. Shares are of the
whole budget, slot-steps over those steps; "utilization" is token states over allocated slots.
"""
    ]
    if has_sharegpt(rows):
        parts.append(
            f"""#### ShareGPT-like: the paper's Fig. 2 and Fig. 13a

{serving_table(rows, "sharegpt")}

The paper's Fig. 2 (averaged over its §6.2 experiments; vLLM's bar prints only its token
states). Its mean batches (the column above) were averaged at
{FIG13_REQUEST_RATES["sharegpt"]} requests/s on ShareGPT and {FIG13_REQUEST_RATES["alpaca"]}
requests/s on Alpaca (Fig. 13); the text
gives vLLM {FIG13A_BATCH_RATIOS["orca-max"]}x Max's batch and
{FIG13A_BATCH_RATIOS["orca-oracle"]}x Oracle's on ShareGPT.

{table(PAPER_COLUMNS, paper)}

![memory breakdown](figures/memory_breakdown.png)

![batch size](figures/batch_size.png)

![utilization over time](figures/utilization_over_time.png)
"""
        )
    for workload, title in (("alpaca", "Alpaca-like"), ("chapter", "The chapter's toy, 400 slots")):
        if (workload, "paged-bs16", False) in rows:
            parts.append(f"#### {title}\n\n{serving_table(rows, workload)}\n")
    sweep = paged_sweep(rows)
    if len(sweep) > 1:
        body = [
            [
                r["block_size"],
                pct(r["utilization"]),
                pct(r["share_token_states"]),
                f"{r['mean_batch']:.1f}",
                r["peak_batch"],
                r["preemptions"],
                f"{r['tokens_per_step']:.1f}",
            ]
            for r in sweep
        ]
        header = ["block size", "utilization", "token states", "mean batch", "peak batch",
                  "preemptions", "tokens / step"]  # fmt: skip
        parts.append(
            "#### ShareGPT-like, paged, by block size\n\n"
            "The memory side of the paper's Fig. 18b: larger blocks waste more of each last "
            "block, so fewer sequences fit. The simulator has no kernel cost, so it cannot show "
            "why very small blocks are slow.\n\n" + table(header, body) + "\n"
        )
    sharing = [(w, s, rows[(w, "paged-bs16", s)]) for w in WORKLOADS for s in (True, False)
               if (w, "paged-bs16", s) in rows and (w, "paged-bs16", True) in rows]  # fmt: skip
    if sharing:
        body = [
            [
                f"`{w}`",
                "on" if s else "off",
                f"{r['mean_batch']:.1f}",
                f"{r['tokens_per_slot']:.2f}",
                pct(r["memory_saving"]),
                pct(r["utilization"]),
                r["preemptions"],
                f"{r['tokens_per_step']:.1f}",
            ]
            for w, s, r in sharing
        ]
        low, high = FIG15_PARALLEL_SAVING["alpaca"]
        header = ["workload", "sharing", "mean batch", "logical tokens / slot", "memory saving",
                  "utilization", "preemptions", "tokens / step"]  # fmt: skip
        parts.append(
            "#### Sharing: a system prompt, parallel samples (paged, block 16)\n\n"
            "With sharing on, the manager is `PrefixCachingBlockManager`: later requests find "
            "the system prompt's full blocks in the prefix cache, and the samples of a request "
            "fork its prompt's blocks. Off, every sequence holds its own copy. \"Logical tokens "
            '/ slot" counts a shared token once per sequence that sees it; "memory saving" is '
            "the paper's Fig. 15 metric (blocks saved by sharing over the blocks the tables "
            f"would hold without it, all steps). The paper saves {low}% to {high}% with 2 to 6 "
            "parallel samples on Alpaca.\n\n" + table(header, body) + "\n"
        )
    return "\n".join(parts)


def differences_section(run: Run) -> str:
    rows = index(run.of_kind("serving"), "workload", "policy", "shared")
    if not has_sharegpt(rows):
        return ""
    paged, oracle, pow2, top = (rows[("sharegpt", p, False)] for p in ORDER)
    paper_max, paper_oracle = FIG13A_BATCH_RATIOS["orca-max"], FIG13A_BATCH_RATIOS["orca-oracle"]
    paper_batch, rate = FIG13_MEAN_BATCH["sharegpt"], FIG13_REQUEST_RATES["sharegpt"]
    vs_oracle = paged["mean_batch"] / oracle["mean_batch"]
    vs_max = paged["mean_batch"] / top["mean_batch"]
    without_external = {
        p: pct(FIG2_MEMORY_SHARES[p]["token_states"] / (100 - FIG2_MEMORY_SHARES[p]["external"]))
        for p in CONTIGUOUS
    }
    text = f"""### Where our numbers differ from the paper's, and why

* **Paged memory matches.** Token states fill {pct(paged["share_token_states"])} of the budget
  (paper: 96.3%) and {pct(paged["utilization"])} of the allocated slots. The rest is the
  unfilled tail of each sequence's last block ({pct(paged["share_reservation"])} will still be
  filled, {pct(paged["share_internal_fragmentation"])} never) and free blocks, mostly the 1%
  watermark ({pct(paged["share_unallocated"])}).
* **Our contiguous baselines hold more token states than the paper's** (Oracle
  {pct(oracle["share_token_states"])} against 38.2%, Pow2 {pct(pow2["share_token_states"])}
  against 26.8%). The paper's Orca places reservations with a buddy allocator, whose holes are
  its "external fragmentation & others" (36.6% of memory for Oracle, 41.6% for Pow2, 8.9% for
  Max). `ContiguousStore` packs reservations perfectly: any free slots take the next one.
  Without the external part, the paper's bars give {without_external["orca-oracle"]} for
  Oracle, {without_external["orca-pow2"]} for Pow2 and {without_external["orca-max"]} for Max,
  close to our {pct(oracle["utilization"])}, {pct(pow2["utilization"])} and
  {pct(top["utilization"])} of the allocated slots. Reservation and internal fragmentation
  split as in the paper (Oracle: no internal fragmentation; Max: mostly internal).
* **So paging's lead over Oracle is smaller here:** {vs_oracle:.2f}x the batch, against the
  paper's {paper_oracle}x. A perfectly packed contiguous allocator is the best case for
  contiguous memory; a buddy allocator's holes would widen the gap.
* **Paging's lead over Max is larger here:** {vs_max:.2f}x against {paper_max}x. Max fits
  {top["mean_batch"]:.0f} requests in both (7 x 2048 slots fit in 15.7K; Fig. 13a prints 7.00),
  but vLLM averaged {paper_batch["paged-bs16"]} requests in the paper where the simulator holds
  {paged["mean_batch"]:.1f}. The paper averages at one request rate ({rate} requests/s) over the
  whole run, on a GPU that also spends time computing; we average only while requests wait for
  memory, which measures what the memory can hold. Our lengths are log-normal draws that match
  only the means of the real traces.
* **Paging preempts; reservations never do.** Paged admission fills memory with young
  sequences, whose growth later runs out of blocks: {paged["preemptions"]} preemptions by
  recompute for {paged["finished"]} requests (their recomputed tokens are in "tokens / step").
  Contiguous reservations never grow, so they never preempt.
"""
    alpaca = rows.get(("alpaca", "paged-bs16", False))
    if alpaca is not None:
        text += f"""* **Alpaca-like requests are short**, so paging's batch reaches the scheduler's
  {alpaca["peak_batch"]}-sequence limit ({alpaca["mean_batch"]:.1f} on average) before the memory
  runs out ({pct(alpaca["share_unallocated"])} of it stays free): the order of the policies
  holds, but paging's ratios over the contiguous policies there are lower bounds.
"""
    return text


def latency_section(run: Run) -> str:
    parts = []
    attention = run.attention()
    batches = sorted({batch for layout, batch in attention if layout == "paged"})
    batches = [n for n in batches if ("contiguous", n) in attention]
    if batches:
        info = next(
            b["extra_info"] for b in run.benchmarks if (b["group"] or "").startswith("attention-bs")
        )
        sizes = sorted(set.intersection(*(set(attention["paged", n]) for n in batches)))
        body = []
        for b in sizes:
            row: list[object] = [b]
            for n in batches:
                paged, contiguous = attention["paged", n][b], attention["contiguous", n][b]
                row += [
                    f"{paged * 1e3:.3f}",
                    f"{contiguous * 1e3:.3f}",
                    f"{paged / contiguous:.2f}x",
                ]
            body.append(row)
        headers = ["block size"] + [
            f"{column}, batch {n}"
            for n in batches
            for column in ("paged (ms)", "contiguous (ms)", "paged / contiguous")
        ]
        spreads = []
        for n in batches:
            column = attention["contiguous", n].values()
            spreads.append(f"{min(column) * 1e3:.3f} to {max(column) * 1e3:.3f} ms at batch {n}")
        reference_note = ""
        if info["backend"] == "reference":
            reference_note = (
                " The torch reference gathers each sequence's K/V through its block table into a"
                " dense copy before attending (`kernels/reference.py`), so the paged column pays"
                " for that copy; `bench/gpu_kernels.py` times the Triton kernel on a GPU."
            )
        parts.append(
            f"""#### Decode attention, paged against contiguous (`bench/bench_attention.py`)

Batch {", ".join(map(str, batches))}; context {info["context"]}, heads {info["heads"]},
{info["dtype"]}, backend `{info["backend"]}` on `{info["device"]}`; median milliseconds per call.
The contiguous call does not depend on the block size, so the spread of its column
({"; ".join(spreads)}) is this machine's noise between benchmarks of the same work.{reference_note}

{table(headers, body)}
"""
        )
    engine = index(run.of_kind("engine"), "block_size", "batch")
    if engine:
        batches = sorted({batch for _, batch in engine})
        sizes = sorted({size for size, _ in engine})
        body = [
            [b]
            + [
                f"{engine[(b, n)]['median'] * 1e3:.1f}" if (b, n) in engine else "-"
                for n in batches
            ]
            for b in sizes
        ]
        first = next(iter(engine.values()))
        parts.append(
            f"""#### Engine decode step (`bench/bench_engine.py`)

One `PagedAttentionEngine.step()` in which every sequence decodes one token after a
{first["context"]}-token prompt: scheduling, block-table growth, slot mapping, K/V writes, paged
attention, sampling. The seeded default `ModelConfig` ({first["model"]}), kernels' torch
reference on CPU; median milliseconds per step.

{table(["block size", *(f"batch {n} (ms)" for n in batches)], body)}
"""
        )
    if not parts:
        return ""
    return (
        "### Decode latency by block size\n\n"
        + "\n".join(parts)
        + "\n![decode latency](figures/decode_latency.png)\n"
    )


# ----------------------------------------------------------------- figures


def save(figure: plt.Figure, name: str, figures: Path) -> None:
    figure.tight_layout()
    figure.savefig(figures / name, dpi=100)
    plt.close(figure)


def plot_utilization(run: Run, figures: Path) -> None:
    rows = run.lifetime()
    names = [w for w in WORKLOADS if (w, "paged-bs16") in rows]
    if not names:
        return
    figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names, strict=True):
        sizes = [b for b in PAPER_BLOCK_SIZES if (name, f"paged-bs{b}") in rows]
        ax.plot(sizes, [100 * rows[(name, f"paged-bs{b}")] for b in sizes],
                "o-", color="#2e8b57", label="paged")  # fmt: skip
        for policy, style in zip(CONTIGUOUS, (":", "--", "-."), strict=True):
            if (name, policy) in rows:
                ax.axhline(100 * rows[(name, policy)], ls=style, color="#555",
                           label=label(policy))  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes], fontsize=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylim(0, 102)
    np.atleast_1d(axes)[0].set_ylabel("token states / allocated slots (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    save(figure, "utilization_vs_block_size.png", figures)


def plot_memory_breakdown(run: Run, figures: Path) -> None:
    rows = index(run.of_kind("serving"), "workload", "policy", "shared")
    if not has_sharegpt(rows):
        return
    figure, ax = plt.subplots(figsize=(8, 4))
    bars, names = [], []
    for policy in ORDER:
        r = rows[("sharegpt", policy, False)]
        bars.append([100 * r[f"share_{k}"] for k in SHARES])
        names.append(f"{label(policy)}\n(simulated)")
        paper = FIG2_MEMORY_SHARES[policy]
        parts = [paper["token_states"], paper.get("reservation", 0), paper.get("internal", 0)]
        bars.append([*parts, 100 - sum(parts)])
        names.append(f"{label(policy)}\n(paper, Fig. 2)")
    left = np.zeros(len(bars))
    for k, part in enumerate(SHARES):
        widths = np.array([bar[k] for bar in bars])
        legend = "unallocated / external frag. & others" if part == "unallocated" else part
        ax.barh(range(len(bars)), widths, left=left, color=COLORS[part],
                label=legend.replace("_", " "))  # fmt: skip
        left += widths
    ax.set_yticks(range(len(bars)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("share of the KV budget (%), ShareGPT-like")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.4, -0.2), ncol=4)
    save(figure, "memory_breakdown.png", figures)


def plot_batch_size(run: Run, figures: Path) -> None:
    rows = index(run.of_kind("serving"), "workload", "policy", "shared")
    if not has_sharegpt(rows):
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.3))
    workloads = [w for w in ("sharegpt", "alpaca") if all((w, p, False) in rows for p in ORDER)]
    width = 0.8 / max(len(workloads), 1)
    for i, workload in enumerate(workloads):
        values = [rows[(workload, p, False)]["mean_batch"] for p in ORDER]
        positions = np.arange(len(ORDER)) + i * width
        left.bar(positions, values, width, label=workload)
        for x, v in zip(positions, values, strict=True):
            left.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    left.set_xticks(np.arange(len(ORDER)) + width * (len(workloads) - 1) / 2,
                    [label(p).replace(", ", "\n") for p in ORDER], fontsize=8)  # fmt: skip
    left.set_ylabel("mean batch while requests wait")
    left.legend(fontsize=8)
    sweep = paged_sweep(rows)
    if sweep:
        sizes = [r["block_size"] for r in sweep]
        right.plot(sizes, [r["mean_batch"] for r in sweep], "o-", label="paged")
        for policy, style in zip(CONTIGUOUS, (":", "--", "-."), strict=True):
            right.axhline(rows[("sharegpt", policy, False)]["mean_batch"], ls=style,
                          color="#555", label=label(policy))  # fmt: skip
        right.set_xscale("log", base=2)
        right.set_xticks(sizes, [str(b) for b in sizes])
        right.set_xlabel("block size (tokens), ShareGPT-like")
        right.set_ylabel("mean batch")
        right.set_ylim(0, None)
        right.legend(fontsize=7)
    save(figure, "batch_size.png", figures)


def plot_over_time(run: Run, figures: Path) -> None:
    rows = index(run.of_kind("serving"), "workload", "policy", "shared")
    if not has_sharegpt(rows):
        return
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    for policy in ORDER:
        series = rows[("sharegpt", policy, False)]["series"]
        top.plot(series["step"], [100 * u for u in series["utilization"]], label=label(policy))
        bottom.plot(series["step"], series["batch"], label=label(policy))
    top.set_ylabel("token states /\nallocated (%)")
    top.set_ylim(0, 102)
    bottom.set_ylabel("batch")
    bottom.set_xlabel("step (ShareGPT-like, 200 requests at step 0; 64-slice means)")
    top.legend(fontsize=7, ncol=4)
    save(figure, "utilization_over_time.png", figures)


def plot_latency(run: Run, figures: Path) -> None:
    attention = run.attention()
    engine = index(run.of_kind("engine"), "block_size", "batch")
    if not attention and not engine:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.3))
    for (layout, batch), medians in sorted(attention.items()):
        sizes = sorted(medians)
        style = "o-" if layout == "paged" else "s--"
        left.plot(sizes, [medians[b] * 1e3 for b in sizes], style, label=f"{layout}, batch {batch}")
    left.set_title("decode attention (bench_attention.py)", fontsize=9)
    for batch in sorted({n for _, n in engine}):
        sizes = sorted(b for b, n in engine if n == batch)
        right.plot(sizes, [engine[(b, batch)]["median"] * 1e3 for b in sizes], "o-",
                   label=f"batch {batch}")  # fmt: skip
    right.set_title("engine decode step (bench_engine.py)", fontsize=9)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(PAPER_BLOCK_SIZES, [str(b) for b in PAPER_BLOCK_SIZES], fontsize=7)
        ax.set_yscale("log")
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel("median (ms)")
        if ax.lines:
            ax.legend(fontsize=7)
    save(figure, "decode_latency.png", figures)


PLOTS: list[Callable[[Run, Path], None]] = [
    plot_utilization,
    plot_memory_breakdown,
    plot_batch_size,
    plot_over_time,
    plot_latency,
]


# ----------------------------------------------------------------- output


def render(run: Run, command: str) -> str:
    """The generated section, markers included."""
    sections = [
        header_section(run, command),
        workloads_section(),
        lifetime_section(run),
        serving_section(run),
        differences_section(run),
        latency_section(run),
    ]
    body = reflow("\n\n".join(section for section in sections if section))
    return f"{BEGIN}\n{body}{END}\n"


def splice(document: str, section: str) -> str:
    """``document`` with its generated section replaced by ``section`` (appended if absent)."""
    if BEGIN in document and END in document:
        before, rest = document.split(BEGIN, 1)
        after = rest.split(END, 1)[1].removeprefix("\n")
        return before + section + after
    return document.rstrip("\n") + "\n\n" + section


def write(run: Run, command: str, results: Path, figures: Path) -> None:
    figures.mkdir(parents=True, exist_ok=True)
    for plot in tqdm(PLOTS, desc="figures", unit="plot"):
        plot(run, figures)
    document = results.read_text() if results.exists() else HEADER
    results.write_text(splice(document, render(run, command)))


# ----------------------------------------------------------------- comparing two runs

DIFF_KEYS = (
    "utilization", "share_token_states", "share_reservation", "share_internal_fragmentation",
    "mean_batch", "peak_batch", "preemptions", "tokens_per_step", "tokens_per_slot",
    "memory_saving", "steps",
)  # fmt: skip


def diff(old: Run, new: Run) -> list[tuple[str, str, Any, Any]]:
    """``(benchmark, figure, old, new)`` for every ``extra_info`` figure of :data:`DIFF_KEYS`
    that differs between two runs of the same benchmark. pytest-benchmark's own comparison
    covers only timings; these figures are what a change to the memory management moves."""
    before = {b["fullname"]: b["extra_info"] for b in old.benchmarks}
    return [
        (b["fullname"], key, before[b["fullname"]][key], b["extra_info"].get(key))
        for b in new.benchmarks
        if b["fullname"] in before
        for key in DIFF_KEYS
        if key in before[b["fullname"]] and before[b["fullname"]][key] != b["extra_info"].get(key)
    ]


def newest_saved_runs() -> list[Path]:
    """The two most recent runs saved by ``--benchmark-save``/``--benchmark-autosave``."""
    saved = sorted(ROOT.glob(".benchmarks/*/*.json"), key=lambda path: path.stat().st_mtime)
    if len(saved) < 2:
        raise SystemExit("--diff needs two saved runs in .benchmarks/ (--benchmark-save=NAME)")
    return saved[-2:]


def print_diff(paths: Sequence[Path]) -> None:
    old, new = (Run.load(path) for path in paths)
    changes = diff(old, new)
    print(f"{old.source} -> {new.source}: {len(changes)} deterministic figures moved")
    for fullname, key, before, after in changes:
        print(f"  {fullname.rsplit('/', 1)[-1]}  {key}: {before} -> {after}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", action="store_true", help="run `pytest bench` first")
    source.add_argument("--json", type=Path, help="a pytest-benchmark JSON to render")
    source.add_argument("--diff", type=Path, nargs="*", metavar="JSON", help="OLD NEW, or none")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--figures", type=Path, default=FIGURES)
    args = parser.parse_args(argv)
    if args.diff is not None:
        if len(args.diff) not in (0, 2):
            parser.error("--diff takes two JSON files, or none for the two newest saved runs")
        print_diff(args.diff or newest_saved_runs())
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
