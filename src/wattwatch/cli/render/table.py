"""Tables people read: fitted to a width, plain when piped, colour only on a terminal that wants it.

Widths are measured in the cells a terminal gives each character (``rich.cells``: a CJK character or an
emoji takes two), so columns line up whatever the job names hold; bold and dim are rich styles, and there
are no control codes at all when colour is off. Not a ``rich.table.Table``: laying out a 100-job page
through it takes 35 ms and its import 40 ms more, a third of a report's start-up budget, for the same
lines. rich is imported only for a name beyond ASCII or for colour.

Fitting: while a table is wider than its width, columns that allow it are first cut to their cap (a long
job name), then dropped, least needed first (the caller ranks them), then cut to their minimum (widths in
terminal cells). The
caller says which were dropped (``Fitted.hidden``) so the reader knows where to find them (CSV, JSON).
Cells are cut with a trailing ``~`` (ASCII), never the job id column: what a table shows is typed back.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

# A table written where no terminal says its width (a pipe, a file) fits this many columns, unless
# $COLUMNS says otherwise: wide enough for the useful columns, narrow enough for a mail or a review.
DEFAULT_WIDTH = 100
GAP = "  "


@dataclass(frozen=True)
class Column:
    """One column: its title, alignment, and how it yields room when the table is too wide."""

    title: str
    right: bool = False  # numbers align right
    drop: int = 0  # 0: always shown; else dropped to fit, the highest rank first
    cap: int | None = None  # cut to this many characters before any column is dropped
    minimum: int | None = None  # then, after dropping, cut down to this; None: never cut


@dataclass(frozen=True)
class Fitted:
    """A rendered table and the titles of the columns dropped to fit it."""

    text: str
    hidden: list[str]


def wants_color(stream: TextIO | None, *, no_color: bool = False) -> bool:
    """Colour only on a terminal, and not with ``--no-color``, ``NO_COLOR`` (any value) or ``TERM=dumb``."""
    if no_color or os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


def width_for(stream: TextIO | None, requested: int | None = None) -> int | None:
    """The width to fit: ``requested`` (0: unlimited, None), else the terminal's when ``stream`` is one
    (None: a file), else ``$COLUMNS``, else ``DEFAULT_WIDTH``."""
    if requested is not None:
        return requested or None
    isatty = getattr(stream, "isatty", None)
    if isatty and isatty():
        return terminal_columns()
    return _columns_env() or DEFAULT_WIDTH


def _columns_env() -> int | None:
    columns = os.environ.get("COLUMNS", "")
    return int(columns) if columns.isdigit() and int(columns) > 0 else None


def terminal_columns(fallback: int = DEFAULT_WIDTH) -> int:
    """The terminal's width as ``shutil.get_terminal_size`` gives it (``$COLUMNS`` first, then the terminal on
    standard output), ``fallback`` when neither says. Not through shutil: it imports bz2 and lzma, 1.3 ms of
    a read command's start-up."""
    columns = _columns_env()
    if columns:
        return columns
    try:
        return os.get_terminal_size(sys.__stdout__.fileno()).columns or fallback  # type: ignore[union-attr]
    except (AttributeError, ValueError, OSError):
        return fallback


def cells(text: str) -> int:
    """The terminal cells ``text`` takes: two for a CJK character or an emoji, one for ASCII."""
    if text.isascii():
        return len(text)  # the common case, without importing rich
    from rich.cells import cell_len

    return cell_len(text)


def wrap(text: str, width: int) -> str:
    """``text`` in lines of at most ``width`` cells, broken between words (a word longer than a line
    gets a line of its own). Not ``textwrap``: its import is 1 ms of a read command's start-up."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and cells(line) + 1 + cells(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}" if line else word
    return "\n".join([*lines, line] if line else lines)


def cut(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, a trailing ``~`` marking a cut (a wide character that would
    straddle the cut gives way to a space)."""
    if cells(text) <= width:
        return text
    from rich.cells import set_cell_size

    return set_cell_size(text, max(width - 1, 0)) + "~"


def render(
    columns: Sequence[Column],
    rows: Sequence[Sequence[str]],
    *,
    width: int | None = None,
    color: bool = False,
    strong_rows: Sequence[int] = (),
) -> Fitted:
    """``rows`` under ``columns``, fitted to ``width`` (None: as wide as they are); ``strong_rows``
    (indexes, e.g. a total) are bold in colour."""
    natural = [max([cells(c.title), *(cells(r[i]) for r in rows)]) for i, c in enumerate(columns)]
    widths = list(natural)
    kept = list(range(len(columns)))

    def total() -> int:
        return sum(widths[i] for i in kept) + len(GAP) * (len(kept) - 1)

    if width is not None:
        for i, c in enumerate(columns):
            if c.cap is not None and total() > width:
                widths[i] = min(widths[i], max(c.cap, cells(c.title)))
        for i in sorted((i for i, c in enumerate(columns) if c.drop), key=lambda i: -columns[i].drop):
            if total() <= width:
                break
            kept.remove(i)
        for i in kept:
            c = columns[i]
            if c.minimum is not None and total() > width:
                widths[i] = max(c.minimum, cells(c.title), widths[i] - (total() - width))
    lines = []
    for n, row in enumerate([[c.title for c in columns], *rows]):
        parts = []
        for i in kept:
            text = cut(row[i], widths[i])
            pad = " " * (widths[i] - cells(text))
            parts.append(pad + text if columns[i].right else text + pad)
        line = GAP.join(parts).rstrip()
        lines.append(_styled(line, "bold") if color and (n == 0 or n - 1 in strong_rows) else line)
    hidden = [c.title for i, c in enumerate(columns) if i not in kept]
    return Fitted("\n".join(lines), hidden)


def _styled(text: str, style: str) -> str:
    """``text`` in a rich style (``bold``, ``dim``) as a terminal's control codes."""
    from rich.color import ColorSystem
    from rich.style import Style

    return Style.parse(style).render(text, color_system=ColorSystem.STANDARD)


def dim(text: str, color: bool) -> str:
    """``text`` dimmed when ``color`` (notes under a table)."""
    return _styled(text, "dim") if color and text else text
