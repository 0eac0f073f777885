"""The raw record (``raw_batches``): every stored batch's intervals come back exactly as sent,
shares included, and the rollups reports read can be rebuilt from them, on SQLite and PostgreSQL."""

from __future__ import annotations

import random
from typing import Any

import pytest
from sqlalchemy import Engine, select, text

from test_storage import T0, _random_batches
from wattwatch.accounting.attribution import split_interval
from wattwatch.protocol import wire
from wattwatch.storage.group_ingest import Pending, ingest_many
from wattwatch.storage.raw_batches import decode_intervals, encode_intervals, read_intervals
from wattwatch.storage.tables import devices, hosts, job_device_energy


def two_hosts(rng: random.Random) -> list[wire.Batch]:
    """Random batches (shares, idle weights, zero and tiny energies) from two hosts with their own agents."""
    out = []
    for host in ("h1", "h2"):
        for b in _random_batches(rng, 4):
            out.append(
                wire.Batch(**{**{f: getattr(b, f) for f in b.__struct_fields__}, "host": host, "agent_id": host})
            )
    return out


def test_raw_intervals_come_back_as_sent_and_rebuild_the_rollups(db_engine: Engine) -> None:
    sent = two_hosts(random.Random(11))
    # Stored in groups of three, as the collector's group commit does under load.
    for k in range(0, len(sent), 3):
        outcomes = ingest_many(db_engine, [Pending(b, T0 + 100) for b in sent[k : k + 3]])
        assert all(not isinstance(o, Exception) for o in outcomes)
    with db_engine.connect() as conn:
        stored = list(read_intervals(conn))
        per_batch = conn.execute(text("SELECT agent_id, seq, n_intervals, energy_j FROM raw_batches")).all()
        ids = {
            (str(h), str(k)): int(i)
            for h, k, i in conn.execute(select(hosts.c.name, devices.c.key, devices.c.id).join(hosts))
        }
        rolled = {
            (str(j), int(d)): float(e)
            for j, d, e in conn.execute(
                select(job_device_energy.c.job_id, job_device_energy.c.device_id, job_device_energy.c.energy_j)
            )
        }
    # Exactly what was sent, batch by batch: device keys, times, energies, shares, idle weights, flags.
    assert [(r.host, r.seq, r.interval) for r in stored] == [(b.host, b.seq, iv) for b in sent for iv in b.intervals]
    # The columns beside the body say the same, for plain SQL.
    assert sorted((a, s, n, pytest.approx(e)) for a, s, n, e in per_batch) == sorted(
        (b.agent_id, b.seq, len(b.intervals), pytest.approx(sum(iv.energy_j for iv in b.intervals))) for b in sent
    )
    # Rebuilt here, interval by interval with the conserving split, from the raw record alone.
    rebuilt: dict[tuple[str, int], float] = {}
    for r in stored:
        jobs_j, _idle_j = split_interval(r.interval.energy_j, r.interval.shares, r.interval.idle_weight)
        for job_id, part_j in jobs_j.items():
            key = (job_id, ids[(r.host, r.interval.device)])
            rebuilt[key] = rebuilt.get(key, 0.0) + part_j
    assert rebuilt.keys() == rolled.keys()
    for key, energy_j in rolled.items():
        assert rebuilt[key] == pytest.approx(energy_j, rel=1e-9, abs=1e-9), key


def test_window_and_host_filters(db_engine: Engine) -> None:
    sent = two_hosts(random.Random(3))
    ingest_many(db_engine, [Pending(b, T0 + 100) for b in sent])
    with db_engine.connect() as conn:
        h2 = [r.interval for r in read_intervals(conn, host="h2", since_s=T0 + 25, until_s=T0 + 45)]
    want = [iv for b in sent if b.host == "h2" for iv in b.intervals if iv.t_end_s > T0 + 25 and iv.t_start_s < T0 + 45]
    assert h2 == want and len(want) == 20 * 3


def test_encoding_round_trip_and_unknown_format() -> None:
    flagged = {"source": "power", "flags": ["counter_reset"]}
    shared = {"source": "counter", "shares": {"a": 2.0, "b": 0.0}, "idle_weight": 3.5}
    ivs = [
        wire.Interval(device="gpu0", t_start_s=T0, t_end_s=T0 + 0.25, energy_j=1e-7, **flagged),  # type: ignore[arg-type]
        wire.Interval(device="cpu0", t_start_s=T0, t_end_s=T0 + 1, energy_j=123.456, **shared),  # type: ignore[arg-type]
    ]
    body = encode_intervals(ivs)
    assert decode_intervals(body) == ivs
    with pytest.raises(ValueError, match="format 2 is not known"):
        decode_intervals(body, 2)


@pytest.mark.postgres
def test_array_literals_round_trip_through_postgresql(pg_url: str) -> None:
    """``dialect.pg_array`` (the upserts' parameters) against PostgreSQL's own parser: awkward strings, NULLs,
    floats that must round-trip to the bit, booleans."""
    from sqlalchemy import JSON, BigInteger, Boolean, Float, LargeBinary, String

    from wattwatch.storage.dialect import pg_array
    from wattwatch.storage.engine import make_engine

    cases: list[tuple[Any, str, list[Any]]] = [
        (String(), "text", ['a"b', "c\\d", "x,y", "{z}", "NULL", "", " sp "]),
        (String(), "text", ["job-1", "gcp:europe-west9", "a/b@c"]),
        (String(), "text", ["x", None]),
        (Float(), "float8", [0.1, 1e-300, 123456.789, 2.0**60, -0.0, 1 / 3]),
        (Float(), "float8", [1.5, None]),
        (BigInteger(), "int8", [0, 2**62, -5]),
        (Boolean(), "bool", [True, False]),
        (JSON(), "json", [{}, {"team": 'a"b', "k": "\\"}, None]),
        (LargeBinary(), "bytea", [b"", b'\x00\\"{},', bytes(range(256))]),
    ]
    engine = make_engine(pg_url)
    try:
        with engine.connect() as conn:
            for type_, pg_type, values in cases:
                got = conn.exec_driver_sql(
                    f"SELECT array_agg(x ORDER BY n) FROM unnest(%(a)s::{pg_type}[]) WITH ORDINALITY AS t(x, n)",
                    {"a": pg_array(values, type_)},
                ).scalar_one()
                assert got == values, (pg_type, values)
    finally:
        engine.dispose()
