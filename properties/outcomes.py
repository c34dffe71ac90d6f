"""One way for every property to compare what two calls did: the result, or what was raised.

Differential properties call the same operation on the spec and on an implementation and assert
that both returned equal results or both raised the same exception class (with ``message=True``,
also the same message). A call's outcome is ``("ok", result)`` or ``("raised", class)``
(``("raised", (class, message))``), so outcomes compare with ``==``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def outcome(call: Callable[..., Any], *args: Any, message: bool = False) -> tuple[str, Any]:
    """``("ok", call(*args))``, or ``("raised", exception class)`` (with ``message``, the class
    and the message) if it raised."""
    try:
        return "ok", call(*args)
    except Exception as error:  # the class (and message) is what is compared
        return "raised", (type(error), str(error)) if message else type(error)
