"""End to end with real processes: `wattwatch up --simulate 4`, jobs tagged by `wattwatch run` and the SDK,
then `wattwatch report --format json`, checked against the simulator's exact integral."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from procs import WATTWATCH, free_port, wait_for
from wattwatch.sim.fleet import SimulatedFleet

pytestmark = pytest.mark.e2e

SIM_GPUS = 4


@dataclass
class Up:
    proc: subprocess.Popen[bytes]
    home: Path
    db_url: str
    url: str
    env: dict[str, str]
    log: Path

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        return self.log.read_text()


def start_up(tmp_path: Path, db_url: str, *extra: str, simulate: int = SIM_GPUS) -> Up:
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    env.pop("WATTWATCH_JOB", None)
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [*WATTWATCH, "up", "--simulate", str(simulate), "--listen", f"127.0.0.1:{port}", "--db", db_url, *extra],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    up = Up(proc, home, db_url, f"http://127.0.0.1:{port}", env, log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"wattwatch up exited early:\n{log.read_text()}")
        try:
            ok = httpx.get(f"{up.url}/readyz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False
        return ok and (home / "agent.sock").exists()

    wait_for(ready, 60, "wattwatch up to be ready")
    return up


@pytest.fixture
def up_factory(tmp_path: Path) -> Iterator[Callable[..., Up]]:
    started: list[Up] = []

    def make(db_url: str, *extra: str, simulate: int = SIM_GPUS) -> Up:
        up = start_up(tmp_path, db_url, *extra, simulate=simulate)
        started.append(up)
        return up

    yield make
    for up in started:
        if up.proc.poll() is None:
            up.proc.kill()
            up.proc.wait()


def report_json(up: Up) -> dict:
    out = subprocess.run(
        [*WATTWATCH, "report", "--db", up.db_url, "--format", "json"],
        env=up.env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def exact_gpu_energy_j(up: Up, job: dict) -> float:
    fleet = SimulatedFleet.replay(up.home / "simulated-gpus.jsonl", SIM_GPUS)
    total = 0.0
    for device in job["devices"]:
        key = device.rsplit("/", 1)[-1]
        if key.startswith("gpu"):
            total += fleet.exact_energy_j(int(key[3:]), job["started_at_s"], job["ended_at_s"])
    return total


SERVE = textwrap.dedent(
    """
    import time, wattwatch
    with wattwatch.job("chat-serve", kind="inference"):
        time.sleep(0.5)
        for i in range(12):
            with wattwatch.query(tokens_in=100 + i, tokens_out=50):
                time.sleep(0.25)
            time.sleep(0.1)
    """
)

SHORT = "import time, wattwatch\nwith wattwatch.job('blip', kind='training'):\n    time.sleep(0.3)\n"


def run_jobs(up: Up) -> None:
    train = subprocess.Popen(
        [
            *WATTWATCH,
            "run",
            "--kind",
            "training",
            "--name",
            "llama-ft",
            "--label",
            "team=nlp",
            "--",
            sys.executable,
            "-c",
            "import time; time.sleep(6)",
        ],
        env={**up.env, "CUDA_VISIBLE_DEVICES": "0,1"},
    )
    serve = subprocess.Popen([sys.executable, "-c", SERVE], env={**up.env, "CUDA_VISIBLE_DEVICES": "2"})
    assert train.wait(timeout=60) == 0
    assert serve.wait(timeout=60) == 0
    # A job much shorter than the 2 s tick: only the boundary reads can give it its energy.
    assert (
        subprocess.run(
            [sys.executable, "-c", SHORT], env={**up.env, "CUDA_VISIBLE_DEVICES": "1"}, timeout=60, check=False
        ).returncode
        == 0
    )


def gpus_of(job: dict) -> list[str]:
    return sorted(k for k in (d.rsplit("/", 1)[-1] for d in job["devices"]) if k.startswith("gpu"))


def check_report(up: Up, report: dict) -> None:
    jobs = {j["name"]: j for j in report["jobs"]}
    assert set(jobs) >= {"llama-ft", "chat-serve", "blip"}, report

    train = jobs["llama-ft"]
    assert train["kind"] == "training"
    assert gpus_of(train) == ["gpu0", "gpu1"]
    exact = exact_gpu_energy_j(up, train)
    print(
        f"\ntraining {train['duration_s']:.2f} s: {train['gpu_energy_j']:.1f} J vs exact {exact:.1f} J "
        f"({(train['gpu_energy_j'] - exact) / exact:+.3%})"
    )
    assert train["gpu_energy_j"] == pytest.approx(exact, rel=0.01)
    assert train["gpu_energy_j"] > 2 * 6 * 300  # two boards under training load for ~6 s
    assert "simulated" in train["sources"]

    serve = jobs["chat-serve"]
    assert serve["kind"] == "inference"
    assert gpus_of(serve) == ["gpu2"]
    exact = exact_gpu_energy_j(up, serve)
    print(
        f"inference {serve['duration_s']:.2f} s: {serve['gpu_energy_j']:.1f} J vs exact {exact:.1f} J "
        f"({(serve['gpu_energy_j'] - exact) / exact:+.3%})"
    )
    assert serve["gpu_energy_j"] == pytest.approx(exact, rel=0.01)
    assert serve["queries"] == 12
    assert serve["tokens"] == sum(100 + i + 50 for i in range(12))
    # Spans: each query gets its share of the instants it was in flight; the energy while the server
    # held the GPU but served nothing is its waiting energy, shown apart. Together they are the job's.
    assert serve["query_method"] == "spans" and serve["queries_settled"] == 12
    assert serve["waiting_energy_j"] > 0
    assert serve["energy_per_query_j"] * 12 + serve["waiting_energy_j"] == pytest.approx(serve["energy_j"], rel=1e-9)

    blip = jobs["blip"]
    assert blip["duration_s"] < 1.0
    assert blip["gpu_energy_j"] > 0
    exact = exact_gpu_energy_j(up, blip)
    print(
        f"short {blip['duration_s']:.2f} s: {blip['gpu_energy_j']:.1f} J vs exact {exact:.1f} J "
        f"({(blip['gpu_energy_j'] - exact) / exact:+.3%})"
    )
    assert blip["gpu_energy_j"] == pytest.approx(exact, rel=0.01)

    idle = {i["device"].rsplit("/", 1)[-1]: i["energy_j"] for i in report["idle"]}
    # GPU 3 ran no job: all its energy is idle.
    assert idle.get("gpu3", 0) > 50 * 5


def test_up_run_sdk_report_matches_simulator_sqlite(up_factory: Callable[..., Up], tmp_path: Path) -> None:
    up = up_factory(f"sqlite:///{tmp_path / 'e2e.db'}", "--interval", "2")
    run_jobs(up)
    log = up.stop()
    assert up.proc.returncode == 0, log
    check_report(up, report_json(up))


@pytest.mark.postgres
@pytest.mark.slow
def test_up_run_sdk_report_matches_simulator_postgres(up_factory: Callable[..., Up], pg_url: str) -> None:
    up = up_factory(pg_url, "--interval", "2")
    run_jobs(up)
    log = up.stop()
    assert up.proc.returncode == 0, log
    check_report(up, report_json(up))


def test_up_without_a_gpu_says_so_and_points_at_simulate(up_factory: Callable[..., Up], tmp_path: Path) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        pytest.skip("this machine has a working NVIDIA driver")
    except pynvml.NVMLError:
        pass
    up = up_factory(f"sqlite:///{tmp_path / 'nogpu.db'}", simulate=0)
    log = up.stop()
    assert up.proc.returncode == 0, log
    assert "no NVIDIA GPU found" in log and "--simulate" in log
    assert "Traceback" not in log
