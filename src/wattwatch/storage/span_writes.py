"""What the span-energy pass (``storage.span_energy``) writes: span energies, and the energy waiting per
minute for spans not yet in (``span_waiting``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import BigInteger, Connection, Float, Table, and_, bindparam, delete, text, update

from wattwatch.storage.dialect import pg_array
from wattwatch.storage.tables import span_waiting


def store_energies(conn: Connection, table: Table, writes: Sequence[Mapping[str, Any]]) -> None:
    """Set ``energy_j`` of each span ``b_id`` to ``b_energy``.

    On PostgreSQL one statement over two arrays: an UPDATE per row, even pipelined, takes about twice as
    long (6,000 spans of a 100 requests/s server: 0.19 s against 0.09 s).
    """
    if not writes:
        return
    c = table.c
    if conn.dialect.name != "postgresql":
        conn.execute(update(table).where(c.id == bindparam("b_id")).values(energy_j=bindparam("b_energy")), writes)
        return
    conn.execute(
        text(
            f"UPDATE {table.name} SET energy_j = v.energy_j"
            " FROM unnest(CAST(:ids AS BIGINT[]), CAST(:energies AS DOUBLE PRECISION[])) AS v(id, energy_j)"
            f" WHERE {table.name}.id = v.id"
        ),
        {
            "ids": pg_array([w["b_id"] for w in writes], BigInteger()),
            "energies": pg_array([w["b_energy"] for w in writes], Float()),
        },
    )


def replace_waiting(
    conn: Connection, job_id: str, kind: str, w0: float, w1: float, by_bucket_j: Mapping[float, float]
) -> float:
    """Replace the waiting minutes in ``[w0, w1)``; returns new total - old total."""
    w = span_waiting.c
    in_window = and_(w.job_id == job_id, w.kind == kind, w.bucket_s >= w0, w.bucket_s < w1)
    old = conn.execute(delete(span_waiting).where(in_window).returning(w.energy_j)).scalars().all()
    new = [(b, e) for b, e in sorted(by_bucket_j.items()) if e]
    if new:
        conn.execute(
            span_waiting.insert(), [{"job_id": job_id, "kind": kind, "bucket_s": b, "energy_j": e} for b, e in new]
        )
    return math.fsum([*(e for _, e in new), *(-x for x in old)])
