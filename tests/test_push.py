"""The pusher against a real HTTP server on loopback that answers as scripted, per batch: order, backoff,
and poison batches (agent.poison) set aside with their reason while the batches behind them flow on."""

from __future__ import annotations

import gzip
import json
import logging
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from wattwatch.agent.poison import (
    DEFAULT_POISON_AFTER,
    REASONS,
    Verdict,
    verdict_of,
)
from wattwatch.agent.push import BACKOFF_JITTER, Pusher
from wattwatch.agent.spool import Spool
from wattwatch.config import load_settings
from wattwatch.errors import ConfigError
from wattwatch.sim.clock import FakeClock

DROP = -1  # answer nothing: close the connection once the request was read (a reset after sending)


class Scripted:
    """Answers 200 unless ``answer(seq)`` says otherwise; records every request's seq."""

    def __init__(self) -> None:
        self.answer: Callable[[int], int] = lambda seq: 200
        self.seqs: list[int] = []
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []
        self.retry_after = ""


@pytest.fixture
def server() -> Iterator[tuple[str, Scripted]]:
    script = Scripted()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the collector (uvicorn) does
        wbufsize = -1  # the reply in one write: no delayed-ACK stall between headers and body

        def do_POST(self) -> None:
            body = gzip.decompress(self.rfile.read(int(self.headers["Content-Length"])))
            script.bodies.append(body)
            script.headers.append(dict(self.headers))
            seq = int(json.loads(body)["seq"])
            script.seqs.append(seq)
            status = script.answer(seq)
            if status == DROP:
                self.close_connection = True
                return
            reply = json.dumps({"error": f"scripted {status}", "field": "intervals[0].energy_j"}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            if script.retry_after:
                self.send_header("Retry-After", script.retry_after)
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", script
    httpd.shutdown()
    httpd.server_close()


def fill(spool: Spool, n: int) -> list[int]:
    seqs = []
    for _ in range(n):
        seq = spool.next_seq()
        spool.put(seq, f'{{"seq": {seq}}}'.encode(), 0.0)
        seqs.append(seq)
    return seqs


def queued(spool: Spool) -> list[int]:
    return [seq for seq, _ in spool.peek(limit=1000)]


def test_pushes_in_order_gzipped_with_token_and_acks(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    pusher = Pusher(spool, url, token="s3cret")
    assert pusher.push_pending() is True
    assert script.bodies == [b'{"seq": 0}', b'{"seq": 1}', b'{"seq": 2}']
    assert script.headers[0]["Authorization"] == "Bearer s3cret"
    assert spool.pending() == 0


def test_server_errors_on_every_batch_keep_them_all_and_back_off(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock)
    script.answer = lambda seq: 503
    assert pusher.push_pending() is False
    assert script.seqs == [0, 1]  # the next batch is tried too: is it the batch or the collector?
    assert pusher.push_pending() is False  # the collector: backing off, nothing sent
    assert len(script.seqs) == 2
    assert pusher.suspects.tries(0).strikes == 0 and spool.dead() == 0
    script.answer = lambda seq: 200
    clock.t_s += 60
    assert pusher.push_pending() is True
    assert spool.pending() == 0


def test_a_refused_batch_is_set_aside_at_once_with_its_reason_and_the_rest_flows(
    server: tuple[str, Scripted], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    script.answer = lambda seq: 422 if seq == 1 else 200
    pusher = Pusher(spool, url, wall_clock=lambda: 1_700_000_000.0)
    with caplog.at_level(logging.ERROR, logger="wattwatch.agent.push"):
        assert pusher.push_pending() is True
    assert script.seqs == [0, 1, 2]  # tried once, never again
    assert spool.pending() == 0 and spool.dead() == 1
    assert pusher.stats.refused == 1 and pusher.stats.set_aside == {"rejected": 1, "key_conflict": 0,
                                                                     "repeated_failure": 0}  # fmt: skip
    (batch,) = spool.set_aside_batches()
    assert batch.seq == 1 and spool.set_aside_body(1) == b'{"seq": 1}'
    assert batch.reason["reason"] == "rejected" and batch.reason["status"] == 422
    assert batch.reason["error"] == "scripted 422" and batch.reason["field"] == "intervals[0].energy_j"
    assert batch.reason["attempts"] == 1 and batch.reason["set_aside_at_s"] == 1_700_000_000.0
    assert (
        batch.reason["set_aside_at"] == "2023-11-14T22:13:20+00:00"
        and batch.reason["collector"] == url + "/api/v1/ingest"
    )
    (error,) = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert "batch 1 set aside (rejected): the collector refused it for good" in error
    assert "HTTP 422 on intervals[0].energy_j: scripted 422" in error and "`wattwatch spool requeue 1`" in error


def test_a_batch_failing_while_later_ones_land_is_set_aside_after_n_strikes(
    server: tuple[str, Scripted], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    script.answer = lambda seq: 500 if seq == 1 else 200
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock, poison_after=3)
    with caplog.at_level(logging.WARNING, logger="wattwatch.agent.push"):
        assert pusher.push_pending() is True  # 1 failed, 2 landed after it: strike 1; the rest flowed
        assert queued(spool) == [1] and pusher.suspects.tries(1).strikes == 1
        assert pusher.push_pending() is True  # batch 1 waits for its own retry time: nothing is sent
        assert script.seqs == [0, 1, 2]
        clock.t_s += 60
        assert pusher.push_pending() is False  # alone, its failure proves nothing: no strike, the round backs off
        assert pusher.suspects.tries(1).strikes == 1
        for n in (2, 3):
            clock.t_s += 60
            fill(spool, 1)  # the agent seals a batch every push interval
            assert pusher.push_pending() is True
            assert pusher.suspects.tries(1).strikes == (n if n < 3 else 0)
    assert spool.pending() == 0 and spool.dead() == 1
    (batch,) = spool.set_aside_batches()
    assert (batch.seq, batch.reason["reason"], batch.reason["status"]) == (1, "repeated_failure", 500)
    assert batch.reason["attempts"] == 4  # three strikes and the lone failure
    assert pusher.stats.set_aside["repeated_failure"] == 1
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "batch 1 set aside (repeated_failure)" in errors[0] and "HTTP 500" in errors[0]


def test_an_outage_of_the_collector_sets_nothing_aside(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 20)
    script.answer = lambda seq: 503
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock, poison_after=1)
    for _ in range(10):
        clock.t_s += 60
        fill(spool, 1)
        assert pusher.push_pending() is False
    assert spool.dead() == 0 and spool.pending() == 30
    assert len(script.seqs) == 10 * 8  # each round gives up after 8 failures in a row
    script.answer = lambda seq: 200
    clock.t_s += 60
    assert pusher.push_pending() is True and spool.pending() == 0 and spool.dead() == 0


def test_a_refused_token_never_sets_anything_aside_and_is_loud(
    server: tuple[str, Scripted], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    script.answer = lambda seq: 401
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock, token="wrong", poison_after=1)
    with caplog.at_level(logging.ERROR, logger="wattwatch.agent.push"):
        for _ in range(5):
            assert pusher.push_pending() is False
            clock.t_s += 31
    assert spool.pending() == 3 and spool.dead() == 0
    assert script.seqs == [0] * 5  # the round stops at the first: every batch would get the same answer
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 3  # at 0, 62 and 124 s: once a minute
    assert "refused our token (HTTP 401" in errors[0] and "nothing is set aside" in errors[0]


def test_429_and_a_wrong_url_set_nothing_aside(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock, poison_after=1)
    script.answer, script.retry_after = (lambda seq: 429), "7"
    assert pusher.push_pending() is False
    clock.t_s += 6.9
    assert pusher.push_pending() is False and script.seqs == [0]  # Retry-After: 7 s is honoured
    script.answer, script.retry_after = (lambda seq: 404), ""
    clock.t_s = 7 * (1 + BACKOFF_JITTER)  # the longest the jitter can stretch it
    assert pusher.push_pending() is False
    assert "is --collector the collector's URL?" in pusher.stats.last_error
    assert spool.dead() == 0 and spool.pending() == 2


def test_a_busy_collectors_503_is_waited_out_with_jitter_and_sets_nothing_aside(
    server: tuple[str, Scripted], tmp_path: Path
) -> None:
    url, script = server
    script.answer, script.retry_after = (lambda seq: 503), "4"
    waits_s = []
    for i in range(12):
        spool = Spool(tmp_path / f"s{i}.db")
        fill(spool, 2)
        clock = FakeClock(0.0)
        pusher = Pusher(spool, url, clock=clock, poison_after=1)
        assert pusher.push_pending() is False
        assert spool.dead() == 0 and spool.pending() == 2  # the collector's state, not the batch's
        assert "HTTP 503" in pusher.stats.last_error
        seqs = len(script.seqs)
        clock.t_s = 3.99
        assert pusher.push_pending() is False and len(script.seqs) == seqs  # Retry-After honoured
        # The first moment it tries again: within [4 s, 4 s x (1 + jitter)], stepped by 10 ms.
        while len(script.seqs) == seqs:
            clock.t_s += 0.01
            pusher.push_pending()
        assert 4.0 <= clock.t_s <= 4 * (1 + BACKOFF_JITTER) + 0.01
        waits_s.append(clock.t_s)
    # Twelve agents told the same Retry-After come back spread out, not in the same 10 ms.
    assert max(waits_s) - min(waits_s) > 0.2, waits_s


def test_a_connection_dropped_after_sending_counts_like_a_5xx(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    script.answer = lambda seq: DROP if seq == 0 else 200
    pusher = Pusher(spool, url, poison_after=1)
    assert pusher.push_pending() is True
    assert script.seqs == [0, 0, 1, 2]  # a dropped connection is retried once, on a new one
    (batch,) = spool.set_aside_batches()
    assert batch.seq == 0 and batch.reason["reason"] == "repeated_failure" and batch.reason["status"] is None
    assert batch.reason["error"].startswith(
        "no answer after the request was sent (RemoteProtocolError: Server disconnected"
    )


def test_a_reset_keep_alive_connection_is_retried_at_once_and_is_no_strike(
    server: tuple[str, Scripted], tmp_path: Path
) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    dropped: list[int] = []

    def answer(seq: int) -> int:
        if seq == 1 and not dropped:
            dropped.append(seq)
            return DROP
        return 200

    script.answer = answer
    pusher = Pusher(spool, url, poison_after=1)
    assert pusher.push_pending() is True
    assert script.seqs == [0, 1, 1, 2] and spool.pending() == 0 and spool.dead() == 0


def test_requeued_batches_are_pushed_again_with_their_keys(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 4)
    script.answer = lambda seq: 422 if seq in (1, 2) else 200
    pusher = Pusher(spool, url)
    assert pusher.push_pending() is True
    assert [b.seq for b in spool.set_aside_batches()] == [2, 1]  # the latest set aside first
    assert spool.requeue([2, 99]) == [2]
    assert queued(spool) == [2] and spool.dead() == 1
    script.answer = lambda seq: 200  # the collector was fixed
    assert pusher.push_pending() is True
    assert spool.requeue() == [1]
    assert pusher.push_pending() is True
    assert script.seqs[-2:] == [2, 1] and spool.pending() == 0 and spool.dead() == 0


def test_a_reason_stored_by_an_older_agent_still_reads(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db")
    fill(spool, 1)
    spool._db.execute("INSERT INTO dead (seq, body, reason) VALUES (5, x'7b7d', 'HTTP 422: energy_j: too big')")
    (batch,) = spool.set_aside_batches()
    assert batch.reason == {"reason": "rejected", "status": 422, "error": "HTTP 422: energy_j: too big"}
    assert spool.requeue() == [5] and queued(spool) == [0, 5]


@pytest.mark.parametrize(
    ("status", "field", "verdict"),
    [
        (200, "", Verdict.LANDED),
        (204, "", Verdict.LANDED),
        (400, "", Verdict.REFUSED),
        (413, "body", Verdict.REFUSED),
        (422, "intervals[0].energy_j", Verdict.REFUSED),
        (409, "seq", Verdict.REFUSED),
        (409, "agent_id", Verdict.BLOCKED),
        (401, "Authorization", Verdict.BLOCKED),
        (403, "host", Verdict.BLOCKED),
        (404, "", Verdict.BLOCKED),
        (429, "", Verdict.BLOCKED),
        (408, "", Verdict.TRANSIENT),
        (500, "", Verdict.TRANSIENT),
        (503, "", Verdict.TRANSIENT),
        (302, "", Verdict.BLOCKED),
    ],
)
def test_verdicts(status: int, field: str, verdict: Verdict) -> None:
    assert verdict_of(status, field) is verdict


def test_poison_after_from_the_environment_and_the_command_line() -> None:
    env = {"WATTWATCH_HOME": "/nonexistent"}
    assert load_settings(env).poison_after == DEFAULT_POISON_AFTER == 5
    assert load_settings({**env, "WATTWATCH_POISON_AFTER": " 3 "}).poison_after == 3
    flag = {"poison_after": ("--poison-after 7", "7")}
    assert load_settings({**env, "WATTWATCH_POISON_AFTER": "3"}, flags=flag).poison_after == 7  # the flag wins
    assert isinstance(load_settings(env, flags=flag).poison_after, int)
    with pytest.raises(ConfigError, match=r"^WATTWATCH_POISON_AFTER=x is not a number; a batch is set aside"):
        load_settings({**env, "WATTWATCH_POISON_AFTER": "x"})
    with pytest.raises(ConfigError, match=r"^WATTWATCH_POISON_AFTER=2.5 is not a whole number"):
        load_settings({**env, "WATTWATCH_POISON_AFTER": "2.5"})
    with pytest.raises(ConfigError, match=r"^--poison-after 0 is out of range; .* 1 to 1000"):
        load_settings(env, flags={"poison_after": ("--poison-after 0", "0")})
    assert set(REASONS) == {"rejected", "key_conflict", "repeated_failure"}


def test_unreachable_collector_keeps_everything(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    pusher = Pusher(spool, "http://127.0.0.1:9")
    assert pusher.push_pending() is False
    assert spool.pending() == 2
    assert "unreachable" in pusher.stats.last_error
