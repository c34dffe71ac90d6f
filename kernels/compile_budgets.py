"""The compile gate's budgets (docs/kernels.md): what every compiled kernel variant (attention
and store) must meet, read from the gate's report rows (``compile_check``), one failure line per
broken rule."""

from __future__ import annotations

BUDGETED_HEAD_DIMS = (64, 80, 96, 128)
GATED_TARGETS = (80, 90)  # the targets whose budgets fail the gate; sm_100 is reported
DECODE_OCCUPANCY = {80: 0.3125, 90: 0.4375}  # at D128: at least vLLM 0.32's best (results.md)
QUERIES, FORMATS = ("fp16", "bf16"), ("fp8_e4m3", "fp8_e5m2")
# Where an fp8 cache's launch does not yet reach the occupancy of its query dtype's cache (issue
# 34's budget), the floor it keeps instead, by (kernel, query dtype, format, head dim, target):
# a ratchet (docs/kernels.md, "fp8 caches in the kernels").
FP8_SHORTFALLS: dict[tuple[str, str, str, int, int], float] = {
    **{("decode", "bf16", f, d, 90): 0.5 for f in FORMATS for d in (80, 96)},
    **{("prefill", "bf16", f, d, 80): 0.25 for f in FORMATS for d in (80, 96, 128)},  # GQA 8
    **{("prefill", "fp16", "fp8_e4m3", d, 90): 0.25 for d in (80, 96)},
}


def budget_failures(rows: list[dict]) -> list[str]:
    """The budgets of docs/kernels.md that ``rows`` break, one line each (empty: all hold).

    On sm_80 and sm_90, at the budgeted head dims: no spills (every dtype); for fp16 and bf16
    queries a 16-bit ``mma`` or ``wgmma`` (no TF32, no FMA), decode at head dim 128 at least
    ``DECODE_OCCUPANCY``, and on an fp8 cache at least the occupancy of the same launch on the
    query dtype's own cache (``FP8_SHORTFALLS`` where that is not reached yet), which ``rows``
    must hold. Head dims 48 and 256 are reported, not budgeted."""
    own = {same_launch(row): row["occupancy"] for row in rows if "+" not in row["dtype"]}
    failures = []
    for row in rows:
        if row["target"] not in GATED_TARGETS or row["kernel"] == "merge":
            continue
        name = (
            f"{row['kernel']} {row['dtype']} D{row['head_dim']} block {row['block_size']} "
            f"group {row['group']} sm_{row['target']}"
        )
        budgeted = row["head_dim"] in BUDGETED_HEAD_DIMS
        spilled = row["spill_stores"] or row["spill_loads"]
        if spilled and budgeted:
            failures.append(f"{name}: spills {row['spill_stores']} bytes")
        query, _, fp8 = row["dtype"].partition("+")
        if query == "fp32" or not budgeted:
            continue
        operands = "f16.f16" if query == "fp16" else "bf16.bf16"
        attention = row["kernel"] != "store"
        if attention and (operands not in row["mma"] or "tf32" in row["mma"]):
            failures.append(f"{name}: not a native 16-bit MMA ({row['mma']})")
        floor = DECODE_OCCUPANCY.get(row["target"], 0.0)
        decode = row["kernel"] in ("decode", "decode-split")
        if decode and row["head_dim"] == 128 and row["occupancy"] < floor:
            failures.append(f"{name}: occupancy {row['occupancy']:.1%} < {floor:.1%}")
        if fp8:
            failures += fp8_failures(row, name, own.get(same_launch(row, query)))
    return failures


def fp8_failures(row: dict, name: str, own_cache: float | None) -> list[str]:
    """An fp8 row's occupancy against ``own_cache``, the same launch's on its query dtype's
    cache (``None``: not in the rows, a failure), or its ``FP8_SHORTFALLS`` floor."""
    query, _, fmt = row["dtype"].partition("+")
    if own_cache is None:
        return [f"{name}: no {query} row to compare with (compile --dtypes {query} too)"]
    kind = row["kernel"] if row["kernel"] in ("prefill", "store") else "decode"
    floor = FP8_SHORTFALLS.get((kind, query, fmt, row["head_dim"], row["target"]), own_cache)
    if row["occupancy"] < min(own_cache, floor):
        return [f"{name}: occupancy {row['occupancy']:.1%} < the {query} cache's {own_cache:.1%}"]
    return []


def same_launch(row: dict, dtype: str | None = None) -> tuple:
    """What identifies a report row's launch, its dtype label replaced by ``dtype`` if given."""
    keys = ("kernel", "head_dim", "block_size", "group", "target")
    return (dtype or row["dtype"], *(row[key] for key in keys))
