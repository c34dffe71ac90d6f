"""The paged engine against Hugging Face ``transformers``, for every family the loader accepts.

Each accepted family's ``<Family>ForCausalLM`` (Llama, with an untied and a tied head, and
Mistral with no sliding window) is built locally from a small config with seeded random weights
(nothing is downloaded) and loaded with ``pagedkv.impl.serving.hf_loader.load_hf``. The engine,
batching the prompts over a small paged pool (chunked prefill, prefix caching, preemption, forked
samples), must produce the greedy tokens of ``transformers``' own ``generate(do_sample=False)`` for
each prompt, stopping at the same EOS, and the logits of ``transformers``' forward pass over the
same tokens within ``LOGIT_ATOL``/``LOGIT_RTOL``. Skipped when ``transformers`` is absent (the
``hf`` extra; CI installs it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.hf_loader import ACCEPTED_MODEL_TYPES, load_hf
from properties.engine_cases import assert_logits_close, one_thread
from properties.hf_cases import hf_greedy, tiny_hf_model

transformers = pytest.importorskip("transformers")

# Every accepted family, each with the fields that make a model ignoring them fail.
FAMILIES = {
    "llama-untied-head": ("Llama", {"tie_word_embeddings": False}),
    "llama-tied-head": ("Llama", {"tie_word_embeddings": True}),
    "mistral-no-window": ("Mistral", {"sliding_window": None, "head_dim": 24}),
}


def test_every_accepted_family_is_tested() -> None:
    tested = {tiny_hf_model(family).config.model_type for family, _ in FAMILIES.values()}
    assert tested == set(ACCEPTED_MODEL_TYPES)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module", params=list(FAMILIES.values()), ids=list(FAMILIES))
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    family, fields = request.param
    # rope_theta and rms_norm_eps are not the defaults, so that a model ignoring them fails.
    return tiny_hf_model(family, rope_theta=500.0, rms_norm_eps=1e-5, **fields)


def test_paged_engine_generates_what_transformers_generates(hf_model: torch.nn.Module) -> None:
    model = load_hf(hf_model)
    assert model.config.rope_theta == 500.0 and model.config.rms_norm_eps == 1e-5
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (9,), generator=generator).tolist()
    prompts = [
        system + torch.randint(3, 128, (length,), generator=generator).tolist()
        for length in (1, 4, 7, 12, 3, 25)
    ]
    max_new_tokens = 16

    # EOS: a token the model emits, for the first time, a few tokens into the first output.
    first = hf_greedy(hf_model, prompts[0], max_new_tokens, 2)
    stop = next(i for i in range(3, len(first)) if first[i] not in first[:i])
    eos = first[stop]
    engine = PagedAttentionEngine(
        model, total_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
        enable_prefix_caching=True, keep_logits=True,
    )  # fmt: skip
    outputs = engine.generate(prompts, max_new_tokens, n=2, eos_token_id=eos)
    metrics = engine.metrics
    assert sum(m.preemptions for m in metrics) > 0 and sum(m.prefix_hit_tokens for m in metrics)
    assert len(outputs[0].outputs[0]) == stop + 1  # stopped at EOS
    for prompt, out in zip(prompts, outputs, strict=True):
        expected = hf_greedy(hf_model, prompt, max_new_tokens, eos)
        assert out.logits is not None
        for tokens, logits in zip(out.outputs, out.logits, strict=True):
            assert tokens == expected, f"prompt {prompt}: paged {tokens} != hf {expected}"
            with torch.no_grad():
                forward = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0]
            assert_logits_close(logits, forward[len(prompt) - 1 :], f"prompt {prompt}")
