"""pytest-benchmark settings for ``bench/``: a stable ``machine_info`` and groups in natural order.

The workflow (README, "Did a change move utilization or latency?")::

    pytest bench --benchmark-save=baseline                          # before a change
    pytest bench --benchmark-compare --benchmark-save=change        # after it
    python bench/report.py --diff                                   # what moved beyond its band

``--benchmark-compare`` warns when the saved run's ``machine_info`` differs from this run's.
pytest-benchmark's default holds values that change between two runs on the same machine (the
host name, the kernel release of a fresh VM, the CPU's current clock, the interpreter's build
date), so every comparison would warn. :func:`stable_machine_info` keeps what a timing depends
on, and adds the torch version and the device. Groups are ordered by their numbers
(``attention-bs2`` before ``attention-bs16``), so tables grouped by block size read in order.
"""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from typing import Any

import pytest_benchmark.plugin

STABLE_KEYS = ("machine", "system", "python_implementation", "python_version")
STABLE_CPU_KEYS = ("arch", "brand_raw", "count")


def stable_machine_info(machine_info: dict[str, Any]) -> dict[str, Any]:
    """The keys of pytest-benchmark's ``machine_info`` that are the same on every run on one
    machine, plus ``torch`` (the installed version) and ``device``."""
    cpu = machine_info.get("cpu", {})
    return {
        **{key: machine_info[key] for key in STABLE_KEYS if key in machine_info},
        "cpu": {key: cpu[key] for key in STABLE_CPU_KEYS if key in cpu},
        "torch": version("torch"),
        "device": device_name(),
    }


def device_name() -> str:
    """The CUDA device the benchmarks could use, or ``cpu``. Benchmarks that use torch have
    imported it by the time machine_info is made; importing it here only for this (2 s) would
    tax runs that never touch it."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return "cpu"


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that compares runs of digits as numbers: ``bs2 < bs16 < bs128``."""
    return tuple(
        (0, int(part)) if part.isdigit() else (1, part) for part in re.split(r"(\d+)", text)
    )


def pytest_benchmark_update_machine_info(config: Any, machine_info: dict[str, Any]) -> None:
    stable = stable_machine_info(machine_info)
    machine_info.clear()
    machine_info.update(stable)


def pytest_benchmark_group_stats(
    config: Any, benchmarks: list[dict[str, Any]], group_by: str
) -> list[tuple[str | None, list[dict[str, Any]]]]:
    groups = pytest_benchmark.plugin.pytest_benchmark_group_stats(config, benchmarks, group_by)
    return sorted(groups, key=lambda pair: natural_key(pair[0] or ""))
