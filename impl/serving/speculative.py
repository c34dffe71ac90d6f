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

The engine's step calls three functions here: :func:`draft` before the pass (every draft source
call, then the drafts added), :func:`roll_back` after it (the rejected drafts cut), and
:func:`undraft` when the step fails (every draft given back). The scheduler makes every change
(``Scheduler.add_drafts``, ``keep_drafts`` and ``undo_drafts``): each drafted sequence's tokens
and table change together, in one call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from pagedkv.impl.serving.scheduler import Drafted, Scheduler, SchedulerOutput
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


Before = Drafted
"""Each drafted sequence's row in the plan and its end before its drafts, by sequence id: what
:func:`undraft` gives back to."""


def draft(
    plan: SchedulerOutput,
    scheduler: Scheduler,
    draft_source: DraftSource,
    num_speculative_tokens: int,
    budget: int,
    vocab_size: int,
) -> tuple[SchedulerOutput, dict[int, list[int]], Before]:
    """Give each sequence whose step samples (one sample) up to ``num_speculative_tokens``
    drafts, within ``budget`` more tokens in the step and the room left in its output
    (``scheduler.add_drafts``). Returns the plan that also computes the drafts, the drafts by
    sequence id, and what :func:`undraft` needs. All-or-nothing: every draft source call is
    made and checked before anything changes; a sequence the pool cannot grow now is not
    speculated this step."""
    drafts: dict[int, list[int]] = {}
    for seq in plan.sampling:
        room = seq.max_new_tokens - len(seq.tokens) + seq.prompt_len - 1  # beyond its sample
        k = min(num_speculative_tokens, budget, room)
        if seq.num_samples > 1 or k < 1:
            continue
        guess = check_drafts(draft_source(list(seq.tokens), k), k, vocab_size)
        if guess:
            drafts[seq.seq_id] = guess
            budget -= len(guess)
    if not drafts:
        return plan, drafts, {}
    drafted, before = scheduler.add_drafts(plan, drafts)
    return drafted, {seq_id: drafts[seq_id] for seq_id in before}, before


def roll_back(
    plan: SchedulerOutput,
    drafts: Mapping[int, list[int]],
    rows: Mapping[int, torch.Tensor],
    scheduler: Scheduler,
) -> SchedulerOutput:
    """Keep each drafted sequence's accepted drafts (``len(rows[seq_id]) - 1`` of them): the
    rest leave its tokens and table (``scheduler.keep_drafts``). Returns the plan as verified:
    each drafted item computes up to its last kept draft."""
    ends = plan.ends
    kept = {}  # seq id -> (row, end)
    for row, seq_id in enumerate(plan.seq_ids.tolist()):
        if seq_id in drafts:
            kept[seq_id] = row, int(ends[row]) - len(drafts[seq_id]) + len(rows[seq_id]) - 1
    return scheduler.keep_drafts(plan, kept)


def undraft(plan: SchedulerOutput, before: Before, scheduler: Scheduler) -> None:
    """A speculative step failed: each drafted sequence's tokens and table go back to what they
    were before its drafts (``before``, from :func:`draft`), so the next step schedules the
    same work again. Cannot fail: ``scheduler.undo_drafts`` cannot, and nothing else here calls
    another module, so a fault in :func:`roll_back` followed by another anywhere leaves no
    unverified draft behind."""
    scheduler.undo_drafts(plan, before)
