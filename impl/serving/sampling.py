"""Choosing the next token from one sequence's logits: greedy, or seeded temperature sampling.

The temperature rule: ``0`` is greedy; any other temperature is a finite ``int`` or ``float``
above 0, subnormal and huge ones included. Every accepted temperature gives a valid
distribution: the logits are shifted by their maximum before the division, in float64, so the
scaled logits lie in ``[-inf, 0]`` with a 0 at each arg-max. A tiny temperature then draws
among the arg-max ties (greedy, but drawn), a huge one nearly uniformly. Nothing can overflow to
``inf - inf``, the NaN that a plain ``softmax(logits / temperature)`` gives for ``1e-300``.
"""

from __future__ import annotations

import torch

from pagedkv.kernels.check_arguments import check_number


def check_temperature(temperature: object) -> float:
    """The temperature rule above; returns it as a float.

    ``TypeError`` for anything but an ``int`` or ``float`` (``bool`` is not a number here),
    ``ValueError`` for a negative, infinite or NaN one.
    """
    return check_number("temperature", temperature, allow_zero=True)


def sample_token(
    logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None
) -> int:
    """The next token for ``logits`` (a float ``[vocab]`` tensor, ``vocab >= 1``).

    ``temperature == 0`` is greedy: the arg-max, the lowest id on a tie. Otherwise a draw from
    ``softmax((logits - max(logits)) / temperature)`` (in float64) with ``generator``, so a
    sequence with its own seeded generator draws the same tokens however it is batched.
    ``TypeError``/``ValueError`` for logits that are not such a tensor, a temperature outside the
    rule, or a ``generator`` that is not a ``torch.Generator``; all are checked before drawing.
    """
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise TypeError(f"logits must be a float torch.Tensor, got {type(logits).__name__}")
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must have shape [vocab] with vocab >= 1, got {logits.shape}")
    temperature = check_temperature(temperature)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if temperature == 0.0:
        return int(torch.argmax(logits))
    wide = logits.double()
    probs = torch.softmax((wide - wide.max()) / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def seeded_generators(base: tuple[int, ...], n: int) -> list[torch.Generator]:
    """One CPU generator per sample ``i < n``, seeded from ``hash((*base, i))``: a sample's draws
    depend on ``base`` and ``i`` only, not on how its sequence is batched or preempted."""
    return [torch.Generator().manual_seed(hash((*base, i)) & 0x7FFF_FFFF) for i in range(n)]
