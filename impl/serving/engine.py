"""PagedAttentionEngine: continuous batching over a real paged KV cache.

K/V live only in the paged cache (``pagedkv.impl.serving.paged_kv``) and are read back through block
tables; there is no ``past_key_values``. One :meth:`PagedAttentionEngine.step` schedules
(``pagedkv.impl.serving.scheduler``), applies the copy-on-write pairs, computes the planned
tokens through the block tables (``PagedKVCache.step``, then the model), samples (verifying
drafts when speculative), and lets the scheduler commit; docs/design.md §10 follows the data
and the calls of one step, and its failure semantics.

The ``pagedkv`` command is ``pagedkv.impl.serving.cli``.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

import numpy as np
import torch
from tqdm import tqdm

from pagedkv.impl.blocks.page_tables import block_tables
from pagedkv.impl.blocks.prefix_cache import KVEvent, PrefixCacheStats
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving import speculative
from pagedkv.impl.serving.engine_args import (
    block_manager,
    check_kv_cache,
    check_options,
    check_prompt,
    check_speculation,
)
from pagedkv.impl.serving.metrics import StepMetrics, step_metrics
from pagedkv.impl.serving.model import CausalLM
from pagedkv.impl.serving.paged_kv import PagedKVCache
from pagedkv.impl.serving.sampling import sample_token, seeded_generators
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from pagedkv.impl.serving.speculative import DraftSource, accepted_drafts
from pagedkv.kernels import resolve_backend
from pagedkv.kernels.check_arguments import check_bool
from pagedkv.spec.block_manager import blocks_needed, check_int

_TOKENS = attrgetter("tokens")
Drawn = list[tuple[torch.Generator, torch.Tensor]]
"""Generators, each with its state before a draw: what a failed step puts back."""


@dataclass
class RequestOutput:
    """A request's samples, by sample index: tokens, and with ``keep_logits`` the logits each
    token was chosen from (``[len(tokens), vocab]``, on the CPU)."""

    request_id: int
    prompt: list[int]
    outputs: list[list[int]]
    logits: list[torch.Tensor] | None = None


@dataclass
class _Request:
    prompt: list[int]
    n: int
    temperature: float
    generators: list[torch.Generator]  # one per sample
    seqs: dict[int, Sequence] = field(default_factory=dict)  # sample index -> sequence
    num_finished: int = 0


@dataclass(frozen=True)
class StepOutput:
    """A step's metrics and the requests it finished."""

    metrics: StepMetrics
    finished: list[RequestOutput]


class PagedAttentionEngine:
    """Serve a :class:`pagedkv.impl.serving.model.CausalLM` from a pool of ``total_blocks`` KV
    blocks.

    ``max_num_seqs``, ``max_num_batched_tokens`` and ``watermark_blocks`` configure the scheduler
    (``pagedkv.impl.serving.scheduler.SchedulerConfig``). ``enable_prefix_caching`` chooses the
    prefix-caching block manager; the engine's code is the same either way. With it,
    ``enable_kv_events`` records KV events for :meth:`take_kv_events`. ``backend`` is the
    kernels' backend (``None``: ``PAGEDKV_BACKEND`` or auto). With ``keep_logits`` each output keeps
    the logits of every step, for comparison with an oracle. ``max_model_len`` is the longest
    sequence (prompt plus output) served: a request whose prompt plus ``max_new_tokens``
    exceeds it is refused (``RequestTooLargeError``, as vLLM does), and each block table is
    ``ceil(max_model_len / block_size)`` blocks wide, so per-step costs follow the model, not
    the pool. ``kv_cache_dtype``, ``kv_scales``: the K/V storage (``engine_args.check_kv_cache``).

    With ``draft_source`` and ``num_speculative_tokens=k`` (both or neither) the engine decodes
    speculatively (``pagedkv.impl.serving.speculative``): each step, every sequence whose step
    samples also computes up to ``k`` drafts, keeps those greedy decoding agrees with, and gives
    the rest back (``store.truncate``). Greedy only: a request with a temperature above 0 is
    refused. ``num_draft_tokens`` and ``num_accepted_tokens`` count the drafts computed and kept.
    """

    def __init__(
        self,
        model: CausalLM,
        total_blocks: int,
        block_size: int,
        *,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 512,
        watermark_blocks: int = 0,
        max_model_len: int = 2048,
        enable_prefix_caching: bool = False,
        enable_kv_events: bool = False,
        backend: str | None = None,
        keep_logits: bool = False,
        seed: int = 0,
        draft_source: DraftSource | None = None,
        num_speculative_tokens: int = 0,
        kv_cache_dtype: str = "auto",
        kv_scales: tuple[float, float] | str | None = None,
    ) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
        check_speculation(draft_source, num_speculative_tokens)
        check_bool("keep_logits", keep_logits)
        check_int("seed", seed, 0)
        check_int("max_model_len", max_model_len, 1)
        resolve_backend(backend, model.device)  # an unknown or unusable backend fails here
        cache_dtype, scales = check_kv_cache(kv_cache_dtype, kv_scales, model.dtype)
        manager = block_manager(total_blocks, block_size, enable_prefix_caching, enable_kv_events)
        self.model = model
        self.store = BlockTableStore(
            manager, max_num_seqs, blocks_needed(max_model_len, block_size)
        )
        config = SchedulerConfig(
            max_num_seqs, max_num_batched_tokens, watermark_blocks, model.config.sliding_window,
            max_model_len,
        )  # fmt: skip
        self.scheduler = Scheduler(self.store, config)
        self.kv = PagedKVCache(
            model.config, total_blocks, block_size,
            dtype=model.dtype, device=model.device, backend=backend, cache_dtype=cache_dtype,
            kv_scales=scales,
        )  # fmt: skip
        self.keep_logits = keep_logits
        self.seed = seed
        self.metrics: list[StepMetrics] = []
        self._requests: dict[int, _Request] = {}
        self._logits: dict[int, list[torch.Tensor]] = {}  # seq id -> rows, with keep_logits
        self._unreturned: list[RequestOutput] = []  # finished, not yet returned by a step
        self._next_request_id = 0
        self.draft_source = draft_source
        self.num_speculative_tokens = num_speculative_tokens
        self.num_draft_tokens = 0  # drafts computed by speculative steps
        self.num_accepted_tokens = 0  # of those, kept (the tokens greedy decoding gives)

    def add_request(
        self,
        prompt: abc.Sequence[int],
        max_new_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        eos_token_id: int | None = None,
        seed: int | None = None,
        cache_salt: str | None = None,
    ) -> int:
        """Queue a request; return its id. ``n`` samples share the prompt's blocks.

        With prefix caching, ``cache_salt`` (a str) keeps the request's cached blocks apart:
        it hits only blocks computed for requests with an equal salt (one tenant's), and its
        own blocks are cached under it.

        ``temperature == 0`` is greedy; otherwise sample ``i`` draws with its own generator
        seeded from ``seed`` (default: the engine's seed and the request id) and ``i``, so its
        tokens do not depend on batching or preemption. Raises what
        ``Scheduler.add_request`` raises (``RequestTooLargeError`` for a request that can
        never fit; ``TypeError``/``ValueError`` for a prompt that is not a list or tuple of
        ints, or a count that is not an int >= 1), ``ValueError`` for a token or
        ``eos_token_id`` outside the vocabulary, and what ``sampling.check_temperature`` raises
        for a temperature outside its rule. All-or-nothing: nothing is queued when it raises.
        """
        vocab, k = self.model.config.vocab_size, self.num_speculative_tokens
        prompt = check_prompt(prompt, vocab)
        temperature, seed = check_options(temperature, eos_token_id, seed, vocab, k)
        request_id = self._next_request_id
        seq = self.scheduler.add_request(
            request_id, prompt, max_new_tokens, n=n, eos_token_id=eos_token_id,
            cache_salt=cache_salt,
        )  # fmt: skip
        self._next_request_id += 1
        n = seq.num_samples  # the checked values, plain ints
        generators = seeded_generators((self.seed, request_id) if seed is None else (seed,), n)
        self._requests[request_id] = _Request(prompt, n, temperature, generators, {0: seq})
        self._logits[seq.seq_id] = []
        return request_id

    def has_unfinished_requests(self) -> bool:
        """Whether a request is queued, running, or finished but not yet returned by a step
        (its step's metrics failed): ``step`` until this is False, and every request comes
        back."""
        return self.scheduler.has_unfinished() or bool(self._unreturned)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (after a weight update, say); return whether it did.
        Refused (False, nothing changes) while any request holds blocks: their blocks would be
        cached as they fill. ``BlockTableStore.reset_prefix_cache``."""
        return self.store.reset_prefix_cache()

    def take_kv_events(self) -> list[KVEvent]:
        """The KV events (blocks stored into and removed from the prefix cache, resets) since
        the last call, oldest first; empty unless ``enable_kv_events``."""
        return self.store.take_kv_events()

    def take_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The prefix cache's counters since the last call (they start again at zero), or None
        without prefix caching."""
        return self.store.take_prefix_cache_stats()

    @property
    def kv_cache_usage(self) -> float:
        """The fraction of the KV pool not free now: held by requests, or (after a step that
        failed at its copy) waiting for that copy."""
        return self.store.usage

    @torch.no_grad()
    def step(self) -> StepOutput:
        """Run one scheduler step: schedule, copy-on-write, write K/V, attend, sample, free.

        Transactional (docs/design.md, "Failure semantics"): if anything it calls raises, the
        step raises and the engine is left able to run the next step correctly: no request is
        lost or duplicated, no block leaks, no copy-on-write pair is dropped, no sampler draws
        twice. A request that finished in a step whose metrics then failed is returned by the
        next step.
        """
        plan = self.scheduler.schedule()
        drafts: dict[int, list[int]] = {}
        before: speculative.Before = {}
        drawn: Drawn = []
        if self.draft_source is not None:
            budget = self.scheduler.config.max_num_batched_tokens - plan.num_batched_tokens
            plan, drafts, before = speculative.draft(
                plan, self.scheduler, self.draft_source, self.num_speculative_tokens, budget,
                self.model.config.vocab_size,
            )  # fmt: skip
        try:
            pairs = self.store.pending_copy_pairs()
            if len(pairs):
                self.kv.copy_blocks(torch.from_numpy(pairs))
            # Forgotten only once copied into every layer. A retry copies them all again: exact,
            # as no pending pair writes a pending source (docs/design.md §5, "Copy-on-write and
            # retries").
            self.store.pop_copy_pairs()
            sampled, rows = self._run(plan, drafts, drawn) if plan.seqs else ([], {})
            verified = speculative.roll_back(plan, drafts, rows, self.scheduler) if drafts else plan
            forked, finished = self.scheduler.update(verified, sampled)
        except BaseException:
            for generator, state in reversed(drawn):  # no sample draws twice
                generator.set_state(state)
            if drafts:
                speculative.undraft(plan, before, self.scheduler)
            raise
        if self.keep_logits:
            for seq_id, row in rows.items():
                self._logits[seq_id].extend(row)
        self.num_draft_tokens += sum(map(len, drafts.values()))
        self.num_accepted_tokens += sum(len(rows[seq_id]) - 1 for seq_id in drafts)
        self._unreturned.extend(self._record(forked, finished))
        metrics = step_metrics(len(self.metrics), self.scheduler, plan, len(finished))
        self.metrics.append(metrics)
        done, self._unreturned = self._unreturned, []
        return StepOutput(metrics, done)

    def generate(
        self,
        prompts: abc.Sequence[abc.Sequence[int]],
        max_new_tokens: int,
        *,
        n: int = 1,
        temperature: float = 0.0,
        eos_token_id: int | None = None,
        progress: bool = False,
        on_step: abc.Callable[[StepMetrics], None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt, in order; return each request's samples.

        Runs the engine until it is idle, so it must start idle (``RuntimeError`` otherwise: mix
        requests with ``add_request`` and ``step`` instead). With ``progress`` a tqdm bar counts
        finished requests and shows the latest metrics; ``on_step`` sees every step's metrics.
        All-or-nothing: every prompt passes every check of :meth:`add_request` (run against a
        scratch scheduler over the same store, which changes nothing) before any is queued, so
        a bad prompt anywhere raises what ``add_request`` would and leaves the engine idle.
        """
        if self.has_unfinished_requests():
            raise RuntimeError("generate() needs an idle engine; drive it with step() instead")
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a list of prompts, got {type(prompts).__name__}")
        check_bool("progress", progress)
        if on_step is not None and not callable(on_step):
            raise TypeError(f"on_step must be callable or None, got {type(on_step).__name__}")
        vocab = self.model.config.vocab_size
        check_options(temperature, eos_token_id, None, vocab, self.num_speculative_tokens)
        check_int("max_new_tokens", max_new_tokens, 1)  # checked even with no prompts
        check_int("n", n, 1)
        scratch = Scheduler(self.store, self.scheduler.config)  # its queue is thrown away
        for index, prompt in enumerate(prompts):
            check_prompt(prompt, vocab)
            scratch.add_request(
                self._next_request_id + index, prompt, max_new_tokens, n=n,
                eos_token_id=eos_token_id,
            )  # fmt: skip
        ids = [
            self.add_request(
                prompt, max_new_tokens, n=n, temperature=temperature, eos_token_id=eos_token_id
            )
            for prompt in prompts
        ]
        results: dict[int, RequestOutput] = {}
        with tqdm(total=len(ids), unit="req", disable=not progress) as bar:
            while self.has_unfinished_requests():
                out = self.step()
                for result in out.finished:
                    results[result.request_id] = result
                if on_step is not None:
                    on_step(out.metrics)
                bar.update(len(out.finished))
                bar.set_postfix_str(
                    f"run={out.metrics.num_running} free={out.metrics.free_blocks} "
                    f"util={out.metrics.kv_utilization:.0%}",
                    refresh=False,
                )
        return [results[request_id] for request_id in ids]

    # ----------------------------------------------------------------- internals

    def _run(
        self, plan: SchedulerOutput, drafts: abc.Mapping[int, list[int]], drawn: Drawn
    ) -> tuple[list[int], dict[int, torch.Tensor]]:
        """Compute the planned tokens through the paged cache; sample where a step completes a
        sequence's known tokens. Returns the sampled tokens, flat in ``plan.sampling`` order as
        ``Scheduler.update`` takes them, and the logits rows they came from (``[tokens,
        vocab]``) by sequence id: every sampling sequence's with ``keep_logits``, else only the
        drafted ones'. A sequence with ``drafts`` (its last tokens in the plan) gets the greedy
        token after its accepted drafts, and the rows of those drafts and of that token.
        Changes nothing outside the K/V cache, whose slots a retry rewrites, and the samplers'
        generators: each state is appended to ``drawn`` before its draw, for the step to put
        back if anything fails before it commits."""
        logits, lengths = self._compute_logits(plan, self._forward(plan), drafts)
        # Every row's greedy token at once: what sample_token gives at temperature 0 (numpy's
        # argmax, like torch's, takes the first of equal maxima and a NaN as the maximum).
        argmax = logits.numpy().argmax(axis=-1).tolist()
        sampled: list[int] = []
        rows: dict[int, torch.Tensor] = {}
        offset = 0
        for seq, n in zip(plan.sampling, lengths, strict=True):
            guess = drafts.get(seq.seq_id) if drafts else None
            if guess:
                greedy, own = argmax[offset : offset + n], logits[offset : offset + n]
                rows[seq.seq_id] = self._verify(seq, guess, greedy, own, sampled)
            else:
                self._draw(seq, argmax[offset], logits[offset], sampled, drawn)
                if self.keep_logits:
                    rows[seq.seq_id] = logits[offset : offset + n]
            offset += n
        return sampled, rows

    def _forward(self, plan: SchedulerOutput) -> torch.Tensor:
        """The final hidden states of the plan's tokens, flat; their K/V written to the cache."""
        starts, counts, ends = plan.starts, plan.num_tokens, plan.ends
        batch = self.store.batch(plan.seq_ids)
        step = self.kv.step(torch.from_numpy(block_tables(self.store, batch)), counts, ends)
        input_ids = torch.tensor(
            list(chain.from_iterable(
                tokens[start:end]
                for tokens, start, end in zip(
                    map(_TOKENS, plan.seqs), starts.tolist(), ends.tolist(), strict=True
                )
            )),
            dtype=torch.int64, device=self.kv.device,
        )  # fmt: skip
        return self.model(input_ids, step.positions, step)

    def _compute_logits(
        self, plan: SchedulerOutput, hidden: torch.Tensor, drafts: abc.Mapping[int, list[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """Float CPU logits of each sampling sequence's last ``1 + k`` positions (``k`` its
        drafts), in ``plan.sampling`` order, and each one's count of rows."""
        sampling = plan.sampling
        last = np.cumsum(plan.num_tokens)[plan.samples]  # one past each row's last flat token
        if not drafts:
            index = torch.from_numpy(last - 1)
            lengths = [1] * len(sampling)
        else:
            lengths = [1 + len(drafts.get(seq.seq_id, ())) for seq in sampling]
            spans = zip(last.tolist(), lengths, strict=True)
            index = torch.tensor([p for end, n in spans for p in range(end - n, end)])
        logits = self.model.compute_logits(hidden[index.to(self.kv.device)]).float().cpu()
        return logits, lengths

    @staticmethod
    def _verify(
        seq: Sequence, guess: list[int], greedy: list[int], logits: torch.Tensor, sampled: list[int]
    ) -> torch.Tensor:
        """Keep the drafts ``guess`` greedy decoding agrees with (``greedy``: the argmax of each
        of ``seq``'s ``logits`` rows), append the token after them to ``sampled``, and return
        the rows of the kept drafts and of that token."""
        kept = accepted_drafts(guess, greedy, seq.eos_token_id)
        sampled.append(greedy[kept])
        return logits[: kept + 1]

    def _draw(
        self, seq: Sequence, greedy: int, logits: torch.Tensor, sampled: list[int], drawn: Drawn
    ) -> None:
        """Append ``seq``'s samples from its ``logits`` row to ``sampled``: ``greedy`` (its
        argmax) for each at temperature 0, else a draw from each sample's generator, whose
        state is appended to ``drawn`` before the draw."""
        request = self._requests[seq.request_id]
        if not request.temperature:
            sampled.extend([greedy] * seq.num_samples)
            return
        for j in range(seq.num_samples):
            generator = request.generators[seq.sample_index + j]
            drawn.append((generator, generator.get_state()))
            sampled.append(sample_token(logits, request.temperature, generator))

    def _record(self, forked: list[Sequence], finished: list[Sequence]) -> list[RequestOutput]:
        """Track forked samples; return the requests whose every sample has finished. Runs
        after the scheduler committed the step, so it calls no other module: nothing in it
        can fail (docs/design.md §10, "Failure semantics")."""
        for child in forked:
            self._requests[child.request_id].seqs[child.sample_index] = child
            parent_rows = self._logits[self._requests[child.request_id].seqs[0].seq_id]
            self._logits[child.seq_id] = list(parent_rows)
        done: list[RequestOutput] = []
        for seq in finished:
            request = self._requests[seq.request_id]
            request.num_finished += 1
            if request.num_finished == request.n:
                done.append(self._output(seq.request_id))
        return done

    def _output(self, request_id: int) -> RequestOutput:
        request = self._requests.pop(request_id)
        seqs = [request.seqs[i] for i in range(request.n)]
        rows = [self._logits.pop(seq.seq_id) for seq in seqs]
        logits = None
        if self.keep_logits:
            vocab = self.model.config.vocab_size
            logits = [torch.stack(r) if r else torch.empty(0, vocab) for r in rows]
        outputs = [seq.tokens[seq.prompt_len :] for seq in seqs]
        return RequestOutput(request_id, request.prompt, outputs, logits)
