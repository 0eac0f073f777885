"""A real `wattwatch agent` whose home is on a full disk while its collector is down: it says so once, keeps
measuring into memory, drops the oldest past its bound (counted on /metrics and by `wattwatch doctor`),
writes everything it kept by itself once space comes back, and sends the time it dropped as ``gap``
intervals, so the report's energy of the job plus its ``unmeasured_s`` accounts for the job's whole window
(checked against the simulator's exact integral).

The full disk is a real one: the agent's home is an 8 MB tmpfs (``mount -t tmpfs``, root only; skipped
elsewhere) that a file fills to the last byte; deleting the file is space coming back. 8 MB, not 2: with
the collector away nothing is acknowledged, and SQLite checkpoints its journal only at 4 MB of it, so on
a smaller disk the journal alone fills it again within a minute whatever the agent does. The agent runs
with its memory bound lowered to ``HELD_INTERVALS`` (the module constant, set in its own process), so
an outage of seconds overflows it."""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import create_engine

from procs import WATTWATCH, free_port, wait_for
from test_agent_metrics import value
from test_restart_e2e import WAIT_FOR_FILE, agent_jobs, agent_ready
from wattwatch.agent.spool import SPOOL_FILE, Spool
from wattwatch.sim.fleet import SimulatedFleet
from wattwatch.storage.raw_batches import read_intervals

pytestmark = [pytest.mark.e2e, pytest.mark.slow]  # a real agent through a 20 s full disk

HOST = "full-disk-host"
TICK_S = 0.2
HELD_INTERVALS = 150  # about 10 s of the agent's 3 devices (gpu0, cpu0, dram0) at 5 ticks a second
OUTAGE_S = 20.0
# The agent as `wattwatch agent` runs it, its memory bound set first (agent.held.MAX_HELD_INTERVALS).
AGENT = [
    sys.executable,
    "-c",
    "import sys; from wattwatch.agent import held; held.MAX_HELD_INTERVALS = int(sys.argv[1]); "
    "from wattwatch.cli.main import main; sys.exit(main(sys.argv[2:]))",
    str(HELD_INTERVALS),
    "agent",
]


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MB tmpfs mounted for the test, unmounted after it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        # Root is no service the environment promises (WATTWATCH_REQUIRE_SERVICES): a skip, not a failure.
        # tests/test_spool_full.py drives the same agent on a full SQLite file without it.
        pytest.skip(f"cannot mount a tmpfs here (root only): {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    """A file taking every free byte of ``disk``; returns it."""
    filler = disk / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        for size in (1 << 16, 1 << 12, 1 << 8, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text


def pending(home: Path) -> int:
    spool = Spool(home / SPOOL_FILE)
    try:
        return spool.pending()
    finally:
        spool.close()


def test_a_full_disk_with_the_collector_down_is_said_once_loses_only_what_is_counted_and_recovers(
    small_disk: Path, tmp_path: Path
) -> None:
    home = small_disk / "home"
    db_url = f"sqlite:///{tmp_path / 'full-disk.db'}"
    collector_port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{collector_port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_") and k != "CUDA_VISIBLE_DEVICES"}
    env["WATTWATCH_HOME"] = str(home)
    agent_log, collector_log = tmp_path / "agent.log", tmp_path / "collector.log"
    release = tmp_path / "release"
    started: list[subprocess.Popen[bytes]] = []

    def start(cmd: list[str], log: Path, extra: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            proc = subprocess.Popen(cmd, env={**env, **(extra or {})}, stdout=out, stderr=subprocess.STDOUT)
        started.append(proc)
        return proc

    try:
        agent_cmd = [*AGENT, "--simulate", "1", "--host", HOST, "--collector", url, "--interval", str(TICK_S)]
        agent = start([*agent_cmd, "--metrics-listen", f"127.0.0.1:{metrics_port}"], agent_log)
        wait_for(lambda: agent_ready(home, agent), 60, "the agent to answer")
        job_cmd = [*WATTWATCH, "run", "--kind", "training", "--name", "through-a-full-disk", "--"]
        job = start([*job_cmd, sys.executable, "-c", WAIT_FOR_FILE, str(release)], tmp_path / "job.log",
                    {"CUDA_VISIBLE_DEVICES": "0"})  # fmt: skip
        wait_for(lambda: "through-a-full-disk" in agent_jobs(home), 30, "the job to start")
        time.sleep(2.0)

        filler = fill(small_disk)
        full_at = agent_log.stat().st_size
        wait_for(lambda: "cannot be written" in agent_log.read_text(), 10, "the agent to say its spool is full")
        time.sleep(OUTAGE_S)
        dropped = value(scrape(metrics_port), "wattwatch_agent_dropped_intervals_total", host=HOST)
        doctor_full = subprocess.run([*WATTWATCH, "doctor", "--simulate", "1"], env=env, capture_output=True,
                                     text=True, timeout=60)  # fmt: skip
        filler.unlink()  # space comes back
        freed_s = time.monotonic()
        wait_for(lambda: "writable again" in agent_log.read_text(), 10, "the agent to write what it held")
        recovered_s = time.monotonic() - freed_s
        outage_log = agent_log.read_bytes()[full_at:].decode(errors="replace")

        start([*WATTWATCH, "collector", "--db", db_url, "--listen", f"127.0.0.1:{collector_port}", "--migrate",
               "--open"], collector_log)  # fmt: skip
        wait_for(lambda: pending(home) == 0, 60, "the spool to drain into the collector")
        release.touch()
        assert job.wait(timeout=30) == 0, (tmp_path / "job.log").read_text()
        wait_for(lambda: pending(home) == 0, 30, "the job's end to reach the collector")
        text = scrape(metrics_port)
        doctor = subprocess.run([*WATTWATCH, "doctor", "--simulate", "1"], env=env, capture_output=True, text=True,
                                timeout=60)  # fmt: skip
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0, agent_log.read_text()
        fleet = SimulatedFleet.replay(home / "simulated-gpus.jsonl", 1)
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    log = agent_log.read_text()

    # Loud once, never a traceback per tick: one WARNING when the spool became unwritable, one INFO when
    # it was written again, and nothing else in the 20 s (100 ticks) between.
    assert "Traceback" not in log, log
    warnings = [line for line in log.splitlines() if "cannot be written" in line]
    recovered = [line for line in log.splitlines() if "writable again" in line]
    assert len(warnings) == 1 and " WARNING " in warnings[0] and "free space" in warnings[0], log
    assert len(recovered) == 1 and " INFO " in recovered[0], log
    assert len(outage_log.splitlines()) <= 3, outage_log
    assert recovered_s < 1.0 + 2 * TICK_S  # by itself, at the next tick's stage
    # What was dropped is counted, and the same number is said, on /metrics and by doctor.
    counted = value(text, "wattwatch_agent_dropped_intervals_total", host=HOST)
    said = re.search(r"(\d+) interval\(s\) were dropped", recovered[0])
    assert said is not None and int(said[1]) == counted >= dropped > 0
    assert doctor_full.returncode == 1 and "CANNOT WRITE its spool" in doctor_full.stdout, doctor_full.stdout
    assert f"{int(counted)} interval(s) dropped since it started" in doctor.stdout, doctor.stdout
    assert "the running agent writes its spool" in doctor.stdout

    out = subprocess.run([*WATTWATCH, "report", "--db", db_url, "--format", "json"], env=env, capture_output=True,
                         text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    (entry,) = [j for j in json.loads(out.stdout)["jobs"] if j["name"] == "through-a-full-disk"]
    t0_s, t1_s = entry["started_at_s"], entry["ended_at_s"]
    engine = create_engine(db_url)
    try:
        with engine.connect() as conn:
            gpu = sorted((r.interval for r in read_intervals(conn) if r.interval.device == "gpu0"),
                         key=lambda iv: iv.t_start_s)  # fmt: skip
    finally:
        engine.dispose()
    gaps = [iv for iv in gpu if "gap" in iv.flags]
    assert gaps and all(iv.energy_j == 0.0 for iv in gaps)
    # The GPU's timeline has no hole and no overlap: the gaps cover exactly the time whose intervals went.
    for before, after in itertools.pairwise(gpu):
        assert after.t_start_s == pytest.approx(before.t_end_s, abs=1e-9), (before, after)
    gap_s = sum(min(iv.t_end_s, t1_s) - max(iv.t_start_s, t0_s) for iv in gaps if iv.t_end_s > t0_s)
    # At 5 ticks a second, the time past what memory held: the outage less about 10 s held.
    assert OUTAGE_S - 10.0 - 4.0 < gap_s < OUTAGE_S, gap_s
    # Every device of the job dropped the same ticks: its unmeasured time is the GPU's gap.
    assert entry["unmeasured_s"] == pytest.approx(gap_s, abs=2 * TICK_S)
    # Its energy plus the gap's is the whole window's: what the board drew less what it drew in the gaps.
    gap_j = sum(fleet.exact_energy_j(0, max(iv.t_start_s, t0_s), min(iv.t_end_s, t1_s)) for iv in gaps)
    window_j = fleet.exact_energy_j(0, t0_s, t1_s)
    assert gap_j > 0.2 * window_j
    # Within 1 %: only four readings err (the job's two ends and the gap's), each by what the board drew
    # since its counter last refreshed; every other joule is a counter delta.
    assert entry["gpu_energy_j"] == pytest.approx(window_j - gap_j, rel=0.01)
    print(
        f"\nwritten again {recovered_s:.2f} s after space came back; {counted:.0f} intervals dropped; "
        f"{gap_s:.1f} s of the job's {t1_s - t0_s:.1f} s not measured; "
        f"its GPU energy {entry['gpu_energy_j']:.0f} J vs {window_j - gap_j:.0f} J exact less the gap's "
        f"{gap_j:.0f} J"
    )
