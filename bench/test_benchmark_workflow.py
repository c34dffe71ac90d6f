"""The documented compare works.

pytest-benchmark's own, on a tiny benchmark in a temporary directory: ``pytest
--benchmark-save=baseline``, then ``pytest --benchmark-compare
--benchmark-compare-fail=median:15%``: the second run compares without a machine_info warning
and passes, and fails once the benchmark is made slower. Each run is a fresh pytest process
with ``bench/conftest.py`` loaded as a plugin (``-p bench.conftest``), as ``pytest bench``
loads it. The benchmark sleeps, so its median is stable to well under 15%. Then README's whole
compare (``report.py --diff``) on the real attention and decode-step benchmarks, against a
planted slowdown (long).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pytest_benchmark.plugin import pytest_benchmark_generate_machine_info

from bench.conftest import natural_key, stable_machine_info
from bench.reporting.diff import plain_environment, retimed, this_tree_ran, timings_moved
from bench.reporting.noise import beyond_bands, not_compared
from bench.reporting.run import Run

ROOT = Path(__file__).resolve().parent.parent

TINY_BENCH = """
import os
import time

DELAY = float(os.environ["BENCH_DELAY"])


def test_sleep(benchmark):
    benchmark.group = "sleep-bs16"
    benchmark.extra_info["delay"] = DELAY
    benchmark.pedantic(time.sleep, args=(DELAY,), rounds=5, iterations=1)
"""


def pytest_run(directory: Path, delay: float, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**plain_environment(), "BENCH_DELAY": str(delay), "PYTHONPATH": str(ROOT)}
    plugins = ["-p", "bench.conftest", "-p", "no:cacheprovider", "-p", "no:hypothesispytest"]
    command = [sys.executable, "-m", "pytest", *plugins]
    return subprocess.run(
        [*command, "bench_tiny.py", "--benchmark-storage=storage", *args],
        cwd=directory,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "bench_tiny.py").write_text(TINY_BENCH)
    return tmp_path


def test_save_then_compare_passes_and_a_slowdown_fails(project: Path) -> None:
    saved = pytest_run(project, 0.002, "--benchmark-save=baseline")
    assert saved.returncode == 0, saved.stdout + saved.stderr
    (baseline,) = project.glob("storage/*/0001_baseline.json")
    machine_info = json.loads(baseline.read_text())["machine_info"]
    assert "node" not in machine_info and "torch" in machine_info

    compare = ["--benchmark-compare", "--benchmark-compare-fail=median:15%"]
    same = pytest_run(project, 0.002, *compare)
    output = same.stdout + same.stderr
    assert same.returncode == 0, output
    assert "Comparing against benchmarks from" in output
    assert "machine_info is different" not in output

    slower = pytest_run(project, 0.004, *compare)
    assert slower.returncode != 0
    assert "Performance has regressed" in slower.stdout + slower.stderr


def test_machine_info_keeps_only_what_is_the_same_on_every_run() -> None:
    raw: dict[str, Any] = pytest_benchmark_generate_machine_info()
    rebooted = {
        **raw,
        "node": "another-host",
        "release": "9.9.9",
        "python_build": ["main", "Jan  1 2030 00:00:00"],
        "cpu": {**raw["cpu"], "hz_actual": [1, 0], "hz_actual_friendly": "1 Hz"},
    }
    assert stable_machine_info(raw) == stable_machine_info(rebooted)
    assert stable_machine_info(raw)["python_version"] == raw["python_version"]


def test_groups_sort_by_their_numbers() -> None:
    names = ["attention-bs16", "attention-bs2", "attention-bs128", "decode-bs4-batch32"]
    assert sorted(names, key=natural_key) == [
        "attention-bs2",
        "attention-bs16",
        "attention-bs128",
        "decode-bs4-batch32",
    ]


SLOWER_ATTENTION = '''
"""A planted slowdown: paged decode attention spins half its own time after each call."""
import time

from pagedkv import kernels

original = kernels.paged_decode_attention


def slower(*args, **kwargs):
    start = time.perf_counter()
    out = original(*args, **kwargs)
    until = time.perf_counter() + 0.5 * (time.perf_counter() - start)
    while time.perf_counter() < until:
        pass
    return out


kernels.paged_decode_attention = slower
'''

COMPARED = ("bench/bench_attention.py", "bench/bench_block_manager.py")
SELECTED = "test_decode_attention or test_decode_step"


def bench_run(storage: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pytest`` over :data:`COMPARED` (the cases :data:`SELECTED`) from the repository root,
    its runs saved under ``storage``."""
    command = [sys.executable, "-m", "pytest", *COMPARED, "-k", SELECTED, "-m", "not long"]
    command += ["-p", "no:cacheprovider", f"--benchmark-storage={storage}", *args]
    return subprocess.run(
        command, cwd=ROOT, env=plain_environment(), capture_output=True, text=True, timeout=900
    )


def flagged_slower(
    old: Run, new: Run, expected: set[str], monkeypatch: pytest.MonkeyPatch
) -> set[str]:
    """The benchmarks (full names) ``report.py --diff``'s compare flags slower from ``old`` to
    ``new``, ``new``'s flagged ones timed again as it does. A two-run compare is only as good as
    its old run, which it cannot time again (README; seen: one case's paired ratio 30 to 40% off in
    one of four runs, either way): where the verdict is not ``expected``, those cases' old figure
    is taken once more (this tree, nothing planted) and the compare made again against it."""
    slower = {name for name, _, ratio, _ in timings_moved(old, new, retime=True) if ratio > 1}
    wrong = sorted(slower ^ expected)
    if not wrong:
        return slower
    with monkeypatch.context() as unplanted:
        unplanted.delenv("PYTEST_PLUGINS", raising=False)
        old_again = retimed(wrong, times=1)[0]
    again = {name for name, _, ratio, _ in timings_moved(old_again, new, retime=True) if ratio > 1}
    return (slower - set(wrong)) | again


@pytest.mark.long
@pytest.mark.alone  # its timings move with whatever runs on the other core
def test_the_documented_compare_flags_a_planted_slowdown_where_it_runs_and_nowhere_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Baseline, then the same code, then paged attention 50% slower (a plugin every pytest
    process loads, re-timings included): ``report.py --diff`` (the README's compare) flags
    nothing in the second and, in the third, exactly the paged-attention benchmarks, slower."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(tmp_path)]))
    (tmp_path / "planted_slowdown.py").write_text(SLOWER_ATTENTION)
    storage = tmp_path / "storage"
    baseline = bench_run(storage, "--benchmark-save=baseline")
    assert baseline.returncode == 0, baseline.stdout[-3000:] + baseline.stderr[-3000:]
    same = bench_run(storage, "--benchmark-save=same", "--benchmark-compare")
    assert same.returncode == 0, same.stdout[-3000:]
    runs = [Run.load(path) for path in sorted(storage.glob("*/*.json"))]
    assert this_tree_ran(runs[1])
    assert flagged_slower(*runs, expected=set(), monkeypatch=monkeypatch) == set()

    monkeypatch.setenv("PYTEST_PLUGINS", "planted_slowdown")
    planted = bench_run(storage, "--benchmark-save=planted", "--benchmark-compare")
    assert planted.returncode == 0, planted.stdout[-3000:]
    planted_run = Run.load(next(storage.glob("*/0003_planted.json")))
    attention = {
        b["fullname"] for b in runs[0].benchmarks if b["name"].startswith("test_decode_attention")
    }
    decode_steps = [b for b in planted_run.benchmarks if b["name"].startswith("test_decode_step")]
    assert len(attention) == 27 and len(decode_steps) == 45
    flagged = flagged_slower(runs[1], planted_run, attention, monkeypatch)
    assert flagged == attention, sorted(flagged ^ attention)


def timed(name: str, low: float, paired: float | None = None) -> dict[str, Any]:
    """A benchmark as a saved run holds it: ``min`` and, if given, ``paired_ratio``."""
    info = {"paired_ratio": paired} if paired is not None else {}
    return {
        "fullname": f"bench/b.py::{name}",
        "stats": {"min": low, "median": low},
        "extra_info": info,
    }


def run_of(*benchmarks: dict[str, Any]) -> Run:
    return Run(list(benchmarks), {}, {}, "", "hand-built")


def test_a_timing_is_compared_where_both_runs_timed_it_and_nan_is_flagged() -> None:
    """The figure is ``paired_ratio`` only where both runs have one, else ``min``; a NaN figure
    is flagged; a benchmark one run lacks is listed, not compared."""
    old = run_of(timed("test_a", 1.0), timed("test_b", 1.0, 1.0), timed("test_gone", 1.0))
    new = run_of(timed("test_a", 1.05, paired=9.0), timed("test_b", 3.0, 1.5), timed("test_c", 1.0))
    flagged = beyond_bands(old, [new], {})
    assert [(name.rsplit("::")[-1], key) for name, key, _, _ in flagged] == [
        ("test_b", "paired_ratio")
    ]
    nan = beyond_bands(old, [run_of(timed("test_a", math.nan))], {})
    assert [key for _, key, _, _ in nan] == ["min"]
    assert [n.rsplit("::")[-1] for n in not_compared(old, new)] == ["test_gone", "test_c"]
    steady = beyond_bands(
        old, [new, run_of(timed("test_b", 3.0, 1.0)), run_of(timed("test_b", 3.0, 1.02))], {}
    )
    assert steady == []  # the median of three paired ratios is 1.02: within the 10% floor
