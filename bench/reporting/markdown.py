"""Markdown for the report: tables, number formats, and re-wrapping prose to a fixed width."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence


def reflow(markdown: str, width: int = 100) -> str:
    """Re-wrap the paragraphs and bullet items of ``markdown`` to ``width`` columns (the text
    is written with numbers substituted in, so its line lengths vary); tables, headings,
    images and comments are kept as they are. Blocks are separated by blank lines; a bullet
    item starts with ``* `` and continues on the lines up to the next item."""

    def fill(text: str, indent: str = "") -> str:
        return textwrap.fill(
            text, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False
        )

    blocks = []
    for block in markdown.split("\n\n"):
        lines = block.strip("\n").splitlines()
        if not lines or lines[0].startswith(("|", "#", "![", "<!--")):
            blocks.append(block.strip("\n"))
        elif lines[0].startswith("* "):
            items: list[list[str]] = []
            for line in lines:
                if line.startswith("* "):
                    items.append([])
                items[-1].append(line.strip())
            blocks.append("\n".join(fill(" ".join(item), "  ") for item in items))
        else:
            blocks.append(fill(" ".join(line.strip() for line in lines)))
    return "\n\n".join(blocks) + "\n"


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table: ``header``, then one line per row, each cell as ``str`` gives it."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def pct(fraction: float) -> str:
    """A fraction as a percentage with one decimal: ``0.9825`` is ``98.2%``."""
    return f"{100 * fraction:.1f}%"


def pct_at_most(fraction: float, decimals: int = 2) -> str:
    """A fraction as a percentage rounded *up* to ``decimals``, so that "within" it is true."""
    scale = 10**decimals
    return f"{math.ceil(100 * fraction * scale) / scale:.{decimals}f}%"


def times(ratio: float) -> str:
    """A ratio with two decimals: ``1.6405`` is ``1.64x``."""
    return f"{ratio:.2f}x"


def ms(seconds: float, decimals: int = 3) -> str:
    """Seconds as milliseconds with ``decimals`` decimals, without the unit."""
    return f"{seconds * 1e3:.{decimals}f}"


def words(items: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    if len(items) <= 1:
        return "".join(items)
    return ", ".join(items[:-1]) + " and " + items[-1]
