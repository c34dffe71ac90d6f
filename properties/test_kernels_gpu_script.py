"""The CUDA benchmark script (``bench/gpu_kernels.py``) works end to end in its small CPU mode:
decode and prefill sweeps, and an engine step whose tokens equal the dense oracle's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu_kernels

ROOT = Path(__file__).resolve().parent.parent


def test_small_sweep_writes_a_complete_report(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    argv = ["--small", "--no-tests", "--batches", "2", "--contexts", "33", "--out", str(out)]
    assert gpu_kernels.main([*argv, "--block-sizes", "1,16,256"]) == 0
    report = json.loads(out.read_text())
    assert report["complete"] and report["out_of_tolerance"] == 0
    measured = {(m["kernel"], m["block_size"]) for m in report["measurements"]}
    assert measured == {("contiguous", None), ("sdpa", None), ("prefill-sdpa", None)} | {
        ("paged", bs) for bs in (1, 16, 256)
    } | {("paged-fp8", bs) for bs in gpu_kernels.FP8_BLOCK_SIZES} | {
        (kernel, bs) for kernel in ("prefill", "prefill-fp8")
        for bs in gpu_kernels.PREFILL_BLOCK_SIZES_SMALL
    }  # fmt: skip
    assert report["launch"]["decode float16"]["block_n"] == 16  # the tile table's rows
    assert report["launch"]["decode float16 fp8"]["num_stages"] == 1
    step = report["engine_step"]
    assert len(step["decode_step_ms"]) == gpu_kernels.ENGINE_STEPS
    assert step["tokens_equal_dense"] == gpu_kernels.ENGINE_SMALL["batch"]
    assert set(report["goals"]) == {
        "paged_within_10pct_of_contiguous_bs_ge_16",
        "peak_fraction_ge_70pct_at_context_33",
    }


@pytest.mark.long  # the script runs the kernel property files before its sweep
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the script runs for real")
def test_script_command_line_runs_tests_then_sweep(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    command = [sys.executable, str(ROOT / "bench" / "gpu_kernels.py"), "--small", "--out", str(out)]
    command += ["--batches", "1", "--contexts", "16", "--block-sizes", "1,256"]
    # Not from the repository root, whose top-level folders would shadow installed names.
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    assert report["property_tests"]["exit_code"] == 0
    assert report["complete"]
