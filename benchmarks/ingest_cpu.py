"""The collector's CPU per stored interval, in-process and repeatable: the real app's ingest route.

Posts ``--batches`` agent batches (benchmarks/load.py's shape: 8 GPUs + CPU + DRAM per host, 300 intervals
each) to the collector's ASGI app directly (no socket, no HTTP parser), ``--concurrency`` at a time so
group commit groups them as under load, and prints the process CPU (every thread: the event loop and
the writer) per stored interval. Everything is the app's own code path from the ASGI call on: routing,
authentication, decoding, bounds, hashing, group commit, rollups, SQL. Noise from other work on the
machine barely moves CPU time (unlike wall time), so two versions compare run against run.

``--profile FILE`` writes cProfile stats of both the event loop and the writer threads (pstats format);
``--print N`` prints the top N functions by own time.

Run: ``python benchmarks/ingest_cpu.py [--db sqlite|postgresql] [--batches 400] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import os
import pstats
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from load import DEVICES, Agent, make_batch
from mdtable import command, paragraph, table

from wattwatch.collector import create_app
from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.config import Settings
from wattwatch.standalone import GC_GEN0_THRESHOLD
from wattwatch.storage import migrate
from wattwatch.storage.engine import make_engine


async def post(app: Any, body: bytes) -> tuple[int, bytes]:
    """POST ``body`` to /api/v1/ingest through the ASGI app; (status, answer)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/api/v1/ingest",
        "raw_path": b"/api/v1/ingest",
        "root_path": "",
        "query_string": b"",
        "headers": [
            (b"host", b"127.0.0.1:8470"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8470),
        "state": {},
    }
    sent = False
    status = 0
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await asyncio.Event().wait()  # a disconnect never comes
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]
        elif message["type"] == "http.response.body":
            chunks.append(message.get("body", b""))

    await app(scope, receive, send)
    return status, b"".join(chunks)


def _profiled_writers(profiles: list[cProfile.Profile]) -> Any:
    """GroupCommitter._loop, run under a cProfile of its own thread (cProfile sees one thread)."""
    original = GroupCommitter._loop

    def loop(self: GroupCommitter) -> None:
        prof = cProfile.Profile(time.thread_time)
        profiles.append(prof)
        prof.enable()
        try:
            original(self)
        finally:
            prof.disable()

    return original, loop


def _callgrind(state: str) -> None:
    """Under ``valgrind --tool=callgrind --instr-atstart=no`` (WATTWATCH_CALLGRIND=1), count instructions
    of the timed part only: a deterministic measure where CPU time on a shared machine is not."""
    if os.environ.get("WATTWATCH_CALLGRIND") == "1":
        subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True, capture_output=True)


def _gc_timer() -> list[float]:
    """Seconds the cyclic GC runs from now on (a one-element list the callback adds to)."""
    total = [0.0]
    started = [0.0]

    def callback(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    return total


def run(url: str, n_batches: int, concurrency: int, intervals: int, profile: bool) -> dict[str, Any]:
    """Post the batches; CPU and wall seconds, intervals stored, and the profiles when asked."""
    migrate.upgrade(url)
    engine = make_engine(url)
    home = Path(tempfile.mkdtemp(prefix="wattwatch-cpu-"))
    settings = Settings(home=home, time_window_past_s=7 * 86400)
    profiles: list[cProfile.Profile] = []
    original = None
    if profile:
        original, patched = _profiled_writers(profiles)
        GroupCommitter._loop = patched  # type: ignore[method-assign]
    app = create_app(settings, engine, span_energy_interval_s=None, periodic=False)
    ticks = max(1, round(intervals / len(DEVICES)))
    run_id = uuid.uuid4().hex[:6]
    agents = [Agent(i, run_id, time.time() - 2 * 86400) for i in range(concurrency)]
    warm = [make_batch(a, ticks)[0] for a in agents]
    per_agent = n_batches // concurrency
    bodies = [[make_batch(a, ticks)[0] for _ in range(per_agent)] for a in agents]

    async def main() -> dict[str, Any]:
        async with app.router.lifespan_context(app):
            for body in warm:  # hosts, devices, jobs: created before timing
                status, answer = await post(app, body)
                assert status == 200, answer

            async def sender(mine: list[bytes]) -> None:
                for body in mine:
                    status, answer = await post(app, body)
                    assert status == 200, answer

            # As the collector does once it serves (standalone.Collector.start): what start-up built is
            # never scanned by the cyclic GC again, and young objects are collected less often.
            gc.collect()
            gc.freeze()
            threshold = gc.get_threshold()
            if not os.environ.get("GC_DEFAULT"):
                gc.set_threshold(GC_GEN0_THRESHOLD, *threshold[1:])
            gc_s = _gc_timer()
            if os.environ.get("NOGC"):
                gc.disable()
            main_prof = cProfile.Profile(time.thread_time) if profile else None
            _callgrind("on")
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if main_prof is not None:
                main_prof.enable()
            await asyncio.gather(*(sender(m) for m in bodies))
            if main_prof is not None:
                main_prof.disable()
                profiles.append(main_prof)
            cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
            _callgrind("off")
            groups = app.state.wattwatch.writer.groups
            gc.callbacks.clear()
            gc.unfreeze()
            gc.set_threshold(*threshold)
        return {"cpu_s": cpu_s, "wall_s": wall_s, "groups": groups, "gc_s": gc_s}

    try:
        out = asyncio.run(main())
    finally:
        if original is not None:
            GroupCommitter._loop = original  # type: ignore[method-assign]
        engine.dispose()
    out["intervals"] = per_agent * concurrency * ticks * len(DEVICES)
    out["batches"] = per_agent * concurrency
    out["profiles"] = profiles
    return out


def pg_url() -> tuple[str, Any]:
    """A scratch PostgreSQL database: its URL and a function dropping it."""
    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test"))
    name = f"wattwatch_cpu_{uuid.uuid4().hex[:8]}"
    admin = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return base.set(database=name).render_as_string(hide_password=False), drop


def main(argv: Sequence[str] | None = None) -> int:
    """Run and print CPU µs per interval (each repeat on a fresh database)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    ap.add_argument("--batches", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--intervals", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--profile", metavar="FILE", help="write cProfile stats (all threads) of the last repeat")
    ap.add_argument("--print", type=int, default=0, metavar="N", help="print the top N functions by own time")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    rows = []
    for i in range(args.repeat):
        profile = bool(args.profile or args.print) and i == args.repeat - 1
        drop = None
        with tempfile.TemporaryDirectory() as tmp:
            if args.db == "sqlite":
                url = f"sqlite:///{Path(tmp) / 'cpu.db'}"
            else:
                url, drop = pg_url()
            try:
                r = run(url, args.batches, args.concurrency, args.intervals, profile)
            finally:
                if drop is not None:
                    drop()
        n = r["intervals"]
        rows.append(
            [
                f"{i + 1}{' (profiled)' if profile else ''}",
                str(n),
                str(r["groups"]),
                f"{r['cpu_s'] * 1e6 / n:.2f}",
                f"{n / r['cpu_s'] / 1e3:.0f}k",
                f"{r['gc_s'][0] * 1e6 / n:.2f}",
                f"{r['wall_s']:.2f} s",
            ]
        )
        if profile and r["profiles"]:
            stats = pstats.Stats(r["profiles"][0])
            for p in r["profiles"][1:]:
                stats.add(p)
            if args.profile:
                stats.dump_stats(args.profile)
            if args.print:
                stats.sort_stats("tottime").print_stats(args.print)
    print(command("ingest_cpu.py", argv))
    print(
        paragraph(
            f"**Collector CPU per stored interval** ({args.db}; the app's ingest route in-process, no socket;"
            f" {args.batches} batches of {args.intervals} intervals from {args.concurrency} agents at a time;"
            " CPU of every thread of the process; each run on a fresh database):"
        )
    )
    header = ["run", "intervals", "groups", "CPU µs/interval", "intervals/s per core", "GC µs/interval", "wall"]
    print(table(header, rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
