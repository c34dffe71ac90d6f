"""The paged engine against ``transformers`` for every family the loader accepts (local seeded
weights): greedy tokens, EOS and logits; Mistral's sliding window under eager and SDPA."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pagedkv.impl.serving.dense import dense_generate
from pagedkv.impl.serving.engine import PagedAttentionEngine, RequestOutput
from pagedkv.impl.serving.hf_loader import ACCEPTED_MODEL_TYPES, load_hf
from pagedkv.impl.serving.model import CausalLM
from properties.engine_cases import (
    assert_logits_close,
    single_thread,  # noqa: F401 - an autouse fixture
    watch_window,
)
from properties.hf_cases import hf_greedy, tiny_hf_model

transformers = pytest.importorskip("transformers")


def seeded_prompts(seed: int, shared: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Seeded prompts: a ``shared``-token prefix, then one suffix of each length."""
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 128, (shared,), generator=generator).tolist()
    return [system + torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


# Every accepted family, each with the fields that make a model ignoring them fail.
FAMILIES = {
    "llama-untied-head": ("Llama", {"tie_word_embeddings": False}),
    "llama-tied-head": ("Llama", {"tie_word_embeddings": True}),
    "mistral-no-window": ("Mistral", {"sliding_window": None, "head_dim": 24}),
}


def check_against_hf(
    hf_model: torch.nn.Module,
    prompts: list[list[int]],
    outputs: list[RequestOutput],
    expected: list[list[int]],
) -> list[torch.Tensor]:
    """Every sample is ``expected``'s, with the logits of transformers' forward pass (returned)."""
    forwards = []
    for prompt, out, tokens in zip(prompts, outputs, expected, strict=True):
        with torch.no_grad():
            forwards.append(hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0])
        assert out.logits is not None
        for sample, logits in zip(out.outputs, out.logits, strict=True):
            assert sample == tokens, f"prompt {prompt}: paged {sample} != hf {tokens}"
            assert_logits_close(logits, forwards[-1][len(prompt) - 1 :], f"prompt {prompt}")
    return forwards


def test_every_accepted_family_is_tested() -> None:
    tested = {tiny_hf_model(family).config.model_type for family, _ in FAMILIES.values()}
    assert tested == set(ACCEPTED_MODEL_TYPES)


@pytest.fixture(scope="module", params=list(FAMILIES.values()), ids=list(FAMILIES))
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    family, fields = request.param
    # rope_theta and rms_norm_eps are not the defaults, so that a model ignoring them fails.
    return tiny_hf_model(family, rope_theta=500.0, rms_norm_eps=1e-5, **fields)


def test_paged_engine_generates_what_transformers_generates(hf_model: torch.nn.Module) -> None:
    model = load_hf(hf_model)
    config = model.config  # a wrong head_dim or num_kv_heads fails to load the weights
    assert (config.rope_theta, config.rms_norm_eps, config.sliding_window) == (500.0, 1e-5, None)
    prompts = seeded_prompts(1, 9, (1, 4, 7, 12, 3, 25))
    new = 16
    # EOS: a token the model emits, for the first time, a few tokens into the first output.
    first = hf_greedy(hf_model, prompts[0], new, 2)
    stop = next(i for i in range(3, len(first)) if first[i] not in first[:i])
    eos = first[stop]
    engine = PagedAttentionEngine(
        model, total_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
        enable_prefix_caching=True, keep_logits=True,
    )  # fmt: skip
    outputs = engine.generate(prompts, new, n=2, eos_token_id=eos)
    metrics = engine.metrics
    assert sum(m.preemptions for m in metrics) > 0 and sum(m.prefix_hit_tokens for m in metrics)
    assert len(outputs[0].outputs[0]) == stop + 1  # stopped at EOS
    check_against_hf(
        hf_model, prompts, outputs, [hf_greedy(hf_model, p, new, eos) for p in prompts]
    )


# ----------------------------------------------------------------------- sliding window

WINDOW = 8
WINDOW_MAX_NEW_TOKENS = 24


@pytest.fixture(scope="module", params=["eager", "sdpa"])
def hf_mistral_window(request: pytest.FixtureRequest) -> torch.nn.Module:
    return tiny_hf_model(
        "Mistral", sliding_window=WINDOW, head_dim=24, rope_theta=500.0, rms_norm_eps=1e-5,
        attn_implementation=request.param,
    )  # fmt: skip


def test_mistral_sliding_window_matches_transformers(
    hf_mistral_window: torch.nn.Module, tmp_path: Path
) -> None:
    hf_model = hf_mistral_window
    assert hf_model.config._attn_implementation in ("eager", "sdpa")
    hf_model.save_pretrained(tmp_path)
    model = load_hf(tmp_path)
    assert model.config.sliding_window == WINDOW
    prompts = seeded_prompts(3, 6, (1, 9, 14, 20))  # 31 to 50 tokens with 24 new: 4-6 windows
    expected = [hf_greedy(hf_model, prompt, WINDOW_MAX_NEW_TOKENS) for prompt in prompts]
    assert all(len(p) + len(e) >= 3 * WINDOW for p, e in zip(prompts, expected, strict=True))

    # Chunks of 10 over prefix hits, two samples each, 8 windowed sequences of 4 blocks in 16.
    engine = PagedAttentionEngine(
        model, total_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=10,
        enable_prefix_caching=True, keep_logits=True,
    )  # fmt: skip
    released = watch_window(engine, WINDOW)
    outputs = engine.generate(prompts, WINDOW_MAX_NEW_TOKENS, n=2)
    assert max(released) > 0, "no block was released"
    metrics = engine.metrics
    assert sum(m.prefix_hit_tokens for m in metrics) > 0 and sum(m.preemptions for m in metrics)
    forwards = check_against_hf(hf_model, prompts, outputs, expected)
    for prompt, tokens, forward in zip(prompts, expected, forwards, strict=True):
        dense = dense_generate(model, prompt, WINDOW_MAX_NEW_TOKENS)
        assert dense.tokens == tokens, f"prompt {prompt}: dense {dense.tokens} != hf {tokens}"
        assert_logits_close(dense.logits, forward[len(prompt) - 1 :], f"dense, prompt {prompt}")

    # Teeth: a model that ignored the window, or placed its edge one token off, would fail.
    for window in (None, WINDOW - 1, WINDOW + 1):
        other = CausalLM(dataclasses.replace(model.config, sliding_window=window))
        other.load_state_dict(model.state_dict())
        differs = [
            dense_generate(other.eval(), prompt, WINDOW_MAX_NEW_TOKENS).tokens != tokens
            for prompt, tokens in zip(prompts, expected, strict=True)
        ]
        assert any(differs), f"window {window} gives transformers' window-{WINDOW} tokens"
