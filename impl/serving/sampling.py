"""Choosing the next token from one sequence's logits: greedy, or seeded temperature sampling."""

from __future__ import annotations

import torch


def sample_token(
    logits: torch.Tensor, temperature: float = 0.0, generator: torch.Generator | None = None
) -> int:
    """The next token for ``logits`` (``[vocab]``).

    ``temperature == 0`` is greedy: the arg-max, the lowest id on a tie. Otherwise a draw from
    ``softmax(logits / temperature)`` (in fp32) with ``generator``, so a sequence with its own
    seeded generator draws the same tokens however it is batched.
    """
    if temperature == 0.0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))
