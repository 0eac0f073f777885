"""``wattwatch agent``: the per-host sidecar that measures and pushes to a collector."""

from __future__ import annotations

import argparse
from typing import Any

from wattwatch.cli import options
from wattwatch.config import Settings

EPILOG = """examples:
  wattwatch agent --collector http://collector:8470 --interval 1
  wattwatch agent --collector http://collector:8470 --scrape vllm:http://127.0.0.1:8000/metrics
  wattwatch agent --collector http://collector:8470 --proc-root /host/proc --kubelet-url https://NODE:10250/pods
  wattwatch agent --collector http://collector:8470 --metrics-listen 0.0.0.0:9471"""


def add_parser(sub: Any) -> None:
    """Add ``agent`` to the command parsers ``sub``."""
    ag = options.add_command(
        sub, "agent", help="the per-host sidecar that measures and pushes to a collector", epilog=EPILOG
    )
    ag.add_argument("--collector", metavar="URL", help="collector base URL (default http://127.0.0.1:8470)")
    options.add_token(ag, "bearer token for the collector: an agent token for this host")
    options.add_ca_file(ag)
    options.add_interval(ag)
    ag.add_argument("--host", help="host name to report (default: this machine's)")
    options.add_grid_region(ag)
    options.add_simulate(ag)
    options.add_sim_flaws(ag)
    options.add_agent_options(ag)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Measure and push until Ctrl-C."""
    from wattwatch.standalone import run_agent

    options.check_simulate(args.simulate)
    flaws = options.sim_flaws(args, args.simulate)
    run_agent(settings, simulate=args.simulate, flaws=flaws, options=options.agent_options(args, settings))
    return 0
