"""A step's layer loop reads no tensor value on the host (no GPU synchronization): on the CPU a
guard makes host reads and value checks inside a decoder layer raise; on CUDA the layers run
under ``set_sync_debug_mode("error")``. Also: the device tables upload only changed rows."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pagedkv.impl.serving import paged_kv
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, DecoderLayer
from pagedkv.impl.serving.paged_kv import DeviceBlockTables, PagedKVCache, PagedStep
from pagedkv.kernels import api
from properties.engine_cases import (
    CONFIG,
    MODEL,
    PRESSURE,
    Request,
    Workload,
    check_against_oracle,
    greedy_oracle,
    run,
    single_thread,  # noqa: F401 - an autouse fixture
)

VALUE_CHECKS = (
    "check_context_values",
    "check_cu_seqlens_values",
    "check_max_query_len",
    "check_position_values",
    "check_slot_values",
)
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


def shared(count: int, new: int, model: CausalLM = MODEL) -> Workload:
    """Greedy prompts over a shared prefix, chunked by a budget of 9."""
    requests = tuple(Request((*range(40, 52), i, i + 7), new, 1, 0.0, 0) for i in range(count))
    return Workload(requests, 4, 40, count, 9, model=model)


WINDOWED = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=5), seed=3)


@pytest.mark.parametrize(
    ("workload", "kwargs"),
    [(PRESSURE, {}), (shared(4, 8, WINDOWED), {}), (shared(3, 4), {"backend": "triton"})],
    ids=["pressure", "window", "triton"],
)
def test_the_layers_read_nothing_on_the_host(workload: Workload, kwargs: dict) -> None:
    """Chunks beside decodes, prefix hits, a window, triton, under the guard: dense outputs."""
    with no_host_reads_in_layers() as calls:
        result = run(workload, **kwargs)
    check_against_oracle(workload, result)
    metrics = result.engine.metrics
    assert calls and sum(m.prefix_hit_tokens for m in metrics) > 0
    assert any(m.num_decodes and m.num_batched_tokens > m.num_decodes for m in metrics)


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
    result = run(shared(4, 6, CausalLM.from_seed(CONFIG, seed=0).cuda()))
    expected = [[greedy_oracle(r.prompt, 6).tokens] for r in shared(4, 6).requests]
    assert [out.outputs for out in result.outputs] == expected


def test_device_tables_upload_only_changed_rows() -> None:
    """The buffer equals each step's tables, uploading only changed rows, growing when wider."""
    tables = DeviceBlockTables(torch.device("cpu"))
    steps = [  # the tables, and the rows uploaded so far: first, grown, unchanged, wider, fewer
        ([[3, -1], [5, 6]], 2), ([[3, 4], [5, 6]], 3), ([[3, 4], [5, 6]], 3),
        ([[3, 4], [5, 6], [7, -1]], 6), ([[5, 6]], 7),
    ]  # fmt: skip
    for rows, uploaded in steps:
        table = torch.tensor(rows, dtype=torch.int32)
        assert torch.equal(tables.update(table), table) and tables.num_uploaded_rows == uploaded


def test_an_engine_uploads_a_decode_step_s_changed_rows_only() -> None:
    """Decoding 8 sequences: a row uploads when its sequence takes a block, not every step."""
    engine = PagedAttentionEngine(MODEL, 64, 4, max_num_seqs=8, max_num_batched_tokens=128)
    engine.generate([[i + 1] * 6 for i in range(8)], 9)
    decode_steps = len(engine.metrics) - 1
    assert engine.kv.tables.num_uploaded_rows < decode_steps * 8 / 2


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
