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
scheduled sequence; ``update`` takes the sampled tokens flat. Each fact of a sequence has one
owner (:mod:`pagedkv.impl.serving.sequence`); a step reads the step columns at the store's rows
of the running list (its live order, ``store.resolve(None)``), and no per-sequence object.
Speculation changes a sequence only through :meth:`Scheduler.add_drafts`, ``keep_drafts`` and
``undo_drafts``: tokens and table at once.
"""

from __future__ import annotations

from collections import abc, deque
from dataclasses import dataclass, field, replace
from itertools import compress
from typing import cast

import numpy as np
from numpy.typing import NDArray

from pagedkv.impl.serving import plan as plans
from pagedkv.impl.serving import sequence
from pagedkv.impl.serving.block_store import BlockStore, DraftStore
from pagedkv.impl.serving.plan import Drafted, SchedulerConfig, SchedulerOutput
from pagedkv.impl.serving.sequence import RequestTooLargeError, SeqStatus, Sequence
from pagedkv.spec.block_manager import blocks_needed

__all__ = ["Drafted", "RequestTooLargeError", "Scheduler", "SchedulerConfig", "SchedulerOutput",
           "SeqStatus", "Sequence"]  # fmt: skip  # the callers' names, defined with the sequence


_consume = deque(maxlen=0).extend  # runs an iterator to its end, keeping nothing


@dataclass
class Scheduler:
    """The continuous-batching policy over ``store`` (see the module docstring)."""

    store: BlockStore
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    waiting: deque[Sequence] = field(default_factory=deque, init=False)
    running: list[Sequence] = field(default_factory=list, init=False)  # the store's live order
    _next_seq_id: int = field(default=0, init=False)
    _columns: sequence.StepColumns = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.store.max_seqs < self.config.max_num_seqs:
            raise ValueError(
                f"the store has {self.store.max_seqs} rows for max_num_seqs="
                f"{self.config.max_num_seqs}"
            )
        self._columns = sequence.StepColumns(self.store)

    @property
    def num_running_seqs(self) -> int:
        """Running sequences, counting every sample an unforked request will fork into."""
        rows = self.store.resolve(None).rows
        return int(self._columns.samples(rows, self._lengths(rows)[1]).sum())

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

        Raises ``TypeError``/``ValueError`` for facts that break the rules of
        :func:`~pagedkv.impl.serving.sequence.check_request`, and :class:`RequestTooLargeError`
        for a request that can never run (:func:`~pagedkv.impl.serving.sequence.check_fits`).
        """
        prompt, max_new_tokens, n, eos_token_id, cache_salt = sequence.check_request(
            prompt, max_new_tokens, n, eos_token_id, cache_salt
        )
        sequence.check_fits(
            request_id, len(prompt), max_new_tokens, n, self.store,
            max_num_seqs=self.config.max_num_seqs, max_model_len=self.config.max_model_len,
        )  # fmt: skip
        seq = Sequence(
            self._new_seq_id(), request_id, prompt, len(prompt), max_new_tokens,
            eos_token_id, n, cache_salt=cache_salt, columns=self._columns,
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
        rows = self.store.resolve(None).rows  # the running sequences' rows, in running order
        window = self.config.sliding_window
        if window is not None and self.running:  # before growing: the freed blocks can serve it
            self.store.release_outside_window(None, window, self._columns.computed[rows])
        held, lengths = self._lengths(rows)
        preempted, starts, counts, samples = self._grow_or_preempt(rows, held, lengths)
        budget = self.config.max_num_batched_tokens - int(counts.sum())
        admitted: list[Sequence] = []
        planned: list[tuple[int, int, bool]] = []
        # A step that preempted admits nothing: its victims would otherwise be readmitted at
        # once (prefix-cache hits on their own freed blocks make them cheap to admit).
        if not preempted and budget > 0 and self.waiting:
            seats = self.config.max_num_seqs - int(self._columns.samples(rows, lengths).sum())
            admitted, planned = self._admit_waiting(budget, seats, rows)
        visited = self.running[: len(starts)]  # the visited sequences that were not preempted
        ids = self._columns.seq_id[rows[: len(visited)]]
        return plans.step_plan(visited, ids, starts, counts, samples, preempted, admitted, planned)

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
        same ``update`` can be retried. Steps: :meth:`_sampled_tokens`,
        :meth:`_cache_filled_blocks`, :meth:`_fork_and_finish`, :meth:`_commit`.
        """
        rows, sample_rows, per_seq, tokens = self._sampled_tokens(output, sampled)
        self._cache_filled_blocks(output, all_ends := output.ends)
        ends = all_ends[sample_rows]  # the sampling sequences'
        done = self._columns.done(rows[sample_rows], ends, tokens.first_tokens)
        sampling = output.seqs if len(sample_rows) == len(output.seqs) else output.sampling
        outcome = self._fork_and_finish(sampling, sample_rows, ends, per_seq, tokens, done)
        self._commit(rows, all_ends, sampling, tokens.first_tokens.tolist(), outcome)
        return outcome.children, outcome.finished

    # ----------------------------------------------------------------- speculative decoding

    def add_drafts(
        self, plan: SchedulerOutput, drafts: abc.Mapping[int, list[int]]
    ) -> tuple[SchedulerOutput, Drafted]:
        """Append ``drafts[seq_id]`` to the tokens of each sequence of ``plan`` it names (one
        whose row samples) and grow its table by them (``store.grow``); one the pool cannot
        grow now gets none. Returns the plan that also computes the drafts, and each drafted
        sequence's row and end before them, by id (:meth:`undo_drafts`). All-or-nothing."""
        ends = plan.ends
        rows = {seq_id: row for row, seq_id in enumerate(plan.seq_ids.tolist()) if seq_id in drafts}
        failed = set(
            cast(DraftStore, self.store).grow(list(drafts), list(map(len, drafts.values())))
        )
        before = {s: (row, int(ends[row])) for s, row in rows.items() if s not in failed}
        extra = np.zeros(len(plan.seqs), np.int64)
        for seq_id, (row, _) in before.items():
            extra[row] = len(drafts[seq_id])
        try:
            drafted = replace(plan, num_tokens=plan.num_tokens + extra)
        except BaseException:
            self.undo_drafts(plan, before)  # the tokens hold no draft yet
            raise
        for seq_id, (row, _) in before.items():  # nothing after this can fail
            plan.seqs[row].tokens.extend(drafts[seq_id])
        return drafted, before

    def keep_drafts(self, plan: SchedulerOutput, kept: Drafted) -> SchedulerOutput:
        """Cut each sequence ``kept`` names (by id: its row in ``plan``, the end to keep) to that
        end, tokens and table (``store.truncate``); return the plan computing up to there."""
        ends = plan.ends
        cast(DraftStore, self.store).truncate(list(kept), [end for _, end in kept.values()])
        for row, end in kept.values():
            del plan.seqs[row].tokens[end:]
            ends[row] = end
        return replace(plan, num_tokens=ends - plan.starts)

    def undo_drafts(self, plan: SchedulerOutput, before: Drafted) -> None:
        """Give back every draft :meth:`add_drafts` gave (``before``), tokens and slots. Cannot
        fail: ``store.undo_growth`` checks nothing and takes no block; nothing else is called."""
        cast(DraftStore, self.store).undo_growth(list(before), [e for _, e in before.values()])
        for row, end in before.values():
            del plan.seqs[row].tokens[end:]

    # ----------------------------------------------------------------- internals

    def _new_seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id - 1

    def _lengths(self, rows: NDArray[np.intp]) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """Each running sequence's (store ``rows``) tokens in its table and its token count:
        the table holds them up to the last one scheduled; only one sampled since is beyond."""
        held = np.asarray(self.store.token_counts_of(None), dtype=np.int64)
        return held, np.maximum(held, self._columns.computed[rows] + 1)

    def _grow_or_preempt(
        self, rows: NDArray[np.intp], held: NDArray[np.int64], lengths: NDArray[np.int64]
    ) -> tuple[list[Sequence], NDArray[np.int64], NDArray[np.int64], NDArray[np.bool_]]:
        """Grow every running sequence (store ``rows``; ``lengths`` tokens, ``held`` in its
        table) the step visits to hold its tokens, preempting from the most recently admitted
        while one does not fit; return the victims, and for the visited survivors the first
        position to compute, the tokens to compute and whether those are all its pending tokens
        (so it samples).

        The visited sequences are the longest prefix of ``running`` whose pending tokens start
        within the budget (each its pending tokens, cut to the budget left). One
        ``store.grow_or_preempt`` over the store's live sequences decides exactly what growing
        them one at a time, preempting from the tail, would: a victim frees its blocks and goes
        back to the front of the waiting queue, its K/V forgotten."""
        budget, size = self.config.max_num_batched_tokens, len(self.running)
        starts = self._columns.computed[rows]
        pending = lengths - starts
        before = np.cumsum(pending) - pending  # tokens scheduled ahead of each, uncut
        visited = int(np.searchsorted(before, budget))  # before is strictly increasing
        counts = np.minimum(pending[:visited], budget - before[:visited])
        missing = lengths[:visited] - held[:visited]
        samples = counts == pending[:visited]
        if not missing.any():
            return [], starts[:visited], counts, samples
        if visited == size and missing.min() == missing.max():
            new_tokens: int | list[int] = int(missing[0])  # a step of decodes: one count
        else:
            new_tokens = [*missing.tolist(), *[0] * (size - visited)]
        survivors = size - len(self.store.grow_or_preempt(None, new_tokens))
        preempted = self.running[survivors:][::-1]  # the store removes from the tail
        del self.running[survivors:]
        for victim in preempted:
            victim.status = SeqStatus.WAITING  # its K/V forgotten: num_computed is 0
            self.waiting.appendleft(victim)
        kept = min(visited, survivors)
        return preempted, starts[:kept], counts[:kept], samples[:kept]

    def _admit_waiting(
        self, budget: int, seats: int, held: NDArray[np.intp]
    ) -> tuple[list[Sequence], list[tuple[int, int, bool]]]:
        """Admit waiting sequences in order while the ``budget`` of tokens, the ``seats`` left
        under ``max_num_seqs`` and the memory allow; ``held``: the store rows of the running
        sequences. Returns the admitted ones and for each its first position to compute (its
        prefix-cache hits), tokens to compute and whether it samples. A sequence's columns are
        written into every free row before the store admits it (it takes one) and it runs
        before any later store call, so a fault anywhere after an admission loses nothing."""
        window = self.config.sliding_window
        admitted: list[Sequence] = []
        planned: list[tuple[int, int, bool]] = []
        while budget > 0 and self.waiting:
            seq = self.waiting[0]
            cached = self._admit(seq, seats, held)
            if cached is None:
                break
            self.waiting.popleft()  # only once its blocks are held: a failed admit loses nothing
            self._columns.computed[self._free_rows(held)] = cached
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if window is not None and cached:  # hits before the first computed token's window
                self.store.release_outside_window([seq.seq_id], window, cached)
            admitted.append(seq)
            seats -= seq.num_samples
            count = min(len(seq.tokens) - cached, budget)
            budget -= count
            planned.append((cached, count, count == len(seq.tokens) - cached))
            held = np.append(held, self.store.row(seq.seq_id))
        return admitted, planned

    def _admit(self, seq: Sequence, seats: int, held: NDArray[np.intp]) -> int | None:
        """Give ``seq`` its prompt's blocks if its samples fit the ``seats`` left and the blocks
        leave the watermark free (waived with nothing running); return its cached tokens, or
        None (the store unchanged). Its request is first written into the columns of the rows
        not ``held``, which no step reads. Without a prefix cache a prompt takes exactly
        ``blocks_needed(len(tokens))`` blocks, so one that cannot leave the headroom is refused
        without asking the store, which plans the prompt once."""
        if seq.num_samples > seats:
            return None
        store = self.store
        headroom = self.config.watermark_blocks if self.running else 0
        if not store.prefix_caching and (
            blocks_needed(len(seq.tokens), store.block_size) > store.num_free_blocks - headroom
        ):
            return None
        self._columns.place(self._free_rows(held), seq)
        return self.store.admit(seq.seq_id, seq.tokens, headroom, seq.cache_salt)

    def _free_rows(self, held: NDArray[np.intp]) -> NDArray[np.bool_]:
        """Which rows of the step columns are not in ``held``."""
        free = np.ones(self._columns.computed.size, dtype=np.bool_)
        free[held] = False
        return free

    def _sampled_tokens(
        self, output: SchedulerOutput, sampled: object
    ) -> tuple[NDArray[np.intp], NDArray[np.intp], NDArray[np.int64], plans.Sampled]:
        """Check that ``output`` is the latest plan and ``sampled`` its tokens (``ValueError``
        or ``TypeError``, changing nothing). Returns the store rows of its sequences, its
        sampling rows, each sampling sequence's samples, and the tokens."""
        size = len(output.seqs)
        if size > len(self.running) or (size and output.seqs[-1] is not self.running[size - 1]):
            raise ValueError("update takes the output of the latest schedule()")
        rows = self.store.resolve(None).rows[:size]  # the plan's sequences lead the running
        sample_rows = np.flatnonzero(output.samples)
        per_seq = self._columns.samples(rows[sample_rows], output.ends[sample_rows])
        return rows, sample_rows, per_seq, plans.check_sampled(sampled, per_seq)

    def _cache_filled_blocks(self, output: SchedulerOutput, ends: NDArray[np.int64]) -> None:
        """Register with the prefix cache every block ``output`` (whose rows end at ``ends``)
        filled. Idempotent: a retried update registers nothing twice."""
        if not self.store.prefix_caching:
            return
        starts, bs = output.starts, self.store.block_size
        for i in np.flatnonzero(ends // bs > starts // bs).tolist():  # filled a block
            seq, end = output.seqs[i], int(ends[i])
            self.store.cache_blocks(
                seq.seq_id,
                seq.tokens if end == len(seq.tokens) else seq.tokens[:end],
                seq.cache_salt,
            )

    def _fork_and_finish(
        self,
        sampling: list[Sequence],
        sample_rows: NDArray[np.intp],
        ends: NDArray[np.int64],
        per_seq: NDArray[np.int64],
        sampled: plans.Sampled,
        done: NDArray[np.bool_],
    ) -> plans.UpdateOutcome:
        """The store calls of an update: fork each unforked sampling sequence's children (one
        per sample after its first, with its token of ``sampled``; a child born
        done holds no blocks) and remove the sequences that are ``done``. Each store call is
        atomic, and on failure the forks are undone by one that cannot fail (``undo_fork``: no
        check, no block taken), so a second fault cannot leave a child in the store."""
        first_id = self._next_seq_id
        outcome = plans.UpdateOutcome()
        forks: list[int] = []
        finishing: list[int] = []  # running positions
        try:
            for j in np.flatnonzero(done | (per_seq > 1)).tolist():
                seq, first, end = sampling[j], sampled.firsts[j], int(ends[j])
                for index in range(1, int(per_seq[j])):
                    child = self._child(seq, index, sampled.tokens[first + index])
                    outcome.children.append(child)
                    if child.done:  # a discarded object if the update fails
                        child.status = SeqStatus.FINISHED
                        outcome.finished.append(child)
                        continue
                    self.store.fork(seq.seq_id, child.seq_id)
                    forks.append(child.seq_id)
                    row = self.store.row(child.seq_id)
                    self._columns.place(row, child)  # a row a failed update frees again
                    outcome.placed.append((child, row, end))
                if done[j]:
                    finishing.append(int(sample_rows[j]))
                    outcome.finished.append(seq)
            if finishing:
                self.store.remove([self.running[i].seq_id for i in finishing])
        except BaseException:
            if forks:
                self.store.undo_fork(forks)
            self._next_seq_id = first_id
            raise
        outcome.finishing = finishing
        return outcome

    def _commit(
        self,
        rows: NDArray[np.intp],
        ends: NDArray[np.int64],
        sampling: list[Sequence],
        first_tokens: abc.Sequence[int],
        outcome: plans.UpdateOutcome,
    ) -> None:
        """The scheduler's own changes of an update, once every store call succeeded: each
        sampling sequence gets its first token, every row its computed tokens, the children
        run and the finished sequences leave. Calls no other module, so it cannot fail."""
        _consume(map(list.append, map(sequence.TOKENS, sampling), first_tokens))
        self._columns.computed[rows] = ends
        for child, row, computed in outcome.placed:
            self._columns.computed[row] = computed
            child.status = SeqStatus.RUNNING
            self.running.append(child)
        if outcome.finishing:
            for i in outcome.finishing:
                self.running[i].status = SeqStatus.FINISHED
            keep = np.ones(len(self.running), dtype=bool)
            keep[outcome.finishing] = False
            self.running = list(compress(self.running, keep.tolist()))

    def _child(self, parent: Sequence, index: int, token: int) -> Sequence:
        """Sample ``index`` of ``parent``'s request: ``parent``'s tokens plus ``token``."""
        return Sequence(
            self._new_seq_id(), parent.request_id, [*parent.tokens, token], parent.prompt_len,
            parent.max_new_tokens, parent.eos_token_id, parent.n, index,
            cache_salt=parent.cache_salt, columns=self._columns,
        )  # fmt: skip
