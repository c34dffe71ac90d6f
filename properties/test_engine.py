"""``PagedAttentionEngine`` against the dense oracle (each sequence alone, contiguous cache) on
drawn and fixed workloads, with and without a sliding window (blocks outside it released); a
step's layer loop reads no tensor value on the host (a guard on the CPU, the sync debug mode on
CUDA) and uploads only changed table rows; greedy speculative decoding is greedy decoding, and
the drafts kept are exactly the leading ones equal to the real continuation."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv.impl.serving.engine as engine_module
import pagedkv.impl.serving.scheduler as scheduler_module
import pagedkv.impl.serving.speculative as speculative_module
import properties.engine_cases as engine_cases
from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving import paged_kv
from pagedkv.impl.serving.cli import main
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, DecoderLayer
from pagedkv.impl.serving.paged_kv import DeviceBlockTables, PagedKVCache, PagedStep
from pagedkv.impl.serving.scheduler import SchedulerConfig
from pagedkv.impl.serving.speculative import accepted_drafts
from pagedkv.kernels import api, trusted
from pagedkv.spec.block_manager import BlockManager as SpecBlockManager
from pagedkv.spec.block_manager import blocks_needed
from pagedkv.spec.checks import int32_window
from pagedkv.spec.fp8 import calibrated_scale, fp8_format
from properties.engine_cases import (
    CONFIG,
    MODEL,
    PRESSURE,
    Request,
    Run,
    Workload,
    check_against_oracle,
    check_all_freed,
    greedy_oracle,
    run,
    single_thread,  # noqa: F401 - an autouse fixture
    workloads,
)
from properties.mutants import load_mutant


@given(workloads())
def test_engine_matches_dense_oracle(workload: Workload) -> None:
    result = run(workload)
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


@settings(max_examples=50)
@given(workloads(max_requests=3, max_new_tokens=6))
def test_prefix_caching_changes_nothing(workload: Workload) -> None:
    """The same workload with and without prefix caching gives the same tokens."""
    on, off = run(workload.but(prefix_caching=True)), run(workload.but(prefix_caching=False))
    for a, b in zip(on.outputs, off.outputs, strict=True):
        assert a.outputs == b.outputs
    check_all_freed(on.engine)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
def test_the_check_catches_a_missing_copy_on_write(
    monkeypatch: pytest.MonkeyPatch, kv_cache_dtype: str
) -> None:
    """Teeth: without ``copy_blocks`` a greedy fork's tail block lacks the prompt's last K/V."""
    monkeypatch.setattr(PagedKVCache, "copy_blocks", lambda self, pairs: None)
    greedy = tuple(dataclasses.replace(r, temperature=0.0) for r in PRESSURE.requests)
    workload = PRESSURE.but(requests=greedy, total_blocks=40, kv_cache_dtype=kv_cache_dtype)
    with pytest.raises(AssertionError, match=r"paged .* != dense"):
        check_against_oracle(workload, run(workload))


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_the_fp8_tolerance_still_tells_an_unquantized_cache(kv_cache_dtype: str) -> None:
    """Teeth of ``engine_cases.FP8_FLIP``: an fp32 cache's run is not taken for an fp8 one."""
    with pytest.raises(AssertionError, match=r"paged .* != dense|Greatest absolute difference"):
        check_against_oracle(PRESSURE.but(kv_cache_dtype=kv_cache_dtype), run(PRESSURE))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"backend": "gpu"}, ValueError, "backend"),
    ({"enable_kv_events": True}, ValueError, "enable_kv_events"),  # needs prefix caching
    ({"draft_source": greedy_oracle}, ValueError, None),  # no k
    ({"num_speculative_tokens": 2}, ValueError, None),  # no source
    ({"draft_source": "oracle", "num_speculative_tokens": 2}, TypeError, None),
    ({"draft_source": greedy_oracle, "num_speculative_tokens": -1}, ValueError, None),
    ({"draft_source": greedy_oracle, "num_speculative_tokens": 2.0}, TypeError, None),
])  # fmt: skip
def test_bad_engine_settings_are_refused(kwargs: dict, error: type, match: str | None) -> None:
    with pytest.raises(error, match=match):
        PagedAttentionEngine(MODEL, 16, 4, **kwargs)


def test_calculated_scales_come_from_the_first_forward_and_a_failed_one_leaves_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``kv_scales="calculate"``: a fault at the first step's last layer leaves no scale; the
    retried step fixes each layer's K and V scale at ``spec.fp8.calibrated_scale`` of the K or V
    that layer wrote, and every later write uses them."""
    writes: list[tuple] = []
    real = trusted.store_kv

    def store(key, value, k_cache, v_cache, slots, backend, scales=None):
        writes.append((key.clone(), value.clone(), scales))
        if len(writes) == CONFIG.num_layers:
            raise RuntimeError("planted fault at the last layer of the first step")
        return real(key, value, k_cache, v_cache, slots, backend, scales)

    monkeypatch.setattr(trusted, "store_kv", store)
    engine = PagedAttentionEngine(MODEL, 16, 4, kv_cache_dtype="fp8_e4m3", kv_scales="calculate")
    engine.add_request([5, 6, 7, 8, 9], 6)
    with pytest.raises(RuntimeError, match="planted"):
        engine.step()
    assert engine.kv.scales is None
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step().finished
    fmt = fp8_format("fp8_e4m3")
    assert engine.kv.scales is not None
    first = writes[CONFIG.num_layers : 2 * CONFIG.num_layers]  # the retried first step's
    for layer, (key, value, _) in enumerate(first):
        for rows, scale in zip((key, value), engine.kv.scales[layer], strict=True):
            assert scale.tolist() == [calibrated_scale(float(rows.abs().max()), fmt)] * 2
    for index, (_, _, scales) in enumerate(writes[CONFIG.num_layers :]):
        assert scales == engine.kv.scales[index % CONFIG.num_layers]
    assert [len(out.outputs[0]) for out in outputs] == [6]
    check_all_freed(engine)


@pytest.mark.parametrize(
    "options", [[], ["--kv-cache-dtype", "fp8_e5m2", "--kv-cache-bytes", "9000"]]
)
def test_demo_runs(capsys: pytest.CaptureFixture[str], options: list[str]) -> None:
    """The demo, and with an fp8 cache whose pool a byte budget sizes: 9,000 bytes hold 17 blocks
    of 512 (4 tokens x 2 layers x K and V x 2 KV heads x 16 dims, a byte each)."""
    main(["--requests", "4", "--max-new-tokens", "6", *options])
    out = capsys.readouterr().out
    assert "step    0 |" in out and "preemptions" in out
    assert ("17 blocks of 4 tokens (torch.float8_e5m2)" in out) == bool(options)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        (["--kv-cache-dtype", "fp4"], "kv_cache_dtype"),
        (["--kv-cache-dtype", "fp8", "--kv-scales", "0", "1"], "k_scale"),
        (["--kv-cache-dtype", "fp8", "--kv-scales", "1", "nan"], "v_scale"),
        (["--kv-scales", "1", "1"], "kv_scales"),
        (["--kv-cache-bytes", "-1"], "budget_bytes"),
    ],
)
def test_bad_kv_cache_options_stop_the_command_naming_them(
    capsys: pytest.CaptureFixture[str], options: list[str], named: str
) -> None:
    with pytest.raises(SystemExit) as stop:
        main(options)
    assert stop.value.code == 2 and named in capsys.readouterr().err


@pytest.mark.parametrize("window", [2**31, 2**63, 2**64], ids=["2**31", "2**63", "2**64"])
def test_a_window_wider_than_any_context_is_no_window_in_every_layer(window: int) -> None:
    """A window above ``INT32_MAX`` hides nothing in any layer, served as no window."""
    for manager in (SpecBlockManager(8, 4), ImplBlockManager(8, 4)):
        table = manager.allocate(3)
        assert manager.release_outside_window(table, 12, window) == table
    store = BlockTableStore(ImplBlockManager(8, 4), 2, 4)
    store.admit(0, list(range(12)))
    store.release_outside_window([0], window)
    store.release_outside_window([0], window, 12)
    assert store.table(0) == [0, 1, 2] and int(store.num_released[store.row(0)]) == 0
    with pytest.raises(ValueError, match="token_counts"):  # the other checks still run first
        store.release_outside_window([0], window, 13)
    assert SchedulerConfig(sliding_window=window).sliding_window == window
    assert int32_window(window) is None
    wide = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=window), seed=0)
    outputs = [
        [out.outputs for out in PagedAttentionEngine(model, total_blocks=16, block_size=2)
         .generate([[1, 2, 3, 4, 5, 6, 7], [9, 8]], 6)]
        for model in (MODEL, wide)
    ]  # fmt: skip
    assert outputs[1] == outputs[0]


# ------------------------------------- fixed workloads, no host reads in the layers

VALUE_CHECKS = ("check_context_values", "check_cu_seqlens_values", "check_max_query_len",
                "check_position_values", "check_slot_values")  # fmt: skip
HOST_READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__")


class HostRead(AssertionError):
    """A layer read a tensor's value on the host."""


@contextmanager
def no_host_reads_in_layers() -> Iterator[list[int]]:
    """Inside a ``DecoderLayer`` host reads and value checks raise; yields the layer calls."""
    inside = [False]
    calls: list[int] = []

    def guard(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if inside[0]:
                raise HostRead(f"{name} inside a decoder layer")
            return original(*args, **kwargs)

        return guarded

    layer_forward = DecoderLayer.forward

    def forward(self: DecoderLayer, *args: Any) -> torch.Tensor:
        calls.append(self.self_attn.layer)
        inside[0] = True
        try:
            return layer_forward(self, *args)
        finally:
            inside[0] = False

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            patch.setattr(torch.Tensor, name, guard(f"Tensor.{name}", original))
        for name in VALUE_CHECKS:
            patch.setattr(api, name, guard(name, getattr(api, name)))
        patch.setattr(DecoderLayer, "forward", forward)
        yield calls


WINDOW_MODEL = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=6), seed=0)
WINDOW_SYSTEM = tuple(range(60, 71))  # 11 tokens: hits on the first blocks of later prompts
WINDOW_REQUESTS = tuple(Request(*request, arrival=0) for request in [
    ((*WINDOW_SYSTEM, 3, 4), 14, 2, 1.0), ((*WINDOW_SYSTEM, 5), 16, 1, 0.0),
    ((*WINDOW_SYSTEM, 7, 8, 9), 12, 2, 0.0), ((20, 21, 22), 15, 1, 1.0)])  # fmt: skip
FORK = (Request((5, 6, 7, 8, 9), 4, 2, 1.0, 0), Request((5, 6, 7, 8, 1, 2), 4, 1, 0.0, 0))
SPECULATIVE_WINDOW = Workload(  # greedy, as speculation is
    tuple(dataclasses.replace(r, n=1, temperature=0.0) for r in WINDOW_REQUESTS), 2, 24, 4, 16,
    model=WINDOW_MODEL)  # fmt: skip
SPECULATIVE_FORK = Workload(
    tuple(dataclasses.replace(r, max_new_tokens=6, temperature=0.0) for r in FORK), 2, 7, 3, 16
)


def partly_right_drafts(workload: Workload) -> dict[str, object]:
    """Speculation options: drafts from each request's dense continuation, the first right."""

    def drafts(tokens: list[int], k: int) -> list[int]:
        for request in workload.requests:
            if tuple(tokens[: len(request.prompt)]) == request.prompt:
                done = len(tokens) - len(request.prompt)
                future = greedy_oracle(request.prompt, request.max_new_tokens, workload.model)
                right = future.tokens[done : done + k]
                return right[:1] + [(t + 1) % CONFIG.vocab_size for t in right[1:]]
        raise AssertionError("an unknown sequence")

    return {"draft_source": drafts, "num_speculative_tokens": 3}


ALL = "preempts hits full mixed"
FIXED = {  # name -> the workload, the engine's options, and the hard cases it must meet (below)
    "pressure": (PRESSURE, {}, ALL),
    # fp8, also K's and V's scales apart: forks copy fp8 blocks, prefix hits and recomputes
    # read them under the scales they were written with.
    **{f"pressure-{dtype}{'-scales' * bool(scales)}": (
        PRESSURE.but(kv_cache_dtype=dtype, kv_scales=scales), {}, ALL)
       for dtype, scales in [("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", (0.5, 4.0))]},
    "triton": (Workload(FORK, 2, 5, 3, 16), {"backend": "triton"}, "preempts hits mixed"),
    # Triton at block size 4: prompts over a shared prefix, chunked by a budget of 9.
    "triton-chunked": (Workload(tuple(Request((*range(40, 52), i, i + 7), 4, 1, 0.0, 0)
                                      for i in range(3)), 4, 40, 3, 9),
                       {"backend": "triton"}, "hits full mixed"),
    # A window with prefix hits, forks, a tight pool, chunks: blocks outside it released.
    **{f"window-bs{bs}": (Workload(WINDOW_REQUESTS, bs, blocks, 6, budget, model=WINDOW_MODEL),
                          {}, f"{cases} released")
       for bs, blocks, budget, cases in [(2, 22, 8, ALL), (4, 10, 5, ALL),
                                         (1, 40, 12, "hits full mixed")]},
    # Partly right drafts: rollback and release in a window; Triton kernels verifying them.
    "window-speculative": (SPECULATIVE_WINDOW, partly_right_drafts(SPECULATIVE_WINDOW),
                           "hits full mixed released drafts"),
    "triton-speculative": (SPECULATIVE_FORK, {**partly_right_drafts(SPECULATIVE_FORK),
                           "backend": "triton"}, "preempts hits mixed drafts"),
}  # fmt: skip


def met(workload: Workload, result: Run) -> set[str]:
    """The hard cases a run met: a preemption, a prefix hit, a step of the whole token budget,
    a chunk beside decodes, blocks released by a window, and some drafts kept but not all."""
    metrics, engine = result.engine.metrics, result.engine
    return {name for name, happened in [
        ("preempts", any(m.preemptions for m in metrics)),
        ("hits", any(m.prefix_hit_tokens for m in metrics)),
        ("full", any(m.num_batched_tokens == workload.max_num_batched_tokens for m in metrics)),
        ("mixed", any(m.num_decodes and m.num_batched_tokens > m.num_decodes for m in metrics)),
        ("released", max(result.released, default=0) > 0),
        ("drafts", 0 < engine.num_accepted_tokens < engine.num_draft_tokens),
    ] if happened}  # fmt: skip


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_workloads_match_dense_reading_nothing_on_the_host(name: str) -> None:
    """Each fixed workload under the guard meets its hard cases, with dense outputs, all freed."""
    workload, options, cases = FIXED[name]
    if "draft_source" in options:  # the drafts' continuations, computed outside the guard
        for request in workload.requests:
            greedy_oracle(request.prompt, request.max_new_tokens, workload.model)
    with no_host_reads_in_layers() as calls:
        result = run(workload, **options)
    assert calls and set(cases.split()) <= met(workload, result)
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


def validate_again(self: PagedStep, layer: int, query: torch.Tensor) -> None:
    cache = self.cache
    api.paged_prefill_attention(
        query, cache.k[layer], cache.v[layer], self.block_tables, self.cu_seqlens_q,
        self.context_lens, backend="reference",
    )  # fmt: skip


@pytest.mark.parametrize(("planted", "match"),
                         [(lambda step, *_: step.context_lens.tolist(), "tolist"),
                          (validate_again, "check_")], ids=["tolist", "validate"])  # fmt: skip
def test_the_guard_catches_a_host_read_in_the_layers(
    planted: Callable[..., None], match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Teeth: an attention reading context lengths on the host, or validating again, is caught."""
    attend = PagedStep.attend

    def reading(self: PagedStep, layer: int, query: torch.Tensor, *args: Any) -> torch.Tensor:
        planted(self, layer, query)
        return attend(self, layer, query, *args)

    monkeypatch.setattr(PagedStep, "attend", reading)
    with pytest.raises(HostRead, match=match), no_host_reads_in_layers():
        run(PRESSURE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_cuda_synchronization_in_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the layers run under ``set_sync_debug_mode("error")``: no synchronizing call."""
    layer_forward = DecoderLayer.forward

    def forward(self: DecoderLayer, *args: Any) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return layer_forward(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(DecoderLayer, "forward", forward)
    requests = tuple(Request((*range(40, 52), i, i + 7), 6, 1, 0.0, 0) for i in range(4))
    result = run(Workload(requests, 4, 40, 4, 9, model=CausalLM.from_seed(CONFIG, seed=0).cuda()))
    expected = [[greedy_oracle(r.prompt, 6).tokens] for r in requests]
    assert [out.outputs for out in result.outputs] == expected


def test_device_tables_upload_only_changed_rows() -> None:
    """The buffer equals each step's tables, uploading only changed rows, growing when wider; an
    engine decoding 8 sequences uploads a row when its sequence takes a block, not every step."""
    tables = DeviceBlockTables(torch.device("cpu"))
    steps = [  # the tables, and the rows uploaded so far: first, grown, unchanged, wider, fewer
        ([[3, -1], [5, 6]], 2), ([[3, 4], [5, 6]], 3), ([[3, 4], [5, 6]], 3),
        ([[3, 4], [5, 6], [7, -1]], 6), ([[5, 6]], 7),
    ]  # fmt: skip
    for rows, uploaded in steps:
        table = torch.tensor(rows, dtype=torch.int32)
        assert torch.equal(tables.update(table), table) and tables.num_uploaded_rows == uploaded
    engine = PagedAttentionEngine(MODEL, 64, 4, max_num_seqs=8, max_num_batched_tokens=128)
    engine.generate([[i + 1] * 6 for i in range(8)], 9)
    assert engine.kv.tables.num_uploaded_rows < (len(engine.metrics) - 1) * 8 / 2  # decode steps


def test_a_checked_step_is_validated_before_anything_changes() -> None:
    """``check_tables`` refuses off-host tables, out-of-pool entries, doubled slots, unchanged."""
    cache = PagedKVCache(CONFIG, 4, 2, check_tables=True)
    good = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
    cache.step(good, [3, 1], [3, 1])
    uploaded = cache.tables.num_uploaded_rows
    with pytest.raises(ValueError, match="block_tables must be on the host"):
        cache.step(good.to("meta"), [3, 1], [3, 1])
    with pytest.raises(IndexError, match=r"block_tables\[1, 0\] = 7"):
        cache.step(torch.tensor([[0, 1], [7, -1]], dtype=torch.int32), [3, 1], [3, 1])
    with pytest.raises(ValueError, match="slot_mapping writes one slot twice"):
        cache.step(torch.tensor([[0, 1], [0, -1]], dtype=torch.int32), [1, 1], [1, 1])
    assert cache.tables.num_uploaded_rows == uploaded
    assert torch.equal(cache.tables.update(good), good)


def test_a_step_trusts_the_store_s_tables(monkeypatch: pytest.MonkeyPatch) -> None:
    """By default a step checks no table value, maps each slot once; ``check_tables`` is a bool."""
    for name in VALUE_CHECKS:
        if hasattr(paged_kv, name):
            monkeypatch.setattr(paged_kv, name, lambda *_: pytest.fail("a trusted step checked"))
    calls: list[str] = []
    for owner, name in ((paged_kv.kernels, "slot_mapping"), (PagedKVCache, "step")):
        real = getattr(owner, name)

        def counted(*args: Any, _name: str = name, _real: Any = real, **kwargs: Any) -> Any:
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)
    cache = PagedKVCache(CONFIG, 4, 2)
    step = cache.step(torch.tensor([[0, 1], [0, -1]], dtype=torch.int32), [1, 1], [1, 1])
    assert step.slot_mapping.tolist() == [0, 0] and calls == ["step", "slot_mapping"]
    check_against_oracle(PRESSURE, run(PRESSURE))
    assert calls.count("slot_mapping") == calls.count("step") > 2
    with pytest.raises(TypeError, match="check_tables must be a bool"):
        PagedKVCache(CONFIG, 4, 2, check_tables=1)  # type: ignore[arg-type]


# ----------------------------------------------------------------- speculative decoding

VOCAB = CONFIG.vocab_size
Source = Callable[[list[int], int], list[int]]


def oracle(tokens: list[int], k: int) -> list[int]:
    return list(greedy_oracle(tuple(tokens), k).tokens)


def wrong(tokens: list[int], k: int) -> list[int]:
    return [(token + 1) % VOCAB for token in oracle(tokens, k)]


def partly_right(right: int) -> Source:
    def draft(tokens: list[int], k: int) -> list[int]:
        return oracle(tokens, k)[:right] + wrong(tokens, k)[right:]

    draft.__name__ = f"first_{right}_right"
    return draft


def fixed_guess(tokens: list[int], k: int) -> list[int]:
    return [tokens[-1]] * k  # "the last token repeats": sometimes right


SOURCES = [oracle, wrong, partly_right(1), partly_right(2), fixed_guess]


@dataclasses.dataclass
class Recorder:
    """A draft source that records each call: the tokens it saw and the drafts it returned."""

    source: Source
    calls: list[tuple[tuple[int, ...], list[int]]] = dataclasses.field(default_factory=list)

    def __call__(self, tokens: list[int], k: int) -> list[int]:
        drafts = self.source(tokens, k)
        assert len(drafts) <= k
        self.calls.append((tuple(tokens), drafts))
        return drafts

    def expected_accepted(self, result: Run, eos_token_id: int | None) -> int:
        """Per call, the leading drafts equal to the real continuation (none EOS): the kept ones."""
        samples = [(tuple(out.prompt), tuple(s)) for out in result.outputs for s in out.outputs]
        kept = 0
        for tokens, drafts in self.calls:
            real = max(
                (
                    output[len(tokens) - len(prompt) :]
                    for prompt, output in samples
                    if (prompt + output)[: len(tokens)] == tokens and len(tokens) >= len(prompt)
                ),
                key=len,
            )
            assert len(real) > len(drafts) or real[-1:] == (eos_token_id,), "drafts past the end"
            kept += accepted_drafts(drafts, real, eos_token_id)
        return kept


def ample(workload: Workload) -> Workload:
    """The workload in a pool that holds every sequence at its longest at once (no preemption)."""
    total = sum(
        r.n * blocks_needed(len(r.prompt) + r.max_new_tokens - 1, workload.block_size)
        for r in workload.requests
    )
    return workload.but(total_blocks=max(total, workload.total_blocks))


def speculate(
    workload: Workload, source: Source, k: int, exact: bool = True, **kwargs: object
) -> tuple[Run, Recorder]:
    """Dense outputs and logits, all freed; ``exact`` (no preemption): the expected drafts kept."""
    recorder = Recorder(source)
    result = run(workload, draft_source=recorder, num_speculative_tokens=k, **kwargs)
    engine = result.engine
    check_against_oracle(workload, result)
    check_all_freed(engine)
    assert engine.num_accepted_tokens <= engine.num_draft_tokens
    if exact:
        assert engine.num_draft_tokens == sum(len(drafts) for _, drafts in recorder.calls)
        kept = recorder.expected_accepted(result, workload.eos_token_id)
        assert engine.num_accepted_tokens == kept
    return result, recorder


PROMPTS = ((5, 6, 7, 8, 9, 10, 11), (5, 6, 7, 8, 1, 2), (40, 41, 42), (3,) * 13)


def fixed_workload(block_size: int, prefix_caching: bool, eos: int | None = None) -> Workload:
    requests = tuple(
        Request(prompt, max_new_tokens=9 + i, n=1 + (i == 1), temperature=0.0, arrival=i % 2)
        for i, prompt in enumerate(PROMPTS)
    )
    return ample(Workload(requests, block_size, 1, 6, 64, 0, prefix_caching, eos))


@pytest.mark.parametrize("source", SOURCES, ids=lambda s: s.__name__)
@pytest.mark.parametrize(("block_size", "prefix_caching", "k"), [(4, True, 3), (3, False, 4)])
def test_speculative_decoding_is_greedy_decoding(
    source: Source, block_size: int, prefix_caching: bool, k: int
) -> None:
    """Every source gives the greedy tokens; the drafts kept are the ones the source got right."""
    workload = fixed_workload(block_size, prefix_caching)
    engine = speculate(workload, source, k)[0].engine
    assert engine.num_draft_tokens > 0
    if source is wrong:
        assert engine.num_accepted_tokens == 0
    if source is oracle:  # the dense oracle and the paged engine agree on every arg-max here
        assert engine.num_accepted_tokens == engine.num_draft_tokens
        plain = run(workload)
        assert len(engine.metrics) < len(plain.engine.metrics)  # fewer steps than plain decoding


def test_a_right_source_takes_one_step_per_k_plus_one_tokens() -> None:
    """10 tokens, 3 right drafts a step: steps give 4, 4 and 2 tokens (the last capped)."""
    workload = Workload((Request((9, 8, 7, 6, 5), 10, 1, 0.0, 0),), 4, 8, 1, 64, 0, False)
    result, recorder = speculate(workload, oracle, 3)
    assert [len(drafts) for _, drafts in recorder.calls] == [3, 3, 1]
    assert (result.engine.num_draft_tokens, result.engine.num_accepted_tokens) == (7, 7)
    assert len(result.engine.metrics) == 3


def test_an_end_of_sequence_draft_ends_the_output() -> None:
    """An EOS draft is never kept: it comes as the bonus token and ends the sequence."""
    eos = greedy_oracle(PROMPTS[0], 9).tokens[2]  # among the first step's drafts: g0, g1, EOS
    speculate(fixed_workload(4, True, eos), oracle, 4)


@settings(max_examples=25, deadline=None)
@given(
    workloads(max_requests=3, max_new_tokens=8, sampled=False),
    st.sampled_from(SOURCES),
    st.integers(1, 5),
)
def test_speculation_on_drawn_workloads(workload: Workload, source: Source, k: int) -> None:
    """Drawn workloads (chunked prompts, forks, prefix hits, EOS) in an ample pool."""
    speculate(ample(workload), source, k)


@settings(max_examples=15, deadline=None)
@given(workloads(max_requests=4, max_new_tokens=8, sampled=False), st.integers(1, 4))
def test_speculation_in_tight_pools(workload: Workload, k: int) -> None:
    """Pools that preempt: drafts take free blocks or wait; the tokens are still greedy."""
    speculate(workload, oracle, k, exact=False)


def test_sampling_with_speculation_is_refused() -> None:
    engine = PagedAttentionEngine(MODEL, 16, 4, draft_source=oracle, num_speculative_tokens=2)
    with pytest.raises(ValueError, match="greedy only"):
        engine.add_request([1, 2, 3], 4, temperature=0.7)
    with pytest.raises(ValueError, match="greedy only"):
        engine.generate([[1, 2, 3]], 4, temperature=1.0)
    assert not engine.has_unfinished_requests()


FAULTS = {"model": RuntimeError, "truncate": RuntimeError, "update": RuntimeError,
          "a set": TypeError, "too many": ValueError, "outside the vocabulary": ValueError,
          "a float": TypeError}  # fmt: skip
BAD_DRAFTS = {"a set": {1, 2}, "too many": [1, 2, 3, 4], "outside the vocabulary": [VOCAB],
              "a float": [1.0]}  # fmt: skip


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_failed_speculative_step_loses_nothing(
    fault: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fault in verify, rollback or update, or a bad draft (not a list, more than k, outside
    the vocabulary, not an int), fails the third step and undoes its drafts, changing nothing;
    the engine then finishes greedily and frees every block."""
    workload, fired = fixed_workload(3, True), list[bool]()

    def source(tokens: list[int], k: int) -> object:
        if fault in BAD_DRAFTS and len(engine.metrics) == 2 and not fired:
            fired.append(True)
            return BAD_DRAFTS[fault]
        return oracle(tokens, k)

    engine = workload.engine(draft_source=source, num_speculative_tokens=3)
    for request in workload.requests:
        engine.add_request(list(request.prompt), request.max_new_tokens, n=request.n)
    if fault not in BAD_DRAFTS:
        target, name = {"model": (engine.model, "forward"), "truncate": (engine.store, "truncate"),
                        "update": (engine.scheduler, "update")}[fault]  # fmt: skip
        original = getattr(target, name)

        def faulty(*args: object, **kwargs: object) -> object:
            ours = fault != "model" or any(isinstance(a, PagedStep) for a in args)  # not dense
            if ours and len(engine.metrics) == 2 and not fired:  # the third step: drafts verified
                fired.append(True)
                raise RuntimeError("injected")
            return original(*args, **kwargs)

        monkeypatch.setattr(target, name, faulty)
    outputs = engine.step().finished + engine.step().finished
    tokens = [list(seq.tokens) for seq in engine.scheduler.running]
    with pytest.raises(FAULTS[fault], match="injected" if fault not in BAD_DRAFTS else None):
        engine.step()  # the injected fault itself, not one the undo raised
    assert fired
    assert [seq.tokens for seq in engine.scheduler.running] == tokens  # the drafts left the tokens,
    assert engine.store.token_counts_of(None) == [len(t) for t in tokens]  # and the tables
    while engine.has_unfinished_requests():
        outputs += engine.step().finished
    outputs.sort(key=lambda out: out.request_id)
    check_against_oracle(workload, Run(engine, outputs))
    check_all_freed(engine)


# Planted bugs in a copy of the engine; each fails one of the checks above.
VERIFY = "PagedAttentionEngine._verify"
KEPT = "kept = accepted_drafts(guess, greedy, seq.eos_token_id)"
ENGINE_BUGS = {
    "every draft is kept": (VERIFY, KEPT, "kept = len(guess)"),
    "an end-of-sequence draft is kept": (
        VERIFY, KEPT, "kept = accepted_drafts(guess, greedy, None)"),
    "the bonus token is the first draft's greedy token": (
        VERIFY, "sampled.append(greedy[kept])", "sampled.append(greedy[0])"),
}  # fmt: skip
# Planted bugs in a copy of pagedkv.impl.serving.speculative or of the scheduler's draft calls.
SPECULATIVE_BUGS = {
    "speculation silently off": (
        speculative_module, "draft",
        "if guess:\n    drafts[seq.seq_id] = guess\n    budget -= len(guess)", "pass"),
    "the rejected drafts keep their slots": (
        scheduler_module, "Scheduler.keep_drafts",
        "cast(DraftStore, self.store).truncate(list(kept), [end for _, end in kept.values()])",
        "pass"),
    "a failed step keeps its drafts' slots": (
        scheduler_module, "Scheduler.undo_drafts",
        "cast(DraftStore, self.store).undo_growth(list(before), [e for _, e in before.values()])",
        "pass"),
}  # fmt: skip
CAUGHT = {  # bug -> the failure that catches it: the greedy tokens, else as commented
    **dict.fromkeys(ENGINE_BUGS, (AssertionError, r"paged .* != dense")),
    "speculation silently off": (AssertionError, None),  # the draft count
    "a failed step keeps its drafts' slots": (AssertionError, None),  # the tables after it
    # The kept slots give the next step more positions than tokens: its kernels refuse them.
    "the rejected drafts keep their slots": (ValueError, "positions must have shape"),
}


@pytest.mark.parametrize("bug", sorted(CAUGHT))
def test_planted_engine_bug_is_caught(bug: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if bug in ENGINE_BUGS:
        mutant = load_mutant(engine_module, *ENGINE_BUGS[bug], ("RequestOutput", "StepOutput"))
        monkeypatch.setattr(engine_cases, "PagedAttentionEngine", mutant.PagedAttentionEngine)
    elif SPECULATIVE_BUGS[bug][0] is speculative_module:
        monkeypatch.setattr(engine_module, "speculative", load_mutant(*SPECULATIVE_BUGS[bug]))
    else:
        mutant = load_mutant(*SPECULATIVE_BUGS[bug], ("RequestTooLargeError",))
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    error, words = CAUGHT[bug]
    with pytest.raises(error, match=words):
        for source in SOURCES:
            test_speculative_decoding_is_greedy_decoding(source, 4, True, 3)
        test_an_end_of_sequence_draft_ends_the_output()
        for fault in ("model", "update"):
            test_a_failed_speculative_step_loses_nothing(fault, monkeypatch)
