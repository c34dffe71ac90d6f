"""Same-run A/B of the trace benchmark: this tree's store against its own variants, or against
another checkout, interleaved in one sitting.

``python -m bench.trace_ab [--base DIR] [--variants NAME ...] [--repeats N] [--rounds N]``

Each run is a fresh process that replays ``bench.bench_trace``'s seeded trace through the chosen
systems (asserting the floor's records, as the benchmark does) and reports the µs per step of
the fastest of ``--rounds`` replays: on a shared machine the least disturbed replay is the best
estimate of a system's own cost. The runs are interleaved (every variant once, then again,
``--repeats`` times), so a machine that gets busier or quieter affects each alike; the table is
the median over the repeats, with each system's ratio to the floor of the same variant.

Variants of this tree, each one path taken out of the store's growth (``docs/design.md`` §9
keeps a path only if the store step is more than 10% slower without it):

* ``current``: the code as it is;
* ``no-decode``: no decode branch of the plan (``growth.decode_plan``): every step reads the
  growth;
* ``no-vector-preempt``: no vectorized preemption plan (``growth.preemption_plan``): the
  planner's loop decides it;
* ``no-tail-flag`` (plain store): the decode shortcut reads the reference counts of the written
  last blocks instead of trusting the rows' tail-shared flags (which are still kept, so this
  bounds the flag's worth from above);
* ``no-live-batch``: the store's batch of every live sequence is rebuilt on every call.

``--base DIR`` adds ``base``: the same replays with ``pagedkv`` imported from ``DIR``, a checkout
of another commit (``git worktree add DIR REV``, or ``git archive REV | tar -x -C DIR``), and
``bench`` from there too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SYSTEMS = ("floor", "store", "scheduler", "floor-prefix", "store-prefix")
VARIANTS = (
    "current",
    "no-decode",
    "no-vector-preempt",
    "no-tail-flag",
    "no-live-batch",
)


def apply_variant(name: str) -> None:
    """Take one path out of this tree's store, in this process."""
    import pagedkv.impl.blocks.growth as growth
    import pagedkv.impl.blocks.rows as rows

    if name == "no-decode":
        growth.decode_plan = lambda *args: None  # type: ignore[assignment]
    elif name == "no-vector-preempt":
        growth.preemption_plan = lambda *args: None  # type: ignore[assignment]
    elif name == "no-tail-flag":
        decode = growth.decode_plan

        def unflagged(table_rows: Any, pool: Any, batch_rows: Any, base: Any) -> Any:
            counts = table_rows.token_counts.take(batch_rows)
            partial = counts % table_rows.block_size != 0
            lengths = table_rows.num_blocks.take(batch_rows[partial])
            last = table_rows.tables.take(base[partial] + lengths - 1)
            if last.size and pool.refs_of(last).max() > 1:  # a shared last block: plan it
                return None
            return decode(table_rows, pool, batch_rows, base)

        growth.decode_plan = unflagged  # type: ignore[assignment]
    elif name == "no-live-batch":
        resolve = rows.SeqRows.resolve

        def rebuilt(self: Any, seqs: Any) -> Any:
            return self.batch(list(self)) if seqs is None else resolve(self, seqs)

        rows.SeqRows.resolve = rebuilt  # type: ignore[method-assign]
    elif name != "current":
        raise ValueError(f"unknown variant {name!r}")


def child(variant: str, rounds: int, systems: list[str]) -> dict[str, float]:
    """Median µs per step of each system in each pool, for one variant, in this process."""
    import bench.bench_trace as trace

    if variant != "base":
        apply_variant(variant)
    result: dict[str, float] = {}
    for pool in ("roomy", "tight"):
        for system in systems:
            expected = trace.EXPECTED.of(system.endswith("prefix"), pool)
            times = []
            for _ in range(rounds):
                start = time.perf_counter()
                records = trace.run_system(system, pool)
                times.append(time.perf_counter() - start)
                assert records == expected, (system, pool)
            result[f"{pool} {system}"] = min(times) / len(records) * 1e6
    return result


def shim(base: Path) -> Path:
    """A folder holding a ``pagedkv`` package whose layers are ``base``'s folders."""
    folder = Path(tempfile.mkdtemp(prefix="pagedkv-base-"))
    package = folder / "pagedkv"
    package.mkdir()
    for entry in (base / "pagedkv").iterdir():
        (package / entry.name).symlink_to(entry)
    for layer in ("spec", "impl", "kernels"):
        (package / layer).symlink_to(base / layer)
    return folder


def run(variant: str, args: argparse.Namespace, base_path: str | None) -> dict[str, float]:
    command = [sys.executable, str(Path(__file__).resolve()), "--child", variant]
    command += ["--rounds", str(args.rounds), "--systems", *args.systems]
    env, cwd = dict(os.environ), ROOT
    env["PYTHONPATH"] = str(ROOT)
    if variant == "base":  # this file runs there too, importing the base's pagedkv and bench
        env["PYTHONPATH"] = base_path or ""
        cwd = args.base
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.trace_ab", description=__doc__)
    parser.add_argument("--base", type=Path, help="a checkout of another commit to compare")
    parser.add_argument("--variants", nargs="+", default=["current"], choices=VARIANTS)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.rounds, args.systems)))
        return
    variants = (["base"] if args.base else []) + args.variants
    base_path = f"{shim(args.base.resolve())}:{args.base.resolve()}" if args.base else None
    runs: dict[str, list[dict[str, float]]] = {variant: [] for variant in variants}
    for _ in range(args.repeats):
        for variant in variants:
            runs[variant].append(run(variant, args, base_path))
    keys = list(runs[variants[0]][0])
    print(f"{'µs per step (median of repeats)':<26}" + "".join(f"{v:>19}" for v in variants))
    for key in keys:
        medians = [statistics.median(r[key] for r in runs[v]) for v in variants]
        pool, system = key.split()
        floor = "floor-prefix" if system.endswith("prefix") else "floor"
        floors = [statistics.median(r[f"{pool} {floor}"] for r in runs[v]) for v in variants]
        cells = "".join(f"{m:9.1f} ({m / f:5.2f}x)" for m, f in zip(medians, floors, strict=True))
        print(f"{key:<26}{cells}")


if __name__ == "__main__":
    main()
