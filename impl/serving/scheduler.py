"""Continuous batching: which sequences compute which tokens each step, and who is preempted.

:class:`Scheduler` is a policy over a :class:`pagedkv.impl.serving.block_store.BlockStore`, such as
:class:`pagedkv.impl.blocks.store.BlockTableStore`. It needs no model and no tensors: it
allocates, grows, forks and frees block tables and tells the caller (an engine, or a serving
simulator) what to compute. The caller computes it and reports the sampled tokens with
:meth:`Scheduler.update`.

A sequence holds ``tokens`` (prompt, then output) of which the first ``num_computed`` have their
K/V in the cache. A running sequence's table always holds its tokens up to the last one
scheduled. Every step, in order:

1. **Running sequences, oldest admission first**, each get their pending tokens (one for a
   decode; a prompt's rest, cut to the step's remaining token budget: chunked prefill). A
   sequence whose table must grow and cannot is the trigger for **preemption by recompute**: the
   most recently admitted running sequence (possibly the one growing) frees its blocks and goes
   back to the front of the waiting queue, its K/V forgotten (``num_computed = 0``), until the
   growth fits. A preempted sequence keeps its tokens, so it resumes exactly where it was.
2. **Waiting sequences, in order** (first come, first served; no overtaking), are admitted while
   the token budget, the sequence limit and the memory allow. Memory allows when the blocks the
   prompt consumes *after prefix-cache hits* (``store.admit`` plans it once) leave at least
   ``watermark_blocks`` free, the headroom that lets running sequences grow; with nothing
   running the watermark is waived, so a request that fits the pool on its own is always
   admitted eventually. A step that preempted admits nothing: with prefix caching, a victim's
   own freed blocks are hits, and it would be readmitted in the step that evicted it.

A request that can never fit (its prompt plus ``max_new_tokens - 1`` tokens need more blocks
than the pool or a table holds, or more samples than ``max_num_seqs``) is rejected by
:meth:`Scheduler.add_request` with :class:`RequestTooLargeError`; every other request runs to
completion. The oldest running sequence is never preempted by a younger one, and alone it
always fits, so every step makes progress.

Sliding window (``SchedulerConfig.sliding_window``, every layer windowed as in Mistral): a query
at position ``p`` reads only positions above ``p - window``, so a sequence whose next query is
at ``num_computed`` never reads again the blocks ``blocks_outside_window(num_computed, window,
block_size)`` of its table (``pagedkv.spec.block_manager``). The scheduler gives them back with
``store.release_outside_window`` at the start of every step, before anything grows (every
running sequence, at its ``num_computed``: committed tokens only, so speculative drafts are never
counted), and right after admitting a prompt with prefix-cache hits (at the first token it
computes: hit blocks wholly before that token's window go straight back to the free queue, still
cached). A running sequence then holds at most ``blocks_needed(window - 1, block_size) + 1``
blocks before a step grows it (a prompt still being computed holds its uncomputed tokens' blocks
too). A release is idempotent, so a failed step that is scheduled again releases nothing twice.

Parallel sampling: a request with ``n > 1`` runs as one sequence until its prompt is computed;
the tokens sampled from the prompt's last logits (one per sample) then fork it into ``n``
sequences sharing the prompt's blocks (``store.fork``). The first write into the shared,
partly filled last block copies it (copy-on-write; the pairs wait in ``store.pop_copy_pairs``).
It is admitted only if all ``n`` samples fit under ``max_num_seqs``.

Arrays, not objects: a step's plan (:class:`SchedulerOutput`) is numpy arrays, one row per
scheduled sequence (ids, starts, token counts, prefix hits, whether it samples), and
:meth:`Scheduler.update` takes the sampled tokens as one flat list or array. The scheduler keeps
what a step needs of each running sequence (id, token count, ``num_computed``, length limit,
EOS token, samples to fork) in one int64 array, a row per running sequence in running order, so
a step reads no per-sequence object; only the :class:`Sequence` objects' ``num_computed`` and
``tokens`` are written, in C-level loops, to keep them the public view of each sequence.
"""

from __future__ import annotations

import enum
from collections import abc, deque
from dataclasses import dataclass, field
from itertools import compress, repeat
from operator import attrgetter

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.serving.block_store import BlockStore
from pagedkv.spec.block_manager import blocks_needed, check_int
from pagedkv.spec.checks import INT64_MAX, check_str, check_tokens


class RequestTooLargeError(ValueError):
    """A request that no amount of waiting could ever run (see :meth:`Scheduler.add_request`)."""


def check_cache_salt(cache_salt: object) -> str | None:
    """Rule: a cache salt is a str or None (``TypeError`` otherwise). Returns it as a plain str
    (a subclass such as ``numpy.str_`` is taken as the str it equals, :func:`check_str`), so
    the salt the store hashes is one the default block hash takes."""
    if cache_salt is None:
        return None
    return check_str("cache_salt", cache_salt)


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits: sequences running at once (each sample counts), tokens computed per step, and
    the free blocks an admission must leave for running sequences to grow into; and the model's
    sliding window (``None``: full attention), whose blocks outside it are released."""

    max_num_seqs: int = 8
    max_num_batched_tokens: int = 512
    watermark_blocks: int = 0
    sliding_window: int | None = None
    max_model_len: int | None = None  # the longest prompt plus output served; None: no limit

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("watermark_blocks", self.watermark_blocks, 0)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sample of one request: its tokens and how many of them the cache holds."""

    seq_id: int
    request_id: int
    tokens: list[int]  # prompt, then output
    prompt_len: int
    max_new_tokens: int
    eos_token_id: int | None = None
    num_samples: int = 1  # > 1 until the prompt is computed: then it forks into that many
    sample_index: int = 0
    num_computed: int = 0  # leading tokens whose K/V are in the cache
    status: SeqStatus = SeqStatus.WAITING
    cache_salt: str | None = None  # prefix-cache hits only among requests with the same salt

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

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


_consume = deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing
_TOKENS = attrgetter("tokens")

# The columns of ``Scheduler._rows``: one int64 row per running sequence, in running order.
_ID, _LENGTH, _COMPUTED, _MAX_LEN, _EOS, _SAMPLES = range(6)
_NO_EOS = -1  # the _EOS column of a sequence without an EOS token: no token equals it


def _row(seq: Sequence) -> list[int]:
    """``seq``'s row of ``Scheduler._rows``."""
    eos = _NO_EOS if seq.eos_token_id is None else seq.eos_token_id
    return [
        seq.seq_id, len(seq.tokens), seq.num_computed, seq.prompt_len + seq.max_new_tokens, eos,
        seq.num_samples,
    ]  # fmt: skip


def _check_sampled(sampled: object, expected: int) -> tuple[abc.Sequence[int], NDArray[np.int64]]:
    """Rule: a step's sampled tokens are a list or tuple of non-negative ints, or a 1-D integer
    array of them, ``expected`` long, each at most int64's largest (``TypeError``/``ValueError``
    otherwise). Returns them as a list or tuple of ints and as an int64 array."""
    if isinstance(sampled, np.ndarray):
        if sampled.ndim != 1 or sampled.dtype.kind not in "iu":
            raise TypeError(f"sampled tokens must be a 1-D integer array, got {sampled.dtype}")
        if sampled.size and sampled.min() < 0:
            check_tokens(sampled.tolist())  # the ValueError naming the token
        tokens = sampled.tolist()
    else:
        tokens = check_tokens(sampled)
    if tokens and max(tokens) > INT64_MAX:
        raise ValueError(f"sampled token {max(tokens)} exceeds int64's largest, {INT64_MAX}")
    array = np.array(tokens, dtype=np.int64)
    if len(tokens) != expected:
        raise ValueError(f"the step samples {expected} tokens, got {len(tokens)}")
    return tokens, array


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` to compute this step, from position ``start``: one row
    of a :class:`SchedulerOutput`, as an object (:meth:`SchedulerOutput.items`)."""

    seq: Sequence
    start: int
    num_tokens: int
    cached_tokens: int = 0  # prefix-cache hits when admitted this step
    samples: bool = True  # the step computes the sequence's last known token: it samples

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan as arrays, one row per scheduled sequence, in batch order (running
    sequences first, then new admissions): row ``b`` computes ``num_tokens[b]`` tokens of
    ``seqs[b]`` from position ``starts[b]``, of which ``cached_tokens[b]`` leading ones were
    prefix-cache hits when it was admitted this step; ``samples[b]`` says whether the row
    computes the sequence's last known token, so its logits give the next one (false for a
    prompt chunk short of the end). Also the sequences preempted while making it (already back
    in the waiting queue, in the order they were preempted), and those admitted (the batch's
    last ``len(admitted)`` rows). The arrays are int64 (``samples`` bool) and read-only."""

    seqs: list[Sequence]
    seq_ids: NDArray[np.int64]
    starts: NDArray[np.int64]
    num_tokens: NDArray[np.int64]
    cached_tokens: NDArray[np.int64]
    samples: NDArray[np.bool_]
    preempted: list[Sequence]
    admitted: list[Sequence]

    def __post_init__(self) -> None:
        for array in (self.seq_ids, self.starts, self.num_tokens, self.cached_tokens):
            array.flags.writeable = False
        self.samples.flags.writeable = False

    @property
    def ends(self) -> NDArray[np.int64]:
        """One past each row's last computed position."""
        return self.starts + self.num_tokens

    @property
    def num_batched_tokens(self) -> int:
        return int(self.num_tokens.sum())

    @property
    def prefix_hit_tokens(self) -> int:
        return int(self.cached_tokens.sum())

    @property
    def sampling(self) -> list[Sequence]:
        """The sequences of the rows that sample, in batch order: ``update`` takes their
        sampled tokens in this order."""
        return [self.seqs[i] for i in np.flatnonzero(self.samples).tolist()]

    def items(self) -> list[ScheduledSeq]:
        """The rows as objects, in batch order (for readers, not the step's hot path)."""
        return [
            ScheduledSeq(seq, start, count, cached, samples)
            for seq, start, count, cached, samples in zip(
                self.seqs, self.starts.tolist(), self.num_tokens.tolist(),
                self.cached_tokens.tolist(), self.samples.tolist(), strict=True,
            )
        ]  # fmt: skip


@dataclass
class Scheduler:
    """The continuous-batching policy over ``store`` (see the module docstring)."""

    store: BlockStore
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    waiting: deque[Sequence] = field(default_factory=deque, init=False)
    running: list[Sequence] = field(default_factory=list, init=False)
    _next_seq_id: int = field(default=0, init=False)
    # What each running sequence's step needs, as arrays (the _ID.._SAMPLES columns): the
    # step reads no per-sequence object.
    _rows: NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 6), np.int64), init=False)

    def __post_init__(self) -> None:
        if self.store.max_seqs < self.config.max_num_seqs:
            raise ValueError(
                f"the store has {self.store.max_seqs} rows for max_num_seqs="
                f"{self.config.max_num_seqs}"
            )

    @property
    def num_running_seqs(self) -> int:
        """Running sequences, counting every sample an unforked request will fork into."""
        return int(self._rows[:, _SAMPLES].sum())

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_request(
        self,
        request_id: int,
        prompt: abc.Sequence[int],
        max_new_tokens: int,
        *,
        n: int = 1,
        eos_token_id: int | None = None,
        cache_salt: str | None = None,
    ) -> Sequence:
        """Queue a request (its first sequence) at the back of the waiting queue.

        ``cache_salt`` isolates the request's prefix cache: its blocks are cached under the
        salt and it hits only blocks cached under an equal one, so tenants with different salts
        never share a block (None is a salt of its own, shared by every unsalted request).

        Raises ``TypeError``/``ValueError`` for a prompt that is not a non-empty list or tuple of
        non-negative ints, a count below 1, a bad ``eos_token_id`` or a ``cache_salt`` that is
        not a str or None, and
        :class:`RequestTooLargeError` for a request that can never run: one sequence of it holds
        up to ``len(prompt) + max_new_tokens - 1`` tokens (the last token is never computed),
        which must fit the pool and a table, and its ``n`` samples must fit ``max_num_seqs``.
        """
        max_new_tokens = check_int("max_new_tokens", max_new_tokens, 1)  # plain ints: the
        n = check_int("n", n, 1)  # values, whatever an int subclass's arithmetic does
        if eos_token_id is not None:
            eos_token_id = check_int("eos_token_id", eos_token_id, 0)
            if eos_token_id > INT64_MAX:
                raise ValueError(f"eos_token_id={eos_token_id} exceeds int64's largest")
        cache_salt = check_cache_salt(cache_salt)
        prompt = check_tokens(prompt)  # plain ints: an int subclass is taken as its value
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        max_model_len = self.config.max_model_len
        if max_model_len is not None and len(prompt) + max_new_tokens > max_model_len:
            raise RequestTooLargeError(
                f"request {request_id}: its prompt of {len(prompt)} tokens plus "
                f"max_new_tokens={max_new_tokens} exceeds max_model_len={max_model_len}"
            )
        max_len = len(prompt) + max_new_tokens - 1
        needed = blocks_needed(max_len, self.store.block_size)
        capacity = min(self.store.total_blocks, self.store.max_blocks_per_seq)
        if needed > capacity:
            raise RequestTooLargeError(
                f"request {request_id} can never fit: its prompt of {len(prompt)} tokens plus "
                f"max_new_tokens={max_new_tokens} new tokens needs up to {needed} blocks of "
                f"{self.store.block_size} tokens, but a sequence can hold at most {capacity}"
            )
        if n > self.config.max_num_seqs:
            raise RequestTooLargeError(
                f"request {request_id} asks for n={n} samples but at most "
                f"max_num_seqs={self.config.max_num_seqs} sequences run at once"
            )
        seq = Sequence(
            self._new_seq_id(), request_id, list(prompt), len(prompt), max_new_tokens,
            eos_token_id, num_samples=n, cache_salt=cache_salt,
        )  # fmt: skip
        self.waiting.append(seq)
        return seq

    def schedule(self) -> SchedulerOutput:
        """Plan one step: grow (or preempt for) the running sequences, then admit waiting ones.

        Every table in the plan holds its sequence's tokens up to its row's end, and with a
        sliding window none holds a block outside the window of its first token to compute. At
        most ``max_num_batched_tokens`` tokens are scheduled, and at most ``max_num_seqs``
        sequences run. The running rows are computed as arrays, with no per-sequence object.
        """
        budget = self.config.max_num_batched_tokens
        window = self.config.sliding_window
        if window is not None and self.running:  # before growing: the freed blocks can serve it
            positions = self._rows[:, _COMPUTED]  # in the store's live order
            self.store.release_outside_window(None, window, positions)
        preempted, starts, counts, samples = self._grow_or_preempt(budget)
        seqs = self.running[: len(starts)]  # the visited sequences that were not preempted
        budget -= int(counts.sum())
        hit_counts = np.zeros(len(starts), np.int64)
        rows = []  # each admission's (start, count, cached, samples)
        admitted: list[Sequence] = []
        # A step that preempted admits nothing: its victims would otherwise be readmitted at
        # once (prefix-cache hits on their own freed blocks make them cheap to admit).
        while not preempted and budget > 0 and self.waiting:
            seq = self.waiting[0]
            cached = self._admit(seq)
            if cached is None:
                break
            self.waiting.popleft()  # only once its blocks are held: a failed admit loses nothing
            seq.status, seq.num_computed = SeqStatus.RUNNING, cached
            self.running.append(seq)
            self._rows = np.append(self._rows, [_row(seq)], axis=0)
            if window is not None and cached:  # hits before the first computed token's window
                self.store.release_outside_window([seq.seq_id], window, cached)
            admitted.append(seq)
            count = min(seq.num_pending, budget)
            budget -= count
            rows.append((cached, count, cached, count == seq.num_pending))
        if admitted:
            seqs = seqs + admitted
            new_starts, new_counts, new_cached, new_samples = map(list, zip(*rows, strict=True))
            starts = np.append(starts, new_starts)
            counts = np.append(counts, new_counts)
            hit_counts = np.append(hit_counts, new_cached)
            samples = np.append(samples, new_samples)
        return SchedulerOutput(
            seqs, self._rows[: len(seqs), _ID].copy(), starts, counts, hit_counts, samples,
            preempted, admitted,
        )  # fmt: skip

    def update(
        self, output: SchedulerOutput, sampled: abc.Sequence[int] | NDArray[np.integer]
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Record that ``output``'s tokens were computed, and the tokens sampled from them.

        ``sampled`` is flat: for each sequence of ``output.sampling`` (the rows that sample, in
        batch order), one token per sample still to fork (``seq.num_samples``; 1 once forked),
        as a list or tuple of ints or a 1-D integer array. Full blocks are registered with the
        prefix cache; an unforked sequence forks; a sequence whose output is complete finishes
        and frees its blocks at once. Returns ``(forked, finished)``: the new sequences, and the
        sequences that finished, in batch order. ``TypeError`` or ``ValueError`` (changing
        nothing) for a wrong number of tokens, or a token that is not a non-negative int.

        Transactional: if a store call raises, the forks made are undone and the scheduler is
        as it was (only idempotent prefix-cache registrations of written K/V remain), so the
        same ``update`` can be retried.
        """
        size = len(output.seqs)
        if size > len(self.running) or (size and output.seqs[-1] is not self.running[size - 1]):
            raise ValueError("update takes the output of the latest schedule()")
        rows = np.flatnonzero(output.samples)  # the sampling rows: running's first ones
        state = self._rows[rows]
        per_seq = state[:, _SAMPLES]
        tokens, token_array = _check_sampled(sampled, int(per_seq.sum()))  # before any change
        forking = per_seq > 1
        any_fork = bool(forking.any())
        firsts = range(len(tokens))  # each sequence's first token
        first_tokens = tokens
        if any_fork:
            firsts = (np.cumsum(per_seq) - per_seq).tolist()
            first_tokens = [tokens[i] for i in firsts]
            token_array = token_array[firsts]
        sampling = output.seqs if len(rows) == size else output.sampling
        starts, ends = output.starts, output.ends
        bs = self.store.block_size
        if self.store.prefix_caching:  # idempotent: a retried update registers nothing twice
            for i in np.flatnonzero(ends // bs > starts // bs).tolist():  # filled a block
                seq, end = output.seqs[i], int(ends[i])
                self.store.cache_blocks(
                    seq.seq_id,
                    seq.tokens if end == len(seq.tokens) else seq.tokens[:end],
                    seq.cache_salt,
                )
        # Output complete once the sampled token is appended: the length limit, or EOS.
        done = (ends[rows] + 1 >= state[:, _MAX_LEN]) | (token_array == state[:, _EOS])
        # The store calls that can fail come first, each atomic, and are undone on failure by
        # a store call that cannot fail (``undo_fork``: no check, no block taken), so a second
        # fault cannot leave a child in the store; the scheduler's own state changes only
        # after all of them succeeded.
        first_id = self._next_seq_id
        children: list[Sequence] = []
        finishing: list[int] = []  # running positions
        finished: list[Sequence] = []  # in batch order: children born done, then the parent
        try:
            for j in np.flatnonzero(done | forking if any_fork else done).tolist():
                seq, first = sampling[j], firsts[j]
                for index in range(1, int(per_seq[j])):
                    child = self._child(seq, int(ends[rows[j]]), index, tokens[first + index])
                    if child.done:  # a child that is already done holds no blocks
                        finished.append(child)
                    else:
                        self.store.fork(seq.seq_id, child.seq_id)
                    children.append(child)
                if done[j]:
                    finishing.append(int(rows[j]))
                    finished.append(seq)
            if finishing:
                self.store.remove([self.running[i].seq_id for i in finishing])
        except BaseException:
            forks = [child.seq_id for child in children if not child.done]
            if forks:
                self.store.undo_fork(forks)
            self._next_seq_id = first_id
            raise
        # Per sequence, in C (a map consumed by an empty deque): the hot loops of a step.
        _consume(map(setattr, output.seqs, repeat("num_computed"), ends.tolist()))
        _consume(map(list.append, map(_TOKENS, sampling), first_tokens))
        table = self._rows  # changed in place: nothing below can fail
        table[:size, _COMPUTED] = ends
        table[rows, _LENGTH] = ends[rows] + 1
        if any_fork:
            for j in np.flatnonzero(forking).tolist():
                sampling[j].num_samples = 1
            table[rows[forking], _SAMPLES] = 1
        for child in children:
            child.status = SeqStatus.FINISHED if child.done else SeqStatus.RUNNING
            if not child.done:
                self.running.append(child)
                table = np.append(table, [_row(child)], axis=0)
        if finishing:
            for i in finishing:
                self.running[i].status = SeqStatus.FINISHED
            keep = np.ones(len(self.running), dtype=bool)
            keep[finishing] = False
            self.running = list(compress(self.running, keep.tolist()))
            table = table[keep]
        self._rows = table
        return children, finished

    # ----------------------------------------------------------------- internals

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _grow_or_preempt(
        self, budget: int
    ) -> tuple[list[Sequence], NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_]]:
        """Grow every running sequence the step visits to hold all its tokens, preempting the
        most recently admitted running sequences while one does not fit; return the victims,
        and for the visited survivors the first position to compute, the tokens to compute and
        whether those are all its pending tokens (so it samples).

        The visited sequences are the longest prefix of ``running`` whose pending tokens start
        within the budget (what :meth:`schedule` then schedules: each its pending tokens, cut to
        the budget left). One ``store.grow_or_preempt`` over the whole running list (the store's
        live sequences, in the order added) decides exactly what growing them one at a time,
        preempting from the tail, would: a victim frees its blocks and goes back to the front
        of the waiting queue, its K/V forgotten.
        """
        size = len(self.running)
        lengths, starts = self._rows[:, _LENGTH], self._rows[:, _COMPUTED]
        pending = lengths - starts
        before = np.cumsum(pending) - pending  # tokens scheduled ahead of each, uncut
        visited = int(np.searchsorted(before, budget))  # before is strictly increasing
        counts = np.minimum(pending[:visited], budget - before[:visited])
        missing = lengths[:visited] - np.asarray(self.store.token_counts_of(None))[:visited]
        samples = counts == pending[:visited]
        if not missing.any():
            return [], starts[:visited], counts, samples
        if visited == size and missing.min() == missing.max():
            new_tokens: int | list[int] = int(missing[0])  # a step of decodes: one count
        else:
            new_tokens = [*missing.tolist(), *[0] * (size - visited)]
        preempted: list[Sequence] = []
        for victim_id in self.store.grow_or_preempt(None, new_tokens):
            victim = self.running.pop()
            assert victim.seq_id == victim_id  # running is the store's live order
            victim.status, victim.num_computed = SeqStatus.WAITING, 0
            self.waiting.appendleft(victim)
            preempted.append(victim)
        self._rows = self._rows[: len(self.running)]
        kept = min(visited, len(self.running))  # victims come from the tail
        return preempted, starts[:kept], counts[:kept], samples[:kept]

    def _admit(self, seq: Sequence) -> int | None:
        """Give ``seq`` its prompt's blocks if its samples fit ``max_num_seqs`` and the blocks
        leave the watermark free (waived with nothing running); return its cached tokens, or
        None (nothing changed). The store plans the prompt once; without a prefix cache the
        prompt takes exactly ``blocks_needed(len(tokens))`` blocks, so a prompt that cannot
        leave the headroom is refused here without asking the store (a waiting request is
        retried every step)."""
        if self.num_running_seqs + seq.num_samples > self.config.max_num_seqs:
            return None
        store = self.store
        headroom = self.config.watermark_blocks if self.running else 0
        if not store.prefix_caching and (
            blocks_needed(len(seq.tokens), store.block_size) > store.num_free_blocks - headroom
        ):
            return None
        return self.store.admit(seq.seq_id, seq.tokens, headroom, seq.cache_salt)

    def _child(self, parent: Sequence, computed: int, index: int, token: int) -> Sequence:
        """Sample ``index`` of ``parent``'s request: ``parent``'s tokens plus ``token``, with
        the K/V of ``parent``'s first ``computed`` tokens (shared blocks)."""
        return Sequence(
            self._new_seq_id(), parent.request_id, [*parent.tokens, token], parent.prompt_len,
            parent.max_new_tokens, parent.eos_token_id, sample_index=index,
            num_computed=computed, cache_salt=parent.cache_salt,
        )  # fmt: skip
