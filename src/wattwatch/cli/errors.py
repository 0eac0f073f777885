"""The command line's two kinds of failure, each printed as one line that says what to do.

``UsageError`` (exit 2): a flag, argument or setup the user must fix. ``RuntimeFailure`` (exit 1): the
command was right but something it needs failed (a collector unreachable or answering 5xx).
"""

from __future__ import annotations


class UsageError(Exception):
    """A flag or argument the user must fix; printed as one line, exit 2."""


class RuntimeFailure(Exception):
    """Something the command needs failed while it ran; printed as one line, exit 1."""
