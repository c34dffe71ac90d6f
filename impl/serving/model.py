"""A small Llama-architecture causal transformer whose attention reads K/V from a pluggable store.

The blocks are the modern ones: token embedding, RMSNorm, rotary position embedding (RoPE),
grouped-query attention, a SwiGLU MLP and a tied or untied LM head, with Hugging Face Llama's
conventions (parameter names, ``rotate_half`` RoPE layout, ``rope_theta``, ``rms_norm_eps``,
``scale = head_dim ** -0.5``), so ``pagedkv.impl.serving.hf_loader`` loads the weights of a
``transformers`` Llama (or of a family that computes exactly what it computes) unchanged. With
``ModelConfig.sliding_window`` every layer attends through a sliding window, as Mistral does.

The model works on a *flat* step: the tokens of every sequence in the step, concatenated
(``input_ids`` and ``positions`` are ``[T]``). It never holds K/V itself. Each attention layer hands
its new K/V and queries to a :class:`KVAttention` and gets the attention output back; the paged
store (``pagedkv.impl.serving.paged_kv``) and the dense oracle's contiguous store
(``pagedkv.impl.serving.dense``) are two implementations of that one method, so both run the very
same layers.

Every projection is a :class:`Linear`: on the CPU in fp32 it multiplies through oneDNN with its
weight prepacked into oneDNN's blocked layout, as vLLM's CPU engine does (``docs/results.md``,
"Engine against Hugging Face ``generate`` and vLLM", has the same-run A/B that put it here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from pagedkv.kernels.check_arguments import (
    check_bool,
    check_float_dtype,
    check_int_range,
    check_number,
    check_same_device,
    check_shape,
    check_tensor,
)
from pagedkv.spec.block_manager import check_int
from pagedkv.spec.checks import int32_window


class KVAttention(Protocol):
    """Where a step's K/V go and how its queries attend; the only thing the model delegates."""

    def attend(
        self,
        layer: int,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        window: int | None = None,
    ) -> torch.Tensor:
        """Store the step's ``key``/``value`` (``[T, num_kv_heads, head_dim]``, RoPE applied) for
        ``layer``, then return the attention of ``query`` (``[T, num_heads, head_dim]``) over each
        token's causal context (every earlier token of its sequence, and itself):
        ``[T, num_heads, head_dim]``. With ``window`` ``w`` (an int ``>= 1``) the token at
        position ``p`` attends only the tokens at positions ``p - w < j <= p`` (the kernels'
        ``window``, Hugging Face's ``sliding_window``)."""
        ...


SIZE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
    "head_dim",
)  # fmt: skip


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a :class:`CausalLM` (Llama's names in brackets where they differ)."""

    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2  # num_hidden_layers
    num_heads: int = 4  # num_attention_heads
    num_kv_heads: int = 2  # num_key_value_heads
    head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Mistral's sliding window: the token at position p attends positions p - w < j <= p in
    # every layer. None: full causal attention.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        """Every field checked: sizes are ints >= 1, ``rope_theta`` a finite number > 0,
        ``rms_norm_eps`` a finite number >= 0, ``tie_word_embeddings`` a bool,
        ``sliding_window`` ``None`` or an int >= 1 (``TypeError`` or ``ValueError`` naming the
        field); heads must group evenly and ``head_dim`` be even."""
        for name in SIZE_FIELDS:
            check_int(name, getattr(self, name), 1)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        check_number("rope_theta", self.rope_theta, allow_zero=False)
        check_number("rms_norm_eps", self.rms_norm_eps, allow_zero=True)
        check_bool("tie_word_embeddings", self.tie_word_embeddings)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")


# The batch size (rows of the input) oneDNN lays the prepacked weight out for: the decode step
# of a full batch. Any number of rows works with it; vLLM's CPU engine packs for 32 as well.
PACK_ROWS = 32
ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(
    torch.ops.mkldnn, "_linear_pointwise"
)


class Linear(nn.Linear):
    """A bias-free ``nn.Linear`` (the same ``weight`` parameter, the same product up to fp32
    rounding order) that, for an fp32 weight on the CPU outside autograd, multiplies through
    oneDNN (``torch.ops.mkldnn._linear_pointwise``, the op ``torch.compile`` emits for a CPU
    linear) on a copy of the weight prepacked for :data:`PACK_ROWS` rows. The copy is made on
    the first such call and again whenever the weight is replaced or changed in place (its
    storage or version counter moves; a write through ``.data``, which autograd does not track,
    is not seen, and neither is an in-place write to a weight made under
    ``torch.inference_mode``, which has no version counter); it doubles the layer's memory.
    Everywhere else (other dtypes or devices, gradients wanted, a torch without oneDNN) it is
    ``torch.nn.functional.linear``."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self._packed: torch.Tensor | None = None
        self._packed_of: tuple[int, int] | None = None  # (data_ptr, version) it was made from

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (
            not ONEDNN_LINEAR
            or weight.dtype != torch.float32
            or weight.device.type != "cpu"
            or (torch.is_grad_enabled() and (weight.requires_grad or x.requires_grad))
        ):
            return nn.functional.linear(x, weight)
        # An inference tensor (made under torch.inference_mode) has no version counter.
        source = (weight.data_ptr(), 0 if weight.is_inference() else weight._version)
        if self._packed is None or source != self._packed_of:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)
            self._packed_of = source
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, None, "none", [], "")


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in fp32 (Llama's ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's ``cos``/``sin`` for ``positions`` (``[T]``), each ``[T, 1, head_dim]``.

    Frequency ``i`` is ``theta ** (-2i / head_dim)``; the angles are computed in fp32 and laid
    out as ``cat(freqs, freqs)``, the ``rotate_half`` layout of Llama.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``): ``x * cos + rotate_half(x) * sin``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """Grouped-query attention: ``num_heads`` query heads share ``num_kv_heads`` K/V heads."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.window = int32_window(config.sliding_window)  # the window the paged cache attends
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        q_dim, kv_dim = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = Linear(config.hidden_size, q_dim)
        self.k_proj = Linear(config.hidden_size, kv_dim)
        self.v_proj = Linear(config.hidden_size, kv_dim)
        self.o_proj = Linear(q_dim, config.hidden_size)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVAttention
    ) -> torch.Tensor:
        tokens = x.shape[0]
        q = self.q_proj(x).view(tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = kv.attend(self.layer, q, k, v, self.window)
        return self.o_proj(out.reshape(tokens, -1))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], kv: KVAttention
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """Embedding, the decoder layers and the final norm (Llama's ``LlamaModel``)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """The language model. Parameter names are those of ``transformers.LlamaForCausalLM``."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_seed(
        cls, config: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32
    ) -> CausalLM:
        """A model with deterministic random weights (the same for a seed on every machine).

        Matrices are drawn ``N(0, 1 / fan_in)`` and the embedding ``N(0, 1)``, so activations,
        attention scores and logits are of order 1: the attention is far from uniform (a wrong
        K/V changes the output) and greedy choices are rarely near-ties. Norm weights are drawn
        around 1 so that they matter too. ``TypeError``/``ValueError`` for a ``config`` that is not
        a :class:`ModelConfig`, a ``seed`` that is not an int in ``[0, 2**64)``, or a ``dtype``
        that is not fp32, fp16 or bf16.
        """
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig, got {type(config).__name__}")
        check_int_range("seed", seed, 0, 2**64 - 1)  # what torch.Generator.manual_seed takes
        check_float_dtype("dtype", dtype)
        model = cls(config)
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():  # a tied head is listed once
                if name.endswith("norm.weight"):
                    values = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
                elif name == "model.embed_tokens.weight":
                    values = torch.randn(param.shape, generator=generator)
                else:
                    values = torch.randn(param.shape, generator=generator) / param.shape[1] ** 0.5
                param.copy_(values)
        return model.to(dtype).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @torch.no_grad()
    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: KVAttention
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of a flat step (``input_ids``, ``positions``:
        int64 ``[T]`` on the model's device; the ids must lie in the vocabulary, which the
        engine checks on admission); every layer's K/V and attention go through ``kv``.
        ``TypeError``/``ValueError`` for other dtypes, shapes or devices."""
        check_tensor("input_ids", input_ids, 1, (torch.int64,))
        check_tensor("positions", positions, 1, (torch.int64,))
        check_shape("positions", positions, input_ids.shape)
        check_same_device(
            model=self.lm_head.weight, input_ids=input_ids, positions=positions
        )  # fmt: skip
        config = self.config
        rope = rotary_cos_sin(positions, config.head_dim, config.rope_theta, self.dtype)
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, rope, kv)
        return self.model.norm(x)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab]`` of final hidden states ``[N, hidden]`` in the model's dtype
        (``TypeError``/``ValueError`` otherwise)."""
        check_tensor("hidden", hidden, 2, (self.dtype,))
        check_shape("hidden", hidden, (hidden.shape[0], self.config.hidden_size))
        return self.lm_head(hidden)
