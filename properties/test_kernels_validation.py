"""Properties: invalid arguments raise a clear, typed error naming the argument and leave every
tensor untouched, on every backend (a kernel on bad block ids would read or write outside the
caches, killing the process); fp8 caches refuse bad scales and dtypes; degenerate valid calls work
as the reference's."""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv import kernels
from properties.kernel_cases import DEVICE, assert_close, kernel_examples

NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 6, 4, 2, 8
BACKENDS = ("triton", "numba", "reference")
FUNCTIONS: dict[str, Callable[..., object]] = {
    "decode": kernels.paged_decode_attention,
    "contiguous": kernels.contiguous_decode_attention,
    "prefill": kernels.paged_prefill_attention,
    "store": kernels.store_kv,
    "slots": kernels.slot_mapping,
    "copy": kernels.copy_blocks,
}
FP8_CALLS = ("store", "decode", "prefill")  # each also called on e4m3 copies of its caches
FUNCTIONS |= {f"fp8 {function}": FUNCTIONS[function] for function in FP8_CALLS}
Args = dict[str, object]


def ints(values: list[int] | list[list[int]], dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def valid_args() -> dict[str, Args]:
    """A valid call of each function (decode: 6 and 2 tokens, GQA 2; prefill: 2 of 5, 3 of 3)."""
    generator = torch.Generator().manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=generator).to(DEVICE)

    cache_size = (NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache, v_cache = randn(*cache_size), randn(*cache_size)
    query = randn(2, 2 * KV_HEADS, HEAD_DIM)
    key, value = randn(3, KV_HEADS, HEAD_DIM), randn(3, KV_HEADS, HEAD_DIM)
    tables, caches = ints([[3, 0, -1], [5, -1, -1]]), {"k_cache": k_cache, "v_cache": v_cache}
    prefill = {"query": randn(5, 4, 8), "k_cache": randn(4, 4, 2, 8), "v_cache": randn(4, 4, 2, 8)}
    prefill.update(block_tables=ints([[2, 0], [3, -1]]), cu_seqlens_q=ints([0, 2, 5], torch.int64))
    slot_mapping = ints([0, 7, -1], torch.int64)
    contiguous = {"query": query, "key": k_cache[:2], "value": v_cache[:2]}
    calls: dict[str, Args] = {
        "decode": {"query": query, **caches, "block_tables": tables, "context_lens": ints([6, 2])},
        "contiguous": {**contiguous, "context_lens": ints([4, 2])},
        "store": {"key": key, "value": value, **caches, "slot_mapping": slot_mapping},
        "slots": {"block_tables": tables, "positions": ints([5, 1]), "block_size": BLOCK_SIZE},
        "copy": {**caches, "pairs": [(0, 1)]},
        "prefill": {**prefill, "context_lens": ints([5, 3], torch.int64)},
    }
    for function in FP8_CALLS:
        source = prefill if function == "prefill" else caches
        fp8 = {c: source[c].to(torch.float8_e4m3fn) for c in caches}
        calls[f"fp8 {function}"] = {**calls[function], **fp8}
    return calls


Case = tuple[str, Callable[[Args], Args]]  # (function, a valid call's arguments -> the case's)


def changing(function: str) -> Callable[..., Case]:
    """Cases of ``function`` that replace arguments: a callable is applied to the valid value; a
    list becomes an int tensor of the replaced tensor's dtype (int32 for a new argument)."""

    def case(**changes: object) -> Case:
        def edit(args: Args) -> Args:
            out = dict(args)
            for name, change in changes.items():
                old = args.get(name)
                if callable(change):
                    out[name] = change(old)
                elif isinstance(change, list) and not isinstance(old, list):
                    dtype = old.dtype if isinstance(old, torch.Tensor) else torch.int32
                    out[name] = ints(change, dtype)
                else:
                    out[name] = change
            return out

        return function, edit

    return case


decode, contiguous, prefill = changing("decode"), changing("contiguous"), changing("prefill")
store, slots, copy = changing("store"), changing("slots"), changing("copy")
fp8_store, fp8_decode, fp8_prefill = (changing(f"fp8 {f}") for f in FP8_CALLS)


def each(function: str, name: str, *values: object) -> dict[str, Case]:
    """A case a value of argument ``name`` of ``function`` (as ``changing`` takes it)."""
    return {f"{function} {name}={v!r}": changing(function)(**{name: v}) for v in values}


def refused(words: str, cases: dict[str, Case]) -> dict[str, tuple[str, Case]]:
    return {name: (words, case) for name, case in cases.items()}


def floats(*values: float, dtype: torch.dtype = torch.float32) -> Callable[[object], torch.Tensor]:
    """A change to a tensor of ``values`` on the device (a scale)."""
    return lambda _: torch.tensor(values, dtype=dtype, device=DEVICE)


def meta(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to("meta")


def all_meta(args: Args) -> Args:
    return {name: meta(value) for name, value in args.items()}  # type: ignore[arg-type]


def overlapping(args: Args) -> Args:
    """Caches that are two views of one buffer overlapping by half: what a caller slicing one
    allocation into K and V wrongly would pass."""
    k, v = args["k_cache"], args["v_cache"]
    assert isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)
    buffer, size = torch.cat([k.view(-1), v.view(-1)]), k.numel()
    k_view, v_view = buffer[:size].view(k.shape), buffer[size // 2 :][:size].view(k.shape)
    return {**args, "k_cache": k_view, "v_cache": v_view}


def in_cache(row: str, cache: str) -> Callable[[Args], Args]:
    """``row`` (key or value) made a view of ``cache``'s first elements: they share memory."""

    def edit(args: Args) -> Args:
        buffer, tokens = args[cache], args[row]
        assert isinstance(buffer, torch.Tensor) and isinstance(tokens, torch.Tensor)
        return {**args, row: buffer.view(-1)[: tokens.numel()].view(tokens.shape)}

    return edit


def long_context(args: Args) -> Args:
    """A table whose capacity (2**32 tokens) exceeds int32, cheaply: one block of 2**20 tokens,
    read 4096 times, and a context of 2**31."""
    cache = torch.zeros(1, 2**20, 1, 2, device=DEVICE)
    return {
        "query": torch.zeros(1, 1, 2, device=DEVICE),
        "k_cache": cache,
        "v_cache": cache.clone(),
        "block_tables": torch.zeros(1, 4096, dtype=torch.int32, device=DEVICE),
        "context_lens": ints([2**31], torch.int64),
    }


# Each table: case id -> (words the message must contain, case). Meta tensors hold no values,
# so no kernel can run on them (every tensor on meta; one alone is on another device).
INDEX_ERRORS: dict[str, tuple[str, Case]] = {
    "block id too large": ("block_tables[0, 1] = 6", decode(block_tables=[[3, 6], [5, 0]])),
    "block id -1": ("block_tables[0, 1] = -1", decode(block_tables=[[3, -1], [5, 0]])),
    "block id -1 in a window": (
        "block_tables[0, 1] = -1", decode(block_tables=[[3, -1], [5, 0]], window=1)),
    "context beyond the table": ("context_lens[0] = 13", decode(context_lens=[13, 2])),
    "context reaches padding": ("block_tables[0, 2] = -1", decode(context_lens=[9, 2])),
    "slot beyond the cache": ("slot_mapping[1] = 24", store(slot_mapping=[0, 24, -1])),
    "slot below -1": ("slot_mapping[1] = -2", store(slot_mapping=[0, -2, 1])),
    "position beyond capacity": ("positions[0] = 12", slots(positions=[12, 0])),
    "position reaches padding": ("block_tables[1, 1] = -1", slots(positions=[5, 4])),
    "entry beyond num_blocks": ("block_tables[1, 0] = 5", slots(num_blocks=5)),
    "seq id out of range": ("seq_ids[1] = 2", slots(positions=[1, 1], seq_ids=[0, 2])),
    "copy dst too large": ("pairs[1] dst = 6", copy(pairs=[(0, 1), (2, 6)])),
    "copy src negative": ("pairs[0] src = -1", copy(pairs=[(-1, 1)])),
    "prefill context beyond the table": ("context_lens[0] = 9", prefill(context_lens=[9, 3])),
    "prefill block id 4": ("block_tables[0, 1] = 4", prefill(block_tables=[[2, 4], [3, 0]])),
    "prefill reached padding": ("block_tables[0, 1] = -1", prefill(block_tables=[[2, -1], [3, 0]])),
}  # fmt: skip
VALUE_ERRORS: dict[str, tuple[str, Case]] = {
    "attention on meta": ("k_cache is a meta tensor", ("decode", all_meta)),
    "slots on meta": ("block_tables is a meta tensor", slots(block_tables=meta, positions=meta)),
    "store on meta": ("k_cache is a meta tensor", ("store", all_meta)),
    "tables on another device": ("block_tables is on meta", decode(block_tables=meta)),
    "negative context": ("context_lens[1]", decode(context_lens=[6, -1])),
    "context_lens wrong length": ("context_lens", decode(context_lens=[6])),
    "block_tables rows": ("block_tables", decode(block_tables=lambda t: t[:1])),
    "heads not a multiple": ("num_heads", decode(query=lambda q: q[:, :3])),
    "head_dim mismatch": ("head_dim", decode(query=lambda q: q[..., :4])),
    "v_cache shape": ("v_cache", decode(v_cache=lambda v: v[:5])),
    "cache not contiguous": (  # block and head dimensions swapped in memory
        "contiguous", decode(k_cache=lambda k: k.transpose(1, 2).contiguous().transpose(1, 2))),
    **refused("scale must be finite and > 0",
              each("decode", "scale", -1.0, 0.0, -5e-324, math.inf, -math.inf, math.nan)),
    "scale is inf in fp32": ("in fp32", decode(scale=1e39)),
    "scale is 0 in fp32": ("in fp32", decode(scale=1e-50)),
    "num_splits zero": ("num_splits", decode(num_splits=0)),
    **refused("num_splits", each("decode", "num_splits", 65, -1)),
    "max_context_len not the longest": (
        "max_context_len = 5, but the longest context in context_lens has 6 tokens",
        decode(max_context_len=5)),
    "contiguous max_context_len negative": ("max_context_len", contiguous(max_context_len=-1)),
    **{f"{function} window {window}": ("window", changing(function)(window=window))
       for function in ("decode", "contiguous", "prefill") for window in (0, -1, -3)},
    **{f"{function} caches overlap": ("k_cache and v_cache must not share", (function, overlapping))
       for function in ("decode", "store", "copy")},
    "context beyond int32": (
        "context_lens[0] = 2147483648 exceeds 2147483647", ("decode", long_context)),
    "slot written twice": ("twice", store(slot_mapping=[3, 3, -1])),
    "slot_mapping length": ("slot_mapping", store(slot_mapping=[0, 1])),
    "key heads": ("key", store(key=lambda k: k[:, :1])),
    "value tokens": ("value", store(value=lambda v: v[:2])),
    **{f"{row} in the cache": (f"{row} and {cache} must not share memory",
                               ("store", in_cache(row, cache)))
       for row, cache in (("key", "k_cache"), ("value", "v_cache"))},
    "position below -1": ("positions[0]", slots(positions=[-2, 0])),
    "positions per sequence": ("positions", slots(positions=[1, 1, 1])),
    **refused("block_size must be >= 1", each("slots", "block_size", 0, -3)),
    **refused("<= 4294967296", each("slots", "block_size", 2**32 + 1, 2**61)),
    "block_size beyond int64": ("block_size", slots(block_size=2**63)),
    **refused("num_blocks", each("slots", "num_blocks", 2**31 + 1, -1)),
    "slots block_tables rows": ("positions must have shape (1,)", slots(block_tables=[[3, 0, -1]])),
    "copy not a pair": ("pairs[0]", copy(pairs=[(0, 1, 2)])),
    "copy tensor shape": ("pairs", copy(pairs=lambda _: ints([[0, 1, 2]]))),
    **{f"{function} unknown backend": ("backend", changing(function)(backend="gpu"))
       for function in ("slots", "store", "decode", "copy")},
    "cu_seqlens_q not batch + 1": ("cu_seqlens_q", prefill(cu_seqlens_q=[0, 5])),
    "cu_seqlens_q not from 0": ("cu_seqlens_q", prefill(cu_seqlens_q=[1, 2, 5])),
    "cu_seqlens_q short of the tokens": ("cu_seqlens_q", prefill(cu_seqlens_q=[0, 2, 4])),
    "cu_seqlens_q decreasing": ("cu_seqlens_q", prefill(cu_seqlens_q=[0, 6, 5])),
    "more queries than context": ("cu_seqlens_q", prefill(cu_seqlens_q=[0, 1, 5])),
    "prefill context_lens wrong length": ("context_lens", prefill(context_lens=[5, 3, 1])),
    "prefill negative context": ("context_lens", prefill(context_lens=[5, -3])),
    "prefill query 2-d": ("query", prefill(query=lambda q: q.reshape(5, 32))),
    "prefill heads not a multiple": ("query", prefill(query=lambda q: q[:, :3])),
    "max_query_len not the longest chunk": ("max_query_len", prefill(max_query_len=2)),
    "max_query_len negative": ("max_query_len", prefill(max_query_len=-1)),
    "fp8 k_scale zero": ("k_scale", fp8_store(k_scale=0.0)),
    "fp8 v_scale NaN": ("v_scale", fp8_store(v_scale=math.nan)),
    "fp8 k_scale not one per head": ("k_scale", fp8_store(k_scale=floats(1.0))),
    "fp8 v_scale negative": ("v_scale", fp8_store(v_scale=floats(1.0, -1.0))),
    "store k_scale, fp32 caches": ("k_scale", store(k_scale=1.0)),
    "decode v_scale, fp32 caches": ("v_scale", decode(v_scale=1.0)),
    "prefill v_scale, fp32 caches": ("v_scale", prefill(v_scale=1.0)),
    "fp8 decode k_scale not one per head": ("k_scale", fp8_decode(k_scale=floats(1.0, 1.0, 1.0))),
    "fp8 prefill k_scale not one per head": ("k_scale", fp8_prefill(k_scale=floats(1, 1, 1))),
}  # fmt: skip
TYPES: dict[str, tuple[str, Case]] = {
    "context_lens float": ("context_lens", decode(context_lens=lambda t: t.float())),
    "block_tables int64": ("block_tables", decode(block_tables=lambda t: t.long())),
    "query dtype": ("query", decode(query=lambda q: q.half())),
    **{f"{function} {name} not a tensor": (name, changing(function)(**{name: lambda t: t.tolist()}))
       for function, names in (("decode", ("query", "context_lens", "block_tables", "k_cache")),
                               ("store", ("key", "k_cache", "slot_mapping")),
                               ("slots", ("positions", "block_tables")), ("copy", ("k_cache",)))
       for name in names},
    **{f"slots {name} {dtype}": (name, slots(**{name: lambda t, dtype=dtype: t.to(dtype)}))
       for name, dtype in (("block_tables", torch.int64), ("block_tables", torch.float32),
                           ("positions", torch.float32))},
    "copy pairs float": ("pairs", copy(pairs=lambda _: ints([[0, 1]]).float())),
    "copy k_cache float64": ("k_cache", copy(k_cache=lambda k: k.double())),
    "copy v_cache float64": ("v_cache", copy(v_cache=lambda v: v.double())),
    "decode k_cache float64": ("k_cache", decode(k_cache=lambda k: k.double())),
    "v_cache dtype": ("v_cache", decode(v_cache=lambda v: v.double())),
    **{f"{function} window {window}": ("window", changing(function)(window=window))
       for function in ("decode", "contiguous", "prefill") for window in (2.0, True, False, "3")},
    **refused("scale must be a number", each("decode", "scale", "1", True, 1j, torch.tensor(1.0))),
    **refused("num_splits", each("decode", "num_splits", 2.0, True)),
    **refused("block_size", each("slots", "block_size", True, 4.0, "4", None)),
    **refused("num_blocks", each("slots", "num_blocks", 6.0, True)),
    "key dtype": ("key", store(key=lambda k: k.half())),
    "key float64": ("key", store(key=lambda k: k.double())),
    "value fp16": ("value has dtype torch.float16", store(value=lambda v: v.half())),
    "v_cache float64": ("v_cache", store(v_cache=lambda v: v.double())),
    "integer cache": ("k_cache", store(k_cache=lambda k: k.int())),
    **{f"{function} validate={v!r}": ("validate", changing(function)(validate=v))
       for function in ("slots", "store", "decode") for v in (1, "yes", None)},
    "max_context_len float": ("max_context_len", decode(max_context_len=6.0)),
    "copy float id": ("pairs[0] src", copy(pairs=[(0.0, 1)])),
    "copy pairs a str": ("pairs", copy(pairs="ab")),
    **{f"{function} backend={v!r}": ("backend must be a str", changing(function)(backend=v))
       for function in ("slots", "store", "decode", "copy") for v in (1, b"reference")},
    "cu_seqlens_q float": ("cu_seqlens_q", prefill(cu_seqlens_q=lambda t: t.float())),
    "prefill block_tables int64": ("block_tables", prefill(block_tables=lambda t: t.long())),
    "prefill query dtype": ("query", prefill(query=lambda q: q.half())),
    "max_query_len not an int": ("max_query_len", prefill(max_query_len=3.0)),
    "fp8 k_scale bool": ("k_scale", fp8_store(k_scale=True)),
    "fp8 v_scale float64": ("v_scale", fp8_store(v_scale=floats(1.0, 1.0, dtype=torch.float64))),
    "fp8 key": ("key", fp8_store(key=lambda k: k.to(torch.float8_e4m3fn))),
    "fp8 value fp16": ("value", fp8_store(value=lambda v: v.half())),
    "fp8 decode query fp8": ("query", fp8_decode(query=lambda q: q.to(torch.float8_e5m2))),
    "fp8 prefill query fp8": ("query", fp8_prefill(query=lambda q: q.to(torch.float8_e5m2))),
}  # fmt: skip
CASES = {
    name: (error, words, case)
    for error, table in ((IndexError, INDEX_ERRORS), (ValueError, VALUE_ERRORS), (TypeError, TYPES))
    for name, (words, case) in table.items()
}


def assert_rejected(
    args: Args, error: type[Exception], words: str, call: Callable[[Args], object]
) -> None:
    """``call(args)`` raises ``error`` naming ``words``, and no tensor of ``args`` changes."""
    before = [value.clone() for value in args.values() if isinstance(value, torch.Tensor)]
    with pytest.raises(error, match=re.escape(words)):
        call(args)
    after = [value for value in args.values() if isinstance(value, torch.Tensor)]
    assert all(map(torch.equal, after, before))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_invalid_call_raises_and_changes_nothing(name: str, backend: str) -> None:
    error, words, (function, edit) = CASES[name]
    assert_rejected(
        valid_args()[function], error, words,
        lambda args: FUNCTIONS[function](**{"backend": backend, **edit(args)}),
    )  # fmt: skip


def not_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(0, 1).contiguous().transpose(0, 1)


def no_rows(tensor: torch.Tensor) -> torch.Tensor:
    return tensor[:0]


PADDED = [[3, 0, -1, -1], [5, -1, -1, -1]]
# Calls that must work, on every backend as on the reference (the valid calls "as is": each
# refusal above breaks one thing of one), degenerate ones included; case id -> case.
EDGES: dict[str, Case] = {
    **{f"{function} as is": changing(function)() for function in FUNCTIONS},
    "prefill max_query_len": prefill(max_query_len=3),
    "decode padded table": decode(block_tables=PADDED),
    "decode query not contiguous": decode(query=not_contiguous),
    **each("decode", "context_lens", [0, 0], ints([8, 4], torch.int64)),
    **each("decode", "scale", 2.0**-149, 1e30, 0.3),
    **each("decode", "num_splits", 1, 64),
    **each("decode", "window", 1, 3, 2**70),
    "decode no sequences": decode(query=no_rows, block_tables=no_rows, context_lens=no_rows),
    "prefill no sequences": prefill(
        query=no_rows, block_tables=no_rows, cu_seqlens_q=[0], context_lens=no_rows),
    "prefill no queries": prefill(query=no_rows, cu_seqlens_q=[0, 0, 0], context_lens=[0, 0]),
    "store key not contiguous": store(key=not_contiguous),
    "store nothing": store(slot_mapping=[-1, -1, -1]),
    "store the last slot": store(slot_mapping=[0, 7, NUM_BLOCKS * BLOCK_SIZE - 1]),
    **each("slots", "positions", [-1, -1], ints([4, 3], torch.int64)),
    "slots padded table": slots(block_tables=PADDED),
    **each("slots", "num_blocks", None, 6, 100, 2**31),
    **{f"{function} backend={v!r}": changing(function)(backend=v)
       for function in ("slots", "store", "decode", "copy") for v in (" Reference ", None)},
    **{f"slots empty table {shape}": slots(block_tables=lambda _, shape=shape: torch.zeros(
        shape, dtype=torch.int32, device=DEVICE), positions=[-1, -1], seq_ids=[0, 0])
       for shape in ((0, 3), (2, 0))},
    "slots the largest block size": slots(  # slots stay in int64
        block_tables=[[5, 2**31 - 1]], positions=lambda _: ints([2**32], torch.int64),
        block_size=2**32),
    **each("copy", "pairs", [], torch.empty(0, 2, dtype=torch.int64), [(2, 2)],
           [(5, 0)], ints([[2, 3], [3, 4]], torch.int64)),
}  # fmt: skip
SLOTS = {"slots as is": [1, 21], "slots empty table (0, 3)": [-1, -1],
         "slots empty table (2, 0)": [-1, -1],
         "slots the largest block size": [(2**31 - 1) * 2**32]}  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(EDGES))
def test_degenerate_calls_work_as_on_the_reference(name: str, backend: str) -> None:
    """The output (an attention's: finite, the query's shape and dtype; slot mapping's: known
    where listed) and every tensor argument after the call equal the reference's; a call that
    does not write (not store or copy) changes no argument."""
    function, edit = EDGES[name]
    seen = []
    for on in ("reference", backend):
        args = edit(valid_args()[function])
        before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
        output = FUNCTIONS[function](**{"backend": on, **args})
        seen.append((output, [args[k] for k in before]))
        if function.endswith(("store", "copy")):
            continue
        assert all(torch.equal(args[k], v) for k, v in before.items()), f"{on} wrote an input"
        assert isinstance(output, torch.Tensor)
        if function == "slots":
            assert name not in SLOTS or output.tolist() == SLOTS[name], on
        else:
            assert output.shape == args["query"].shape and output.dtype == args["query"].dtype
            assert bool(output.isfinite().all()), on
    (expected, expected_after), (output, after) = seen
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        assert_close(output, expected, f"{backend} vs reference")
    else:
        assert output is expected is None or torch.equal(output, expected)
    assert all(map(torch.equal, after, expected_after))


@settings(max_examples=kernel_examples(30))
@given(
    tokens=st.integers(1, 12),
    at=st.integers(0, 11),
    bad_slot=st.one_of(st.integers(-50, -2), st.integers(NUM_BLOCKS * BLOCK_SIZE, 10**6)),
    pairs=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), max_size=5),
    bad_pair=st.tuples(st.integers(0, 5), st.integers(6, 100)).map(
        lambda p: p[::-1] if p[0] % 2 else p),  # a bad src or dst
    backend=st.sampled_from(BACKENDS),
)  # fmt: skip
def test_one_bad_slot_or_pair_anywhere_means_no_write_at_all(
    tokens: int, at: int, bad_slot: int, pairs: list[tuple[int, int]], bad_pair: tuple[int, int],
    backend: str,
) -> None:  # fmt: skip
    slot_list = list(range(tokens))
    slot_list[at % tokens] = bad_slot
    key = torch.ones(tokens, KV_HEADS, HEAD_DIM, device=DEVICE)
    bad = {"key": key, "value": key, "slot_mapping": ints(slot_list)}
    pairs.insert(at % (len(pairs) + 1), bad_pair)
    calls = valid_args()
    assert_rejected(
        calls["store"], IndexError, "slot_mapping",
        lambda args: kernels.store_kv(**{**args, **bad}, backend=backend),
    )  # fmt: skip
    assert_rejected(
        calls["copy"], IndexError, "pairs",
        lambda args: kernels.copy_blocks(**{**args, "pairs": pairs}, backend=backend),
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_validates_only_the_entries_a_window_reaches(backend: str) -> None:
    """Sequence 0 has 8 tokens and one query, at 7; sequence 1 has 3 tokens, all queries. Window
    4 reads positions 4 .. 7 of sequence 0, entry 1 alone, so entry 0 may hold anything (the
    output is that of a real block there); window 5 reaches position 3, so entry 0 is checked."""
    call = valid_args()["prefill"]
    call.update(context_lens=ints([8, 3], torch.int64), cu_seqlens_q=ints([0, 1, 4], torch.int64))
    call["query"] = torch.randn(4, 4, 8).to(DEVICE)
    real = kernels.paged_prefill_attention(**call, window=4, backend=backend)  # entry 0 is 2
    call["block_tables"] = ints([[-1, 0], [3, -1]])
    assert torch.equal(kernels.paged_prefill_attention(**call, window=4, backend=backend), real)
    with pytest.raises(IndexError, match=re.escape("block_tables[0, 0]")):
        kernels.paged_prefill_attention(**call, window=5, backend=backend)
