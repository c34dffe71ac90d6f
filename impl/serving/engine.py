"""PagedAttentionEngine: continuous batching over a real paged KV cache.

K/V live only in the paged cache (``pagedkv.impl.serving.paged_kv``) and are read back through block
tables; there is no ``past_key_values``. One :meth:`PagedAttentionEngine.step`:

1. **schedule**: ``pagedkv.impl.serving.scheduler`` picks each sequence's tokens to compute
   (decodes and prompt chunks), growing block tables, admitting requests (prefix-cache hits skip
   their cached tokens) and preempting by recompute when memory runs out;
2. **copy-on-write**: the copy pairs the growth produced are applied with
   ``kernels.copy_blocks``, before anything is written;
3. **block tables -> slot mapping**: the batch's tables go to ``PagedKVCache.step``, which
   validates them once, on the host, and gives every new token its physical slot
   (``kernels.slot_mapping``);
4. **store -> attention**: every layer writes the new K/V at those slots and attends through
   the tables in one call for the whole mixed step (``pagedkv.impl.serving.paged_kv``), reading
   no value on the host;
5. **sample**: the logits of each sequence whose known tokens are now all computed give its next
   token (greedy or seeded sampling; ``n`` tokens fork a parallel-sampling request);
6. **free**: finished sequences free their blocks at once; full blocks are registered with the
   prefix cache. The step's :class:`pagedkv.impl.serving.metrics.StepMetrics` are recorded.

With a sliding-window model (``ModelConfig.sliding_window``) the scheduler also releases, at
the start of each step and after admitting a prompt with prefix hits, every block outside the
window of a sequence's next query (``BlockTableStore.release_outside_window``): its table
entry becomes -1, which the attention kernels never read (they start at the window).

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

from pagedkv.impl.blocks.manager import BlockManager
from pagedkv.impl.blocks.page_tables import block_tables
from pagedkv.impl.blocks.prefix_cache import (
    KVEvent,
    PrefixCacheStats,
    PrefixCachingBlockManager,
)
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving import speculative
from pagedkv.impl.serving.metrics import StepMetrics, step_metrics
from pagedkv.impl.serving.model import CausalLM
from pagedkv.impl.serving.paged_kv import PagedKVCache
from pagedkv.impl.serving.sampling import check_temperature, sample_token
from pagedkv.impl.serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, Sequence
from pagedkv.impl.serving.speculative import DraftSource, accepted_drafts
from pagedkv.kernels import resolve_backend
from pagedkv.kernels.check_arguments import check_bool
from pagedkv.spec.block_manager import blocks_needed, check_int
from pagedkv.spec.checks import check_tokens

_TOKENS = attrgetter("tokens")


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
    the pool.

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
    ) -> None:
        if not isinstance(model, CausalLM):
            raise TypeError(f"model must be a CausalLM, got {type(model).__name__}")
        check_int("num_speculative_tokens", num_speculative_tokens, 0)
        if draft_source is not None and not callable(draft_source):
            raise TypeError(f"draft_source must be callable, got {type(draft_source).__name__}")
        if (draft_source is None) != (num_speculative_tokens == 0):
            raise ValueError("draft_source and num_speculative_tokens >= 1 go together")
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_bool("enable_kv_events", enable_kv_events)
        if enable_kv_events and not enable_prefix_caching:
            raise ValueError(
                "enable_kv_events needs enable_prefix_caching: events report cache keys"
            )
        check_bool("keep_logits", keep_logits)
        check_int("seed", seed, 0)
        check_int("max_model_len", max_model_len, 1)
        resolve_backend(backend, model.device)  # an unknown or unusable backend fails here
        manager = (
            PrefixCachingBlockManager(total_blocks, block_size, enable_kv_events=enable_kv_events)
            if enable_prefix_caching
            else BlockManager(total_blocks, block_size)
        )
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
            dtype=model.dtype, device=model.device, backend=backend,
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
        prompt = self._check_prompt(prompt)
        temperature, seed = self._check_options(temperature, eos_token_id, seed)
        request_id = self._next_request_id
        seq = self.scheduler.add_request(
            request_id, prompt, max_new_tokens, n=n, eos_token_id=eos_token_id,
            cache_salt=cache_salt,
        )  # fmt: skip
        self._next_request_id += 1
        n = seq.num_samples  # the checked values, plain ints
        base = (self.seed, request_id) if seed is None else (seed,)
        generators = [
            torch.Generator().manual_seed(hash((*base, i)) & 0x7FFF_FFFF) for i in range(n)
        ]
        self._requests[request_id] = _Request(prompt, n, temperature, generators, {0: seq})
        self._logits[seq.seq_id] = []
        return request_id

    def _check_prompt(self, prompt: abc.Sequence[int]) -> list[int]:
        """The engine's own check of a prompt (the scheduler's follow): ints in the vocabulary.
        Returns it as plain ints."""
        vocab = self.model.config.vocab_size
        tokens = check_tokens(prompt)
        if any(token >= vocab for token in tokens):
            raise ValueError(f"prompt tokens must lie in [0, {vocab})")
        return tokens

    def _check_options(
        self, temperature: object, eos_token_id: object, seed: object
    ) -> tuple[float, int | None]:
        """The engine's own checks of a request's options; returns the temperature as a float
        and the seed as a plain int (or None)."""
        vocab = self.model.config.vocab_size
        temperature = check_temperature(temperature)
        if temperature and self.num_speculative_tokens:
            raise ValueError(
                "speculative decoding is greedy only: temperature must be 0 with "
                f"num_speculative_tokens={self.num_speculative_tokens}, got {temperature}"
            )
        if seed is not None:
            seed = check_int("seed", seed, 0)
        if eos_token_id is not None and check_int("eos_token_id", eos_token_id, 0) >= vocab:
            raise ValueError(f"eos_token_id must lie in [0, {vocab}), got {eos_token_id}")
        return temperature, seed  # type: ignore[return-value]

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
        drawn: list[tuple[torch.Generator, torch.Tensor]] = []  # generator states before draws
        if self.draft_source is not None:
            budget = self.scheduler.config.max_num_batched_tokens - plan.num_batched_tokens
            plan, drafts, before = speculative.draft(
                plan, self.store, self.draft_source, self.num_speculative_tokens, budget,
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
            verified = speculative.roll_back(plan, drafts, rows, self.store) if drafts else plan
            forked, finished = self.scheduler.update(verified, sampled)
        except BaseException:
            for generator, state in reversed(drawn):  # no sample draws twice
                generator.set_state(state)
            if drafts:
                speculative.undraft(plan, before, self.store)
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
        self._check_options(temperature, eos_token_id, None)
        check_int("max_new_tokens", max_new_tokens, 1)  # checked even with no prompts
        check_int("n", n, 1)
        scratch = Scheduler(self.store, self.scheduler.config)  # its queue is thrown away
        for index, prompt in enumerate(prompts):
            self._check_prompt(prompt)
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
        self,
        plan: SchedulerOutput,
        drafts: abc.Mapping[int, list[int]],
        drawn: list[tuple[torch.Generator, torch.Tensor]],
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
        device = self.kv.device
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
            dtype=torch.int64, device=device,
        )  # fmt: skip
        hidden = self.model(input_ids, step.positions, step)
        sampling = plan.sampling
        last = np.cumsum(counts)[plan.samples]  # one past each sampling row's last flat token
        # A drafted sequence's logits at its last 1 + k positions; every other one's at its last.
        lengths = [1 + len(drafts.get(seq.seq_id, ())) for seq in sampling] if drafts else None
        if lengths is None:
            index = torch.from_numpy(last - 1)
            lengths = [1] * len(sampling)
        else:
            spans = zip(last.tolist(), lengths, strict=True)
            index = torch.tensor([p for end, n in spans for p in range(end - n, end)])
        logits = self.model.compute_logits(hidden[index.to(device)]).float().cpu()
        # Every row's greedy token at once: what sample_token gives at temperature 0 (numpy's
        # argmax, like torch's, takes the first of equal maxima and a NaN as the maximum).
        argmax = logits.numpy().argmax(axis=-1).tolist()
        sampled: list[int] = []
        rows: dict[int, torch.Tensor] = {}
        offset = 0
        for seq, n in zip(sampling, lengths, strict=True):
            guess = drafts.get(seq.seq_id) if drafts else None
            if guess:  # greedy: the drafts greedy decoding agrees with, then its next token
                greedy = argmax[offset : offset + n]
                kept = accepted_drafts(guess, greedy, seq.eos_token_id)
                sampled.append(greedy[kept])
                rows[seq.seq_id] = logits[offset : offset + kept + 1]
            else:
                request = self._requests[seq.request_id]
                if not request.temperature:
                    sampled += [argmax[offset]] * seq.num_samples
                else:
                    for j in range(seq.num_samples):
                        generator = request.generators[seq.sample_index + j]
                        drawn.append((generator, generator.get_state()))
                        sampled.append(sample_token(logits[offset], request.temperature, generator))
                if self.keep_logits:
                    rows[seq.seq_id] = logits[offset : offset + n]
            offset += n
        return sampled, rows

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
