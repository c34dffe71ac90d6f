"""The lockstep driver of the differential machines: :meth:`Lockstep.both` calls ``self.model``
and ``self.impl`` and asserts the same outcome (equal results of the same types, or the same
exception class), list arguments left alike, and a refusal changing nothing (:meth:`snapshot`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from properties.outcomes import outcome


def same_types(expected: Any, actual: Any, view: Callable[[Any], Any] | None = None) -> bool:
    """Equal and of the same types, element by element (no numpy ints), seen through ``view``."""
    if view is not None:
        expected, actual = view(expected), view(actual)
    if type(expected) is not type(actual):
        return False
    if isinstance(expected, (list, tuple)):
        return len(expected) == len(actual) and all(
            same_types(e, a, view) for e, a in zip(expected, actual, strict=True)
        )
    return bool(expected == actual)


def same_outcome(expected: tuple[str, Any], actual: tuple[str, Any], view: Any = None) -> bool:
    """The same exception class, or results equal and of the same types (:func:`same_types`)."""
    if expected[0] == "raised":
        return actual[0] == "raised" and expected[1] is actual[1]
    return actual[0] == "ok" and same_types(expected[1], actual[1], view)


class Lockstep:
    model: Any
    impl: Any

    def view(self, value: Any) -> Any:
        """How results are compared (with :func:`same_types`): as they are, unless overridden."""
        return value

    def snapshot(self) -> object:
        """What a refused call must leave as it was (nothing, unless a machine says)."""
        return None

    def expect(self, name: str, *args: Any) -> tuple[str, Any]:
        return outcome(getattr(self.model, name), *args)

    def after(self, name: str, args: tuple[Any, ...], expected: tuple[str, Any]) -> None:
        """Checks after every call (a machine's KV events, say)."""

    def both(self, name: str, *args: Any, impl_name: str | None = None) -> tuple[str, Any]:
        """``name(*args)`` on the model, ``impl_name or name`` on impl; the model's outcome. An
        ``impl_name`` is the array API: list arguments go as int64 arrays, an array comes back
        as its list."""
        before = self.snapshot()
        model_args = [list(arg) if isinstance(arg, list) else arg for arg in args]
        expected = self.expect(name, *model_args)
        arrays = impl_name and [np.array(a, np.int64) if isinstance(a, list) else a for a in args]
        actual = outcome(getattr(self.impl, impl_name or name), *(arrays or args))
        if impl_name and actual[0] == "ok" and isinstance(actual[1], np.ndarray):
            actual = ("ok", actual[1].tolist())
        where = f"{name}{args}: expected {expected}, impl {actual}"
        assert same_outcome(expected, actual, self.view), where
        if expected[0] == "raised":
            assert self.snapshot() == before, f"a refused {name} changed the state"
        for arg, model_arg in zip(args, model_args, strict=True):
            assert not isinstance(arg, list) or arg == model_arg, f"{name} mutated its argument"
        self.after(name, args, expected)
        return expected

    def refuses(self, error: type[Exception], call: Callable[..., Any], *args: Any) -> str:
        """``call(*args)`` raises ``error`` and changes nothing; returns its message."""
        before = self.snapshot()
        try:
            call(*args)
        except error as raised:
            assert self.snapshot() == before, f"{call.__name__} raised but changed the state"
            return str(raised)
        raise AssertionError(f"{call.__name__}{args} did not raise {error.__name__}")
