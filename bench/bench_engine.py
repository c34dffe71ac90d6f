"""Engine decode-step latency by block size and batch, on the CPU torch path.

Each case builds an ``pagedkv.impl.serving.engine.PagedAttentionEngine`` over the seeded default
``pagedkv.impl.serving.model.ModelConfig`` (a 2-layer Llama-style model), submits ``batch`` requests
of ``CONTEXT`` prompt tokens and runs their prefill and one warm-up step (untimed). Each of the
``ROUNDS`` timed rounds is then one ``engine.step()`` in which every sequence decodes one token:
scheduling and block-table growth, slot mapping, K/V writes and paged attention through the tables,
sampling, metrics. The kernels run their torch reference on CPU (``bench/gpu_kernels.py`` times the
Triton kernels on a GPU).

Groups: ``engine-decode-bs{B}``, one row per batch (1, 32, 128). Paged against contiguous
attention is ``bench/bench_attention.py``; the engine has no batched contiguous twin.

Under ``--benchmark-disable`` (CI) each case runs one step, except batch 128, which is skipped:
its prefill and step cost seconds per block size on CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.spec.block_manager import blocks_needed

BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
BATCHES = (1, 32, 128)
CONTEXT = 64
ROUNDS = 7
WARMUP = 1
CONFIG = ModelConfig()
MODEL = CausalLM.from_seed(CONFIG, seed=0)


def decoding_engine(block_size: int, batch: int) -> PagedAttentionEngine:
    """An engine whose ``batch`` sequences have computed their prompts and will decode (at
    least) ``WARMUP + ROUNDS + 1`` more steps, with a pool that holds all of it."""
    max_new_tokens = WARMUP + ROUNDS + 3
    total_blocks = batch * blocks_needed(CONTEXT + max_new_tokens, block_size)
    engine = PagedAttentionEngine(
        MODEL, total_blocks, block_size, max_num_seqs=batch, max_num_batched_tokens=batch * CONTEXT
    )
    generator = torch.Generator().manual_seed(block_size * 1000 + batch)
    for _ in range(batch):
        prompt = torch.randint(CONFIG.vocab_size, (CONTEXT,), generator=generator).tolist()
        engine.add_request(prompt, max_new_tokens)
    prefill = engine.step().metrics
    assert prefill.num_batched_tokens == batch * CONTEXT and prefill.num_running == batch
    return engine


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
def test_engine_decode_step(benchmark: Any, block_size: int, batch: int) -> None:
    if benchmark.disabled and batch == BATCHES[-1]:
        pytest.skip("batch 128 on the CPU reference is timed only (seconds per block size)")
    engine = decoding_engine(block_size, batch)
    benchmark.group = f"engine-decode-bs{block_size}"
    benchmark.extra_info.update(
        kind="engine",
        block_size=block_size,
        batch=batch,
        context=CONTEXT,
        model=f"{CONFIG.num_layers} layers, hidden {CONFIG.hidden_size}, "
        f"{CONFIG.num_heads}q/{CONFIG.num_kv_heads}kv heads x {CONFIG.head_dim}",
    )
    metrics = benchmark.pedantic(
        lambda: engine.step().metrics, rounds=ROUNDS, warmup_rounds=WARMUP, iterations=1
    )
    assert metrics.num_decodes == metrics.num_batched_tokens == batch
    assert metrics.preemptions == 0
