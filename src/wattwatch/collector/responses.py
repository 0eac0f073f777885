"""What the collector answers, as msgspec Structs: the OpenAPI document's response schemas (``contract``).

The routes build plain dicts (``storage.reads``); these Structs only describe them, so the document can
state every field, its type and whether it may be null. tests/test_contract.py holds the two together:
schemathesis checks every response against these schemas on SQLite and PostgreSQL.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from wattwatch.protocol.units import DeviceKind, JobKind, Source

Joules = Annotated[float, msgspec.Meta(description="joules")]
Seconds = Annotated[float, msgspec.Meta(description="seconds")]
Watts = Annotated[float, msgspec.Meta(description="watts")]
Epoch_s = Annotated[float, msgspec.Meta(description="Unix time, seconds")]
Count = Annotated[int, msgspec.Meta(ge=0)]
# ISO 8601 in UTC with a Z (``units.iso_utc``); msgspec states no format for a datetime, so it is said here.
Timestamp = Annotated[str, msgspec.Meta(extra_json_schema={"format": "date-time"})]


class Error(msgspec.Struct):
    """Every 4xx and 5xx body: what went wrong, and the field of the request it is about (a dotted path
    such as ``intervals[0].energy_j``, a parameter or header name; null when no one field is to blame)."""

    error: str
    field: str | None


class IngestResult(msgspec.Struct):
    """``POST /api/v1/ingest``: the batch is stored (``duplicate``: it was already, by ``(agent_id, seq)``)."""

    accepted: Literal[True]
    duplicate: bool
    intervals: Annotated[Count, msgspec.Meta(description="intervals of the batch stored now (0 for a duplicate)")]


class QueriesResult(msgspec.Struct, omit_defaults=True):
    """``POST /api/v1/jobs/{job_id}/queries``: spans stored now; ``duplicate`` only with an Idempotency-Key."""

    accepted: Count
    duplicate: bool = False


class PerHost(msgspec.Struct):
    """A job's energy and peak power on one of its hosts."""

    host: str
    energy_j: Joules
    peak_power_w: Watts
    grid_intensity_g_per_kwh: Annotated[float, msgspec.Meta(description="gCO2e/kWh of this host's grid")]
    emissions_g: Annotated[float, msgspec.Meta(description="grams CO2e of this host's share")]


class Phase(msgspec.Struct):
    """Energy a job's process drew before the job opened (``setup``) or after it ended (``after``)."""

    id: str
    phase: Literal["setup", "after"]
    energy_j: Joules
    started_at_s: Epoch_s
    ended_at_s: Epoch_s | None
    duration_s: Seconds


class JobEntry(msgspec.Struct):
    """One job's report entry (DESIGN.md's report JSON plus extras); null where a figure does not apply."""

    id: str
    short_id: Annotated[str, msgspec.Meta(description="the shortest id prefix (8+) unique in the database")]
    name: str
    kind: JobKind
    started_at: Timestamp
    ended_at: Timestamp | None
    duration_s: Seconds
    hosts: list[str]
    devices: Annotated[list[str], msgspec.Meta(description="host/device keys the job drew energy from")]
    energy_j: Joules
    gpu_energy_j: Joules
    cpu_energy_j: Joules
    dram_energy_j: Joules
    avg_power_w: Watts | None
    unmeasured_s: Annotated[
        Seconds,
        msgspec.Meta(
            ge=0,
            description="of duration_s, the seconds in which one of its devices was not measured (an agent's full "
            "disk, an outage no counter bridged): its energy then is not in energy_j",
        ),
    ]
    peak_power_w: Watts
    queries: Count
    tokens: Count
    tokens_in: Count
    tokens_out: Count
    query_method: Literal["spans", "counts"] | None
    queries_settled: Count
    energy_per_query_j: Joules | None
    energy_per_query_p50_j: Joules | None
    energy_per_query_p95_j: Joules | None
    energy_per_token_j: Joules | None
    waiting_energy_j: Joules | None
    steps: Count
    steps_settled: Count
    energy_per_step_j: Joules | None
    energy_per_step_p50_j: Joules | None
    energy_per_step_p95_j: Joules | None
    epochs: Count
    energy_per_epoch_j: Joules | None
    emissions_g: Annotated[float, msgspec.Meta(description="grams CO2e: each host's kWh x PUE x its intensity")]
    cost: Annotated[float | None, msgspec.Meta(description="kWh x PUE x price_per_kwh (null: no price set)")]
    grid_intensity_g_per_kwh: Annotated[float, msgspec.Meta(description="gCO2e/kWh, energy-weighted over hosts")]
    intensity_source: Annotated[str, msgspec.Meta(description="where the intensity comes from")]
    pue: Annotated[float, msgspec.Meta(description="power usage effectiveness applied")]
    sources: list[Source]
    labels: dict[str, str]
    running: bool
    ended_by: str | None
    started_at_s: Epoch_s
    ended_at_s: Epoch_s | None
    per_host: list[PerHost]
    source_note: str | None
    setup_energy_j: Joules | None
    setup_duration_s: Seconds | None
    after_energy_j: Joules | None
    after_duration_s: Seconds | None
    phases: list[Phase]
    phase: Literal["setup", "after"] | None
    phase_of: str | None
    reason: Annotated[str | None, msgspec.Meta(description="why it shows 0 J or no GPU (null: nothing to explain)")]
    fix: Annotated[str | None, msgspec.Meta(description="what to do about `reason`")]


class JobList(msgspec.Struct):
    """``GET /api/v1/jobs``: the newest jobs first."""

    jobs: list[JobEntry]


class Idle(msgspec.Struct):
    """Energy of one device that no job held."""

    host: str
    device: str
    energy_j: Joules
    device_kind: DeviceKind


class ReportWindow(msgspec.Struct):
    """Which jobs a report covers: those that ended at or after ``since_at`` or still run; null times
    when no window applies (a report of one job)."""

    since: str | None  # the duration or date asked for (or the default), e.g. "7d"
    since_s: Epoch_s | None
    since_at: Timestamp | None
    default: bool  # true when no ``since`` was given and the collector's default window applied


class HostIntensity(msgspec.Struct):
    """The grid intensity a host's energy is charged at, and where the figure comes from."""

    host: str
    region: Annotated[str | None, msgspec.Meta(description="FRA, gcp:europe-west9; null: the configured default")]
    g_per_kwh: Annotated[float, msgspec.Meta(description="gCO2e per kWh")]
    source: Annotated[str, msgspec.Meta(description="e.g. 'codecarbon data: France (FRA) 2023' or 'config default'")]


class KindCarbon(msgspec.Struct):
    """Energy, emissions and cost of the report's jobs of one kind."""

    kind: JobKind
    energy_j: Joules
    emissions_g: float
    cost: float | None


class CarbonSummary(msgspec.Struct):
    """What the report's emissions and costs rest on, and their totals."""

    pue: float
    price_per_kwh: Annotated[float | None, msgspec.Meta(description="null: no price configured")]
    currency: str | None
    default_g_per_kwh: Annotated[float, msgspec.Meta(description="for hosts with no region (config)")]
    hosts: list[HostIntensity]
    by_kind: list[KindCarbon]
    emissions_g: float
    cost: float | None


class Report(msgspec.Struct):
    """``GET /api/v1/report``: one page of jobs in start order, and idle energy per device (first page only).

    ``next_cursor`` is null on the last page, else the ``cursor`` that asks for the next one."""

    jobs: list[JobEntry]
    idle: list[Idle]
    filters: Annotated[
        dict[str, str | list[str]], msgspec.Meta(description="the filters given (since/until as ISO times)")
    ]
    jobs_recorded: Annotated[bool, msgspec.Meta(description="whether the database holds any job at all")]
    idle_from: Annotated[Timestamp | None, msgspec.Meta(description="idle energy counts whole hours from here")]
    idle_until: Annotated[Timestamp | None, msgspec.Meta(description="... up to here")]
    next_cursor: str | None
    jobs_matched: Annotated[
        int, msgspec.Meta(description="jobs matching the filters on all pages (the page's count if it is the only one)")
    ]
    window: ReportWindow
    carbon: Annotated[CarbonSummary, msgspec.Meta(description="intensity per host, its source, PUE, price, totals")]


class Health(msgspec.Struct, omit_defaults=True):
    """``GET /healthz``: the process answers; ``ok`` false (503) when a worker thread died, named in
    ``dead_threads``."""

    ok: bool
    dead_threads: list[str] = []


class Readiness(msgspec.Struct, omit_defaults=True):
    """``GET /readyz``: whether the database is reachable and migrated; ``error`` says why not."""

    ready: bool
    error: str | None = None


class LiveDevice(msgspec.Struct):
    """One device of a host in ``GET /api/v1/live``: its power over its latest second pushed."""

    device: str
    kind: DeviceKind
    model: str | None
    power_w: Watts | None
    power_at_s: Annotated[Epoch_s | None, msgspec.Meta(description="when that reading ends (null: none lately)")]
    jobs: Annotated[list[str], msgspec.Meta(description="ids of the running jobs holding it")]


class LiveHost(msgspec.Struct):
    """A host heard from in the last 10 minutes, and its devices."""

    host: str
    last_seen_s: Epoch_s
    devices: list[LiveDevice]


class LiveJob(msgspec.Struct):
    """A running job as ``wattwatch top`` shows it (its report entry's figures so far)."""

    id: str
    short_id: str
    name: str
    kind: JobKind
    started_at_s: Epoch_s
    duration_s: Seconds
    energy_j: Joules
    avg_power_w: Watts | None
    queries: Count
    energy_per_query_j: Joules | None
    steps: Count
    energy_per_step_j: Joules | None
    devices: list[str]
    reason: str | None
    gpu_power_w: Annotated[
        Watts | None, msgspec.Meta(description="power now of the GPUs it holds (a shared GPU split evenly)")
    ]


class Live(msgspec.Struct):
    """``GET /api/v1/live``: power now per device, and the running jobs with their energy so far."""

    at_s: Epoch_s
    hosts: list[LiveHost]
    jobs: list[LiveJob]


RESPONSE_BODIES: tuple[type, ...] = (
    Error,
    IngestResult,
    QueriesResult,
    JobEntry,
    JobList,
    Report,
    Health,
    Readiness,
    Live,
)
