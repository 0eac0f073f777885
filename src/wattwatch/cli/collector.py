"""``wattwatch collector``: the central service (PostgreSQL in production)."""

from __future__ import annotations

import argparse
from typing import Any

from wattwatch.cli import options
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings

EPILOG = """examples:
  wattwatch collector --db postgresql://wattwatch@db/wattwatch --listen 0.0.0.0:8470
  wattwatch collector --listen 0.0.0.0:8470 --tls-cert cert.pem --tls-key key.pem   HTTPS
  wattwatch collector --migrate --metric-labels team,namespace
Every request but /healthz and /readyz needs a token: `wattwatch token create --role agent --host HOST`
(--open: none from this machine until one exists). A write's body is 64 MiB at most; a bad token
is refused before the body is read."""


def add_parser(sub: Any) -> None:
    """Add ``collector`` to the command parsers ``sub``."""
    col = options.add_command(sub, "collector", help="the central service (PostgreSQL in production)", epilog=EPILOG)
    options.add_db(col)
    options.add_listen(col)
    options.add_token(col, "a static admin token (backward compatible; prefer `wattwatch token create`)")
    col.add_argument("--tls-cert", metavar="PEM", help="serve HTTPS with this certificate (chain) file")
    col.add_argument("--tls-key", metavar="PEM", help="the certificate's private key file")
    options.add_allow_open(col)
    col.add_argument(
        "--open",
        action="store_true",
        help="take requests from this machine (loopback, no proxy header) without a token while none was ever "
        "created; by default every request but /healthz and /readyz needs one",
    )
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
    options.add_metric_labels(col)
    options.add_time_window(col)
    options.add_retention(col)
    options.add_server_limits(col)


def check_workers(workers: int, settings: Settings) -> None:
    """``--workers`` is 1 to 64, and more than 1 only on PostgreSQL."""
    if not 1 <= workers <= 64:
        raise UsageError(f"--workers {workers} is out of range; use 1 to 64 (about one per core)")
    if workers > 1 and not settings.resolved_db_url.startswith(("postgresql", "postgres")):
        raise UsageError(
            f"--workers {workers} needs PostgreSQL: SQLite takes one writer at a time, so one collector process "
            "serves it; drop --workers or use --db postgresql://..."
        )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until stopped."""
    from wattwatch.standalone import run_collector

    check_workers(args.workers, settings)
    run_collector(
        settings,
        migrate=args.migrate,
        allow_open=args.allow_open,
        open_local=args.open,
        workers=args.workers,
        worker_index=args.worker_index,
        argv=args.argv,
    )
    return 0
