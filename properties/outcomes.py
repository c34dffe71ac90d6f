"""What a call did, ``("ok", result)`` or ``("raised", class)``: outcomes compare with ``==``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def outcome(call: Callable[..., Any], *args: Any, message: bool = False) -> tuple[str, Any]:
    """``("ok", call(*args))``, or ``("raised", class)`` (``(class, message)`` with ``message``)."""
    try:
        return "ok", call(*args)
    except Exception as error:  # the class (and message) is what is compared
        return "raised", (type(error), str(error)) if message else type(error)
