"""No secret in anything wattwatch prints: real processes are given planted credentials (a database password
in the URL's userinfo and as ``?password=``, a collector URL with userinfo, a bearer token) and every
line they write, logs, errors and banners, is searched for them. The URLs themselves are still shown,
masked, so a person can fix a setup."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from sqlalchemy.engine import make_url

from procs import WATTWATCH, free_port, wait_for
from test_auth_e2e import env_for, run, stop
from test_front_door_e2e import start_collector

pytestmark = [pytest.mark.e2e, pytest.mark.postgres]

PLANTED = ("PlantedDbPassword1", "PlantedQueryPassword2", "PlantedUrlPassword3", "PlantedToken4abcdef")


def _planted_db_url(pg_url: str, port: int | None = None) -> str:
    url = make_url(pg_url).set(password=PLANTED[0])
    if port is not None:
        url = url.set(port=port)
    # PostgreSQL here trusts local connections, so both passwords are given and neither is needed.
    return f"{url.render_as_string(hide_password=False)}?password={PLANTED[1]}"


def _clean(what: str, text: str) -> None:
    for secret in PLANTED:
        assert secret not in text, f"{what} printed a planted secret:\n{text}"


def test_no_planted_secret_is_ever_printed(pg_url: str, tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = env_for(home)
    db_url = _planted_db_url(pg_url)
    dead_port = free_port()  # nothing listens there
    collector_url = f"http://agent:{PLANTED[2]}@127.0.0.1:{dead_port}"
    outputs: dict[str, str] = {}

    r = run(["db", "upgrade", "--db", db_url], env)
    outputs["db upgrade"] = r.stdout + r.stderr
    assert r.returncode == 0 and "***" in outputs["db upgrade"], outputs["db upgrade"]

    r = run(["token", "create", "--db", _planted_db_url(pg_url, port=dead_port), "--role", "reader"], env)
    outputs["token create, database down"] = r.stdout + r.stderr
    assert r.returncode != 0 and "***" in outputs["token create, database down"], r.stderr

    collector, _url = start_collector(db_url, home, "--token", PLANTED[3])
    out, err = stop(collector)
    outputs["collector"] = out + err
    assert "database postgresql" in outputs["collector"] and "***" in outputs["collector"], outputs["collector"]

    log_path = tmp_path / "agent.log"
    with log_path.open("w") as log_file:
        agent = subprocess.Popen(
            [
                *WATTWATCH,
                "agent",
                "--simulate",
                "1",
                "--collector",
                collector_url,
                "--token",
                PLANTED[3],
                "--interval",
                "0.2",
                "--push-interval",
                "0.5",
                "--log-level",
                "debug",
            ],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            # Its "unreachable" warning names the collector (and debug lines log each attempt).
            wait_for(lambda: "unreachable" in log_path.read_text(), 30.0, "the agent to find no collector")
        finally:
            stop(agent)
    outputs["agent"] = log_path.read_text()
    assert f"agent:***@127.0.0.1:{dead_port}" in outputs["agent"], outputs["agent"][-3000:]

    r = run(["report", "--server", collector_url, "--token", PLANTED[3]], env)
    outputs["report"] = r.stdout + r.stderr
    assert r.returncode != 0 and f"127.0.0.1:{dead_port}" in outputs["report"], outputs["report"]

    r = run(["doctor"], {**env, "WATTWATCH_COLLECTOR_URL": collector_url, "WATTWATCH_DB_URL": db_url})
    outputs["doctor"] = r.stdout + r.stderr

    for what, text in outputs.items():
        _clean(what, text)
