"""Greedy speculative decoding: what a draft source is, and which of its guesses are kept.

A speculative step computes a sequence's next token together with ``k`` guesses of the tokens
after it (*drafts*) in one pass, as a query chunk of ``1 + k`` tokens through the paged cache.
The logits at each of those positions give the greedy token there, so the step keeps the longest
prefix of drafts that greedy decoding itself would have produced, ``j <= k`` of them, and then
the greedy token after them (the *bonus* token): ``1 + j`` tokens for the price of one pass, the
same tokens plain greedy decoding gives. The rejected drafts' slots are given back with
``BlockTableStore.truncate`` (``BlockManager.truncate`` per sequence; docs/design.md §5,
"Lookahead and rollback"). Sampling is not speculated: the engine refuses a temperature above 0
when speculation is on.

A *draft source* is any callable ``draft_source(tokens, k)`` that returns up to ``k`` guesses
of the tokens that follow ``tokens`` (a sequence's prompt and output so far, as a new list): a
small model, an n-gram lookup, or, in the tests, the dense oracle or a fixed guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pagedkv.spec.block_manager import check_int

DraftSource = Callable[[list[int], int], Sequence[int]]
"""``draft_source(tokens, k)``: up to ``k`` guesses of the tokens that follow ``tokens``."""


def check_drafts(drafts: object, k: int, vocab_size: int) -> list[int]:
    """Rule: a draft source returns a list or tuple of at most ``k`` token ids in
    ``[0, vocab_size)`` (``TypeError`` or ``ValueError`` naming it otherwise). Returns them."""
    if not isinstance(drafts, (list, tuple)):
        raise TypeError(f"draft_source must return a list of ints, got {type(drafts).__name__}")
    if len(drafts) > k:
        raise ValueError(f"draft_source returned {len(drafts)} drafts, more than the {k} asked")
    for token in drafts:
        if check_int("draft token", token, 0) >= vocab_size:
            raise ValueError(f"draft token {token} is outside the vocabulary [0, {vocab_size})")
    return [int(token) for token in drafts]


def accepted_drafts(drafts: Sequence[int], greedy: Sequence[int], eos_token_id: int | None) -> int:
    """How many leading ``drafts`` greedy decoding would have produced.

    ``greedy[i]`` is the arg-max of the logits computed at the position before ``drafts[i]``
    (``len(greedy) == len(drafts) + 1``; the last one follows every draft). Rule: draft ``i`` is
    kept while every draft before it was, it equals ``greedy[i]``, and it is not
    ``eos_token_id``: greedy decoding stops at an end-of-sequence token, so one comes as the
    bonus token, ``greedy[j]``, never as a kept draft.
    """
    kept = 0
    for draft, token in zip(drafts, greedy, strict=False):
        if draft != token or draft == eos_token_id:
            break
        kept += 1
    return kept
