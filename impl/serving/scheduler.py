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
"""

from __future__ import annotations

import enum
from collections import abc, deque
from dataclasses import dataclass, field

from pagedkv.impl.serving.block_store import BlockStore
from pagedkv.spec.block_manager import blocks_needed, check_int
from pagedkv.spec.checks import check_str, check_tokens


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

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        check_int("watermark_blocks", self.watermark_blocks, 0)
        if self.sliding_window is not None:
            check_int("sliding_window", self.sliding_window, 1)


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


def _done_with(seq: Sequence, token: int) -> bool:
    """Whether ``seq`` is done once ``token`` is appended to it (``Sequence.done``'s rule)."""
    output = len(seq.tokens) + 1 - seq.prompt_len
    return output >= seq.max_new_tokens or token == seq.eos_token_id


@dataclass(frozen=True)
class ScheduledSeq:
    """``num_tokens`` tokens of ``seq`` to compute this step, from position ``start``."""

    seq: Sequence
    start: int
    num_tokens: int
    cached_tokens: int = 0  # prefix-cache hits when admitted this step

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this step computes the sequence's last known token, so its logits give the
        next one (false for a prompt chunk short of the end)."""
        return self.end == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: the batch, in order (running sequences first, then new admissions),
    the sequences preempted while making it (already back in the waiting queue, in the order
    they were preempted), and those admitted (the batch's last ``len(admitted)`` entries)."""

    scheduled: list[ScheduledSeq]
    preempted: list[Sequence]
    admitted: list[Sequence]

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_tokens for item in self.scheduled)

    @property
    def prefix_hit_tokens(self) -> int:
        return sum(item.cached_tokens for item in self.scheduled)


@dataclass
class Scheduler:
    """The continuous-batching policy over ``store`` (see the module docstring)."""

    store: BlockStore
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    waiting: deque[Sequence] = field(default_factory=deque, init=False)
    running: list[Sequence] = field(default_factory=list, init=False)
    _next_seq_id: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.store.max_seqs < self.config.max_num_seqs:
            raise ValueError(
                f"the store has {self.store.max_seqs} rows for max_num_seqs="
                f"{self.config.max_num_seqs}"
            )

    @property
    def num_running_seqs(self) -> int:
        """Running sequences, counting every sample an unforked request will fork into."""
        return sum(seq.num_samples for seq in self.running)

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
        check_int("max_new_tokens", max_new_tokens, 1)
        check_int("n", n, 1)
        if eos_token_id is not None:
            check_int("eos_token_id", eos_token_id, 0)
        cache_salt = check_cache_salt(cache_salt)
        if not check_tokens(prompt):
            raise ValueError("the prompt must hold at least one token")
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

        Every table in the plan holds its sequence's tokens up to ``end``, and with a sliding
        window none holds a block outside the window of its first token to compute. At most
        ``max_num_batched_tokens`` tokens are scheduled, and at most ``max_num_seqs`` sequences
        run.
        """
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        admitted: list[Sequence] = []
        window = self.config.sliding_window
        if window is not None and self.running:  # before growing: the freed blocks can serve it
            positions = [seq.num_computed for seq in self.running]  # the store's live order
            self.store.release_outside_window(None, window, positions)
        preempted = self._grow_or_preempt(budget)
        for seq in self.running:  # the visited sequences that were not preempted
            if budget <= 0:
                break
            scheduled.append(ScheduledSeq(seq, seq.num_computed, min(seq.num_pending, budget)))
            budget -= scheduled[-1].num_tokens
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
            if window is not None and cached:  # hits before the first computed token's window
                self.store.release_outside_window([seq.seq_id], window, cached)
            admitted.append(seq)
            scheduled.append(ScheduledSeq(seq, cached, min(seq.num_pending, budget), cached))
            budget -= scheduled[-1].num_tokens
        return SchedulerOutput(scheduled, preempted, admitted)

    def update(
        self, output: SchedulerOutput, sampled: abc.Mapping[int, abc.Sequence[int]]
    ) -> tuple[list[Sequence], list[Sequence]]:
        """Record that ``output``'s tokens were computed, and the tokens sampled from them.

        ``sampled[seq_id]`` holds, for every scheduled sequence whose step ``samples``, one
        token per sample still to fork (``seq.num_samples``; 1 once forked). Full blocks are
        registered with the prefix cache; an unforked sequence forks; a sequence whose output
        is complete finishes and frees its blocks at once. Returns ``(forked, finished)``: the
        new sequences, and the sequences that finished, in batch order. ``KeyError``,
        ``TypeError`` or ``ValueError`` (changing nothing) for a missing entry, a wrong number of
        tokens, or a token that is not a non-negative int.

        Transactional: if a store call raises, the forks made are undone and the scheduler is
        as it was (only idempotent prefix-cache registrations of written K/V remain), so the
        same ``update`` can be retried.
        """
        draws: list[tuple[ScheduledSeq, abc.Sequence[int]]] = []  # the sampling items
        for item in output.scheduled:  # check everything before changing anything
            seq = item.seq
            if item.start + item.num_tokens == len(seq.tokens):  # item.samples
                tokens = sampled[seq.seq_id]
                if not isinstance(tokens, (list, tuple)) or len(tokens) != seq.num_samples:
                    check_tokens(tokens)  # the TypeError first
                    raise ValueError(
                        f"sequence {seq.seq_id} needs {seq.num_samples} sampled tokens, "
                        f"got {len(tokens)}"
                    )
                draws.append((item, tokens))
        check_tokens([token for _, tokens in draws for token in tokens])  # in one pass
        bs = self.store.block_size
        for item in output.scheduled:  # idempotent: a retried update registers nothing twice
            end = item.start + item.num_tokens
            if end // bs > item.start // bs:  # filled a block: its K/V is written
                seq = item.seq
                self.store.cache_blocks(
                    seq.seq_id,
                    seq.tokens if end == len(seq.tokens) else seq.tokens[:end],
                    seq.cache_salt,
                )
        # The store calls that can fail come first, each atomic, and are undone on failure by
        # a store call that cannot fail (``undo_fork``: no check, no block taken), so a second
        # fault cannot leave a child in the store; the scheduler's own state changes only
        # after all of them succeeded.
        first_id = self._next_seq_id
        children: list[Sequence] = []
        finishing: list[Sequence] = []
        finished: list[Sequence] = []  # in batch order: children born done, then the parent
        try:
            for item, tokens in draws:
                seq = item.seq
                for index, token in enumerate(tokens[1:], start=1):
                    child = self._child(seq, item.end, index, token)
                    if child.done:  # a child that is already done holds no blocks
                        finished.append(child)
                    else:
                        self.store.fork(seq.seq_id, child.seq_id)
                    children.append(child)
                if _done_with(seq, tokens[0]):
                    finishing.append(seq)
                    finished.append(seq)
            if finishing:
                self.store.remove([seq.seq_id for seq in finishing])
        except BaseException:
            forks = [child.seq_id for child in children if not child.done]
            if forks:
                self.store.undo_fork(forks)
            self._next_seq_id = first_id
            raise
        for item in output.scheduled:
            item.seq.num_computed = item.start + item.num_tokens
        for item, tokens in draws:
            item.seq.num_samples = 1
            item.seq.tokens.append(tokens[0])
        for child in children:
            child.status = SeqStatus.FINISHED if child.done else SeqStatus.RUNNING
            if not child.done:
                self.running.append(child)
        if finishing:
            done = set(map(id, finishing))
            self.running = [seq for seq in self.running if id(seq) not in done]
            for seq in finishing:
                seq.status = SeqStatus.FINISHED
        return children, finished

    # ----------------------------------------------------------------- internals

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _grow_or_preempt(self, budget: int) -> list[Sequence]:
        """Grow every running sequence the step visits to hold all its tokens, preempting the
        most recently admitted running sequences while one does not fit; return the victims.

        The visited sequences are the longest prefix of ``running`` whose pending tokens start
        within the budget (what :meth:`schedule` then schedules). One ``store.grow_or_preempt``
        over the whole running list (the store's live sequences, in the order added) decides
        exactly what growing them one at a time, preempting from the tail, would: a victim
        frees its blocks and goes back to the front of the waiting queue, its K/V forgotten.
        """
        counts = self.store.token_counts_of(None)
        missing = [0] * len(self.running)
        for index, (seq, count) in enumerate(zip(self.running, counts, strict=True)):
            if budget <= 0:
                break
            missing[index] = seq.num_tokens - count
            budget -= min(seq.num_pending, budget)
        if not any(missing):
            return []
        preempted: list[Sequence] = []
        for victim_id in self.store.grow_or_preempt(None, missing):
            victim = self.running.pop()
            assert victim.seq_id == victim_id  # running is the store's live order
            victim.status, victim.num_computed = SeqStatus.WAITING, 0
            self.waiting.appendleft(victim)
            preempted.append(victim)
        return preempted

    def _admit(self, seq: Sequence) -> int | None:
        """Give ``seq`` its prompt's blocks if its samples fit ``max_num_seqs`` and the blocks
        leave the watermark free (waived with nothing running); return its cached tokens, or
        None (nothing changed). The store plans the prompt once."""
        if self.num_running_seqs + seq.num_samples > self.config.max_num_seqs:
            return None
        headroom = self.config.watermark_blocks if self.running else 0
        return self.store.admit(seq.seq_id, seq.tokens, headroom, seq.cache_salt)

    def _child(self, parent: Sequence, computed: int, index: int, token: int) -> Sequence:
        """Sample ``index`` of ``parent``'s request: ``parent``'s tokens plus ``token``, with
        the K/V of ``parent``'s first ``computed`` tokens (shared blocks)."""
        return Sequence(
            self._new_seq_id(), parent.request_id, [*parent.tokens, token], parent.prompt_len,
            parent.max_new_tokens, parent.eos_token_id, sample_index=index,
            num_computed=computed, cache_salt=parent.cache_salt,
        )  # fmt: skip
