"""What the SDK tells the workload instead of raising: one warning when energy is not being recorded,
and per reason a warning for the first span or label dropped as out of bounds, with counts in ``refused()``.
"""

from __future__ import annotations

import collections
import threading
import warnings

from wattwatch.protocol import limits

_warned = False
_refused: collections.Counter[str] = collections.Counter()
_refused_lock = threading.Lock()


def refused() -> dict[str, int]:
    """Spans and labels this process dropped as out of bounds, by reason (``limits.REASONS``)."""
    with _refused_lock:
        return dict(_refused)


def refuse(what: str, exc: limits.BoundError) -> None:
    """Count ``exc``'s reason; warn the first time per reason that ``what`` (e.g. "a step span was") was dropped."""
    with _refused_lock:
        first = _refused[exc.reason] == 0
        _refused[exc.reason] += 1
    if first:
        warnings.warn(
            f"wattwatch: {what} dropped: {exc} (further ones for this reason are counted in wattwatch.sdk.refused())",
            RuntimeWarning,
            stacklevel=4,
        )


def warn_once(message: str) -> None:
    """Warn once per process that energy is not being recorded, and why (``message``)."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"wattwatch: {message}; energy is not being recorded", RuntimeWarning, stacklevel=3)
