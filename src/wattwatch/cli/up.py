"""``wattwatch up``: the collector and a local agent in one process (embedded SQLite by default)."""

from __future__ import annotations

import argparse
from typing import Any

from wattwatch.cli import options
from wattwatch.config import Settings

EPILOG = """examples:
  wattwatch up --simulate 4 --listen 127.0.0.1:8470
  wattwatch up --simulate 4 --metrics-listen 127.0.0.1:9471   the agent's own /metrics too"""


def add_parser(sub: Any) -> None:
    """Add ``up`` to the command parsers ``sub``."""
    up = options.add_command(
        sub, "up", help="collector + local agent in one process (embedded SQLite by default)", epilog=EPILOG
    )
    options.add_db(up)
    options.add_listen(up)
    options.add_simulate(up)
    options.add_sim_flaws(up)
    options.add_interval(up)
    options.add_allow_open(up)
    options.add_metric_labels(up)
    options.add_retention(up)
    options.add_server_limits(up)
    options.add_agent_options(up)
    options.add_grid_region(up)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Serve until Ctrl-C."""
    from wattwatch.standalone import run_up

    options.check_simulate(args.simulate)
    flaws = options.sim_flaws(args, args.simulate)
    run_up(
        settings,
        simulate=args.simulate,
        flaws=flaws,
        options=options.agent_options(args, settings),
        allow_open=args.allow_open,
    )
    return 0
