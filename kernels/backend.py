"""The one place that decides which backend runs a kernel call.

Two backends compute the same functions:

* ``"triton"``: the Triton kernels. Compiled on CUDA tensors; on a machine without CUDA the
  package turns on the Triton interpreter, which runs the same kernels in numpy on CPU tensors
  (slowly: it is for proving the kernels correct, not for speed).
* ``"reference"``: plain torch (``kernels.reference``), obviously correct; the CPU fast path.

Precedence, first match wins: the ``backend=`` argument of a call, the ``PAGEDKV_BACKEND``
environment variable, then ``"auto"`` (``"triton"`` for CUDA tensors, ``"reference"`` otherwise).

Triton reads ``TRITON_INTERPRET`` when it *decorates* a function with ``@triton.jit``, and that
includes its own helpers (``tl.sum``, ``tl.max``, ``tl.zeros``), decorated when ``triton`` is
first imported. So the variable must be set before ``triton`` is imported at all. This module
imports no Triton; importing it (``kernels/__init__.py`` does so first) sets
``TRITON_INTERPRET=1`` when CUDA is absent and the user has not set the variable either way. If
``triton`` was imported earlier without it, the interpreter cannot work in this process: the
reference backend still does, and asking for ``"triton"`` on CPU raises an error that says why.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["triton", "reference"]
BackendChoice = Literal["auto", "triton", "reference"]

BACKEND_ENV = "PAGEDKV_BACKEND"
INTERPRET_ENV = "TRITON_INTERPRET"
_CHOICES: tuple[BackendChoice, ...] = ("auto", "triton", "reference")
_TRUE = ("1", "true", "on", "yes")


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set to a true value (as Triton itself parses it)."""
    return os.environ.get(INTERPRET_ENV, "0").strip().lower() in _TRUE


def configure_interpreter() -> bool:
    """Turn on the Triton interpreter when CUDA is absent and the user has not decided.

    Idempotent. Returns whether the interpreter is on.
    """
    if INTERPRET_ENV not in os.environ and not torch.cuda.is_available():
        os.environ[INTERPRET_ENV] = "1"
    return interpreter_enabled()


def _triton_is_interpreted() -> bool:
    """Whether Triton's own ``@jit`` helpers were decorated for the interpreter."""
    # Imported here, not at the top: this module must not import triton before it has set
    # TRITON_INTERPRET.
    import triton
    import triton.language as tl

    return not isinstance(tl.sum, triton.JITFunction)


# Decided once, on first import: kernels are decorated under this value, and changing the
# environment afterwards cannot change how they run.
INTERPRETED: bool = configure_interpreter()
INTERPRETER_BROKEN: bool = INTERPRETED and not _triton_is_interpreted()


def resolve_backend(backend: str | None, device: torch.device) -> Backend:
    """Return the backend that runs a call on tensors living on ``device``.

    Raises ``ValueError`` for an unknown name and ``RuntimeError`` when ``"triton"`` is asked for
    where it cannot run (CPU tensors without a working interpreter).
    """
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    choice = choice.strip().lower()
    if choice not in _CHOICES:
        source = "backend" if backend is not None else BACKEND_ENV
        raise ValueError(f"{source} must be one of {_CHOICES}, got {choice!r}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "reference"
    if choice == "triton" and device.type != "cuda":
        if not INTERPRETED:
            raise RuntimeError(
                f"the triton backend needs CUDA tensors (got {device.type}) or the Triton "
                f"interpreter: set {INTERPRET_ENV}=1 before importing kernels, or use "
                f"backend='reference'"
            )
        if INTERPRETER_BROKEN:
            raise RuntimeError(
                f"the Triton interpreter cannot run in this process: triton was imported "
                f"before kernels, when {INTERPRET_ENV} was not set. Import kernels before "
                f"triton, or set {INTERPRET_ENV}=1 in the environment; or use "
                f"backend='reference'"
            )
    return choice  # type: ignore[return-value]
