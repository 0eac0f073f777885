"""``wattwatch top``: a live view of the fleet, redrawn in place: each GPU's power now, the job holding it,
that job's energy so far and its J/query or J/step, then every running job.

It reads the collector's ``GET /api/v1/live`` (``storage.live``), so it works the same under ``wattwatch up``
(whose collector the local agent names) and against a central collector (``--server``). On a terminal each
frame replaces the last in place (``rich.live.Live``, cropped to the terminal's width and height, cursor
hidden while it runs); piped, frames are printed one after another, plain. ``--once`` prints one frame and
exits. Ctrl-C exits 0. Columns line up by terminal cells, so a CJK or emoji job name keeps them straight.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

from wattwatch import redact
from wattwatch.cli.errors import RuntimeFailure, UsageError
from wattwatch.cli.render.table import cells, cut
from wattwatch.config import Settings

DEFAULT_INTERVAL_S = 2.0


def add_parser(sub: Any) -> None:
    """Register ``wattwatch top``."""
    from wattwatch.cli import options

    top = options.add_command(
        sub,
        "top",
        help="live view: power now per GPU, the job holding it, its energy so far and J/query",
        epilog="examples:\n  wattwatch top                      the collector the local agent pushes to\n"
        "  wattwatch top --server http://collector:8470 --interval 5\n"
        "  wattwatch top --once               one frame, plain (for scripts)",
    )
    top.add_argument("--server", metavar="URL", help="the collector (default: the one the local agent pushes to)")
    top.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL_S,
        metavar="S",
        help=f"seconds between frames (default {DEFAULT_INTERVAL_S:g})",
    )
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    options.add_token(top, "bearer token for the collector: a reader token")
    top.add_argument("--ca-file", metavar="PEM", help="trust only this CA for an https collector")


def run(args: argparse.Namespace, settings: Settings, out: TextIO | None = None) -> int:
    """Draw frames until Ctrl-C (or one, with ``--once``)."""
    out = out or sys.stdout
    if not 0.2 <= args.interval <= 3600:
        raise UsageError(f"--interval {args.interval:g} is out of range; use 0.2 to 3600 seconds")
    # WATTWATCH_SERVER, set for reports of a cluster, names the collector to watch too.
    server = args.server or settings.report_server or _agent_collector(settings) or settings.collector_url
    if not server.lower().startswith(("http://", "https://")):
        raise UsageError(f"--server {server!r} is not a URL; use e.g. http://collector:8470")
    fetch = _fetcher(server, settings)
    live = fetch()  # the first answer decides: a collector that is not there is an error, not an empty view
    if args.once:
        out.write(render(live, server=server) + "\n")
        return 0
    if not out.isatty():
        return _print_frames(out, fetch, live, server=server, interval_s=args.interval)
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console(file=out, highlight=False, markup=False, emoji=False)

    def frame(live: Mapping[str, Any]) -> Text:
        text = render(live, server=server, interval_s=args.interval, width=console.width)
        return Text(text, no_wrap=True, overflow="crop")

    try:
        with Live(frame(live), console=console, auto_refresh=False) as view:
            while True:
                time.sleep(args.interval)
                live = _next(fetch, live)
                view.update(frame(live), refresh=True)
    except KeyboardInterrupt:
        return 0


def _print_frames(
    out: TextIO, fetch: Callable[[], dict[str, Any]], live: dict[str, Any], *, server: str, interval_s: float
) -> int:
    """Frames one after another, plain, for a pipe or a file: nothing there can redraw."""
    try:
        while True:
            out.write(render(live, server=server, interval_s=interval_s) + "\n\n")
            out.flush()
            time.sleep(interval_s)
            live = _next(fetch, live)
    except KeyboardInterrupt:
        return 0


def _next(fetch: Callable[[], dict[str, Any]], last: dict[str, Any]) -> dict[str, Any]:
    """The collector's next answer; when it fails, the last figures marked stale (and asked again next)."""
    try:
        return fetch()
    except (UsageError, RuntimeFailure) as exc:
        return {**last, "error": str(exc)}


def _agent_collector(settings: Settings) -> str | None:
    """The collector the local agent pushes to, when one answers on the socket."""
    if not settings.socket_path.exists():
        return None
    from wattwatch.sdk import AgentClient

    client = AgentClient(settings.socket_path, timeout_s=1.0)
    try:
        reply = client.request({"op": "ping"})
    except (OSError, ValueError):
        return None
    finally:
        client.close()
    url = reply.get("collector")
    return str(url) if url else None


def _fetcher(server: str, settings: Settings) -> Callable[[], dict[str, Any]]:
    from wattwatch.cli.report import get_json

    def fetch() -> dict[str, Any]:
        return get_json(server, "/api/v1/live", settings)

    return fetch


def render(live: Mapping[str, Any], *, server: str, interval_s: float | None = None, width: int = 0) -> str:
    """One frame as text: a header, one row per GPU, the running jobs; lines cut to ``width`` (0: not)."""
    from wattwatch.reporting.render import format_duration, format_energy

    at_s = float(live.get("at_s") or time.time())
    clock = datetime.fromtimestamp(at_s, UTC).strftime("%H:%M:%S UTC")
    every = f"every {interval_s:g} s, Ctrl-C quits" if interval_s else "one frame"
    lines = [f"wattwatch top  {redact.url(server)}  {clock}  ({every})"]
    if live.get("error"):
        lines.append(f"! {live['error']} (figures below are from the last answer)")
    jobs = {j["id"]: j for j in live.get("jobs") or []}
    hosts = live.get("hosts") or []
    rows: list[list[str]] = []
    total_w = 0.0
    newest_s = 0.0
    for host in hosts:
        for d in host.get("devices") or []:
            if d.get("power_w") is not None:
                total_w += float(d["power_w"])
                newest_s = max(newest_s, float(d.get("power_at_s") or 0.0))
            if d.get("kind") != "gpu":
                continue
            holders = [jobs[j] for j in d.get("jobs") or [] if j in jobs]
            first = holders[0] if holders else None
            rows.append(
                [
                    host["host"],
                    d["device"],
                    _watts(d.get("power_w")),
                    _job_cell(first) if first else "idle",
                    format_energy(first["energy_j"]) if first else "",
                    _per_unit(first) if first else "",
                ]
            )
            for other in holders[1:]:  # a shared GPU: one row per job
                rows.append(["", "", "", _job_cell(other), format_energy(other["energy_j"]), _per_unit(other)])
    if rows:
        lines += ["", *_grid(["HOST", "GPU", "POWER", "JOB", "ENERGY SO FAR", "J/QUERY or J/STEP"], rows)]
    elif hosts:
        lines += ["", f"no GPU on {len(hosts)} host(s) heard from in the last 10 minutes"]
    else:
        lines += ["", "no host has pushed in the last 10 minutes: is an agent running (`wattwatch up` or `agent`)?"]
    job_rows = [
        [
            j["short_id"],
            cut(j["name"], 28),
            j["kind"],
            _watts(j.get("gpu_power_w")),
            format_energy(j["energy_j"]),
            format_duration(j["duration_s"]),
            _per_unit(j) or "-",
        ]
        for j in jobs.values()
    ]
    lines += ["", f"running jobs: {len(job_rows)}"]
    if job_rows:
        lines += _grid(
            ["JOB", "NAME", "KIND", "GPU POWER", "ENERGY SO FAR", "RUNNING FOR", "J/QUERY or J/STEP"], job_rows
        )
    age = f", as of {max(at_s - newest_s, 0.0):.1f} s ago (agents push every few seconds)" if newest_s else ""
    lines += ["", f"power now: {_watts(total_w)} on {len(hosts)} host(s){age}"]
    if width > 0:
        lines = [cut(line, width) if cells(line) > width else line for line in lines]
    return "\n".join(lines)


def _watts(power_w: float | None) -> str:
    if power_w is None:
        return "-"
    return f"{power_w / 1000:.2f} kW" if power_w >= 10_000 else f"{power_w:.0f} W"


def _job_cell(job: Mapping[str, Any]) -> str:
    return f"{job['short_id']} {cut(str(job['name']), 28)} ({job['kind']})"


def _per_unit(job: Mapping[str, Any]) -> str:
    """J/query and J/step as far as the collector has computed them ("" when neither applies yet)."""
    from wattwatch.reporting.render import format_energy

    parts = []
    if job.get("energy_per_query_j") is not None:
        parts.append(f"{format_energy(job['energy_per_query_j'])}/query ({job.get('queries', 0)})")
    elif job.get("queries"):
        parts.append(f"{job['queries']} queries, J/query pending")
    if job.get("energy_per_step_j") is not None:
        parts.append(f"{format_energy(job['energy_per_step_j'])}/step ({job.get('steps', 0)})")
    elif job.get("steps"):
        parts.append(f"{job['steps']} steps, J/step pending")
    return ", ".join(parts)


def _grid(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` under ``header``, each column as wide (in terminal cells) as its widest cell."""
    widths = [max(cells(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(str(c) + " " * (w - cells(str(c))) for c, w in zip(r, widths, strict=True)).rstrip()
        for r in [header, *rows]
    ]
