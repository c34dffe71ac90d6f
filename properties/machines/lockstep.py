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
        """``name(*args)`` on the model, ``impl_name or name`` on impl; the model's outcome."""
        before = self.snapshot()
        model_args = [list(arg) if isinstance(arg, list) else arg for arg in args]
        expected = self.expect(name, *model_args)
        actual = outcome(getattr(self.impl, impl_name or name), *args)
        if impl_name and actual[0] == "ok" and isinstance(actual[1], np.ndarray):
            actual = ("ok", actual[1].tolist())  # the array API: compared as its list
        where = f"{name}{args}: expected {expected}, impl {actual}"
        assert expected[0] == actual[0], where
        if expected[0] == "raised":
            assert expected[1] is actual[1], where
            assert self.snapshot() == before, f"a refused {name} changed the state"
        else:
            assert same_types(expected[1], actual[1], self.view), where
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
