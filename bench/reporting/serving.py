"""The serving simulation section (``bench_serving.py``): each workload's policies under the
fixed KV budget, the block-size sweep and sharing, each table followed by the sentences its
numbers support (orders, trends, the paper's ranges), computed from them."""

from __future__ import annotations

from bench.paper import (
    FIG2_MEMORY_SHARES,
    FIG13_MEAN_BATCH,
    FIG13_REQUEST_RATES,
    FIG13A_BATCH_RATIOS,
    FIG15_PARALLEL_SAVING,
)
from bench.reporting.labels import ORDER, PAGED, label, short_label
from bench.reporting.markdown import pct, table, times
from bench.reporting.run import Info, Run, Serving
from bench.reporting.verdicts import compare, ordering, same_order, trend, within, word
from bench.simulator import ServingConfig
from bench.workloads import CHAPTER_KV_SLOTS

FIG13_PANELS = {"sharegpt": "13a", "alpaca": "13b"}
"""The panel of the paper's Fig. 13 that holds each workload's mean batches."""

PAPER_COLUMNS = ["policy", "token states", "reservation", "internal frag.",
                 "external frag. & others"]  # fmt: skip
SERVING_COLUMNS = [
    "policy", "token states", "reservation", "internal frag.", "unallocated",
    "utilization", "mean batch", "paper's mean batch (Fig. 13)", "paged / this",
    "peak batch", "preemptions", "tokens / step", "steps",
]  # fmt: skip
SWEEP_COLUMNS = ["block size", "utilization", "token states", "mean batch", "peak batch",
                 "preemptions", "tokens / step"]  # fmt: skip
SHARING_COLUMNS = ["workload", "sharing", "mean batch", "logical tokens / slot",
                   "memory saving", "utilization", "preemptions", "tokens / step"]  # fmt: skip


def batch(value: float) -> str:
    """A mean batch as the tables print it."""
    return f"{value:.1f}"


def serving_table(serving: Serving, workload: str) -> str:
    """The :data:`~bench.reporting.labels.ORDER` policies on ``workload``, one row each, with
    the paper's Fig. 13 mean batch and paged's batch over each policy's."""
    compared = serving.compared(workload)
    paged = serving.get(workload, PAGED)
    body = []
    for policy, r in compared:
        paper = FIG13_MEAN_BATCH.get(workload, {}).get(policy)
        body.append(
            [
                label(policy),
                pct(r["share_token_states"]),
                pct(r["share_reservation"]),
                pct(r["share_internal_fragmentation"]),
                pct(r["share_unallocated"]),
                pct(r["utilization"]),
                batch(r["mean_batch"]),
                "-" if paper is None else f"{paper:.2f}",
                times(paged["mean_batch"] / r["mean_batch"]) if paged else "-",
                r["peak_batch"],
                r["preemptions"],
                f"{r['tokens_per_step']:.1f}",
                r["steps"],
            ]
        )
    return table(SERVING_COLUMNS, body)


def batch_order(serving: Serving, workload: str) -> list[tuple[str, float]]:
    """``(short label, mean batch)`` of the policies compared on ``workload``."""
    return [(short_label(p), r["mean_batch"]) for p, r in serving.compared(workload)]


def paper_batch_order(workload: str) -> list[tuple[str, float]]:
    """``(short label, mean batch)`` of the paper's Fig. 13 for ``workload`` (empty if none)."""
    paper = FIG13_MEAN_BATCH.get(workload, {})
    return [(short_label(p), paper[p]) for p in ORDER if p in paper]


def order_sentence(serving: Serving, workload: str) -> str:
    """The policies sorted by their measured mean batch and utilization, and whether the mean
    batches rank as the paper's Fig. 13 ranks them."""
    compared = serving.compared(workload)
    utilization = [(short_label(p), r["utilization"]) for p, r in compared]
    text = (
        f"By mean batch: {ordering(batch_order(serving, workload), batch)}; by utilization: "
        f"{ordering(utilization, pct)}."
    )
    paper = paper_batch_order(workload)
    if paper and len(paper) == len(compared):
        agreement = (
            "the same order" if same_order(batch_order(serving, workload), paper, batch) else
            "a different order"
        )  # fmt: skip
        text += (
            f" The paper's Fig. {FIG13_PANELS[workload]}: "
            f"{ordering(paper, lambda v: f'{v:.2f}')}, {agreement}."
        )
    return text


def sweep_part(serving: Serving) -> str:
    """The ShareGPT-like paged runs by block size, with how utilization and the mean batch move
    with the block size and which block size holds the largest batch."""
    sweep = serving.sweep()
    if len(sweep) < 2:
        return ""
    body = [
        [
            r["block_size"],
            pct(r["utilization"]),
            pct(r["share_token_states"]),
            batch(r["mean_batch"]),
            r["peak_batch"],
            r["preemptions"],
            f"{r['tokens_per_step']:.1f}",
        ]
        for r in sweep
    ]
    first, last = sweep[0], sweep[-1]
    utilization, batches = (
        trend([r["utilization"] for r in sweep]),
        trend([r["mean_batch"] for r in sweep]),
    )
    moves = (
        f"From block {first['block_size']} to {last['block_size']}, utilization {utilization}"
        f" ({pct(first['utilization'])} to {pct(last['utilization'])}) and the mean batch"
        f" {batches} ({batch(first['mean_batch'])} to {batch(last['mean_batch'])})"
    )
    if utilization == batches == "falls":
        moves += ": larger blocks waste more of each last block, so fewer sequences fit"
    best = max(sweep, key=lambda r: r["mean_batch"])
    return (
        "#### ShareGPT-like, paged, by block size\n\n"
        f"The memory side of the paper's Fig. 18b. {moves}. Block {best['block_size']} holds the"
        f" largest mean batch ({batch(best['mean_batch'])}). The simulator has no kernel cost,"
        " so it cannot show why very small blocks are slow.\n\n" + table(SWEEP_COLUMNS, body) + "\n"
    )


def parallel_base(workload: str) -> str | None:
    """The dataset of a parallel-sampling workload (``alpaca-n4``: ``alpaca``), if the paper's
    Fig. 15 measures it; None for any other workload."""
    base, _, samples = workload.rpartition("-n")
    return base if samples.isdigit() and base in FIG15_PARALLEL_SAVING else None


def sharing_sentence(workload: str, on: Info, off: Info) -> str:
    """What sharing does to ``workload``'s mean batch and memory, and, for parallel sampling,
    where the saving falls against the paper's Fig. 15 range."""
    moved = compare(on["mean_batch"], off["mean_batch"], 1)
    effect = (
        f"keeps the mean batch at {batch(on['mean_batch'])}"
        if moved == 0
        else f"{word(moved, 'raises', 'lowers', '')} the mean batch from {batch(off['mean_batch'])}"
        f" to {batch(on['mean_batch'])} ({times(on['mean_batch'] / off['mean_batch'])})"
    )
    text = f"On `{workload}`, sharing {effect} and saves {pct(on['memory_saving'])} of the blocks"
    base = parallel_base(workload)
    if base is not None:
        low, high = FIG15_PARALLEL_SAVING[base]
        place = within(100 * on["memory_saving"], low, high, 1)
        text += f", {place} the paper's {low}% to {high}% for {base.capitalize()}"
    return text + "."


def sharing_part(serving: Serving) -> str:
    """The paged runs with sharing on and off, and :func:`sharing_sentence` for each workload."""
    pairs = serving.sharing()
    if not pairs:
        return ""
    body = [
        [
            f"`{w}`",
            "on" if r["shared"] else "off",
            batch(r["mean_batch"]),
            f"{r['tokens_per_slot']:.2f}",
            pct(r["memory_saving"]),
            pct(r["utilization"]),
            r["preemptions"],
            f"{r['tokens_per_step']:.1f}",
        ]
        for w, pair in pairs.items()
        for r in pair
    ]
    low, high = FIG15_PARALLEL_SAVING["alpaca"]
    verdicts = " ".join(sharing_sentence(w, on, off) for w, (on, off) in pairs.items())
    return (
        f"#### Sharing: a system prompt, parallel samples ({label(PAGED)})\n\n"
        "With sharing on, the manager is `PrefixCachingBlockManager`: later requests find "
        "the system prompt's full blocks in the prefix cache, and the samples of a request "
        "fork its prompt's blocks. Off, every sequence holds its own copy. \"Logical tokens "
        '/ slot" counts a shared token once per sequence that sees it; "memory saving" is '
        "the paper's Fig. 15 metric (blocks saved by sharing over the blocks the tables "
        f"would hold without it, all steps). The paper saves {low}% to {high}% with 2 to 6 "
        f"parallel samples on Alpaca. {verdicts}\n\n" + table(SHARING_COLUMNS, body) + "\n"
    )


def largest_power_of_two_dividing(n: int) -> int:
    """The largest power of two that divides ``n >= 1``: every block size up to it divides a
    budget of ``n`` slots into whole blocks."""
    return n & -n


def serving_section(run: Run) -> str:
    """``bench_serving.py``: the simulator's method and budget, each workload's table with its
    :func:`order_sentence`, the paper's Fig. 2, :func:`sweep_part` and :func:`sharing_part`."""
    serving = run.serving()
    if not serving:
        return ""
    config = ServingConfig()
    parts = [
        f"""### Serving under a fixed KV budget (`bench/bench_serving.py`)

`bench/simulator.py` runs impl's `Scheduler` (FCFS admission, chunked prefill, watermark,
preemption of the newest sequence by recompute) over impl's `BlockTableStore` for paged memory,
or over `ContiguousStore`, which reserves a policy's slots per sequence at admission, for the
Orca baselines. The model is not run; the trace says how long each sample is. The budget is the
paper's OPT-13B on one A100 (Table 1, ~15.7K slots): {config.budget_slots:,} slots (whole
blocks at every power-of-two size up to {largest_power_of_two_dividing(config.budget_slots)});
{config.max_num_seqs} sequences and {config.max_num_batched_tokens} tokens per step at most;
paged admissions keep {config.watermark:.0%} of the blocks free. The chapter's toy runs in its
{CHAPTER_KV_SLOTS} slots. Averages cover the **saturated** steps, while some request waits for
memory, so the batch is what the memory holds. Shares are of the whole budget, slot-steps over
those steps; "utilization" is token states over allocated slots.
"""
    ]
    if serving.compares_all("sharegpt"):
        paper = [
            [label(p)]
            + [
                f"{FIG2_MEMORY_SHARES[p][k]:.1f}%" if k in FIG2_MEMORY_SHARES[p] else "-"
                for k in ("token_states", "reservation", "internal", "external")
            ]
            for p in ORDER
        ]
        parts.append(
            f"""#### ShareGPT-like: the paper's Fig. 2 and Fig. 13a

{serving_table(serving, "sharegpt")}

{order_sentence(serving, "sharegpt")}

The paper's Fig. 2 (averaged over its §6.2 experiments; vLLM's bar prints only its token
states). Its mean batches (the column above) were averaged at
{FIG13_REQUEST_RATES["sharegpt"]} requests/s on ShareGPT and {FIG13_REQUEST_RATES["alpaca"]}
requests/s on Alpaca (Fig. 13); the text gives vLLM {FIG13A_BATCH_RATIOS["orca-max"]}x Max's
batch and {FIG13A_BATCH_RATIOS["orca-oracle"]}x Oracle's on ShareGPT.

{table(PAPER_COLUMNS, paper)}

![memory breakdown](figures/memory_breakdown.png)

![batch size](figures/batch_size.png)

![utilization over time](figures/utilization_over_time.png)
"""
        )
    titles = {"alpaca": "Alpaca-like", "chapter": f"The chapter's toy, {CHAPTER_KV_SLOTS} slots"}
    for workload, title in titles.items():
        if serving.get(workload, PAGED) is not None:
            parts.append(
                f"#### {title}\n\n{serving_table(serving, workload)}\n\n"
                f"{order_sentence(serving, workload)}\n"
            )
    parts += [part for part in (sweep_part(serving), sharing_part(serving)) if part]
    return "\n".join(parts)
