"""Properties of the backend choice: the interpreter rule, import hygiene, triton optional. Each
runs in a fresh process (Triton picks interpreter or compiler once, when imported) in a temporary
directory (the repository root's top-level folders would shadow installed names)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedkv.kernels.backend import BACKEND_ENV, INTERPRET_ENV, resolve_backend

CPU = torch.device("cpu")
CUDA = torch.device("cuda")

# A reference call, then a tiny triton-backend call on CPU tensors; reports what it saw as JSON.
PROBE = """
import json, os, sys, torch
{before}
from pagedkv import kernels
seen = {{"env_at_import": os.environ.get("TRITON_INTERPRET")}}
tables = torch.tensor([[2, 0]], dtype=torch.int32)
seen["reference"] = kernels.slot_mapping(tables, torch.tensor([5]), 4, backend="reference").item()
seen["triton_after_reference"] = "triton" in sys.modules
try:
    seen["triton"] = kernels.slot_mapping(tables, torch.tensor([5]), 4, backend="triton").item()
except RuntimeError as error:
    seen["error"] = str(error)
seen["env"] = os.environ.get("TRITON_INTERPRET")
seen["interpreter"] = kernels.interpreter_active()
print(json.dumps(seen))
"""

# Every public kernel on small CPU inputs, returning its outputs and the caches it wrote.
EVERY_KERNEL = """
import torch
from pagedkv import kernels

def every_kernel(b):
    gen = torch.Generator().manual_seed(0)
    kc, vc = (torch.randn(3, 4, 2, 8, generator=gen) for _ in "kv")
    key, value = (torch.randn(2, 2, 8, generator=gen) for _ in "kv")
    q = torch.randn(2, 4, 8, generator=gen)
    tables = torch.tensor([[2, 0], [1, -1]], dtype=torch.int32)
    lens = torch.tensor([5, 3])
    calls = {
        "slot_mapping": lambda: kernels.slot_mapping(tables, lens - 1, 4, num_blocks=3, backend=b),
        "store_kv": lambda: kernels.store_kv(key, value, kc, vc, torch.tensor([4, 6]), backend=b),
        "paged_decode_attention": lambda: kernels.paged_decode_attention(
            q, kc, vc, tables, lens, backend=b
        ),
        "contiguous_decode_attention": lambda: kernels.contiguous_decode_attention(
            q, kc[:2], vc[:2], lens - 1, backend=b
        ),
        "copy_blocks": lambda: kernels.copy_blocks(kc, vc, [(2, 1)], backend=b),
    }
    results = {}
    for name, call in calls.items():
        try:
            results[name] = (call(), kc.clone(), vc.clone())
        except Exception as error:
            results[name] = error
    return results
"""

# Hides triton from import, the two ways a test can: a finder that refuses it, or a None entry.
HIDE_TRITON = {
    "finder": """
import importlib.abc, sys
class HideTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] == "triton":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, HideTriton())
""",
    "sys.modules": "import sys; sys.modules['triton'] = None",
}

WITHOUT_TRITON = """
import json, sys, torch
{hide}
{every_kernel}
reference, auto, triton = (every_kernel(b) for b in ("reference", "auto", "triton"))
print(json.dumps({{
    "reference_ran": [n for n, r in reference.items() if not isinstance(r, Exception)],
    "auto_matches_reference": [
        n for n, r in auto.items()
        if not isinstance(r, Exception) and all(
            (a is None and b is None) or torch.allclose(a, b, atol=1e-5, rtol=1e-5)
            for a, b in zip(r, reference[n])
        )
    ],
    "triton_errors": {{n: [type(e).__name__, str(e)] for n, e in triton.items()}},
    "triton_imported": "triton" in sys.modules and sys.modules["triton"] is not None,
}}))
"""


def run_fresh(code: str, cwd: Path, **env: str) -> dict[str, object]:
    """The JSON object ``code`` prints last, run fresh in ``cwd`` with ``env`` (none inherited)."""
    clean = {k: v for k, v in os.environ.items() if k not in (INTERPRET_ENV, BACKEND_ENV)}
    command = [sys.executable, "-c", code]
    result = subprocess.run(
        command, cwd=cwd, env={**clean, **env}, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads(result.stdout.splitlines()[-1])


cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only import behaviour")


def test_importing_kernels_imports_no_triton_and_writes_no_environment(tmp_path: Path) -> None:
    """On every machine, GPU ones included."""
    code = """
import json, os, sys
before = dict(os.environ)
import pagedkv.kernels
print(json.dumps({"triton": "triton" in sys.modules, "env_unchanged": dict(os.environ) == before}))
"""
    assert run_fresh(code, tmp_path) == {"triton": False, "env_unchanged": True}


# (statements before the probe, TRITON_INTERPRET or None, what it must see; "error": words)
PROBES = {
    "the first triton call on CPU turns the interpreter on": ("", None, {
        "env_at_import": None, "reference": 1, "triton_after_reference": False, "triton": 1,
        "env": "1", "interpreter": True,
    }),
    "triton imported first works when the user set the variable": (
        "import triton", "1", {"triton": 1, "interpreter": True}
    ),
    "triton imported first gives a clear error, not a crash": ("import triton.language", None, {
        "reference": 1, "error": "triton was imported before the interpreter was chosen",
        "env": None,  # the rule writes nothing once triton is imported
    }),
    "the user can turn the interpreter off": ("", "0", {
        "env": "0", "reference": 1, "error": "needs CUDA tensors", "interpreter": False,
    }),
    "use_interpreter before triton is imported turns it on": (
        "from pagedkv import kernels; kernels.use_interpreter(); import triton", "0",
        {"triton": 1, "interpreter": True},
    ),
    "use_interpreter after triton is imported raises": (
        "import triton\nfrom pagedkv import kernels\ntry: kernels.use_interpreter()\n"
        "except RuntimeError as e: print(json.dumps({'error': str(e)})); sys.exit()", "0",
        {"error": "must be called before triton is imported"},
    ),
}  # fmt: skip


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n.startswith("use_") else cpu_only) for n in PROBES]
)
def test_the_interpreter_rule(name: str, tmp_path: Path) -> None:
    before, interpret, expected = PROBES[name]
    env = {} if interpret is None else {"TRITON_INTERPRET": interpret}
    seen = run_fresh(PROBE.format(before=before), tmp_path, **env)
    assert ("error" in seen) == ("error" in expected)
    for key, want in expected.items():
        assert want in str(seen[key]) if key == "error" else seen[key] == want, key


@pytest.mark.parametrize("hide", sorted(HIDE_TRITON))
def test_without_triton_the_reference_runs_and_triton_says_it_is_missing(
    hide: str, tmp_path: Path
) -> None:
    code = WITHOUT_TRITON.format(hide=HIDE_TRITON[hide], every_kernel=EVERY_KERNEL)
    seen = run_fresh(code, tmp_path)
    names = "slot_mapping store_kv paged_decode_attention contiguous_decode_attention copy_blocks"
    names = names.split()
    assert seen["reference_ran"] == names
    assert seen["auto_matches_reference"] == names  # auto is numba on CPU: fp32 sums reordered
    errors = seen["triton_errors"]
    assert isinstance(errors, dict) and sorted(errors) == sorted(names)
    for kind, message in errors.values():
        assert kind == "RuntimeError"
        assert "triton is not installed" in message
        assert "backend='reference'" in message
    assert seen["triton_imported"] is False


def test_resolve_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto``: Triton on CUDA, numba on CPU; the argument beats the environment; unknown fail."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert resolve_backend(None, CUDA) == "triton"
    assert resolve_backend("auto", CPU) == "numba"
    assert resolve_backend("reference", CUDA) == "reference"
    with pytest.raises(RuntimeError, match="numba backend runs on CPU tensors only"):
        resolve_backend("numba", CUDA)
    with pytest.raises(ValueError, match="backend must be one of"):
        resolve_backend("cuda", CPU)
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert resolve_backend(None, CUDA) == "reference"
    assert resolve_backend("triton", CUDA) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        resolve_backend(None, CPU)


NUMBA_HIDDEN = """
import json, sys, torch
sys.modules["numba"] = None
from pagedkv.kernels import resolve_backend
try:
    resolve_backend("numba", torch.device("cpu"))
    error = None
except RuntimeError as caught:
    error = str(caught)
print(json.dumps({"auto": resolve_backend("auto", torch.device("cpu")), "error": error}))
"""


def test_without_numba_auto_picks_the_reference_and_numba_says_it_is_missing(
    tmp_path: Path,
) -> None:
    seen = run_fresh(NUMBA_HIDDEN, tmp_path)
    assert seen["auto"] == "reference"
    assert "numba package, which does not import here" in str(seen["error"])
