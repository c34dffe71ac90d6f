"""The numba backend's own properties: its split count, parallel drivers equal to the serial ones,
``exp32`` and ``sum_in_order`` (what it computes is in ``test_kernels_agreement``)."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.kernels import numba_attention, numba_runtime
from properties import kernel_cases as kc

pytestmark = pytest.mark.skipif(kc.DEVICE.type != "cpu", reason="the numba backend runs on CPU")


def test_splits_follow_the_threads_and_the_length() -> None:
    """One split once the batch gives every thread a program; else enough for the threads, each
    at least ``MIN_TOKENS_PER_SPLIT`` long."""
    choose = numba_attention.choose_num_splits
    assert choose(programs=64, max_tokens=4096, threads=16) == 1
    assert choose(programs=2, max_tokens=4096, threads=16) == 8
    assert choose(programs=2, max_tokens=300, threads=16) == 1
    assert choose(programs=1, max_tokens=10**9, threads=1000) == 64


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="numba's pool has one thread")
@pytest.mark.parametrize("block_size", [1, 16])
def test_the_parallel_drivers_equal_the_serial_ones(
    block_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The property tests' calls are below ``PARALLEL_MIN_BYTES`` (serial drivers); with it at 0
    and two threads the pool runs the same programs to the same bits (thread-chosen splits too)."""
    shape = kc.Shape(block_size, 2, 4, 64, torch.float32)
    cache = kc.KVCache(kc.fixed_scenario(block_size), shape, backend="numba")
    prefill = kc.prefill_on("numba")
    seqs, tables, lens = cache.batch(extra_columns=1, padding_row=True)
    query = cache.randn(len(seqs), 8, 64)
    query_lens = [seq.length if seq else 0 for seq in seqs]
    flat = cache.randn(sum(query_lens), 8, 64)
    offsets = torch.tensor([0, *query_lens]).cumsum(0)
    args = (cache.k_cache, cache.v_cache, tables)

    def both() -> tuple[torch.Tensor, ...]:
        return (
            kc.decode_on("numba", 2)(query, *args, lens, 0.125, window=5),
            kc.decode_on("numba")(query, *args, lens, 0.125),
            prefill(flat, *args, offsets, lens, 0.125, window=7),
        )

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        serial = both()
        monkeypatch.setattr(numba_runtime, "PARALLEL_MIN_BYTES", 0)
        parallel = both()
        kc.check_attention(cache, kc.decode_on("numba"), extra_columns=1, padding_row=True)
        kc.check_attention(cache, prefill, query_lens[:-1])
    finally:
        torch.set_num_threads(threads)
    for one, other in zip(serial, parallel, strict=True):
        assert torch.equal(one, other)


@numba.njit(fastmath=numba_runtime.FASTMATH)  # the kernels' flags, which exp32 must withstand
def _exp32_all(values: np.ndarray) -> np.ndarray:
    out = np.empty_like(values)
    for i in range(values.size):
        out[i] = numba_runtime.exp32(values[i])
    return out


@numba.njit
def _sum_in_order_of(values: np.ndarray) -> np.float32:
    return numba_runtime.sum_in_order(values)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(-100.0, 88.0, width=32), min_size=1, max_size=64))
def test_exp32_is_exp_within_its_bound(xs: list[float]) -> None:
    """The softmax's exp: within 1.5e-7 relative of float64's exp from fp32's smallest normal
    up to 88, exactly 0 below it."""
    values = np.array(xs, dtype=np.float32)
    got = _exp32_all(values).astype(np.float64)
    want = np.exp(values.astype(np.float64))
    normal = values >= numba_runtime.EXP_MIN
    assert np.all(np.abs(got[normal] - want[normal]) <= 1.5e-7 * want[normal])
    assert np.all(got[~normal] == 0.0)


def test_exp32_special_values() -> None:
    """1 at 0, 0 at -inf, NaN at NaN (a poisoned score must reach the output)."""
    got = _exp32_all(np.array([0.0, -np.inf, np.nan], dtype=np.float32))
    assert got[0] == 1.0 and got[1] == 0.0 and np.isnan(got[2])


@given(st.lists(st.floats(-1e3, 1e3, width=32), max_size=40))
def test_sum_in_order_adds_left_to_right(xs: list[float]) -> None:
    """Bit for bit the fp32 sum added in index order (what keeps the drivers' outputs equal)."""
    values = np.array(xs, dtype=np.float32)
    expected = np.float32(0.0)
    for value in values:
        expected = np.float32(expected + value)
    assert _sum_in_order_of(values) == expected
