"""Poison batches through real processes: a `wattwatch agent` whose spool holds 20 batches, one of which a
real collector (on SQLite) refuses (422) or fails (500), while the others must land within a minute; the
refused one is set aside with its reason, counted on the agent's /metrics, shown by `wattwatch doctor`
and put back by `wattwatch spool requeue`. A wrong token sets nothing aside."""

from __future__ import annotations

import gzip
import json
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import select

from procs import WATTWATCH, free_port, wait_for
from test_agent_metrics import value
from test_auth_e2e import env_for, run
from wattwatch.agent.spool import SPOOL_FILE, Spool
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.storage.engine import make_engine
from wattwatch.storage.tables import ingested_batches

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # faults: agents whose batches fail for tens of seconds

HOST = "poison-host"
AGENT_ID = "poison-agent-0001"
N_BATCHES = 20
POISON_SEQ = 6  # the 7th batch of 20
LAND_WITHIN_S = 60.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def fill_spool(home: Path, *, poison: bool) -> None:
    """Batches 0..19 of agent AGENT_ID on HOST, a 1 s interval of 10 J on gpu0 each, as an agent that could
    not reach its collector would leave them; with ``poison``, batch 6 carries a field no wire struct has."""
    spool = Spool(home / SPOOL_FILE)
    spool.set_meta("agent_id", AGENT_ID)
    start_s = time.time() - 120.0
    device = wire.Device(key="gpu0", kind="gpu", index=0, uuid="GPU-poison-0", model="H100")
    for _ in range(N_BATCHES):
        seq = spool.next_seq()
        t_s = start_s + seq
        interval = wire.Interval(device="gpu0", t_start_s=t_s, t_end_s=t_s + 1.0, energy_j=10.0, shares={},
                                 source="counter")  # fmt: skip
        batch = wire.Batch(agent_id=AGENT_ID, host=HOST, seq=seq, sent_at_s=t_s + 1.0, devices=[device],
                           intervals=[interval])  # fmt: skip
        body = wire.encode(batch)
        if poison and seq == POISON_SEQ:
            record = json.loads(body)
            record["intervals"][0]["bogus"] = 1  # wire structs forbid unknown fields: 422
            body = json.dumps(record).encode()
        spool.put(seq, body, t_s)
    spool.close()


def stored_seqs(db_url: str) -> set[int]:
    """The seqs of AGENT_ID the collector stored."""
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(select(ingested_batches.c.seq).where(ingested_batches.c.agent_id == AGENT_ID))
            return {int(seq) for seq in rows.scalars()}
    finally:
        engine.dispose()


def spool_state(home: Path) -> tuple[int, list[Any]]:
    """(batches queued, set-aside batches) of the agent's spool, read while the agent runs."""
    spool = Spool(home / SPOOL_FILE)
    try:
        return spool.pending(), spool.set_aside_batches()
    finally:
        spool.close()


@dataclass
class AgentProc:
    proc: subprocess.Popen[bytes]
    log: Path

    def stop(self) -> str:
        """SIGTERM (the agent flushes and exits); its log."""
        end(self.proc)
        return self.log.read_text()


def end(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def start_agent(home: Path, collector_url: str, metrics_port: int, **env: str) -> AgentProc:
    """`wattwatch agent` on one simulated GPU, pushing the spool under ``home``; logs to a file."""
    cmd = [*WATTWATCH, "agent", "--simulate", "1", "--host", HOST, "--collector", collector_url, "--interval", "0.5",
           "--metrics-listen", f"127.0.0.1:{metrics_port}"]  # fmt: skip
    log = home.parent / f"agent-{time.monotonic_ns()}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=env_for(home, **env), stdout=out, stderr=subprocess.STDOUT)
    return AgentProc(proc, log)


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture
def collector_proc(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[str, Callable[..., str]]]:
    """Starts `wattwatch collector` on SQLite (with ``--token`` when given); yields its URL maker."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(*extra: str) -> str:
        port = free_port()
        with (tmp_path / f"collector-{port}.log").open("wb") as out:
            proc = subprocess.Popen(
                [*WATTWATCH, "collector", "--db", sqlite_url, "--listen", f"127.0.0.1:{port}", "--open", *extra],
                env=env_for(tmp_path / "collector"),
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: proc.poll() is None and ready(url), 60, "the collector to be ready")
        return url

    yield sqlite_url, start
    for proc in procs:
        end(proc)


def test_a_poison_batch_in_the_middle_of_a_spool_is_set_aside_and_the_others_land(
    collector_proc: tuple[str, Callable[..., str]], tmp_path: Path
) -> None:
    db_url, start_collector = collector_proc
    url = start_collector()
    home = tmp_path / "agent"
    fill_spool(home, poison=True)
    metrics_port = free_port()
    started_s = time.monotonic()
    agent = start_agent(home, url, metrics_port)
    try:
        others = set(range(N_BATCHES)) - {POISON_SEQ}
        wait_for(lambda: others <= stored_seqs(db_url), LAND_WITHIN_S, "the 19 good batches to land")
        landed_s = time.monotonic() - started_s
        wait_for(lambda: len(spool_state(home)[1]) == 1, 10, "the poison batch to be set aside")
        assert POISON_SEQ not in stored_seqs(db_url)
        (aside,) = spool_state(home)[1]
        assert aside.seq == POISON_SEQ and aside.reason["reason"] == "rejected" and aside.reason["status"] == 422
        assert aside.reason["field"] == "intervals[0].bogus" and "bogus" in aside.reason["error"]
        assert aside.reason["attempts"] == 1 and aside.reason["set_aside_at"].endswith("+00:00")
        text = scrape(metrics_port)
        assert value(text, "wattwatch_agent_batches_set_aside_total", host=HOST, reason="rejected") == 1
        assert value(text, "wattwatch_agent_batches_set_aside_total", host=HOST, reason="repeated_failure") == 0
        assert value(text, "wattwatch_agent_spool_dead_batches", host=HOST) == 1
        doctor = run(["doctor", "--simulate", "1"], env_for(home))
        assert doctor.returncode == 1, doctor.stdout + doctor.stderr  # something to fix
        assert "1 batch(es) SET ASIDE" in doctor.stdout
        assert f"seq {POISON_SEQ}: rejected, HTTP 422 on intervals[0].bogus" in doctor.stdout
        assert "wattwatch spool requeue --all" in doctor.stdout
        listed = run(["spool", "list", "--format", "json"], env_for(home))
        assert [(b["seq"], b["status"]) for b in json.loads(listed.stdout)] == [(POISON_SEQ, 422)]
        shown = run(["spool", "show", str(POISON_SEQ)], env_for(home))
        assert json.loads(shown.stdout)["intervals"][0]["bogus"] == 1  # the batch as it was sent, for a bug report
    finally:
        out = agent.stop()
    assert landed_s < LAND_WITHIN_S
    refusals = [line for line in out.splitlines() if f"batch {POISON_SEQ} set aside (rejected)" in line]
    assert len(refusals) == 1 and " ERROR " in refusals[0], out  # loud, once
    print(f"19 good batches behind a poison one landed {landed_s:.1f} s after the agent started")


class FailOneSeq:
    """ASGI middleware in front of the real collector app: while ``broken``, answers 500 to batch ``seq``
    (a collector bug that batch triggers); everything else reaches the app untouched."""

    def __init__(self, app: Any, seq: int) -> None:
        self.app = app
        self.seq = seq
        self.broken = True
        self.failed = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != "/api/v1/ingest":
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = bool(message.get("more_body", False))
        body = b"".join(chunks)
        if self.broken and json.loads(gzip.decompress(body))["seq"] == self.seq:
            self.failed += 1
            reply = b'{"error": "injected failure", "field": null}'
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(reply)).encode())]
            await send({"type": "http.response.start", "status": 500, "headers": headers})
            await send({"type": "http.response.body", "body": reply})
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


@pytest.fixture
def failing_collector(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[str, str, FailOneSeq]]:
    """The real collector app on SQLite behind FailOneSeq, served by uvicorn on a loopback port."""
    import uvicorn

    engine = make_engine(sqlite_url)
    gate = FailOneSeq(create_app(Settings(home=tmp_path / "c"), engine, span_energy_interval_s=None), POISON_SEQ)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(gate, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started, 30, "uvicorn to start")
    try:
        yield sqlite_url, f"http://127.0.0.1:{port}", gate
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        engine.dispose()


def test_a_batch_failing_with_500_is_set_aside_after_n_then_requeued_once_fixed(
    failing_collector: tuple[str, str, FailOneSeq], tmp_path: Path
) -> None:
    db_url, url, gate = failing_collector
    home = tmp_path / "agent"
    fill_spool(home, poison=False)
    metrics_port = free_port()
    started_s = time.monotonic()
    agent = start_agent(home, url, metrics_port, WATTWATCH_POISON_AFTER="3")
    try:
        others = set(range(N_BATCHES)) - {POISON_SEQ}
        wait_for(lambda: others <= stored_seqs(db_url), LAND_WITHIN_S, "the 19 other batches to land")
        landed_s = time.monotonic() - started_s
        wait_for(lambda: len(spool_state(home)[1]) == 1, LAND_WITHIN_S, "the failing batch to be set aside")
        aside_s = time.monotonic() - started_s
        (aside,) = spool_state(home)[1]
        assert aside.seq == POISON_SEQ and aside.reason["reason"] == "repeated_failure"
        assert aside.reason["status"] == 500 and aside.reason["error"] == "injected failure"
        assert aside.reason["attempts"] == gate.failed >= 3  # each try recorded; strikes needed later landings
        text = scrape(metrics_port)
        assert value(text, "wattwatch_agent_batches_set_aside_total", host=HOST, reason="repeated_failure") == 1
        failed_before = gate.failed
        # The agent keeps sealing batches: none of them is held up, and the set-aside one is not retried.
        newest = max(stored_seqs(db_url))
        wait_for(lambda: max(stored_seqs(db_url)) >= newest + 3, 30, "newer batches to land")
        assert gate.failed == failed_before and POISON_SEQ not in stored_seqs(db_url)
        # The collector is fixed; the operator requeues the batch while the agent runs.
        gate.broken = False
        requeued = run(["spool", "requeue", str(POISON_SEQ)], env_for(home))
        assert requeued.returncode == 0 and "1 batch(es) back in the queue" in requeued.stdout, requeued.stderr
        wait_for(lambda: POISON_SEQ in stored_seqs(db_url), 30, "the requeued batch to land")
        assert spool_state(home)[1] == []
        doctor = run(["doctor", "--simulate", "1"], env_for(home))
        assert "none set aside" in doctor.stdout and doctor.returncode == 0, doctor.stdout
    finally:
        out = agent.stop()
    assert landed_s < LAND_WITHIN_S
    assert len([line for line in out.splitlines() if "set aside (repeated_failure)" in line]) == 1, out
    print(f"19 batches landed in {landed_s:.1f} s; the failing one was set aside after {aside_s:.1f} s")


def test_a_wrong_token_sets_nothing_aside_and_the_right_one_lands_everything(
    collector_proc: tuple[str, Callable[..., str]], tmp_path: Path
) -> None:
    db_url, start_collector = collector_proc
    url = start_collector("--token", "the-right-token")
    home = tmp_path / "agent"
    fill_spool(home, poison=False)
    metrics_port = free_port()
    agent = start_agent(home, url, metrics_port, WATTWATCH_TOKEN="a-wrong-token", WATTWATCH_POISON_AFTER="1")

    def refused_rounds() -> float:
        try:
            return value(scrape(metrics_port), "wattwatch_agent_push_failures_total", host=HOST)
        except httpx.HTTPError:
            return 0.0

    try:
        wait_for(lambda: refused_rounds() >= 4, 60, "four refused rounds")
        pending, aside = spool_state(home)
        assert aside == [] and pending >= N_BATCHES
        assert stored_seqs(db_url) == set()
    finally:
        out = agent.stop()
    # Logged at ERROR; the stop's own summary (not a log line) repeats the reason and says nothing is lost.
    said = [line for line in out.splitlines() if "refused our token (HTTP 401" in line]
    errors = [line for line in said if not line.startswith("wattwatch agent:")]
    assert errors and all(" ERROR " in line for line in errors), out
    assert all("nothing is lost" in line for line in said if line.startswith("wattwatch agent:")), out
    assert "set aside (" not in out
    agent = start_agent(home, url, metrics_port, WATTWATCH_TOKEN="the-right-token")
    try:
        wait_for(lambda: set(range(N_BATCHES)) <= stored_seqs(db_url), LAND_WITHIN_S, "every batch to land")
    finally:
        agent.stop()
    assert spool_state(home)[1] == []
