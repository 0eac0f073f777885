"""The argparse pieces every command shares: the parser class (one-line errors, exit 2), its help
formatter, and the options several commands declare alike (--db, --listen, --token, the agent's)."""

from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, NoReturn

from wattwatch.cli.errors import UsageError

LOG_LEVELS = ("debug", "info", "warning", "error")


class Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's formatter (descriptions and examples as written), as wide as the terminal."""

    def __init__(self, prog: str, indent_increment: int = 2, max_help_position: int = 24, width: int | None = None):
        super().__init__(prog, indent_increment, max_help_position, _help_width() if width is None else width)


@functools.cache
def _help_width() -> int:
    from wattwatch.cli.render.table import terminal_columns

    return terminal_columns(80) - 2  # argparse's own: the terminal's width (fallback 80), less 2


class Parser(argparse.ArgumentParser):
    """argparse, but errors are one line naming the fix, and exit 2; help in ``Formatter``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line pointing at ``--help``; exit 2."""
        sys.stderr.write(f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")
        raise SystemExit(2)


def add_command(sub: Any, name: str, *, help: str, epilog: str) -> argparse.ArgumentParser:
    """A command (or action) parser under ``sub``, with its help line and its examples."""
    parser: argparse.ArgumentParser = sub.add_parser(name, help=help, formatter_class=Formatter, epilog=epilog)
    # The global options after the command too (`wattwatch report --home X`), listed last in its help;
    # SUPPRESS keeps a value given before the command when it is not repeated after.
    add_globals(parser.add_argument_group("global options"), default=argparse.SUPPRESS)
    return parser


def add_actions(parser: argparse.ArgumentParser, dest: str) -> Any:
    """The action parsers of a command with actions (``token create``, ``db upgrade``)."""
    return parser.add_subparsers(dest=dest, metavar="ACTION", parser_class=Parser)


def add_globals(p: Any, *, default: Any) -> None:
    """``--home``, ``-v`` and ``--log-level``: before the command, and after it too."""
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


def add_db(p: argparse.ArgumentParser) -> None:
    """``--db URL``."""
    p.add_argument("--db", metavar="URL", help="database URL (default: embedded SQLite under $WATTWATCH_HOME)")


def add_listen(p: argparse.ArgumentParser) -> None:
    """``--listen HOST:PORT``."""
    p.add_argument("--listen", metavar="HOST:PORT", help="where the collector listens (default 127.0.0.1:8470)")


def add_token(p: argparse.ArgumentParser, what: str) -> None:
    """``--token`` or ``--token-file`` (one of them)."""
    group = p.add_mutually_exclusive_group()
    group.add_argument("--token", help=f"{what} (visible in process lists: prefer WATTWATCH_TOKEN or --token-file)")
    group.add_argument("--token-file", metavar="PATH", help="read the token from this file (WATTWATCH_TOKEN_FILE)")


def add_ca_file(p: argparse.ArgumentParser) -> None:
    """``--ca-file PEM``."""
    p.add_argument(
        "--ca-file",
        metavar="PEM",
        help="trust only this CA for an https collector (WATTWATCH_CA_FILE; default: system)",
    )


def add_reader_auth(p: argparse.ArgumentParser) -> None:
    """A reader's token and the CA it trusts."""
    add_token(p, "bearer token for --server: a reader token")
    add_ca_file(p)


def add_allow_open(p: argparse.ArgumentParser) -> None:
    """``--allow-open``."""
    p.add_argument(
        "--allow-open",
        action="store_true",
        help="start listening beyond loopback with no token yet (other machines are refused until one exists)",
    )


def add_interval(p: argparse.ArgumentParser) -> None:
    """``--interval S``, the sampling tick (a string here: config.check_setting reads and checks it, as it
    does WATTWATCH_INTERVAL and the file's interval_s)."""
    p.add_argument("--interval", metavar="S", help="sampling tick in seconds (default 1)")


def add_simulate(p: argparse.ArgumentParser, help: str = "simulate N GPUs (no GPU needed)") -> None:
    """``--simulate N``."""
    p.add_argument("--simulate", type=int, default=0, metavar="N", help=help)


def check_simulate(n: int) -> None:
    """``--simulate`` is 0 to 64."""
    if not 0 <= n <= 64:
        raise UsageError(f"--simulate {n} is out of range; simulate 1 to 64 GPUs (0: none)")


def add_grid_region(p: argparse.ArgumentParser) -> None:
    """``--grid-region REGION``."""
    p.add_argument(
        "--grid-region",
        metavar="REGION",
        help="this host's grid, for its emissions: ISO country code (FR, USA) or cloud provider:region "
        "(gcp:europe-west9); default $WATTWATCH_GRID_REGION, else the collector's setting",
    )


def add_agent_options(p: argparse.ArgumentParser) -> None:
    """What the agent discovers, scrapes and pushes (``agent`` and ``up``)."""
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
        metavar="S",
        help="interval length while inference requests flow, for per-query energy (default 0.1; 0: off)",
    )
    p.add_argument(
        "--push-interval",
        metavar="S",
        help="seconds between the agent's pushes of a batch (default $WATTWATCH_PUSH_INTERVAL or 5); a job's "
        "start or end is pushed at once, and every tick is kept in the spool meanwhile",
    )
    p.add_argument(
        "--poison-after",
        metavar="N",
        help="set a batch aside after N failures (5xx or no answer) while later batches land "
        "(default $WATTWATCH_POISON_AFTER or 5; see `wattwatch spool --help`)",
    )


def agent_options(args: argparse.Namespace, settings: Any) -> Any:
    """The agent's discovery and scraping options: ``settings``' (flags applied there), plus ``--scrape``."""
    from wattwatch.agent.options import AgentOptions

    return AgentOptions.from_settings(settings, scrape=args.scrape)


def add_sim_flaws(p: argparse.ArgumentParser) -> None:
    """``--sim-flaws SPEC``."""
    p.add_argument(
        "--sim-flaws",
        default="",
        metavar="SPEC",
        help="give simulated GPUs real hardware's flaws: a preset (none, realistic) and/or KEY=VALUE items, "
        "comma separated: refresh_ms=20 or 10:200 (per board), noise_w, latency_ms, jitter_ms, "
        "process_delay_s=0.5:2, start_lag_s, end_lag_s, process_sample_ms, seed",
    )


def sim_flaws(args: argparse.Namespace, simulate: int) -> Any:
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


def add_metric_labels(p: argparse.ArgumentParser) -> None:
    """``--metric-labels KEYS``."""
    p.add_argument(
        "--metric-labels",
        metavar="KEYS",
        help="job labels to export as labels of the job series on /metrics, e.g. team,namespace "
        "(default none: each costs one label value per job)",
    )


def add_time_window(p: argparse.ArgumentParser) -> None:
    """``--time-window-past`` and ``--time-window-future``."""
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


def add_retention(p: argparse.ArgumentParser) -> None:
    """``--retention-days DAYS``."""
    p.add_argument(
        "--retention-days",
        metavar="DAYS",
        help="delete raw intervals older than this, and spans, ticks and batch keys once also past the time "
        "window; job and idle rollups stay forever (default 14; 0 keeps everything; WATTWATCH_RETENTION_DAYS)",
    )


def add_server_limits(p: argparse.ArgumentParser) -> None:
    """``--header-timeout``, ``--body-timeout``, ``--max-connections``, ``--max-reads`` and ``--max-writes``."""
    p.add_argument(
        "--header-timeout",
        type=float,
        metavar="SECONDS",
        help="close a connection whose request headers take longer than this (default 10; WATTWATCH_HEADER_TIMEOUT)",
    )
    p.add_argument(
        "--body-timeout",
        type=float,
        metavar="SECONDS",
        help="close a connection whose request body takes longer than this after its headers (default 60; "
        "WATTWATCH_BODY_TIMEOUT)",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        metavar="N",
        help="answer 503 with Retry-After beyond this many open connections (default 4096; each is a file "
        "descriptor; WATTWATCH_MAX_CONNECTIONS)",
    )
    p.add_argument(
        "--max-reads",
        type=int,
        metavar="N",
        help="answer 429 with Retry-After beyond this many reads at once (default 16; WATTWATCH_MAX_READS)",
    )
    p.add_argument(
        "--max-writes",
        type=int,
        metavar="N",
        help="answer 429 with Retry-After beyond this many writes at once (default 2048; WATTWATCH_MAX_WRITES)",
    )
