"""Scale-out on PostgreSQL: `wattwatch collector --workers 2` and a second collector process on one
database, under concurrent load from several agents, give exact totals; SQLite refuses --workers.

The joules expected are summed here from the batches the test sends; the collectors' report is read over HTTP.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from procs import WATTWATCH, free_port, wait_for
from wattwatch.protocol import wire

pytestmark = [pytest.mark.e2e]

GPUS = 4
DEVICES = [wire.Device(key=f"gpu{i}", kind="gpu", index=i) for i in range(GPUS)] + [wire.Device(key="cpu0", kind="cpu")]
HOSTS = 6
BATCHES = 8  # per host
TICKS = 10  # seconds of intervals per batch


def make_batch(host: int, seq: int, t0_s: float) -> wire.Batch:
    """Host ``host``'s batch ``seq``: its GPUs split between its own job and one job every host runs."""
    name = f"node-{host}"
    start_s = t0_s + seq * TICKS
    intervals = []
    for k in range(TICKS):
        for d in DEVICES:
            shares = {f"{name}-own": 1.0, "shared-run": 1.0} if d.kind == "gpu" else {"shared-run": 1.0}
            intervals.append(
                wire.Interval(
                    device=d.key,
                    t_start_s=start_s + k,
                    t_end_s=start_s + k + 1,
                    energy_j=100.0 + 7.0 * host + d.index + 0.25 * seq,
                    source="counter",
                    shares=shares,
                    idle_weight=1.0 if d.kind == "cpu" else 0.0,
                )
            )
    return wire.Batch(
        agent_id=f"{name}-agent",
        seq=seq,
        host=name,
        sent_at_s=start_s + TICKS,
        devices=DEVICES,
        intervals=intervals,
    )


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid``."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry.name))
    return out


def ready(url: str) -> bool:
    """The collector at ``url`` answers /readyz with 200."""
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def collectors(pg_url: str, tmp_path: Path) -> Iterator[tuple[list[str], subprocess.Popen[bytes]]]:
    """A `--workers 2` collector and a plain one, both on ``pg_url``: their URLs, and the supervisor."""
    env = {**os.environ, "WATTWATCH_HOME": str(tmp_path)}
    ports = [free_port(), free_port()]
    procs = [
        subprocess.Popen(
            [*WATTWATCH, "collector", "--db", pg_url, "--listen", f"127.0.0.1:{ports[0]}", "--open", "--workers", "2"],
            env=env,
        ),
        subprocess.Popen(
            [*WATTWATCH, "collector", "--db", pg_url, "--listen", f"127.0.0.1:{ports[1]}", "--open"], env=env
        ),
    ]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    try:
        wait_for(lambda: all(ready(url) for url in urls), 60, f"collectors at {urls}")
        yield urls, procs[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.postgres
def test_three_collector_processes_on_one_postgresql_give_exact_totals(
    collectors: tuple[list[str], subprocess.Popen[bytes]],
) -> None:
    urls, supervisor = collectors
    workers = children_of(supervisor.pid)
    assert len(workers) == 2, workers
    t0_s = time.time() - 3600
    sent = {h: [make_batch(h, s, t0_s) for s in range(BATCHES)] for h in range(HOSTS)}

    def agent(host: int) -> list[int]:
        # Each agent alternates between the two addresses, as agents behind a load balancer would.
        statuses = []
        with httpx.Client(timeout=60) as client:
            for seq, b in enumerate(sent[host]):
                r = client.post(
                    f"{urls[(host + seq) % 2]}/api/v1/ingest",
                    content=wire.encode(b),
                    headers={"Content-Type": "application/json"},
                )
                statuses.append(r.status_code)
            # A retry of the first batch, to the other address: stored once.
            r = client.post(f"{urls[(host + 1) % 2]}/api/v1/ingest", content=wire.encode(sent[host][0]))
            assert r.json()["duplicate"] is True
        return statuses

    with ThreadPoolExecutor(HOSTS) as pool:
        statuses = [s for result in pool.map(agent, range(HOSTS)) for s in result]
    assert statuses == [200] * (HOSTS * BATCHES)

    report = httpx.get(f"{urls[0]}/api/v1/report", timeout=30).json()
    by_job = {j["id"]: j["energy_j"] for j in report["jobs"]}
    idle_j = sum(i["energy_j"] for i in report["idle"])
    total_j = sum(iv.energy_j for batches in sent.values() for b in batches for iv in b.intervals)
    gpu_j = {
        h: sum(iv.energy_j for b in sent[h] for iv in b.intervals if iv.device.startswith("gpu")) for h in range(HOSTS)
    }
    cpu_j = total_j - sum(gpu_j.values())
    for h in range(HOSTS):
        assert by_job[f"node-{h}-own"] == pytest.approx(gpu_j[h] / 2, rel=1e-9)
    # The shared run: half of every GPU joule and half of every CPU joule (the other half is idle).
    assert by_job["shared-run"] == pytest.approx(sum(gpu_j.values()) / 2 + cpu_j / 2, rel=1e-9)
    assert idle_j == pytest.approx(cpu_j / 2, rel=1e-9)
    assert sum(by_job.values()) + idle_j == pytest.approx(total_j, rel=1e-9)

    supervisor.send_signal(signal.SIGTERM)
    assert supervisor.wait(timeout=30) == 0
    wait_for(lambda: not any(Path(f"/proc/{p}").exists() for p in workers), 10, "the workers to exit")


def test_sqlite_refuses_workers(tmp_path: Path) -> None:
    """One line, exit 2: SQLite has one writer, so one collector process."""
    result = subprocess.run(
        [*WATTWATCH, "collector", "--db", f"sqlite:///{tmp_path / 'w.db'}", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "WATTWATCH_HOME": str(tmp_path)},
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--workers 2 needs PostgreSQL" in lines[0], result.stderr


def test_worker_connections_are_tcp_nodelay() -> None:
    """The workers' shared listening socket says it is TCP, so asyncio sets TCP_NODELAY on each connection
    it accepts, as on a socket of its own: without it each answer waited out the client's delayed ACK
    (40-50 ms a request, a third of the throughput of `collector --workers 2`)."""
    import asyncio
    import socket

    from wattwatch.standalone import reuse_port_socket

    async def accepted_nodelay() -> int:
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=reuse_port_socket("127.0.0.1", free_port()))
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            return await asyncio.wait_for(seen, timeout=10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(accepted_nodelay()) != 0
