"""What every numba kernel shares: zero-copy array views of CPU tensors, the thread policy, and
the compile flags.

**Views.** ``as_array`` returns a numpy view of a CPU tensor's memory (``Tensor.numpy()``): a
kernel that writes it writes the tensor. Float tensors of 2-byte dtypes (fp16, bf16) have no
numpy arithmetic here, so the byte-moving kernels (``store_kv``, ``copy_blocks``) see every cache
as raw bytes (``as_bytes``), one compiled signature for every dtype.

**Threads.** Every attention kernel is compiled twice: a serial driver that runs its programs on
the calling thread, and a parallel one that spreads them over numba's pool. ``launch_threads``
picks, per call: the pool, on ``torch.get_num_threads()`` threads capped at numba's pool size
(``numba.config.NUMBA_NUM_THREADS``, the machine's cores unless ``NUMBA_NUM_THREADS`` says
otherwise), when that is more than one thread and the call reads at least
``PARALLEL_MIN_BYTES`` of K/V; the calling thread otherwise, because a parallel launch costs
about 50 us (``docs/kernels.md``), more than a small call's whole work. One knob,
``torch.set_num_threads``, so sets the threads of the model's matmuls and of attention alike;
``bench/bench_attention.py`` fixes it at one.

**Threading layer.** Unless ``NUMBA_THREADING_LAYER`` is set, importing this module asks numba
for its own ``workqueue`` layer (numba picks the layer at its first parallel launch). numba's
OpenMP layer loads the libgomp that torch also runs its thread pool on, and with GOMP's default
active wait a launch measured 16 ms instead of 0.3 ms (batch 1, context 1024, one thread, on
this project's 2-core machine; ``docs/kernels.md``). ``workqueue`` does not support parallel
launches from several Python threads at once; pagedkv launches from one.

**Prefetch.** ``prefetch`` asks the CPU to start loading an array element's cache line
(LLVM's ``llvm.prefetch``, read, keep in all levels). The attention kernels prefetch the K/V
rows ``PREFETCH_AHEAD`` keys ahead: a block table sends the reads to a new place at every block,
where the hardware prefetcher, which follows only regular strides, would start cold.

**Compile flags.** ``FASTMATH`` lets LLVM reorder and contract fp32 sums (so the dot products
vectorize) but keeps NaN and infinity semantics: a NaN read from a slot no token was written to
must reach the output, as the kernel properties require. Every kernel is ``cache=True``: the
first process compiles (``docs/kernels.md`` gives the times) and writes the machine code to
``__pycache__`` next to the module (or numba's cache directory when that is read-only); later
processes load it.
"""

from __future__ import annotations

import math
import os

import numba
import numpy as np
import torch
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

FASTMATH = {"reassoc", "contract", "nsz", "arcp"}  # no "nnan"/"ninf": NaN must propagate
THREADING_LAYER = "workqueue"
PARALLEL_MIN_BYTES = 1 << 20  # K/V a call must read before a parallel launch pays
PREFETCH_AHEAD = 16  # keys: about a DRAM latency of work at head dim 64
CACHE_LINE_FLOATS = 16  # 64-byte lines of fp32

if "NUMBA_THREADING_LAYER" not in os.environ:
    numba.config.THREADING_LAYER = THREADING_LAYER


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


def launch_threads(work_bytes: int) -> int:
    """Threads for a call that reads about ``work_bytes`` of K/V: 1 (run the serial driver)
    below ``PARALLEL_MIN_BYTES`` or when ``num_threads()`` is 1; else ``num_threads()``, which
    it sets as numba's thread count for this calling thread (numba keeps it per thread)."""
    threads = num_threads()
    if threads == 1 or work_bytes < PARALLEL_MIN_BYTES:
        return 1
    if numba.get_num_threads() != threads:
        numba.set_num_threads(threads)
    return threads


@intrinsic
def prefetch(typingctx, array, i, j, k):  # type: ignore[no-untyped-def]
    """``prefetch(array, i, j, k)`` in a numba kernel: start loading the cache line of the 3-d
    ``array[i, j, k]`` (no bounds check, no effect on the program's result)."""
    signature = types.void(array, i, j, k)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        array_type = sig.args[0]
        view = context.make_array(array_type)(context, builder, args[0])
        indices = [
            context.cast(builder, a, t, types.intp)
            for a, t in zip(args[1:], sig.args[1:], strict=True)
        ]
        pointer = cgutils.get_item_pointer(
            context, builder, array_type, view, indices, wraparound=False
        )
        byte_pointer = ir.IntType(8).as_pointer()
        int32 = ir.IntType(32)
        function = cgutils.get_or_insert_function(
            builder.module,
            ir.FunctionType(ir.VoidType(), [byte_pointer, int32, int32, int32]),
            "llvm.prefetch.p0i8",
        )
        read, keep, data = ir.Constant(int32, 0), ir.Constant(int32, 3), ir.Constant(int32, 1)
        builder.call(function, [builder.bitcast(pointer, byte_pointer), read, keep, data])
        return context.get_dummy_value()

    return signature, codegen


@intrinsic
def float32_from_bits(typingctx, bits):  # type: ignore[no-untyped-def]
    """The fp32 whose bit pattern is the int32 ``bits`` (an LLVM bitcast: no memory, so a loop
    around it still vectorizes)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.int32), codegen


# exp(x) = 2**n * exp(r), n = round(x / ln 2), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2]; ln 2 is
# split in two so that n * LN2_HIGH is exact in fp32 (its 8 significant bits times |n| < 2**8),
# which holds only without ``reassoc``: with it LLVM folds the two products into one.
LOG2_E = np.float32(1.4426950408889634)
LN2_HIGH = np.float32(0.693359375)
LN2_LOW = np.float32(0.6931471805599453 - 0.693359375)
# exp(r) = 1 + r + r**2 * q(r): q's coefficients, a degree-4 least-squares fit at Chebyshev
# nodes of (exp(r) - 1 - r) / r**2 on that interval (maximum relative error of exp(r) 7.2e-8).
EXP_Q = (
    np.float32(0.5),
    np.float32(0.16666576266288757),
    np.float32(0.04166646674275398),
    np.float32(0.008363175205886364),
    np.float32(0.0013933643931522965),
)
EXP_MIN = np.float32(-87.33654)  # ln of fp32's smallest normal: below it exp32 returns 0


@numba.njit(fastmath=FASTMATH - {"reassoc"})
def exp32(x):  # type: ignore[no-untyped-def]
    """``exp(x)`` of an fp32 ``x <= 88``, within 1.5e-7 relative of the exact value (9.1e-8 at
    worst on a grid of 20 million points from ``EXP_MIN`` to 88), without a branch or a libm
    call, so the softmax loops around it vectorize (numba's ``np.exp`` calls libm per element).
    ``exp32(x) = 0`` below ``EXP_MIN`` (for ``-inf`` too); NaN gives NaN. Compiled without
    ``reassoc`` (LLVM inlines it, keeping these flags on its instructions), so its range
    reduction stays as written in every kernel."""
    clamped = EXP_MIN if x < EXP_MIN else x  # NaN < EXP_MIN is false: NaN stays
    n = np.floor(clamped * LOG2_E + np.float32(0.5))
    n = n if n == n else np.float32(0.0)  # NaN's exponent: r below is NaN, and so the result
    r = clamped - n * LN2_HIGH - n * LN2_LOW
    q = EXP_Q[4]
    q = q * r + EXP_Q[3]
    q = q * r + EXP_Q[2]
    q = q * r + EXP_Q[1]
    q = q * r + EXP_Q[0]
    value = (q * r * r + r + np.float32(1.0)) * float32_from_bits((np.int32(n) + 127) << 23)
    return np.float32(0.0) if x < EXP_MIN else value


@numba.njit(fastmath=FASTMATH - {"reassoc"})
def sum_in_order(values):  # type: ignore[no-untyped-def]
    """The fp32 sum of a 1-d array, added left to right. Without ``reassoc`` LLVM may not
    reorder it, so every compiled copy of a kernel (the serial and the parallel driver, each
    optimized with its own surroundings) adds in the same order and gets the same bits."""
    total = np.float32(0.0)
    for value in values:
        total += value
    return total
