"""``model.Linear``: ``nn.Linear``'s product on oneDNN's prepacked weight or not, never stale."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.impl.serving import model
from pagedkv.impl.serving.model import Linear


def linear(rows: int, inputs: int, outputs: int, seed: int) -> tuple[Linear, torch.Tensor]:
    """A seeded :class:`Linear` and an input of ``rows`` rows."""
    generator = torch.Generator().manual_seed(seed)
    layer = Linear(inputs, outputs)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(outputs, inputs, generator=generator) / inputs**0.5)
    return layer, torch.randn(rows, inputs, generator=generator)


def exact(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in fp64, rounded to fp32."""
    return torch.nn.functional.linear(x.double(), weight.double()).float()


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 80), inputs=st.integers(1, 96), outputs=st.integers(1, 96),
    seed=st.integers(0, 2**32 - 1),
)  # fmt: skip
def test_the_product_is_the_linear_one(rows: int, inputs: int, outputs: int, seed: int) -> None:
    """Any rows and shape, batched or not: ``x @ weight.T`` up to fp32 rounding order."""
    layer, x = linear(rows, inputs, outputs, seed)
    with torch.no_grad():
        expected = exact(x, layer.weight)
        torch.testing.assert_close(layer(x), expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(layer(x[None])[0], expected, rtol=1e-4, atol=1e-5)


def test_a_changed_weight_is_packed_again() -> None:
    """An in-place ``copy_`` (as loaders write weights), a replaced ``.data`` and a replaced
    parameter each show in the next product."""
    layer, x = linear(32, 48, 40, 0)
    changes = (
        lambda new: layer.weight.copy_(new),
        lambda new: setattr(layer.weight, "data", new),
        lambda new: setattr(layer, "weight", torch.nn.Parameter(new)),
    )
    with torch.no_grad():
        layer(x)  # packs
        for scale, change in enumerate(changes, 1):
            change(new := torch.randn(40, 48) * scale)
            torch.testing.assert_close(layer(x), exact(x, new), rtol=1e-4, atol=1e-4)


def test_gradients_and_other_dtypes_take_the_plain_product() -> None:
    """With gradients wanted, and for bf16, exactly ``functional.linear``; backward works."""
    layer, x = linear(8, 16, 12, 1)
    x.requires_grad_(True)
    out = layer(x)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight), rtol=0, atol=0)
    out.sum().backward()
    assert x.grad is not None and layer.weight.grad is not None
    half = layer.to(torch.bfloat16)
    with torch.no_grad():
        y = x.detach().bfloat16()
        torch.testing.assert_close(
            half(y), torch.nn.functional.linear(y, half.weight), rtol=0, atol=0
        )


def test_onednn_is_what_runs_on_this_cpu() -> None:
    """oneDNN (x86, arm64) products use the packed copy: an unseen ``.data`` change is not in it."""
    if not model.ONEDNN_LINEAR:
        pytest.skip("this torch has no oneDNN")
    layer, x = linear(32, 24, 20, 2)
    with torch.no_grad():
        before = layer(x)
        layer.weight.data.mul_(2)
        torch.testing.assert_close(layer(x), before, rtol=0, atol=0)
        layer.weight.mul_(1)  # a tracked change: packed again
        torch.testing.assert_close(layer(x), 2 * before, rtol=1e-4, atol=1e-5)


def test_a_layer_built_under_inference_mode_multiplies() -> None:
    """Under ``inference_mode`` (no version counter): the plain product; a new parameter shows."""
    with torch.inference_mode():
        layer, x = linear(32, 24, 20, 3)
        torch.testing.assert_close(layer(x), exact(x, layer.weight), rtol=1e-4, atol=1e-5)
        new = torch.randn(20, 24)
        layer.weight = torch.nn.Parameter(new, requires_grad=False)
        torch.testing.assert_close(layer(x), exact(x, new), rtol=1e-4, atol=1e-5)
