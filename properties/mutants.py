"""Planted bugs: load a copy of a module with one piece of code replaced.

A planted bug is keyed by where it lives and what it replaces, as code: the module, the function
or class it is planted in (a dotted name, ``"BlockManager.free"``), and ``old`` and ``new``,
parsed. ``old`` must match exactly one place of that function's syntax tree (one expression, or
one run of statements), compared without positions, so layout, comments and line breaks do not
matter, and reformatting a file, editing another function or moving the function to another
module (with its key's module) never moves a planted bug; a bug whose code is gone raises
``LookupError`` instead of planting nothing. ``old`` may also be one of the mutation tool's
edits of the function (``"edit:Lt->LtE:<statement's first line>"``, see
:mod:`properties.mutation`), so a planted bug and a mutant can share one id.
A mutant is executed as a fresh module, and the names in ``shared`` (typically exception
classes) are re-bound to the real module's, so a mutant raises the same types as the original
and a test can only fail because of the planted behaviour.

A bug planted in a module that others import (the free queue under the pool, the pool under
the managers, ...) reaches them through :func:`load_chain`: each module after the mutated one
is loaded again with the copies before it standing in for the real modules in its imports.
"""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import types
from collections.abc import Mapping, Sequence

import pytest
from hypothesis import HealthCheck, Phase, settings

FIND = settings(
    max_examples=300,
    stateful_step_count=50,
    derandomize=True,
    database=None,
    deadline=None,
    report_multiple_bugs=False,
    suppress_health_check=list(HealthCheck),
    phases=[Phase.generate],  # a planted bug only has to be found, not shrunk
)
"""The search every planted-bug run makes: explicit, so it does not depend on the Hypothesis
profile. A control's full search (:data:`CONTROL_SEARCHES`) is the same, so it proves the
loading path sound for every example a mutant is hunted with."""

CONTROL_SEARCHES = (
    pytest.param(settings(FIND, max_examples=30), id="sample"),
    pytest.param(FIND, id="full", marks=pytest.mark.long),
)
"""The searches a control runs, as a ``search`` parameter: 30 examples in the quick command,
and :data:`FIND`'s whole search, every example a planted bug can be hunted with, in the long
command (``-m long``). A control is an unmutated copy, so it passes either way unless the
loading path itself is broken."""


def bug_table(text: str) -> dict[str, tuple[str, ...]]:
    """Planted bugs written as a table: ``name | field ...`` (more fields on lines starting
    ``|``), then the code it replaces on ``-`` lines and its replacement on ``+`` lines, as in
    a diff. Returns each name's ``(*fields, old, new)``."""
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
    """The function or class named by the dotted path ``within``."""
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
    """Replace, in place, the one place of ``tree`` inside the function or class ``within``
    whose code is ``old`` by ``new``. ``old`` is one expression (matched anywhere, and
    replaced by ``new``'s expression), one or more statements (matched as a run of one
    statement list, and replaced by ``new``'s statements, none for an empty ``new``), or a
    mutation-tool edit (``"edit:OPERATOR:CODE"``, with ``new`` empty). ``LookupError``
    unless exactly one place matches."""
    if old.startswith(EDIT):
        apply_edit(tree, within, old, new)
        return
    old_body = ast.parse(textwrap.dedent(old)).body
    new_body = ast.parse(textwrap.dedent(new)).body
    scope = _scope(tree, within)
    one_expression = (
        len(old_body) == 1
        and isinstance(old_body[0], ast.Expr)
        and len(new_body) == 1
        and isinstance(new_body[0], ast.Expr)
    )
    matches: list[tuple[ast.AST, str, int | None, int]] = []
    if one_expression:
        target = _shape(old_body[0].value)  # type: ignore[attr-defined]
        for parent in ast.walk(scope):
            for field, value in ast.iter_fields(parent):
                children = value if isinstance(value, list) else [value]
                for index, child in enumerate(children):
                    if isinstance(child, ast.expr) and _shape(child) == target:
                        position = index if isinstance(value, list) else None
                        matches.append((parent, field, position, 1))
    else:
        target_run = [_shape(statement) for statement in old_body]
        size = len(target_run)
        for parent in ast.walk(scope):
            for field, value in ast.iter_fields(parent):
                if not (isinstance(value, list) and value and isinstance(value[0], ast.stmt)):
                    continue
                shapes = [_shape(statement) for statement in value]
                for start in range(len(shapes) - size + 1):
                    if shapes[start : start + size] == target_run:
                        matches.append((parent, field, start, size))
    if len(matches) != 1:
        raise LookupError(f"{len(matches)} places in {within} match the code {old!r}")
    parent, field, index, size = matches[0]
    if one_expression:
        replacement = new_body[0].value  # type: ignore[attr-defined]
        if index is None:
            setattr(parent, field, replacement)
        else:
            getattr(parent, field)[index] = replacement
    else:
        statements = getattr(parent, field)
        statements[index : index + size] = new_body or [ast.Pass()]


EDIT = "edit:"
"""How a planted bug names one of the mutation tool's edits instead of code."""


def apply_edit(tree: ast.Module, within: str, old: str, new: str) -> None:
    """Make, in place, the mutation tool's edit ``old`` (``"edit:OPERATOR:CODE"``: the edit's
    operator and its statement's first line, as in a mutant's id) inside ``within``."""
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
    """Execute ``module`` (or ``tree``, its edited syntax) as a new module; return it.
    ``using`` maps module names to copies that the new module's imports receive instead of
    the real modules. Names in ``shared`` are taken from the real module."""
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
    modules: Sequence[types.ModuleType],
    within: str,
    old: str,
    new: str,
    shared: Sequence[str] = (),
) -> types.ModuleType:
    """Plant ``old -> new`` in ``modules[0]``, then load each later module again with the
    copies of those before it in its imports; return the copy of the last one. Each module
    re-binds ``shared`` names it has to the real ones."""
    first, *rest = modules
    copies = {first.__name__: load_mutant(first, within, old, new, _own(first, shared))}
    for module in rest:
        copies[module.__name__] = load_copy(module, _own(module, shared), using=dict(copies))
    return copies[modules[-1].__name__]


def _own(module: types.ModuleType, names: Sequence[str]) -> tuple[str, ...]:
    return tuple(name for name in names if hasattr(module, name))


def planted_store(module: types.ModuleType, within: str, old: str, new: str) -> type:
    """``BlockTableStore`` with ``old -> new`` planted in ``module``: the store itself, or one of
    the parts it is built from (its tables, growth, block hashes or prefix cache), loaded again
    under the store. Exception classes stay the real ones."""
    import pagedkv.impl.blocks.store as store

    chain = [store] if module is store else [module, store]
    shared = ("CapacityError", "OutOfBlocksError", "BlockTableError")
    return load_chain(chain, within, old, new, shared).BlockTableStore
