"""Planted bugs: load a copy of a module with one piece of code replaced.

A bug is keyed by its module, the dotted function or class it is in, and ``old`` and ``new`` as
code: ``old`` must match exactly one place of that syntax tree (compared without positions, so
layout never moves a bug; a vanished one raises ``LookupError``), or be a mutation-tool edit
(``"edit:Lt->LtE:<statement's first line>"``). Names in ``shared`` (exception classes) are the
real module's; :func:`load_chain` reloads the modules importing the mutated one over its copy."""

from __future__ import annotations

import ast
import inspect
import os
import sys
import textwrap
import types
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings

PROBE = bool(os.environ.get("PAGEDKV_PLANTED_PROBE"))
"""Set, every planted-bug search draws fresh examples (``--hypothesis-seed=N`` picks them): a
bug found in only some seeds is found by luck (results.md, "Planted bugs' margin")."""

FIND = settings(
    max_examples=300, stateful_step_count=50, derandomize=not PROBE, database=None,
    deadline=None, report_multiple_bugs=False, suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],  # a planted bug only has to be found, not shrunk
)  # fmt: skip
"""The search every planted-bug run makes, explicit so that no Hypothesis profile changes it.
Derandomized, its examples still depend on the modules loaded before it (Hypothesis draws
constants from them), so they differ between test orders: every bug needs a margin."""

CONTROL_SEARCHES = (
    pytest.param(settings(FIND, max_examples=30), id="sample"),
    pytest.param(FIND, id="full", marks=pytest.mark.long),
)
"""A control's (unmutated copy's) searches: 30 examples, and under ``-m long`` :data:`FIND`'s
whole search, so the loading path is proved sound for every example a bug is hunted with."""


def bug_table(text: str) -> dict[str, tuple[str, ...]]:
    """``name | field ...`` rows (more fields on ``|`` lines), then ``-`` old and ``+`` new code
    lines as in a diff: each name's ``(*fields, old, new)``."""
    rows: list[tuple[str, list[str], list[str], list[str]]] = []
    for line in textwrap.dedent(text).strip().splitlines():
        if line[:1] in ("-", "+"):
            rows[-1][2 if line[0] == "-" else 3].append(line[2:])
        elif line.startswith("|"):
            rows[-1][1].extend(line[1:].split())
        else:
            name, _, fields = line.partition(" | ")
            rows.append((name, fields.split(), [], []))
    table = {name: (*fields, "\n".join(old), "\n".join(new)) for name, fields, old, new in rows}
    assert len(table) == len(rows), "a planted bug is named twice"
    return table


def _shape(node: ast.AST) -> str:
    """A node's code without positions: equal for equal code however it is laid out."""
    return ast.dump(node, annotate_fields=False, include_attributes=False)


def _scope(tree: ast.Module, within: str) -> ast.AST:
    node: ast.AST = tree
    for name in within.split("."):
        found = [
            child
            for child in ast.iter_child_nodes(node)
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and child.name == name
        ]
        if len(found) != 1:
            raise LookupError(f"no single {name!r} in {within!r}")
        node = found[0]
    return node


def replace_code(tree: ast.Module, within: str, old: str, new: str) -> None:
    """Replace in place the one place in ``within`` whose code is ``old`` (an expression, a run of
    statements, or an ``"edit:OPERATOR:CODE"``) by ``new``; ``LookupError`` unless exactly one."""
    if old.startswith(EDIT):
        apply_edit(tree, within, old, new)
        return
    old_body = ast.parse(textwrap.dedent(old)).body
    new_body = ast.parse(textwrap.dedent(new)).body
    one_expression = all(len(b) == 1 and isinstance(b[0], ast.Expr) for b in (old_body, new_body))
    target = [_shape(s.value if one_expression else s) for s in old_body]  # type: ignore[attr-defined]
    size = len(target)
    matches: list[tuple[ast.AST, str, int | None]] = []
    for parent in ast.walk(_scope(tree, within)):
        for field, value in ast.iter_fields(parent):
            if one_expression:
                children = value if isinstance(value, list) else [value]
                for index, child in enumerate(children):
                    if isinstance(child, ast.expr) and [_shape(child)] == target:
                        matches.append((parent, field, index if isinstance(value, list) else None))
            elif isinstance(value, list) and value and isinstance(value[0], ast.stmt):
                shapes = [_shape(statement) for statement in value]
                for start in range(len(shapes) - size + 1):
                    if shapes[start : start + size] == target:
                        matches.append((parent, field, start))
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} places in {within} match the code {old!r}")
    parent, field, index = matches[0]
    if index is None:
        setattr(parent, field, new_body[0].value)  # type: ignore[attr-defined]
    else:
        replacement = [new_body[0].value] if one_expression else new_body or [ast.Pass()]  # type: ignore[attr-defined]
        getattr(parent, field)[index : index + size] = replacement


EDIT = "edit:"
"""How a planted bug names one of the mutation tool's edits instead of code."""


def apply_edit(tree: ast.Module, within: str, old: str, new: str) -> None:
    """Make in place the mutation tool's edit ``old`` (``"edit:OPERATOR:CODE"``) in ``within``."""
    from properties import mutation

    operator, code = old.removeprefix(EDIT).split(":", 1)
    if new:
        raise ValueError(f"an edit plants no new code, got {new!r}")
    found = [
        site
        for site in mutation.sites(tree)
        if site.scope == within and site.operator == operator and site.code == code
    ]
    if len(found) != 1:
        raise LookupError(f"{len(found)} edits {operator} of {code!r} in {within}")
    mutation.apply(found[0])


def load_copy(
    module: types.ModuleType,
    shared: Sequence[str] = (),
    *,
    using: Mapping[str, types.ModuleType] | None = None,
    tree: ast.Module | None = None,
) -> types.ModuleType:
    """``module`` (or ``tree``) run as a new module, its imports of ``using``'s names served the
    copies, ``shared`` names taken from the real module."""
    if tree is None:
        tree = ast.parse(inspect.getsource(module))
    mutant = types.ModuleType(f"{module.__name__}_mutant")
    code = compile(ast.fix_missing_locations(tree), f"<mutant of {module.__name__}>", "exec")
    stand_ins = {mutant.__name__: mutant, **(using or {})}
    saved = {name: sys.modules.get(name) for name in stand_ins}
    sys.modules.update(stand_ins)  # dataclasses look their module up while decorating
    try:
        exec(code, mutant.__dict__)
    finally:
        for name, real in saved.items():
            if real is None:
                del sys.modules[name]
            else:
                sys.modules[name] = real
    for name in shared:
        setattr(mutant, name, getattr(module, name))
    return mutant


def load_mutant(
    module: types.ModuleType,
    within: str,
    old: str,
    new: str,
    shared: Sequence[str] = (),
    *,
    using: Mapping[str, types.ModuleType] | None = None,
) -> types.ModuleType:
    """A copy of ``module`` (see :func:`load_copy`) with the code ``old`` inside ``within``
    replaced by ``new`` (see :func:`replace_code`)."""
    tree = ast.parse(inspect.getsource(module))
    try:
        replace_code(tree, within, old, new)
    except LookupError as error:
        raise LookupError(f"{module.__name__}: {error}") from None
    return load_copy(module, shared, using=using, tree=tree)


def load_chain(
    modules: Sequence[types.ModuleType], within: str, old: str, new: str, shared: Sequence[str] = ()
) -> types.ModuleType:
    """Plant ``old -> new`` in ``modules[0]``, reload each later one over the copies; the last."""
    first, *rest = modules
    copies = {first.__name__: load_mutant(first, within, old, new, _own(first, shared))}
    for module in rest:
        copies[module.__name__] = load_copy(module, _own(module, shared), using=dict(copies))
    return copies[modules[-1].__name__]


def _own(module: types.ModuleType, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(name for name in names if hasattr(module, name))


def planted_store(module: types.ModuleType, within: str, old: str, new: str) -> type:
    """``BlockTableStore`` with ``old -> new`` planted in ``module`` (the store or a part)."""
    import pagedkv.impl.blocks.store as store

    chain = [store] if module is store else [module, store]
    shared = ("CapacityError", "OutOfBlocksError", "BlockTableError")
    return load_chain(chain, within, old, new, shared).BlockTableStore
