"""Kernels that read and write the KV cache through block tables (Triton, with a torch reference).

Cache layout: K and V each ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous.
See ``docs/kernels.md``.

Without CUDA, importing this package sets ``TRITON_INTERPRET=1`` (unless the user set it) before
anything imports ``triton``: Triton reads the variable when it decorates functions, its own
included. ``kernels.backend`` does it, so it is imported first, on its own, below.
"""

if __name__ != "pagedkv.kernels":  # the repository root is on sys.path: refuse a second name
    raise ImportError(f"import pagedkv.kernels, not {__name__}: one module, one name")

from pagedkv.kernels import backend

backend.configure_interpreter()  # idempotent; the first import above already did it

from pagedkv.kernels.api import (  # noqa: E402 - must follow configure_interpreter()
    contiguous_decode_attention,
    copy_blocks,
    paged_decode_attention,
    slot_mapping,
    store_kv,
)
from pagedkv.kernels.backend import INTERPRETED, Backend, BackendChoice, resolve_backend  # noqa: E402

__all__ = [
    "INTERPRETED",
    "Backend",
    "BackendChoice",
    "contiguous_decode_attention",
    "copy_blocks",
    "paged_decode_attention",
    "resolve_backend",
    "slot_mapping",
    "store_kv",
]
