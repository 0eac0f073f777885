"""How the benchmarks print their results: the command that produced them, then a markdown table.

The tables in docs/ are pasted from this output unchanged, so a figure in the docs always has a
command next to it that prints it again.
"""

from __future__ import annotations

import shlex
import textwrap
from collections.abc import Sequence


def command(script: str, argv: Sequence[str]) -> str:
    """The command line, as a reader would type it from the repository root, in backquotes."""
    return "`" + shlex.join(["python", f"benchmarks/{script}", *argv]) + "`"


def caption(text: str, width: int = 105) -> str:
    """A paragraph wrapped as the docs wrap their prose."""
    return textwrap.fill(text, width, break_long_words=False, break_on_hyphens=False)


def paragraph(text: str) -> str:
    """``caption(text)`` as a paragraph of its own, blank lines around it."""
    return "\n" + caption(text) + "\n"


def table(header: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[bool] | None = None) -> str:
    """A markdown table, columns padded to their widest cell; ``right`` marks right-aligned columns
    (default: all but the first)."""
    align = list(right) if right is not None else [False, *([True] * (len(header) - 1))]
    cells = [list(header), *[list(r) for r in rows]]
    if any(len(r) != len(header) for r in cells):
        raise ValueError("every row needs one cell per column")
    widths = [max(3, *(len(r[c]) for r in cells)) for c in range(len(header))]

    def line(row: Sequence[str]) -> str:
        padded = [cell.rjust(w) if a else cell.ljust(w) for cell, w, a in zip(row, widths, align, strict=True)]
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if a else ("-" * (w + 2)) for w, a in zip(widths, align, strict=True))
    return "\n".join([line(header), rule + "|", *(line(r) for r in rows)])


def percent(x: float, digits: int = 2, sign: bool = True) -> str:
    """``x`` (a fraction) as a percentage: ``+1.23%``."""
    return f"{x:+.{digits}%}" if sign else f"{x:.{digits}%}"
