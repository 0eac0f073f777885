"""Carbon and cost per host: each host's energy at its grid's intensity from codecarbon's data,
through the real collector (ingest, report API) and the `wattwatch report` CLI on SQLite and PostgreSQL.

The expected intensities are read here from codecarbon's own data files, not through wattwatch.carbon.grid, so
the truth does not come from the code under test.
"""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import Engine

from procs import WATTWATCH
from test_storage import GPUS, WIDE_WINDOW_S, iv
from wattwatch.agent.outbox import Outbox
from wattwatch.agent.spool import Spool
from wattwatch.collector import create_app
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sim.clock import FakeClock

T = 1_700_000_000.0
PUE = 1.25
PRICE = 0.3
ENERGY_J = 7.2e6  # 2 kWh per job: 720 one-second intervals of 10 kJ


def codecarbon_dir() -> Path:
    spec = importlib.util.find_spec("codecarbon")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("codecarbon is not installed (pip install 'wattwatch[estimate]')")
    return Path(next(iter(spec.submodule_search_locations)))


def country_intensity(alpha3: str) -> float:
    """codecarbon's gCO2e/kWh for a country, straight from its energy-mix file."""
    mix = json.loads((codecarbon_dir() / "data" / "private_infra" / "global_energy_mix.json").read_text())
    return float(mix[alpha3]["carbon_intensity"])


def cloud_intensity(provider: str, region: str) -> float:
    """codecarbon's gCO2e/kWh for a cloud region, straight from its cloud file."""
    with (codecarbon_dir() / "data" / "cloud" / "impact.csv").open(encoding="utf-8-sig") as f:
        rows = [r for r in csv.DictReader(f) if (r["provider"], r["region"]) == (provider, region)]
    assert len(rows) == 1, rows
    return float(rows[0]["impact"])


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(
        home=tmp_path,
        grid_intensity_g_per_kwh=400.0,
        pue=PUE,
        price_per_kwh=PRICE,
        currency="EUR",
        time_window_past_s=WIDE_WINDOW_S,
    )


def app_client(settings: Settings, engine: Engine) -> TestClient:
    return TestClient(create_app(settings, engine, clock=FakeClock(T + 1000), span_energy_interval_s=None))


@pytest.fixture
def client(settings: Settings, db_engine: Engine) -> Iterator[TestClient]:
    with app_client(settings, db_engine) as c:
        yield c


def host_batch(host: str, job_id: str, kind: str, region: str | None, energy_j: float = ENERGY_J) -> bytes:
    """One host's batch: a job of ``energy_j`` on gpu0, sent with ``region`` (left out when None)."""
    n = 720
    b = wire.Batch(
        agent_id=f"agent-{host}",
        seq=1,
        host=host,
        sent_at_s=T + n,
        devices=GPUS,
        jobs=[wire.Job(id=job_id, name=job_id, kind=kind, started_at_s=T, ended_at_s=T + n)],  # type: ignore[arg-type]
        intervals=[iv("gpu0", T + t, energy_j / n, {job_id: 1.0}) for t in range(n)],
        grid_region=region if region is not None else msgspec.UNSET,
    )
    return wire.encode(b)


def ingest(client: TestClient, body: bytes) -> Any:
    return client.post("/api/v1/ingest", content=body, headers={"Content-Type": "application/json"})


def cli_report(db_url: str, home: Path, fmt: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
    # The data is from 2023: a window that holds it (a report alone covers the last 7 days).
    cmd = [*WATTWATCH, "report", "--db", db_url, "--format", fmt, "--since", "2023-11-01"]
    extra = {"WATTWATCH_HOME": str(home), "WATTWATCH_PUE": str(PUE), "WATTWATCH_PRICE_PER_KWH": str(PRICE), **env}
    done = subprocess.run(cmd, env={**base, **extra}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_host_in_france_and_one_in_the_usa_emit_in_the_ratio_of_codecarbons_intensities(
    client: TestClient, db_url: str, tmp_path: Path
) -> None:
    fra, usa = country_intensity("FRA"), country_intensity("USA")
    assert ingest(client, host_batch("paris-1", "train-fr", "training", "FR")).status_code == 200
    assert ingest(client, host_batch("ohio-1", "train-us", "training", "USA")).status_code == 200
    api = client.get("/api/v1/report").json()
    jobs = {j["id"]: j for j in api["jobs"]}
    fr, us = jobs["train-fr"], jobs["train-us"]
    assert fr["energy_j"] == pytest.approx(ENERGY_J) and us["energy_j"] == pytest.approx(ENERGY_J)
    assert fr["emissions_g"] / us["emissions_g"] == pytest.approx(fra / usa, rel=1e-9)
    # And each on its own: kWh x PUE x the country's intensity; cost: kWh x PUE x price.
    assert fr["emissions_g"] == pytest.approx(2.0 * PUE * fra, rel=1e-9)
    assert us["emissions_g"] == pytest.approx(2.0 * PUE * usa, rel=1e-9)
    assert fr["cost"] == pytest.approx(2.0 * PUE * PRICE, rel=1e-9)
    assert (fr["grid_intensity_g_per_kwh"], fr["pue"]) == (pytest.approx(fra), PUE)
    assert "France (FRA)" in fr["intensity_source"] and "codecarbon data" in fr["intensity_source"]
    hosts = {h["host"]: h for h in api["carbon"]["hosts"]}
    assert (hosts["paris-1"]["region"], hosts["paris-1"]["g_per_kwh"]) == ("FRA", fra)
    assert (hosts["ohio-1"]["region"], hosts["ohio-1"]["g_per_kwh"]) == ("USA", usa)
    assert api["carbon"]["pue"] == PUE and api["carbon"]["price_per_kwh"] == PRICE
    (training,) = api["carbon"]["by_kind"]
    assert training["emissions_g"] == pytest.approx(2.0 * PUE * (fra + usa), rel=1e-9)

    # The CLI reads the same database and says the same in every format.
    as_json = json.loads(cli_report(db_url, tmp_path, "json"))
    cli_jobs = {j["id"]: j for j in as_json["jobs"]}
    assert cli_jobs["train-fr"]["emissions_g"] == pytest.approx(fr["emissions_g"], rel=1e-12)
    assert cli_jobs["train-us"]["emissions_g"] == pytest.approx(us["emissions_g"], rel=1e-12)
    assert as_json["carbon"]["hosts"] == api["carbon"]["hosts"]
    rows = {r["id"]: r for r in csv.DictReader(io.StringIO(cli_report(db_url, tmp_path, "csv")))}
    assert float(rows["train-fr"]["emissions_g"]) / float(rows["train-us"]["emissions_g"]) == pytest.approx(fra / usa)
    assert float(rows["train-fr"]["grid_intensity_g_per_kwh"]) == pytest.approx(fra)
    assert float(rows["train-us"]["pue"]) == PUE and "United States (USA)" in rows["train-us"]["intensity_source"]
    assert float(rows["train-us"]["cost"]) == pytest.approx(2.0 * PUE * PRICE)
    for fmt in ("table", "markdown"):
        text = cli_report(db_url, tmp_path, fmt)
        assert f"PUE {PUE:g}" in text, text
        assert f"paris-1: {fra:.4g} g/kWh (codecarbon data: France (FRA)" in text, text
        assert f"ohio-1: {usa:.4g} g/kWh (codecarbon data: United States (USA)" in text, text
        assert f"price {PRICE:g} USD/kWh" in text  # the CLI's own settings: no WATTWATCH_CURRENCY given


def test_a_job_on_both_hosts_emits_each_hosts_share_at_its_own_intensity(client: TestClient) -> None:
    fra, usa = country_intensity("FRA"), country_intensity("USA")
    assert ingest(client, host_batch("paris-1", "run-7", "training", "FRA", energy_j=3.6e6)).status_code == 200
    assert ingest(client, host_batch("ohio-1", "run-7", "training", "USA", energy_j=7.2e6)).status_code == 200
    (job,) = client.get("/api/v1/report").json()["jobs"]
    assert job["emissions_g"] == pytest.approx(PUE * (1.0 * fra + 2.0 * usa), rel=1e-9)
    assert job["grid_intensity_g_per_kwh"] == pytest.approx((fra + 2 * usa) / 3, rel=1e-9)
    per_host = {h["host"]: h["emissions_g"] for h in job["per_host"]}
    assert per_host == {"paris-1": pytest.approx(PUE * fra), "ohio-1": pytest.approx(2 * PUE * usa)}


def test_a_batch_names_its_region_as_agents_spell_it(client: TestClient) -> None:
    # Agents send check_region's spelling, the one the OpenAPI document lists; another is named, not guessed.
    r = ingest(client, host_batch("ohio-1", "run-7", "training", "usa", energy_j=7.2e6))
    assert r.status_code == 422 and r.json()["field"] == "grid_region", r.text
    assert "send it as 'USA'" in r.json()["error"]


def test_collector_override_and_default_region(settings: Settings, db_engine: Engine) -> None:
    """The collector's per-host override beats what the agent sent; its own region covers hosts sending none;
    a cloud region takes codecarbon's cloud figure."""
    from dataclasses import replace

    tuned = replace(settings, grid_region="DEU", grid_regions="ohio-*=gcp:us-west1")
    with app_client(tuned, db_engine) as client:
        assert ingest(client, host_batch("ohio-1", "a", "training", "USA")).status_code == 200
        assert ingest(client, host_batch("berlin-1", "b", "inference", None)).status_code == 200
        report = client.get("/api/v1/report").json()
    hosts = {h["host"]: h for h in report["carbon"]["hosts"]}
    assert hosts["ohio-1"]["g_per_kwh"] == cloud_intensity("gcp", "us-west1")
    assert "collector override" in hosts["ohio-1"]["source"]
    assert hosts["berlin-1"]["g_per_kwh"] == country_intensity("DEU")
    assert "collector default" in hosts["berlin-1"]["source"]
    kinds = {k["kind"]: k for k in report["carbon"]["by_kind"]}
    assert kinds["inference"]["emissions_g"] == pytest.approx(2.0 * PUE * country_intensity("DEU"))


def test_hosts_without_a_region_state_the_config_default(client: TestClient) -> None:
    assert ingest(client, host_batch("h1", "j", "other", None)).status_code == 200
    report = client.get("/api/v1/report").json()
    assert report["carbon"]["hosts"] == [{"host": "h1", "region": None, "g_per_kwh": 400.0, "source": "config default"}]
    assert report["jobs"][0]["emissions_g"] == pytest.approx(2.0 * PUE * 400.0)


@pytest.mark.parametrize("region", ["ZZZ", "XX", "aws:moon-1", "F R", "gcp:", "x" * 65])
def test_a_bad_region_is_a_422_naming_the_field(client: TestClient, region: str) -> None:
    body = json.loads(host_batch("h1", "j", "other", "FRA"))
    body["grid_region"] = region
    r = client.post("/api/v1/ingest", content=json.dumps(body), headers={"Content-Type": "application/json"})
    assert r.status_code == 422, r.text
    assert r.json()["field"] == "grid_region"
    assert client.get("/api/v1/report").json()["jobs"] == []  # nothing of the batch was stored


@pytest.mark.parametrize(
    ("argv", "env", "says"),
    [
        (["agent", "--grid-region", "ZZZ", "--collector", "http://127.0.0.1:9"], {}, "--grid-region"),
        (["agent", "--grid-region", "F-R", "--collector", "http://127.0.0.1:9"], {}, "--grid-region"),
        (["agent", "--simulate", "1", "--collector", "http://127.0.0.1:9"], {"WATTWATCH_GRID_REGION": "ZZZ"}, "ZZZ"),
        (["report", "--format", "json"], {"WATTWATCH_GRID_REGION": "ZZZ"}, "WATTWATCH_GRID_REGION"),
        (["report", "--format", "json"], {"WATTWATCH_GRID_REGIONS": "gpu-*"}, "HOSTGLOB=REGION"),
        (["report", "--format", "json"], {"WATTWATCH_GRID_REGIONS": "gpu-*=mars"}, "grid_regions"),
    ],
)
def test_a_bad_region_on_the_command_line_is_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], env: dict[str, str], says: str
) -> None:
    base = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
    done = subprocess.run(
        [*WATTWATCH, *argv],
        env={**base, "WATTWATCH_HOME": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in done.stderr, done.stderr


def test_the_agent_sends_its_region_and_leaves_the_field_out_without_one(tmp_path: Path) -> None:
    now = time.time()
    devices = [wire.Device(key="gpu0", kind="gpu")]
    interval = wire.Interval("gpu0", now - 1, now, 300.0, "counter")
    bodies = []
    for name, region in (("with", "FRA"), ("without", None)):
        spool = Spool(tmp_path / f"{name}.db")
        outbox = Outbox(spool, "a1", "h1", lambda: devices, time.time, grid_region=region)
        outbox.add(intervals=[interval])
        outbox.seal()
        bodies.append(spool.peek()[0][1])
        spool.close()
    assert json.loads(bodies[0])["grid_region"] == "FRA"
    # Absent, not null: collectors from before the field (forbid_unknown_fields) take the batch.
    assert "grid_region" not in json.loads(bodies[1])


def test_codecarbon_and_pandas_stay_off_the_agents_import_path() -> None:
    done = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import wattwatch.agent.runner"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines() if "|" in line}
    assert "wattwatch" in imported  # the check reads the right output
    assert not imported & {"codecarbon", "pandas", "numpy"}


def test_without_codecarbons_data_a_region_falls_back_to_the_config_default_and_says_so(tmp_path: Path) -> None:
    # A codecarbon package without its data files first on the path: what an install without the extra finds.
    (tmp_path / "codecarbon").mkdir()
    (tmp_path / "codecarbon" / "__init__.py").write_text("")
    code = (
        "from wattwatch.carbon import grid, policy as c;"
        "p = c.CarbonPolicy(default_g_per_kwh=321.0);"
        "i = p.intensity('h1', 'FRA'); print(grid.data_installed(), i.g_per_kwh, i.source, sep='|')"
    )
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    installed, g, source = done.stdout.strip().split("|")
    assert (installed, float(g)) == ("False", 321.0)
    assert "config default" in source and "not installed" in source and "FRA" in source


def test_metrics_charge_each_hosts_energy_at_its_own_intensity(client: TestClient) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    fra, usa = country_intensity("FRA"), country_intensity("USA")
    assert ingest(client, host_batch("paris-1", "train-fr", "training", "FR")).status_code == 200
    assert ingest(client, host_batch("ohio-1", "train-us", "training", "USA")).status_code == 200
    samples = [s for f in text_string_to_metric_families(client.get("/metrics").text) for s in f.samples]
    intensity = {
        s.labels["host"]: (s.labels["region"], s.value)
        for s in samples
        if s.name == "wattwatch_host_grid_intensity_grams_per_kwh"
    }
    assert intensity == {"paris-1": ("FRA", fra), "ohio-1": ("USA", usa)}
    grams = {s.labels["job_id"]: s.value for s in samples if s.name == "wattwatch_job_emissions_grams_total"}
    assert grams["train-fr"] / grams["train-us"] == pytest.approx(fra / usa, rel=1e-9)
    assert grams["train-fr"] == pytest.approx(2.0 * PUE * fra, rel=1e-9)


def test_a_later_batch_without_a_region_keeps_the_hosts_region(client: TestClient) -> None:
    assert ingest(client, host_batch("paris-1", "a", "training", "FR")).status_code == 200
    later = json.loads(host_batch("paris-1", "b", "training", None))
    later["seq"] = 2
    r = client.post("/api/v1/ingest", content=json.dumps(later), headers={"Content-Type": "application/json"})
    assert r.status_code == 200, r.text
    (paris,) = client.get("/api/v1/report").json()["carbon"]["hosts"]
    assert (paris["region"], paris["g_per_kwh"]) == ("FRA", country_intensity("FRA"))


@pytest.mark.e2e
@pytest.mark.slow
def test_the_demo_with_a_region_charges_codecarbons_figure_end_to_end(tmp_path: Path) -> None:
    """A real `wattwatch demo` (agent, wire, collector, database, report) with WATTWATCH_GRID_REGION=FR."""
    from procs import free_port

    fra = country_intensity("FRA")
    base = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
    env = {**base, "WATTWATCH_HOME": str(tmp_path), "WATTWATCH_GRID_REGION": "FR", "WATTWATCH_PUE": "1.5"}
    cmd = [*WATTWATCH, "demo", "--duration", "4", "--listen", f"127.0.0.1:{free_port()}"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"{fra:.4g} g/kWh (codecarbon data: France (FRA) 2023, region set by agent)" in done.stdout, done.stdout
    assert "PUE 1.5" in done.stdout
    report = json.loads(cli_report(f"sqlite:///{tmp_path / 'wattwatch.db'}", tmp_path, "json", WATTWATCH_PUE="1.5"))
    (host,) = report["carbon"]["hosts"]
    assert (host["region"], host["g_per_kwh"]) == ("FRA", fra)
    for job in report["jobs"]:
        assert job["emissions_g"] == pytest.approx(job["energy_j"] / 3.6e6 * 1.5 * fra, rel=1e-9)
