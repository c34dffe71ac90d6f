"""Mutation testing: every small edit of ``spec/`` and ``impl/blocks/`` must fail a property.

A mutant is one edit of a syntax tree (:func:`_edits`; no docstring, annotation or f-string),
served by an import hook to ``pytest`` in a forked child (nothing is written). It is killed when
pytest fails (exit 1 or 2) or times out (3 x the passing baseline + 10 s); a survivor is a
missing property or listed in :data:`EQUIVALENT` with the reason. Linux only."""

from __future__ import annotations

import argparse
import ast
import copy
import importlib.abc
import importlib.machinery
import json
import os
import signal
import sys
import tempfile
import time
import types
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

FOLDER_PACKAGES = {"spec": "pagedkv.spec", "impl": "pagedkv.impl"}  # as pyproject.toml maps them

DEFAULT_PATHS = tuple(
    path.relative_to(ROOT).as_posix()
    for folder in ("spec", "impl/blocks")
    for path in sorted((ROOT / folder).glob("*.py"))
    if path.name != "__init__.py"
)
"""The files a full run mutates: every module of the spec and of impl's block management."""

BLOCK_MANAGEMENT_TESTS = (
    "properties/test_block_table_store.py", "properties/test_impl_differential.py",
    "properties/test_impl_edges.py", "properties/test_impl_free_queue.py",
    "properties/test_impl_prefix_cache.py", "properties/test_kv_cache_groups.py",
    "properties/test_prefix_cache_spec.py",
    "properties/test_spec_examples.py", "properties/test_spec_machine.py",
    "properties/test_store_hash_work.py", "properties/test_store_preemption.py",
    "properties/test_trusted_api.py", "properties/test_utilization_and_demo.py",
)  # fmt: skip
"""Block management's property files; not the planted-bug tests nor the (slow) exhaustive check."""

READERS = {
    "spec/checks.py": ("properties/test_scheduler.py", "properties/test_keys_salts_events.py"),
    "spec/fp8.py": ("properties/test_fp8_spec.py",),
    "spec/utilization.py": ("properties/test_fp8_spec.py",),
}
"""Files whose rules are checked outside block management's property files too: their mutants
also face those tests (the scheduler refuses token ids past ``INT64_MAX`` and checks a cache salt
with ``check_str``; the fp8 storage rules and the KV byte budget have their own file)."""

PYTEST_OPTIONS = ("-x", "-q", "-p", "no:cacheprovider", "--hypothesis-profile=mutation")


def tests_of(paths: Sequence[str]) -> tuple[str, ...]:
    """The test files a mutant of any of ``paths`` runs against."""
    readers = [test for path in paths for test in READERS.get(path, ())]
    return (*BLOCK_MANAGEMENT_TESTS, *dict.fromkeys(readers))


def _ident(entry: dict[str, Any]) -> str:
    key = f"{entry['file']}::{entry['scope']}::{entry['operator']}::{entry['code']}"
    return key if entry.get("occurrence", 1) == 1 else f"{key}#{entry['occurrence']}"


EQUIVALENT = {
    _ident(entry): entry["reason"]
    for entry in json.loads((ROOT / "properties" / "equivalent_mutants.json").read_text())
}
"""Survivors equivalent to the original, by :attr:`Mutant.ident`, with the reason
(``properties/equivalent_mutants.json``: ``file``, ``scope``, ``operator``, ``code``,
``occurrence`` (default 1), ``reason``)."""


def _swaps(pairs: str) -> dict[type, type]:
    """``"Lt->LtE ..."`` as ``{ast.Lt: ast.LtE, ...}``."""
    return {getattr(ast, a): getattr(ast, b) for a, b in (p.split("->") for p in pairs.split())}


COMPARE_SWAPS = _swaps(
    "Lt->LtE LtE->Lt Gt->GtE GtE->Gt Eq->NotEq NotEq->Eq Is->IsNot IsNot->Is In->NotIn NotIn->In"
)
ARITHMETIC_SWAPS = _swaps(
    "Add->Sub Sub->Add Mult->FloorDiv FloorDiv->Mult Div->Mult Mod->FloorDiv Pow->Mult "
    "BitAnd->BitOr BitOr->BitAnd BitXor->BitOr LShift->RShift RShift->LShift"
)
DELETABLE = (ast.Expr, ast.AugAssign, ast.Raise, ast.Delete)


@dataclass(frozen=True)
class Site:
    """One edit: ``parent.field`` (at ``index`` when that field is a list) becomes ``new``."""

    parent: ast.AST
    field: str
    index: int | None
    new: ast.AST
    operator: str  # what the edit does, e.g. "Lt->LtE"
    line: int
    scope: str  # the enclosing class and function, dotted ("" at module level)
    code: str  # the first line of the statement that holds the edit, as ast.unparse writes it


def _name(op: ast.AST) -> str:
    return type(op).__name__


def _edits(node: ast.AST) -> Iterator[tuple[ast.AST, str]]:
    """The replacements of ``node`` (each a new node) and what each does."""
    if isinstance(node, ast.Compare):
        for i, op in enumerate(node.ops):
            if type(op) in COMPARE_SWAPS:
                new = copy.copy(node)
                new.ops = [*node.ops[:i], COMPARE_SWAPS[type(op)](), *node.ops[i + 1 :]]
                yield new, f"{_name(op)}->{_name(new.ops[i])}"
    elif isinstance(node, (ast.BinOp, ast.AugAssign)) and type(node.op) in ARITHMETIC_SWAPS:
        new = copy.copy(node)
        new.op = ARITHMETIC_SWAPS[type(node.op)]()
        yield new, f"{_name(node.op)}->{_name(new.op)}"
    elif isinstance(node, ast.BoolOp):
        swapped = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        yield ast.BoolOp(swapped, node.values), f"{_name(node.op)}->{_name(swapped)}"
    elif isinstance(node, ast.UnaryOp) and not isinstance(node.op, ast.UAdd):
        yield node.operand, f"drop-{_name(node.op)}"
    elif isinstance(node, ast.Constant) and type(node.value) in (bool, int):
        new_value = not node.value if type(node.value) is bool else node.value + 1
        yield ast.Constant(new_value), f"{node.value}->{new_value}"
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        other = {"min": "max", "max": "min"}.get(node.func.id)
        if other:
            call = ast.Call(ast.Name(other, ast.Load()), node.args, node.keywords)
            yield call, f"{node.func.id}->{other}"
    elif isinstance(node, ast.Break):
        yield ast.Continue(), "break->continue"
    if isinstance(node, (ast.If, ast.While)) and not isinstance(
        node.test, (ast.Compare, ast.BoolOp)
    ):
        negated = copy.copy(node)
        negated.test = ast.UnaryOp(ast.Not(), node.test)
        yield negated, f"negate-{_name(node).lower()}-test"
    if isinstance(node, DELETABLE):
        yield ast.Pass(), f"delete-{_name(node)}"


def _is_docstring(node: ast.AST) -> bool:
    value = node.value if isinstance(node, ast.Expr) else None
    return isinstance(value, ast.Constant) and isinstance(value.value, str)


def sites(tree: ast.Module) -> list[Site]:
    """Every edit of ``tree``, in a fixed order (the same for a deep copy of it)."""
    found: list[Site] = []

    def visit(node: ast.AST, scope: str, code: str) -> None:
        if isinstance(node, ast.JoinedStr) or _is_docstring(node):
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = f"{scope}.{node.name}" if scope else node.name
        for field, value in ast.iter_fields(node):
            if field in ("returns", "annotation"):  # annotations: no runtime effect here
                continue
            for index, child in enumerate(value if isinstance(value, list) else [value]):
                if not isinstance(child, ast.AST) or _is_docstring(child):
                    continue
                # a statement's (or its decorator's) first line as unparsed: layout-independent
                here = ast.unparse(child).split("\n", 1)[0] if isinstance(child, ast.stmt) else code
                position = index if isinstance(value, list) else None
                line = getattr(child, "lineno", getattr(node, "lineno", 0))
                for new, operator in _edits(child):
                    found.append(Site(node, field, position, new, operator, line, scope, here))
                visit(child, scope, here)

    visit(tree, "", "")
    return found


def apply(site: Site) -> None:
    if site.index is None:
        setattr(site.parent, site.field, site.new)
    else:
        getattr(site.parent, site.field)[site.index] = site.new


@dataclass(frozen=True)
class Mutant:
    """One edit of one file; its ``ident`` (function, operator, statement) survives moves."""

    path: str  # relative to the repository root
    index: int  # position among the file's sites
    ident: str  # path::scope::operator::code, and #n for the n-th (n >= 2) of equal ones
    line: int
    operator: str


def module_name(path: str) -> str:
    """A file's import name: ``spec/prefix_cache.py`` is ``pagedkv.spec.prefix_cache``."""
    folder, *rest = Path(path).with_suffix("").parts
    return ".".join((FOLDER_PACKAGES[folder], *rest))


def mutants_of(path: str) -> list[Mutant]:
    return mutants_in((ROOT / path).read_text(), path)


def mutants_in(source: str, path: str) -> list[Mutant]:
    """Every mutant of ``source``, read as the file ``path``, in site order."""
    seen: Counter[str] = Counter()
    result = []
    for index, site in enumerate(sites(ast.parse(source, path))):
        key = f"{path}::{site.scope}::{site.operator}::{site.code}"
        seen[key] += 1
        ident = key if seen[key] == 1 else f"{key}#{seen[key]}"
        result.append(Mutant(path, index, ident, site.line, site.operator))
    return result


def mutated_code(mutant: Mutant) -> types.CodeType:
    """The mutant's module, compiled under the real file name (so tracebacks point there)."""
    source_path = ROOT / mutant.path
    tree = ast.parse(source_path.read_text(), str(source_path))
    apply(sites(tree)[mutant.index])
    return compile(ast.fix_missing_locations(tree), str(source_path), "exec")


class MutantFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Import hook: module ``name`` is executed from ``code`` instead of its file."""

    def __init__(self, name: str, path: Path, code: types.CodeType) -> None:
        self.name, self.path, self.code = name, path, code

    def find_spec(self, name: str, *_: object) -> importlib.machinery.ModuleSpec | None:
        """Only ``name``'s spec (the default module object: Loader's ``create_module``)."""
        if name != self.name:
            return None
        return importlib.machinery.ModuleSpec(name, self, origin=str(self.path))

    def exec_module(self, module: types.ModuleType) -> None:
        module.__file__ = str(self.path)
        exec(self.code, module.__dict__)


class FailureLog:
    """A pytest plugin: the node ids of the tests that failed (setup, call or teardown)."""

    def __init__(self) -> None:
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)


def run_pytest(
    code: tuple[str, types.CodeType] | None,
    timeout: float,
    tests: Sequence[str],
    options: Sequence[str] = PYTEST_OPTIONS,
) -> tuple[str, float, list[str]]:
    """``tests`` in a forked child with ``code = (module, compiled)`` (None: baseline);
    ``(verdict, seconds, failed test ids)``, verdict ``"passed"``, ``"failed"``, ``"timeout"``
    or ``"error: N"``."""
    start = time.monotonic()
    handle, log_path = tempfile.mkstemp(suffix=".json")
    os.close(handle)
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.setpgid(0, 0)  # its own process group, so a timeout ends what it started
        status = 3
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            if code is not None:
                name, compiled = code
                sys.meta_path.insert(0, MutantFinder(name, Path(compiled.co_filename), compiled))
            import pytest

            log = FailureLog()
            status = int(pytest.main([*tests, *options], plugins=[log]))
            Path(log_path).write_text(json.dumps(log.failed))
        finally:
            os._exit(status)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            elapsed = time.monotonic() - start
            if done:
                exit_code = os.waitstatus_to_exitcode(status)
                verdict = {0: "passed", 1: "failed", 2: "failed"}.get(exit_code)
                text = Path(log_path).read_text()
                failed = json.loads(text) if text else []
                return verdict or f"error: {exit_code}", elapsed, failed
            if elapsed > timeout:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout", elapsed, []
            time.sleep(0.02)
    finally:
        os.unlink(log_path)


@dataclass
class Result:
    """A mutant and what became of it: ``killed``, ``timeout`` (also a kill) or ``survived``."""

    ident: str
    path: str
    line: int
    operator: str
    verdict: str
    seconds: float
    failed: list[str]  # the failing tests (the first only, unless run with --matrix)


def score_table(results: list[Result]) -> str:
    """Markdown: per file, mutants, killed, survivors (equivalent or not) and the score."""
    lines = [
        "| file | mutants | killed | equivalent | missing a property "
        "| score | score less equivalent |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path in dict.fromkeys(r.path for r in results):
        mine = [r for r in results if r.path == path]
        killed = sum(r.verdict != "survived" for r in mine)
        equivalent = sum(r.verdict == "survived" and r.ident in EQUIVALENT for r in mine)
        other = len(mine) - killed - equivalent
        less = f"{100 * killed / (len(mine) - equivalent):.1f}%" if other + killed else "-"
        lines.append(
            f"| `{path}` | {len(mine)} | {killed} | {equivalent} | {other} | "
            f"{100 * killed / len(mine):.1f}% | {less} |"
        )
    return "\n".join(lines)


def sample(mutants: list[Mutant], count: int) -> list[Mutant]:
    """``count`` mutants spread evenly over the list (the same ones every time)."""
    if count >= len(mutants):
        return mutants
    return [mutants[i * len(mutants) // count] for i in range(count)]


def main(argv: list[str] | None = None) -> int:
    """The command. Exit status 0 when every mutant is killed or listed in :data:`EQUIVALENT`."""
    parser = argparse.ArgumentParser(prog="python -m properties.mutation", description=__doc__)
    parser.add_argument("paths", nargs="*", default=list(DEFAULT_PATHS), help="files to mutate")
    parser.add_argument("--sample", type=int, help="run only this many mutants, spread evenly")
    parser.add_argument("--only", nargs="+", default=[], help="run only these mutant ids")
    parser.add_argument("--list", action="store_true", help="list the mutants, run nothing")
    parser.add_argument("--json", type=Path, help="write every result here (after each)")
    parser.add_argument("--markdown", action="store_true", help="print the score table")
    parser.add_argument("--tests", nargs="+", help="run these test files, not the default ones")
    parser.add_argument("--keyword", help="only the tests pytest's -k expression selects")
    parser.add_argument(
        "--matrix", action="store_true", help="run every test (no -x): record all that fail"
    )
    args = parser.parse_args(argv)
    mutants = [m for path in args.paths for m in mutants_of(path)]
    if args.only:
        mutants = [m for m in mutants if m.ident in args.only]
    if args.sample:
        mutants = sample(mutants, args.sample)
    if args.list:
        for mutant in mutants:
            print(f"{mutant.ident}  (line {mutant.line})")
        return 0
    os.chdir(ROOT)
    from hypothesis import HealthCheck, Phase, settings

    # a mutant run's profile: reproducible, and it only has to find a bug
    settings.register_profile(
        "mutation", max_examples=50, stateful_step_count=30, derandomize=True, database=None,
        deadline=None, suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate],
    )  # fmt: skip
    import numpy  # noqa: F401  (imported once here, not again in every child)
    import pytest  # noqa: F401

    options = [o for o in PYTEST_OPTIONS if o != "-x" or not args.matrix]
    options += ["-k", args.keyword] if args.keyword else []

    def tests(paths: Sequence[str]) -> Sequence[str]:
        return args.tests or tests_of(paths)

    verdict, seconds, _ = run_pytest(None, 600, tests(args.paths), options)  # all it faces
    if verdict != "passed":
        print(f"the unmutated code does not pass: {verdict}", file=sys.stderr)
        return 2
    timeout = 3 * seconds + 10
    print(f"baseline passed in {seconds:.1f} s; {len(mutants)} mutants, timeout {timeout:.0f} s")
    results: list[Result] = []
    for mutant in mutants:
        code = (module_name(mutant.path), mutated_code(mutant))
        verdict, seconds, failed = run_pytest(code, timeout, tests([mutant.path]), options)
        if verdict.startswith("error"):
            raise RuntimeError(f"{mutant.ident}: pytest ended with {verdict}")
        outcome = {"failed": "killed", "passed": "survived"}.get(verdict, verdict)
        result = Result(
            mutant.ident, mutant.path, mutant.line, mutant.operator, outcome, seconds, failed
        )
        results.append(result)
        if args.json:  # after every mutant, so a run cut short keeps what it did
            args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
        if outcome == "survived":
            note = EQUIVALENT.get(mutant.ident, "NOT EQUIVALENT: a property is missing")
            print(f"survived  {mutant.ident} (line {mutant.line}): {note}", flush=True)
    print(score_table(results) if args.markdown else f"{len(results)} mutants run")
    missing = [r for r in results if r.verdict == "survived" and r.ident not in EQUIVALENT]
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
