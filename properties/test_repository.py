"""The README's commands are what CI runs: the quick test command, then the long checks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    return [block.strip() for block in blocks[:3]]


def test_readme_opens_with_a_demo_command_and_a_test_command() -> None:
    demo, tests, _ = readme_commands()
    assert demo.startswith("python3 -m venv .venv") and demo.endswith("run.py")
    assert tests.startswith("python3 -m venv .venv") and "pytest" in tests


def test_ci_runs_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert readme_commands()[1] in ci_lines


def test_the_third_command_runs_the_long_checks_and_ci_runs_it_after_the_tests() -> None:
    """Plain pytest deselects ``long`` (pyproject's addopts); the third command selects only it."""
    _, tests, long_checks = readme_commands()
    assert long_checks.endswith("pytest --benchmark-disable -m long -n auto")
    assert "-m long" not in tests
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert ci_lines.index(long_checks) > ci_lines.index(tests)
