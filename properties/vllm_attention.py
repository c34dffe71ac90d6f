"""vLLM 0.32's Triton unified attention beside ours: same answers, and its compiled figures.

Runs in ``.venv-vllm``, both kernels in the Triton interpreter on the same spec-run paged caches,
with GQA and windows; fp16 and fp32 only: the Triton 3.9 interpreter's ``tl.dot`` multiplies bf16
operands' raw bits (docs/kernels.md). ``--compile`` compiles vLLM's kernel with the arguments its
launcher passes (captured) through ``compile_variant``: docs/results.md's figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import Tensor

from pagedkv import kernels
from pagedkv.kernels import compile_check
from pagedkv.kernels.launch_config import INDEX_TYPES, SCALAR_TYPES, LaunchConfig
from properties import kernel_cases as kc

if os.environ.get("TRITON_INTERPRET") != "0":  # the properties: both kernels interpreted
    kernels.use_interpreter()

VLLM_MODULE = "vllm.v1.attention.ops.triton_unified_attention"
SEGMENTS = 16  # vLLM's NUM_PAR_SOFTMAX_SEGMENTS (v1/attention/backends/triton_attn.py)
MIN_LAUNCH_GRID_SIZE_2D = 128  # vLLM's: below this many sequences x KV heads, decode goes 3D


def load_unified_attention() -> ModuleType:
    """vLLM's ``triton_unified_attention`` with Triton on (vLLM's CPU build turns it off without a
    driver): its import-time check sees a ``"cpu"`` backend entry while it is imported."""
    if VLLM_MODULE in sys.modules:
        return sys.modules[VLLM_MODULE]
    import importlib

    from triton.backends import backends

    backends["cpu"] = backends["nvidia"]
    try:
        return importlib.import_module(VLLM_MODULE)
    finally:
        del backends["cpu"]


def unified_call(
    query: Tensor, k_cache: Tensor, v_cache: Tensor, tables: Tensor, cu_seqlens: Tensor,
    lens: Tensor, scale: float, window: int | None,
) -> dict[str, Any]:  # fmt: skip
    """The arguments vLLM's Triton backend passes ``unified_attention``: causal, the window as
    ``(w - 1, 0)``, no softcap, and the 3D segment buffers, which it uses for a pure decode batch
    of fewer than ``128 / num_kv_heads`` sequences."""
    _, num_heads, head_dim = query.shape
    threshold = MIN_LAUNCH_GRID_SIZE_2D // k_cache.shape[2]
    padded = 1 << (head_dim - 1).bit_length()
    scalars = torch.empty(threshold, num_heads, SEGMENTS)
    window_size = (-1, -1) if window is None else (window - 1, 0)
    return dict(
        q=query, k=k_cache, v=v_cache, out=torch.empty_like(query), cu_seqlens_q=cu_seqlens.int(),
        max_seqlen_q=int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), seqused_k=lens.int(),
        max_seqlen_k=int(lens.max()), softmax_scale=scale, causal=True, window_size=window_size,
        block_table=tables, softcap=0, q_descale=None, k_descale=None, v_descale=None,
        seq_threshold_3D=threshold, num_par_softmax_segments=SEGMENTS,
        softmax_segm_output=torch.empty(threshold, num_heads, SEGMENTS, padded),
        softmax_segm_max=scalars, softmax_segm_expsum=scalars.clone(),
    )  # fmt: skip


def vllm_attention(*args: Any) -> torch.Tensor:
    """vLLM's ``unified_attention`` on :func:`unified_call`'s arguments: its output."""
    call = unified_call(*args)
    load_unified_attention().unified_attention(**call)
    return call["out"]


def draw_case(
    data: st.DataObject,
) -> tuple[kc.KVCache, list, torch.Tensor, torch.Tensor, int | None]:
    """A spec-run cache (fp16 or fp32, GQA, one or two KV heads), its live batch (not empty;
    tables padded with block 0: vLLM reads whole tiles of table entries) and a window or None."""
    dtype = data.draw(st.sampled_from([torch.float16, torch.float32]), label="dtype")
    cache = kc.draw_cache(data, "reference", dtype=dtype)
    seqs, tables, lens = cache.batch(extra_columns=1, pad=0)
    assume(seqs)  # a run that freed every sequence has nothing to attend
    window = data.draw(st.none() | st.integers(1, int(lens.max()) + 1), label="window")
    return cache, seqs, tables, lens, window


@settings(max_examples=kc.kernel_examples(80), deadline=None)
@given(data=st.data())
def test_batches_agree(data: st.DataObject) -> None:
    """Prompt chunks over cached prefixes beside decodes (vLLM's 2D kernel, our prefill kernel),
    or a pure decode batch (vLLM's segmented 3D kernel, our split-K decode kernel)."""
    cache, seqs, tables, lens, window = draw_case(data)
    decode = data.draw(st.booleans(), label="decode")
    query_lens = [1 if decode else data.draw(st.integers(1, s.length)) for s in seqs]
    cu_seqlens = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    shape = cache.shape
    query = cache.randn(int(cu_seqlens[-1]), shape.num_heads, shape.head_dim)
    args = (query, cache.k_cache, cache.v_cache, tables, cu_seqlens, lens, shape.head_dim**-0.5)
    if decode:
        ours = kernels.paged_decode_attention(
            *args[:4], *args[5:], num_splits=data.draw(st.integers(1, 8), label="num_splits"),
            window=window, max_context_len=int(lens.max()), backend="triton",
        )  # fmt: skip
    else:
        ours = kernels.paged_prefill_attention(*args, window=window, backend="triton")
    kc.assert_close(ours, vllm_attention(*args, window), "ours vs vLLM")


class _Launch(dict):
    """Stands in for a Triton kernel: ``kernel[grid](**kwargs)`` records ``grid`` and ``kw``."""

    def __missing__(self, grid: tuple) -> Callable[..., None]:
        return lambda **kwargs: self.update(grid=grid, kw=kwargs)


def capture_launch(call: dict) -> LaunchConfig:
    """The launch vLLM's ``unified_attention`` makes for ``call``, captured in place of its
    kernel, as a :class:`LaunchConfig` (Triton's 4 warps and 3 stages where vLLM passes none)."""
    vua = load_unified_attention()
    kernel, reduce = vua.kernel_unified_attention, vua.reduce_segments
    captured = _Launch()
    # the 3D path's segment reduction, launched after the kernel, is ignored
    vua.kernel_unified_attention, vua.reduce_segments = captured, _Launch()
    try:
        vua.unified_attention(**call)
    finally:
        vua.kernel_unified_attention, vua.reduce_segments = kernel, reduce
    kwargs = captured["kw"]
    dtypes = {**SCALAR_TYPES, **INDEX_TYPES, torch.float8_e4m3fn: "fp8e4nv"}
    signature, scalars, constexprs = {}, {}, {}
    for param in kernel.params:
        name, value = param.name, kwargs.get(param.name, param.default)
        if param.is_constexpr or value is None or isinstance(value, bool):
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = f"*{dtypes[value.dtype]}"
        elif isinstance(value, int):
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            scalars[name] = value
        else:
            signature[name], scalars[name] = "fp32", float(value)
    return LaunchConfig(
        kernel="kernel_unified_attention",
        grid=tuple(captured["grid"]) + (1,) * (3 - len(captured["grid"])),
        signature=signature,
        scalars=scalars,
        constexprs=constexprs,
        num_warps=kwargs.get("num_warps", 4),
        num_stages=kwargs.get("num_stages", 3),
    )


def figures(targets: tuple[int, ...] = (80, 90)) -> list[dict]:
    """vLLM's kernel compiled as launched: fp16, head dim 128, block 16, 32 query heads over 8 KV
    heads, a 4k context; decode (3D, 16 segments) and a 512-token prefill chunk (2D)."""
    rows = []
    for kind, query_len in (("decode", 1), ("prefill", 512)):
        query = torch.empty(query_len, 32, 128, dtype=torch.float16)
        cache = torch.empty(2048, 16, 8, 128, dtype=torch.float16)
        tables = torch.zeros(1, 256, dtype=torch.int32)
        lens, cu_seqlens = torch.tensor([4096]), torch.tensor([0, query_len])
        call = unified_call(query, cache, cache, tables, cu_seqlens, lens, 128**-0.5, None)
        config = capture_launch(call)
        variant = compile_check.Variant(VLLM_MODULE, kind, "fp16", 128, 16, 4, config)
        for capability in compile_check.targets_supported(targets):
            figures = compile_check.compile_variant(variant, capability)
            rows.append(compile_check.rows_of(variant, figures))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compile", action="store_true", help="print vLLM's compiled figures")
    parser.add_argument("--targets", nargs="+", type=int, default=[80, 90, 100])
    args = parser.parse_args(argv)
    if not args.compile:
        parser.error("nothing to do: pass --compile (the properties run under pytest)")
    if os.environ.get("TRITON_INTERPRET") != "0":
        raise SystemExit("run with TRITON_INTERPRET=0: the kernels are compiled, not interpreted")
    print(compile_check.markdown(figures(tuple(args.targets))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
