"""Launch configurations of the Triton attention and store kernels, as pure data, and what fits
on an SM.

A launcher (``triton_decode``, ``triton_prefill``, ``triton_store_kv``) never decides a launch
inline: a pure function of shapes, dtypes, host integers and the GPU generation builds a
:class:`LaunchConfig` (grid, constexprs, the runtime scalars, ``num_warps``, ``num_stages``, a
register cap), :func:`run` launches exactly that, and the compile gate (``python -m
pagedkv.kernels.compile_check``) compiles exactly that for sm_80, sm_90 and sm_100 with no GPU.
Both read the specialization hints Triton's JIT derives from the arguments
(:meth:`LaunchConfig.hints`) from the same config.

:func:`tiles` is the attention kernels' tile table, per kernel, query dtype, fp8 cache and
padded head dim; docs/kernels.md gives the compile measurement behind every row. Importing this
module imports no triton.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pagedkv.kernels.fp8 import encode_limits
from pagedkv.spec.fp8 import fp8_format

SCALAR_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
INDEX_TYPES = {torch.int32: "i32", torch.int64: "i64"}
ELEMENTS_PER_PROGRAM = 4096  # what one program of the store and copy kernels moves, at most
MIN_DOT = 16  # the rows, columns and inner size a tile pads a tl.dot operand to, at least


@dataclass(frozen=True)
class Target:
    """An NVIDIA GPU generation's per-SM limits (CUDA programming guide, compute capabilities
    table): what bounds how many programs of a compiled kernel are resident at once."""

    capability: int  # 80, 90, 100
    shared_per_sm: int  # bytes of shared memory an SM gives its programs
    shared_reserved: int = 1024  # bytes the runtime keeps per resident program
    registers_per_sm: int = 65536
    register_unit: int = 256  # registers are allocated per warp, in units of this many
    max_warps: int = 64
    max_programs: int = 32

    @property
    def name(self) -> str:
        return f"sm_{self.capability}"


TARGETS: dict[int, Target] = {
    80: Target(80, shared_per_sm=164 * 1024),
    90: Target(90, shared_per_sm=228 * 1024),
    100: Target(100, shared_per_sm=228 * 1024),
}
DEFAULT_CAPABILITY = 90  # the table row used off CUDA (the interpreter), where nothing is resident


def programs_per_sm(target: Target, registers: int, shared: int, num_warps: int) -> int:
    """How many programs of a kernel using ``registers`` per thread and ``shared`` bytes of
    shared memory, with ``num_warps`` warps, are resident on one SM of ``target`` at once: the
    least of what the register file, the shared memory, the warp slots and the program slots
    allow. 0 if one program does not fit."""
    per_warp = -(-registers * 32 // target.register_unit) * target.register_unit
    by_registers = (target.registers_per_sm // per_warp) // num_warps if per_warp else 10**9
    by_shared = target.shared_per_sm // (shared + target.shared_reserved)
    by_warps = target.max_warps // num_warps
    return min(by_registers, by_shared, by_warps, target.max_programs)


def occupancy(target: Target, programs: int, num_warps: int) -> float:
    """The fraction of the SM's warp slots that ``programs`` resident programs fill."""
    return programs * num_warps / target.max_warps


@dataclass(frozen=True)
class Tiles:
    """One row of the tile table."""

    block_n: int  # keys per step of the key loop
    rows: int  # query rows per program (prefill: BLOCK_Q * BLOCK_G); decode: at least
    num_warps: int
    num_stages: int
    max_registers: int | None = None  # ptxas's cap per thread (``maxnreg``); None: its choice


def padded_head_dim(head_dim: int) -> int:
    """The head dim a tile spans: the next power of two, at least ``MIN_DOT``."""
    return max(MIN_DOT, 1 << (head_dim - 1).bit_length())


def tiles(
    kernel: str, dtype: torch.dtype, head_dim: int, capability: int, fp8: bool = False
) -> Tiles:
    """The tile table: tiles, warps and pipeline stages per kernel (``"decode"`` or
    ``"prefill"``), query dtype (the cache's, or an ``fp8`` cache's reader's), padded head dim
    and target (``capability``: rows differ on sm_80). docs/kernels.md gives the measurement
    behind each row.

    16-bit caches feed ``tl.dot`` their own dtype (native ``mma``); fp32 caches run exact IEEE
    fp32 dots, which Triton lowers to FMA, so their tiles are smaller to keep the operands in
    registers without spilling."""
    block_d = padded_head_dim(head_dim)
    half = dtype != torch.float32
    if kernel == "decode":
        block_n = 32 if half and block_d <= 64 else 16
        if fp8 and half:  # decoded tiles go to shared memory: 1 stage; 8 warps of 48 registers
            # (62.5%) where that cap does not spill: not D 256, nor bf16 at a masked D on sm_90
            masked_bf16 = dtype == torch.bfloat16 and head_dim != block_d and capability >= 90
            cap = None if block_d > 128 or masked_bf16 else 48
            return Tiles(block_n=16, rows=MIN_DOT, num_warps=8, num_stages=1, max_registers=cap)
        return Tiles(block_n=block_n, rows=MIN_DOT, num_warps=4, num_stages=2)
    if kernel == "prefill":
        num_stages = 2
        if half:  # 64 rows read each K/V tile once for 64 query rows; 8 warps hold them at D 128
            rows = 64 if block_d <= 128 else 32
            block_n = 32 if block_d <= 64 else 16
            num_warps = 8 if block_d == 128 else 4
            if block_d == 128 and capability < 90:  # sm_80: 8 warps of 64 rows spill at D80/96
                rows, block_n, num_warps = 32, 16, 4
            if fp8:  # decoded tiles are written to shared memory: 1 stage (sm_80: 16 keys)
                block_n, num_stages = 16 if capability < 90 else block_n, 1
        else:
            rows = 32 if block_d <= 64 else 16
            block_n = 16
            num_warps = 8 if block_d >= 256 else 4
        return Tiles(block_n=block_n, rows=rows, num_warps=num_warps, num_stages=num_stages)
    raise ValueError(f"kernel must be 'decode' or 'prefill', got {kernel!r}")


@dataclass(frozen=True)
class Call:
    """What an attention launch's configuration reads from its call: shapes, dtypes, the block
    table's row stride, and where it runs (``capability`` selects the tile-table row;
    ``interpreted``: the tensors are not on CUDA, so the Triton interpreter runs the kernel)."""

    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # the query's (and the caches', unless they are fp8)
    index_dtype: torch.dtype  # context_lens' (and cu_seqlens_q's)
    block_size: int
    table_stride: int
    capability: int = DEFAULT_CAPABILITY
    interpreted: bool = False
    fp8: str | None = None  # the caches' fp8 format (read as uint8), or None: the query's dtype

    @property
    def fenced(self) -> bool:
        """Whether the kernels pass an fp8 cache's decoded tiles through ``triton_fp8.fence``:
        compiled (the interpreter has no inline assembly), for 16-bit MMA operands."""
        return self.fp8 is not None and not self.interpreted and self.dtype != torch.float32


@dataclass(frozen=True)
class LaunchConfig:
    """Everything one kernel launch is made of, except the tensors' addresses.

    ``signature`` gives each runtime argument, in the kernel's order, its Triton type (``"*fp16"``
    for a pointer to fp16, ``"i32"``, ``"fp32"``); ``scalars`` the value of each non-pointer
    one. ``constexprs`` are the compile-time arguments."""

    kernel: str  # the @triton.jit function's name in its module
    grid: tuple[int, int, int]
    signature: dict[str, str]
    scalars: dict[str, int | float]
    constexprs: dict[str, int | bool | str]
    num_warps: int
    num_stages: int
    max_registers: int | None = None

    def options(self) -> dict[str, int]:
        """The compile options a launch, a warmup and the compile gate pass alike."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers is not None:
            options["maxnreg"] = self.max_registers
        return options

    def pointer_dtypes(self) -> list[torch.dtype]:
        """The element dtype of each pointer argument, in order (what ``warmup`` takes)."""
        by_name = {name: dtype for dtype, name in (*SCALAR_TYPES.items(), *INDEX_TYPES.items())}
        by_name["u8"] = torch.uint8  # an fp8 cache's codes
        return [by_name[k[1:]] for k in self.signature.values() if k.startswith("*")]

    def hints(self) -> tuple[frozenset[str], frozenset[str]]:
        """The specialization Triton's JIT derives from the arguments: (arguments known
        divisible by 16, integer arguments equal to 1, which it folds as constants). Pointers
        count as divisible: the launchers pass fresh or contiguous torch tensors, whose
        storage starts 16-byte aligned (:func:`aligned`)."""
        divisible = {name for name, kind in self.signature.items() if kind.startswith("*")}
        ones = set()
        for name, value in self.scalars.items():
            if self.signature[name].startswith("i"):
                if value % 16 == 0:
                    divisible.add(name)
                elif value == 1:
                    ones.add(name)
        return frozenset(divisible), frozenset(ones)


def run(kernel: Any, config: LaunchConfig, *tensors: torch.Tensor) -> None:
    """Launch the ``@triton.jit`` ``kernel`` with ``config``: the tensors fill the signature's
    pointers, in order, then its scalars, constexprs and options."""
    kernel[config.grid](*tensors, *config.scalars.values(), **config.constexprs, **config.options())


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its data starts on a 16-byte boundary, else a copy that does (a
    clone: a dense tensor keeps its strides, another becomes contiguous), so that the launch
    matches the hints the compile gate checks; launchers read strides after it."""
    return tensor if tensor.data_ptr() % 16 == 0 else tensor.clone()


def dot_precision(dtype: torch.dtype, interpreted: bool = False) -> str:
    """``tl.dot``'s precision for a query dtype: exact IEEE fp32 for fp32 queries, and for bf16
    operands upcast under the interpreter. For fp16 and bf16 the operands stay 16-bit and the
    product is the native one whatever this says (docs/kernels.md, Tolerances)."""
    return "ieee" if dtype == torch.float32 or interpreted else "tf32"


def capability(device: torch.device) -> int:
    """The tile table's row for ``device``: its compute capability on CUDA, else the default."""
    if device.type != "cuda":
        return DEFAULT_CAPABILITY
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def cache_pointers(call: Call) -> dict[str, str]:
    """The K/V cache pointers of an attention kernel's signature: an fp8 cache's ``uint8``
    codes, any other the query's dtype."""
    kind = "*u8" if call.fp8 else f"*{SCALAR_TYPES[call.dtype]}"
    return {"k_cache_ptr": kind, "v_cache_ptr": kind}


def fp8_constexprs(name: str | None, *, store: bool = False) -> dict[str, int | bool]:
    """The constexprs a kernel takes for a cache of fp8 format ``name`` (``None``: not fp8, and
    ``FP8`` false): ``FP8`` and ``E5M2``, and with ``store`` the format's ``MANTISSA``, ``BIAS``,
    largest code ``MAX_CODE`` and that value's fp32 bits ``MAX_BITS``."""
    fmt = fp8_format(name) if name is not None else None
    constexprs: dict[str, int | bool] = {
        "FP8": fmt is not None,
        "E5M2": bool(fmt and fmt.has_infinity),
    }
    if store:
        constexprs["MANTISSA"] = fmt.mantissa_bits if fmt else 0
        constexprs["BIAS"] = fmt.bias if fmt else 0
        constexprs["MAX_CODE"], constexprs["MAX_BITS"] = encode_limits(fmt) if fmt else (0, 0)
    return constexprs


def operand_constexprs(call: Call) -> dict[str, str | bool | int]:
    """The attention kernels' constexprs for their dots' operands: the dots' precision, bf16's
    upcast under the interpreter, and an fp8 cache's format and fence."""
    return {
        "DOT_PRECISION": dot_precision(call.dtype, call.interpreted),
        "DOT_FP32": call.interpreted and call.dtype == torch.bfloat16,
        **fp8_constexprs(call.fp8),
        "FENCE": call.fenced,
    }
