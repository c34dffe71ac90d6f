"""Fault seams found by tracing: every call a real engine step makes from one ``pagedkv`` module
(the nearest ``pagedkv`` frame below it: torch and standard library frames are looked through)
into another, or into a user callable (the draft source). No seams (docs/design.md §10): calls
inside one module, imports and what they call, the Triton interpreter's kernel bodies (one launch
on a GPU), what numba's compiler calls (once per signature and cache), calls into the pure input
checks, and from inside ``pagedkv.impl.blocks`` (one store call validates, then runs array code
that cannot fail halfway)."""

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

CHECKS = ("pagedkv.spec.checks", "pagedkv.kernels.check_arguments",
          "pagedkv.kernels.check_shapes", "pagedkv.kernels.check_values")  # fmt: skip
Wrap = Callable[[str, Callable[..., Any]], Callable[..., Any]]
"""A fault injector's ``wrap(name, function)``: the function, failing when the injector says."""


def _module(frame: FrameType | None) -> str:
    return "" if frame is None else frame.f_globals.get("__name__", "")


def caller_module(frame: FrameType | None) -> str | None:
    """The module of the nearest ``pagedkv`` frame from ``frame`` down, or None; a planted
    bug's copy of a module (``<module>_mutant``, see ``properties.mutants``) is that module."""
    while frame is not None:
        if (name := _module(frame)).startswith("pagedkv"):
            return name.removesuffix("_mutant")
        frame = frame.f_back
    return None


def _importing(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs inside a ``pagedkv`` module's import (its ``<module>`` code is on
    the stack): such calls happen once per process, in whichever step first imports it."""
    while frame is not None:
        if frame.f_code.co_name == "<module>" and _module(frame).startswith("pagedkv"):
            return True
        frame = frame.f_back
    return False


def _compiling(frame: FrameType | None) -> bool:
    """Whether numba's compiler stands between ``frame`` and the nearest ``pagedkv`` frame: it
    runs a kernel's Python helpers (intrinsics' codegen, type inference) only on a cold cache."""
    while frame is not None and not (name := _module(frame)).startswith("pagedkv"):
        if name.startswith("numba"):
            return True
        frame = frame.f_back
    return False


def _callee_name(frame: FrameType) -> str:
    """The called function's qualified name; a dataclass's generated ``__init__`` is named by
    its class."""
    code = frame.f_code
    qualname = getattr(code, "co_qualname", code.co_name)
    if "<locals>" in qualname and code.co_name == "__init__" and "self" in frame.f_locals:
        return f"{type(frame.f_locals['self']).__qualname__}.__init__"
    return qualname


@contextmanager
def tracing(user: dict[CodeType, str]) -> Iterator[set[Seam]]:
    """Record the seams of the calls made in the block; ``user`` names user callables' code."""
    seams: set[Seam] = set()

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        code, callee_module = frame.f_code, _module(frame)
        if code in user:
            callee = user[code]
        elif (
            callee_module.startswith("pagedkv")
            and code.co_name != "<module>"  # not an import
            and not _module(frame.f_back).startswith("triton")  # nor an interpreted kernel body
        ):
            callee = f"{callee_module}:{_callee_name(frame)}"
        else:
            return
        caller = caller_module(frame.f_back)
        if caller is None or _importing(frame.f_back) or _compiling(frame.f_back):
            return  # or a module's own import-time code, or numba compiling a kernel
        if code in user or (
            caller != callee_module
            and callee_module not in CHECKS
            and not caller.startswith("pagedkv.impl.blocks")  # inside one store call
        ):
            seams.add((caller, callee))

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield seams
    finally:
        sys.setprofile(previous)


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
    """Make each seam's calls go through ``wrap`` while the block runs (only ``module:qualname``
    callees: user callables are the caller's to wrap)."""
    by_callee: dict[str, set[str]] = {}
    for caller, callee in seams:
        if ":" in callee:
            by_callee.setdefault(callee, set()).add(caller)
    undo: list[tuple[Any, str, Any]] = []  # (target, attribute, original)
    ours = [module for key, module in list(sys.modules.items()) if key.startswith("pagedkv")]
    try:
        for callee, callers in sorted(by_callee.items()):
            module_name, qualname = callee.split(":")
            owner: Any = importlib.import_module(module_name)
            *path, name = qualname.split(".")
            for part in path:
                owner = owner.__dict__[part]
            raw = owner.__dict__[name]
            faulty = functools.partial(_faulty, callee=callee, callers=callers, wrap=wrap)
            targets = [owner]
            if isinstance(owner, ModuleType):  # a function: wherever a pagedkv module binds it
                targets = [module for module in ours if getattr(module, name, None) is raw]
                replacement = faulty(raw)
            elif isinstance(raw, property):
                replacement = property(faulty(raw.fget), raw.fset, raw.fdel, raw.__doc__)
            elif isinstance(raw, (staticmethod, classmethod)):
                replacement = type(raw)(faulty(raw.__func__))
            else:
                replacement = faulty(raw)
            for target in targets:
                undo.append((target, name, raw))
                setattr(target, name, replacement)
        yield
    finally:
        for target, name, original in reversed(undo):
            setattr(target, name, original)


def listed_seams() -> set[Seam]:
    """The engine fault machine's seams: ``fault_seams.txt``, one ``caller callee`` pair a line."""
    lines = Path(__file__).with_name("fault_seams.txt").read_text().splitlines()
    return {tuple(line.split()) for line in lines if line and not line.startswith("#")}  # type: ignore[misc]


def repeat_last(tokens: list[int], k: int) -> list[int]:
    """A draft source that is sometimes right: the last token, ``k`` times."""
    return [tokens[-1]] * k


def trace_engine(backend: str) -> set[Seam]:
    """The seams of real steps on ``backend``: runs that prefix-cache, fork, copy on write,
    preempt, sample at a temperature, slide a window, speculate, and keep K/V in fp8 with scales
    calibrated in the first step, each to completion."""
    from pagedkv.impl.serving.engine import PagedAttentionEngine
    from pagedkv.impl.serving.model import CausalLM, ModelConfig

    requests = [([1, 2, 3], 4, 3, 0.0), ([1, 2, 3, 4, 5], 3, 1, 1.0), ([9], 5, 2, 0.0)]
    speculative = {"draft_source": repeat_last, "num_speculative_tokens": 2}
    fp8 = {"kv_cache_dtype": "fp8_e4m3", "kv_scales": "calculate", "enable_prefix_caching": True}
    seams: set[Seam] = set()
    runs = [(None, {"enable_prefix_caching": True}), (3, {}), (None, speculative), (None, fp8)]
    for window, options in runs:
        model = CausalLM.from_seed(ModelConfig(sliding_window=window), seed=0)
        engine = PagedAttentionEngine(
            model, 6, 2, max_num_seqs=6, max_num_batched_tokens=8, max_model_len=64,
            backend=backend, **options,
        )  # fmt: skip
        for prompt, max_new, n, temperature in requests:
            temperature = 0.0 if options is speculative else temperature
            engine.add_request(prompt, max_new, n=n, temperature=temperature, seed=1)
        while engine.has_unfinished_requests():
            with tracing({repeat_last.__code__: "draft_source"}) as traced:
                engine.step()
            seams |= traced
    return seams


if __name__ == "__main__":  # the seams on the backend named, one pair a line
    for caller, callee in sorted(trace_engine(sys.argv[1])):
        print(caller, callee)
