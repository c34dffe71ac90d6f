"""Properties: a step's layer loop reads no tensor value on the host (no GPU synchronization).

``PagedKVCache.step`` validates everything before the first layer runs, and the layers call the
kernels with ``validate=False``. On the CPU that is checked by instrumentation: while any
decoder layer runs, ``Tensor.tolist``, ``Tensor.item``, ``bool``/``int``/``float`` of a tensor
and every value check of ``kernels.check_values`` raise :class:`HostRead`. A real engine run
(mixed prefill chunks and decodes, prefix-cache hits, forks, preemption; with and without a
sliding window; the reference backend's fast path and the triton kernels) must then still
finish with the dense oracle's tokens. A planted ``.tolist()``
in the attention is caught. On CUDA, the same run happens under
``torch.cuda.set_sync_debug_mode("error")`` around the layers. The persistent device
block-table buffer uploads only the rows that changed, and a step with bad tables is refused
before anything changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pagedkv.impl.serving import paged_kv
from pagedkv.impl.serving.dense import dense_generate
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, DecoderLayer
from pagedkv.impl.serving.paged_kv import DeviceBlockTables, PagedKVCache, PagedStep
from pagedkv.kernels import api
from properties.engine_cases import CONFIG, MODEL, check_against_oracle, one_thread, run
from properties.test_engine import PRESSURE

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


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    with one_thread():
        yield


@contextmanager
def no_host_reads_in_layers() -> Iterator[list[int]]:
    """While a ``DecoderLayer`` runs, host reads and value checks raise :class:`HostRead`
    (until the context exits). Yields a list that gets one entry per layer call, so a test can
    see the layers ran."""
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


def test_the_layers_read_nothing_on_the_host() -> None:
    """The pressure workload (chunked prompts with decodes, prefix hits, forks, preemption)
    under the guard still gives the dense oracle's tokens."""
    with no_host_reads_in_layers() as calls:
        result = run(PRESSURE)
    check_against_oracle(PRESSURE, result)
    metrics = result.engine.metrics
    assert calls
    assert any(m.num_decodes and m.num_batched_tokens > m.num_decodes for m in metrics)
    assert sum(m.prefix_hit_tokens for m in metrics) > 0


WINDOW = 5


def test_the_layers_read_nothing_on_the_host_with_a_window() -> None:
    """Greedy prompts longer than the window, chunked, with a shared prefix, through a windowed
    model, under the guard: the tokens equal dense decoding."""
    model = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=WINDOW), seed=3)
    prompts = [[*range(40, 52), i, i + 7] for i in range(4)]
    engine = PagedAttentionEngine(
        model, 40, 4, max_num_seqs=4, max_num_batched_tokens=9, enable_prefix_caching=True
    )
    with no_host_reads_in_layers():
        outputs = engine.generate(prompts, 8)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0] == dense_generate(model, tuple(prompt), 8).tokens
    assert sum(m.prefix_hit_tokens for m in engine.metrics) > 0


def test_the_triton_layers_read_nothing_on_the_host() -> None:
    """The triton backend (the interpreter here; the kernels a GPU compiles), chunked prompts
    over a shared prefix, under the guard: the dense oracle's tokens."""
    prompts = [[*range(40, 52), i, i + 7] for i in range(3)]
    engine = PagedAttentionEngine(
        MODEL, 40, 4, max_num_seqs=3, max_num_batched_tokens=9, enable_prefix_caching=True,
        backend="triton",
    )  # fmt: skip
    with no_host_reads_in_layers() as calls:
        outputs = engine.generate(prompts, 4)
    assert calls
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0] == dense_generate(MODEL, tuple(prompt), 4).tokens


def test_the_guard_catches_a_host_read_in_the_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: an attention that reads the context lengths on the host is caught."""
    attend = PagedStep.attend

    def reading(self: PagedStep, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.context_lens.tolist()
        return attend(self, *args, **kwargs)

    monkeypatch.setattr(PagedStep, "attend", reading)
    with pytest.raises(HostRead, match="tolist"), no_host_reads_in_layers():
        run(PRESSURE)


def test_the_guard_catches_a_value_check_in_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: a layer that validates its kernel arguments again (``validate=True``) is caught."""
    attend = PagedStep.attend

    def validating(self: PagedStep, layer: int, query: torch.Tensor, *args: Any) -> torch.Tensor:
        cache = self.cache
        api.paged_prefill_attention(
            query, cache.k[layer], cache.v[layer], self.block_tables, self.cu_seqlens_q,
            self.context_lens, backend="reference",
        )  # fmt: skip
        return attend(self, layer, query, *args)

    monkeypatch.setattr(PagedStep, "attend", validating)
    with pytest.raises(HostRead, match="check_"), no_host_reads_in_layers():
        run(PRESSURE)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_cuda_synchronization_in_the_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU: the layers run under ``set_sync_debug_mode("error")``, which raises on any
    synchronizing call, with the engine on CUDA (triton backend)."""
    layer_forward = DecoderLayer.forward

    def forward(self: DecoderLayer, *args: Any) -> torch.Tensor:
        torch.cuda.set_sync_debug_mode("error")
        try:
            return layer_forward(self, *args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(DecoderLayer, "forward", forward)
    model = CausalLM.from_seed(CONFIG, seed=0).cuda()
    prompts = [[*range(40, 52), i, i + 7] for i in range(4)]
    engine = PagedAttentionEngine(
        model, 40, 4, max_num_seqs=4, max_num_batched_tokens=9, enable_prefix_caching=True
    )
    outputs = engine.generate(prompts, 6)
    cpu = CausalLM.from_seed(CONFIG, seed=0)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0] == dense_generate(cpu, tuple(prompt), 6).tokens


def test_device_tables_upload_only_changed_rows() -> None:
    """The persistent buffer ends equal to each step's tables, uploading only rows that differ
    from what it holds (a grown row, a new sequence), and grows for a wider batch."""
    tables = DeviceBlockTables(torch.device("cpu"))
    first = torch.tensor([[3, -1], [5, 6]], dtype=torch.int32)
    assert torch.equal(tables.update(first), first) and tables.num_uploaded_rows == 2
    grown = torch.tensor([[3, 4], [5, 6]], dtype=torch.int32)
    assert torch.equal(tables.update(grown), grown) and tables.num_uploaded_rows == 3
    assert torch.equal(tables.update(grown), grown) and tables.num_uploaded_rows == 3
    wider = torch.tensor([[3, 4], [5, 6], [7, -1]], dtype=torch.int32)
    assert torch.equal(tables.update(wider), wider) and tables.num_uploaded_rows == 6
    fewer = torch.tensor([[5, 6]], dtype=torch.int32)
    assert torch.equal(tables.update(fewer), fewer) and tables.num_uploaded_rows == 7


def test_an_engine_uploads_a_decode_step_s_changed_rows_only() -> None:
    """Decoding 8 sequences with blocks of 4 for 8 steps: a row is uploaded when its sequence
    takes a block, not every step."""
    engine = PagedAttentionEngine(MODEL, 64, 4, max_num_seqs=8, max_num_batched_tokens=128)
    engine.generate([[i + 1] * 6 for i in range(8)], 9)
    decode_steps = len(engine.metrics) - 1
    assert engine.kv.tables.num_uploaded_rows < decode_steps * 8 / 2


def test_a_checked_step_is_validated_before_anything_changes() -> None:
    """With ``check_tables`` (the debug mode) bad tables are refused by ``PagedKVCache.step``,
    naming the argument, before the device buffer changes: tables not on the host, an entry
    outside the pool, a slot written twice."""
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
    """By default a step checks no value of the tables and lengths the store built (a wrong
    entry passes), maps every slot once, and an engine's run still equals the oracle's; a
    cache's ``check_tables`` must be a bool."""
    for name in VALUE_CHECKS:
        if hasattr(paged_kv, name):
            monkeypatch.setattr(paged_kv, name, _refuse)
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


def _refuse(*args: object) -> None:
    raise AssertionError("a trusted step checked a value")
