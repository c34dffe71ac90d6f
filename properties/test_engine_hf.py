"""The paged engine against Hugging Face ``transformers`` on the same tiny Llama.

A ``LlamaForCausalLM`` is built locally from a small config with seeded random weights (nothing is
downloaded) and its weights are loaded into ``pagedkv.impl.serving.model.CausalLM``. The engine,
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
from pagedkv.impl.serving.model import CausalLM
from properties.engine_cases import assert_logits_close, one_thread

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@pytest.fixture(scope="module", params=[False, True], ids=["untied-head", "tied-head"])
def hf_model(request: pytest.FixtureRequest) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=500.0,  # not the default, so that a model ignoring it fails
        tie_word_embeddings=request.param,
        initializer_range=0.2,  # peaked attention: a wrong position or K/V row shows
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def test_paged_engine_generates_what_transformers_generates(hf_model: torch.nn.Module) -> None:
    model = CausalLM.from_hf_llama(hf_model)
    assert model.config.rope_theta == 500.0 and model.config.rms_norm_eps == 1e-5
    generator = torch.Generator().manual_seed(1)
    system = torch.randint(3, 128, (9,), generator=generator).tolist()
    prompts = [
        system + torch.randint(3, 128, (length,), generator=generator).tolist()
        for length in (1, 4, 7, 12, 3, 25)
    ]
    max_new_tokens = 16

    def hf_generate(prompt: list[int], eos: int) -> list[int]:
        ids = torch.tensor([prompt])
        out = hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=eos, pad_token_id=0,
        )  # fmt: skip
        return out[0, len(prompt) :].tolist()

    # EOS: a token the model emits, for the first time, a few tokens into the first output.
    first = hf_generate(prompts[0], 2)
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
        expected = hf_generate(prompt, eos)
        assert out.logits is not None
        for tokens, logits in zip(out.outputs, out.logits, strict=True):
            assert tokens == expected, f"prompt {prompt}: paged {tokens} != hf {expected}"
            with torch.no_grad():
                forward = hf_model(torch.tensor([prompt + tokens[:-1]])).logits[0]
            assert_logits_close(logits, forward[len(prompt) - 1 :], f"prompt {prompt}")
