"""What a KV cache's storage dtype costs in accuracy, measured (issue 34; docs/results.md).

``python -m bench.kv_accuracy --model small`` (or ``large``): the engine presets of
``bench/bench_engine.py`` (a seeded random Llama and its prompts), served greedily by the engine
with the fp32 cache and again with each other cache: ``fp8_e4m3`` and ``fp8_e5m2`` (fp32 model,
scales 1.0, vLLM's default) and ``fp16`` (the model and its cache in fp16). Per cache, against
the fp32 cache: the prompts whose tokens are all equal, the first position where they differ
(mean over the prompts that differ), and the largest and mean absolute logit error over the
positions up to and including each prompt's first difference (after it the contexts differ).

``python -m bench.kv_accuracy --kernels``: paged decode attention over fp8 K/V against the same
K/V in an fp32 cache, for normal K/V and for K/V whose few outlier channels are 10x to 100x the
rest (as real checkpoints' K shows), each with a scale of 1.0 and with the engine's calibrated
scale (``spec.fp8.calibrated_scale``: the largest magnitude maps to half the largest value): the
largest and the mean absolute error, relative to the output's largest magnitude.

``--kernels`` prints in seconds; ``--model small`` in a minute or two on two cores, ``large``
about 17 minutes a cache.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.bench_engine import PRESETS, engine_for, engine_workload, hf_llama
from pagedkv import kernels
from pagedkv.impl.serving.hf_loader import load_hf
from pagedkv.spec.fp8 import calibrated_scale, fp8_format

CACHES = ("fp8_e4m3", "fp8_e5m2", "fp16")
FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def serve(model: Any, prompts: list[list[int]], new: int, kv_cache_dtype: str) -> list[Any]:
    """Greedy outputs, logits kept, with the cache ``kv_cache_dtype`` (``auto``: the model's)."""
    engine = engine_for(model, prompts, new, keep_logits=True, kv_cache_dtype=kv_cache_dtype)
    return engine.generate(prompts, new)


def compare(reference: list[Any], outputs: list[Any]) -> dict[str, float | int]:
    """Agreement of ``outputs`` with ``reference`` (the fp32 cache's), prompt by prompt."""
    equal, firsts, errors = 0, [], []
    for ref, out in zip(reference, outputs, strict=True):
        tokens, ref_tokens = out.outputs[0], ref.outputs[0]
        differ = [i for i, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)) if a != b]
        last = differ[0] if differ else len(tokens) - 1
        if differ:
            firsts.append(differ[0])
        else:
            equal += 1
        logits, ref_logits = out.logits[0][: last + 1].float(), ref.logits[0][: last + 1]
        errors.append((logits - ref_logits).abs().flatten())
    error = torch.cat(errors)
    return {
        "prompts_equal": equal,
        "prompts": len(reference),
        "first_difference": sum(firsts) / len(firsts) if firsts else float("nan"),
        "max_logit_error": float(error.max()),
        "mean_logit_error": float(error.mean()),
    }


def engine_table(preset_name: str) -> list[str]:
    preset = PRESETS[preset_name]
    model, prompts = engine_workload(preset.count, preset.shortest, preset.longest, **preset.shape)
    reference = serve(model, prompts, preset.new, "auto")
    rows = []
    for cache in CACHES:
        if cache == "fp16":
            fp16 = load_hf(hf_llama(0, **preset.shape), dtype=torch.float16)
            result = compare(reference, serve(fp16, prompts, preset.new, "auto"))
        else:
            result = compare(reference, serve(model, prompts, preset.new, cache))
        rows.append(
            f"| {preset_name} | {cache} | {result['prompts_equal']}/{result['prompts']} | "
            f"{result['first_difference']:.1f} | {result['max_logit_error']:.3g} | "
            f"{result['mean_logit_error']:.3g} |"
        )
        print(rows[-1], flush=True)
    return rows


def kernel_table() -> list[str]:
    """Decode attention over fp8 K/V against fp32, normal and outlier-channel K/V."""
    generator = torch.Generator().manual_seed(0)
    shape = (64, 16, 4, 128)  # 64 blocks of 16 tokens, 4 KV heads of 128
    tables = torch.arange(64, dtype=torch.int32).view(8, 8)
    lens = torch.full((8,), 128, dtype=torch.int32)
    query = torch.randn(8, 16, 128, generator=generator)
    rows = []
    for case in ("normal", "outliers"):
        k, v = (torch.randn(shape, generator=generator) for _ in range(2))
        if case == "outliers":  # 4 of 128 channels 10x to 100x the rest
            channels = torch.tensor([3, 40, 77, 120])
            factors = torch.tensor([10.0, 30.0, 60.0, 100.0])
            k[..., channels] *= factors
            v[..., channels] *= factors
        exact = kernels.paged_decode_attention(query, k, v, tables, lens, backend="reference")
        for name, dtype in FP8_DTYPES.items():
            fmt = fp8_format(name)
            for scale_kind in ("1.0", "calibrated"):
                calibrated = [calibrated_scale(float(t.abs().max()), fmt) for t in (k, v)]
                k_scale, v_scale = (1.0, 1.0) if scale_kind == "1.0" else calibrated
                caches = [torch.empty(shape, dtype=dtype) for _ in range(2)]
                slots = torch.arange(64 * 16)
                kernels.store_kv(
                    k.view(-1, 4, 128), v.view(-1, 4, 128), *caches, slots,
                    k_scale=k_scale, v_scale=v_scale, backend="reference",
                )  # fmt: skip
                out = kernels.paged_decode_attention(
                    query, *caches, tables, lens, k_scale=k_scale, v_scale=v_scale,
                    backend="reference",
                )  # fmt: skip
                error = (out - exact).abs() / exact.abs().max()
                rows.append(
                    f"| {case} | {name} | {scale_kind} | {float(error.max()):.2e} | "
                    f"{float(error.mean()):.2e} |"
                )
                print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=PRESETS, help="the engine table for this preset")
    parser.add_argument("--kernels", action="store_true", help="the kernel table")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.kernels:
        print("| K/V | cache | scale | max error | mean error |\n|---|---|---|---:|---:|")
        kernel_table()
    if args.model:
        print(
            "| preset | cache | prompts equal | first difference (mean) | max logit error "
            "| mean logit error |\n|---|---|---:|---:|---:|---:|"
        )
        engine_table(args.model)


if __name__ == "__main__":
    main()
