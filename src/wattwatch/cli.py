"""The ``wattwatch`` command line. Nothing imports this module.

Exit codes: 0 success; 2 a usage or setup problem, reported in one line that says what to fix;
``wattwatch run`` exits with its command's own code.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from wattwatch import __version__, record, report_options
from wattwatch.cli_errors import RuntimeFailure, UsageError
from wattwatch.config import Settings, load_settings, parse_listen, resolve_token
from wattwatch.errors import ConfigError, WattwatchError
from wattwatch.units import JOB_KINDS, parse_duration_s

LOG_LEVELS = ("debug", "info", "warning", "error")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter (descriptions and examples as written) with the terminal's width read once:
    argparse asks shutil for it in each of the 70-odd formatters that building a parser makes, and
    importing shutil is 2 ms of a read command's start-up."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, _help_width() if width is None else width)


@functools.cache
def _help_width() -> int:
    from wattwatch.table_render import terminal_columns

    return terminal_columns(80) - 2  # argparse's own: shutil's width (fallback 80), less 2


class _Parser(argparse.ArgumentParser):
    """argparse, but errors are one line naming the fix, and exit 2; help in ``_Formatter``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def _fmt() -> type[argparse.RawDescriptionHelpFormatter]:
    return _Formatter


class _Skipped:
    """Stands in for the parser of a command this run does not use: every call on it is accepted and
    ignored, so its options cost nothing to declare (declaring every command's took 19 ms of a
    `report --server` whose budget is 200 ms)."""

    def __getattr__(self, name: str) -> Any:
        return self._ignore

    def _ignore(self, *args: Any, **kwargs: Any) -> _Skipped:
        return self


class _OnlyOne:
    """The command parsers, where only ``only`` gets its options: every other command is still listed
    (``wattwatch --help``, "invalid choice" errors) with its help line."""

    def __init__(self, sub: Any, only: str) -> None:
        self._sub, self._only = sub, only

    def add_parser(self, name: str, **kwargs: Any) -> Any:
        """The full parser for ``only``; for any other command its name and help line alone."""
        if name == self._only:
            return self._sub.add_parser(name, **kwargs)
        self._sub.add_parser(name, help=kwargs.get("help"))
        return _Skipped()


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The argument parser (every command has --help with an example). With ``only``, the options of that
    command alone are declared (the others are listed by name): what one run needs."""
    p = _Parser(
        prog="wattwatch",
        formatter_class=_fmt(),
        description="Energy and power measurement for AI workloads: joules per training run and per query.",
        epilog="""examples:
  wattwatch demo                         simulated GPUs, synthetic jobs, then a report
  wattwatch up --simulate 4              collector + agent on this machine (embedded SQLite)
  wattwatch run --kind training --name llama-ft -- python train.py
  wattwatch report --since 7d --format json""",
    )
    p.add_argument("--version", action="version", version=f"wattwatch {__version__}")
    _add_globals(p, default=None)
    sub: Any = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    if only is not None:
        sub = _OnlyOne(sub, only)

    up = sub.add_parser(
        "up",
        help="collector + local agent in one process (embedded SQLite by default)",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch up --simulate 4 --listen 127.0.0.1:8470\n"
        "  wattwatch up --simulate 4 --metrics-listen 127.0.0.1:9471   the agent's own /metrics too",
    )
    _add_db(up)
    _add_listen(up)
    up.add_argument("--simulate", type=int, default=0, metavar="N", help="simulate N GPUs (no GPU needed)")
    _add_sim_flaws(up)
    up.add_argument("--interval", type=float, metavar="S", help="sampling tick in seconds (default 1)")
    _add_allow_open(up)
    _add_metric_labels(up)
    _add_retention(up)
    _add_agent_options(up)
    _add_grid_region(up)

    demo = sub.add_parser(
        "demo",
        help="`up` with simulated GPUs running synthetic training and inference jobs",
        formatter_class=_fmt(),
        epilog="example:\n  wattwatch demo --duration 20",
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to run before printing the report (default 30; 0 runs until Ctrl-C)",
    )
    _add_db(demo)
    _add_listen(demo)
    _add_sim_flaws(demo)

    col = sub.add_parser(
        "collector",
        help="the central service (PostgreSQL in production)",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch collector --db postgresql://wattwatch@db/wattwatch --listen 0.0.0.0:8470\n"
        "  wattwatch collector --listen 0.0.0.0:8470 --tls-cert cert.pem --tls-key key.pem   HTTPS\n"
        "  wattwatch collector --migrate --metric-labels team,namespace\n"
        "Beyond loopback it needs a token: `wattwatch token create --role agent --host HOST` (or --allow-open).",
    )
    _add_db(col)
    _add_listen(col)
    _add_token(col, "a static admin token (backward compatible; prefer `wattwatch token create`)")
    col.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (chain) file")
    col.add_argument("--tls-key", metavar="PEM", help="the certificate's private key file")
    _add_allow_open(col)
    col.add_argument("--migrate", action="store_true", help="apply database migrations before serving")
    col.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="worker processes on the one address (PostgreSQL only; default 1)",
    )
    # Set by the supervisor of --workers N on each worker process it starts.
    col.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    _add_metric_labels(col)
    _add_time_window(col)
    _add_retention(col)

    ag = sub.add_parser(
        "agent",
        help="the per-host sidecar that measures and pushes to a collector",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch agent --collector http://collector:8470 --interval 1\n"
        "  wattwatch agent --collector http://collector:8470 --scrape vllm:http://127.0.0.1:8000/metrics\n"
        "  wattwatch agent --collector http://collector:8470 --proc-root /host/proc --kubelet-url https://NODE:10250/pods\n"
        "  wattwatch agent --collector http://collector:8470 --metrics-listen 0.0.0.0:9471",
    )
    ag.add_argument("--collector", metavar="URL", help="collector base URL (default http://127.0.0.1:8470)")
    _add_token(ag, "bearer token for the collector: an agent token for this host")
    _add_ca_file(ag)
    ag.add_argument("--interval", type=float, metavar="S", help="sampling tick in seconds (default 1)")
    ag.add_argument("--host", help="host name to report (default: this machine's)")
    _add_grid_region(ag)
    ag.add_argument("--simulate", type=int, default=0, metavar="N", help="simulate N GPUs (no GPU needed)")
    _add_sim_flaws(ag)
    _add_agent_options(ag)

    run = sub.add_parser(
        "run",
        help="run a command as a tagged job",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch run --kind training --name llama-ft -- python train.py\n"
        "  CUDA_VISIBLE_DEVICES=2 wattwatch run --kind inference --name chat -- vllm serve m",
    )
    run.add_argument("--kind", choices=JOB_KINDS, default="other", help="training, inference or other")
    run.add_argument("--name", help="job name (default: the command)")
    run.add_argument("--label", action="append", default=[], metavar="K=V", help="add a label (repeatable)")
    run.add_argument("--job-id", help="join this job id (default $WATTWATCH_JOB or a new id)")
    run_src = run.add_mutually_exclusive_group()
    run_src.add_argument(
        "--server", metavar="URL", help="ask this collector for the summary (default: the one the agent pushes to)"
    )
    run_src.add_argument("--db", metavar="URL", help="read the summary from this database instead")
    run.add_argument(
        "--summary-wait",
        type=float,
        default=15.0,
        metavar="S",
        help="wait up to S seconds for the job's figures after it ends (default 15; 0: no summary)",
    )
    _add_token(run, "bearer token for the summary: a reader token")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")

    rep = sub.add_parser(
        "report",
        help="per-job energy summaries",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch report --since 7d\n"
        "  wattwatch report --since 2026-11-30 --until 2026-12-01 --name 'llama-*' --label team=nlp\n"
        "  wattwatch report --job 3f2a9c1e         an id prefix as the table shows it, or a job name\n"
        "  wattwatch report --since 7d --group-by label:team --sort energy --format markdown --output week.md\n"
        "  wattwatch report --server http://collector:8470 --kind inference --format json\n"
        "  WATTWATCH_TOKEN_FILE=reader.token wattwatch report --server https://collector:8470 --ca-file ca.pem",
    )
    report_options.add_source(rep)
    rep.add_argument("--job", metavar="REF", help="only this job: its id, a unique prefix of it, or its name")
    report_options.add_filters(rep)
    report_options.add_view(rep)
    _add_reader_auth(rep)

    doc = sub.add_parser(
        "doctor",
        help="which sensors work here, why the others don't, and batches the collector refused",
        formatter_class=_fmt(),
        epilog="examples:\n  wattwatch doctor\n  wattwatch doctor --simulate 2 --generation p100\n"
        "  wattwatch --home /var/lib/wattwatch doctor    the agent's spool in another home",
    )
    doc.add_argument("--simulate", type=int, default=0, metavar="N", help="examine N simulated GPUs instead")
    doc.add_argument("--generation", default="h100", help="board generation of simulated GPUs (default h100)")
    _add_sim_flaws(doc)

    db = sub.add_parser(
        "db",
        help="database maintenance",
        formatter_class=_fmt(),
        epilog="example:\n  wattwatch db upgrade --db postgresql://wattwatch@db/wattwatch",
    )
    dbsub = db.add_subparsers(dest="db_command", metavar="ACTION", parser_class=_Parser)
    upg = dbsub.add_parser(
        "upgrade",
        help="create or migrate the schema to this version",
        formatter_class=_fmt(),
        epilog="example:\n  wattwatch db upgrade --db sqlite:///w.db",
    )
    _add_db(upg)

    from wattwatch import completion, spool_cli, token_cli, top_cli

    token_cli.add_parser(sub, _fmt(), _add_db)
    report_options.add_jobs_parser(sub, _fmt(), _add_reader_auth)
    spool_cli.add_parser(sub, _fmt())
    top_cli.add_parser(sub, _fmt(), _add_token)
    completion.add_parser(sub, _fmt())
    for parser in _subparsers(p):
        # Global options after the command too (`wattwatch report --home X`); SUPPRESS keeps one given
        # before the command when it is not repeated after.
        _add_globals(parser, default=argparse.SUPPRESS)
    return p


def _add_globals(p: argparse.ArgumentParser, *, default: Any) -> None:
    p.add_argument(
        "--home", default=default, help="state directory (default $WATTWATCH_HOME or ~/.local/share/wattwatch)"
    )
    p.add_argument(
        "-v", "--verbose", action="store_true", default=default or False, help="log more (same as --log-level debug)"
    )
    p.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=default,
        type=str.lower,
        help="log lines (on stderr) from this level up; default info for services, warning for the rest",
    )


def _subparsers(p: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """Every parser below ``p`` (commands and their actions)."""
    out: list[argparse.ArgumentParser] = []
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                out += [child, *_subparsers(child)]
    return out


# --- identity (issue 9): tokens from argv, the environment or a file; TLS; the open-collector guard --------


def _add_token(p: argparse.ArgumentParser, what: str) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument("--token", help=f"{what} (visible in process lists: prefer WATTWATCH_TOKEN or --token-file)")
    group.add_argument("--token-file", metavar="PATH", help="read the token from this file (WATTWATCH_TOKEN_FILE)")


def _add_reader_auth(p: argparse.ArgumentParser) -> None:
    _add_token(p, "bearer token for --server: a reader token")
    _add_ca_file(p)


def _add_ca_file(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--ca-file",
        metavar="PEM",
        help="trust only this CA for an https collector (WATTWATCH_CA_FILE; default: system)",
    )


def _add_allow_open(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allow-open",
        action="store_true",
        help="listen beyond loopback even with no token (anyone reaching it may write and read)",
    )


def _identity_changes(args: argparse.Namespace) -> dict[str, Any]:
    changes: dict[str, Any] = {}
    if getattr(args, "token", None):
        changes.update(token=args.token, token_file="")
    if getattr(args, "token_file", None):
        changes.update(token_file=args.token_file, token="")
    for name in ("ca_file", "tls_cert", "tls_key"):
        if getattr(args, name, None):
            changes[name] = getattr(args, name)
    return changes


# --- end identity ------------------------------------------------------------------------------------------


def _add_agent_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metrics-listen",
        metavar="HOST:PORT",
        help="serve the agent's own Prometheus /metrics there, e.g. 0.0.0.0:9471 "
        "(default $WATTWATCH_METRICS_LISTEN; empty: not served)",
    )
    p.add_argument(
        "--scrape",
        action="append",
        default=[],
        metavar="PRESET:URL[#job=ID]",
        help="count requests from a serving engine's metrics (presets: vllm, tgi, triton, sglang, custom); "
        "repeatable, e.g. vllm:http://127.0.0.1:8000/metrics",
    )
    p.add_argument("--kubelet-url", metavar="URL", help="kubelet pods API for pod names, labels and annotations")
    p.add_argument("--proc-root", metavar="PATH", help="the host's /proc (default /proc; /host/proc in a pod)")
    p.add_argument("--no-discover", action="store_true", help="do not attribute untagged GPU processes to jobs")
    p.add_argument(
        "--fine-interval",
        type=float,
        metavar="S",
        help="interval length while inference requests flow, for per-query energy (default 0.1; 0: off)",
    )
    p.add_argument(
        "--push-interval",
        type=float,
        metavar="S",
        help="seconds between the agent's pushes of a batch (default $WATTWATCH_PUSH_INTERVAL or 5); a job's "
        "start or end is pushed at once, and every tick is kept in the spool meanwhile",
    )
    p.add_argument(
        "--poison-after",
        type=int,
        metavar="N",
        help="set a batch aside after N failures (5xx or no answer) while later batches land "
        "(default $WATTWATCH_POISON_AFTER or 5; see `wattwatch spool --help`)",
    )


def _add_sim_flaws(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sim-flaws",
        default="",
        metavar="SPEC",
        help="give simulated GPUs real hardware's flaws: a preset (none, realistic) and/or KEY=VALUE items, "
        "comma separated: refresh_ms=20 or 10:200 (per board), noise_w, latency_ms, jitter_ms, "
        "process_delay_s=0.5:2, start_lag_s, end_lag_s, process_sample_ms, seed",
    )


def _sim_flaws(args: argparse.Namespace, simulate: int) -> Any:
    """The ``--sim-flaws`` spec as ``sim.flaws.Flaws`` (None when not given); a bad spec is a usage error."""
    spec = getattr(args, "sim_flaws", "")
    if not spec:
        return None
    if not simulate:
        raise UsageError("--sim-flaws applies to simulated GPUs only; add --simulate N")
    from wattwatch.sim.flaws import parse_flaws

    try:
        return parse_flaws(spec)
    except ValueError as exc:
        raise UsageError(f"--sim-flaws: {exc}") from None


def _agent_options(args: argparse.Namespace) -> Any:
    from wattwatch.agent.options import AgentOptions

    return AgentOptions.from_env(
        scrape=args.scrape,
        kubelet_url=args.kubelet_url,
        proc_root=args.proc_root,
        discover=False if args.no_discover else None,
        fine_interval_s=args.fine_interval,
        poison_after=args.poison_after,
    )


def _add_metric_labels(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--metric-labels",
        metavar="KEYS",
        help="job labels to export as labels of the job series on /metrics, e.g. team,namespace "
        "(default none: each costs one label value per job)",
    )


def _add_time_window(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--time-window-past",
        metavar="DURATION",
        help="refuse (422) times further back than this, e.g. 30d (default; WATTWATCH_TIME_WINDOW_PAST, seconds)",
    )
    p.add_argument(
        "--time-window-future",
        metavar="DURATION",
        help="refuse (422) times further ahead than this, e.g. 1d (default; WATTWATCH_TIME_WINDOW_FUTURE, seconds)",
    )


def _add_retention(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--retention-days",
        type=float,
        metavar="DAYS",
        help="delete raw intervals older than this, and spans, ticks and batch keys once also past the time "
        "window; job and idle rollups stay forever (default 14; 0 keeps everything; WATTWATCH_RETENTION_DAYS)",
    )


def _retention_changes(args: argparse.Namespace, settings: Settings) -> dict[str, float]:
    raw = getattr(args, "retention_days", None)
    days = settings.retention_days if raw is None else raw
    if not (days >= 0 and days <= 36500):
        where = "--retention-days" if raw is not None else "WATTWATCH_RETENTION_DAYS"
        raise UsageError(f"{where} {days:g} is out of range; use 0 (keep everything) or 1 to 36500 days")
    return {} if raw is None else {"retention_days": float(raw)}


def _time_window_changes(args: argparse.Namespace) -> dict[str, float]:
    changes: dict[str, float] = {}
    for flag, name in (("past", "time_window_past_s"), ("future", "time_window_future_s")):
        raw = getattr(args, f"time_window_{flag}", None)
        if raw is None:
            continue
        try:
            value = parse_duration_s(raw)
        except ValueError as exc:
            raise UsageError(f"--time-window-{flag}: {exc}") from None
        if value <= 0:
            raise UsageError(f"--time-window-{flag} {raw!r} must be positive; use e.g. 30d or 12h")
        changes[name] = value
    return changes


def _add_db(p: argparse.ArgumentParser) -> None:
    p.add_argument("--db", metavar="URL", help="database URL (default: embedded SQLite under $WATTWATCH_HOME)")


def _add_listen(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", metavar="HOST:PORT", help="where the collector listens (default 127.0.0.1:8470)")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``wattwatch`` console script."""
    code = _main(argv)
    if argv is None:  # a process of its own: a read-only command ends without the teardown (quick_exit)
        from wattwatch import quick_exit

        return quick_exit.finish(code, sys.argv[1:])
    return code


def _configure_logging(args: argparse.Namespace) -> None:
    """Services log what they do; one-shot commands (the demo too: it prints its own story and a table)
    print their answer and only warnings besides. Logs go to stderr, answers to stdout."""
    from wattwatch.quick_exit import QUICK_COMMANDS

    if args.command in QUICK_COMMANDS and not (args.verbose or args.log_level) and "logging" not in sys.modules:
        # A read command that has imported nothing that logs (`report --server`): importing logging to
        # configure it is 3.5 ms of a start-up whose budget is 200 ms. A warning that still comes is
        # written to stderr by logging's last-resort handler (the message alone); INFO and DEBUG are
        # dropped, as at the WARNING level set below.
        return
    import logging

    quiet = args.command not in ("up", "collector", "agent")
    level = logging.DEBUG if args.verbose else (logging.WARNING if quiet else logging.INFO)
    if args.log_level:
        level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("apscheduler", "httpx", "httpcore", "uvicorn", "alembic"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level <= logging.DEBUG else max(level, logging.WARNING))


def _main(argv: Sequence[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    negative = _negative_duration(argv)
    if negative:
        sys.stderr.write(f"wattwatch: error: {negative}\n")
        return 2
    from wattwatch.quick_exit import command_of

    only = command_of(argv)
    parser = build_parser(only=only)
    args = parser.parse_args(argv)
    if args.command != only:  # the command word was misread: the full parser decides, as it always did
        parser = build_parser()
        args = parser.parse_args(argv)
    # As typed: the collector's supervisor starts its workers with the same arguments.
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.command is None:
        parser.print_help()
        return 2
    _configure_logging(args)
    try:
        if args.home:
            os.environ["WATTWATCH_HOME"] = str(Path(args.home).expanduser())
        settings = _settings_from(args)
        return _dispatch(args, settings)
    except (UsageError, WattwatchError) as exc:
        sys.stderr.write(f"wattwatch {args.command}: error: {exc}\n")
        return 2
    except RuntimeFailure as exc:
        sys.stderr.write(f"wattwatch {args.command}: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # never a traceback for a user; -v / --log-level debug logs it
        import logging

        logging.getLogger("wattwatch").debug("unexpected error", exc_info=True)
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        sys.stderr.write(
            f"wattwatch {args.command}: error: unexpected {type(exc).__name__}: {first}; rerun with "
            "--log-level debug for details and report it\n"
        )
        return 1


# Options taking a duration or a time; argparse reads "-5d" after them as an option and says only
# "expected one argument".
_TIME_OPTIONS = ("--since", "--until", "--time-window-past", "--time-window-future")


def _add_grid_region(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--grid-region",
        metavar="REGION",
        help="this host's grid, for its emissions: ISO country code (FR, USA) or cloud provider:region "
        "(gcp:europe-west9); default $WATTWATCH_GRID_REGION, else the collector's setting",
    )


def _negative_duration(argv: list[str]) -> str | None:
    """The one-line error for a negative duration given as ``--since -5d``, else None."""
    for flag, value in itertools.pairwise(argv):
        if flag == "--":
            return None
        if flag in _TIME_OPTIONS and len(value) > 1 and value[0] == "-" and (value[1].isdigit() or value[1] == "."):
            return f"{flag} {value}: negative durations are invalid; give how far back as a positive one, e.g. 5d"
    return None


def _settings_from(args: argparse.Namespace) -> Settings:
    settings = load_settings()
    changes: dict[str, Any] = {}
    if getattr(args, "db", None):
        changes["db_url"] = args.db
    if getattr(args, "listen", None):
        parse_listen(args.listen)
        changes["listen"] = args.listen
        if args.command in ("up", "demo"):
            host, port = parse_listen(args.listen)
            changes["collector_url"] = f"http://{host}:{port}"
    metrics_listen = getattr(args, "metrics_listen", None)
    if metrics_listen is not None:
        if metrics_listen:
            try:
                parse_listen(metrics_listen)
            except ConfigError:
                raise UsageError(
                    f"--metrics-listen {metrics_listen!r} is not HOST:PORT; use e.g. 0.0.0.0:9471"
                ) from None
        changes["metrics_listen"] = metrics_listen
    if getattr(args, "interval", None) is not None:
        if not 0.05 <= args.interval <= 3600:
            raise UsageError(f"--interval {args.interval} is out of range; use 0.05 to 3600 seconds")
        changes["interval_s"] = args.interval
    if getattr(args, "push_interval", None) is not None:
        changes["push_interval_s"] = args.push_interval
    if args.command in ("agent", "up", "demo"):
        push_s = changes.get("push_interval_s", settings.push_interval_s)
        if not 0.1 <= push_s <= 3600:
            raise UsageError(
                f"push interval {push_s:g} s (--push-interval or WATTWATCH_PUSH_INTERVAL) is out of range; "
                "use 0.1 to 3600 seconds"
            )
    if getattr(args, "grid_region", None) or (args.command in ("agent", "up", "demo") and settings.grid_region):
        # Checked before a service starts anything (sensors, sockets), so a bad region is the only output.
        from wattwatch import grid

        try:
            changes["grid_region"] = grid.check_region(getattr(args, "grid_region", None) or settings.grid_region)
        except grid.UnknownRegion as exc:
            if getattr(args, "grid_region", None):
                raise UsageError(f"--grid-region: {exc}") from None
            raise ConfigError(f"{exc} (WATTWATCH_GRID_REGION or grid_region in the config file)") from None
    if args.command == "agent":
        if args.collector:
            if not args.collector.startswith(("http://", "https://")):
                raise UsageError(f"--collector {args.collector!r} is not a URL; use e.g. http://collector:8470")
            changes["collector_url"] = args.collector
        if args.host:
            changes["host"] = args.host
    if getattr(args, "metric_labels", None) is not None:
        from wattwatch.collector.metrics import metric_label_names

        metric_label_names(args.metric_labels)  # a clash is a usage error now, not when the first scrape comes
        changes["metric_labels"] = args.metric_labels
    changes.update(_identity_changes(args))
    changes.update(_time_window_changes(args))
    if args.command in ("up", "collector"):
        changes.update(_retention_changes(args, settings))
    settings = record.replace(settings, **changes)
    needs_token = args.command in ("up", "demo", "collector", "agent", "report", "run", "top", "jobs")
    return resolve_token(settings) if needs_token else settings


def _check_workers(workers: int, settings: Settings) -> None:
    """``--workers`` is 1 to 64, and more than 1 only on PostgreSQL."""
    if not 1 <= workers <= 64:
        raise UsageError(f"--workers {workers} is out of range; use 1 to 64 (about one per core)")
    if workers > 1 and not settings.resolved_db_url.startswith(("postgresql", "postgres")):
        raise UsageError(
            f"--workers {workers} needs PostgreSQL: SQLite takes one writer at a time, so one collector process "
            "serves it; drop --workers or use --db postgresql://..."
        )


def _dispatch(args: argparse.Namespace, settings: Settings) -> int:
    cmd = args.command
    if cmd == "up":
        from wattwatch.standalone import run_up

        _check_simulate(args.simulate)
        flaws = _sim_flaws(args, args.simulate)
        run_up(settings, simulate=args.simulate, flaws=flaws, options=_agent_options(args), allow_open=args.allow_open)
        return 0
    if cmd == "demo":
        return _demo(args, settings)
    if cmd == "collector":
        from wattwatch.standalone import run_collector

        _check_workers(args.workers, settings)
        run_collector(
            settings,
            migrate=args.migrate,
            allow_open=args.allow_open,
            workers=args.workers,
            worker_index=args.worker_index,
            argv=args.argv,
        )
        return 0
    if cmd == "agent":
        from wattwatch.standalone import run_agent

        _check_simulate(args.simulate)
        run_agent(settings, simulate=args.simulate, flaws=_sim_flaws(args, args.simulate), options=_agent_options(args))
        return 0
    if cmd == "run":
        from wattwatch import run_cli

        return run_cli.run(args, settings)
    if cmd == "report":
        from wattwatch import report_cli

        return report_cli.run(args, settings)
    if cmd == "jobs":
        from wattwatch import jobs_cli

        return jobs_cli.run(args, settings)
    if cmd == "doctor":
        return _doctor(args, settings)
    if cmd == "token":
        from wattwatch import token_cli

        return token_cli.run(args, settings)
    if cmd == "spool":
        from wattwatch import spool_cli

        return spool_cli.run(args, settings)
    if cmd == "top":
        from wattwatch import top_cli

        return top_cli.run(args, settings)
    if cmd == "completion":
        from wattwatch import completion

        sys.stdout.write(completion.script(build_parser(), args.shell))
        return 0
    if cmd == "db":
        if args.db_command != "upgrade":
            raise UsageError("say what to do with the database, e.g. `wattwatch db upgrade`")
        if not settings.db_url:
            settings.home.mkdir(parents=True, exist_ok=True)
        print(f"wattwatch db: {_upgrade_db(settings.resolved_db_url)}")
        return 0
    raise UsageError(f"unknown command {cmd!r}")


def _upgrade_db(url: str) -> str:
    """Migrate the database at ``url``; what was done, in words: created, upgraded, or already current."""
    from wattwatch.storage.engine import display_url
    from wattwatch.storage.migrate import current_revision, head_revision, upgrade

    shown = display_url(url)
    before = current_revision(url)
    upgrade(url)
    head = head_revision()
    if before is None:
        return f"created the schema (revision {head}) in {shown}"
    if before == head:
        return f"{shown} was already at the current schema (revision {head}); nothing to do"
    return f"upgraded {shown} from revision {before} to {head}"


def _check_simulate(n: int) -> None:
    if not 0 <= n <= 64:
        raise UsageError(f"--simulate {n} is out of range; simulate 1 to 64 GPUs (0: none)")


def _demo(args: argparse.Namespace, settings: Settings) -> int:
    from wattwatch import carbon_policy, demo, progress, report_group, table_render
    from wattwatch.report import render
    from wattwatch.standalone import run_up
    from wattwatch.storage.engine import check_ready
    from wattwatch.storage.repository import build_report

    if args.duration < 0:
        raise UsageError("--duration must be 0 (until Ctrl-C) or a number of seconds")
    flaws = _sim_flaws(args, demo.DEMO_GPUS)
    started_s = time.time()
    print(
        f"wattwatch demo: {demo.DEMO_GPUS} simulated GPUs; training on GPU 0-1, inference on GPU 2, "
        f"GPU 3 idle; running {'until Ctrl-C' if not args.duration else f'{args.duration:g} s'}"
    )
    # A status line on stderr while it runs (elapsed, remaining, energy so far): `progress`.
    driver = progress.demo_driver(demo.drive, args.duration or None)
    run_up(settings, simulate=demo.DEMO_GPUS, flaws=flaws, driver=driver, duration_s=args.duration or None)
    engine = check_ready(settings.resolved_db_url)
    try:
        report = build_report(engine, since_s=started_s, carbon=carbon_policy.from_settings(settings))
    finally:
        engine.dispose()
    report["jobs"] = [j for j in report["jobs"] if str(j["id"]).startswith("demo-")]
    report_group.shape(report)
    print()
    print(render(report, "table", width=table_render.width_for(sys.stdout), color=table_render.wants_color(sys.stdout)))
    print(f"\nThe data stays in {settings.resolved_db_url}; see it again with `{_report_command(args)}`.")
    return 0


def _report_command(args: argparse.Namespace) -> str:
    """The ``wattwatch report`` that reads the database this command used."""
    import shlex

    if getattr(args, "db", None):
        return f"wattwatch report --db {shlex.quote(args.db)}"
    if args.home:
        return f"wattwatch --home {shlex.quote(str(Path(args.home).expanduser()))} report"
    return "wattwatch report"


def _doctor(args: argparse.Namespace, settings: Settings) -> int:
    from wattwatch.agent.spool import SPOOL_FILE
    from wattwatch.doctor import run_doctor

    fleet = None
    flaws = _sim_flaws(args, args.simulate)
    if args.simulate:
        _check_simulate(args.simulate)
        from wattwatch.sim.fleet import SimulatedFleet
        from wattwatch.sim.generations import GENERATIONS

        if args.generation.lower() not in GENERATIONS:
            raise UsageError(f"--generation {args.generation!r} is unknown; use one of {', '.join(GENERATIONS)}")
        fleet = SimulatedFleet(args.simulate, generation=args.generation, flaws=flaws)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text, code = run_doctor(
            simulate_fleet=fleet, cpu_tdp_w=settings.cpu_tdp_w or None, spool_path=settings.home / SPOOL_FILE
        )
    print(text)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
