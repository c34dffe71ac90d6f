"""The package's one import of triton, made under the interpreter rule of ``kernels.backend``.

Every Triton kernel module (``kernels/triton_*.py``) takes ``triton`` and ``tl`` from here, so
whichever of them loads first, through the first triton-backend call or a direct import,
lets the rule set ``TRITON_INTERPRET`` before ``triton`` itself is imported. Importing this
module imports triton; it raises ``ModuleNotFoundError`` where triton is not installed.
"""

from pagedkv.kernels.backend import choose_interpreter

choose_interpreter()

import triton  # noqa: E402 - TRITON_INTERPRET must be settled before triton is imported
import triton.language as tl  # noqa: E402

__all__ = ["tl", "triton"]
