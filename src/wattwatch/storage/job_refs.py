"""Job references people can type: a job's full id, a unique prefix of it, or its name.

``resolve_job_ref`` is what ``wattwatch report --job`` (local database) and ``GET /api/v1/report?job=``
(a collector) both use, so a reference means the same job either way. ``short_ids`` is the id prefix a
table shows: the shortest one (at least ``MIN_SHORT_ID`` characters) that no other job's id starts with,
so what a person copies from a table is accepted back.

Phases (``jobs.phase_of``) are hidden rows: a prefix or a name never selects one, its full id still does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, func, literal_column, or_, select

from wattwatch.storage.dialect import among
from wattwatch.storage.tables import jobs

# Eight characters of a uuid4 hex id: one clash in ~4 billion pairs, and short enough to type.
MIN_SHORT_ID = 8
# How many candidates an ambiguous reference lists before "and N more".
MAX_LISTED = 5


@dataclass(frozen=True)
class Candidate:
    """A job a reference may mean."""

    id: str
    short_id: str
    name: str
    started_at_s: float


class AmbiguousJob(ValueError):
    """A reference matched more than one job; ``str()`` is one line listing them and what to do."""

    def __init__(self, ref: str, candidates: list[Candidate], total: int) -> None:
        self.ref = ref
        self.candidates = candidates
        self.total = total
        shown = ", ".join(f"{c.short_id} ({c.name}, started {_minute(c.started_at_s)})" for c in candidates)
        more = f" and {total - len(candidates)} more" if total > len(candidates) else ""
        super().__init__(f"job {ref!r} is ambiguous: it matches {total} jobs: {shown}{more}; give more of the id")


def resolve_job_ref(conn: Connection, ref: str) -> str | None:
    """The id of the one job ``ref`` names (full id, unique id prefix, or name); None when none does.

    Raises AmbiguousJob when it names several. A full id wins over everything else.
    """
    if conn.execute(select(jobs.c.id).where(jobs.c.id == ref)).first() is not None:
        return ref
    # LIKE finds them with an index where there is one; the substr equality makes it exact (SQLite's LIKE
    # ignores case, and ids are case-sensitive).
    by_prefix = jobs.c.id.startswith(ref, autoescape=True) & (func.substr(jobs.c.id, 1, len(ref)) == ref)
    where = (jobs.c.phase_of.is_(None), or_(by_prefix, jobs.c.name == ref))
    total = int(conn.execute(select(func.count()).select_from(jobs).where(*where)).scalar_one())
    if total == 0:
        return None
    rows = conn.execute(
        select(jobs.c.id, jobs.c.name, jobs.c.started_at_s)
        .where(*where)
        .order_by(jobs.c.started_at_s.desc(), jobs.c.id)
        .limit(MAX_LISTED)
    ).all()
    if total == 1:
        return str(rows[0].id)
    shorts = short_ids(conn, [r.id for r in rows])
    raise AmbiguousJob(ref, [Candidate(r.id, shorts[r.id], r.name, r.started_at_s) for r in rows], total)


def short_ids(conn: Connection, ids: Iterable[str]) -> dict[str, str]:
    """job id -> the shortest prefix (at least MIN_SHORT_ID characters) no other job's id starts with.

    Reads only the ids sharing the first MIN_SHORT_ID - 2 characters with one of ``ids``: with random ids
    that is about ``ids`` themselves, so this stays proportional to the jobs shown, not to the table.
    """
    wanted = set(ids)
    if not wanted:
        return {}
    stem = MIN_SHORT_ID - 2
    stems = sorted({i[:stem] for i in wanted})
    # The expression of index ix_jobs_id_stem (migration 0011), constants inline so the planner matches it.
    id_stem = func.substr(jobs.c.id, literal_column("1"), literal_column(str(stem)))
    others: set[str] = set()
    for chunk_start in range(0, len(stems), 500):  # bound the IN list
        chunk = stems[chunk_start : chunk_start + 500]
        others.update(
            conn.execute(select(jobs.c.id).where(jobs.c.phase_of.is_(None), among(conn, id_stem, chunk))).scalars()
        )
    ordered = sorted(others | set(wanted))
    out: dict[str, str] = {}
    for i, job_id in enumerate(ordered):
        if job_id not in wanted:
            continue
        shared = 0
        for neighbour in (ordered[i - 1] if i else None, ordered[i + 1] if i + 1 < len(ordered) else None):
            if neighbour is not None:
                shared = max(shared, _common_prefix(job_id, neighbour))
        out[job_id] = job_id[: max(MIN_SHORT_ID, shared + 1)]
    return out


def _minute(t_s: float) -> str:
    return datetime.fromtimestamp(t_s, tz=UTC).strftime("%Y-%m-%d %H:%MZ")


def _common_prefix(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
