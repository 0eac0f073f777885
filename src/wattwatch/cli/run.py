"""``wattwatch run``: run a command as a tagged job, say its id at start and its energy at exit.

The summary asks where the job's figures land, as ``wattwatch report`` does: ``--db`` (a database read
directly), ``--server``, or by default the collector the local agent pushes to (its ``job_start`` reply
names it). The agent pushes a job's end at once, but that is asynchronous: the summary waits, up to
``--summary-wait`` seconds, for the collector to hold the ended job, and says it is pending otherwise.
All of it goes to stderr, so the command's own stdout stays its own.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from wattwatch.cli import options
from wattwatch.cli.errors import RuntimeFailure, UsageError
from wattwatch.config import Settings
from wattwatch.protocol.units import JOB_KINDS

POLL_S = 0.2


EPILOG = """examples:
  wattwatch run --kind training --name llama-ft -- python train.py
  CUDA_VISIBLE_DEVICES=2 wattwatch run --kind inference --name chat -- vllm serve m"""


def add_parser(sub: Any) -> None:
    """Add ``run`` to the command parsers ``sub``."""
    run = options.add_command(sub, "run", help="run a command as a tagged job", epilog=EPILOG)
    run.add_argument("--kind", choices=JOB_KINDS, default="other", help="training, inference or other")
    run.add_argument("--name", help="job name (default: the command)")
    run.add_argument("--label", action="append", default=[], metavar="K=V", help="add a label (repeatable)")
    run.add_argument("--job-id", help="join this job id (default $WATTWATCH_JOB or a new id)")
    source = run.add_mutually_exclusive_group()
    source.add_argument(
        "--server", metavar="URL", help="ask this collector for the summary (default: the one the agent pushes to)"
    )
    source.add_argument("--db", metavar="URL", help="read the summary from this database instead")
    run.add_argument(
        "--summary-wait",
        type=float,
        default=15.0,
        metavar="S",
        help="wait up to S seconds for the job's figures after it ends (default 15; 0: no summary)",
    )
    options.add_token(run, "bearer token for the summary: a reader token")
    run.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ...", help="the command to run")


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run ``args.cmd`` as a job; its exit code (128+N for a signal) is ours."""
    from wattwatch.sdk import AgentClient

    cmd = list(args.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise UsageError("no command given; put it after --, e.g. `wattwatch run --kind training -- python train.py`")
    if not 0 <= args.summary_wait <= 3600:  # NaN too
        raise UsageError("--summary-wait must be 0 (no summary) to 3600 seconds")
    labels: dict[str, str] = {}
    for item in args.label:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--label {item!r} is not K=V; use e.g. --label team=nlp")
        labels[key] = value
    job_id = args.job_id or os.environ.get("WATTWATCH_JOB") or uuid.uuid4().hex
    name = args.name or Path(cmd[0]).name
    client = AgentClient(settings.socket_path, timeout_s=2.0)
    reply: dict[str, Any] = {}
    try:
        reply = client.request(
            {
                "op": "job_start",
                "id": job_id,
                "name": name,
                "kind": args.kind,
                "labels": labels,
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "via": "run",
            }
        )
        if not reply.get("ok"):
            raise UsageError(f"the agent refused the job: {reply.get('error')}")
        if reply.get("warning"):
            _say(f"warning: {reply['warning']}")
        devices = ",".join(reply.get("devices") or []) or "GPUs found as its processes appear on them"
        _say(f"job {job_id} ({args.kind} {name!r}) on {reply.get('host', 'this host')}: {devices}")
    except (OSError, ValueError) as exc:
        reply = {}
        _say(
            f"warning: no agent at {settings.socket_path} ({exc}); running the command unmeasured. "
            "Start one with `wattwatch up` or `wattwatch agent`."
        )
    started = bool(reply)
    env = {**os.environ, "WATTWATCH_JOB": job_id, "WATTWATCH_KIND": args.kind}
    try:
        child = subprocess.Popen(cmd, env=env)
    except OSError as exc:
        if started:
            client.request({"op": "job_end", "id": job_id})
        raise UsageError(f"cannot start {cmd[0]!r}: {exc.strerror}") from None

    def forward(signum: int, frame: object) -> None:
        child.send_signal(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    code = child.wait()
    ended = False
    if started:
        try:
            client.request({"op": "job_end", "id": job_id})
            ended = True
        except (OSError, ValueError) as exc:
            _say(f"warning: could not tell the agent the job ended ({exc})")
    client.close()
    if ended and args.summary_wait > 0:
        # Ctrl-C while waiting for the summary skips it; the command's code still stands.
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.default_int_handler)
        try:
            _summary(args, settings, job_id, reply)
        except (UsageError, RuntimeFailure) as exc:
            _say(f"no summary: {exc}")
        except KeyboardInterrupt:
            pass
    return code if code >= 0 else 128 - code


def _say(line: str) -> None:
    sys.stderr.write(f"wattwatch run: {line}\n")
    sys.stderr.flush()


def _summary(args: argparse.Namespace, settings: Settings, job_id: str, reply: dict[str, Any]) -> None:
    """Wait (bounded) until the ended job is stored, then say what it drew."""
    fetch = _fetcher(args, settings, reply)
    deadline = time.monotonic() + args.summary_wait
    entry: dict[str, Any] | None = None
    while True:
        entry = fetch(job_id)
        ended = entry is not None and not entry.get("running")
        if ended and entry is not None and _settled(entry):
            break
        if time.monotonic() >= deadline:
            if ended and entry is not None:
                # The end is stored; the per-query / per-step pass runs every few seconds on the collector.
                _say(summary_line(entry) + " (J/query and J/step still being computed: see the report shortly)")
            else:
                _say(
                    f"job {job_id} summary pending: the collector did not hold its end within "
                    f"{args.summary_wait:g} s; see it later with `wattwatch report --job {job_id}`"
                )
            return
        time.sleep(POLL_S)
    assert entry is not None
    _say(summary_line(entry))


def _settled(job: dict[str, Any]) -> bool:
    """Whether the collector has computed the energy of every query and step the job marked."""
    return all(int(job.get(f"{k}_settled") or 0) >= int(job.get(k) or 0) for k in ("queries", "steps"))


def summary_line(job: dict[str, Any]) -> str:
    """One line: the job's energy, duration (and the seconds of it not measured), average power and
    per-query / per-step energy where known."""
    from wattwatch.reporting.figures import figure
    from wattwatch.reporting.render import format_duration, format_energy

    short = job.get("short_id") or job["id"]
    parts = [f"{format_energy(job.get('energy_j'))} in {format_duration(job.get('duration_s'))}"]
    if job.get("unmeasured_s"):
        # Its energy is that of the rest: an agent's full disk or an outage left this time unmeasured.
        parts[0] += f" ({figure(job['unmeasured_s'])} s of it not measured)"
    if job.get("avg_power_w") is not None:
        parts.append(f"avg {job['avg_power_w']:.0f} W")
    if job.get("energy_per_query_j") is not None:
        parts.append(f"{format_energy(job['energy_per_query_j'])}/query over {job.get('queries', 0)} queries")
    if job.get("energy_per_step_j") is not None:
        parts.append(f"{format_energy(job['energy_per_step_j'])}/step over {job.get('steps', 0)} steps")
    devices = job.get("devices") or []
    parts.append(f"on {', '.join(devices)}" if devices else "on no device")
    line = f"job {short} done: {', '.join(parts)}"
    if job.get("reason"):
        line += f"; {job['reason']}"
        if job.get("fix"):
            line += f" ({job['fix']})"
    return f"{line}; details: `wattwatch report --job {short}`"


def _fetcher(args: argparse.Namespace, settings: Settings, reply: dict[str, Any]) -> Any:
    """A function job id -> its report entry (None while the collector has not got it)."""
    if args.db:
        from wattwatch.cli.report import local_report

        def from_db(job_id: str) -> dict[str, Any] | None:
            jobs = local_report(args.db, settings, job_ref=job_id)["jobs"]
            return jobs[0] if jobs else None

        return from_db
    from wattwatch.cli.report import get_json

    server = args.server or reply.get("collector") or settings.collector_url

    def from_server(job_id: str) -> dict[str, Any] | None:
        return get_json(server, f"/api/v1/jobs/{job_id}", settings, missing_ok=True) or None

    return from_server
