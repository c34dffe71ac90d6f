"""``PagedAttentionEngine`` against the dense oracle (each sequence alone, contiguous cache) on
drawn and fixed workloads, with and without a sliding window (blocks outside it released)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from pagedkv.impl.blocks.manager import BlockManager as ImplBlockManager
from pagedkv.impl.blocks.store import BlockTableStore
from pagedkv.impl.serving.cli import main
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM
from pagedkv.impl.serving.paged_kv import PagedKVCache
from pagedkv.impl.serving.scheduler import SchedulerConfig
from pagedkv.kernels import trusted
from pagedkv.spec.block_manager import BlockManager as SpecBlockManager
from pagedkv.spec.checks import int32_window
from pagedkv.spec.fp8 import calibrated_scale, fp8_format
from properties.engine_cases import (
    CONFIG,
    MODEL,
    PRESSURE,
    Request,
    Workload,
    check_against_oracle,
    check_all_freed,
    greedy_oracle,
    run,
    single_thread,  # noqa: F401 - an autouse fixture
    workloads,
)


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


@pytest.mark.parametrize(
    ("kv_cache_dtype", "kv_scales"),
    [("auto", None), ("fp8_e4m3", None), ("fp8_e5m2", None), ("fp8_e4m3", (0.5, 4.0))],
)
def test_preemption_prefix_hits_and_forks_happen(
    kv_cache_dtype: str, kv_scales: tuple[float, float] | None
) -> None:
    """Also with K/V in fp8 (K's and V's scales apart): forks copy fp8 blocks, prefix hits and
    recomputes read them under the scales they were written with."""
    workload = PRESSURE.but(kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales)
    result = run(workload)
    metrics = result.engine.metrics
    assert sum(m.preemptions for m in metrics) > 0
    assert sum(m.prefix_hit_tokens for m in metrics) > 0
    assert any(m.num_batched_tokens == PRESSURE.max_num_batched_tokens for m in metrics)
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


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


def test_triton_kernels_drive_the_engine() -> None:
    """The Triton kernels (the CPU interpreter) drive the engine, with forks and a preemption."""
    requests = (Request((5, 6, 7, 8, 9), 4, 2, 1.0, 0), Request((5, 6, 7, 8, 1, 2), 4, 1, 0.0, 0))
    workload = Workload(requests, block_size=2, total_blocks=5, max_num_seqs=3,
                        max_num_batched_tokens=16)  # fmt: skip
    result = run(workload, backend="triton")
    assert sum(m.preemptions for m in result.engine.metrics) > 0
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


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


# ----------------------------------------------------------------------- sliding window

WINDOW_MODEL = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=6), seed=0)
WINDOW_SYSTEM = tuple(range(60, 71))  # 11 tokens: hits on the first blocks of later prompts
WINDOW_REQUESTS = tuple(Request(*request, arrival=0) for request in [
    ((*WINDOW_SYSTEM, 3, 4), 14, 2, 1.0), ((*WINDOW_SYSTEM, 5), 16, 1, 0.0),
    ((*WINDOW_SYSTEM, 7, 8, 9), 12, 2, 0.0), ((20, 21, 22), 15, 1, 1.0)])  # fmt: skip


@pytest.mark.parametrize(("block_size", "total_blocks", "budget"),
                         [(2, 22, 8), (4, 10, 5), (1, 40, 12)],
                         ids=["bs2-tight", "bs4-chunked", "bs1"])  # fmt: skip
def test_sliding_window_releases_blocks_and_matches_dense(
    block_size: int, total_blocks: int, budget: int
) -> None:
    """A window with prefix hits, forks, a tight pool, chunks: dense outputs, blocks released."""
    workload = Workload(WINDOW_REQUESTS, block_size, total_blocks, 6, budget, model=WINDOW_MODEL)
    result = run(workload)
    metrics = result.engine.metrics
    assert sum(m.prefix_hit_tokens for m in metrics) > 0 and max(result.released) > 0
    assert block_size != 2 or sum(m.preemptions for m in metrics) > 0
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


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


def test_sliding_window_with_speculative_decoding() -> None:
    """Partly right drafts under a window: rollback and release keep the oracle's output."""
    greedy = tuple(dataclasses.replace(r, n=1, temperature=0.0) for r in WINDOW_REQUESTS)

    def drafts(tokens: list[int], k: int) -> list[int]:
        for request in greedy:
            prompt = request.prompt
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                future = greedy_oracle(prompt, request.max_new_tokens, WINDOW_MODEL).tokens
                right = future[done : done + k]
                return right[:1] + [(t + 1) % CONFIG.vocab_size for t in right[1:]]
        raise AssertionError("an unknown sequence")

    workload = Workload(greedy, 2, 24, 4, 16, model=WINDOW_MODEL)
    result = run(workload, draft_source=drafts, num_speculative_tokens=3)
    engine = result.engine
    assert max(result.released) > 0 and engine.num_accepted_tokens > 0
    assert engine.num_accepted_tokens < engine.num_draft_tokens
    check_against_oracle(workload, result)
    check_all_freed(engine)
