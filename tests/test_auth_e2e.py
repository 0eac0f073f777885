"""Identity through real processes: `wattwatch token` on SQLite and PostgreSQL, the collector that will
not listen beyond loopback without a token, HTTPS with a CA made here, and two agents on one cloned spool."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import shutil
import signal
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sqlalchemy import select

from procs import WATTWATCH, free_port, wait_for
from test_agent_metrics import value
from wattwatch.config import Settings
from wattwatch.standalone import Collector
from wattwatch.storage import tokens
from wattwatch.storage.engine import make_engine
from wattwatch.storage.tables import hosts, raw_batches

pytestmark = pytest.mark.e2e


def env_for(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WATTWATCH_")}
    return {**env, "WATTWATCH_HOME": str(home), **extra}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*WATTWATCH, *args], env=env, capture_output=True, text=True, timeout=60)


def stop(proc: subprocess.Popen[str]) -> tuple[str, str]:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate(timeout=10)


def host_names(db_url: str) -> set[str]:
    engine = make_engine(db_url)
    try:
        with engine.connect() as conn:
            return set(conn.execute(select(hosts.c.name)).scalars())
    finally:
        engine.dispose()


# --- the token command -------------------------------------------------------------------------------------

HOST = "gpu-01'); DROP TABLE api_tokens; -- ノード"


def test_token_create_list_revoke_through_the_cli(db_url: str, tmp_path: Path) -> None:
    env = env_for(tmp_path / "home")
    made = run(["token", "create", "--db", db_url, "--role", "agent", "--host", HOST], env)
    assert made.returncode == 0, made.stderr
    token = made.stdout.splitlines()[-1]
    assert token.startswith("ww_") and made.stdout.strip() == token  # alone on its (last) line
    assert "shown once" in made.stderr
    reader = run(["token", "create", "--db", db_url, "--role", "reader"], env).stdout.strip()
    listed = json.loads(run(["token", "list", "--db", db_url, "--format", "json"], env).stdout)
    assert [(t["prefix"], t["role"], t["host"], t["revoked_at_s"]) for t in listed] == [
        (tokens.prefix_of(token), "agent", HOST, None),
        (tokens.prefix_of(reader), "reader", None, None),
    ]
    table = run(["token", "list", "--db", db_url], env).stdout
    assert table.splitlines()[0].split() == ["ID", "PREFIX", "ROLE", "HOST", "CREATED", "LAST", "USED", "REVOKED"]
    assert HOST in table and token not in table
    revoked = run(["token", "revoke", "--db", db_url, tokens.prefix_of(token)], env)
    assert revoked.returncode == 0 and "revoked" in revoked.stdout, revoked.stderr
    listed = json.loads(run(["token", "list", "--db", db_url, "--format", "json"], env).stdout)
    assert listed[0]["revoked_at_s"] is not None and listed[1]["revoked_at_s"] is None
    engine = make_engine(db_url)
    try:
        assert list(tokens.active_tokens(engine)) == [tokens.prefix_of(reader)]
    finally:
        engine.dispose()
    for args, needle in [
        (["token", "revoke", "--db", db_url, "999"], "no token with id or prefix '999'"),
        (["token", "create", "--db", db_url, "--role", "agent"], "--host"),
        (["token", "create", "--db", db_url, "--role", "admin", "--host", "x"], "drop --host"),
        (["token", "create", "--db", db_url, "--role", "root"], "--role"),
    ]:
        bad = run(args, env)
        assert bad.returncode == 2, bad
        assert len(bad.stderr.strip().splitlines()) == 1 and needle in bad.stderr, bad.stderr
    help_text = run(["token", "--help"], env).stdout
    assert "examples:" in help_text and "token create --role agent --host" in help_text


def test_token_commands_default_to_the_embedded_database(tmp_path: Path) -> None:
    env = env_for(tmp_path / "home")
    missing = run(["token", "list"], env)
    assert missing.returncode == 2 and "wattwatch db upgrade" in missing.stderr
    assert run(["db", "upgrade"], env).returncode == 0
    assert run(["token", "create", "--role", "admin"], env).returncode == 0
    assert "admin" in run(["token", "list"], env).stdout


# --- the open-collector guard ------------------------------------------------------------------------------


def test_a_collector_beyond_loopback_without_a_token_refuses_to_start(sqlite_url: str, tmp_path: Path) -> None:
    env = env_for(tmp_path / "home")
    port = free_port()
    refused = run(["collector", "--db", sqlite_url, "--listen", f"0.0.0.0:{port}"], env)
    assert refused.returncode == 2
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr
    assert "refusing to listen on 0.0.0.0:" in lines[0] and "wattwatch token create" in lines[0]
    assert "--allow-open" in lines[0]
    # With a token in its database it starts, and requires one.
    made = run(["token", "create", "--db", sqlite_url, "--role", "reader"], env)
    token = made.stdout.strip()
    proc = subprocess.Popen(
        [*WATTWATCH, "collector", "--db", sqlite_url, "--listen", f"0.0.0.0:{port}"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz", proc), 30.0, "the collector to listen")
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 401
        ok = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"Authorization": f"Bearer {token}"})
        assert ok.status_code == 200
    finally:
        stop(proc)


def test_allow_open_starts_beyond_loopback_but_takes_nobody_anonymous_from_elsewhere(
    sqlite_url: str, tmp_path: Path
) -> None:
    env = env_for(tmp_path / "home")
    port = free_port()
    proc = subprocess.Popen(
        [*WATTWATCH, "collector", "--db", sqlite_url, "--listen", f"0.0.0.0:{port}", "--allow-open", "--open"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: _answers(f"http://127.0.0.1:{port}/healthz", proc), 30.0, "the collector to listen")
        assert httpx.get(f"http://127.0.0.1:{port}/metrics").status_code == 200  # this machine, --open
        proxied = httpx.get(f"http://127.0.0.1:{port}/metrics", headers={"X-Forwarded-For": "127.0.0.1"})
        assert (proxied.status_code, proxied.json()["field"]) == (401, "Authorization")
    finally:
        stop(proc)


def _answers(url: str, proc: subprocess.Popen[str], **kw: object) -> bool:
    try:
        return httpx.get(url, timeout=2, **kw).status_code == 200  # type: ignore[arg-type]
    except httpx.HTTPError:
        assert proc.poll() is None, proc.communicate()
        return False


# --- TLS ---------------------------------------------------------------------------------------------------


def _make_pki(where: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 signed by it: (ca.pem, cert.pem, key.pem)."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        pytest.skip("the cryptography package is not installed")  # a dependency of the test extra's tools
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "wattwatch test CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digital_signature, key_cert_sign, crl_sign
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = where / "ca.pem", where / "cert.pem", where / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@pytest.fixture
def https_collector(sqlite_url: str, tmp_path: Path) -> Iterator[tuple[str, Path, dict[str, Path]]]:
    """A real collector process serving HTTPS on loopback; yields its URL, the CA file and token files."""
    ca, cert, key = _make_pki(tmp_path)
    engine = make_engine(sqlite_url)
    files: dict[str, Path] = {}
    try:
        for name, role, host in (
            ("agent", "agent", "tls-host"),
            ("other", "agent", "no-ca-host"),
            ("reader", "reader", None),
        ):
            files[name] = tmp_path / f"{name}.token"
            files[name].write_text(tokens.create_token(engine, role, host)[1] + "\n")
    finally:
        engine.dispose()
    port = free_port()
    cmd = [*WATTWATCH, "collector", "--db", sqlite_url, "--listen", f"127.0.0.1:{port}"]
    cmd += ["--tls-cert", str(cert), "--tls-key", str(key)]
    proc = subprocess.Popen(cmd, env=env_for(tmp_path / "c"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"https://127.0.0.1:{port}"
    try:
        trust = ssl.create_default_context(cafile=str(ca))
        wait_for(lambda: _answers(f"{url}/healthz", proc, verify=trust), 30.0, "the HTTPS collector")
        yield url, ca, files
    finally:
        stop(proc)


@pytest.mark.slow
def test_agent_to_collector_over_https_with_a_custom_ca(
    https_collector: tuple[str, Path, dict[str, Path]], sqlite_url: str, tmp_path: Path
) -> None:
    url, ca, files = https_collector
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/healthz", timeout=5)  # the system's CAs do not know this one
    agent_cmd = [*WATTWATCH, "agent", "--simulate", "1", "--interval", "0.2", "--collector", url]
    trusted = subprocess.Popen(
        [*agent_cmd, "--host", "tls-host", "--ca-file", str(ca)],
        env=env_for(tmp_path / "a1", WATTWATCH_TOKEN_FILE=str(files["agent"])),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    untrusted = subprocess.Popen(
        [*agent_cmd, "--host", "no-ca-host", "--token-file", str(files["other"])],
        env=env_for(tmp_path / "a2"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: "tls-host" in host_names(sqlite_url), 40.0, "the agent's batches over HTTPS")
    finally:
        stop(trusted)
        _, err = stop(untrusted)
    assert "no-ca-host" not in host_names(sqlite_url)
    untrusted_lines = [line for line in err.splitlines() if "not trusted" in line]
    assert untrusted_lines, err
    assert f"the TLS certificate of {url}/api/v1/ingest is not trusted" in untrusted_lines[0]
    assert "--ca-file" in untrusted_lines[0]
    engine = make_engine(sqlite_url)
    try:
        with engine.connect() as conn:
            assert conn.execute(select(raw_batches.c.id)).first() is not None
    finally:
        engine.dispose()
    # `report --server` with a reader token from a file and the CA; without the CA, one line, exit 2.
    env = env_for(tmp_path / "r", WATTWATCH_TOKEN_FILE=str(files["reader"]))
    report = run(["report", "--server", url, "--ca-file", str(ca), "--format", "json"], env)
    assert report.returncode == 0, report.stderr
    assert {d["host"] for d in json.loads(report.stdout)["idle"]} == {"tls-host"}
    no_ca = run(["report", "--server", url], env)
    assert no_ca.returncode == 2 and len(no_ca.stderr.strip().splitlines()) == 1
    assert "is not trusted" in no_ca.stderr and "--ca-file" in no_ca.stderr
    no_token = run(["report", "--server", url, "--ca-file", str(ca)], env_for(tmp_path / "r"))
    assert no_token.returncode == 2 and "HTTP 401" in no_token.stderr


def test_tls_flags_name_what_is_wrong(tmp_path: Path, sqlite_url: str) -> None:
    env = env_for(tmp_path / "home")
    base = ["collector", "--db", sqlite_url, "--listen", f"127.0.0.1:{free_port()}"]
    for extra, needle in [
        (["--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(tmp_path / "nope.key")], "--tls-cert"),
        (["--tls-cert", str(tmp_path / "x.pem")], "both --tls-cert and --tls-key"),
    ]:
        bad = run([*base, *extra], env)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
        assert needle in bad.stderr
    bad = run(["agent", "--simulate", "1", "--ca-file", str(tmp_path / "missing.pem")], env)
    assert bad.returncode == 2 and "--ca-file" in bad.stderr.strip().splitlines()[-1]


# --- a cloned spool, two real agents -----------------------------------------------------------------------


@pytest.mark.slow
def test_two_agents_on_one_cloned_spool(sqlite_url: str, tmp_path: Path) -> None:
    port = free_port()
    collector = Collector(
        Settings(home=tmp_path / "c", db_url=sqlite_url, listen=f"127.0.0.1:{port}"), migrate=False, open_local=True
    )
    collector.start()
    agent_cmd = [*WATTWATCH, "agent", "--simulate", "1", "--interval", "0.2", "--collector", collector.url]
    try:
        first = subprocess.Popen(
            [*agent_cmd, "--host", "h1"], env=env_for(tmp_path / "h1"), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            wait_for(lambda: "h1" in host_names(sqlite_url), 30.0, "the first agent's batches")
        finally:
            stop(first)
        (tmp_path / "h2").mkdir()
        shutil.copyfile(tmp_path / "h1" / "spool.db", tmp_path / "h2" / "spool.db")  # the cloned image
        metrics_port = free_port()
        clone = subprocess.Popen(
            [*agent_cmd, "--host", "h2", "--metrics-listen", f"127.0.0.1:{metrics_port}"],
            env=env_for(tmp_path / "h2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:

            def refused() -> bool:
                try:
                    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
                except httpx.HTTPError:
                    assert clone.poll() is None, clone.communicate()
                    return False
                return value(text, "wattwatch_agent_push_conflicts_total") > 0

            wait_for(refused, 30.0, "the clone's pushes to be refused")
        finally:
            clone.kill()  # a clean stop would spend its flush timeout on refused pushes
            _, err = clone.communicate(timeout=10)
    finally:
        collector.stop()
    assert host_names(sqlite_url) == {"h1"}
    loud = [line for line in err.splitlines() if " ERROR " in line and "cloned spool?" in line]
    assert loud, err
    assert "belongs to host 'h1', but this batch comes from host 'h2'" in loud[0]


@pytest.mark.slow
def test_up_keeps_pushing_once_tokens_exist_and_then_requires_them(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = env_for(home)
    assert run(["db", "upgrade"], env).returncode == 0
    reader = run(["token", "create", "--role", "reader"], env).stdout.strip()
    port = free_port()
    proc = subprocess.Popen(
        [*WATTWATCH, "up", "--simulate", "1", "--listen", f"127.0.0.1:{port}", "--interval", "0.2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        # Its own agent pushes with an in-process credential; callers need a token like everywhere else.
        wait_for(lambda: bool(host_names(f"sqlite:///{home / 'wattwatch.db'}")), 30.0, "the local agent's batches")
        assert httpx.get(f"{url}/api/v1/report", timeout=5).status_code == 401
        ok = httpx.get(f"{url}/api/v1/report", headers={"Authorization": f"Bearer {reader}"}, timeout=5)
        assert ok.status_code == 200 and ok.json()["idle"]
    finally:
        out, err = stop(proc)
    assert proc.returncode == 0, err
    assert "refused our token" not in err
    assert "--open: requests from this machine need no token until one exists" in out  # its banner says so
