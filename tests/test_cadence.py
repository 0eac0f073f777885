"""The push cadence: ticks staged in the spool as they are measured, one batch sealed and pushed per push
interval, a job's start and end pushed at once, and nothing staged lost to a crash."""

from __future__ import annotations

import gzip
import itertools
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from test_agent import LinearSensor, wait_for
from test_restart import BRIDGED, POWER_W, batches, crash, make_agent, start_job, write_boot_id, write_proc
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.requests import Refusals
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock


class Recorder:
    """A collector stand-in on loopback: takes every batch (200) and keeps it, decoded."""

    def __init__(self) -> None:
        self.batches: list[wire.Batch] = []
        self.lock = threading.Lock()

    def received(self) -> list[wire.Batch]:
        with self.lock:
            return list(self.batches)


@pytest.fixture
def collector() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        wbufsize = -1

        def do_POST(self) -> None:
            body = gzip.decompress(self.rfile.read(int(self.headers["Content-Length"])))
            with recorder.lock:
                recorder.batches.append(wire.decode_batch(body))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", recorder
    httpd.shutdown()
    httpd.server_close()


def cadence_agent(home: Path, url: str, interval_s: float, push_interval_s: float) -> Agent:
    sensor = LinearSensor({"gpu0": 300.0, "gpu1": 200.0}, time.time)
    settings = replace(Settings(home=home), collector_url=url, interval_s=interval_s, push_interval_s=push_interval_s)
    return Agent(
        settings,
        [sensor],
        resolve_visible=lambda spec, devs: [f"gpu{i}" for i in spec.split(",")],
        serve_socket=False,
    )


def staged_parts(home: Path) -> dict[int, list[bytes]]:
    spool = Spool(home / "spool.db")  # another connection, as `wattwatch doctor` opens it
    try:
        return spool.staged()
    finally:
        spool.close()


def test_every_tick_is_staged_at_once_and_nothing_is_pushed_before_the_push_interval(
    tmp_path: Path, collector: tuple[str, Recorder]
) -> None:
    url, recorder = collector
    agent = cadence_agent(tmp_path, url, interval_s=0.05, push_interval_s=3600.0)
    agent.start()
    try:
        wait_for(lambda: sum(len(p) for p in staged_parts(tmp_path).values()) >= 4)
        parts = staged_parts(tmp_path)
        assert len(parts) == 1  # all of them parts of the one batch the next push seals
        assert agent.spool.pending() == 0 and recorder.received() == []
        staged = [wire.decode_batch(body) for body in next(iter(parts.values()))]
        ivs = sorted((iv for b in staged for iv in b.intervals if iv.device == "gpu0"), key=lambda iv: iv.t_start_s)
        assert len(ivs) >= 4 and all(a.t_end_s == b.t_start_s for a, b in itertools.pairwise(ivs))
        seq = agent.seal()
        assert seq == next(iter(parts))  # the batch keeps the seq its parts were staged under
        assert staged_parts(tmp_path) == {} and agent.spool.pending() == 1
    finally:
        agent.stop(flush_timeout_s=2.0)


def test_one_batch_per_push_interval_holds_many_ticks(tmp_path: Path, collector: tuple[str, Recorder]) -> None:
    url, recorder = collector
    agent = cadence_agent(tmp_path, url, interval_s=0.05, push_interval_s=0.6)
    started_s = time.monotonic()
    agent.start()
    try:
        wait_for(lambda: len(recorder.received()) >= 3, timeout_s=30.0)
        elapsed_s = time.monotonic() - started_s
    finally:
        agent.stop(flush_timeout_s=2.0)
    got = recorder.received()
    # A push every 0.6 s (and one at stop), not one per 0.05 s tick.
    assert len(got) <= elapsed_s / 0.6 + 3
    periodic = got[1:-1] or got[:1]
    for batch in periodic:
        ivs = [iv for iv in batch.intervals if iv.device == "gpu0"]
        span_s = max(iv.t_end_s for iv in ivs) - min(iv.t_start_s for iv in ivs)
        assert len(ivs) >= 3 and span_s >= 0.3, (len(ivs), span_s)
    # Every joule measured is pushed once: contiguous intervals across the batches.
    ivs = sorted((iv for b in got for iv in b.intervals if iv.device == "gpu0"), key=lambda iv: iv.t_start_s)
    assert all(a.t_end_s == b.t_start_s for a, b in itertools.pairwise(ivs))
    assert math.fsum(iv.energy_j for iv in ivs) == pytest.approx(300.0 * (ivs[-1].t_end_s - ivs[0].t_start_s))
    assert [b.seq for b in got] == sorted({b.seq for b in got})


def test_a_job_start_and_end_are_pushed_at_once(
    tmp_path: Path, collector: tuple[str, Recorder], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    url, recorder = collector
    agent = cadence_agent(tmp_path, url, interval_s=0.05, push_interval_s=3600.0)
    agent.start()
    try:
        reply = agent.handle(
            {"op": "job_start", "id": "j", "name": "j", "kind": "training", "cuda_visible_devices": "0"}
        )
        assert reply["ok"], reply

        def pushed(ended: bool) -> Callable[[], bool]:
            return lambda: any(
                j.id == "j" and (j.ended_at_s is not None) == ended for b in recorder.received() for j in b.jobs
            )

        wait_for(pushed(False))
        time.sleep(0.2)  # a few ticks of the job: staged, not pushed (the push interval is an hour)
        end = agent.handle({"op": "job_end", "id": "j"})
        wait_for(pushed(True))
        got = recorder.received()
        held = [iv for b in got for iv in b.intervals if "j" in iv.shares]
        assert math.fsum(iv.energy_j for iv in held) == pytest.approx(300.0 * (end["t_s"] - reply["t_s"]), rel=1e-6)
    finally:
        agent.stop(flush_timeout_s=2.0)


def test_a_crash_loses_no_staged_tick(tmp_path: Path) -> None:
    home, proc, clock = tmp_path / "home", tmp_path / "proc", FakeClock()
    write_boot_id(proc, "boot-1")
    write_proc(proc, 500, 100)
    first = make_agent(home, proc, clock)
    first.start()
    # No pushes here: the push thread, woken by the job's start, would seal whatever is staged when it gets
    # to run (late, on a loaded machine), and the staged ticks would not be what the crash leaves.
    first._pushes.stop(timeout_s=10)
    start_job(first, "train", 500, "0")
    for _ in range(3):
        clock.t_s += 1.0
        assert first.tick(stage=True)  # what each tick of the schedule does
    last_staged_s = clock.t_s
    clock.t_s += 0.5
    assert first.tick()  # measured, never staged: lost with the crash, and bridged instead
    crash(first)
    clock.t_s = last_staged_s + 10.0
    second = make_agent(home, proc, clock)
    second.start()
    try:
        after = batches(home)
        gpu0 = sorted((iv for b in after for iv in b.intervals if iv.device == "gpu0"), key=lambda iv: iv.t_start_s)
        bridged = [iv for iv in gpu0 if iv.flags == [BRIDGED]]
        assert [(iv.t_start_s, iv.t_end_s) for iv in bridged] == [(last_staged_s, clock.t_s)]
        assert all(a.t_end_s == b.t_start_s for a, b in itertools.pairwise(gpu0))
        total_s = gpu0[-1].t_end_s - gpu0[0].t_start_s
        assert math.fsum(iv.energy_j for iv in gpu0) == pytest.approx(POWER_W["gpu0"] * total_s)
        # The three staged ticks came back as one batch, with the seq they were staged under.
        recovered = [b for b in after if sum(iv.device == "gpu0" and not iv.flags for iv in b.intervals) == 3]
        assert len(recovered) == 1 and staged_parts(home) == {}
    finally:
        second.stop(flush_timeout_s=0.2)


def test_a_part_staged_before_a_crash_with_a_bad_record_loses_only_that_record(tmp_path: Path) -> None:
    now = time.time()
    spool = Spool(tmp_path / "spool.db")
    devices = [wire.Device(key="gpu0", kind="gpu")]
    first = Outbox(spool, "a1", "h1", lambda: devices, time.time)
    good = [wire.Interval("gpu0", now - 3 + i, now - 2 + i, 300.0, "counter") for i in range(3)]
    glitch = wire.Interval("gpu0", now - 1, now, 1.7e308, "counter")  # a counter glitch's absurd energy
    first.add(intervals=[good[0], glitch])
    seq = first.stage()
    first.add(intervals=good[1:], counts=[wire.QueryCount("chat", now - 5, now, queries=7)])
    assert first.stage() == seq and spool.pending() == 0
    # kill -9: the next agent's outbox finds the parts
    refusals = Refusals()
    second = Outbox(spool, "a1", "h1", lambda: devices, time.time, refused=refusals.add)
    assert second.recover() == [seq]
    sealed = [wire.decode_batch(body) for _, body in spool.peek()]
    assert [b.seq for b in sealed] == [seq] and spool.staged() == {}
    assert sealed[0].intervals == good and [c.queries for c in sealed[0].query_counts] == [7]
    assert refusals.counts() == {"out_of_range": 1}
    spool.close()


def test_a_push_interval_that_is_not_a_positive_number_is_refused(tmp_path: Path) -> None:
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(ConfigError, match="push interval"):
            cadence_agent(tmp_path, "http://127.0.0.1:9", interval_s=1.0, push_interval_s=bad)


@pytest.mark.parametrize(
    ("argv", "env"),
    [(["--push-interval", "0"], {}), (["--push-interval", "99999"], {}), ([], {"WATTWATCH_PUSH_INTERVAL": "0.01"})],
)
def test_the_cli_refuses_a_bad_push_interval_in_one_line(tmp_path: Path, argv: list[str], env: dict[str, str]) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "wattwatch.cli.main", "agent", "--simulate", "1", *argv],
        env={**_env(), "WATTWATCH_HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "push interval" in lines[0] and "0.1 to 3600" in lines[0], out.stderr


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
