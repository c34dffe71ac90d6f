"""Properties of the backend choice: the interpreter switch cannot be got wrong by import order.

Each import scenario runs in a fresh Python process, because Triton decides interpreter versus
compiler once per process, when it decorates functions.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.kernels.backend import BACKEND_ENV, INTERPRET_ENV, resolve_backend

ROOT = Path(__file__).resolve().parent.parent
CPU = torch.device("cpu")
CUDA = torch.device("cuda")

# A tiny triton-backend call on CPU tensors, then a reference one; prints what it saw.
PROBE = """
import os, torch
{before}
from pagedkv import kernels
tables = torch.tensor([[2, 0]], dtype=torch.int32)
print("env", os.environ.get("TRITON_INTERPRET"))
print("reference", kernels.slot_mapping(tables, torch.tensor([5]), 4, backend="reference").item())
try:
    print("triton", kernels.slot_mapping(tables, torch.tensor([5]), 4, backend="triton").item())
except RuntimeError as error:
    print("error", error)
"""


def probe(before: str = "", **env: str) -> dict[str, str]:
    """Run ``PROBE`` in a fresh interpreter with ``env`` (and no inherited choices)."""
    clean = {k: v for k, v in os.environ.items() if k not in (INTERPRET_ENV, BACKEND_ENV)}
    result = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before)],
        cwd=ROOT,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return dict(line.split(" ", 1) for line in result.stdout.splitlines())


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only import behaviour")


@cpu_only
def test_fresh_import_on_cpu_turns_the_interpreter_on() -> None:
    seen = probe()
    assert seen == {"env": "1", "reference": "1", "triton": "1"}


@cpu_only
def test_triton_imported_first_still_works_when_the_user_set_the_variable() -> None:
    seen = probe(before="import triton", TRITON_INTERPRET="1")
    assert seen["triton"] == "1"


@cpu_only
def test_triton_imported_first_gives_a_clear_error_not_a_crash() -> None:
    seen = probe(before="import triton.language")
    assert seen["reference"] == "1"
    assert "triton was imported before kernels" in seen["error"]


@cpu_only
def test_the_user_can_turn_the_interpreter_off() -> None:
    seen = probe(TRITON_INTERPRET="0")
    assert seen["env"] == "0"
    assert seen["reference"] == "1"
    assert "needs CUDA tensors" in seen["error"]


def test_auto_picks_triton_for_cuda_tensors_and_the_reference_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, CUDA) == "triton"
    assert resolve_backend("auto", CPU) == "reference"
    assert resolve_backend("reference", CUDA) == "reference"


def test_the_argument_beats_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert resolve_backend(None, CUDA) == "reference"
    assert resolve_backend("triton", CUDA) == "triton"


def test_unknown_backend_names_are_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", CPU)
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend(None, CPU)
