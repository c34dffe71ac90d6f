"""Fault seams found by tracing: every call a real engine step makes from one ``pagedkv`` module
into another, or into a user callable (the draft source).

:func:`trace_seams` runs steps under ``sys.setprofile`` and records, for every call into a
``pagedkv`` function (or a user callable), the module of the nearest ``pagedkv`` frame below it
(frames of torch and the standard library in between, such as ``nn.Module.__call__``, are
looked through). A call inside one module is no seam. Two kinds of calls are left out, each for
a reason the fault model states (docs/design.md §10, "Failure semantics"):

* calls *into* the pure input checks, ``pagedkv.spec.checks`` and ``pagedkv.kernels.check_*``:
  they change nothing, and the call that makes them is a seam of its own;
* calls made *from inside* the block-management layer (``pagedkv.impl.blocks``): they run inside
  one store call, which validates its arguments and then runs unchecked array code that cannot
  fail halfway (``impl/blocks/pool.py``); the store call itself is the seam.

numba kernels are reached through their Python wrappers, so those are the seams of a compiled
kernel; a Triton kernel's body, which the interpreter runs as Python, is none (on a GPU the
launch is the call). Imports are no calls. :func:`installed` makes every listed seam raise when
a fault injector says so, whoever the callee is: a module function (patched wherever a
``pagedkv`` module binds it), a method or a property (patched on its class). Only calls from
the seam's caller module fail.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import CodeType, FrameType, ModuleType
from typing import Any

Seam = tuple[str, str]
"""``(caller module, callee)``: the callee as ``module:qualname``, or a user callable's name."""

CHECKS = (
    "pagedkv.spec.checks",
    "pagedkv.kernels.check_arguments",
    "pagedkv.kernels.check_shapes",
    "pagedkv.kernels.check_values",
)
"""The pure input checks: calls into them are no seams."""

INSIDE_ONE_STORE_CALL = "pagedkv.impl.blocks"
"""Calls from modules under this package run inside one store call: no seams."""


def _module(frame: FrameType | None) -> str:
    return "" if frame is None else frame.f_globals.get("__name__", "")


def caller_module(frame: FrameType | None) -> str | None:
    """The module of the nearest ``pagedkv`` frame from ``frame`` down, or None. A planted
    bug's copy of a module (``properties.mutants``, named ``<module>_mutant``) calls as the
    module it copies."""
    while frame is not None:
        name = _module(frame)
        if name.startswith("pagedkv"):
            return name.removesuffix("_mutant")
        frame = frame.f_back
    return None


def _qualname(code: CodeType) -> str:
    return getattr(code, "co_qualname", code.co_name)


def _callee_name(frame: FrameType) -> str:
    """The called function's qualified name; a dataclass's generated ``__init__`` is named by
    its class."""
    qualname = _qualname(frame.f_code)
    if "<locals>" in qualname and frame.f_code.co_name == "__init__" and "self" in frame.f_locals:
        return f"{type(frame.f_locals['self']).__qualname__}.__init__"
    return qualname


def is_seam(caller: str, callee_module: str) -> bool:
    """Whether a call from ``caller`` into ``callee_module`` is a fault seam."""
    return (
        caller != callee_module
        and callee_module not in CHECKS
        and not caller.startswith(INSIDE_ONE_STORE_CALL)
    )


@contextmanager
def tracing(user: dict[CodeType, str]) -> Iterator[set[Seam]]:
    """Record the seams of the calls made in the block; ``user`` names user callables' code."""
    seams: set[Seam] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        callee_module = _module(frame)
        if frame.f_code in user:
            caller = caller_module(frame.f_back)
            if caller is not None:
                seams.add((caller, user[frame.f_code]))
            return
        if not callee_module.startswith("pagedkv") or frame.f_code.co_name == "<module>":
            return  # not ours, or an import
        if _module(frame.f_back).startswith("triton"):
            return  # a kernel body the Triton interpreter runs: on a GPU, no Python call
        caller = caller_module(frame.f_back)
        if caller is not None and is_seam(caller, callee_module):
            seams.add((caller, f"{callee_module}:{_callee_name(frame)}"))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seams
    finally:
        sys.setprofile(previous)


Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
"""A fault injector's ``wrap(name, function)``: the function, failing when the injector says."""


def _faulty(original: Callable[..., Any], callee: str, callers: set[str], wrap: Wrap) -> Any:
    """``original``, whose calls from ``callers`` go through ``wrap``."""
    injected = wrap(callee, original)

    @functools.wraps(original)
    def seam(*args: Any, **kwargs: Any) -> Any:
        if caller_module(sys._getframe(1)) in callers:
            return injected(*args, **kwargs)
        return original(*args, **kwargs)

    return seam


@contextmanager
def installed(seams: set[Seam], wrap: Wrap) -> Iterator[None]:
    """Make each seam's calls go through ``wrap`` while the block runs (user callables are the
    caller's to wrap; only ``module:qualname`` callees are patched here)."""
    by_callee: dict[str, set[str]] = {}
    for caller, callee in seams:
        if ":" in callee:
            by_callee.setdefault(callee, set()).add(caller)
    undo: list[tuple[Any, str, Any]] = []
    try:
        for callee, callers in sorted(by_callee.items()):
            undo += _patch(callee, callers, wrap)
        yield
    finally:
        for target, name, original in reversed(undo):
            setattr(target, name, original)


def _patch(callee: str, callers: set[str], wrap: Wrap) -> list[tuple[Any, str, Any]]:
    """Patch one callee; return what to put back: ``(target, attribute, original)``."""
    module_name, qualname = callee.split(":")
    owner: Any = importlib.import_module(module_name)
    *path, name = qualname.split(".")
    for part in path:
        owner = owner.__dict__[part]
    raw = owner.__dict__[name]
    if isinstance(owner, ModuleType):  # a function: wherever a pagedkv module binds it
        faulty = _faulty(raw, callee, callers, wrap)
        bound = [
            module
            for module_name, module in list(sys.modules.items())
            if module_name.startswith("pagedkv") and getattr(module, name, None) is raw
        ]
        for module in bound:
            setattr(module, name, faulty)
        return [(module, name, raw) for module in bound]
    if isinstance(raw, property):
        getter = _faulty(raw.fget, callee, callers, wrap)
        setattr(owner, name, property(getter, raw.fset, raw.fdel, raw.__doc__))
    elif isinstance(raw, (staticmethod, classmethod)):
        setattr(owner, name, type(raw)(_faulty(raw.__func__, callee, callers, wrap)))
    else:
        setattr(owner, name, _faulty(raw, callee, callers, wrap))
    return [(owner, name, raw)]


LISTED = Path(__file__).with_name("fault_seams.txt")
"""The engine fault machine's seams, one ``caller callee`` pair a line."""


def listed_seams() -> set[Seam]:
    """The seams in :data:`LISTED`."""
    lines = LISTED.read_text().splitlines()
    return {tuple(line.split()) for line in lines if line and not line.startswith("#")}  # type: ignore[misc]


def _repeat_last(tokens: list[int], k: int) -> list[int]:
    """A draft source that is sometimes right: the last token, ``k`` times."""
    return [tokens[-1]] * k


DRAFT_SOURCE = {_repeat_last.__code__: "draft_source"}
"""The traced runs' user callable, by its code."""


def trace_engine(backend: str) -> set[Seam]:
    """The seams of real steps on ``backend``: runs that prefix-cache, fork, copy on write,
    preempt, sample at a temperature, slide a window and speculate, each to completion."""
    from pagedkv.impl.serving.engine import PagedAttentionEngine
    from pagedkv.impl.serving.model import CausalLM, ModelConfig

    requests = [([1, 2, 3], 4, 3, 0.0), ([1, 2, 3, 4, 5], 3, 1, 1.0), ([9], 5, 2, 0.0)]
    runs = [
        (None, {"enable_prefix_caching": True}),
        (3, {}),
        (None, {"draft_source": _repeat_last, "num_speculative_tokens": 2}),
    ]
    seams: set[Seam] = set()
    for window, options in runs:
        model = CausalLM.from_seed(ModelConfig(sliding_window=window), seed=0)
        engine = PagedAttentionEngine(
            model, 6, 2, max_num_seqs=6, max_num_batched_tokens=8, max_model_len=64,
            backend=backend, **options,
        )  # fmt: skip
        for prompt, max_new, n, temperature in requests:
            speculative = "draft_source" in options
            engine.add_request(
                prompt, max_new, n=n, temperature=0.0 if speculative else temperature, seed=1
            )
        while engine.has_unfinished_requests():
            with tracing(DRAFT_SOURCE) as traced:
                engine.step()
            seams |= traced
    return seams


def main() -> None:
    """Print the seams of :func:`trace_engine` on the backend named by the first argument, one
    ``caller callee`` pair a line (``python -m properties.seams triton`` under the interpreter)."""
    for caller, callee in sorted(trace_engine(sys.argv[1])):
        print(caller, callee)


if __name__ == "__main__":
    main()
