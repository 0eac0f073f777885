"""Load on a real collector process over loopback HTTP: simulated agents push agent-shaped batches.

Two modes:

- ``throughput``: ``--senders`` connections each post batches back-to-back (8 GPUs + CPU + DRAM per
  host, ``--intervals`` intervals per batch, about 300 by default) for ``--seconds``.
- ``fleet``: ``--agents`` agents (1,000 by default) each push one batch every ``--push-interval``
  seconds (5 s, the agent's default cadence) over its own keep-alive connection, starting at random
  phases; a push that starts later than its slot by a whole interval counts as an agent falling behind.

Prints, under the command that produced it, a markdown table: intervals/s, batches/s, p50/p99 latency
(send to full answer), errors, rows the database holds afterwards against rows sent (read with plain SQL),
the collector's CPU (all its processes, from /proc) and, on PostgreSQL, the CPU of the backends serving the
benchmark database. In the same run, after the load, the ceiling: the same rows written raw (psycopg COPY,
one COPY and commit per batch, on 1 and 4 connections; on SQLite, sqlite3 executemany) into a scratch
table of the same shape, and the ratio of the collector's rate to the best ceiling.

Run: ``python benchmarks/load.py [--db sqlite|postgresql] [--mode throughput|fleet] [--senders 8]
[--seconds 20] [--workers 1]``. PostgreSQL comes from WATTWATCH_TEST_PG_URL (default
postgresql://postgres@127.0.0.1:5432/test); a scratch database is created and dropped.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import command, paragraph, table

from wattwatch.protocol import wire

PG_DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/test"
GPUS = 8
DEVICES = [
    *(wire.Device(key=f"gpu{i}", kind="gpu", index=i, model="H100", power_limit_w=700.0) for i in range(GPUS)),
    wire.Device(key="cpu0", kind="cpu"),
    wire.Device(key="dram0", kind="dram"),
]
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- batches -----------------------------------------------------------------------------------------------


@dataclass
class Agent:
    """One simulated host: its agent id, next seq, and where its next batch starts in time."""

    index: int
    run: str
    t_s: float
    seq: int = 0
    energy_j: float = 0.0  # sent in accepted batches (the truth a test compares reports with)

    @property
    def host(self) -> str:
        """The host name this agent reports."""
        return f"load-{self.run}-{self.index:04d}"

    def jobs(self) -> list[str]:
        """Two jobs per host, one per half of its GPUs."""
        return [f"{self.host}-a", f"{self.host}-b"]


def make_batch(agent: Agent, ticks: int) -> tuple[bytes, float]:
    """The agent's next batch, ``ticks`` seconds of 1 s intervals of every device, and the energy it carries.

    The first batch also carries the two jobs' start records, as a real agent's first push does.
    """
    job_a, job_b = agent.jobs()
    intervals: list[wire.Interval] = []
    energy_j = 0.0
    t_s = agent.t_s
    for _ in range(ticks):
        for dev in DEVICES:
            if dev.kind == "gpu":
                e = 300.0 + 10.0 * dev.index + (agent.seq % 7)
                shares = {job_a if dev.index < GPUS // 2 else job_b: 1.0}
                idle = 0.0
            else:
                e = 120.0 if dev.kind == "cpu" else 20.0
                shares = {job_a: 1.0, job_b: 1.0}
                idle = 2.0
            energy_j += e
            intervals.append(
                wire.Interval(
                    device=dev.key,
                    t_start_s=t_s,
                    t_end_s=t_s + 1.0,
                    energy_j=e,
                    source="counter",
                    shares=shares,
                    idle_weight=idle,
                )
            )
        t_s += 1.0
    jobs = []
    if agent.seq == 0:
        jobs = [
            wire.Job(id=job, name=job, kind="training", started_at_s=agent.t_s, devices=keys)
            for job, keys in ((job_a, [f"gpu{i}" for i in range(4)]), (job_b, [f"gpu{i}" for i in range(4, 8)]))
        ]
    batch = wire.Batch(
        agent_id=f"{agent.host}-id",
        seq=agent.seq,
        host=agent.host,
        sent_at_s=min(t_s, time.time()),
        devices=DEVICES,
        intervals=intervals,
        jobs=jobs,
    )
    agent.seq += 1
    agent.t_s = t_s
    return wire.encode(batch), energy_j


# --- a minimal keep-alive HTTP/1.1 client (asyncio streams: light enough for 1,000 connections) ----------


class HttpError(Exception):
    """A refused request or a broken connection."""


class Connection:
    """One keep-alive connection to the collector."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.reconnects = 0

    async def open(self) -> None:
        """Connect (again)."""
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        sock = self.writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def close(self) -> None:
        """Close the connection."""
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(OSError):
                await self.writer.wait_closed()
            self.writer = None

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """POST ``body`` as JSON; (status, answer). A connection the server closed while idle is reopened
        once (as HTTP clients do); anything else raises HttpError."""
        for attempt in (0, 1):
            if self.writer is None:
                await self.open()
            assert self.reader is not None and self.writer is not None
            head = (
                f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            ).encode()
            try:
                self.writer.write(head + body)
                await self.writer.drain()
                status_line = await self.reader.readline()
                if not status_line:
                    raise ConnectionResetError("closed by the server")
                headers = await self.reader.readuntil(b"\r\n\r\n")
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                await self.close()
                if attempt == 0:
                    self.reconnects += 1
                    continue
                raise HttpError(f"connection: {exc}") from None
            length = 0
            close = False
            for line in headers.split(b"\r\n"):
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                elif name.strip().lower() == b"connection" and value.strip().lower() == b"close":
                    close = True
            answer = await self.reader.readexactly(length)
            if close:
                await self.close()
            return int(status_line.split()[1]), answer
        raise AssertionError("unreachable")


# --- the collector process and what it costs ----------------------------------------------------------------


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (0 when it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def process_tree(pid: int) -> list[int]:
    """``pid`` and every descendant alive now."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        parents.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


class CpuMeter:
    """CPU seconds a set of processes used between ``start`` and ``stop`` (processes that appear count from 0)."""

    def __init__(self, pids: Any) -> None:
        self._pids = pids  # a callable returning the pids to watch now
        self._start: dict[int, float] = {}
        self.seconds = 0.0

    def start(self) -> None:
        """Take the first reading."""
        self._start = {p: cpu_s(p) for p in self._pids()}

    def stop(self) -> None:
        """Take the last reading."""
        self.seconds = sum(max(0.0, cpu_s(p) - self._start.get(p, 0.0)) for p in self._pids())


def start_collector(
    db_url: str, workers: int, home: Path, extra: Sequence[str] = ()
) -> tuple[subprocess.Popen[bytes], int]:
    """``wattwatch collector`` (with ``extra`` options) on a free loopback port, migrated and answering;
    (process, port)."""
    port = free_port()
    cmd = [sys.executable, "-m", "wattwatch.cli.main", "collector", "--db", db_url, "--listen", f"127.0.0.1:{port}"]
    cmd += ["--migrate", "--open", *extra] + (["--workers", str(workers)] if workers != 1 else [])
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    log = open(home / "collector.log", "wb")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = (home / "collector.log").read_text()[-2000:]
            raise SystemExit(f"the collector exited ({proc.returncode}): {tail}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                if b" 200 " in s.recv(200):
                    return proc, port
        except OSError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise SystemExit("the collector did not become ready within 60 s")


# --- load ----------------------------------------------------------------------------------------------------


@dataclass
class Result:
    """What one load run measured."""

    seconds: float = 0.0
    batches: int = 0
    intervals: int = 0
    errors: int = 0
    behind: int = 0
    reconnects: int = 0
    latencies_s: list[float] = field(default_factory=list)
    error_samples: list[str] = field(default_factory=list)

    def record_error(self, what: str) -> None:
        """Count an error and keep the first few for the printout."""
        self.errors += 1
        if len(self.error_samples) < 3:
            self.error_samples.append(what[:300])


async def _push(conn: Connection, agent: Agent, ticks: int, result: Result | None) -> bool:
    body, energy_j = make_batch(agent, ticks)
    t0 = time.perf_counter()
    try:
        status, answer = await conn.post("/api/v1/ingest", body)
    except HttpError as exc:
        if result is not None:
            result.record_error(str(exc))
        return False
    if result is not None:
        result.latencies_s.append(time.perf_counter() - t0)
    if status != 200:
        if result is not None:
            result.record_error(f"HTTP {status}: {answer.decode(errors='replace')}")
        return False
    agent.energy_j += energy_j
    if result is not None:
        result.batches += 1
        result.intervals += ticks * len(DEVICES)
    return True


async def _warm_up(port: int, agents: list[Agent], ticks: int) -> list[Connection]:
    """Connect every agent and push its first batch (hosts, devices and jobs created before timing)."""
    conns = [Connection("127.0.0.1", port) for _ in agents]
    sem = asyncio.Semaphore(32)
    failed = Result()

    async def one(conn: Connection, agent: Agent) -> None:
        async with sem:
            await _push(conn, agent, ticks, failed)

    await asyncio.gather(*(one(c, a) for c, a in zip(conns, agents, strict=True)))
    if failed.errors:
        raise RuntimeError(f"{failed.errors} warm-up pushes failed, e.g. {failed.error_samples[0]}")
    return conns


async def throughput(port: int, agents: list[Agent], ticks: int, seconds: float, meters: list[CpuMeter]) -> Result:
    """Each agent posts back-to-back for ``seconds``."""
    conns = await _warm_up(port, agents, ticks)
    result = Result()
    for m in meters:
        m.start()
    t0 = time.perf_counter()
    end = t0 + seconds

    async def sender(conn: Connection, agent: Agent) -> None:
        while time.perf_counter() < end:
            await _push(conn, agent, ticks, result)

    await asyncio.gather(*(sender(c, a) for c, a in zip(conns, agents, strict=True)))
    return await _finish(result, t0, conns, meters)


async def _finish(result: Result, t0: float, conns: list[Connection], meters: list[CpuMeter]) -> Result:
    """End a run: its length, the CPU meters stopped, reconnects counted, connections closed."""
    result.seconds = time.perf_counter() - t0
    for m in meters:
        m.stop()
    result.reconnects = sum(c.reconnects for c in conns)
    for c in conns:
        await c.close()
    return result


async def fleet(
    port: int, agents: list[Agent], ticks: int, seconds: float, push_s: float, meters: list[CpuMeter]
) -> Result:
    """Each agent pushes every ``push_s`` from a random phase for ``seconds``."""
    conns = await _warm_up(port, agents, ticks)
    result = Result()
    rng = random.Random(7)
    for m in meters:
        m.start()
    t0 = time.perf_counter()
    end = t0 + seconds

    async def agent_loop(conn: Connection, agent: Agent) -> None:
        slot = t0 + rng.uniform(0, push_s)
        while slot < end:
            await asyncio.sleep(max(0.0, slot - time.perf_counter()))
            if time.perf_counter() - slot > push_s:
                result.behind += 1
            await _push(conn, agent, ticks, result)
            slot += push_s

    await asyncio.gather(*(agent_loop(c, a) for c, a in zip(conns, agents, strict=True)))
    return await _finish(result, t0, conns, meters)


# --- the ceiling: the same rows written raw -------------------------------------------------------------------

_CEILING_DDL = (
    "CREATE TABLE load_ceiling (id {id} PRIMARY KEY, device_id INTEGER NOT NULL, t_start_s {f} NOT NULL, "
    "t_end_s {f} NOT NULL, energy_j {f} NOT NULL, source VARCHAR(16) NOT NULL, flags VARCHAR(200) NOT NULL)"
)


def _ceiling_rows(n_batches: int, per_batch: int) -> list[list[tuple[Any, ...]]]:
    t_s = 1.8e9
    out = []
    for _ in range(n_batches):
        rows = []
        for i in range(per_batch):
            rows.append((1 + i % len(DEVICES), t_s, t_s + 1.0, 300.0 + i, "counter", ""))
            if i % len(DEVICES) == len(DEVICES) - 1:
                t_s += 1.0
        out.append(rows)
    return out


def pg_ceiling(url: str, per_batch: int, connections: int, n_batches: int = 200) -> float:
    """Rows/s of psycopg COPY into a table shaped like energy_intervals, one COPY and commit per batch."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS load_ceiling")
        conn.execute(_CEILING_DDL.format(id="BIGSERIAL", f="DOUBLE PRECISION"))
        conn.execute("CREATE INDEX ON load_ceiling (device_id, t_start_s)")
    batches = _ceiling_rows(n_batches, per_batch)
    share = [batches[i::connections] for i in range(connections)]
    conns = [psycopg.connect(url) for _ in range(connections)]

    def write(conn: Any, mine: list[list[tuple[Any, ...]]]) -> None:
        for rows in mine:
            with (
                conn.cursor() as cur,
                cur.copy(
                    "COPY load_ceiling (device_id, t_start_s, t_end_s, energy_j, source, flags) FROM STDIN"
                ) as copy,
            ):
                for row in rows:
                    copy.write_row(row)
            conn.commit()

    threads = [threading.Thread(target=write, args=(c, s)) for c, s in zip(conns, share, strict=True)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    for c in conns:
        c.close()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DROP TABLE load_ceiling")
    return n_batches * per_batch / elapsed


def sqlite_ceiling(path: Path, per_batch: int, n_batches: int = 200) -> float:
    """Rows/s of sqlite3 executemany (WAL, synchronous NORMAL, as the collector runs) into a scratch table
    shaped like energy_intervals, one transaction per batch."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute(_CEILING_DDL.format(id="INTEGER", f="FLOAT"))
    conn.execute("CREATE INDEX ix_ceiling ON load_ceiling (device_id, t_start_s)")
    batches = _ceiling_rows(n_batches, per_batch)
    sql = "INSERT INTO load_ceiling (device_id, t_start_s, t_end_s, energy_j, source, flags) VALUES (?, ?, ?, ?, ?, ?)"
    t0 = time.perf_counter()
    for rows in batches:
        conn.execute("BEGIN IMMEDIATE")
        conn.executemany(sql, rows)
        conn.execute("COMMIT")
    elapsed = time.perf_counter() - t0
    conn.close()
    return n_batches * per_batch / elapsed


# --- the run --------------------------------------------------------------------------------------------------


@dataclass
class Database:
    """The benchmark's database: its URL, and how to clean up."""

    url: str
    backend: str
    drop: Any = None
    psycopg_url: str = ""


def make_database(kind: str, tmp: Path) -> Database:
    """A fresh SQLite file, or a scratch PostgreSQL database next to WATTWATCH_TEST_PG_URL's."""
    if kind == "sqlite":
        return Database(url=f"sqlite:///{tmp / 'load.db'}", backend="sqlite")
    import psycopg
    from sqlalchemy.engine import make_url

    base = make_url(os.environ.get("WATTWATCH_TEST_PG_URL", PG_DEFAULT_URL))
    name = f"wattwatch_load_{uuid.uuid4().hex[:8]}"
    admin_url = base.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop() -> None:
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    url = base.set(drivername="postgresql", database=name).render_as_string(hide_password=False)
    return Database(url=url, backend="postgresql", drop=drop, psycopg_url=url)


def stored_rows(db: Database) -> int:
    """Intervals stored in raw_batches (a row per batch, its interval count beside it), with plain SQL."""
    query = "SELECT coalesce(sum(n_intervals), 0) FROM raw_batches"
    if db.backend == "sqlite":
        with sqlite3.connect(db.url.removeprefix("sqlite:///")) as conn:
            return int(conn.execute(query).fetchone()[0])
    import psycopg

    with psycopg.connect(db.psycopg_url) as conn:
        row = conn.execute(query).fetchone()
        return int(row[0]) if row else 0


def pg_backend_pids(db: Database) -> list[int]:
    """Pids of the PostgreSQL backends connected to the benchmark database now."""
    import psycopg

    with psycopg.connect(db.psycopg_url, autocommit=True) as conn:
        name = conn.info.dbname
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()", (name,)
        ).fetchall()
    return [int(r[0]) for r in rows]


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One load run against a fresh collector and database; the figures for the table."""
    with tempfile.TemporaryDirectory(prefix="wattwatch-load-") as tmp_name:
        tmp = Path(tmp_name)
        db = make_database(args.db, tmp)
        proc = None
        try:
            proc, port = start_collector(db.url, args.workers, tmp)
            collector = CpuMeter(lambda: process_tree(proc.pid))
            client = CpuMeter(lambda: [os.getpid()])
            meters = [collector, client]
            backends = None
            if db.backend == "postgresql":
                backends = CpuMeter(lambda: pg_backend_pids(db))
                meters.append(backends)
            fleet_mode = args.mode == "fleet"
            n = args.agents if fleet_mode else args.senders
            ticks = max(1, round(args.intervals / len(DEVICES)))
            run_id = uuid.uuid4().hex[:6]
            # Back in time enough that every batch of the run lies in the collector's accepted window.
            start_s = time.time() - (2 * 86400 if not fleet_mode else 3600)
            agents = [Agent(i, run_id, start_s) for i in range(n)]
            if fleet_mode:
                coro = fleet(port, agents, ticks, args.seconds, args.push_interval, meters)
            else:
                coro = throughput(port, agents, ticks, args.seconds, meters)
            result = asyncio.run(coro)
            # Other work on the machine takes cores from the collector: say how busy it was.
            load_1m = float(Path("/proc/loadavg").read_text().split()[0])
            stored = stored_rows(db)
            sent = sum(a.seq for a in agents)  # warm-up batches included
            proc.terminate()
            proc.wait(timeout=30)
            if db.backend == "postgresql":
                ceilings = [pg_ceiling(db.psycopg_url, ticks * len(DEVICES), c) for c in (1, 4)]
            else:
                ceilings = [sqlite_ceiling(tmp / "ceiling.db", ticks * len(DEVICES))]
        finally:
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            if db.drop is not None:
                db.drop()
    lat = sorted(result.latencies_s) or [0.0]
    return {
        "result": result,
        "n": n,
        "ticks": ticks,
        "p50_s": statistics.median(lat),
        "p99_s": lat[min(len(lat) - 1, int(0.99 * len(lat)))],
        "stored": stored,
        "sent_rows": sent * ticks * len(DEVICES),
        "collector_cpu": collector.seconds / result.seconds,
        "backend_cpu": backends.seconds / result.seconds if backends is not None else None,
        "client_cpu": client.seconds / result.seconds,
        "load_1m": load_1m,
        "ceilings": ceilings,
    }


def _k(x: float) -> str:
    return f"{x / 1e3:.1f}k" if x < 1e4 else f"{x / 1e3:.0f}k"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and print the markdown table under the command that produced it."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--db", choices=("sqlite", "postgresql"), default="postgresql")
    ap.add_argument("--mode", choices=("throughput", "fleet"), default="throughput")
    ap.add_argument("--senders", type=int, default=8, help="throughput: concurrent connections")
    ap.add_argument("--agents", type=int, default=1000, help="fleet: agents")
    ap.add_argument("--push-interval", type=float, default=5.0, help="fleet: seconds between an agent's pushes")
    ap.add_argument("--seconds", type=float, default=20.0, help="timed load (after a warm-up push per agent)")
    ap.add_argument("--intervals", type=int, default=None, help="per batch (default 300; fleet: push interval x 10)")
    ap.add_argument("--workers", type=int, default=1, help="collector worker processes")
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.intervals is None:
        args.intervals = round(args.push_interval) * len(DEVICES) if args.mode == "fleet" else 300
    r = run(args)
    res: Result = r["result"]
    best = max(r["ceilings"])
    rate = res.intervals / res.seconds
    ceiling = _k(best)
    if args.db == "postgresql":
        ceiling = f"{_k(r['ceilings'][0])} (1 conn) / {_k(r['ceilings'][1])} (4)"
    print(command("load.py", argv))
    who = f"{r['n']} agents pushing every {args.push_interval:g} s" if args.mode == "fleet" else f"{r['n']} senders"
    print(
        paragraph(
            f"**Collector under load** ({args.db}, {args.workers} worker(s), {who}, {r['ticks'] * len(DEVICES)}"
            f" intervals per batch, {res.seconds:.0f} s over loopback HTTP). CPU in cores (load: this benchmark's"
            " own simulated agents); ceiling: the same rows written raw in the same run (psycopg COPY / sqlite3"
            f" executemany, a commit per batch). Machine load average at the end: {r['load_1m']:.1f} on"
            f" {os.cpu_count()} cores."
        )
    )
    header = [
        "mode",
        "intervals/s",
        "batches/s",
        "p50",
        "p99",
        "errors",
        "behind",
        "stored/sent",
        "collector CPU",
        "PG backends CPU",
        "load CPU",
        "ceiling rows/s",
        "ratio",
    ]
    row = [
        args.mode,
        _k(rate),
        f"{res.batches / res.seconds:.0f}",
        f"{r['p50_s'] * 1e3:.0f} ms",
        f"{r['p99_s'] * 1e3:.0f} ms",
        str(res.errors),
        str(res.behind) if args.mode == "fleet" else "-",
        f"{r['stored']}/{r['sent_rows']}",
        f"{r['collector_cpu']:.2f}",
        f"{r['backend_cpu']:.2f}" if r["backend_cpu"] is not None else "-",
        f"{r['client_cpu']:.2f}",
        ceiling,
        f"{rate / best:.2g}",
    ]
    print(table(header, [row]))
    if res.error_samples:
        print("\nfirst errors: " + " | ".join(res.error_samples))
    if res.reconnects:
        print(f"\n({res.reconnects} connections closed by the collector while idle were reopened)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
