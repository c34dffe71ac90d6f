"""Serving: a Llama-style model served from the paged KV cache with continuous batching.

* ``scheduler``: the continuous-batching policy over a :class:`BlockStore` (no torch).
* ``block_store``: the :class:`BlockStore` protocol, all the scheduler needs from a store.
* ``sequence``: a sequence's facts, each with one owner, and the scheduler's step columns;
  ``plan``: one step's plan (:class:`SchedulerOutput`) and its limits.
* ``model``, ``paged_kv``, ``sampling``: the model, the paged KV tensors and one step's attention
  through block tables, and token choice.
* ``engine``: :class:`PagedAttentionEngine` and the ``pagedkv`` command line.
* ``metrics``: per-step KV metrics. ``dense``: the dense-decoding oracle.
* ``speculative``: greedy speculative decoding, the draft sources' contract and its acceptance rule.
* ``hf_loader``: a Hugging Face Llama or Mistral checkpoint and tokenizer, loaded and checked.

Names are imported on first use, so ``import pagedkv.impl.serving.scheduler`` loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BlockStore": "block_store",
    "dense_generate": "dense",
    "CausalLM": "model",
    "ModelConfig": "model",
    "PagedAttentionEngine": "engine",
    "PagedKVCache": "paged_kv",
    "RequestOutput": "engine",
    "RequestTooLargeError": "sequence",
    "Scheduler": "scheduler",
    "SchedulerConfig": "plan",
    "SchedulerOutput": "plan",
    "StepMetrics": "metrics",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
