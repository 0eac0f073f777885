"""Per-query and per-step figures of the report, read from ``span_stats`` and ``job_query_totals``: O(jobs).

Which method a job's energy per query comes from:

- ``"spans"`` when the job sent request spans: every query's own share (mean, p50, p95), waiting
  energy apart;
- ``"counts"`` when it only has counts (a serving engine's counters): the energy of the windows the
  counts cover / the queries completed in them; no percentiles; waiting is the energy outside them;
- ``None`` when it has neither.

Per-query figures exclude waiting energy, so for a finished job whose spans are all settled,
``energy_per_query_j * queries + waiting_energy_j == energy_j``. They cover the settled spans only
(``queries_settled``), so a running job's figures trail its newest data by the settle delay.
``energy_per_token_j`` is the settled queries' energy / their tokens, a token being one of
``tokens_in + tokens_out`` (prompt and generated tokens count alike). Steps and epochs are shared
among themselves (steps among steps in flight, epochs among epochs), never with queries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, Select, select

from wattwatch.storage.dialect import among
from wattwatch.storage.spans import COUNT_KIND
from wattwatch.storage.tables import job_query_totals, span_stats


@dataclass(frozen=True)
class SpanFigures:
    """A job's query and step counts and energies, as the report shows them."""

    queries: int = 0
    tokens_in: int = 0
    tokens_out: int = 0
    query_method: str | None = None
    queries_settled: int = 0
    energy_per_query_j: float | None = None
    energy_per_query_p50_j: float | None = None
    energy_per_query_p95_j: float | None = None
    energy_per_token_j: float | None = None
    waiting_energy_j: float | None = None
    steps: int = 0
    steps_settled: int = 0
    energy_per_step_j: float | None = None
    energy_per_step_p50_j: float | None = None
    energy_per_step_p95_j: float | None = None
    epochs: int = 0
    energy_per_epoch_j: float | None = None

    def report_fields(self) -> dict[str, Any]:
        """The report entry's keys for these figures (``queries``, ``tokens``, ``energy_per_query_j``, ...)."""
        return {
            "queries": self.queries,
            "tokens": self.tokens_in + self.tokens_out,
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "query_method": self.query_method,
            "queries_settled": self.queries_settled,
            "energy_per_query_j": self.energy_per_query_j,
            "energy_per_query_p50_j": self.energy_per_query_p50_j,
            "energy_per_query_p95_j": self.energy_per_query_p95_j,
            "energy_per_token_j": self.energy_per_token_j,
            "waiting_energy_j": self.waiting_energy_j,
            "steps": self.steps,
            "steps_settled": self.steps_settled,
            "energy_per_step_j": self.energy_per_step_j,
            "energy_per_step_p50_j": self.energy_per_step_p50_j,
            "energy_per_step_p95_j": self.energy_per_step_p95_j,
            "epochs": self.epochs,
            "energy_per_epoch_j": self.energy_per_epoch_j,
        }


def read_span_figures(conn: Connection, job_ids: Select[Any] | list[str]) -> dict[str, SpanFigures]:
    """Figures for the jobs ``job_ids`` selects (or lists); a job with no spans or counts is absent (all zero/None)."""
    totals = {
        r.job_id: r
        for r in conn.execute(select(job_query_totals).where(among(conn, job_query_totals.c.job_id, job_ids)))
    }
    stats: dict[str, dict[str, Any]] = {}
    for r in conn.execute(select(span_stats).where(among(conn, span_stats.c.job_id, job_ids))):
        stats.setdefault(r.job_id, {})[r.kind] = r
    return {job_id: _figures(totals.get(job_id), stats.get(job_id, {})) for job_id in {*totals, *stats}}


def _mean(energy_j: float, n: int) -> float | None:
    return energy_j / n if n else None


def _figures(totals: Any, stats: dict[str, Any]) -> SpanFigures:
    if totals is None:
        return SpanFigures()
    fields: dict[str, Any] = {"steps": int(totals.steps), "epochs": int(totals.epochs)}
    if totals.queries:
        method, st = "spans", stats.get("query")
        fields.update(queries=int(totals.queries), tokens_in=int(totals.tokens_in), tokens_out=int(totals.tokens_out))
    elif totals.counted_queries:
        method, st = "counts", stats.get(COUNT_KIND)
        fields.update(
            queries=int(totals.counted_queries),
            tokens_in=int(totals.counted_tokens_in),
            tokens_out=int(totals.counted_tokens_out),
        )
    else:
        method, st = None, None
    fields["query_method"] = method
    if st is not None:
        fields.update(
            queries_settled=int(st.settled_queries),
            energy_per_query_j=_mean(st.settled_energy_j, st.settled_queries),
            energy_per_token_j=_mean(st.settled_energy_j, st.settled_tokens),
            waiting_energy_j=st.waiting_energy_j if st.computed_to_s is not None else None,
        )
        if method == "spans":
            fields.update(energy_per_query_p50_j=st.p50_j, energy_per_query_p95_j=st.p95_j)
    step = stats.get("step")
    if step is not None:
        fields.update(
            steps_settled=int(step.settled_spans),
            energy_per_step_j=_mean(step.settled_energy_j, step.settled_spans),
            energy_per_step_p50_j=step.p50_j,
            energy_per_step_p95_j=step.p95_j,
        )
    epoch = stats.get("epoch")
    if epoch is not None:
        fields["energy_per_epoch_j"] = _mean(epoch.settled_energy_j, epoch.settled_spans)
    return SpanFigures(**fields)
