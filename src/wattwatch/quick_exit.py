"""Ending a one-shot read command without the interpreter's teardown.

After ``wattwatch report`` has printed, CPython still tears down every module it imported, SQLAlchemy's
thousands of objects included, and runs a last garbage collection over them: 100-300 ms of a command whose
answer is already on the screen (``benchmarks/report_startup.py``). The commands listed here only read,
close their database engine and files themselves, and start no threads, so once their output is flushed
the process may end at once (``os._exit``). Only when run as a program: a caller of ``cli.main(argv)`` in
the same process (tests) gets the exit code back as before.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

# Read-only commands that leave nothing to finish at exit.
QUICK_COMMANDS = frozenset({"report", "jobs", "top", "completion"})
# Options before the command that take a value (so the value is not read as the command).
_VALUED_GLOBALS = frozenset({"--home", "--log-level"})


def command_of(argv: Sequence[str]) -> str | None:
    """The command word of a ``wattwatch`` command line (None when there is none)."""
    skip = False
    for word in argv:
        if skip:
            skip = False
        elif _takes_value(word):
            skip = True
        elif not word.startswith("-"):
            return word
    return None


def _takes_value(word: str) -> bool:
    """Whether ``word`` is a global option whose value is the next word: ``--home``, or any prefix argparse
    takes for it (``--hom``, ``--log``); ``--home=X`` carries its own."""
    return len(word) > 2 and "=" not in word and any(g.startswith(word) for g in _VALUED_GLOBALS)


def finish(code: int, argv: Sequence[str]) -> int:
    """End the process now with ``code`` when ``argv``'s command is a quick one; else return ``code``."""
    if command_of(argv) not in QUICK_COMMANDS:
        return code
    logging = sys.modules.get("logging")  # flush log handlers, if anything imported logging at all
    if logging is not None:
        logging.shutdown()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # a reader that went away (| head), or a closed stream
        pass
    os._exit(code)
