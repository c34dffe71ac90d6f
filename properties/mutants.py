"""Planted bugs: load a copy of a module's source with one snippet replaced.

A mutant is the real module's source with exactly one edit, executed as a fresh module. The
exception classes are then re-bound to the real ones, so a mutant raises the same types as the
original and a test can only fail because of the planted behaviour.
"""

from __future__ import annotations

import inspect
import sys
import types

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
"""The search every planted-bug run and its control make: explicit, so it does not depend on
the Hypothesis profile, and the same for both, so a control proves the loading path sound for
every example a mutant is hunted with."""


def load_mutant(
    module: types.ModuleType, old: str, new: str, shared: tuple[str, ...]
) -> types.ModuleType:
    """Execute ``module``'s source with ``old`` replaced by ``new`` as a new module; return it.

    ``old`` must occur exactly once, so a planted bug cannot silently stop applying when the
    original changes; otherwise ``LookupError`` (deliberately not an ``AssertionError``, which
    a planted-bug test counts as a catch). Names in ``shared`` (typically exception classes)
    are taken from the real module.
    """
    source = inspect.getsource(module)
    occurrences = source.count(old)
    if occurrences != 1:
        raise LookupError(f"snippet occurs {occurrences} times in {module.__name__}: {old!r}")
    mutant = types.ModuleType(f"{module.__name__}_mutant")
    code = compile(source.replace(old, new), f"<mutant of {module.__name__}>", "exec")
    sys.modules[mutant.__name__] = mutant  # dataclasses look their module up while decorating
    try:
        exec(code, mutant.__dict__)
    finally:
        del sys.modules[mutant.__name__]
    for name in shared:
        setattr(mutant, name, getattr(module, name))
    return mutant
