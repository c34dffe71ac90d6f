"""Tiny ``transformers`` models of one shape with seeded weights (nothing downloaded)."""

from __future__ import annotations

from typing import Any

import torch

TINY_SHAPE: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
    "initializer_range": 0.2,  # peaked attention: a wrong position or K/V row shows
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
}  # fmt: skip


def tiny_hf_model(family: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """``transformers.<family>ForCausalLM`` of TINY_SHAPE with ``overrides``, seeded, in eval."""
    import transformers

    config = getattr(transformers, f"{family}Config")(**{**TINY_SHAPE, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, f"{family}ForCausalLM")(config).eval()


def hf_greedy(
    model: torch.nn.Module, prompt: list[int], max_new_tokens: int, eos: int | None = None
) -> list[int]:
    """The tokens ``transformers``' own ``generate(do_sample=False)`` appends to ``prompt``."""
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
        do_sample=False, eos_token_id=eos, pad_token_id=0,
    )  # fmt: skip
    return out[0, len(prompt) :].tolist()
