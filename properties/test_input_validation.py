"""Every layer (blocks, serving; kernels: test_kernels_validation) checks its input: **valid** and
**edge** (degenerate) arguments work, a **wrong type** raises ``TypeError``, **out of range**
``ValueError``, ``IndexError`` or ``OutOfBlocksError``. Hypothesis breaks up to two arguments of a
call; a failing call changes nothing (compared with a twin)."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.impl.blocks.prefix_cache import PrefixCachingBlockManager as ImplManager
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.model import CausalLM, ModelConfig
from pagedkv.impl.serving.sampling import sample_token
from pagedkv.impl.serving.scheduler import RequestTooLargeError
from pagedkv.spec.block_manager import OutOfBlocksError
from pagedkv.spec.prefix_cache import PrefixCachingBlockManager as SpecManager
from properties.engine_cases import MODEL, check_all_freed, single_thread  # noqa: F401

VALID, EDGE, WRONG_TYPE, OUT_OF_RANGE = "valid", "edge", "wrong type", "out of range"
ERRORS: dict[str, tuple[type[Exception], ...]] = {
    WRONG_TYPE: (TypeError,),
    OUT_OF_RANGE: (ValueError, IndexError, OutOfBlocksError),
}
TINY = 5e-324  # the smallest subnormal double
HUGE = sys.float_info.max
NOT_NUMBERS = ["1", True, None, 1j, torch.tensor(1.0)]
BAD_NUMBERS = [-1.0, -TINY, math.inf, -math.inf, math.nan]


@dataclass(frozen=True)
class Arg:
    """The four pools of one argument (an empty pool is never drawn)."""

    valid: list[Any]
    edge: list[Any] = dataclasses.field(default_factory=list)
    wrong_type: list[Any] = dataclasses.field(default_factory=list)
    out_of_range: list[Any] = dataclasses.field(default_factory=list)


def draw_call(data: st.DataObject, args: dict[str, Arg]) -> tuple[dict[str, Any], tuple]:
    """Values for ``args``, and the error classes the call may raise (none: it must work)."""
    broken = data.draw(st.sets(st.sampled_from(sorted(args)), max_size=2), label="broken")
    values: dict[str, Any] = {}
    expected: tuple[type[Exception], ...] = ()
    for name, arg in args.items():
        pools = {VALID: arg.valid, EDGE: arg.edge}
        if name in broken:
            pools = {WRONG_TYPE: arg.wrong_type, OUT_OF_RANGE: arg.out_of_range}
        pools = {pool: items for pool, items in pools.items() if items} or {VALID: arg.valid}
        pool = data.draw(st.sampled_from(sorted(pools)), label=f"{name} pool")
        values[name] = data.draw(st.sampled_from(pools[pool]), label=name)
        expected += ERRORS.get(pool, ())
    return values, expected


def outcome(call: Callable[[], object], expected: tuple) -> object:
    """The call's result, or its exception, of a class in ``expected`` (none: it must work)."""
    try:
        result = call()
    except Exception as error:
        assert expected, f"valid arguments raised {error!r}"
        assert isinstance(error, expected), f"{error!r} is not one of {expected}"
        return error
    assert not expected, f"bad arguments were accepted, returning {result!r}"
    return result


# ------------------------------------------------------------------ spec and blocks

PROMPT = [5, 6, 7, 8, 9]  # block size 2: two full blocks, cached, and a partial one


def build_manager(cls: type) -> tuple[Any, dict[str, list[int]]]:
    """A prefix-caching manager of 16 blocks of 2 with a cached, forked table and a stale one."""
    manager = cls(16, 2)
    live, _ = manager.allocate_prompt(PROMPT)
    manager.cache_blocks(live, PROMPT)
    manager.fork(live)
    stale = manager.allocate(2)
    manager.free(stale)
    return manager, {"live": live, "stale": stale}


def snapshot(manager: Any) -> tuple:
    """Everything a caller can observe (pending copy pairs are popped: compare twins)."""
    ids = range(manager.total_blocks)
    return (
        manager.free_block_ids(),
        [manager.ref_count(b) for b in ids],
        [manager.key_of(b) for b in ids],
        dataclasses.astuple(manager.stats),
        [tuple(pair) for pair in manager.pop_copy_pairs()],
    )


def manager_calls(manager: Any, tables: dict[str, list[int]]) -> dict[str, dict[str, Arg]]:
    """The public methods under test and their arguments' pools, for ``build_manager``'s state."""
    live, stale = tables["live"], tables["stale"]
    counts = [1.0, True, "2", None]
    tokens = Arg([[5, 6, 7, 8, 9], [1, 2, 3]], [[], (5, 6), [0] * 4],
                 ["123", [1, 2.0], [True], None, {1, 2}], [[1, -2]])  # fmt: skip
    table = Arg([live], [tuple(live)], ["ab", [0.0], None, {0}, (True,)],
                [stale, [99], [live[0], live[0]]])  # fmt: skip
    block_id = Arg([0, live[0]], [manager.total_blocks - 1], [1.0, True, "0", None], [-1, 16])
    return {
        "max_hit_blocks": {"prompt_len": Arg([3, 7], [0, 1, 2**62], [4.5, True, "3"], [-1, -5])},
        **{name: {"token_ids": tokens}
           for name in ("block_keys", "lookup", "blocks_to_allocate", "allocate_prompt")},
        "cache_blocks": {
            "block_table": table,
            "token_ids": Arg([PROMPT, PROMPT[:2]], [[], PROMPT[:1], [*PROMPT, 1]], ["x", [1.5]],
                             [[-1], list(range(20)), [7, 7, 7, 7]]),
        },
        "allocate": {"num_blocks": Arg([0, 3], [manager.num_free_blocks], counts, [-1, 99])},
        "can_allocate": {"num_blocks": Arg([0, 3], [2**62], counts, [-1])},
        **{name: {"block_table": dataclasses.replace(table, edge=[[]])}
           for name in ("fork", "free")},
        "append_slot": {
            "block_table": table,
            "token_count": Arg([5, 6, 9], [len(live) * 2], counts, [-1]),
            "new_tokens": Arg([1], [0], counts, [-1]),
        },
        "translate_slot": {
            "block_table": table,
            "token_pos": Arg([0, 3], [len(live) * 2 - 1], [1.0, None], [-1, len(live) * 2]),
        },
        "ref_count": {"block_id": block_id},
        "key_of": {"block_id": block_id},
    }  # fmt: skip


@given(st.data())
def test_blocks_check_their_input_as_the_spec_does(data: st.DataObject) -> None:
    """The spec and the impl each check their input; they agree on the result or error class."""
    method = data.draw(st.sampled_from(sorted(manager_calls(*build_manager(SpecManager)))))
    values, expected = draw_call(data, manager_calls(*build_manager(SpecManager))[method])
    results = []
    for cls in (SpecManager, ImplManager):
        manager, _ = build_manager(cls)
        result = outcome(lambda: getattr(manager, method)(**values), expected)  # noqa: B023
        twin, _ = build_manager(cls)
        if isinstance(result, Exception):
            assert snapshot(manager) == snapshot(twin), f"{cls.__module__}.{method} changed state"
        results.append((type(result) if isinstance(result, Exception) else result, manager))
    (spec_result, spec), (impl_result, impl) = results
    assert spec_result == impl_result
    assert snapshot(spec) == snapshot(impl)


@pytest.mark.parametrize("returned", ["x", 1.5, None])
@pytest.mark.parametrize("cls", [SpecManager, ImplManager])
def test_a_hash_fn_failing_for_a_later_block_registers_nothing(cls: type, returned: object) -> None:
    """The spec used to register the first block before the second block's bad hash raised."""

    def hash_fn(parent: object, tokens: tuple[int, ...], extra: object) -> object:
        return returned if tokens == (3, 4) else hash((parent, tokens, extra))

    manager = cls(4, 2, hash_fn=hash_fn)
    table = manager.allocate(2)
    with pytest.raises(TypeError):
        manager.cache_blocks(table, [1, 2, 3, 4])
    assert manager.num_cached_blocks == 0 and manager.key_of(table[0]) is None


# ------------------------------------------------------------------ serving

PROMPT_TYPES = ["123", [1, 2.0], [True], None, (1, None)]
ENGINE_ARGS = {"total_blocks": 16, "block_size": 4, "max_num_seqs": 4}
TEMPERATURE = Arg([0.0, 0.7, 1], [TINY, 1e-300, 1e300, HUGE, -0.0], NOT_NUMBERS, BAD_NUMBERS)


def engine_state(engine: PagedAttentionEngine) -> tuple:
    waiting = [(seq.request_id, seq.tokens) for seq in engine.scheduler.waiting]
    running = [(seq.request_id, seq.tokens) for seq in engine.scheduler.running]
    return waiting, running, engine.store.num_free_blocks, len(engine.metrics)


def serving_calls(engine: PagedAttentionEngine) -> dict[str, tuple[Callable, dict[str, Arg]]]:
    logits = torch.randn(128, generator=torch.Generator().manual_seed(2))
    one_hot = torch.full((128,), -math.inf).index_fill(0, torch.tensor([7]), 0.0)
    counts = [2.0, True, "2"]
    return {
        "sample_token": (sample_token, {
            "logits": Arg([logits], [logits[:1], one_hot, logits.half()],
                          [logits.tolist(), logits.long(), None], [logits.view(2, 64), logits[:0]]),
            "temperature": TEMPERATURE,
            "generator": Arg([None, torch.Generator().manual_seed(1)], [], [1, "g"]),
        }),
        "add_request": (engine.add_request, {
            "prompt": Arg([[1, 2, 3], (4, 5)], [[0], [127] * 4, [9] * 50], PROMPT_TYPES,
                          [[], [1, 128], [-1]]),
            "max_new_tokens": Arg([2, 5], [1], counts, [0, -1, 10**6]),
            "n": Arg([1, 2], [4], counts, [0, 5]),
            "temperature": TEMPERATURE,
            "eos_token_id": Arg([None, 2], [0, 127], [2.0, True, "2"], [-1, 128]),
            "seed": Arg([None, 7], [0, 2**64], [1.0, True], [-1]),
        }),
        "generate": (engine.generate, {
            "prompts": Arg([[[1, 2, 3], [4, 5]]], [[], ([7],)], ["abc", [[1, 2], "x"], iter([[1]])],
                           [[[1, 2, 3], [4, 5], [], [7]], [[1, 200]]]),
            "max_new_tokens": Arg([2], [1], counts, [0]),
            "n": Arg([1, 2], [], counts, [0]),
            "temperature": TEMPERATURE,
            "eos_token_id": Arg([None], [0], [True], [128]),
            "progress": Arg([False], [], [0, "yes", None]),
            "on_step": Arg([None, lambda metrics: None], [], [1, "f"]),
        }),
        "PagedAttentionEngine": (lambda **kwargs: PagedAttentionEngine(MODEL, **kwargs), {
            "total_blocks": Arg([8], [1], [8.0, "8"], [0, -1]),
            "block_size": Arg([4], [1], [4.0, None], [0]),
            "enable_prefix_caching": Arg([True, False], [], [1, "yes"]),
            "keep_logits": Arg([False], [True], [0, None]),
            "seed": Arg([0], [2**70], [1.5, True], [-1]),
            "backend": Arg(["reference", None], [" Reference "], [1, b"x"], ["gpu"]),
        }),
        "CausalLM.from_seed": (CausalLM.from_seed, {
            "config": Arg([ModelConfig(num_layers=1)], [], [{"vocab_size": 128}, None]),
            "seed": Arg([0, 3], [2**64 - 1], [1.0, "0"], [-1, 2**64]),
            "dtype": Arg([torch.float32], [torch.bfloat16], [torch.int64, "float32"]),
        }),
        "CausalLM.compute_logits": (MODEL.compute_logits, {
            "hidden": Arg([torch.randn(3, 64)], [torch.randn(0, 64)],
                          [torch.randn(3, 64).double(), [[0.0] * 64]],
                          [torch.randn(64), torch.randn(3, 65)]),
        }),
        "ModelConfig": (ModelConfig, {
            "vocab_size": Arg([128], [1], [128.0, True], [0]),
            "num_kv_heads": Arg([2], [4], ["2"], [0, 3]),
            "head_dim": Arg([16], [2], [16.0], [0, 15]),
            "rope_theta": Arg([500.0], [TINY, HUGE], ["1e4", None], [0.0, -1.0, math.inf]),
            "rms_norm_eps": Arg([1e-6], [0.0, TINY], [True, "x"], [-1e-6, math.nan]),
            "tie_word_embeddings": Arg([False], [True], [0, "yes"]),
            "sliding_window": Arg([None, 8], [1, 2**70], [8.0, True, "8"], [0, -1]),
        }),
    }  # fmt: skip


@settings(max_examples=100)
@given(st.data())
def test_serving_checks_its_input(data: st.DataObject) -> None:
    engine = PagedAttentionEngine(MODEL, **ENGINE_ARGS)
    name = data.draw(st.sampled_from(sorted(serving_calls(engine))))
    function, args = serving_calls(engine)[name]
    values, expected = draw_call(data, args)
    generator = values.get("generator")
    state = generator.get_state() if isinstance(generator, torch.Generator) else None
    result = outcome(lambda: function(**values), expected)
    if isinstance(result, Exception):
        twin = PagedAttentionEngine(MODEL, **ENGINE_ARGS)
        assert engine_state(engine) == engine_state(twin)
        assert engine.add_request([1, 2, 3], 2) == twin.add_request([1, 2, 3], 2)
        if state is not None:
            assert torch.equal(generator.get_state(), state)
    elif name == "sample_token":
        assert isinstance(result, int) and 0 <= result < values["logits"].numel()
    # Whatever happened, the engine serves every request it holds, and a sampled one, to the end.
    engine.add_request([4, 5], 3, temperature=0.5)
    while engine.has_unfinished_requests():
        engine.step()
    check_all_freed(engine)


def test_a_tiny_temperature_samples_the_greedy_tokens() -> None:
    """``1e-300`` used to give NaN probabilities, and every later step raised."""
    engine = PagedAttentionEngine(MODEL, **ENGINE_ARGS)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    greedy = [out.outputs for out in engine.generate(prompts, 6)]
    for temperature in (TINY, 1e-300, 1e-30):
        sampled = engine.generate(prompts, 6, temperature=temperature, n=2)
        assert [out.outputs[:1] for out in sampled] == greedy
        assert all(out.outputs[0] == out.outputs[1] for out in sampled)


def test_max_model_len_bounds_the_prompt_plus_output_exactly() -> None:
    """Block size 4, ``max_model_len=10``: prompt plus output of 10 is served, 11 refused (as
    vLLM), though three blocks hold 12."""
    eng = PagedAttentionEngine(MODEL, 16, 4, max_num_seqs=2, max_model_len=10)
    for prompt_len, max_new in ((5, 6), (1, 10), (10, 1)):
        with pytest.raises(RequestTooLargeError, match="max_model_len=10"):
            eng.add_request([1] * prompt_len, max_new)
    assert not eng.has_unfinished_requests()
    outputs = eng.generate([[1] * 5, [2] * 9], 1)
    assert [len(out.outputs[0]) for out in outputs] == [1, 1]
    eng.add_request([1] * 5, 5)
    while eng.has_unfinished_requests():
        eng.step()
    check_all_freed(eng)
