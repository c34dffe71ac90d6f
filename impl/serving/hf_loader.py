"""Load a Hugging Face causal LM into :class:`CausalLM`, but only one that it computes exactly.

:func:`load_hf` takes a ``transformers`` model object, or a local directory written by
``save_pretrained`` (read with ``local_files_only=True``: nothing is ever downloaded). Before any
weight is read, :func:`config_from_hf` checks the config against what ``CausalLM`` implements:

* ``model_type`` must be one of :data:`ACCEPTED_MODEL_TYPES` (Llama and Mistral, whose layers are
  Llama's);
* every other field of ``config.to_dict()`` must be known. A field is either one the model is
  built from (:data:`SHAPE_FIELDS`, RoPE's ``rope_theta``, and for the families in
  :data:`WINDOW_FAMILIES` ``sliding_window``), one that changes the computation and must hold
  the one value ``CausalLM`` computes (:data:`REQUIRED_VALUES`, and RoPE's type, which must be
  ``"default"``), or one that does not change what inference computes (:data:`INERT_FIELDS`,
  and the fields every ``PretrainedConfig`` has).

Mistral's ``sliding_window`` (``None``, or an int ``w >= 1``) becomes
``ModelConfig.sliding_window``: every layer's token at position ``p`` attends positions ``p - w
< j <= p``, as ``transformers``' sliding-window mask does. Llama ignores the field in
``transformers``, so a Llama config must not set it (``None``): a config that says one thing
while the model computes another is refused. Anything else is refused with a ``ValueError``
that names the field: a new family, a field a newer ``transformers`` adds, biases, another
activation, scaled or partial RoPE, quantization. Then the weights must have exactly
``CausalLM``'s names and shapes. So a model that loads computes what ``transformers`` computes;
the properties check it against ``generate``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.kernels.check_arguments import check_float_dtype
from pagedkv.spec.checks import check_window

ACCEPTED_MODEL_TYPES = ("llama", "mistral")
WINDOW_FAMILIES = ("mistral",)  # model types whose sliding_window every layer applies

SHAPE_FIELDS = {  # Hugging Face's name -> ModelConfig's
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "intermediate_size": "intermediate_size",
    "num_hidden_layers": "num_layers",
    "num_attention_heads": "num_heads",
    "num_key_value_heads": "num_kv_heads",
    "head_dim": "head_dim",  # None: hidden_size // num_attention_heads
    "rms_norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
REQUIRED_VALUES: dict[str, object] = {  # where present, these fields must hold these values
    "hidden_act": "silu",  # the SwiGLU MLP
    "attention_bias": False,
    "mlp_bias": False,
    "pretraining_tp": 1,  # Llama 4.x: split projections (not the same float arithmetic)
    "sliding_window": None,  # outside WINDOW_FAMILIES: transformers would ignore a window
    "rope_scaling": None,  # transformers 4.x: plain RoPE
}
INERT_FIELDS = frozenset(
    {
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "initializer_range",  # used only to initialize weights
        "max_position_embeddings",  # default RoPE does not depend on it
        "use_cache",
        "attention_dropout",  # inference does not drop out
    }
)
ROPE_FIELDS = ("rope_parameters", "rope_theta")  # transformers 5.x, 4.x
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def config_from_hf(config: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a ``transformers`` config that passes every check in the
    module docstring. ``ValueError`` naming the first field that does not; ``TypeError`` for an
    object without ``to_dict``."""
    if not callable(getattr(config, "to_dict", None)):
        raise TypeError(f"config must be a transformers config, got {type(config).__name__}")
    fields = config.to_dict()
    model_type = fields.get("model_type")
    if model_type not in ACCEPTED_MODEL_TYPES:
        raise ValueError(
            f"config field model_type={model_type!r} is not supported; the loader runs only "
            f"{ACCEPTED_MODEL_TYPES}"
        )
    known = {*SHAPE_FIELDS, *REQUIRED_VALUES, *INERT_FIELDS, *ROPE_FIELDS, *_generic_fields()}
    windowed = model_type in WINDOW_FAMILIES
    window = None  # outside WINDOW_FAMILIES a window field is inert
    for name, value in fields.items():
        if windowed and name == "sliding_window":
            window = _check_window(value)
        elif name in REQUIRED_VALUES and value != REQUIRED_VALUES[name]:
            raise ValueError(
                f"config field {name}={value!r} is not supported: CausalLM computes "
                f"{name}={REQUIRED_VALUES[name]!r}"
            )
        if name not in known:
            raise ValueError(
                f"config field {name}={value!r} is unknown to the loader, which refuses what it "
                f"cannot check"
            )
    missing = [name for name in SHAPE_FIELDS if name not in fields and name != "head_dim"]
    if missing:
        raise ValueError(f"config field {missing[0]} is missing")
    shape = {ours: fields[theirs] for theirs, ours in SHAPE_FIELDS.items() if theirs in fields}
    if shape.get("head_dim") is None:
        shape["head_dim"] = fields["hidden_size"] // fields["num_attention_heads"]
    return ModelConfig(**shape, rope_theta=_rope_theta(fields), sliding_window=window)


def _check_window(value: object) -> int | None:
    """A window ``ModelConfig`` takes: ``None`` or what ``spec.checks.check_window`` takes,
    returned as the plain int it equals. Refused with ``ValueError`` naming the field, like
    every refused field (a config file's content is a value, whatever its type)."""
    if value is None:
        return None
    try:
        return check_window(value)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"config field sliding_window={value!r} is not supported: it must be None or an "
            f"int >= 1 ({error})"
        ) from None


def load_hf(
    source: nn.Module | str | os.PathLike[str], dtype: torch.dtype = torch.float32
) -> CausalLM:
    """A :class:`CausalLM` with the weights of ``source`` (a ``transformers`` causal LM, or a
    local ``save_pretrained`` directory), in ``dtype`` (fp32, fp16 or bf16), in eval mode.

    Refuses, before reading any weight, what :func:`config_from_hf` refuses; ``ValueError``
    when the weights' names or shapes are not exactly ``CausalLM``'s, or ``source`` names no
    directory; ``TypeError`` for any other kind of ``source`` or ``dtype``.
    """
    check_float_dtype("dtype", dtype)
    if isinstance(source, (str, os.PathLike)):
        source = _from_directory(Path(source))
    if not isinstance(source, nn.Module) or not hasattr(source, "config"):
        raise TypeError(
            f"source must be a transformers model or a directory, got {type(source).__name__}"
        )
    model = CausalLM(config_from_hf(source.config))
    weights = source.state_dict()
    expected = model.state_dict()
    for name in sorted(expected.keys() ^ weights.keys()):
        where = "missing from" if name in expected else "unexpected in"
        raise ValueError(f"weight {name} is {where} the source model")
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"weight {name} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(expected[name].shape)}"
            )
    model.load_state_dict(weights, strict=True)
    return model.to(dtype).eval()


def load_tokenizer(directory: str | os.PathLike[str]) -> Any | None:
    """The tokenizer saved in ``directory`` (local files only), or ``None`` if it holds none."""
    path = Path(directory)
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    import transformers

    return transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)


def _from_directory(path: Path) -> nn.Module:
    """The ``transformers`` model saved in ``path``: its config is checked before its weights are
    read, and only local files are read."""
    if not path.is_dir():
        raise ValueError(f"source {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"source {str(path)!r} holds no config.json (save_pretrained writes one)")
    import transformers

    config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
    config_from_hf(config)
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, config=config, local_files_only=True
    )


def _generic_fields() -> set[str]:
    """The fields every ``PretrainedConfig`` has (ids, labels, output switches, dtype, ...)."""
    import transformers

    return set(transformers.PretrainedConfig().to_dict())


def _rope_theta(fields: dict[str, Any]) -> float:
    """RoPE's base from ``rope_parameters`` (5.x) or ``rope_theta`` (4.x); only the default
    RoPE type, with no other parameter, is accepted."""
    rope = fields.get("rope_parameters") or {"rope_theta": fields.get("rope_theta", 10000.0)}
    for name, value in rope.items():
        if name == "rope_type" and value == "default":
            continue
        if name != "rope_theta":
            raise ValueError(
                f"config field rope_parameters[{name!r}]={value!r} is not supported: "
                f"CausalLM computes the default RoPE"
            )
    return rope.get("rope_theta", 10000.0)
