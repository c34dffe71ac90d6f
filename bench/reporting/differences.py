"""Where the run's ShareGPT-like serving numbers differ from the paper's, and why.

Every verdict here (matches or not, more or fewer, smaller or larger, close or far, which
part dominates, who preempts, whether a limit is reached, whether the order holds) is chosen by
comparing the numbers it names; only the explanations of method are fixed text.
"""

from __future__ import annotations

from bench.paper import (
    FIG2_MEMORY_SHARES,
    FIG11_MEAN_LENGTHS,
    FIG13_MEAN_BATCH,
    FIG13_REQUEST_RATES,
    FIG13A_BATCH_RATIOS,
)
from bench.reporting.labels import ORDER, PAGED, short_label
from bench.reporting.markdown import pct, times, words
from bench.reporting.run import Info, Run, Serving
from bench.reporting.serving import FIG13_PANELS, batch, batch_order, paper_batch_order
from bench.reporting.verdicts import Sign, compare, same_order, word
from bench.simulator import ServingConfig
from bench.workloads import OPT_MAX_LEN

MATCH_POINTS = 1.0
"""A share of memory "matches" the paper's within this many percentage points."""

CLOSE_POINTS = 5.0
"""Shares of memory are "close to" the paper's within this many percentage points: our traces
match only the means of the real ones."""

CONTIGUOUS_BY_SIZE = ORDER[1:]
"""The Orca baselines from the least to the most reserved: Oracle, Pow2, Max."""


def points(ours: float, paper: float) -> float:
    """The gap in percentage points between two percentages, as printed (one decimal)."""
    return abs(round(ours, 1) - round(paper, 1))


def amount(sign: Sign) -> str:
    """``more``, ``fewer`` or ``as many``, as ours is above, below or equal to the paper's."""
    return word(sign, "more", "fewer", "as many")


def than(sign: Sign) -> str:
    """What :func:`amount` compares with: ``than the paper's`` or ``as the paper's``."""
    return "as the paper's" if sign == 0 else "than the paper's"


def paged_bullet(paged: Info, watermark: float) -> str:
    """Paged token states against the paper's Fig. 2, and where the rest of the budget goes:
    the last blocks' tails, and free blocks against the admission ``watermark``."""
    ours, paper = 100 * paged["share_token_states"], FIG2_MEMORY_SHARES[PAGED]["token_states"]
    gap = points(ours, paper)
    head = (
        "Paged memory matches the paper's."
        if gap <= MATCH_POINTS
        else f"Paged memory holds {amount(compare(ours, paper, 1))} token states than the paper's."
    )
    free = paged["share_unallocated"]
    if compare(free, 0, 3) == 0:
        free_part = "no free blocks"
    elif min(watermark, free) >= free / 2:
        free_part = f"free blocks, mostly the {watermark:.0%} watermark ({pct(free)})"
    else:
        free_part = f"free blocks ({pct(free)}), mostly beyond the {watermark:.0%} watermark"
    return f"""* **{head}** Token states fill {pct(paged["share_token_states"])} of the budget
  (paper: {paper}%, {gap:.1f} points apart) and {pct(paged["utilization"])} of the allocated
  slots. The rest is the unfilled tail of each sequence's last block
  ({pct(paged["share_reservation"])} will still be filled,
  {pct(paged["share_internal_fragmentation"])} never) and {free_part}.
"""


def split(reservation: float, internal: float) -> str:
    """How a reservation splits into slots still to fill and slots never filled (percentages,
    compared as printed)."""
    if compare(internal, 0, 1) == 0:
        return "no internal fragmentation"
    if compare(reservation, 0, 1) == 0:
        return "no reservation"
    if compare(internal, reservation, 1) > 0:
        return "more internal fragmentation than reservation"
    return "more reservation than internal fragmentation"


def split_sentence(rows: dict[str, Info]) -> str:
    """Whether each baseline's reservation and internal fragmentation split as the paper's do."""
    ours = {
        p: split(100 * r["share_reservation"], 100 * r["share_internal_fragmentation"])
        for p, r in rows.items()
    }
    paper = {
        p: split(FIG2_MEMORY_SHARES[p]["reservation"], FIG2_MEMORY_SHARES[p]["internal"])
        for p in rows
    }
    alike = [p for p in rows if ours[p] == paper[p]]
    unlike = [p for p in rows if ours[p] != paper[p]]
    parts = []
    if alike:
        detail = "; ".join(f"{short_label(p)}: {ours[p]}" for p in alike)
        scope = "" if not unlike else f" for {words([short_label(p) for p in alike])}"
        parts.append(f"split as in the paper{scope} ({detail})")
    if unlike:
        detail = "; ".join(
            f"{short_label(p)}: ours {ours[p]}, the paper's {paper[p]}" for p in unlike
        )
        parts.append(
            f"differently from the paper for {words([short_label(p) for p in unlike])} ({detail})"
        )
    return f"Reservation and internal fragmentation {', and '.join(parts)}."


def contiguous_bullet(rows: dict[str, Info]) -> tuple[str, dict[str, Sign]]:
    """Our baselines' token states against the paper's Fig. 2, the buddy allocator's external
    fragmentation, how close the paper's bars come to ours without it, and
    :func:`split_sentence`. Also returns, by policy, whether ours holds more token states."""
    ours = {p: 100 * r["share_token_states"] for p, r in rows.items()}
    paper = {p: FIG2_MEMORY_SHARES[p]["token_states"] for p in rows}
    signs: dict[str, Sign] = {p: compare(ours[p], paper[p], 1) for p in rows}
    groups = [
        (sign, [short_label(p) for p in rows if signs[p] == sign])
        for sign in dict.fromkeys(signs.values())
    ]
    (sign, names), rest = groups[0], groups[1:]
    subject = (
        "contiguous baselines hold"
        if not rest
        else f"{words(names)} {'baseline holds' if len(names) == 1 else 'baselines hold'}"
    )
    head = f"Our {subject} {amount(sign)} token states {than(sign)}" + "".join(
        f", our {words(others)} {amount(other)}" for other, others in rest
    )
    against = ", ".join(f"{short_label(p)} {pct(ours[p] / 100)} against {paper[p]}%" for p in rows)
    external = words([f"{FIG2_MEMORY_SHARES[p]['external']}% for {short_label(p)}" for p in rows])
    without = {
        p: 100 * FIG2_MEMORY_SHARES[p]["token_states"] / (100 - FIG2_MEMORY_SHARES[p]["external"])
        for p in rows
    }
    gap = max(points(without[p], 100 * r["utilization"]) for p, r in rows.items())
    near = (
        f"close to (within {gap:.1f} points of)"
        if gap <= CLOSE_POINTS
        else f"up to {gap:.1f} points from"
    )
    bars = words([f"{pct(without[p] / 100)} for {short_label(p)}" for p in rows])
    utilizations = words([pct(r["utilization"]) for r in rows.values()])
    text = f"""* **{head}** ({against}). The paper's Orca places reservations with a buddy
  allocator, whose holes are its "external fragmentation & others" (of memory: {external}).
  `ContiguousStore` packs reservations perfectly: any free slots take the next one. Without the
  external part, the paper's bars give {bars}, {near} our {utilizations} of the allocated slots.
  {split_sentence(rows)}
"""
    return text, signs


def oracle_bullet(paged: Info, oracle: Info, holds_more: bool) -> str:
    """Paging's batch over Oracle's against the paper's ratio; ``holds_more`` (our Oracle holds
    more token states than the paper's) makes it the consequence of the bullet before."""
    ours, paper = paged["mean_batch"] / oracle["mean_batch"], FIG13A_BATCH_RATIOS["orca-oracle"]
    sign = compare(ours, paper, 2)
    head = f"Paging's lead over Oracle is {word(sign, 'larger', 'smaller', 'the same')} here:"
    if sign < 0 and holds_more:
        head = "So p" + head[1:]
    why = (
        "A perfectly packed contiguous allocator is the best case for contiguous memory; a buddy"
        " allocator's holes would widen the gap."
        if sign < 0
        else "This is against a perfectly packed contiguous allocator, the best case for"
        " contiguous memory."
    )
    return f"* **{head}** {times(ours)} the batch, against the paper's {paper}x. {why}\n"


def max_bullet(paged: Info, top: Info) -> str:
    """Paging's batch over Max's against the paper's ratio, and which side of the ratio moved:
    Max's batch (fixed by the budget) or paging's."""
    ours, paper = paged["mean_batch"] / top["mean_batch"], FIG13A_BATCH_RATIOS["orca-max"]
    paper_batch = FIG13_MEAN_BATCH["sharegpt"]
    budget = top["budget_slots"]
    fits = f"{budget // OPT_MAX_LEN} x {OPT_MAX_LEN} slots fit in {budget:,}"
    sign = compare(ours, paper, 2)
    if compare(top["mean_batch"], paper_batch["orca-max"], 0) == 0:
        so = ", so the difference is paging's batch:" if sign != 0 else ";"
        max_part = (
            f"Max fits {top['mean_batch']:.0f} requests in both ({fits}; Fig. 13a prints"
            f" {paper_batch['orca-max']:.2f}){so}"
        )
    else:
        max_part = (
            f"Max averages {batch(top['mean_batch'])} requests here ({fits}) and"
            f" {paper_batch['orca-max']:.2f} in the paper's Fig. 13a;"
        )
    lead = word(sign, "larger", "smaller", "the same")
    return f"""* **Paging's lead over Max is {lead} here:** {times(ours)} against {paper}x.
  {max_part} vLLM averaged {paper_batch[PAGED]} requests
  in the paper where the simulator holds {batch(paged["mean_batch"])}. The paper averages at one
  request rate ({FIG13_REQUEST_RATES["sharegpt"]} requests/s) over the whole run, on a GPU that
  also spends time computing; we average only while requests wait for memory, which measures what
  the memory can hold. Our lengths are log-normal draws that match only the means of the real
  traces.
"""


def preemption_bullet(paged: Info, contiguous: dict[str, Info]) -> str:
    """Who preempted: paged growth runs out of blocks, contiguous reservations never grow."""
    preempted = {short_label(p): r["preemptions"] for p, r in contiguous.items()}
    counts = f"{paged['preemptions']} preemptions by recompute for {paged['finished']} requests"
    if any(preempted.values()):
        others = words([f"{name} {n}" for name, n in preempted.items()])
        return f"* **Preemptions:** paged {counts}; the contiguous baselines: {others}.\n"
    if paged["preemptions"] == 0:
        return "* **No policy preempts here:** paged growth always found free blocks.\n"
    return f"""* **Paging preempts; reservations never do.** Paged admission fills memory with young
  sequences, whose growth later runs out of blocks: {counts} (their recomputed tokens are in
  "tokens / step"). Contiguous reservations never grow, and none of them preempted.
"""


def alpaca_bullet(serving: Serving, max_num_seqs: int) -> str:
    """Whether paging's Alpaca-like batch reaches the scheduler's ``max_num_seqs`` (then its
    ratios are lower bounds), and whether the policies rank as in the paper's Fig. 13b."""
    alpaca = serving.get("alpaca", PAGED)
    if alpaca is None:
        return ""
    (sg_in, sg_out), (al_in, al_out) = FIG11_MEAN_LENGTHS["sharegpt"], FIG11_MEAN_LENGTHS["alpaca"]
    shorter = (sg_in + sg_out) / (al_in + al_out)
    head = (
        f"* **Alpaca-like requests are short** ({shorter:.1f}x shorter than ShareGPT-like on"
        " average, Fig. 11)"
    )
    order = ""
    if serving.compares_all("alpaca"):
        alike = same_order(batch_order(serving, "alpaca"), paper_batch_order("alpaca"), batch)
        order = (
            f"the policies rank {'as in' if alike else 'differently from'} the paper's"
            f" Fig. {FIG13_PANELS['alpaca']}"
        )
    if alpaca["peak_batch"] >= max_num_seqs:
        order = f"{order}, but" if order else ""
        return (
            f"{head}, so paging's batch reaches the scheduler's {max_num_seqs}-sequence limit"
            f" ({batch(alpaca['mean_batch'])} on average) before the memory runs out"
            f" ({pct(alpaca['share_unallocated'])} of it stays free): {order} paging's ratios"
            " over the contiguous policies there are lower bounds.\n"
        )
    order = f", and {order}" if order else ""
    return (
        f"{head}, yet paging's batch stays under the scheduler's {max_num_seqs}-sequence limit"
        f" (peak {alpaca['peak_batch']}): memory bounds it there too{order}.\n"
    )


def differences_section(run: Run) -> str:
    """The bullets above, for a run holding the four policies' ShareGPT-like runs."""
    serving = run.serving()
    if not serving.compares_all("sharegpt"):
        return ""
    rows = dict(serving.compared("sharegpt"))
    paged = rows[PAGED]
    contiguous = {p: rows[p] for p in CONTIGUOUS_BY_SIZE}
    config = ServingConfig()
    contiguous_text, signs = contiguous_bullet(contiguous)
    bullets = [
        paged_bullet(paged, config.watermark),
        contiguous_text,
        oracle_bullet(paged, rows["orca-oracle"], signs["orca-oracle"] > 0),
        max_bullet(paged, rows["orca-max"]),
        preemption_bullet(paged, contiguous),
        alpaca_bullet(serving, config.max_num_seqs),
    ]
    return "### Where our numbers differ from the paper's, and why\n\n" + "".join(bullets)
