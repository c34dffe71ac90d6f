"""The one place that decides which backend runs a kernel call, and when Triton is interpreted.

Two backends compute the same functions:

* ``"triton"``: the Triton kernels. Compiled on CUDA tensors; on CPU tensors they run in the
  Triton interpreter, which executes the same kernels in numpy (slowly: it is for proving the
  kernels correct, not for speed).
* ``"numba"``: the numba kernels (``kernels/numba_*.py``), compiled for the CPU (CPU tensors
  only); the CPU fast path. Attention is fp32: fp16 and bf16 attention calls on this backend run
  the reference (numba has no fp16 arithmetic); slot mapping, ``store_kv`` and ``copy_blocks``
  run every dtype.
* ``"reference"``: plain torch (``kernels.reference``), obviously correct. It needs only torch:
  triton and numba are optional dependencies.

Precedence, first match wins: the ``backend=`` argument of a call, the ``PAGEDKV_BACKEND``
environment variable, then ``"auto"``: ``"triton"`` for CUDA tensors when triton is installed,
``"numba"`` for CPU tensors when numba imports, ``"reference"`` otherwise.

**The interpreter rule.** Triton reads ``TRITON_INTERPRET`` when it *decorates* a function with
``@triton.jit``, and that includes its own helpers (``tl.sum``, ``tl.max``, ``tl.zeros``),
decorated when ``triton`` is first imported. So interpreter or compiler is decided once per
process, by the value the variable has when ``triton`` is first imported. Hence:

1. Importing ``pagedkv.kernels`` imports no triton and writes no environment variable.
2. Triton is imported when the triton backend is first needed: by the first call (or
   ``resolve_backend``) that resolves to ``"triton"``, or by importing one of the
   ``pagedkv.kernels.triton_*`` kernel modules. All of them import it through
   ``kernels.triton_import``, which applies step 3 first.
3. At that moment, if ``triton`` is not imported yet, ``TRITON_INTERPRET`` is unset and CUDA is
   absent, ``TRITON_INTERPRET=1`` is set (in ``os.environ``, so child processes inherit it).
   Otherwise nothing is written: a value the user set stands (``TRITON_INTERPRET=0`` keeps the
   interpreter off), and with CUDA present the kernels compile.
4. ``use_interpreter()`` asks for the interpreter explicitly (even with CUDA present). Like
   setting ``TRITON_INTERPRET=1`` yourself, it works only before ``triton`` is imported.

A triton call on CPU tensors then runs only if ``triton`` was imported under the interpreter.
Otherwise it raises ``RuntimeError``, with one of three reasons: triton is not installed; the
interpreter is off (the user set ``TRITON_INTERPRET`` to a false value, or CUDA is present and
nobody asked for it), the "needs CUDA tensors" error; or ``triton`` was imported, by someone else,
before the rule could choose the interpreter. The reference backend works in every case.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
from typing import Literal

import torch

Backend = Literal["triton", "numba", "reference"]
BackendChoice = Literal["auto", "triton", "numba", "reference"]

BACKEND_ENV = "PAGEDKV_BACKEND"
INTERPRET_ENV = "TRITON_INTERPRET"
_CHOICES: tuple[BackendChoice, ...] = ("auto", "triton", "numba", "reference")
_TRUE = ("1", "true", "on", "yes", "y")  # Triton 3.9's getenv_bool, case-insensitive
_TRITON_IMPORT = "pagedkv.kernels.triton_import"


def _triton_imported() -> bool:
    """Whether ``triton`` is imported in this process (``None`` in ``sys.modules`` hides it)."""
    return sys.modules.get("triton") is not None


def _triton_installed() -> bool:
    """Whether ``triton`` can be imported; imports nothing."""
    try:
        return importlib.util.find_spec("triton") is not None
    except ImportError:  # a meta-path finder that refuses triton, as tests hide it
        return False


def _interpreter_wanted() -> bool:
    """What the rule asks for: the user's ``TRITON_INTERPRET`` if set, else CUDA's absence."""
    value = os.environ.get(INTERPRET_ENV)
    if value is not None:
        return value.lower() in _TRUE
    return not torch.cuda.is_available()


def interpreter_active() -> bool:
    """Whether ``triton`` is imported and runs in the interpreter in this process.

    ``False`` before ``triton`` is imported: it is decided then (the rule in this module's
    docstring), and cannot change afterwards.
    """
    if not _triton_imported():
        return False
    import triton
    import triton.language as tl

    return not isinstance(tl.sum, triton.JITFunction)  # Triton's own helper, decorated on import


def use_interpreter() -> None:
    """Run the triton backend in the Triton interpreter in this process, even with CUDA present.

    Sets ``TRITON_INTERPRET=1`` (over any value the user set). Must be called before ``triton``
    is imported: afterwards it does nothing if the interpreter is already active, and raises
    ``RuntimeError`` if it is not, because Triton cannot switch in a running process.
    """
    if not _triton_imported():
        os.environ[INTERPRET_ENV] = "1"
    elif not interpreter_active():
        raise RuntimeError(
            "use_interpreter() must be called before triton is imported, and triton is already "
            "imported without the interpreter; Triton cannot switch in a running process. Call "
            f"it first, or set {INTERPRET_ENV}=1 in the environment before starting Python"
        )


def choose_interpreter() -> None:
    """Step 3 of the rule: set ``TRITON_INTERPRET=1`` if triton is not imported yet, the
    variable is unset and CUDA is absent. ``kernels.triton_import`` calls it right before it
    imports triton; nothing else should."""
    if not _triton_imported() and INTERPRET_ENV not in os.environ and _interpreter_wanted():
        os.environ[INTERPRET_ENV] = "1"


def _load_triton(device: torch.device) -> None:
    """Import triton under the rule; ``RuntimeError`` if its kernels cannot run on ``device``."""
    if not _triton_installed():
        raise RuntimeError(
            "the triton backend needs the triton package, but triton is not installed (it ships "
            "wheels for Linux only): install it with `pip install 'triton>=3.0'`, or use "
            f"backend='reference' (or {BACKEND_ENV}=reference), which needs only torch"
        )
    importlib.import_module(_TRITON_IMPORT)
    if device.type == "cuda" or interpreter_active():
        return
    if not _interpreter_wanted():
        value = os.environ.get(INTERPRET_ENV)
        why = f"{INTERPRET_ENV}={value}" if value is not None else "CUDA is present"
        raise RuntimeError(
            f"the triton backend needs CUDA tensors (got {device.type}) or the Triton "
            f"interpreter, which is off in this process ({why}): set {INTERPRET_ENV}=1 or call "
            f"pagedkv.kernels.use_interpreter() before triton is imported, or use "
            f"backend='reference'"
        )
    raise RuntimeError(
        "the Triton interpreter cannot run in this process: triton was imported before the "
        "interpreter was chosen, and Triton decides when it is imported. pagedkv chooses it when "
        "it first needs triton, and only if triton is not imported by then: import triton after "
        f"the first triton-backend call, or set {INTERPRET_ENV}=1 (or call "
        "pagedkv.kernels.use_interpreter()) before importing triton; or use backend='reference'"
    )


@functools.cache
def numba_importable() -> bool:
    """Whether ``numba`` imports in this process (tried once, then remembered)."""
    try:
        importlib.import_module("numba")
    except ImportError:
        return False
    return True


def _check_numba(device: torch.device) -> None:
    """``RuntimeError`` unless the numba backend can run on ``device``."""
    if not numba_importable():
        raise RuntimeError(
            "the numba backend needs the numba package, which does not import here: install it "
            "with `pip install numba`, or use backend='reference', which needs only torch"
        )
    if device.type != "cpu":
        raise RuntimeError(
            f"the numba backend runs on CPU tensors only (got {device.type}): use "
            "backend='triton' on a GPU, or backend='reference'"
        )


def resolve_backend(backend: str | None, device: torch.device) -> Backend:
    """Return the backend that runs a call on tensors living on ``device``.

    Resolving to ``"triton"`` loads triton (choosing the interpreter per the rule above).
    Raises ``TypeError`` for a ``backend`` that is neither ``None`` nor a ``str``,
    ``ValueError`` for an unknown name and ``RuntimeError`` when ``"triton"`` is asked for
    where it cannot run: triton not installed, or CPU tensors without a working interpreter,
    and when ``"numba"`` is asked for without numba or for tensors off the CPU.
    """
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str or None, got {type(backend).__name__}")
    choice = backend if backend is not None else os.environ.get(BACKEND_ENV, "auto")
    choice = choice.strip().lower()
    if choice not in _CHOICES:
        source = "backend" if backend is not None else BACKEND_ENV
        raise ValueError(f"{source} must be one of {_CHOICES}, got {choice!r}")
    if choice == "auto":
        if device.type == "cuda" and _triton_installed():
            choice = "triton"
        elif device.type == "cpu" and numba_importable():
            choice = "numba"
        else:
            choice = "reference"
    if choice == "triton":
        _load_triton(device)
    elif choice == "numba":
        _check_numba(device)
    return choice  # type: ignore[return-value]
