"""The engine fault machine injects at every seam a real step crosses, and only there: the seams
traced on each backend (``properties/seams.py``) must equal ``properties/fault_seams.txt``.
Triton's interpreter is traced in a subprocess: ``TRITON_INTERPRET`` must be set before triton
is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from pagedkv.impl.blocks.store import BlockTableStore
from properties.seams import listed_seams, trace_engine
from properties.test_faults import STORE_CALLS

ROOT = Path(__file__).resolve().parents[1]


def test_the_machine_injects_at_every_traced_seam_and_no_other() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "properties.seams", "triton"]
    out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    traced = trace_engine("numba") | trace_engine("reference")
    traced |= {tuple(line.split()) for line in out.stdout.splitlines()}  # type: ignore[misc]
    listed = listed_seams()
    assert not traced - listed, f"seams no machine injects at: {sorted(traced - listed)}"
    assert not listed - traced, f"listed seams no step reaches: {sorted(listed - traced)}"


def test_the_scheduler_machine_faults_every_store_method_the_step_calls() -> None:
    """The fast machine's store wraps every store method a traced step calls (the engine
    machine faults the properties it reads)."""
    prefix = "pagedkv.impl.blocks.store:BlockTableStore."
    called = {
        callee.removeprefix(prefix) for _, callee in listed_seams() if callee.startswith(prefix)
    }
    methods = {name for name in called if not isinstance(getattr(BlockTableStore, name), property)}
    assert methods <= set(STORE_CALLS), sorted(methods - set(STORE_CALLS))
