"""A sequence's facts, each with one owner: the :class:`Sequence` (its request's facts and its
tokens), the :class:`StepColumns` (what a step computes of it while it runs) and the block store
(its table and token count, read from the store and never copied); and the rules a request's
facts meet (:func:`check_request`, :func:`check_fits`).

A :class:`Sequence` is one sample of one request. Its tokens (prompt, then output) are its own;
how many of them have their K/V in the cache (``num_computed``) is a step column while it runs,
0 while it waits (a preempted sequence forgets its K/V) and all but its last token once it has
finished (the last token is never computed). How many samples it still forks into follows from
its tokens: the request's ``n`` until its prompt's logits are sampled, then 1.

:class:`StepColumns` holds, for every row of the store (``store.row(seq_id)``), the running
sequence's ``num_computed`` and the facts of its request that a step reads for every row at once
(its id, length limit, EOS token, prompt length and ``n``), so a step reads no per-sequence object.
The scheduler writes a row when its sequence starts running there and ``num_computed`` after
every step; a row no running sequence holds is never read.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from operator import attrgetter

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.serving.block_store import BlockStore
from pagedkv.spec.block_manager import blocks_needed, check_int
from pagedkv.spec.checks import INT64_MAX, check_str, check_tokens


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


TOKENS = attrgetter("tokens")
"""A sequence's tokens, as a getter to map over many sequences at C speed."""

NO_EOS = -1
"""The EOS column of a sequence without an EOS token: no token equals it."""


class StepColumns:
    """Int64 columns indexed by the store's row: ``computed`` (the running sequence's
    ``num_computed``), its ``seq_id``, and its request's ``max_len`` (prompt plus
    ``max_new_tokens``), ``eos`` (:data:`NO_EOS` for none), ``prompt_len`` and ``n``."""

    def __init__(self, store: BlockStore) -> None:
        self.store = store
        size = store.max_seqs
        self.computed: NDArray[np.int64] = np.zeros(size, np.int64)
        self.seq_id: NDArray[np.int64] = np.zeros(size, np.int64)
        self.max_len: NDArray[np.int64] = np.zeros(size, np.int64)
        self.eos: NDArray[np.int64] = np.zeros(size, np.int64)
        self.prompt_len: NDArray[np.int64] = np.zeros(size, np.int64)
        self.n: NDArray[np.int64] = np.zeros(size, np.int64)

    def num_computed(self, seq_id: int) -> int:
        """The running sequence ``seq_id``'s ``num_computed`` (``KeyError`` if it holds no row)."""
        return int(self.computed[self.store.row(seq_id)])

    def place(self, where: int | NDArray[np.bool_], seq: Sequence) -> None:
        """Write ``seq``'s request into the rows ``where`` (``computed`` is the caller's)."""
        self.seq_id[where] = seq.seq_id
        self.max_len[where] = seq.prompt_len + seq.max_new_tokens
        self.eos[where] = NO_EOS if seq.eos_token_id is None else seq.eos_token_id
        self.prompt_len[where] = seq.prompt_len
        self.n[where] = seq.n

    def done(
        self, rows: NDArray[np.intp], ends: NDArray[np.int64], tokens: NDArray[np.int64]
    ) -> NDArray[np.bool_]:
        """Whether the sequence in each of ``rows``, with ``ends`` tokens, completes its output
        by appending its token of ``tokens``: the length limit, or EOS (as
        :attr:`Sequence.done`)."""
        return (ends + 1 >= self.max_len[rows]) | (tokens == self.eos[rows])

    def samples(self, rows: NDArray[np.intp], lengths: NDArray[np.int64]) -> NDArray[np.int64]:
        """Samples the sequence in each of ``rows`` still forks into at ``lengths`` tokens, as
        :attr:`Sequence.num_samples` counts them."""
        return np.where(lengths == self.prompt_len[rows], self.n[rows], 1)


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens, and how many of them the cache holds."""

    seq_id: int
    request_id: int
    tokens: list[int]  # prompt, then output
    prompt_len: int
    max_new_tokens: int
    eos_token_id: int | None = None
    n: int = 1  # the request's samples: a sequence forks into them once its prompt is computed
    sample_index: int = 0
    status: SeqStatus = SeqStatus.WAITING
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt
    columns: StepColumns | None = field(default=None, repr=False)  # its scheduler's

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_samples(self) -> int:
        """Samples still to fork into: ``n`` until the prompt's logits are sampled, then 1."""
        return self.n if len(self.tokens) == self.prompt_len else 1

    @property
    def num_computed(self) -> int:
        """Leading tokens whose K/V are in the cache (see the module docstring)."""
        if self.status is SeqStatus.RUNNING and self.columns is not None:
            return self.columns.num_computed(self.seq_id)
        return 0 if self.status is SeqStatus.WAITING else len(self.tokens) - 1

    @property
    def num_pending(self) -> int:
        """Tokens whose K/V are not computed yet (at least 1 for an unfinished sequence)."""
        return len(self.tokens) - self.num_computed

    @property
    def done(self) -> bool:
        """Whether the output is complete: ``max_new_tokens`` tokens, or the last one is EOS."""
        output = len(self.tokens) - self.prompt_len
        return output >= self.max_new_tokens or (
            output > 0 and self.tokens[-1] == self.eos_token_id
        )


class RequestTooLargeError(ValueError):
    """A request that no amount of waiting could ever run (see :func:`check_fits`)."""


def check_cache_salt(cache_salt: object) -> str | None:
    """Rule: a cache salt is a str or None (``TypeError`` otherwise). Returns it as a plain str
    (a subclass such as ``numpy.str_`` is taken as the str it equals, :func:`check_str`), so
    the salt the store hashes is one the default block hash takes."""
    if cache_salt is None:
        return None
    return check_str("cache_salt", cache_salt)


def check_request(
    prompt: object, max_new_tokens: object, n: object, eos_token_id: object, cache_salt: object
) -> tuple[list[int], int, int, int | None, str | None]:
    """Rules of a request's facts, checked in this order: ``max_new_tokens`` and ``n`` are ints
    of at least 1, ``eos_token_id`` is None or a non-negative int at most int64's largest, the
    cache salt is a str or None (:func:`check_cache_salt`) and the prompt is a non-empty list
    or tuple of non-negative ints (``TypeError``/``ValueError`` naming the argument otherwise).
    Returns them as plain values (an int subclass is taken as its value, whatever its
    arithmetic does), the prompt as a new list."""
    max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)
    n = check_int("n", n, 1)
    if eos_token_id is not None:
        eos_token_id = check_int("eos_token_id", eos_token_id, 0)
        if eos_token_id > INT64_MAX:
            raise ValueError(f"eos_token_id={eos_token_id} exceeds int64's largest")
    cache_salt = check_cache_salt(cache_salt)
    tokens = list(check_tokens(prompt))
    if not tokens:
        raise ValueError("the prompt must hold at least one token")
    return tokens, max_new_tokens, n, eos_token_id, cache_salt


def check_fits(
    request_id: int,
    prompt_len: int,
    max_new_tokens: int,
    n: int,
    store: BlockStore,
    *,
    max_num_seqs: int,
    max_model_len: int | None,
) -> None:
    """:class:`RequestTooLargeError` for a request that can never run: its prompt plus output
    must fit ``max_model_len``; one sequence of it holds up to ``prompt_len + max_new_tokens -
    1`` tokens (the last token is never computed), whose blocks must fit ``store``'s pool and
    one of its tables; its ``n`` samples must fit ``max_num_seqs``."""
    block_size = store.block_size
    capacity = min(store.total_blocks, store.max_blocks_per_seq)
    if max_model_len is not None and prompt_len + max_new_tokens > max_model_len:
        raise RequestTooLargeError(
            f"request {request_id}: its prompt of {prompt_len} tokens plus "
            f"max_new_tokens={max_new_tokens} exceeds max_model_len={max_model_len}"
        )
    needed = blocks_needed(prompt_len + max_new_tokens - 1, block_size)
    if needed > capacity:
        raise RequestTooLargeError(
            f"request {request_id} can never fit: its prompt of {prompt_len} tokens plus "
            f"max_new_tokens={max_new_tokens} new tokens needs up to {needed} blocks of "
            f"{block_size} tokens, but a sequence can hold at most {capacity}"
        )
    if n > max_num_seqs:
        raise RequestTooLargeError(
            f"request {request_id} asks for n={n} samples but at most "
            f"max_num_seqs={max_num_seqs} sequences run at once"
        )
