"""``wattwatch token create|list|revoke``: the collector's API tokens, straight in its database.

``cli.main`` calls ``add_parser`` and ``run``, as for every command.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from wattwatch.cli import options
from wattwatch.config import Settings
from wattwatch.errors import ConfigError

EPILOG = """examples:
  wattwatch token create --role agent --host gpu-01 --db postgresql://wattwatch@db/wattwatch > gpu-01.token
  wattwatch token create --role reader          # reports, job lists, /metrics (Prometheus)
  wattwatch token create --role admin           # everything
  wattwatch token list
  wattwatch token revoke 3                      # by id, or by the prefix `token list` shows

The token is printed once, alone on the last line; the database keeps only its SHA-256. Give it to the
agent as WATTWATCH_TOKEN or in a file (--token-file / WATTWATCH_TOKEN_FILE). Once any token exists, the
collector answers only requests that carry one (except /healthz and /readyz)."""


def add_parser(sub: Any) -> None:
    """Add ``token`` and its actions to the command parsers ``sub``."""
    tok = options.add_command(sub, "token", help="create, list and revoke the collector's API tokens", epilog=EPILOG)
    actions = options.add_actions(tok, "token_command")
    create = options.add_command(
        actions,
        "create",
        help="make a token and print it (once)",
        epilog="examples:\n  wattwatch token create --role agent --host gpu-01\n  wattwatch token create --role reader",
    )
    create.add_argument("--role", required=True, choices=("agent", "reader", "admin"), help="what the token may do")
    create.add_argument("--host", help="the agent's host name (its --host / WATTWATCH_HOST); --role agent only")
    options.add_db(create)
    listing = options.add_command(
        actions,
        "list",
        help="every token: id, prefix, role, host, when created, last used, revoked",
        epilog="examples:\n  wattwatch token list\n  wattwatch token list --format json",
    )
    listing.add_argument("--format", choices=("table", "json"), default="table")
    options.add_db(listing)
    revoke = options.add_command(
        actions,
        "revoke",
        help="stop accepting a token (collectors notice within seconds)",
        epilog="examples:\n  wattwatch token revoke 3\n  wattwatch token revoke ww_AbCdEfGh",
    )
    revoke.add_argument("which", metavar="ID|PREFIX", help="the token's id or prefix, as `wattwatch token list` shows")
    options.add_db(revoke)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Do the ``token`` action; errors are ConfigError (one line, exit 2)."""
    from wattwatch.storage import tokens
    from wattwatch.storage.engine import check_ready

    if args.token_command is None:
        raise ConfigError("say what to do, e.g. `wattwatch token create --role reader` (see `wattwatch token --help`)")
    engine = check_ready(settings.resolved_db_url)
    try:
        if args.token_command == "create":
            try:
                token_id, token = tokens.create_token(engine, args.role, args.host)
            except tokens.TokenError as exc:
                raise ConfigError(str(exc)) from None
            what = f"role {args.role}" + (f", host {args.host!r}" if args.host else "")
            sys.stderr.write(f"wattwatch token: created token {token_id} ({what}); it is shown once, keep it now\n")
            print(token)
            return 0
        if args.token_command == "list":
            rows = tokens.list_tokens(engine)
            print(_render(rows, args.format))
            return 0
        try:
            row, newly = tokens.revoke_token(engine, args.which)
        except tokens.TokenError as exc:
            raise ConfigError(str(exc)) from None
        state = "revoked" if newly else "was already revoked"
        print(f"wattwatch token: token {row.id} ({row.prefix}, role {row.role}) {state}")
        print(_after_revoke(len({t.id for ts in tokens.active_tokens(engine).values() for t in ts})))
        return 0
    finally:
        engine.dispose()


def _after_revoke(n_active: int) -> str:
    """What a running collector does once it re-reads its tokens (within seconds) after a revoke."""
    if n_active == 0:
        return (
            "wattwatch token: no active tokens left: the collector refuses all writes and reads until "
            "`wattwatch token create` (it never reopens to anonymous callers, --open or not)"
        )
    return f"wattwatch token: {n_active} active token(s) left; the collector refuses this one within seconds"


def _when(t_s: float | None) -> str:
    return "-" if t_s is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_s))


def _render(rows: list[Any], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(
            [
                {
                    "id": r.id,
                    "prefix": r.prefix,
                    "role": r.role,
                    "host": r.host,
                    "created_at_s": r.created_at_s,
                    "last_used_s": r.last_used_s,
                    "revoked_at_s": r.revoked_at_s,
                }
                for r in rows
            ],
            ensure_ascii=False,
        )
    header = ("ID", "PREFIX", "ROLE", "HOST", "CREATED", "LAST USED", "REVOKED")
    table = [header] + [
        (str(r.id), r.prefix, r.role, r.host or "-", _when(r.created_at_s), _when(r.last_used_s), _when(r.revoked_at_s))
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table)
