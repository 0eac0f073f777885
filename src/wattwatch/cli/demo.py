"""``wattwatch demo``: synthetic training and inference jobs on simulated GPUs.

GPU 0-1 run a training job, GPU 2 serves inference requests (sent as query spans through the SDK
client), GPU 3 stays idle: every part of the report has something to show.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from wattwatch import redact
from wattwatch.cli import options
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings

DEMO_GPUS = 4


def add_parser(sub: Any) -> None:
    """Add ``demo`` to the command parsers ``sub``."""
    demo = options.add_command(
        sub,
        "demo",
        help="`up` with simulated GPUs running synthetic training and inference jobs",
        epilog="example:\n  wattwatch demo --duration 20",
    )
    demo.add_argument(
        "--duration",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to run before printing the report (default 30; 0 runs until Ctrl-C)",
    )
    options.add_db(demo)
    options.add_listen(demo)
    options.add_sim_flaws(demo)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run the demo for ``--duration`` seconds, then print its jobs' report."""
    from wattwatch.carbon import policy as carbon_policy
    from wattwatch.cli.render import progress
    from wattwatch.cli.render import table as table_render
    from wattwatch.reporting import group as report_group
    from wattwatch.reporting.render import render
    from wattwatch.standalone import run_up
    from wattwatch.storage.engine import check_ready
    from wattwatch.storage.repository import build_report

    if not 0 <= args.duration <= 86400:  # NaN too
        raise UsageError("--duration must be 0 (until Ctrl-C) to 86400 seconds")
    flaws = options.sim_flaws(args, DEMO_GPUS)
    started_s = time.time()
    print(
        f"wattwatch demo: {DEMO_GPUS} simulated GPUs; training on GPU 0-1, inference on GPU 2, "
        f"GPU 3 idle; running {'until Ctrl-C' if not args.duration else f'{args.duration:g} s'}"
    )
    # A status line on stderr while it runs (elapsed, remaining, energy so far): `progress`.
    driver = progress.demo_driver(drive, args.duration or None)
    run_up(settings, simulate=DEMO_GPUS, flaws=flaws, driver=driver, duration_s=args.duration or None)
    engine = check_ready(settings.resolved_db_url)
    try:
        report = build_report(engine, since_s=started_s, carbon=carbon_policy.from_settings(settings))
    finally:
        engine.dispose()
    report["jobs"] = [j for j in report["jobs"] if str(j["id"]).startswith("demo-")]
    report_group.shape(report)
    print()
    print(render(report, "table", width=table_render.width_for(sys.stdout), color=table_render.wants_color(sys.stdout)))
    print(f"\nThe data stays in {redact.url(settings.resolved_db_url)}; see it again with `{_report_command(args)}`.")
    return 0


def _report_command(args: argparse.Namespace) -> str:
    """The ``wattwatch report`` that reads the database this command used."""
    import shlex

    if getattr(args, "db", None):
        return f"wattwatch report --db {shlex.quote(args.db)}"
    if args.home:
        return f"wattwatch --home {shlex.quote(str(Path(args.home).expanduser()))} report"
    return "wattwatch report"


def drive(settings: Settings, stop: threading.Event) -> None:
    """Run the demo jobs until ``stop`` is set, then end them."""
    from wattwatch.sdk import AgentClient

    client = AgentClient(settings.socket_path, timeout_s=2.0)
    run = uuid.uuid4().hex[:6]
    train = client.request(
        {
            "op": "job_start",
            "id": f"demo-train-{run}",
            "name": "llama-ft (demo)",
            "kind": "training",
            "labels": {"team": "demo"},
            "cuda_visible_devices": "0,1",
        }
    )
    serve = client.request(
        {
            "op": "job_start",
            "id": f"demo-serve-{run}",
            "name": "chat-serve (demo)",
            "kind": "inference",
            "labels": {"team": "demo"},
            "cuda_visible_devices": "2",
        }
    )
    rng = random.Random(7)
    try:
        while not stop.wait(rng.uniform(0.1, 0.5)):
            t_end_s = time.time()
            client.send(
                {
                    "op": "query",
                    "job": serve["id"],
                    "t_start_s": t_end_s - rng.uniform(0.2, 1.2),
                    "t_end_s": t_end_s,
                    "tokens_in": rng.randint(20, 800),
                    "tokens_out": rng.randint(10, 400),
                }
            )
    finally:
        client.request({"op": "job_end", "id": train["id"]})
        client.request({"op": "job_end", "id": serve["id"]})
        client.close()
