"""A spool that cannot be written (its disk full): the outbox keeps what it took in memory, in order and
within its bound, drops the oldest past it and sends their time as ``gap`` intervals, and says so once.

The full disk is SQLite's own: ``PRAGMA max_page_count`` set to the file's page count, so every write that
needs a page more fails with SQLITE_FULL ("database or disk is full"), as on a full file system; raising
it is space coming back. ENOSPC from the file system is injected where SQLite would not raise it."""

from __future__ import annotations

import errno
import logging
import sqlite3
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from procs import wait_for
from test_agent_metrics import scrape, value
from wattwatch.agent import held
from wattwatch.agent.held import GAP, Dropped
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.push import Pusher
from wattwatch.agent.push_cadence import PushCadence
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import SPOOL_FILE, Spool, disk_full
from wattwatch.cli.doctor import describe_agent_spool
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor, resolve_visible
from wattwatch.sim.fleet import SimulatedFleet

DEVICES = [wire.Device(key="gpu0", kind="gpu"), wire.Device(key="cpu0", kind="cpu")]
TICK_S = 1.0


class Disk:
    """The spool file's room: ``fill()`` lets it grow no more, ``free()`` gives space back."""

    def __init__(self, spool: Spool) -> None:
        self.spool = spool

    def fill(self) -> None:
        db = self.spool._db
        db.execute("CREATE TABLE IF NOT EXISTS filler (b BLOB)")
        db.execute(f"PRAGMA max_page_count = {db.execute('PRAGMA page_count').fetchone()[0]}")
        # Fill the free room of the file's last pages too: from here on no write fits.
        for size in (4096, 1024, 256, 64, 16, 1):
            try:
                while True:
                    db.execute("INSERT INTO filler VALUES (zeroblob(?))", (size,))
            except sqlite3.OperationalError as exc:
                assert disk_full(exc)

    def free(self) -> None:
        self.spool._db.execute("PRAGMA max_page_count = 1073741823")


# Jobs with long ids sharing every device: a tick's records take more than a 4 kB page, so writing even one
# tick needs a page more (an overflow page), which a full file cannot give.
HOLDERS = {f"job-{k}-" + "x" * 190: 1.0 for k in range(12)}


def ticks(start_s: float, n: int) -> list[list[wire.Interval]]:
    """``n`` ticks of one interval per device each, 1 s long, held by ``HOLDERS``."""
    out = []
    for i in range(n):
        t0 = start_s + i * TICK_S
        out.append([wire.Interval(d.key, t0, t0 + TICK_S, 100.0 + i, "counter", shares=HOLDERS) for d in DEVICES])
    return out


@pytest.fixture
def parts(tmp_path: Path) -> tuple[Spool, Disk, Outbox, PushCadence]:
    spool = Spool(tmp_path / "spool.db")
    outbox = Outbox(spool, "agent-1", "host-1", lambda: DEVICES, time.time, max_held_intervals=20)
    pusher = Pusher(spool, "http://127.0.0.1:9")
    cadence = PushCadence(outbox, pusher, spool, "http://127.0.0.1:9", push_interval_s=5.0, interval_s=TICK_S)
    yield spool, Disk(spool), outbox, cadence
    pusher.close()
    spool.close()


def sealed_intervals(spool: Spool) -> list[wire.Interval]:
    """Every interval of every queued batch, in seq order."""
    return [iv for _, body in spool.peek(limit=1000) for iv in wire.decode_batch(body).intervals]


def measured(intervals: list[wire.Interval]) -> list[wire.Interval]:
    return [iv for iv in intervals if GAP not in iv.flags]


def test_a_failed_stage_and_seal_put_the_records_back_in_order(parts: tuple[Spool, Disk, Outbox, PushCadence]) -> None:
    spool, disk, outbox, cadence = parts
    now_s = time.time() - 100
    batches = ticks(now_s, 8)
    outbox.add(intervals=batches[0])
    assert cadence.stage() is not None  # a part of the next batch, in the spool
    disk.fill()
    for batch in batches[1:6]:
        outbox.add(intervals=batch)
        assert cadence.stage() is None  # nothing written: it waits in memory
    outbox.add(intervals=batches[6])
    assert cadence.seal() is None and spool.pending() == 0
    assert outbox.held() == (12, 0) and outbox.unwritable == "database or disk is full"
    disk.free()
    outbox.add(intervals=batches[7])
    seq = cadence.seal()
    assert seq is not None and outbox.held() == (0, 0) and outbox.unwritable == ""
    # Every interval once, in the order it was added: the staged part's, then those held through the outage.
    assert sealed_intervals(spool) == [iv for batch in batches for iv in batch]
    assert outbox.dropped.intervals == 0


def test_past_the_bound_the_oldest_are_dropped_counted_and_sent_as_gaps_covering_exactly_their_time(
    parts: tuple[Spool, Disk, Outbox, PushCadence],
) -> None:
    spool, disk, outbox, cadence = parts
    now_s = time.time() - 100
    batches = ticks(now_s, 25)  # 50 intervals through a full disk, 20 held at most
    disk.fill()
    for batch in batches:
        outbox.add(intervals=batch)
        cadence.stage()
        assert outbox.held()[0] <= outbox.max_held_intervals
    assert outbox.held() == (20, 0) and outbox.dropped.intervals == 30
    disk.free()
    assert cadence.seal() is not None
    sent = sealed_intervals(spool)
    kept = [iv for batch in batches[15:] for iv in batch]
    assert measured(sent) == kept  # the newest 20, in order
    gaps = {iv.device: iv for iv in sent if GAP in iv.flags}
    assert set(gaps) == {"gpu0", "cpu0"} and len(sent) == len(kept) + 2
    for key, gap in gaps.items():
        # Exactly the 15 dropped ticks of the device: from the first's start to the first kept one's start.
        assert (gap.t_start_s, gap.t_end_s) == (now_s, now_s + 15 * TICK_S)
        assert gap.energy_j == 0.0 and gap.flags == [GAP] and gap.shares == HOLDERS
        assert gap.t_end_s == min(iv.t_start_s for iv in kept if iv.device == key)
    # Nothing more is owed: the next seal sends no gap again.
    outbox.add(intervals=ticks(now_s + 25, 1)[0])
    assert cadence.seal() is not None
    assert sum(GAP in iv.flags for iv in sealed_intervals(spool)) == 2


def test_a_gap_waiting_for_a_write_that_fails_again_is_kept_not_counted_twice(
    parts: tuple[Spool, Disk, Outbox, PushCadence],
) -> None:
    spool, disk, outbox, cadence = parts
    now_s = time.time() - 100
    batches = ticks(now_s, 40)
    disk.fill()
    for batch in batches[:15]:  # 10 ticks dropped
        outbox.add(intervals=batch)
        cadence.stage()
    # A write takes the gaps with what is held and fails: they come back first, the oldest records.
    assert cadence.seal() is None
    for batch in batches[15:]:
        outbox.add(intervals=batch)
        cadence.stage()
    assert outbox.dropped.intervals == 60  # measured intervals only: the gaps dropped again are no more
    disk.free()
    assert cadence.stage() is not None and cadence.seal() is not None
    sent = sealed_intervals(spool)
    assert measured(sent) == [iv for batch in batches[30:] for iv in batch]
    gaps = sorted((iv.device, iv.t_start_s, iv.t_end_s) for iv in sent if GAP in iv.flags)
    assert gaps == [("cpu0", now_s, now_s + 30 * TICK_S), ("gpu0", now_s, now_s + 30 * TICK_S)]


def test_dropped_spans_merge_only_where_they_touch() -> None:
    dropped = Dropped()
    a = wire.Interval("gpu0", 10.0, 11.0, 5.0, "counter", shares={"a": 1.0})
    b = wire.Interval("gpu0", 12.0, 13.0, 5.0, "counter", shares={"b": 1.0})
    c = wire.Interval("gpu0", 11.0, 12.0, 5.0, "counter")
    dropped.add([a, b])  # a kept interval lies between them: two spans, not one over it
    assert dropped.dropped_s() == 2.0
    dropped.add([c])  # the one between is dropped too: one span
    (gap,) = dropped.take()
    assert (gap.t_start_s, gap.t_end_s, gap.shares) == (10.0, 13.0, {"a": 1.0, "b": 1.0})
    assert dropped.intervals == 3 and not dropped and dropped.take() == []


def test_one_warning_when_it_cannot_write_and_one_info_when_it_can_again(
    parts: tuple[Spool, Disk, Outbox, PushCadence], caplog: pytest.LogCaptureFixture
) -> None:
    _spool, disk, outbox, cadence = parts
    now_s = time.time() - 100
    caplog.set_level(logging.INFO, logger="wattwatch")
    disk.fill()
    for batch in ticks(now_s, 30):
        outbox.add(intervals=batch)
        cadence.stage()
    assert cadence.seal() is None
    disk.free()
    assert cadence.stage() is not None and cadence.seal() is not None
    said = [(r.levelno, r.getMessage()) for r in caplog.records if "spool" in r.getMessage()]
    assert [level for level, _ in said] == [logging.WARNING, logging.INFO], said
    assert "database or disk is full" in said[0][1] and "free space" in said[0][1]
    assert "wrote the 20 interval(s) held in memory; 40 interval(s) were dropped" in said[1][1]
    assert not any(r.exc_info for r in caplog.records)  # no traceback


def test_an_error_that_is_not_a_full_disk_is_raised_and_loses_nothing(
    parts: tuple[Spool, Disk, Outbox, PushCadence], monkeypatch: pytest.MonkeyPatch
) -> None:
    spool, _disk, outbox, cadence = parts
    batch = ticks(time.time() - 100, 1)[0]
    outbox.add(intervals=batch)

    def locked(*args: object, **kwargs: object) -> int:
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(spool, "stage_new", locked)
    with pytest.raises(sqlite3.OperationalError, match="locked"):
        cadence.stage()
    assert outbox.held() == (2, 0) and outbox.unwritable == ""
    monkeypatch.undo()
    assert cadence.seal() is not None and sealed_intervals(spool) == batch


def test_enospc_from_the_file_system_is_a_full_disk(
    parts: tuple[Spool, Disk, Outbox, PushCadence], monkeypatch: pytest.MonkeyPatch
) -> None:
    spool, _disk, outbox, cadence = parts
    batch = ticks(time.time() - 100, 1)[0]
    outbox.add(intervals=batch)

    def no_space(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(spool, "seal", no_space)
    assert cadence.seal() is None and outbox.held() == (2, 0) and "No space left" in outbox.unwritable
    monkeypatch.undo()
    assert cadence.seal() is not None and sealed_intervals(spool) == batch
    assert disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    assert not disk_full(OSError(errno.EACCES, "Permission denied"))
    assert not disk_full(sqlite3.OperationalError("database is locked"))


def test_spans_past_their_bound_are_dropped_oldest_first_and_counted(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "spool.db")
    outbox = Outbox(spool, "agent-1", "host-1", lambda: DEVICES, time.time, max_held_spans=5)
    now_s = time.time() - 100
    spans = [wire.Query(job="j1", t_start_s=now_s + i, t_end_s=now_s + i + 0.5) for i in range(8)]
    outbox.add(queries=spans)
    assert outbox.held() == (0, 5) and outbox.dropped_spans == 3
    assert outbox.seal() is not None
    (body,) = [b for _, b in spool.peek()]
    assert wire.decode_batch(body).queries == spans[3:]
    spool.close()


def sim_agent(home: Path, fleet: SimulatedFleet) -> Agent:
    """An agent on ``fleet`` through the NVML sensor, serving its socket; it ticks only when told."""
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=home, collector_url="http://127.0.0.1:9", interval_s=3600, push_interval_s=3600)
    return Agent(
        settings, [sensor], gpu_processes=sensor, resolve_visible=resolve_visible, options=AgentOptions(discover=False)
    )


def test_the_agent_counts_what_it_dropped_on_metrics_its_ping_and_doctor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(held, "MAX_HELD_INTERVALS", 3)  # read when the agent's outbox is made
    # The agent's spool file made with 512-byte pages first: a tick's part (an interval and the checkpoint)
    # takes more than one, so every stage needs a page more, which the full file cannot give.
    made = sqlite3.connect(tmp_path / SPOOL_FILE)
    made.execute("PRAGMA page_size = 512")
    made.execute("PRAGMA journal_mode = WAL")
    made.close()
    fleet = SimulatedFleet(1, seed=3)
    agent = sim_agent(tmp_path, fleet)
    settings = agent.settings
    agent.start()
    try:
        disk = Disk(agent.spool)
        disk.fill()
        for _ in range(8):
            time.sleep(0.02)
            assert agent.tick(stage=True)
        dropped = value(scrape(agent), "wattwatch_agent_dropped_intervals_total", host=agent.host)
        assert dropped == agent.outbox.dropped.intervals >= 3
        state = agent.handle({"op": "ping"})["spool"]
        assert state["unwritable"] == "database or disk is full" and state["held_intervals"] == 3
        assert state["dropped_intervals"] == dropped
        lines, problems = describe_agent_spool(settings.socket_path)
        assert problems == 1 and "CANNOT WRITE its spool (database or disk is full)" in lines[0], lines
        assert f"{int(dropped)} interval(s) dropped since it started" in lines[0] and "free space" in lines[1]
        disk.free()
        assert agent.tick(stage=True)  # its interval joins the 3 held first: one more dropped, then all written
        total = agent.outbox.dropped.intervals
        assert total == dropped + 1 and agent.outbox.held() == (0, 0)
        lines, problems = describe_agent_spool(settings.socket_path)
        assert problems == 0 and lines == [
            f"ok    agent          the running agent writes its spool; {total} interval(s) dropped since it "
            "started (their time is sent as gap intervals: reports show it as not measured)"
        ]
    finally:
        agent.stop(flush_timeout_s=0.1)
    assert describe_agent_spool(settings.socket_path) == ([], 0)  # no agent there: nothing to say


def test_an_agent_starting_on_a_full_disk_runs_and_the_next_start_seals_what_was_left_staged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wattwatch")
    fleet = SimulatedFleet(1, seed=3)
    # The agent before this one staged a part and was killed before it sealed it.
    spool = Spool(tmp_path / SPOOL_FILE)
    crashed = Outbox(spool, "agent-1", "host-1", lambda: DEVICES, time.time)
    left = ticks(time.time() - 100, 2)
    crashed.add(intervals=[iv for batch in left for iv in batch])
    seq = crashed.stage()
    spool.close()
    agent = sim_agent(tmp_path, fleet)
    disk = Disk(agent.spool)
    disk.fill()
    agent.start()  # the left part cannot be sealed now: it stays staged, and the agent measures on
    try:
        assert agent.outbox.unwritable == "database or disk is full"
        assert agent.tick(stage=True)
        disk.free()
        assert agent.tick(stage=True) and agent.outbox.unwritable == ""
    finally:
        agent.stop(flush_timeout_s=0.1)
    spool = Spool(tmp_path / SPOOL_FILE)
    assert list(spool.staged()) == [seq]
    spool.close()
    again = sim_agent(tmp_path, fleet)
    again.start()
    again.stop(flush_timeout_s=0.1)
    spool = Spool(tmp_path / SPOOL_FILE)
    try:
        assert spool.staged() == {}
        (recovered,) = [b for b in (wire.decode_batch(body) for _, body in spool.peek(limit=100)) if b.seq == seq]
        assert recovered.intervals == [iv for batch in left for iv in batch]
    finally:
        spool.close()
    assert not any(r.exc_info for r in caplog.records)


def test_an_acknowledgement_that_cannot_be_written_is_said_once_and_the_batch_goes_again(
    tmp_path: Path, db_engine: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="wattwatch")
    app = create_app(Settings(home=tmp_path / "c"), db_engine, span_energy_interval_s=None)
    spool = Spool(tmp_path / SPOOL_FILE)
    outbox = Outbox(spool, "agent-1", "host-1", lambda: DEVICES, time.time)
    with TestClient(app) as client:
        pusher = Pusher(spool, "http://testserver", client=client)
        cadence = PushCadence(outbox, pusher, spool, "http://testserver", push_interval_s=3600.0, interval_s=TICK_S)
        outbox.add(intervals=ticks(time.time() - 100, 1)[0])
        seq = cadence.seal()
        acks: list[int] = []

        def full(seq: int) -> None:
            acks.append(seq)
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(spool, "ack", full)
        cadence.start()
        try:
            for round_n in range(1, 4):  # three rounds, each stored by the collector and not forgotten here
                cadence.push_soon()
                wait_for(lambda n=round_n: len(acks) >= n, 10, "the push to land")
            assert outbox.unwritable == "database or disk is full" and spool.pending() == 1
            monkeypatch.undo()
            outbox.add(intervals=ticks(time.time() - 99, 1)[0])
            assert cadence.stage() is not None and outbox.unwritable == ""
            cadence.push_soon()
            wait_for(lambda: spool.pending() == 0, 10, "the batch to be acknowledged")
        finally:
            cadence.stop(5.0)
            pusher.close()
    spool.close()
    assert acks == [seq, seq, seq]
    said = [r for r in caplog.records if "spool" in r.getMessage() and r.name.startswith("wattwatch.agent")]
    assert [r.levelno for r in said] == [logging.WARNING, logging.INFO], [r.getMessage() for r in said]
    assert not any(r.exc_info for r in caplog.records)


def test_a_spool_write_on_a_full_disk_rolls_back_whole_and_raises_sqlites_own_error(tmp_path: Path) -> None:
    spool = Spool(tmp_path / SPOOL_FILE)
    disk = Disk(spool)
    disk.fill()
    for write in (
        lambda: spool.seal(None, lambda seq: b"x" * 5000, created_s=1.0),
        lambda: spool.stage_new(lambda seq: (b"x" * 5000, 1.0)),
        lambda: spool.put(0, b"x" * 5000, 1.0),
    ):
        with pytest.raises(sqlite3.OperationalError) as raised:
            write()
        # SQLite rolled the transaction back itself: the error is its own, not "no transaction is active".
        assert disk_full(raised.value) and "disk is full" in str(raised.value)
    disk.free()
    assert spool.pending() == 0 and spool.staged() == {}
    assert spool.seal(None, lambda seq: b"y", created_s=1.0) == 0  # no seq was used up by the failed writes
    spool.close()
