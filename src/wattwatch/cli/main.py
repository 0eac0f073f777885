"""The ``wattwatch`` command line: the parser and the dispatch to each command's module.

Exit codes: 0 success; 2 a usage or setup problem, reported in one line that says what to fix;
``wattwatch run`` exits with its command's own code.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from wattwatch import __version__, redact
from wattwatch.cli import (
    agent,
    collector,
    completion,
    db,
    demo,
    doctor,
    jobs,
    options,
    report,
    run,
    spool,
    token,
    top,
    up,
)
from wattwatch.cli.errors import RuntimeFailure, UsageError
from wattwatch.cli.settings import settings_from
from wattwatch.errors import WattwatchError

# Each command's module: ``add_parser(sub)`` declares it, ``run(args, settings)`` does it. In the order
# ``wattwatch --help`` lists them.
COMMANDS: dict[str, ModuleType] = {
    "up": up,
    "demo": demo,
    "collector": collector,
    "agent": agent,
    "run": run,
    "report": report,
    "doctor": doctor,
    "db": db,
    "token": token,
    "jobs": jobs,
    "spool": spool,
    "top": top,
    "completion": completion,
}
# The long-running services log what they do at INFO; the rest print their answer and warnings only.
SERVICES = ("up", "collector", "agent")

EPILOG = """examples:
  wattwatch demo                         simulated GPUs, synthetic jobs, then a report
  wattwatch up --simulate 4              collector + agent on this machine (embedded SQLite)
  wattwatch run --kind training --name llama-ft -- python train.py
  wattwatch report --since 7d --format json"""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser: every command, each with --help and examples."""
    p = options.Parser(
        prog="wattwatch",
        description="Energy and power measurement for AI workloads: joules per training run and per query.",
        epilog=EPILOG,
    )
    p.add_argument("--version", action="version", version=f"wattwatch {__version__}")
    options.add_globals(p, default=None)
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=options.Parser)
    for module in COMMANDS.values():
        module.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wattwatch`` console script: the exit code (argv: ``sys.argv[1:]`` if None)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    negative = _negative_duration(argv)
    if negative:
        sys.stderr.write(f"wattwatch: error: {negative}\n")
        return 2
    parser = build_parser()
    if "_ARGCOMPLETE" in os.environ:  # the shell asks what Tab offers (`wattwatch completion`): answer, exit
        import argcomplete

        # Options only once a "-" is typed: a bare Tab offers the commands, actions or choices.
        argcomplete.autocomplete(parser, always_complete_options=False, exit_method=sys.exit)
    args = parser.parse_args(argv)
    args.argv = argv  # as typed: the collector's supervisor starts its workers with the same arguments
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(args)
    try:
        if args.home:
            os.environ["WATTWATCH_HOME"] = str(Path(args.home).expanduser())
        return int(COMMANDS[args.command].run(args, settings_from(args)))
    except (UsageError, WattwatchError) as exc:
        sys.stderr.write(f"wattwatch {args.command}: error: {redact.text(str(exc))}\n")
        return 2
    except RuntimeFailure as exc:
        sys.stderr.write(f"wattwatch {args.command}: error: {redact.text(str(exc))}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # never a traceback for a user; -v / --log-level debug logs it
        import logging

        logging.getLogger("wattwatch").debug("unexpected error", exc_info=True)
        first = redact.text((str(exc).strip().splitlines() or [""])[0][:300])
        sys.stderr.write(
            f"wattwatch {args.command}: error: unexpected {type(exc).__name__}: {first}; rerun with "
            "--log-level debug for details and report it\n"
        )
        return 1


def _configure_logging(args: argparse.Namespace) -> None:
    """Services log what they do; one-shot commands (the demo too: it prints its own story and a table)
    print their answer and only warnings besides. Logs go to stderr, answers to stdout."""
    import logging

    level = logging.DEBUG if args.verbose else (logging.INFO if args.command in SERVICES else logging.WARNING)
    if args.log_level:
        level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, stream=sys.stderr)
    # Every line through one formatter that masks URL credentials and this process's tokens.
    for handler in logging.getLogger().handlers:
        handler.setFormatter(redact.RedactingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for noisy in ("apscheduler", "httpx", "httpcore", "uvicorn", "alembic"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level <= logging.DEBUG else max(level, logging.WARNING))


# Options taking a duration or a time; argparse reads "-5d" after them as an option and says only
# "expected one argument".
_TIME_OPTIONS = ("--since", "--until", "--time-window-past", "--time-window-future")


def _negative_duration(argv: list[str]) -> str | None:
    """The one-line error for a negative duration given as ``--since -5d``, else None."""
    for flag, value in itertools.pairwise(argv):
        if flag == "--":
            return None
        if flag in _TIME_OPTIONS and len(value) > 1 and value[0] == "-" and (value[1].isdigit() or value[1] == "."):
            return f"{flag} {value}: negative durations are invalid; give how far back as a positive one, e.g. 5d"
    return None


if __name__ == "__main__":
    raise SystemExit(main())
