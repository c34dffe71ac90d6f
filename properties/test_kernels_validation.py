"""Properties: invalid arguments raise a clear, typed error and leave the caches untouched.

Every case runs on every backend: each public function's arguments, prefill's and the sliding
window's included; the entries a window does not reach are not checked. A kernel launched on
bad block ids would read or write outside the caches (in the interpreter that kills the
process), so these checks are what keeps it in.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from properties.kernel_cases import (
    DEVICE,
    KVCache,
    Shape,
    assert_close,
    fixed_scenario,
    kernel_examples,
)

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 8
BACKENDS = ("triton", "numba", "reference")


@dataclass
class Setup:
    """A valid call's arguments; each case breaks one thing."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    query: torch.Tensor  # [2, 4, HEAD_DIM]: two sequences, GQA ratio 2
    block_tables: torch.Tensor  # [[3, 0, -1], [5, -1, -1]]
    context_lens: torch.Tensor  # [6, 2]
    key: torch.Tensor  # [3, KV_HEADS, HEAD_DIM]
    value: torch.Tensor
    slots: torch.Tensor  # [0, 7, -1]


def make_setup() -> Setup:
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DEVICE)

    return Setup(
        k_cache=randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        v_cache=randn(NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM),
        query=randn(2, 2 * KV_HEADS, HEAD_DIM),
        block_tables=torch.tensor([[3, 0, -1], [5, -1, -1]], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([6, 2], dtype=torch.int32, device=DEVICE),
        key=randn(3, KV_HEADS, HEAD_DIM),
        value=randn(3, KV_HEADS, HEAD_DIM),
        slots=torch.tensor([0, 7, -1], dtype=torch.int64, device=DEVICE),
    )


def ints(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def attention(s: Setup, backend: str, **changes: object) -> object:
    args = {
        "query": s.query,
        "k_cache": s.k_cache,
        "v_cache": s.v_cache,
        "block_tables": s.block_tables,
        "context_lens": s.context_lens,
    }
    return kernels.paged_decode_attention(**{**args, **changes}, backend=backend)


def store(s: Setup, backend: str, **changes: object) -> object:
    args = {
        "key": s.key,
        "value": s.value,
        "k_cache": s.k_cache,
        "v_cache": s.v_cache,
        "slot_mapping": s.slots,
    }
    return kernels.store_kv(**{**args, **changes}, backend=backend)


def slots(s: Setup, backend: str, **changes: object) -> object:
    args = {
        "block_tables": s.block_tables,
        "positions": ints([5, 1]),
        "block_size": BLOCK_SIZE,
    }
    return kernels.slot_mapping(**{**args, **changes}, backend=backend)


def copy(s: Setup, backend: str, pairs: object) -> object:
    return kernels.copy_blocks(s.k_cache, s.v_cache, pairs, backend=backend)


Call = Callable[[Setup, str], object]
# (id, call, error type, words the message must contain)
CASES: list[tuple[str, Call, type[Exception], str]] = [
    # --- meta tensors hold no values: no kernel can run on them (every tensor on meta; one alone
    # is a tensor on another device, below)
    (
        "attention on meta tensors",
        lambda s, b: attention(
            s,
            b,
            **{
                name: getattr(s, name).to("meta")
                for name in ("query", "k_cache", "v_cache", "block_tables", "context_lens")
            },
        ),
        ValueError,
        "k_cache is a meta tensor",
    ),
    (
        "slot mapping on meta tensors",
        lambda s, b: slots(
            s, b, block_tables=s.block_tables.to("meta"), positions=ints([5, 1]).to("meta")
        ),
        ValueError,
        "block_tables is a meta tensor",
    ),
    (
        "store on meta tensors",
        lambda s, b: kernels.store_kv(
            *(t.to("meta") for t in (s.key, s.value, s.k_cache, s.v_cache, s.slots)), backend=b
        ),
        ValueError,
        "k_cache is a meta tensor",
    ),
    # --- paged_decode_attention
    (
        "block id too large",
        lambda s, b: attention(s, b, block_tables=ints([[3, 6], [5, 0]])),
        IndexError,
        "block_tables[0, 1] = 6",
    ),
    (
        "block id -1 inside the context",
        lambda s, b: attention(s, b, block_tables=ints([[3, -1], [5, 0]])),
        IndexError,
        "block_tables[0, 1] = -1",
    ),
    (
        "context beyond the table",
        lambda s, b: attention(s, b, context_lens=ints([13, 2])),
        IndexError,
        "context_lens[0] = 13",
    ),
    (
        "negative context",
        lambda s, b: attention(s, b, context_lens=ints([6, -1])),
        ValueError,
        "context_lens[1]",
    ),
    (
        "context_lens float",
        lambda s, b: attention(s, b, context_lens=s.context_lens.float()),
        TypeError,
        "context_lens",
    ),
    (
        "context_lens wrong length",
        lambda s, b: attention(s, b, context_lens=ints([6])),
        ValueError,
        "context_lens",
    ),
    (
        "block_tables int64",
        lambda s, b: attention(s, b, block_tables=s.block_tables.long()),
        TypeError,
        "block_tables",
    ),
    (
        "block_tables rows",
        lambda s, b: attention(s, b, block_tables=s.block_tables[:1]),
        ValueError,
        "block_tables",
    ),
    (
        "heads not a multiple",
        lambda s, b: attention(s, b, query=s.query[:, :3]),
        ValueError,
        "num_heads",
    ),
    (
        "head_dim mismatch",
        lambda s, b: attention(s, b, query=s.query[..., :4]),
        ValueError,
        "head_dim",
    ),
    ("query dtype", lambda s, b: attention(s, b, query=s.query.half()), TypeError, "query"),
    ("query not a tensor", lambda s, b: attention(s, b, query=[1.0]), TypeError, "query"),
    ("v_cache shape", lambda s, b: attention(s, b, v_cache=s.v_cache[:5]), ValueError, "v_cache"),
    (
        "v_cache dtype",
        lambda s, b: attention(s, b, v_cache=s.v_cache.double()),
        TypeError,
        "v_cache",
    ),
    (
        "cache not contiguous",
        lambda s, b: attention(
            s, b, k_cache=s.k_cache.transpose(1, 2).contiguous().transpose(1, 2)
        ),
        ValueError,
        "contiguous",
    ),
    ("scale negative", lambda s, b: attention(s, b, scale=-1.0), ValueError, "scale"),
    ("num_splits zero", lambda s, b: attention(s, b, num_splits=0), ValueError, "num_splits"),
    ("num_splits huge", lambda s, b: attention(s, b, num_splits=65), ValueError, "num_splits"),
    (
        "tables on another device",
        lambda s, b: attention(s, b, block_tables=s.block_tables.to("meta")),
        ValueError,
        "block_tables is on meta",
    ),
    # --- store_kv
    (
        "slot beyond the cache",
        lambda s, b: store(s, b, slot_mapping=ints([0, 24, -1], torch.int64)),
        IndexError,
        "slot_mapping[1] = 24",
    ),
    (
        "slot below -1",
        lambda s, b: store(s, b, slot_mapping=ints([0, -2, 1], torch.int64)),
        IndexError,
        "slot_mapping[1] = -2",
    ),
    (
        "slot written twice",
        lambda s, b: store(s, b, slot_mapping=ints([3, 3, -1], torch.int64)),
        ValueError,
        "twice",
    ),
    (
        "slot_mapping length",
        lambda s, b: store(s, b, slot_mapping=ints([0, 1], torch.int64)),
        ValueError,
        "slot_mapping",
    ),
    ("key dtype", lambda s, b: store(s, b, key=s.key.half()), TypeError, "key"),
    ("key heads", lambda s, b: store(s, b, key=s.key[:, :1]), ValueError, "key"),
    ("value tokens", lambda s, b: store(s, b, value=s.value[:2]), ValueError, "value"),
    ("integer cache", lambda s, b: store(s, b, k_cache=s.k_cache.int()), TypeError, "k_cache"),
    # --- slot_mapping
    (
        "position beyond capacity",
        lambda s, b: slots(s, b, positions=ints([12, 0])),
        IndexError,
        "positions[0] = 12",
    ),
    (
        "position reaches padding",
        lambda s, b: slots(s, b, positions=ints([5, 4])),
        IndexError,
        "block_tables[1, 1] = -1",
    ),
    (
        "position below -1",
        lambda s, b: slots(s, b, positions=ints([-2, 0])),
        ValueError,
        "positions[0]",
    ),
    (
        "entry beyond num_blocks",
        lambda s, b: slots(s, b, num_blocks=5),
        IndexError,
        "block_tables[1, 0] = 5",
    ),
    (
        "seq id out of range",
        lambda s, b: slots(s, b, positions=ints([1, 1]), seq_ids=ints([0, 2])),
        IndexError,
        "seq_ids[1] = 2",
    ),
    (
        "positions per sequence",
        lambda s, b: slots(s, b, positions=ints([1, 1, 1])),
        ValueError,
        "positions",
    ),
    ("block_size zero", lambda s, b: slots(s, b, block_size=0), ValueError, "block_size"),
    ("block_size bool", lambda s, b: slots(s, b, block_size=True), TypeError, "block_size"),
    # --- copy_blocks
    (
        "copy dst too large",
        lambda s, b: copy(s, b, [(0, 1), (2, 6)]),
        IndexError,
        "pairs[1] dst = 6",
    ),
    ("copy src negative", lambda s, b: copy(s, b, [(-1, 1)]), IndexError, "pairs[0] src = -1"),
    ("copy not a pair", lambda s, b: copy(s, b, [(0, 1, 2)]), ValueError, "pairs[0]"),
    ("copy float id", lambda s, b: copy(s, b, [(0.0, 1)]), TypeError, "pairs[0] src"),
    ("copy tensor shape", lambda s, b: copy(s, b, ints([[0, 1, 2]])), ValueError, "pairs"),
    # --- backend
    ("unknown backend", lambda s, b: attention(s, "gpu"), ValueError, "backend"),
    ("backend not a str", lambda s, b: attention(s, 1), TypeError, "backend must be a str"),
    # --- integer ranges, numeric edges, flags and aliasing
    (
        "block_size wraps int64",
        lambda s, b: slots(s, b, block_size=2**61),
        ValueError,
        "<= 4294967296",
    ),
    (
        "block_size beyond int64",
        lambda s, b: slots(s, b, block_size=2**63),
        ValueError,
        "block_size",
    ),
    (
        "num_blocks beyond int32",
        lambda s, b: slots(s, b, num_blocks=2**31 + 1),
        ValueError,
        "num_blocks",
    ),
    ("scale is inf in fp32", lambda s, b: attention(s, b, scale=1e39), ValueError, "in fp32"),
    ("scale is 0 in fp32", lambda s, b: attention(s, b, scale=1e-50), ValueError, "in fp32"),
    ("validate not a bool", lambda s, b: store(s, b, validate=1), TypeError, "validate"),
    (
        "caches overlap",
        lambda s, b: attention(s, b, **overlapping(s)),
        ValueError,
        "k_cache and v_cache must not share memory",
    ),
    (
        "key is a view of the cache",
        lambda s, b: store(s, b, key=s.k_cache.view(-1)[: s.key.numel()].view(s.key.shape)),
        ValueError,
        "key and k_cache must not share memory",
    ),
    (
        "context beyond int32",
        lambda s, b: long_context_attention(b, 2**31),
        ValueError,
        "context_lens[0] = 2147483648 exceeds 2147483647",
    ),
]


def overlapping(s: Setup) -> dict[str, torch.Tensor]:
    """Caches that are two views of one buffer overlapping by half: what a caller slicing one
    allocation into K and V wrongly would pass."""
    numel, shape = s.k_cache.numel(), s.k_cache.shape
    buffer = torch.cat([s.k_cache.view(-1), s.v_cache.view(-1)])
    start = numel // 2
    return {
        "k_cache": buffer[:numel].view(shape),
        "v_cache": buffer[start : start + numel].view(shape),
    }


def long_context_attention(backend: str, context_len: int) -> object:
    """Attention over a table whose capacity (2**32 tokens) exceeds int32, cheaply: one block of
    2**20 tokens, read 4096 times."""
    cache = torch.zeros(1, 2**20, 1, 2, device=DEVICE)
    tables = torch.zeros(1, 4096, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([context_len], dtype=torch.int64, device=DEVICE)
    query = torch.zeros(1, 1, 2, device=DEVICE)
    return kernels.paged_decode_attention(
        query, cache, cache.clone(), tables, lens, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("call", "error", "words"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_invalid_call_raises_and_changes_nothing(
    call: Call, error: type[Exception], words: str, backend: str
) -> None:
    setup = make_setup()
    before = (setup.k_cache.clone(), setup.v_cache.clone())
    with pytest.raises(error, match=re.escape(words)):
        call(setup, backend)
    assert torch.equal(setup.k_cache, before[0])
    assert torch.equal(setup.v_cache, before[1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_valid_setup_is_valid(backend: str) -> None:
    """The base of every case above runs: each case fails for the one thing it breaks."""
    setup = make_setup()
    attention(setup, backend)
    store(setup, backend)
    assert slots(setup, backend).tolist() == [0 * BLOCK_SIZE + 1, 5 * BLOCK_SIZE + 1]
    copy(setup, backend, [(0, 1)])


@settings(max_examples=kernel_examples(30))
@given(
    tokens=st.integers(1, 12),
    bad_at=st.integers(0, 11),
    bad_slot=st.one_of(st.integers(-50, -2), st.integers(NUM_BLOCKS * BLOCK_SIZE, 10**6)),
    backend=st.sampled_from(BACKENDS),
)
def test_one_bad_slot_anywhere_means_no_write_at_all(
    tokens: int, bad_at: int, bad_slot: int, backend: str
) -> None:
    setup = make_setup()
    before = (setup.k_cache.clone(), setup.v_cache.clone())
    slot_list = list(range(tokens))
    slot_list[bad_at % tokens] = bad_slot
    key = torch.ones(tokens, KV_HEADS, HEAD_DIM, device=DEVICE)
    with pytest.raises(IndexError, match="slot_mapping"):
        kernels.store_kv(key, key, setup.k_cache, setup.v_cache, ints(slot_list), backend=backend)
    assert torch.equal(setup.k_cache, before[0])
    assert torch.equal(setup.v_cache, before[1])


@settings(max_examples=kernel_examples(30))
@given(
    pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=5),
    bad=st.tuples(st.integers(0, 5), st.integers(6, 100)).map(lambda p: p[::-1] if p[0] % 2 else p),
    at=st.integers(0, 5),
    backend=st.sampled_from(BACKENDS),
)
def test_one_bad_pair_anywhere_means_no_copy_at_all(
    pairs: list[tuple[int, int]], bad: tuple[int, int], at: int, backend: str
) -> None:
    setup = make_setup()
    before = (setup.k_cache.clone(), setup.v_cache.clone())
    pairs.insert(at % (len(pairs) + 1), bad)
    with pytest.raises(IndexError, match="pairs"):
        copy(setup, backend, pairs)
    assert torch.equal(setup.k_cache, before[0])
    assert torch.equal(setup.v_cache, before[1])


# ----------------------------------------------------------------------- prefill and windows


def valid_prefill() -> dict[str, object]:
    """Arguments of a valid prefill: two sequences of 5 and 3 tokens computing 2 and 3 of them."""
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DEVICE)

    return {
        "query": randn(5, 4, 8),
        "k_cache": randn(4, 4, 2, 8),
        "v_cache": randn(4, 4, 2, 8),
        "block_tables": ints([[2, 0], [3, -1]]),
        "cu_seqlens_q": ints([0, 2, 5], torch.int64),
        "context_lens": ints([5, 3], torch.int64),
    }


PREFILL_CASES = {
    "cu_seqlens_q float": ("cu_seqlens_q", torch.tensor([0.0, 2.0, 5.0]), TypeError),
    "cu_seqlens_q not batch + 1": ("cu_seqlens_q", torch.tensor([0, 5]), ValueError),
    "cu_seqlens_q not from 0": ("cu_seqlens_q", torch.tensor([1, 2, 5]), ValueError),
    "cu_seqlens_q short of the tokens": ("cu_seqlens_q", torch.tensor([0, 2, 4]), ValueError),
    "cu_seqlens_q decreasing": ("cu_seqlens_q", torch.tensor([0, 6, 5]), ValueError),
    "more queries than context": ("cu_seqlens_q", torch.tensor([0, 1, 5]), ValueError),
    "context_lens wrong length": ("context_lens", torch.tensor([5, 3, 1]), ValueError),
    "context beyond the table": ("context_lens", torch.tensor([9, 3]), IndexError),
    "negative context": ("context_lens", torch.tensor([5, -3]), ValueError),
    "block id outside the cache": ("block_tables", torch.tensor([[2, 4], [3, -1]]), TypeError),
    "block id outside the cache (int32)": (
        "block_tables",
        torch.tensor([[2, 4], [3, -1]], dtype=torch.int32),
        IndexError,
    ),
    "reached padding entry": (
        "block_tables",
        torch.tensor([[2, -1], [3, -1]], dtype=torch.int32),
        IndexError,
    ),
    "query 2-d": ("query", torch.zeros(5, 32), ValueError),
    "query heads not a multiple": ("query", torch.zeros(5, 3, 8), ValueError),
    "query dtype": ("query", torch.zeros(5, 4, 8, dtype=torch.float16), TypeError),
    "max_query_len not the longest chunk": ("max_query_len", 2, ValueError),
    "max_query_len negative": ("max_query_len", -1, ValueError),
    "max_query_len not an int": ("max_query_len", 3.0, TypeError),
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_valid_prefill_passes_with_or_without_max_query_len(backend: str) -> None:
    """With or without ``max_query_len`` (3, the longest chunk), the reference's output."""
    call = valid_prefill()
    expected = kernels.paged_prefill_attention(**call, backend="reference")
    for extra in ({}, {"max_query_len": 3}):
        output = kernels.paged_prefill_attention(**call, **extra, backend=backend)
        assert_close(output, expected, f"{backend} vs reference, {extra}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(PREFILL_CASES), ids=list(PREFILL_CASES))
def test_invalid_prefill_raises(case: str, backend: str) -> None:
    name, value, error = PREFILL_CASES[case]
    call = {**valid_prefill(), name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value}
    with pytest.raises(error, match=name.split("_")[0] if error is not IndexError else None):
        kernels.paged_prefill_attention(**call, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_window_is_checked(backend: str) -> None:
    """``window`` is an int >= 1, and an entry inside the window is still checked."""
    cache = KVCache(fixed_scenario(4), Shape(4, 2, 2, 64, torch.float32))
    _, tables, lens = cache.batch()
    query = cache.randn(tables.shape[0], 4, 64)
    args = (query, cache.k_cache, cache.v_cache, tables, lens)
    contiguous = (query, cache.k_cache[: tables.shape[0]], cache.v_cache[: tables.shape[0]])
    for bad, error in ((0, ValueError), (-3, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="window"):
            kernels.paged_decode_attention(*args, window=bad, backend=backend)
        with pytest.raises(error, match="window"):
            kernels.contiguous_decode_attention(
                *contiguous, torch.ones_like(lens), window=bad, backend=backend
            )
    last = (int(lens[0]) - 1) // 4  # the first sequence's last block
    broken = tables.clone()
    broken[0, last] = -1
    with pytest.raises(IndexError, match=rf"block_tables\[0, {last}\]"):
        kernels.paged_decode_attention(*args[:3], broken, lens, window=1, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_window_is_checked(backend: str) -> None:
    """``window`` is an int >= 1, and only the entries a window reaches are validated."""
    call = valid_prefill()
    for bad, error in ((0, ValueError), (-1, ValueError), (3.0, TypeError), (False, TypeError)):
        with pytest.raises(error, match="window"):
            kernels.paged_prefill_attention(**call, window=bad, backend=backend)
    # Sequence 0 has 8 tokens and one query, at 7; sequence 1 has 3 tokens, all queries. Window
    # 4 reads positions 4 .. 7 of sequence 0, entry 1 alone, so entry 0 may hold anything;
    # window 5 reaches position 3, so entry 0 is read, and checked.
    call["context_lens"] = ints([8, 3], torch.int64)
    call["query"] = torch.randn(4, 4, 8).to(DEVICE)
    call["cu_seqlens_q"] = ints([0, 1, 4], torch.int64)
    for window, entry_read in ((4, False), (5, True)):
        args = {**call, "block_tables": ints([[-1, 0], [3, -1]]), "window": window}
        if entry_read:
            with pytest.raises(IndexError, match=r"block_tables\[0, 0\]"):
                kernels.paged_prefill_attention(**args, backend=backend)
        else:  # and the output is that of a table whose entry 0 is a real block
            real = {**args, "block_tables": ints([[2, 0], [3, -1]])}
            expected = kernels.paged_prefill_attention(**real, backend=backend)
            assert torch.equal(kernels.paged_prefill_attention(**args, backend=backend), expected)
