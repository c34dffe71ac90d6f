"""``hf_loader`` runs only what ``CausalLM`` computes exactly and refuses the rest by name (each
named family, single fields, windows); also directories, weight checks and the command line. The
paged engine generates what ``transformers`` generates for every family the loader accepts (local
seeded weights): greedy tokens, EOS and logits; Mistral's sliding window under eager and SDPA."""

from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedkv.impl.serving.cli import main
from pagedkv.impl.serving.dense import dense_generate
from pagedkv.impl.serving.engine import PagedAttentionEngine, RequestOutput
from pagedkv.impl.serving.hf_loader import ACCEPTED_MODEL_TYPES, config_from_hf, load_hf
from pagedkv.impl.serving.model import CausalLM
from properties.engine_cases import (
    assert_logits_close,
    single_thread,  # noqa: F401 - an autouse fixture
    watch_window,
)
from properties.hf_cases import hf_greedy, tiny_hf_model

transformers = pytest.importorskip("transformers")

# family -> (overrides, a field of its config that CausalLM does not compute)
REFUSED_FAMILIES: dict[str, tuple[dict[str, Any], str]] = {
    "Granite": ({"embedding_multiplier": 12.0}, "embedding_multiplier"),
    "Ernie4_5": ({}, "use_bias"),  # and interleaved RoPE, which no field announces
    "SmolLM3": ({}, "no_rope_layers"),
    "Olmo": ({}, "clip_qkv"),  # and LayerNorm without weights
    "Cohere": ({}, "layer_norm_eps"),
    "StableLm": ({}, "layer_norm_eps"),
}


def _relabelled(config: Any, **changes: Any) -> SimpleNamespace:
    """A config whose ``to_dict`` is ``config``'s with ``changes`` (an edited ``config.json``)."""
    fields = {**config.to_dict(), **changes}
    return SimpleNamespace(to_dict=lambda: fields)


@pytest.mark.parametrize("family", list(REFUSED_FAMILIES))
def test_each_named_family_is_refused_by_name_and_by_field(family: str) -> None:
    overrides, field = REFUSED_FAMILIES[family]
    if not hasattr(transformers, f"{family}ForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} has no {family}ForCausalLM")
    model = tiny_hf_model(family, **overrides)
    with pytest.raises(ValueError, match="config field model_type="):
        load_hf(model)
    # Relabelled llama: refused for a field Llama lacks; its own field alone refuses a Llama.
    own = set(model.config.to_dict()) - set(tiny_hf_model("Llama").config.to_dict())
    with pytest.raises(ValueError, match="config field") as refused:
        config_from_hf(_relabelled(model.config, model_type="llama"))
    assert re.match(r"config field (\w+)=", str(refused.value))[1] in own
    value = model.config.to_dict()[field]
    with pytest.raises(ValueError, match=re.escape(f"config field {field}={value!r}")):
        config_from_hf(_relabelled(tiny_hf_model("Llama").config, **{field: value}))


@pytest.mark.parametrize(("family", "field", "value"), [*(("Llama", *row) for row in [
    ("hidden_act", "gelu"), ("attention_bias", True), ("mlp_bias", True),
    ("rope_parameters", {"rope_type": "llama3", "rope_theta": 1e4}),
    ("rope_parameters", {"rope_theta": 1e4, "partial_rotary_factor": 0.5}),
    ("quantization_config", {"quant_method": "bitsandbytes"}),
    ("logits_scaling", 4.0),  # unknown to the loader
    ("sliding_window", 4096), ("model_type", "llama4"),
]), *(("Mistral", "sliding_window", window) for window in [0, -4, 2.5, True, "8"])])  # fmt: skip
def test_every_field_that_changes_the_computation_is_checked(
    family: str, field: str, value: object
) -> None:
    """The base passes; the field alone is refused by name and value (a dict's by name)."""
    config = tiny_hf_model(
        family, **({"sliding_window": None} if family == "Mistral" else {})
    ).config
    words = f"config field {field}" + ("" if isinstance(value, dict) else f"={value!r}")
    config_from_hf(_relabelled(config))
    with pytest.raises(ValueError, match=re.escape(words)):
        config_from_hf(_relabelled(config, **{field: value}))


def test_a_window_wider_than_any_context_loads() -> None:
    """A Mistral ``sliding_window`` of ``2**64`` is kept (once raised; served as no window:
    test_engine's test_a_window_wider_than_any_context_is_no_window_in_every_layer)."""
    assert load_hf(tiny_hf_model("Mistral", sliding_window=2**64)).config.sliding_window == 2**64


def test_a_refused_directory_reads_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_hf_model("Granite").save_pretrained(tmp_path)

    def no_weights(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights were read before the config was checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_weights)
    with pytest.raises(ValueError, match="model_type='granite'"):
        load_hf(str(tmp_path))


@pytest.mark.parametrize(
    ("source", "kwargs", "error", "words"),
    [
        ("/nonexistent/model", {}, ValueError, "not a directory"),
        ("/", {}, ValueError, "holds no config.json"), (42, {}, TypeError, "source"),
        (torch.nn.Linear(2, 2), {}, TypeError, "source"),
        (None, {"dtype": torch.int32}, TypeError, "dtype"),
    ],
)  # fmt: skip
def test_bad_sources_are_refused(source: object, kwargs: dict, error: type, words: str) -> None:
    with pytest.raises(error, match=words):
        load_hf(source if source is not None else tiny_hf_model("Llama"), **kwargs)  # type: ignore[arg-type]


def test_weights_must_have_the_models_names_and_shapes() -> None:
    model = tiny_hf_model("Llama")
    with pytest.raises(ValueError, match=r"weight .* is (missing from|unexpected in)"):
        load_hf(transformers.LlamaModel(model.config))  # no lm_head, no "model." prefix


def test_the_command_line_serves_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tiny Llama saved with a word-level tokenizer (``w3`` .. ``w127``), by text and by ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(3, 128)} | {"<pad>": 0, "<s>": 1, "</s>": 2}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<pad>")
    fast.save_pretrained(tmp_path)
    model = tiny_hf_model("Llama")
    model.save_pretrained(tmp_path)
    common = ["--model", str(tmp_path), "--max-new-tokens", "4", "--n", "1", "--temperature", "0"]
    main([*common, "--prompt", "w5 w6 w7", "--prompt", "w9"])
    text_out = capsys.readouterr().out
    main([*common, "--token-ids", "--prompt", "5,6,7", "--prompt", "9"])
    ids_out = capsys.readouterr().out
    for prompt in ([5, 6, 7], [9]):
        expected = hf_greedy(model, prompt, 4)
        assert f"-> [{expected}]" in text_out and f"-> [{expected}]" in ids_out
    assert "'w" in text_out  # the samples are decoded too


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prompt", "w5"], "needs --model"),
        (["--model", "{dir}"], "at least one --prompt"),
        (["--model", "{dir}", "--token-ids", "--prompt", "5,x"], "not integers"),
        (["--model", "{dir}", "--prompt", "some text"], "needs a tokenizer"),
        (["--model", "{dir}/missing", "--prompt", "w5"], "not a directory"),
    ],
)
def test_the_command_line_refuses_bad_arguments(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], words: str
) -> None:
    tiny_hf_model("Llama").save_pretrained(tmp_path)  # no tokenizer
    with pytest.raises(SystemExit):
        main([arg.format(dir=tmp_path) for arg in args])
    assert words in capsys.readouterr().err


def test_the_engine_imports_without_transformers() -> None:
    """transformers is the ``hf`` extra: the loader imports it only when it loads."""
    code = (
        "import sys; sys.modules['transformers'] = None; "
        "import pagedkv.impl.serving.engine, pagedkv.impl.serving.hf_loader"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ------------------------------------------------------ the engine against transformers


def seeded_prompts(seed: int, shared: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """Seeded prompts: a ``shared``-token prefix, then one suffix of each length."""
    generator = torch.Generator().manual_seed(seed)
    system = torch.randint(3, 128, (shared,), generator=generator).tolist()
    return [system + torch.randint(3, 128, (n,), generator=generator).tolist() for n in lengths]


WINDOW = 8
# Every accepted family, each with the fields that make a model ignoring them fail, and Mistral's
# sliding window under eager and SDPA attention.
FAMILIES = {
    "llama-untied-head": ("Llama", {"tie_word_embeddings": False}),
    "llama-tied-head": ("Llama", {"tie_word_embeddings": True}),
    "mistral-no-window": ("Mistral", {"sliding_window": None, "head_dim": 24}),
    **{f"mistral-window-{attention}": ("Mistral", {
        "sliding_window": WINDOW, "head_dim": 24, "attn_implementation": attention})
       for attention in ("eager", "sdpa")},
}  # fmt: skip
RUNS = {  # prompts (seed, shared prefix, suffixes), new tokens; the pool and limits (blocks of 4)
    None: ((1, 9, (1, 4, 7, 12, 3, 25)), 16, (14, 4, 24)),
    # 31 to 50 tokens with 24 new: 4-6 windows; chunks of 10 over prefix hits, 8 windowed
    # sequences of 4 blocks in 16.
    WINDOW: ((3, 6, (1, 9, 14, 20)), 24, (16, 8, 10)),
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


def test_paged_engine_generates_what_transformers_generates(
    hf_model: torch.nn.Module, tmp_path: Path
) -> None:
    """Two samples each over preemptions and prefix hits: transformers' greedy tokens, EOS (no
    window) and logits, dense decoding's too. A window: its model loads from a saved directory,
    blocks are released, and with no window or its edge one token off the tokens would differ."""
    window = getattr(hf_model.config, "sliding_window", None)  # Llama has none
    if window:
        assert hf_model.config._attn_implementation in ("eager", "sdpa")
        hf_model.save_pretrained(tmp_path)
    model = load_hf(tmp_path if window else hf_model)
    config = model.config  # a wrong head_dim or num_kv_heads fails to load the weights
    assert (config.rope_theta, config.rms_norm_eps, config.sliding_window) == (500.0, 1e-5, window)
    seeds, new, (total_blocks, max_num_seqs, budget) = RUNS[window]
    prompts, eos = seeded_prompts(*seeds), None
    if window is None:  # EOS: a token emitted for the first time a few tokens into the first output
        first = hf_greedy(hf_model, prompts[0], new, 2)
        stop = next(i for i in range(3, len(first)) if first[i] not in first[:i])
        eos = first[stop]
    expected = [hf_greedy(hf_model, prompt, new, eos) for prompt in prompts]
    lengths = [len(p) + len(e) for p, e in zip(prompts, expected, strict=True)]
    assert not window or min(lengths) >= 3 * window  # the window slides
    engine = PagedAttentionEngine(
        model, total_blocks, 4, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
        enable_prefix_caching=True, keep_logits=True,
    )  # fmt: skip
    released = watch_window(engine, window) if window else []
    outputs = engine.generate(prompts, new, n=2, eos_token_id=eos)
    metrics = engine.metrics
    assert sum(m.preemptions for m in metrics) > 0 and sum(m.prefix_hit_tokens for m in metrics)
    assert not window or max(released) > 0, "no block was released"
    assert eos is None or len(outputs[0].outputs[0]) == stop + 1  # stopped at EOS
    forwards = check_against_hf(hf_model, prompts, outputs, expected)
    for prompt, tokens, forward in zip(prompts, expected, forwards, strict=True):
        dense = dense_generate(model, prompt, new, eos_token_id=eos)
        assert dense.tokens == tokens, f"prompt {prompt}: dense {dense.tokens} != hf {tokens}"
        assert_logits_close(dense.logits, forward[len(prompt) - 1 :], f"dense, prompt {prompt}")
    for other_window in (None, window - 1, window + 1) if window else ():  # teeth
        other = CausalLM(dataclasses.replace(model.config, sliding_window=other_window))
        other.load_state_dict(model.state_dict())
        differs = [
            dense_generate(other.eval(), prompt, new).tokens != tokens
            for prompt, tokens in zip(prompts, expected, strict=True)
        ]
        assert any(differs), f"window {other_window} gives transformers' window-{window} tokens"
