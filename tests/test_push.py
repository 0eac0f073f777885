"""The pusher against a real HTTP server on loopback that answers as scripted."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from wattwatch.agent.push import Pusher
from wattwatch.agent.spool import Spool
from wattwatch.sim.clock import FakeClock


class Scripted:
    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.bodies: list[bytes] = []
        self.headers: list[dict[str, str]] = []


@pytest.fixture
def server() -> Iterator[tuple[str, Scripted]]:
    script = Scripted()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            script.bodies.append(gzip.decompress(body))
            script.headers.append(dict(self.headers))
            status = script.statuses.pop(0) if script.statuses else 200
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": "scripted", "field": "intervals[0].energy_j"}')

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


def test_pushes_in_order_gzipped_with_token_and_acks(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 3)
    pusher = Pusher(spool, url, token="s3cret")
    assert pusher.push_pending() is True
    assert script.bodies == [b'{"seq": 0}', b'{"seq": 1}', b'{"seq": 2}']
    assert script.headers[0]["Authorization"] == "Bearer s3cret"
    assert spool.pending() == 0


def test_server_errors_keep_batches_and_back_off(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    clock = FakeClock(0.0)
    pusher = Pusher(spool, url, clock=clock)
    script.statuses = [503]
    assert pusher.push_pending() is False
    assert spool.pending() == 2
    assert pusher.push_pending() is False  # still backing off: nothing sent
    assert len(script.bodies) == 1
    clock.t_s += 60
    assert pusher.push_pending() is True
    assert spool.pending() == 0


def test_a_refused_batch_is_set_aside_not_lost_and_the_rest_flows(server: tuple[str, Scripted], tmp_path: Path) -> None:
    url, script = server
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    script.statuses = [422]
    pusher = Pusher(spool, url)
    assert pusher.push_pending() is True
    assert spool.pending() == 0
    assert spool.dead() == 1
    assert pusher.stats.refused == 1


def test_unreachable_collector_keeps_everything(tmp_path: Path) -> None:
    spool = Spool(tmp_path / "s.db")
    fill(spool, 2)
    pusher = Pusher(spool, "http://127.0.0.1:9")
    assert pusher.push_pending() is False
    assert spool.pending() == 2
    assert "unreachable" in pusher.stats.last_error
