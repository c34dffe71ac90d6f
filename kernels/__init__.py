"""Kernels that read and write the KV cache through block tables (Triton for GPUs, numba for
CPUs, with a torch reference).

Cache layout: K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
See ``docs/kernels.md``.

Importing this package has no process-wide side effect: it imports no ``triton`` and writes no
environment variable. triton and numba are optional; the torch reference backend needs only
torch. numba is imported when a call on CPU tensors first resolves its backend (``auto`` picks
numba there when it imports), and its threading layer is chosen when the first numba kernel
module loads (``kernels.numba_runtime``). Triton is imported when the triton backend is first
needed (a call resolved to ``"triton"``, or an import of a ``pagedkv.kernels.triton_*``
module), and the interpreter is chosen at that moment, because Triton decides once, when it is
imported: if ``triton`` is not imported yet, ``TRITON_INTERPRET`` is unset and CUDA is absent,
``TRITON_INTERPRET=1`` is set first. A value the user set stands, and ``use_interpreter()`` asks
for the interpreter explicitly; both work only before ``triton`` is imported.
``interpreter_active()`` says what was decided. The whole rule, and the errors a triton call on
CPU tensors raises when it cannot run, are in ``kernels.backend``.
"""

if __name__ != "pagedkv.kernels":  # the repository root is on sys.path: refuse a second name
    raise ImportError(f"import pagedkv.kernels, not {__name__}: one module, one name")

from pagedkv.kernels.api import (
    contiguous_decode_attention,
    copy_blocks,
    paged_decode_attention,
    paged_prefill_attention,
    slot_mapping,
    store_kv,
)
from pagedkv.kernels.backend import (
    Backend,
    BackendChoice,
    interpreter_active,
    resolve_backend,
    use_interpreter,
)

__all__ = [
    "Backend",
    "BackendChoice",
    "contiguous_decode_attention",
    "copy_blocks",
    "interpreter_active",
    "paged_decode_attention",
    "paged_prefill_attention",
    "resolve_backend",
    "slot_mapping",
    "store_kv",
    "use_interpreter",
]
