"""``PagedAttentionEngine`` against the dense oracle: the paging changes nothing in the output.

The engine keeps K/V only in the paged cache and reads them through block tables; the oracle
(``pagedkv.impl.serving.dense.dense_generate``) decodes each sequence alone with a contiguous
cache, through the same layers. Hypothesis draws the workload (``properties/engine_cases.py``):
block sizes 1..256, prefix caching on and off, pools tight enough to preempt, chunked prompts,
parallel sampling, staggered arrivals, an EOS token the model emits. Greedy samples must equal
the oracle token for token and sampled ones must have the oracle's logits for their own tokens,
within ``LOGIT_ATOL``/``LOGIT_RTOL``. After the run every block is free and no request is lost.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given, settings

from pagedkv.impl.serving.engine import PagedAttentionEngine, main
from pagedkv.impl.serving.paged_kv import PagedKVCache
from pagedkv.impl.serving.scheduler import RequestTooLargeError
from properties.engine_cases import (
    MODEL,
    Request,
    Workload,
    check_against_oracle,
    check_all_freed,
    one_thread,
    run,
    workloads,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@given(workloads())
def test_engine_matches_dense_oracle(workload: Workload) -> None:
    result = run(workload)
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


@settings(max_examples=50)
@given(workloads(max_requests=3, max_new_tokens=6))
def test_prefix_caching_changes_nothing(workload: Workload) -> None:
    """The same workload with and without prefix caching gives the same tokens."""
    on = run(Workload(**{**workload.__dict__, "prefix_caching": True}))
    off = run(Workload(**{**workload.__dict__, "prefix_caching": False}))
    for a, b in zip(on.outputs, off.outputs, strict=True):
        assert a.outputs == b.outputs
    check_all_freed(on.engine)


# Fixed workloads that are sure to exercise what the drawn ones exercise most of the time.
SYSTEM = tuple(range(40, 52))
PRESSURE = Workload(
    requests=tuple(
        Request((*SYSTEM, i, 2 * i + 1), max_new_tokens=12, n=1 + i % 2, temperature=t, arrival=i)
        for i, t in enumerate([0.0, 1.0, 0.0, 0.0, 1.0, 0.0])
    ),
    block_size=4,
    total_blocks=12,
    max_num_seqs=6,
    max_num_batched_tokens=10,
    watermark_blocks=1,
    prefix_caching=True,
    eos_token_id=None,
)


def test_preemption_prefix_hits_and_forks_happen() -> None:
    result = run(PRESSURE)
    metrics = result.engine.metrics
    assert sum(m.preemptions for m in metrics) > 0
    assert sum(m.prefix_hit_tokens for m in metrics) > 0
    assert any(m.num_batched_tokens == PRESSURE.max_num_batched_tokens for m in metrics)
    check_against_oracle(PRESSURE, result)
    check_all_freed(result.engine)


def test_the_check_catches_a_missing_copy_on_write(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: if the engine skipped ``copy_blocks``, a forked sample's copy of the shared tail
    block would lack the prompt's last K/V. The slot reads as NaN (never written: sampling
    raises) or holds another sequence's stale K/V (the comparison fails)."""
    monkeypatch.setattr(PagedKVCache, "copy_blocks", lambda self, pairs: None)
    workload = Workload(**{**PRESSURE.__dict__, "total_blocks": 40})
    with pytest.raises((AssertionError, RuntimeError)):
        check_against_oracle(workload, run(workload))


def test_triton_kernels_drive_the_engine() -> None:
    """The Triton kernels (the interpreter on CPU) in the engine: slot mapping, store_kv, paged
    decode attention and copy_blocks, with forks and a preemption."""
    workload = Workload(
        requests=(
            Request((5, 6, 7, 8, 9), max_new_tokens=4, n=2, temperature=1.0, arrival=0),
            Request((5, 6, 7, 8, 1, 2), max_new_tokens=4, n=1, temperature=0.0, arrival=0),
        ),
        block_size=2,
        total_blocks=5,
        max_num_seqs=3,
        max_num_batched_tokens=16,
        watermark_blocks=0,
        prefix_caching=True,
        eos_token_id=None,
    )
    result = run(workload, backend="triton")
    assert sum(m.preemptions for m in result.engine.metrics) > 0
    check_against_oracle(workload, result)
    check_all_freed(result.engine)


def test_a_request_that_can_never_fit_is_rejected() -> None:
    engine = PagedAttentionEngine(MODEL, total_blocks=3, block_size=4, max_num_seqs=2)
    with pytest.raises(RequestTooLargeError, match=r"needs up to 4 blocks .* at most 3"):
        engine.add_request(list(range(10)), max_new_tokens=4)  # 13 tokens: 4 blocks
    with pytest.raises(RequestTooLargeError, match="3 samples"):
        engine.add_request([1, 2], max_new_tokens=2, n=3)
    engine.add_request(list(range(10)), max_new_tokens=3)  # 12 tokens: exactly 3 blocks
    while engine.has_unfinished_requests():
        engine.step()
    check_all_freed(engine)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"prompt": [1, True, 3]}, TypeError),
        ({"prompt": [1, 2.0]}, TypeError),
        ({"prompt": "123"}, TypeError),
        ({"prompt": [1, -2]}, ValueError),
        ({"prompt": [1, 128]}, ValueError),  # outside the vocabulary
        ({"prompt": []}, ValueError),
        ({"temperature": float("nan")}, ValueError),
        ({"temperature": -1.0}, ValueError),
        ({"eos_token_id": True}, TypeError),
        ({"seed": -1}, ValueError),
        ({"max_new_tokens": 0}, ValueError),
    ],
)
def test_bad_requests_are_refused_and_queue_nothing(kwargs: dict, error: type) -> None:
    engine = PagedAttentionEngine(MODEL, total_blocks=8, block_size=4)
    request = {"prompt": [1, 2, 3], "max_new_tokens": 2, **kwargs}
    with pytest.raises(error):
        engine.add_request(request.pop("prompt"), request.pop("max_new_tokens"), **request)
    assert not engine.has_unfinished_requests()
    engine.add_request([1, 2, 3], 2)  # the engine still serves a good request
    while engine.has_unfinished_requests():
        engine.step()
    check_all_freed(engine)


def test_an_unknown_backend_fails_at_construction() -> None:
    with pytest.raises(ValueError, match="backend"):
        PagedAttentionEngine(MODEL, total_blocks=8, block_size=4, backend="gpu")


def test_demo_runs(capsys: pytest.CaptureFixture[str]) -> None:
    main(["--requests", "4", "--max-new-tokens", "6"])
    out = capsys.readouterr().out
    assert "step    0 |" in out and "preemptions" in out
