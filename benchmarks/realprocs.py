"""Real wattwatch processes for the benchmarks that run them: ``wattwatch up`` in a temporary home,
waiting on conditions (never on a fixed sleep), the report as JSON, scratch PostgreSQL databases, and the
simulator's truth replayed from the log ``--simulate`` writes (``simulated-gpus.jsonl``)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from _sim import SimulatedFleet
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from wattwatch.storage.engine import normalize_url

WATTWATCH = [sys.executable, "-m", "wattwatch.cli.main"]
PG_DEFAULT_URL = os.environ.get("WATTWATCH_TEST_PG_URL", "postgresql://postgres@127.0.0.1:5432/test")


class BenchError(Exception):
    """A run did not produce what the benchmark measures (a process failed, a job is missing)."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``condition`` until it holds; raise naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def clean_env(home: Path) -> dict[str, str]:
    """This process's environment without wattwatch's, CUDA's or Slurm's variables, homed at ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATTWATCH_", "CUDA_VISIBLE_DEVICES", "SLURM_"))}
    return {**env, "WATTWATCH_HOME": str(home)}


@dataclass
class Up:
    """A running ``wattwatch up --simulate N``."""

    proc: subprocess.Popen[bytes]
    home: Path
    db_url: str
    url: str
    env: dict[str, str]
    log: Path
    gpus: int

    def stop(self) -> None:
        """SIGTERM (the agent pushes its last intervals), wait, and fail unless it exited cleanly."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        if self.proc.returncode != 0:
            raise BenchError(f"wattwatch up exited {self.proc.returncode}:\n{self.log.read_text()}")

    def report(self) -> dict[str, Any]:
        """``wattwatch report --format json`` on the run's database."""
        out = subprocess.run(
            [*WATTWATCH, "report", "--db", self.db_url, "--format", "json"],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if out.returncode != 0:
            raise BenchError(f"wattwatch report failed: {out.stderr.strip()}")
        return dict(json.loads(out.stdout))

    def fleet(self) -> SimulatedFleet:
        """The simulated boards replayed from their truth log: exact power, no wattwatch accounting."""
        return SimulatedFleet.replay(self.home / "simulated-gpus.jsonl", self.gpus)


@contextlib.contextmanager
def running_up(workdir: Path, db_url: str, *extra: str, gpus: int) -> Iterator[Up]:
    """``wattwatch up --simulate gpus`` in ``workdir/home``, ready (collector answers, agent socket up);
    killed on the way out if it is still running."""
    workdir.mkdir(parents=True, exist_ok=True)
    home = workdir / "home"
    port = free_port()
    env = clean_env(home)
    log = workdir / "up.log"
    with log.open("wb") as sink:
        proc = subprocess.Popen(
            [*WATTWATCH, "up", "--simulate", str(gpus), "--listen", f"127.0.0.1:{port}", "--db", db_url, *extra],
            env=env,
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
    up = Up(proc, home, db_url, f"http://127.0.0.1:{port}", env, log, gpus)

    def ready() -> bool:
        if proc.poll() is not None:
            raise BenchError(f"wattwatch up exited early:\n{log.read_text()}")
        try:
            ok = httpx.get(f"{up.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
        return ok and (home / "agent.sock").exists()

    try:
        wait_for(ready, 60, "wattwatch up to be ready")
        yield up
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def check_exit(proc: subprocess.Popen[Any], what: str, timeout_s: float = 90) -> None:
    """Wait for ``proc``; raise with its stderr (when captured) unless it exited 0."""
    _, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        raise BenchError(f"{what} exited {proc.returncode}: {err or ''}")


@contextlib.contextmanager
def scratch_postgres(server_url: str) -> Iterator[str]:
    """A new, empty database on the PostgreSQL server at ``server_url`` (its URL), dropped afterwards."""
    admin = create_engine(normalize_url(server_url), isolation_level="AUTOCOMMIT")
    name = f"wattwatch_bench_{uuid.uuid4().hex[:8]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
        yield make_url(server_url).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            # FORCE: a process a failed run left behind must not keep the database alive.
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
