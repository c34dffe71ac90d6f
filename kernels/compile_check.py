"""The compile gate: every attention and store variant the launchers produce, compiled for GPUs.

``python -m pagedkv.kernels.compile_check`` needs no GPU and no driver. It builds each variant's
:class:`~pagedkv.kernels.launch_config.LaunchConfig` with the launchers' own pure functions
(``triton_decode.decode_config``, ``merge_config``, ``triton_prefill.prefill_config``,
``triton_store_kv.store_config``) over the
documented grid (:func:`variants`), compiles it ahead of time with ``triton.compile`` for sm_80,
sm_90 and sm_100 (where the wheel's ``ptxas`` knows it), and reads, per variant and target:

* registers and spill bytes from ``ptxas -v``, run on the PTX with the flags Triton itself uses;
* shared memory from the compiled kernel's metadata (Triton's dynamic shared memory) plus the
  static shared memory ``ptxas`` reports;
* the matrix instruction in the PTX (``mma.sync``/``wgmma`` with its operand types, or ``FMA``);
* the resident programs and occupancy that implies (``launch_config.programs_per_sm``).

It then checks the budgets of docs/kernels.md (:func:`budget_failures`) and exits 1 if one
fails. Triton decides interpreter or compiler when it is imported, so the work runs in a child
process started with ``TRITON_INTERPRET=0`` (:func:`measure`); ``--sample`` compiles the handful
of variants the quick test suite checks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedkv.kernels.compile_budgets import BUDGETED_HEAD_DIMS, budget_failures
from pagedkv.kernels.launch_config import (
    TARGETS,
    Call,
    LaunchConfig,
    occupancy,
    programs_per_sm,
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# fp8 caches, "query dtype+format", read by 16-bit queries (fp32 ones run FMA dots: not listed).
FP8_LABELS = tuple(f"{q}+{f}" for q in ("fp16", "bf16") for f in ("fp8_e4m3", "fp8_e5m2"))
LABELS = (*DTYPES, *FP8_LABELS)
REPORTED_HEAD_DIMS = (48, 256)
BLOCK_SIZES = tuple(2**i for i in range(9))  # 1 .. 256
GROUPS = (1, 4, 8)
PREFILL_CHUNKS = (16, 128, 512)
NUM_KV_HEADS = 8
CONTEXT = 32768  # the table's capacity and the longest context of the enumerated launches
SM_COUNT = 132  # an H100/H200's SMs: sizes the automatic split of the enumerated decode
# CI's long command compiles every dtype (each fp8 format with each query dtype), budgeted head
# dim and group at block size 16, on the gated targets; the whole grid (hours) runs by hand.
CI_HEAD_DIMS = BUDGETED_HEAD_DIMS
CI_LABELS = LABELS
CI_BLOCK_SIZES = (16,)
DECODE = "pagedkv.kernels.triton_decode"
PREFILL = "pagedkv.kernels.triton_prefill"
STORE = "pagedkv.kernels.triton_store_kv"


@dataclass(frozen=True)
class Variant:
    """One launch the launchers produce: which kernel module, its config, and its labels."""

    module: str  # the kernel's module: "pagedkv.kernels.triton_decode", ...
    kind: str  # "decode", "decode-split", "merge", "prefill", "contiguous", "store"
    dtype: str  # a label of LABELS: the query's dtype, and an fp8 cache's format after "+"
    head_dim: int
    block_size: int
    group: int
    config: LaunchConfig

    def key(self) -> str:
        """What the compiled code depends on: two variants with one key compile alike."""
        c = self.config
        return repr((c.kernel, c.signature, c.constexprs, c.hints(), c.options()))


@dataclass(frozen=True)
class Figures:
    """What one variant compiles to on one target."""

    target: int
    registers: int
    spill_stores: int
    spill_loads: int
    shared: int
    mma: str
    programs: int
    occupancy: float


@dataclass(frozen=True)
class Grid:
    """The enumerated configuration space (docs/kernels.md); a smaller one trims a run."""

    dtypes: tuple[str, ...] = LABELS
    head_dims: tuple[int, ...] = tuple(sorted(BUDGETED_HEAD_DIMS + REPORTED_HEAD_DIMS))
    block_sizes: tuple[int, ...] = BLOCK_SIZES
    groups: tuple[int, ...] = GROUPS


def variants(sample: bool = False, grid: Grid | None = None, capability: int = 90) -> list[Variant]:
    """The documented grid (or ``grid``), through the launchers' config functions for target
    ``capability``, one per distinct compile; with ``sample``, the few the quick suite
    compiles."""
    if sample:
        found = [
            decode_variant("fp16", 128, 16, 4, False, capability),
            decode_variant("bf16", 128, 16, 4, True, capability),
            prefill_variant("fp16", 128, 16, 4, 512, capability),
            decode_variant("fp32", 128, 16, 4, False, capability),
            decode_variant("fp16+fp8_e4m3", 128, 16, 4, False, capability),
            store_variant("fp16", 128),
            store_variant("fp16+fp8_e4m3", 128),
        ]
    else:
        found = list(grid_variants(grid or Grid(), capability))
    unique: dict[str, Variant] = {}
    for variant in found:
        unique.setdefault(variant.key(), variant)
    return list(unique.values())


def grid_variants(grid: Grid, capability: int) -> Iterator[Variant]:
    """Every launch of ``grid`` for ``capability``, duplicates included: per dtype and head dim
    the merge and the store, and per group the contiguous decode, then per block size the paged
    decode (one split and the automatic split) and the prefill of every chunk in
    ``PREFILL_CHUNKS``."""
    for dtype in grid.dtypes:
        for head_dim in grid.head_dims:
            yield merge_variant(dtype, head_dim)
            yield store_variant(dtype, head_dim)
            for group in grid.groups:
                for split in (False, True):
                    yield decode_variant(dtype, head_dim, 0, group, split, capability)
                for block_size in grid.block_sizes:
                    for split in (False, True):
                        yield decode_variant(dtype, head_dim, block_size, group, split, capability)
                    for chunk in PREFILL_CHUNKS:
                        yield prefill_variant(dtype, head_dim, block_size, group, chunk, capability)


def enumerated_call(
    dtype: str, head_dim: int, block_size: int, group: int, capability: int
) -> Call:
    """One sequence whose table spans ``CONTEXT`` tokens (block size 0: contiguous); ``dtype``
    is a label of ``LABELS``."""
    stride = CONTEXT // max(1, block_size)
    heads = group * NUM_KV_HEADS
    query, _, fp8 = dtype.partition("+")
    return Call(1, heads, NUM_KV_HEADS, head_dim, DTYPES[query], torch.int64, block_size, stride,
                capability, fp8=fp8 or None)  # fmt: skip


def decode_variant(
    dtype: str, head_dim: int, block_size: int, group: int, split: bool, capability: int
) -> Variant:
    """The decode launch of :func:`enumerated_call` (block size 0: the contiguous kernel), with
    one split or, with ``split``, the launcher's automatic split at the longest context."""
    from pagedkv.kernels import triton_decode

    num_splits = 1
    if split:
        num_splits = triton_decode.auto_num_splits(NUM_KV_HEADS, CONTEXT, SM_COUNT, 8)
    config = triton_decode.decode_config(
        enumerated_call(dtype, head_dim, block_size, group, capability),
        rows_per_seq=CONTEXT,
        paged=block_size > 0,
        max_tokens=CONTEXT,
        num_splits=num_splits,
    )
    kind = "contiguous" if block_size == 0 else "decode-split" if split else "decode"
    return Variant(DECODE, kind, dtype, head_dim, block_size, group, config)


def prefill_variant(
    dtype: str, head_dim: int, block_size: int, group: int, chunk: int, capability: int
) -> Variant:
    """The prefill launch of :func:`enumerated_call` for query chunks of up to ``chunk``."""
    from pagedkv.kernels import triton_prefill

    config = triton_prefill.prefill_config(
        enumerated_call(dtype, head_dim, block_size, group, capability),
        window=CONTEXT,
        max_query_len=chunk,
    )
    return Variant(PREFILL, "prefill", dtype, head_dim, block_size, group, config)


def merge_variant(dtype: str, head_dim: int) -> Variant:
    """The split-K merge of the automatic split at the longest context."""
    from pagedkv.kernels import triton_decode

    splits = triton_decode.auto_num_splits(NUM_KV_HEADS, CONTEXT, SM_COUNT, 8)
    query = DTYPES[dtype.partition("+")[0]]  # the merge reads no cache
    config = triton_decode.merge_config(
        batch=1, num_heads=NUM_KV_HEADS, head_dim=head_dim, dtype=query, num_splits=splits
    )
    return Variant(DECODE, "merge", dtype, head_dim, 0, 1, config)


def store_variant(dtype: str, head_dim: int) -> Variant:
    """``store_kv`` of a 512-token chunk's contiguous rows of the query dtype, into caches of
    that dtype or of the label's fp8 format."""
    from pagedkv.kernels import triton_store_kv

    query, _, fp8 = dtype.partition("+")
    rows, shape = DTYPES[query], (512, NUM_KV_HEADS, head_dim)
    strides = (NUM_KV_HEADS * head_dim, head_dim, 1) * 2
    config = triton_store_kv.store_config(shape, (rows, rows, torch.int64), strides, fp8 or None)
    return Variant(STORE, "store", dtype, head_dim, 0, 1, config)


def _tool(name: str) -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def targets_supported(wanted: tuple[int, ...]) -> tuple[int, ...]:
    """The targets of ``wanted`` that the wheel's ``ptxas`` can assemble for."""
    found = []
    for capability in wanted:
        ptxas = _tool("ptxas" if capability < 90 else "ptxas-blackwell")
        listing = subprocess.run([ptxas, "--help"], capture_output=True, text=True).stdout
        if f"sm_{capability}" in listing:
            found.append(capability)
    return tuple(found)


def compile_variant(variant: Variant, capability: int) -> Figures:
    """Compile ``variant`` for ``capability`` (no GPU) and read its figures."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    config = variant.config
    kernel = getattr(importlib.import_module(variant.module), config.kernel)
    divisible, ones = config.hints()
    signature = {**config.signature, **dict.fromkeys(config.constexprs, "constexpr")}
    constexprs = dict(config.constexprs)
    for name in ones:  # the JIT folds an integer argument equal to 1 into a constant
        signature[name] = "constexpr"
        constexprs[name] = 1
    names = kernel.arg_names
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(kernel, {name: signature[name] for name in names}, constexprs, attrs)
    gpu = GPUTarget("cuda", capability, 32)
    compiled = triton.compile(source, target=gpu, options=config.options())
    ptx = compiled.asm["ptx"]
    arch = f"sm_{capability}{'a' if capability >= 90 else ''}"  # Triton's own choice
    ptxas = _tool("ptxas" if capability < 90 else "ptxas-blackwell")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        log = subprocess.run(
            [ptxas, "-v", "--regAllocOptLevel=2", f"--gpu-name={arch}", str(path), "-o",
             str(path.with_suffix(".cubin"))],
            capture_output=True, text=True, check=True,
        ).stderr  # fmt: skip
    registers = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    static = re.search(r"(\d+) bytes smem", log)
    shared = compiled.metadata.shared + (int(static.group(1)) if static else 0)
    target = TARGETS[capability]
    programs = programs_per_sm(target, registers, shared, config.num_warps)
    return Figures(
        target=capability,
        registers=registers,
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        shared=shared,
        mma=matrix_instruction(ptx),
        programs=programs,
        occupancy=occupancy(target, programs, config.num_warps),
    )


def matrix_instruction(ptx: str) -> str:
    """The PTX's matrix instructions (``mma.sync.aligned.m16n8k16...f16`` on sm_80,
    ``wgmma.mma_async...`` on sm_90, ``tcgen05.mma...kind::f16`` on sm_100), or ``FMA`` when a
    dot was lowered to scalar fused multiply-adds, or ``-`` with no dot."""
    pattern = r"(?<![\w.])((?:tcgen05\.mma|wgmma\.mma_async|mma)\.[\w.:]+)"
    found = sorted(set(re.findall(pattern, ptx)))
    if found:
        return " ".join(found)
    return "FMA" if "fma.rn.f32" in ptx else "-"


def rows_of(variant: Variant, figures: Figures) -> dict:
    """One row of the report."""
    return {
        "kernel": variant.kind,
        "dtype": variant.dtype,
        "head_dim": variant.head_dim,
        "block_size": variant.block_size,
        "group": variant.group,
        "num_warps": variant.config.num_warps,
        "num_stages": variant.config.num_stages,
        "block_n": variant.config.constexprs.get("BLOCK_N"),
        **asdict(figures),
        **({"mma": "-"} if variant.kind in ("merge", "store") else {}),  # no tl.dot in them
    }


def compile_all(sample: bool, wanted: tuple[int, ...], grid: Grid | None = None) -> Iterator[dict]:
    """Every variant on every supported target, as report rows (in this process)."""
    for capability in targets_supported(wanted):
        for variant in variants(sample, grid, capability):
            yield rows_of(variant, compile_variant(variant, capability))


def measure(
    sample: bool = False, targets: tuple[int, ...] = (80, 90, 100), grid: Grid | None = None
) -> list[dict]:
    """Run the gate's compilation of ``grid`` (the whole documented grid by default) with
    ``TRITON_INTERPRET=0`` (whatever this process imported), one ``nice`` child process per
    target (compiles time nothing; benchmarks beside them do), and return their rows by target."""
    grid = grid or Grid()
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        children = []
        for target in targets:
            out = Path(tmp) / f"rows_{target}.json"
            command = ["nice", sys.executable, "-m", "pagedkv.kernels.compile_check"]
            command += ["--json", str(out), "--targets", str(target), "--no-budgets"]
            command += ["--dtypes", *grid.dtypes, "--head-dims", *map(str, grid.head_dims)]
            command += ["--block-sizes", *map(str, grid.block_sizes)]
            command += ["--groups", *map(str, grid.groups)]
            if sample:
                command.append("--sample")
            log = out.with_suffix(".log").open("w+")  # a file: a full pipe would stall the child
            child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            children.append((command, child, out, log))
        rows: list[dict] = []
        for command, child, out, log in children:
            with log:
                if child.wait():
                    log.seek(0)
                    raise subprocess.CalledProcessError(child.returncode, command, log.read())
            rows += json.loads(out.read_text())
        return rows


def markdown(rows: list[dict]) -> str:
    """The resource table of docs/kernels.md: per kernel, dtype, head dim and target, the
    range over block sizes and groups."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        key = (row["kernel"], row["dtype"], row["head_dim"], row["target"])
        groups.setdefault(key, []).append(row)
    lines = [
        "| kernel | dtype | D | target | warps | registers | spills (B) | shared (KB) | "
        "occupancy | MMA |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def span(values: list) -> str:
        low, high = min(values), max(values)
        return f"{low}" if low == high else f"{low}-{high}"

    for (kind, dtype, head_dim, target), group in sorted(groups.items()):
        shared = span([round(r["shared"] / 1024, 1) for r in group])
        occupancy_span = span([round(100 * r["occupancy"], 1) for r in group])
        mma = " ".join(sorted({short_mma(r["mma"]) for r in group}))
        lines.append(
            f"| {kind} | {dtype} | {head_dim} | sm_{target} | "
            f"{span([r['num_warps'] for r in group])} | {span([r['registers'] for r in group])} "
            f"| {span([r['spill_stores'] for r in group])} | {shared} | {occupancy_span}% "
            f"| {mma} |"
        )
    return "\n".join(lines)


def short_mma(mma: str) -> str:
    """``mma.m16n8k16 f16`` / ``wgmma f16`` / ``FMA``: the instruction and its operand type."""
    if mma in ("FMA", "-"):
        return mma
    if mma.startswith("tcgen05"):  # its operand types live in the instruction descriptor
        return "tcgen05 " + mma.split("kind::")[-1].split(".")[0]
    kinds = {"wgmma" if "mma_async" in part else "mma" for part in mma.split()}
    operand = next(t for t in ("bf16", "f16", "tf32", "f32") if f".{t}." in mma + ".")
    return "+".join(sorted(kinds)) + f" {operand}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", type=int, default=[80, 90, 100])
    parser.add_argument("--sample", action="store_true", help="only the quick suite's variants")
    parser.add_argument("--json", type=Path, help="write every row here")
    parser.add_argument("--markdown", action="store_true", help="print docs/kernels.md's table")
    parser.add_argument("--no-budgets", action="store_true", help="report only")
    parser.add_argument("--dtypes", nargs="+", default=list(Grid.dtypes), choices=list(LABELS))
    parser.add_argument("--head-dims", nargs="+", type=int, default=list(Grid.head_dims))
    parser.add_argument("--block-sizes", nargs="+", type=int, default=list(Grid.block_sizes))
    parser.add_argument("--groups", nargs="+", type=int, default=list(Grid.groups))
    args = parser.parse_args(argv)
    grid = Grid(
        tuple(args.dtypes), tuple(args.head_dims), tuple(args.block_sizes), tuple(args.groups)
    )
    if os.environ.get("TRITON_INTERPRET") != "0":  # triton must be imported compiling
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
        command = [sys.executable, "-m", "pagedkv.kernels.compile_check", *(argv or sys.argv[1:])]
        return subprocess.run(command, env=env).returncode
    import triton

    rows = []
    for row in compile_all(args.sample, tuple(args.targets), grid):
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        print(markdown(rows))
    print(f"triton {triton.__version__}: {len(rows)} compiles")
    failures = [] if args.no_budgets else budget_failures(rows)
    for failure in failures:
        print("BUDGET", failure)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
