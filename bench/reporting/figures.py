"""The report's PNG figures, drawn with matplotlib's Agg backend (no display needed).

Each plot function draws one figure of a :class:`~bench.reporting.run.Run` into a folder, or
nothing when the run lacks its benchmarks; :data:`PLOTS` lists them all.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes

from bench.paper import FIG2_MEMORY_SHARES
from bench.reporting.labels import CONTIGUOUS, ORDER, PAGED, label
from bench.reporting.run import Run
from bench.utilization_policies import PAPER_BLOCK_SIZES
from bench.workloads import WORKLOADS

SHARES = ("token_states", "reservation", "internal_fragmentation", "unallocated")
COLORS = {
    "token_states": "#2e8b57",
    "reservation": "#e0a030",
    "internal_fragmentation": "#c0504d",
    "unallocated": "#a0a0a0",
}
CONTIGUOUS_STYLES = (":", "--", "-.")
"""Line styles of the :data:`~bench.reporting.labels.CONTIGUOUS` policies' reference lines."""


def save(figure: plt.Figure, name: str, figures: Path) -> None:
    """Lay ``figure`` out, write it to ``figures/name`` and close it."""
    figure.tight_layout()
    figure.savefig(figures / name, dpi=100)
    plt.close(figure)


def contiguous_lines(ax: Axes, values: Mapping[str, float]) -> None:
    """A horizontal reference line for each contiguous policy in ``values`` (policy: y)."""
    for policy, style in zip(CONTIGUOUS, CONTIGUOUS_STYLES, strict=True):
        if policy in values:
            ax.axhline(values[policy], ls=style, color="#555", label=label(policy))


def plot_utilization(run: Run, figures: Path) -> None:
    """Lifetime utilization against block size, one panel per workload."""
    rows = run.lifetime()
    names = [w for w in WORKLOADS if (w, PAGED) in rows]
    if not names:
        return
    figure, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 3.2), sharey=True)
    for ax, name in zip(np.atleast_1d(axes), names, strict=True):
        sizes = [b for b in PAPER_BLOCK_SIZES if (name, f"paged-bs{b}") in rows]
        ax.plot(sizes, [100 * rows[(name, f"paged-bs{b}")] for b in sizes],
                "o-", color="#2e8b57", label="paged")  # fmt: skip
        contiguous_lines(ax, {p: 100 * rows[(name, p)] for p in CONTIGUOUS if (name, p) in rows})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes], fontsize=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("block size (tokens)")
        ax.set_ylim(0, 102)
    np.atleast_1d(axes)[0].set_ylabel("token states / allocated slots (%)")
    np.atleast_1d(axes)[0].legend(fontsize=7, loc="lower left")
    save(figure, "utilization_vs_block_size.png", figures)


def plot_memory_breakdown(run: Run, figures: Path) -> None:
    """Where the ShareGPT-like budget goes, each policy simulated and as the paper's Fig. 2."""
    serving = run.serving()
    if not serving.compares_all("sharegpt"):
        return
    figure, ax = plt.subplots(figsize=(8, 4))
    bars, names = [], []
    for policy, r in serving.compared("sharegpt"):
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
    """Mean batch by policy and workload (left), and paged by block size on ShareGPT (right)."""
    serving = run.serving()
    if not serving.compares_all("sharegpt"):
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.3))
    workloads = [w for w in ("sharegpt", "alpaca") if serving.compares_all(w)]
    width = 0.8 / max(len(workloads), 1)
    for i, workload in enumerate(workloads):
        values = [r["mean_batch"] for _, r in serving.compared(workload)]
        positions = np.arange(len(ORDER)) + i * width
        left.bar(positions, values, width, label=workload)
        for x, v in zip(positions, values, strict=True):
            left.text(x, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    left.set_xticks(np.arange(len(ORDER)) + width * (len(workloads) - 1) / 2,
                    [label(p).replace(", ", "\n") for p in ORDER], fontsize=8)  # fmt: skip
    left.set_ylabel("mean batch while requests wait")
    left.legend(fontsize=8)
    sweep = serving.sweep()
    if sweep:
        sizes = [r["block_size"] for r in sweep]
        right.plot(sizes, [r["mean_batch"] for r in sweep], "o-", label="paged")
        contiguous_lines(right, {p: r["mean_batch"] for p, r in serving.compared("sharegpt")})
        right.set_xscale("log", base=2)
        right.set_xticks(sizes, [str(b) for b in sizes])
        right.set_xlabel("block size (tokens), ShareGPT-like")
        right.set_ylabel("mean batch")
        right.set_ylim(0, None)
        right.legend(fontsize=7)
    save(figure, "batch_size.png", figures)


def plot_over_time(run: Run, figures: Path) -> None:
    """Utilization and batch over the ShareGPT-like run, one line per policy."""
    serving = run.serving()
    if not serving.compares_all("sharegpt"):
        return
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(8, 4.6), sharex=True)
    for policy, r in serving.compared("sharegpt"):
        series = r["series"]
        top.plot(series["step"], [100 * u for u in series["utilization"]], label=label(policy))
        bottom.plot(series["step"], series["batch"], label=label(policy))
    top.set_ylabel("token states /\nallocated (%)")
    top.set_ylim(0, 102)
    bottom.set_ylabel("batch")
    paged = serving.compared("sharegpt")[0][1]
    slices = len(paged["series"]["step"])
    bottom.set_xlabel(f"step (ShareGPT-like, {paged['finished']} requests; {slices}-slice means)")
    top.legend(fontsize=7, ncol=4)
    save(figure, "utilization_over_time.png", figures)


def plot_latency(run: Run, figures: Path) -> None:
    """Decode attention against block size: paged and contiguous medians at the longest context
    (left), and paged / contiguous at every batch and context (right)."""
    attention = run.attention()
    if not attention:
        return
    figure, (left, right) = plt.subplots(1, 2, figsize=(9, 3.4))
    longest = max(context for _, _, context in attention)
    batches = sorted({batch for _, batch, _ in attention})
    for (layout, batch, context), medians in sorted(attention.items()):
        if context != longest:
            continue
        sizes = sorted(medians)
        style = "o-" if layout == "paged" else "s--"
        color = f"C{batches.index(batch)}"
        label = f"{layout}, batch {batch}"
        left.plot(sizes, [medians[b] * 1e3 for b in sizes], style, color=color, label=label)
    left.set_title(f"decode attention, context {longest}", fontsize=9)
    left.set_yscale("log")
    left.set_ylabel("median (ms)")
    for (context, batch), ratios in sorted(run.attention_ratio().items()):
        sizes = sorted(ratios)
        label = f"ctx {context}, batch {batch}"
        right.plot(sizes, [ratios[b] for b in sizes], "o-", label=label)
    right.axhline(1.1, color="grey", linestyle=":", linewidth=1, label="+10%")
    right.axhline(1.0, color="black", linewidth=0.5)
    right.set_title("paged / contiguous (paired rounds)", fontsize=9)
    right.set_ylabel("median ratio")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(PAPER_BLOCK_SIZES, [str(b) for b in PAPER_BLOCK_SIZES], fontsize=7)
        ax.set_xlabel("block size (tokens)")
        ax.legend(fontsize=6)
    save(figure, "decode_latency.png", figures)


PLOTS: list[Callable[[Run, Path], None]] = [
    plot_utilization,
    plot_memory_breakdown,
    plot_batch_size,
    plot_over_time,
    plot_latency,
]
"""Every figure, in the order they are drawn."""
