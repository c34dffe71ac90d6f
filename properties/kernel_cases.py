"""Shared pieces of the kernel property tests: sizes, tolerances, oracles, and ``KVCache``, which
replays a script played on the spec's ``BlockManager`` through the kernels, keeping the logical K/V.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import pairwise
from pathlib import Path
from types import ModuleType

import pytest
import torch
from hypothesis import currently_in_test_context, event, settings
from hypothesis import strategies as st

from pagedkv import kernels
from pagedkv.kernels import sdpa
from pagedkv.spec import fp8 as spec_fp8
from pagedkv.spec.block_manager import BlockManager, OutOfBlocksError, blocks_needed, translate_slot
from properties.mutants import replace_code

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
GQA_RATIOS = (1, 2, 4, 8)
HEAD_DIMS = (64, 80, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
ON_CPU = pytest.mark.skipif(DEVICE.type != "cpu", reason="the numba backend runs on CPU")
FP8 = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}

# (atol, rtol): ``|actual - expected| <= atol + rtol * |expected|``, elementwise. All kernels
# accumulate in fp32, so summation order and the output's rounding (about an ulp of fp16 or bf16
# at outputs of a few units) differ, plus TF32 on GPUs.
TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Agreement within ``TOLERANCES[expected.dtype]``, on ``expected``'s device."""
    atol, rtol = TOLERANCES[expected.dtype]
    torch.testing.assert_close(
        actual.to(expected.device), expected, atol=atol, rtol=rtol, msg=lambda d: f"{what}: {d}"
    )


def kernel_examples(base: int) -> int:
    """``base`` examples (small: the interpreter is slow) under dev and ci, more under deep."""
    return max(base, base * settings.default.max_examples // 200)


Op = tuple[str, int, int]  # (kind, sequence index, token count)


@dataclass(eq=False)
class Seq:
    """A live sequence: its block table, its length, and (in a ``KVCache``) its logical K/V."""

    table: list[int]
    length: int = 0
    kv: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)


@dataclass(frozen=True)
class Write:
    """Tokens ``start .. start + count - 1`` of ``seq`` must be written, after ``copies``."""

    seq: Seq
    start: int
    count: int
    copies: list[tuple[int, int]]


class SpecRun:
    """Plays a script on the spec's ``BlockManager``; reports the writes a cache must do."""

    def __init__(self, total_blocks: int, block_size: int, free_order: Sequence[int]) -> None:
        self.manager = BlockManager(total_blocks, block_size)
        held = [self.manager.allocate(1) for _ in range(total_blocks)]  # held[b] == [b]
        for block_id in free_order:  # the free queue now runs in free_order
            self.manager.free(held[block_id])
        self.seqs: list[Seq] = []

    def apply(self, op: Op) -> Write | None:
        """Apply one operation; ``None`` when it writes nothing or the pool is too small."""
        kind, index, count = op
        bs = self.manager.block_size
        if kind == "new":
            try:
                seq = Seq(self.manager.allocate(blocks_needed(count, bs)))
            except OutOfBlocksError:
                return None
            self.seqs.append(seq)
            return self._grow(seq, count, [])
        if not self.seqs:
            return None
        index %= len(self.seqs)
        seq = self.seqs[index]
        if kind == "extend":
            try:
                seq.table = self.manager.append_slot(seq.table, seq.length + count, count)
            except OutOfBlocksError:
                return None
            return self._grow(seq, count, self.manager.pop_copy_pairs())
        if kind == "fork":
            self.seqs.append(Seq(self.manager.fork(seq.table), seq.length, list(seq.kv)))
        elif kind == "free":
            self.manager.free(seq.table)
            del self.seqs[index]
        return None

    @staticmethod
    def _grow(seq: Seq, count: int, copies: list[tuple[int, int]]) -> Write:
        start, seq.length = seq.length, seq.length + count
        return Write(seq, start, count, copies)


@dataclass(frozen=True)
class Scenario:
    """Everything drawn for one run: the pool, its free order, the script, a tensor seed."""

    block_size: int
    total_blocks: int
    free_order: tuple[int, ...]
    script: tuple[Op, ...]
    seed: int

    def play(self, on_write: Callable[[Write], None] = lambda write: None) -> SpecRun:
        """The spec run, each write it asks for passed to ``on_write`` as it happens."""
        run = SpecRun(self.total_blocks, self.block_size, self.free_order)
        for op in self.script:
            write = run.apply(op)
            if write is not None:
                on_write(write)
        return run


def fixed_scenario(block_size: int) -> Scenario:
    """Reversed free queue, three sequences, a fork whose branches both extend, a free, a reuse."""
    total_blocks = 4 * blocks_needed(40, block_size) + 4
    script: tuple[Op, ...] = (
        ("new", 0, 3 * block_size + 1),
        ("new", 0, 2 * block_size),
        ("fork", 0, 0),
        ("extend", 2, 2),
        ("extend", 0, 1),
        ("free", 1, 0),
        ("new", 0, block_size + 3),
    )
    return Scenario(block_size, total_blocks, tuple(reversed(range(total_blocks))), script, 0)


@st.composite
def scenarios(draw: st.DrawFn, block_size: int) -> Scenario:
    """A small realistic run: prompts (block-size edge lengths likely), decodes, forks, frees."""
    longest = min(512, max(40, 2 * block_size))  # two blocks (so exact multiples occur)
    edges = [n for n in (1, block_size - 1, block_size, block_size + 1, 2 * block_size) if n > 0]
    lengths = st.one_of(
        st.sampled_from([n for n in edges if n <= longest]), st.integers(1, longest)
    )
    extends = st.integers(1, min(block_size + 1, 24))
    op = st.one_of(
        st.tuples(st.just("new"), st.just(0), lengths),
        st.tuples(st.just("extend"), st.integers(0, 7), extends),
        st.tuples(st.just("extend"), st.integers(0, 7), st.just(1)),
        st.tuples(st.just("fork"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("free"), st.integers(0, 7), st.just(0)),
    )
    first = draw(lengths)
    script = (("new", 0, first), *draw(st.lists(op, max_size=10)))
    needed = blocks_needed(first, block_size)
    total_blocks = draw(st.integers(needed, needed + 2 * blocks_needed(longest, block_size) + 2))
    free_order = tuple(draw(st.permutations(range(total_blocks))))
    seed = draw(st.integers(0, 2**31 - 1))
    return Scenario(block_size, total_blocks, free_order, script, seed)


@dataclass(frozen=True)
class Shape:
    """Cache geometry and dtype; ``num_heads`` query heads share each KV head ``group`` ways."""

    block_size: int
    num_kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.group


class KVCache:
    """K/V caches filled by ``store_kv`` and ``copy_blocks``, NaN where no token was written."""

    def __init__(self, scenario: Scenario, shape: Shape, backend: str = "triton") -> None:
        self.shape = shape
        self.backend = backend
        self.generator = torch.Generator().manual_seed(scenario.seed)
        size = (scenario.total_blocks, shape.block_size, shape.num_kv_heads, shape.head_dim)
        self.k_cache = torch.full(size, float("nan"), dtype=shape.dtype, device=DEVICE)
        self.v_cache = torch.full(size, float("nan"), dtype=shape.dtype, device=DEVICE)
        self.run = scenario.play(self.write)

    def randn(self, *size: int) -> torch.Tensor:
        return torch.randn(*size, generator=self.generator).to(self.shape.dtype).to(DEVICE)

    def write(self, write: Write) -> None:
        """Copy-on-write first (the spec's contract), then the new tokens' K/V."""
        if write.copies and currently_in_test_context():
            event("copy-on-write")  # shown by --hypothesis-show-statistics
        kernels.copy_blocks(self.k_cache, self.v_cache, write.copies, backend=self.backend)
        key = self.randn(write.count, self.shape.num_kv_heads, self.shape.head_dim)
        value = self.randn(write.count, self.shape.num_kv_heads, self.shape.head_dim)
        positions = range(write.start, write.start + write.count)
        slots = [translate_slot(write.seq.table, p, self.shape.block_size) for p in positions]
        slot_tensor = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        kernels.store_kv(key, value, self.k_cache, self.v_cache, slot_tensor, backend=self.backend)
        write.seq.kv.append((key, value))

    def batch(
        self, extra_columns: int = 0, pad: int = -1, padding_row: bool = False
    ) -> tuple[list[Seq | None], torch.Tensor, torch.Tensor]:
        """``(seqs, padded_tables(...), context_lens)``; ``padding_row`` adds ``None``, length 0."""
        seqs: list[Seq | None] = list(self.run.seqs) + ([None] if padding_row else [])
        tables = padded_tables([seq.table if seq else [] for seq in seqs], extra_columns, pad)
        lens = torch.tensor([s.length if s else 0 for s in seqs], dtype=torch.int32, device=DEVICE)
        return seqs, tables, lens


def fixed_cache(
    block_size: int, group: int, head_dim: int, dtype: torch.dtype = torch.float32,
    backend: str = "reference",
) -> KVCache:  # fmt: skip
    """``fixed_scenario(block_size)``'s cache, two KV heads; fresh, so its queries' RNG too."""
    shape = Shape(block_size, 2, group, head_dim, dtype)
    return KVCache(fixed_scenario(block_size), shape, backend)


def poison_outside_window(
    cache: KVCache, tables: torch.Tensor, starts: Sequence[int], poison: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Entries below ``starts[b] // block_size`` name a NaN block appended to copies of the caches
    (``"nan"``: read even masked, it gives NaN) or ``-1`` (``"invalid"``: validation accepts it)."""
    block_size = cache.shape.block_size
    k_cache, v_cache, poisoned = cache.k_cache, cache.v_cache, tables.clone()
    value = -1
    if poison == "nan":
        nan_block = torch.full_like(k_cache[:1], float("nan"))
        value = k_cache.shape[0]
        k_cache, v_cache = torch.cat([k_cache, nan_block]), torch.cat([v_cache, nan_block])
    for b, start in enumerate(starts):
        poisoned[b, : start // block_size] = value
    return k_cache, v_cache, poisoned


# decode(query, k_cache, v_cache, block_tables, context_lens, scale, *, window) -> output; prefill
# takes cu_seqlens_q before context_lens
Attention = Callable[..., object]


def check_attention(
    cache: KVCache, kernel: Attention, query_lens: list[int] | None = None, extra_columns: int = 0,
    padding_row: bool = False, scale: float | None = None, pad: int = -1,
    window: int | None = None, poison: str | None = None,
) -> None:  # fmt: skip
    """``kernel`` (decode, or prefill of ``query_lens``: a count per row of ``cache.batch(...)``),
    the reference and the dense oracle agree, in the query's dtype and shape, at ``scale`` (default
    ``1 / sqrt(head_dim)``) and ``window``; with ``poison``, both give the same bits again when
    the entries of blocks wholly before each window are poisoned (``poison_outside_window``)."""
    seqs, tables, lens = cache.batch(extra_columns, pad, padding_row)
    counts = [1] * len(seqs) if query_lens is None else query_lens
    query = cache.randn(sum(counts), cache.shape.num_heads, cache.shape.head_dim)
    scale = cache.shape.head_dim**-0.5 if scale is None else scale
    reference, args = decode_on("reference"), (tables, lens, scale)
    if query_lens is not None:
        reference = prefill_on("reference")
        args = (tables, torch.tensor([0, *counts], device=DEVICE).cumsum(0).int(), lens, scale)
    expected = dense_attention(query, seqs, scale, window, counts)
    caches = (query, cache.k_cache, cache.v_cache)
    ref, actual = reference(*caches, *args, window=window), kernel(*caches, *args, window=window)
    if poison is not None:
        pairs = zip(lens.tolist(), counts, strict=True)
        starts = [max(0, n - q - window + 1) if window else 0 for n, q in pairs]
        k_cache, v_cache, poisoned = poison_outside_window(cache, tables, starts, poison)
        for run, output in ((reference, ref), (kernel, actual)):
            dirty = run(query, k_cache, v_cache, poisoned, *args[1:], window=window)
            assert isinstance(dirty, torch.Tensor) and torch.equal(dirty, output), "read outside"
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == query.dtype and actual.shape == query.shape
    assert_close(ref, expected, "reference vs oracle")
    assert_close(actual, expected, "kernel vs oracle")
    assert_close(actual, ref, "kernel vs reference")


def decode_on(backend: str, num_splits: int | None = None) -> Attention:
    """The public decode function on ``backend``, with ``num_splits`` fixed."""
    return partial(kernels.paged_decode_attention, num_splits=num_splits, backend=backend)


def sdpa_prefill(module: ModuleType = sdpa) -> Attention:
    """``paged_prefill_attention`` over ``module``'s plan (from host ints, as the engine's step)."""

    def prefill(
        query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor, lens: torch.Tensor, scale: float, window: int | None = None,
    ) -> torch.Tensor:  # fmt: skip
        query_lens = [b - a for a, b in pairwise(cu_seqlens_q.tolist())]
        group = query.shape[1] // k_cache.shape[2]
        plan = module.plan(tables, query_lens, lens.tolist(), k_cache.shape[1], group, window)
        return module.attention(plan, query, k_cache, v_cache, scale)

    return prefill


def prefill_on(backend: str) -> Attention:
    """The public prefill function on ``backend``, or ``sdpa``'s plan and attention."""
    if backend == "sdpa":
        return sdpa_prefill()
    return partial(kernels.paged_prefill_attention, backend=backend)


def fill_backend(backend: str) -> str:
    """The backend that fills the caches for a check of ``backend`` (the reference for sdpa)."""
    return backend if backend in ("triton", "numba") else "reference"


def draw_cache(
    data: st.DataObject, backend: str, block_size: int | None = None,
    dtype: torch.dtype | None = None, group: int | None = None, head_dim: int | None = None,
) -> KVCache:  # fmt: skip
    """A cache filled through ``fill_backend(backend)`` by a drawn scenario; ``None``: drawn."""
    block_size = block_size or data.draw(st.sampled_from(BLOCK_SIZES), label="block_size")
    dtype = dtype or data.draw(st.sampled_from(DTYPES), label="dtype")
    group = group or data.draw(st.sampled_from(GQA_RATIOS), label="group")
    head_dim = head_dim or data.draw(st.sampled_from(HEAD_DIMS), label="head_dim")
    scenario = data.draw(scenarios(block_size), label="scenario")
    num_kv_heads = data.draw(st.sampled_from([1, 2]), label="num_kv_heads")
    shape = Shape(block_size, num_kv_heads, group, head_dim, dtype)
    return KVCache(scenario, shape, backend=fill_backend(backend))


def dense_attention(
    query: torch.Tensor, seqs: Sequence[Seq | None], scale: float, window: int | None = None,
    query_lens: list[int] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The spec: query ``i`` of a chunk of ``q`` (``query_lens``; default: one a sequence, decode),
    at position ``p = length - q + i``, attends in fp32 the logical K/V at ``j <= p`` and, with a
    window ``w``, ``j > p - w`` (HF's sliding_window); padding and empty sequences give zeros."""
    out = torch.zeros_like(query)
    start = 0
    for seq, count in zip(seqs, query_lens or [1] * len(seqs), strict=True):
        if count and seq is not None and seq.length:
            key, value = (torch.cat(parts) for parts in zip(*seq.kv, strict=True))  # [L, kv, dim]
            group = query.shape[1] // key.shape[1]
            k = key.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, L, dim]
            v = value.float().repeat_interleave(group, dim=1).transpose(0, 1)
            q = query[start : start + count].float().transpose(0, 1)  # [heads, count, dim]
            positions = torch.arange(seq.length - count, seq.length, device=query.device)
            j, p = torch.arange(seq.length, device=query.device)[None, :], positions[:, None]
            mask = (j <= p) & (j > p - window if window is not None else True)
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=scale)
            out[start : start + count] = o.transpose(0, 1).to(query.dtype)
        start += count
    return out


def padded_tables(tables: list[list[int]], extra_columns: int, pad: int = -1) -> torch.Tensor:
    """int32 ``[len(tables), longest + extra_columns]``, padded with ``pad``."""
    width = max((len(t) for t in tables), default=0) + extra_columns
    rows = [t + [pad] * (width - len(t)) for t in tables]
    return torch.tensor(rows, dtype=torch.int32, device=DEVICE).reshape(len(tables), width)


def check_slot_mapping(
    tables: list[list[int]], tokens: list[tuple[int, int]], block_size: int,
    slot_mapping: Callable[..., torch.Tensor],  # (tables, positions, block_size, seq_ids)
    extra_columns: int = 0, index_dtype: torch.dtype = torch.int64,
) -> None:  # fmt: skip
    """``slot_mapping`` of ``(sequence, position)`` tokens equals the spec, ``-1`` for padding."""
    expected = [translate_slot(tables[b], p, block_size) if p >= 0 else -1 for b, p in tokens]
    seq_ids = torch.tensor([b for b, _ in tokens], dtype=index_dtype, device=DEVICE)
    positions = torch.tensor([p for _, p in tokens], dtype=index_dtype, device=DEVICE)
    block_tables = padded_tables(tables, extra_columns)
    slots = slot_mapping(block_tables, positions, block_size, seq_ids)
    assert slots.dtype == torch.int64
    assert slots.tolist() == expected


def assert_writes(cache: torch.Tensor, write: Callable[..., None], expected: torch.Tensor) -> None:
    """``write(k_cache, v_cache)`` on copies of ``cache`` gives ``expected``, bit for bit."""
    k_cache, v_cache = cache[0].clone(), cache[1].clone()
    write(k_cache, v_cache)
    assert torch.equal(torch.stack([k_cache, v_cache]), expected)


def check_store_kv(
    cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int],
    store_kv: Callable[..., None],  # (key, value, k_cache, v_cache, slot_mapping)
) -> None:  # fmt: skip
    """``store_kv`` changes exactly the rows of the given slots (``-1``: none), to the tokens."""
    block_size = cache.shape[2]
    expected = cache.clone()
    for t, slot in enumerate(slots):
        if slot >= 0:
            expected[:, slot // block_size, slot % block_size] = torch.stack([key[t], value[t]])
    slot_tensor = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    assert_writes(cache, lambda k, v: store_kv(key, value, k, v, slot_tensor), expected)


def check_copy_blocks(cache: torch.Tensor, pairs: object, copy_blocks: Callable[..., None]) -> None:
    """``copy_blocks`` equals the sequential loop (``copy_in_order``)."""
    in_order = torch.as_tensor(pairs, dtype=torch.int64).reshape(-1, 2).tolist()
    assert_writes(cache, lambda k, v: copy_blocks(k, v, pairs), copy_in_order(cache, in_order))


def load_mutant(module: ModuleType, within: str, old: str, new: str, directory: Path) -> ModuleType:
    """``module`` with ``old`` in ``within`` replaced by ``new`` (``replace_code``), imported from a
    file under ``directory`` (Triton needs source) named by its hash (numba's cache stays valid)."""
    assert module.__file__ is not None
    tree = ast.parse(Path(module.__file__).read_text())
    replace_code(tree, within, old, new)
    mutated_source = ast.unparse(tree) + "\n"
    digest = hashlib.sha256(mutated_source.encode()).hexdigest()[:16]
    name = f"mutant_{module.__name__.rsplit('.', 1)[-1]}_{digest}"
    path = directory / f"{name}.py"
    if not path.exists() or path.read_text() != mutated_source:
        path.write_text(mutated_source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mutant = importlib.util.module_from_spec(spec)
    sys.modules[name] = mutant  # importlib's recipe: a dataclass looks its module up there
    spec.loader.exec_module(mutant)
    return mutant


def copy_in_order(cache: torch.Tensor, pairs: Sequence[Sequence[int]]) -> torch.Tensor:
    """``copy_blocks``'s contract: ``cache`` (``[2, blocks, ...]``) after each pair, in order."""
    expected = cache.clone()
    for src, dst in pairs:
        expected[:, dst] = expected[:, src].clone()
    return expected


def expected_codes(rows: torch.Tensor, scales: list[float], name: str) -> torch.Tensor:
    """``spec.fp8.quantize`` of every element of ``rows`` ``[tokens, heads, dim]``."""
    fmt = spec_fp8.fp8_format(name)
    codes = [
        [[spec_fp8.quantize(x, scales[h], fmt) for x in head] for h, head in enumerate(token)]
        for token in rows.float().tolist()
    ]
    return torch.tensor(codes, dtype=torch.uint8)


def fp8_attention_case(
    dtype: torch.dtype, query_dtype: torch.dtype, seed: int
) -> tuple[dict, torch.Tensor, torch.Tensor]:
    """A paged cache of random codes (NaN codes excluded) under per-head scales, a batch of
    three sequences; and the same values as an fp32 cache (code value times scale)."""
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (2, 8, 4, 2, 16), dtype=torch.uint8, generator=generator)
    values = codes.view(dtype).float()
    codes[values.isnan() | values.isinf()] = 0x38  # 1.0 in e4m3, 0.5 in e5m2
    k_scale, v_scale = torch.tensor([0.02, 3.0]), torch.tensor(0.001).expand(2)
    k_cache, v_cache = codes.view(dtype)
    args = {
        "block_tables": torch.tensor([[3, 0, 5, 7], [5, 1, 2, -1], [6, -1, -1, -1]]).int(),
        "context_lens": torch.tensor([14, 9, 3], dtype=torch.int32),
        "k_scale": k_scale,
        "v_scale": v_scale,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "query": torch.randn(3, 4, 16, generator=generator).to(query_dtype),
    }
    return args, k_cache.float() * k_scale[:, None], v_cache.float() * v_scale[:, None]
