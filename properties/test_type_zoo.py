"""One verdict at the door: each public entry point takes a value every layer below takes, as
its plain value, or refuses it by name changing nothing (a type zoo; design.md, "Input rules")."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pagedkv.impl.blocks import BlockManager as ImplManager
from pagedkv.impl.blocks import BlockTableStore
from pagedkv.impl.serving import engine as engine_module
from pagedkv.impl.serving import paged_kv as paged_kv_module
from pagedkv.impl.serving.engine import PagedAttentionEngine
from pagedkv.impl.serving.hf_loader import config_from_hf
from pagedkv.impl.serving.model import CausalLM
from pagedkv.spec.block_manager import BlockManager as SpecManager
from pagedkv.spec.checks import OutOfBlocksError
from properties.engine_cases import (
    CONFIG,
    MODEL,
    single_thread,  # noqa: F401 - an autouse fixture
)
from properties.hf_cases import tiny_hf_model
from properties.mutants import load_mutant

Int, Str, Bytes = type("Int", (int,), {}), type("Str", (str,), {}), type("Bytes", (bytes,), {})


class LyingInt(int):
    """Off-by-one arithmetic: a layer computing with it, not its checked plain value, goes wrong."""

    def __add__(self, other: object) -> int:
        return int(self) + int(other) + 1  # type: ignore[call-overload]

    __radd__ = __add__

    def __sub__(self, other: object) -> int:
        return int(self) - int(other) - 1  # type: ignore[call-overload]

    def __rsub__(self, other: object) -> int:
        return int(other) - int(self) - 1  # type: ignore[call-overload]


ZOO: dict[str, object] = {
    "int subclass": Int(3), "int subclass with its own arithmetic": LyingInt(3), "None": None,
    "bool": True, "numpy int64": np.int64(3), "numpy bool": np.bool_(True), "float": 3.0,
    "numpy float64": np.float64(3.0), "2**31": 2**31, "2**63": 2**63, "2**64": 2**64,
    "str subclass": Str("t"), "numpy str": np.str_("t"), "bytes subclass": Bytes(b"t"),
    "NaN": math.nan, "0.0": 0.0, "-0.0": -0.0,
}  # fmt: skip


def plain(value: object) -> object:
    """The plain value a subclass is taken as (design.md's input rules)."""
    for base in (bool, int, float, str, bytes):
        if isinstance(value, base):
            return base(value)  # type: ignore[call-arg]
    return value


# design.md §6's error classes (subclasses such as ``RequestTooLargeError`` count as their base).
ERRORS = (OutOfBlocksError, TypeError, IndexError, ValueError)


def verdict(call: Callable[[], Any]) -> tuple[str, Any]:
    """("ok", the result), or §6's class and the message of what ``call`` raised."""
    try:
        return "ok", call()
    except ERRORS as error:
        kind = next(cls for cls in ERRORS if isinstance(error, cls))
        return kind.__name__, str(error)


# ----------------------------------------------------------------- the engine

REQUEST = {
    "prompt": [5, 7, 9], "max_new_tokens": 2, "n": 1, "temperature": 0.0, "eos_token_id": None,
    "seed": None, "cache_salt": None,
}  # fmt: skip
NAMES = {"prompt": "token", "max_new_tokens": "max_new_tokens", "n": "n"}  # what an error names


def engine() -> PagedAttentionEngine:
    return PagedAttentionEngine(MODEL, 16, 4, max_num_seqs=4, max_model_len=64,
                                enable_prefix_caching=True)  # fmt: skip


def served(kwargs: dict[str, Any]) -> tuple[str, Any]:
    """Queue one request and run it to completion: ("ok", its outputs) or the refusal. An
    output's ``prompt`` is the checked prompt: plain ints, not the caller's token objects."""
    eng = engine()
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt")
    outcome = verdict(lambda: eng.add_request(prompt, **kwargs))
    if outcome[0] != "ok":
        assert outcome[0] in ("TypeError", "ValueError"), outcome
        assert not eng.has_unfinished_requests(), "a refused request was queued"
        assert eng.add_request([1], 1) == 0, "a refused request took an id"
        return outcome
    outputs = []
    while eng.has_unfinished_requests():
        outputs += eng.step().finished  # a layer below refusing it raises here
    for out in outputs:
        assert out.prompt == prompt and all(type(token) is int for token in out.prompt)
    return "ok", [out.outputs for out in outputs]


@pytest.mark.parametrize("argument", sorted(REQUEST))
def test_add_request_verdicts_agree(argument: str) -> None:
    for label, value in ZOO.items():
        kwargs = dict(REQUEST)
        kwargs[argument] = [5, value, 9] if argument == "prompt" else value
        outcome = served(kwargs)
        what = f"{argument}={label}"
        if outcome[0] == "ok":
            kwargs[argument] = [5, plain(value), 9] if argument == "prompt" else plain(value)
            assert served(kwargs) == outcome, f"{what}: not served as its plain value"
        else:
            name = NAMES.get(argument, argument)
            assert name in outcome[1], f"{what}: {outcome} does not name {name}"


@pytest.mark.parametrize("argument", ["max_new_tokens", "n", "temperature", "eos_token_id"])
def test_generate_verdicts_agree_with_add_request(argument: str) -> None:
    """``generate`` refuses exactly what ``add_request`` refuses, with the same class."""
    for label, value in ZOO.items():
        kwargs = {"max_new_tokens": 2, argument: value}
        eng = engine()
        got = verdict(lambda eng=eng, kwargs=kwargs: eng.generate([[5, 7, 9]], **kwargs))
        expected = served({**REQUEST, **kwargs})
        assert got[0] == expected[0], f"{argument}={label}: generate {got} vs {expected}"
        if got[0] == "ok":
            assert [out.outputs for out in got[1]] == expected[1]
        else:
            assert not eng.has_unfinished_requests()


# ----------------------------------------------------------------- managers and the store

MANAGER_CALLS: dict[str, Callable[[Any, list[int], object], Any]] = {
    "allocate": lambda manager, table, value: manager.allocate(value),
    "truncate": lambda manager, table, value: manager.truncate(table, value),
    "window count": lambda manager, table, value: manager.release_outside_window(table, value, 2),
    "window": lambda manager, table, value: manager.release_outside_window(table, 8, value),
    "translate_slot": lambda manager, table, value: manager.translate_slot(table, value),
}


def test_spec_and_impl_managers_agree() -> None:
    for (name, call), (label, value) in itertools.product(MANAGER_CALLS.items(), ZOO.items()):
        spec, impl = SpecManager(8, 4), ImplManager(8, 4)
        spec_table, impl_table = spec.allocate(2), impl.allocate(2)  # up to 8 tokens
        got_spec = verdict(lambda: call(spec, spec_table, value))  # noqa: B023 - called here
        got_impl = verdict(lambda: call(impl, impl_table, value))  # noqa: B023
        what = f"{name}({label})"
        assert got_spec[0] == got_impl[0], f"{what}: spec {got_spec}, impl {got_impl}"
        if got_spec[0] == "ok":
            assert got_spec[1] == got_impl[1], what
        assert spec.free_block_ids() == impl.free_block_ids(), what


def test_allocate_array_takes_what_allocate_takes() -> None:
    for label, value in ZOO.items():
        array, listed = ImplManager(8, 4), ImplManager(8, 4)
        got = verdict(lambda: array.allocate_array(value).tolist())  # noqa: B023 - called here
        assert got == verdict(lambda: listed.allocate(value)), label  # noqa: B023
        assert array.free_block_ids() == listed.free_block_ids(), label


STORE_CALLS: dict[str, tuple[Callable[[Any, object], Any], Callable[[Any, Any, object], Any]]] = {
    "window": (lambda store, value: store.release_outside_window([0], value),
               lambda spec, table, value: spec.release_outside_window(table, 8, value)),
    "truncate": (lambda store, value: store.truncate([0], value),
                 lambda spec, table, value: spec.truncate(table, value)),
}  # fmt: skip


def test_the_store_agrees_with_the_managers() -> None:
    """The store's window and count arguments: the verdicts and tables of the spec's calls."""
    for (name, (on_store, on_spec)), (label, value) in itertools.product(
        STORE_CALLS.items(), ZOO.items()
    ):
        spec, store = SpecManager(8, 4), BlockTableStore(ImplManager(8, 4), 2, 4)
        table = spec.allocate(2)
        store.add(0, 8)
        got_store = verdict(lambda: on_store(store, value))  # noqa: B023 - called here
        got_spec = verdict(lambda: on_spec(spec, table, value))  # noqa: B023
        what = f"{name}({label})"
        assert got_store[0] == got_spec[0], f"{what}: store {got_store}, spec {got_spec}"
        assert store.table(0) == (got_spec[1] if got_spec[0] == "ok" else table), what


# ----------------------------------------------------------------- the loader


def test_a_window_the_loader_takes_is_one_the_engine_serves() -> None:
    """A ``sliding_window`` the loader accepts is served by every layer as its plain value."""
    base = tiny_hf_model("Mistral", sliding_window=None).config.to_dict()
    for label, value in ZOO.items():
        config = SimpleNamespace(to_dict=lambda value=value: {**base, "sliding_window": value})
        got = verdict(lambda config=config: config_from_hf(config).sliding_window)
        if got[0] != "ok":
            assert "sliding_window" in got[1], f"{label}: {got}"
            continue
        assert got[1] == plain(value) and type(got[1]) is type(plain(value)), label
        assert windowed_output(got[1]) == windowed_output(plain(value)), label


def windowed_output(window: object) -> list[list[int]]:
    model = CausalLM.from_seed(dataclasses.replace(CONFIG, sliding_window=window), seed=0)
    eng = PagedAttentionEngine(model, 16, 2, max_num_seqs=2, max_model_len=32)
    return eng.generate([[5, 7, 9, 11]], 3)[0].outputs


def test_an_unchecked_window_in_the_kernels_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """Teeth: a K/V cache passing the model's window to the kernels unchecked fails on ``2**64``."""
    mutant = load_mutant(
        paged_kv_module, "PagedKVCache.__init__",
        "self.window = int32_window(config.sliding_window)", "self.window = config.sliding_window",
        ("PagedStep",),
    )  # fmt: skip
    monkeypatch.setattr(engine_module, "PagedKVCache", mutant.PagedKVCache)
    with pytest.raises(ValueError, match="window"):
        test_a_window_the_loader_takes_is_one_the_engine_serves()
