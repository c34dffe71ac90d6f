"""What every numba kernel shares: zero-copy array views of CPU tensors, the thread policy, and
the compile flags.

**Views.** ``as_array`` returns a numpy view of a CPU tensor's memory (``Tensor.numpy()``): a
kernel that writes it writes the tensor. Float tensors of 2-byte dtypes (fp16, bf16) have no
numpy arithmetic here, so the byte-moving kernels (``store_kv``, ``copy_blocks``) see every cache
as raw bytes (``as_bytes``), one compiled signature for every dtype.

**Threads.** A parallel kernel runs on ``torch.get_num_threads()`` threads, capped at numba's
pool (``numba.config.NUMBA_NUM_THREADS``, the machine's cores unless ``NUMBA_NUM_THREADS`` says
otherwise). One knob, ``torch.set_num_threads``, so sets the threads of the model's matmuls and
of attention alike; ``bench/bench_attention.py`` fixes it. ``apply_thread_policy`` applies it
before each launch (numba keeps the setting per calling thread).

**Compile flags.** ``FASTMATH`` lets LLVM reorder and contract fp32 sums (so the dot products
vectorize) but keeps NaN and infinity semantics: a NaN read from a slot no token was written to
must reach the output, as the kernel properties require. Every kernel is ``cache=True``: the
first process compiles (``docs/kernels.md`` gives the times) and writes the machine code to
``__pycache__`` next to the module (or numba's cache directory when that is read-only); later
processes load it.
"""

from __future__ import annotations

import math

import numba
import numpy as np
import torch

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # no "nnan"/"ninf": NaN must propagate


def as_array(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor of a numpy dtype (no copy; writes reach the tensor)."""
    return tensor.detach().numpy()


def as_bytes(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as ``uint8`` ``[rows, bytes per row]`` (rows: its first
    dimension), whatever its dtype; a view, no copy."""
    flat = tensor.detach().reshape(tensor.shape[0], math.prod(tensor.shape[1:]))
    return flat.view(torch.uint8).numpy()


def num_threads() -> int:
    """The threads a parallel kernel runs on: ``torch.get_num_threads()``, at most numba's pool."""
    return max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))


def apply_thread_policy() -> int:
    """Set numba's thread count for this calling thread to ``num_threads()``; return it."""
    threads = num_threads()
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads
