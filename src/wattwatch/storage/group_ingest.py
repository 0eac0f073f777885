"""Store several agent batches in one transaction (group commit), each still all-or-nothing and idempotent.

A collector under load spends most of a batch's time on per-statement overhead (round trips, statement
compilation, a commit per batch), not on the rows. ``ingest_many`` writes a group of batches with one
statement per table instead of one per table per batch, and one commit.

Per batch, nothing changes for the agent: its ``(agent_id, seq)`` key is claimed first, and a batch
refused for its identity (``AgentIdTaken``, ``KeyReused``) writes nothing, while the others of the group
are stored. A database error fails the whole group; the caller (``collector.group_commit``) then stores
each batch alone, so only a batch that fails by itself is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from sqlalchemy import Connection, Engine, func, select, tuple_

from wattwatch.accounting.rollup import JobHostTotals, rollup_intervals
from wattwatch.carbon import grid
from wattwatch.protocol import wire
from wattwatch.storage import raw_batches, tables, unmeasured
from wattwatch.storage.dialect import (
    append_rows,
    cached_upsert,
    execute_rows,
    greatest,
    pipelined,
    upsert,
    upsert_rows,
)
from wattwatch.storage.engine import write_transaction
from wattwatch.storage.idempotency import AgentIdTaken, KeyReused
from wattwatch.storage.ingest_cache import DeviceCache, DeviceRows
from wattwatch.storage.job_writes import job_rows, reopen_jobs, upsert_job_rows
from wattwatch.storage.rollup_writes import add_device_energy, add_idle, add_job_device_energy, add_job_hosts
from wattwatch.storage.spans import record_spans, record_ticks_many
from wattwatch.storage.tables import agents, devices, hosts, ingested_batches


@dataclass(frozen=True)
class IngestResult:
    """What storing one batch did: ``duplicate`` means the (agent_id, seq) key was stored before."""

    duplicate: bool
    n_intervals: int


@dataclass
class Pending:
    """A decoded batch waiting to be stored, and when the collector received it."""

    batch: wire.Batch
    received_at_s: float
    # The hash of the decoded batch, re-encoded: the same batch hashes the same however it was sent.
    body_sha256: str = field(default="")

    def __post_init__(self) -> None:
        if not self.body_sha256:
            self.body_sha256 = hashlib.sha256(wire.encode(self.batch)).hexdigest()


Outcome = IngestResult | AgentIdTaken | KeyReused


def ingest_many(engine: Engine, items: Sequence[Pending], cache: DeviceCache | None = None) -> list[Outcome]:
    """Store ``items`` in one write transaction; one outcome per item, in order.

    An outcome is an IngestResult, or the AgentIdTaken/KeyReused that refused that batch alone (it wrote
    nothing). Any other error rolls back the whole group and raises. ``cache`` (one per writer thread)
    saves the devices upsert for hosts whose devices did not change.
    """
    try:
        with write_transaction(engine) as conn:
            outcomes = ingest_many_in(conn, items, cache)
    except BaseException:
        if cache is not None:
            cache.rollback()
        raise
    if cache is not None:
        cache.commit()
    return outcomes


def ingest_many_in(conn: Connection, items: Sequence[Pending], cache: DeviceCache | None = None) -> list[Outcome]:
    """``ingest_many`` inside the caller's transaction ``conn``."""
    outcomes: list[Outcome | None] = [None] * len(items)
    owners = _claim_agent_ids(conn, items, cache)
    for i, item in enumerate(items):
        owner = owners[item.batch.agent_id]
        if owner != item.batch.host:
            outcomes[i] = AgentIdTaken(item.batch.agent_id, owner, item.batch.host)
    new = _claim_batches(conn, items, outcomes)
    if new:
        _store(conn, [items[i] for i in new], cache)
        for i in new:
            outcomes[i] = IngestResult(duplicate=False, n_intervals=len(items[i].batch.intervals))
    return [o if o is not None else IngestResult(duplicate=True, n_intervals=0) for o in outcomes]


def _claim_agent_ids(conn: Connection, items: Sequence[Pending], cache: DeviceCache | None = None) -> dict[str, str]:
    """Bind each new agent id to the host of its first batch; every agent id's owner host."""
    first_host: dict[str, tuple[str, float]] = {}
    for item in items:
        first_host.setdefault(item.batch.agent_id, (item.batch.host, item.received_at_s))
    cached = cache.owners if cache is not None else {}
    known = {a: cached[a] for a in first_host if a in cached}
    ids = sorted(a for a in first_host if a not in known)
    if not ids:
        return known
    stmt = select(agents.c.agent_id, agents.c.host).where(agents.c.agent_id.in_(ids))
    known.update({str(a): str(h) for a, h in conn.execute(stmt).all()})
    unknown = [a for a in ids if a not in known]
    if unknown:
        stmt, params = upsert_rows(
            conn,
            agents,
            [{"agent_id": a, "host": first_host[a][0], "first_seen_s": first_host[a][1]} for a in unknown],
        )
        conn.execute(stmt.on_conflict_do_nothing(index_elements=[agents.c.agent_id]), params)
        # Read after the insert: under a race, PostgreSQL's ON CONFLICT waited for the other insert to commit.
        stmt = select(agents.c.agent_id, agents.c.host).where(agents.c.agent_id.in_(unknown))
        known.update({str(a): str(h) for a, h in conn.execute(stmt).all()})
    if cache is not None:
        cache.stage_owners({a: known[a] for a in ids if a in known})
    return known


def _claim_batches(conn: Connection, items: Sequence[Pending], outcomes: list[Outcome | None]) -> list[int]:
    """Insert the keys of the batches not refused yet; the indexes of the batches that are new.

    A key seen before (stored, or earlier in this group) with the same hash makes a duplicate (outcome
    left None), with another hash KeyReused.
    """
    first: dict[tuple[str, int], int] = {}
    for i, item in enumerate(items):
        if outcomes[i] is None:
            first.setdefault((item.batch.agent_id, item.batch.seq), i)
    if not first:
        return []
    ib = ingested_batches
    rows = [
        {
            "agent_id": key[0],
            "seq": key[1],
            "received_at_s": items[i].received_at_s,
            "n_intervals": len(items[i].batch.intervals),
            "body_sha256": items[i].body_sha256,
        }
        for key, i in sorted(first.items())
    ]
    # One INSERT .. ON CONFLICT DO NOTHING RETURNING for the group; the keys it returns are the new ones.
    stmt, params = cached_upsert(
        conn, "claim_batches", ib, rows, lambda base: base.on_conflict_do_nothing().returning(ib.c.agent_id, ib.c.seq)
    )
    stored = {(str(a), int(s)) for a, s in conn.execute(stmt, params).all()}
    stored_sha: dict[tuple[str, int], str | None] = {k: items[first[k]].body_sha256 for k in stored}
    before = [k for k in first if k not in stored]
    if before:
        found = conn.execute(
            select(ib.c.agent_id, ib.c.seq, ib.c.body_sha256).where(tuple_(ib.c.agent_id, ib.c.seq).in_(before))
        ).all()
        stored_sha.update({(str(a), int(s)): sha for a, s, sha in found})
    new = []
    for i, item in enumerate(items):
        if outcomes[i] is not None:
            continue
        key = (item.batch.agent_id, item.batch.seq)
        sha = stored_sha.get(key)
        if key in stored and first[key] == i:
            new.append(i)
        elif sha is not None and sha != item.body_sha256:
            outcomes[i] = KeyReused(
                f"seq {key[1]} of agent_id {key[0]!r} was stored before with other content; an agent never reuses "
                "a seq, so two agents share this spool (cloned?): give each its own $WATTWATCH_HOME/spool.db",
                "seq",
            )
    return new


def _store(conn: Connection, items: Sequence[Pending], cache: DeviceCache | None) -> None:
    """Write the new batches: hosts, devices, jobs, raw intervals and the rollups, one statement per table."""
    host_ids = _upsert_hosts(conn, items, cache)
    device_ids = _upsert_devices(conn, items, host_ids, cache)
    rollups = [rollup_intervals(item.batch.intervals) for item in items]
    # Each job's first interval start, for its row: the rollup has it (before the job records below move it).
    firsts = [{job_id: t.first_s for job_id, t in rollup.job_host.items()} for rollup in rollups]
    _upsert_jobs(conn, items, cache, firsts)

    raw_rows: list[tuple[Any, ...]] = []
    jde: dict[tuple[str, int], tuple[float, float, set[str]]] = {}
    job_hosts: dict[tuple[str, int], JobHostTotals] = {}
    idle: dict[tuple[int, float], float] = {}
    ticks: dict[int, dict[tuple[str, float, float], float]] = {}
    unmeasured_rows: list[tuple[Any, ...]] = []
    for item, rollup in zip(items, rollups, strict=True):
        batch = item.batch
        host_id = host_ids[batch.host]
        dev = device_ids[host_id]
        raw = raw_batches.batch_row(host_id, batch, item.received_at_s)
        if raw is not None:
            raw_rows.append(raw)
        unmeasured_rows += unmeasured.span_rows(batch.intervals, dev)
        for (job_id, key), t in rollup.job_device.items():
            e, p, s = jde.get((job_id, dev[key]), (0.0, 0.0, set()))
            jde[(job_id, dev[key])] = (e + t.energy_j, max(p, t.max_power_w), s | t.sources)
        # A job this host reported is on the host even before (or without) any energy.
        seen = dict(rollup.job_host)
        for job in batch.jobs:
            totals = seen.setdefault(job.id, JobHostTotals())
            start_s = job.started_at_s or item.received_at_s
            totals.first_s = min(totals.first_s, start_s)
            totals.last_s = max(totals.last_s, job.ended_at_s or start_s)
        for job_id, totals in seen.items():
            key2 = (job_id, host_id)
            job_hosts[key2] = _merge_job_host(job_hosts[key2], totals) if key2 in job_hosts else totals
        for (key, hour_s), energy_j in rollup.idle_j.items():
            idle[(dev[key], hour_s)] = idle.get((dev[key], hour_s), 0.0) + energy_j
        host_ticks = ticks.setdefault(host_id, {})
        for tick, energy_j in rollup.job_ticks_j.items():
            host_ticks[tick] = host_ticks.get(tick, 0.0) + energy_j

    per_device: dict[int, tuple[float, float]] = {}
    for (_job_id, device_id), (energy_j, _p, _s) in jde.items():
        job_j, idle_j = per_device.get(device_id, (0.0, 0.0))
        per_device[device_id] = (job_j + energy_j, idle_j)
    for (device_id, _hour_s), energy_j in idle.items():
        job_j, idle_j = per_device.get(device_id, (0.0, 0.0))
        per_device[device_id] = (job_j, idle_j + energy_j)
    # None of these writes needs another's result: on PostgreSQL they go out in one pipeline.
    with pipelined(conn):
        append_rows(conn, tables.raw_batches, raw_batches.COLUMNS, raw_rows)
        append_rows(conn, tables.unmeasured_spans, unmeasured.COLUMNS, unmeasured_rows)
        add_job_device_energy(conn, [(j, d, e, p, sorted(s)) for (j, d), (e, p, s) in jde.items()])
        add_job_hosts(conn, job_hosts)
        add_idle(conn, [(d, h, e) for (d, h), e in idle.items()])
        add_device_energy(conn, per_device)
        record_ticks_many(conn, sorted(ticks.items()))
    # Spans read rows back (RETURNING), which a pipeline cannot give SQLAlchemy: after it.
    for item in items:
        if item.batch.queries or item.batch.query_counts:
            record_spans(conn, host_ids[item.batch.host], item.batch.queries, item.batch.query_counts)


def _merge_job_host(a: JobHostTotals, b: JobHostTotals) -> JobHostTotals:
    """Two batches' totals of one job on one host; "power now" is the later one's."""
    later = b if (b.recent_at_s or float("-inf")) >= (a.recent_at_s or float("-inf")) else a
    return JobHostTotals(
        peak_power_w=max(a.peak_power_w, b.peak_power_w),
        first_s=min(a.first_s, b.first_s),
        last_s=max(a.last_s, b.last_s),
        recent_power_w=later.recent_power_w if later.recent_at_s is not None else None,
        recent_at_s=later.recent_at_s,
    )


def _upsert_hosts(conn: Connection, items: Sequence[Pending], cache: DeviceCache | None = None) -> dict[str, int]:
    latest: dict[str, tuple[str, float]] = {}
    # The grid region each host's agent sent last in this group (carbon_policy); a host whose batches send
    # none keeps the one stored (an older agent, or one started without --grid-region).
    regions: dict[str, tuple[str, float]] = {}
    for item in items:
        b = item.batch
        if b.host not in latest or item.received_at_s >= latest[b.host][1]:
            latest[b.host] = (b.agent_id, item.received_at_s)
        if not isinstance(b.grid_region, msgspec.UnsetType) and (
            b.host not in regions or item.received_at_s >= regions[b.host][1]
        ):
            regions[b.host] = (grid.normalize(b.grid_region), item.received_at_s)
    pg = conn.dialect.name == "postgresql"

    def merge(base: Any) -> Any:
        new = base.excluded
        stmt = base.on_conflict_do_update(
            index_elements=[hosts.c.name],
            set_={
                "last_seen_s": greatest(conn, hosts.c.last_seen_s, new.last_seen_s),
                "agent_id": new.agent_id,
                "grid_region": func.coalesce(new.grid_region, hosts.c.grid_region),
            },
        )
        # PostgreSQL returns the ids of inserted and updated rows alike: no second round trip to read them.
        return stmt.returning(hosts.c.name, hosts.c.id) if pg else stmt

    stmt, params = cached_upsert(
        conn,
        "upsert_hosts",
        hosts,
        [
            {
                "name": name,
                "agent_id": agent_id,
                "first_seen_s": seen_s,
                "last_seen_s": seen_s,
                "grid_region": regions[name][0] if name in regions else None,
            }
            for name, (agent_id, seen_s) in sorted(latest.items())
        ],
        merge,
    )
    if pg:
        return {str(name): int(host_id) for name, host_id in conn.execute(stmt, params).all()}
    execute_rows(conn, stmt, params)
    cached = cache.host_ids if cache is not None else {}
    out = {name: cached[name] for name in latest if name in cached}
    missing = sorted(name for name in latest if name not in out)
    if missing:
        rows = conn.execute(select(hosts.c.name, hosts.c.id).where(hosts.c.name.in_(missing))).all()
        read = {str(name): int(host_id) for name, host_id in rows}
        if cache is not None:
            cache.stage_host_ids(read)
        out.update(read)
    return out


def _upsert_devices(
    conn: Connection, items: Sequence[Pending], host_ids: dict[str, int], cache: DeviceCache | None
) -> dict[int, dict[str, int]]:
    described: dict[int, dict[str, tuple[Any, ...]]] = {}
    for item in items:  # a later batch's description of a device wins, as across transactions
        host = described.setdefault(host_ids[item.batch.host], {})
        for d in item.batch.devices:
            host[d.key] = (d.key, d.kind, d.index, d.uuid, d.model, d.power_limit_w)
    out: dict[int, dict[str, int]] = {}
    todo: dict[int, DeviceRows] = {}
    for host_id, devs in described.items():
        rows = tuple(devs[k] for k in sorted(devs))
        cached = cache.get(host_id, rows) if cache is not None else None
        if cached is not None:
            out[host_id] = cached
        else:
            todo[host_id] = rows
    if not todo:
        return out
    upserts = [(host_id, row) for host_id, rows in sorted(todo.items()) for row in rows]
    if upserts:
        stmt = upsert(conn, devices)
        conn.execute(
            stmt.on_conflict_do_update(
                index_elements=[devices.c.host_id, devices.c.key],
                set_={
                    "kind": stmt.excluded.kind,
                    "index": stmt.excluded["index"],
                    "uuid": stmt.excluded.uuid,
                    "model": stmt.excluded.model,
                    "power_limit_w": stmt.excluded.power_limit_w,
                },
            ),
            [
                dict(zip(("host_id", "key", "kind", "index", "uuid", "model", "power_limit_w"), (h, *r), strict=True))
                for h, r in upserts
            ],
        )
    ids = sorted(todo)
    found: dict[int, dict[str, int]] = {h: {} for h in ids}
    for host_id, key, device_id in conn.execute(
        select(devices.c.host_id, devices.c.key, devices.c.id).where(devices.c.host_id.in_(ids))
    ):
        found[int(host_id)][str(key)] = int(device_id)
    for host_id in ids:
        # Cached only when the host's stored devices are exactly the ones described (none left from before).
        if cache is not None and len(found[host_id]) == len(todo[host_id]):
            cache.stage(host_id, todo[host_id], found[host_id])
    out.update(found)
    return out


def _upsert_jobs(
    conn: Connection,
    items: Sequence[Pending],
    cache: DeviceCache | None = None,
    firsts: Sequence[dict[str, float]] | None = None,
) -> None:
    """Job records and placeholders of the group; one statement each unless two batches record one job.
    ``firsts``: per item, each job's first interval start (``job_writes.job_rows``)."""
    if firsts is None:
        per_item = [job_rows(item.batch, item.received_at_s) for item in items]
    else:
        per_item = [job_rows(i.batch, i.received_at_s, f) for i, f in zip(items, firsts, strict=True)]
    real_ids = [r["id"] for rows in per_item for r in rows if not r["placeholder"]]
    real = set(real_ids)
    # Membership tests only: other writer threads add to it (under the GIL, a test sees it whole).
    known = cache.jobs if cache is not None else set()
    placeholders: dict[str, dict[str, Any]] = {}
    for rows in per_item:
        for r in rows:
            if r["placeholder"] and r["id"] not in real and r["id"] not in known:
                if r["id"] in placeholders:
                    r = {**r, "started_at_s": min(r["started_at_s"], placeholders[r["id"]]["started_at_s"])}
                placeholders[r["id"]] = r
    if placeholders:
        upsert_job_rows(conn, [placeholders[k] for k in sorted(placeholders)])
    if cache is not None:
        cache.stage_jobs(real | placeholders.keys())
    if not real_ids:
        return
    if len(real) == len(real_ids):
        # One lock order for every writer (PostgreSQL deadlocks): rows sorted by id.
        upsert_job_rows(conn, sorted((r for rows in per_item for r in rows if not r["placeholder"]), key=_id))
    else:  # two records of one job in the group: apply them in order, as separate batches would
        for rows in per_item:
            upsert_job_rows(conn, [r for r in rows if not r["placeholder"]])
    for item, rows in zip(items, per_item, strict=True):
        running = [r["id"] for r in rows if not r["placeholder"] and r["ended_at_s"] is None]
        reopen_jobs(conn, running, item.batch.sent_at_s)


def _id(row: dict[str, Any]) -> str:
    return str(row["id"])
