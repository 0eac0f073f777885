"""The schema, as SQLAlchemy Core tables. Migrations create it; code reads and writes through these.

Times are Unix epoch seconds (``*_s``, Float) and energies joules (``*_j``, Float), like the wire
format, so nothing is converted between agent, database and report. ``raw_batches`` is the raw record
(every batch's intervals with their shares, one row per batch: ``storage.raw_batches``; revisions before
0010 wrote a row per interval into ``energy_intervals``, kept until retention empties it);
``job_device_energy``, ``job_hosts``, ``idle_energy``, ``job_query_totals`` and ``unmeasured_spans`` are
rollups that ingest keeps current, so reports read O(jobs) rows, never the raw intervals.

Per-span energy (``storage.span_energy``): ``job_ticks`` is each job's energy timeline, ``queries``
and ``query_counts`` the spans and counts it is shared among, ``span_dirty`` the queue of jobs with
data not yet shared out, and ``span_stats``/``span_waiting`` the results reports read.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
    text,
)

# Named constraints, so later migrations can alter them by name on every backend.
metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

hosts = Table(
    "hosts",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("name", String(200), nullable=False, unique=True),
    Column("agent_id", String(200), nullable=True),
    Column("first_seen_s", Float, nullable=False),
    Column("last_seen_s", Float, nullable=False),
    # The grid region its agent sent (canonical: FRA, gcp:europe-west9): wattwatch.carbon.policy.
    Column("grid_region", String(64), nullable=True),
)

devices = Table(
    "devices",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="CASCADE"), nullable=False),
    Column("key", String(200), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("index", Integer, nullable=False, default=0),
    Column("uuid", String(200), nullable=True),
    Column("model", String(200), nullable=True),
    Column("power_limit_w", Float, nullable=True),
    UniqueConstraint("host_id", "key"),
)

jobs = Table(
    "jobs",
    metadata,
    Column("id", String(200), primary_key=True),
    Column("name", String(200), nullable=False),
    Column("kind", String(16), nullable=False),
    Column("labels", JSON, nullable=False),
    Column("started_at_s", Float, nullable=False),
    Column("ended_at_s", Float, nullable=True),
    Column("created_at_s", Float, nullable=False),
    # True while only intervals or queries have named the job; the first real job record replaces
    # name, kind and labels and clears it.
    Column("placeholder", Boolean, nullable=False, default=False),
    # Longest job_ticks row of the job (s): how far back a window must look for ticks reaching into it.
    # Kept by the span-energy pass (from span_dirty marks), so ingest never updates the jobs row for it.
    Column("max_tick_s", Float, nullable=False, default=0.0, server_default="0"),
    # Null: the job's own process or client ended it. Else who did (wire.Job.ended_by, or the collector's
    # ``collector-silent-agent`` for a job no host reported for too long; an agent's later end replaces it).
    Column("ended_by", String(40), nullable=True),
    # A phase of another job's process (wire.PHASE_LABEL): "setup" (before that job opened) or "after"
    # (after it ended), and that job's id; NULL for ordinary jobs. Reports show the row with that job.
    Column("phase", String(8), nullable=True),
    Column("phase_of", String(200), nullable=True),
    Index(None, "started_at_s"),
    Index(None, "ended_at_s"),
    Index(None, "phase_of"),
    # The first MIN_SHORT_ID - 2 characters of the id: storage.job_refs.short_ids (migration 0011).
    Index("ix_jobs_id_stem", text("substr(id, 1, 6)")),
)

energy_intervals = Table(
    "energy_intervals",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    # devices.id, without a foreign key: checking it was most of a raw row's insert (migration 0007).
    Column("device_id", Integer, nullable=False),
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("energy_j", Float, nullable=False),
    Column("source", String(16), nullable=False),
    Column("flags", String(200), nullable=False, default=""),
    Index(None, "device_id", "t_start_s"),
)

# Time a device was not measured: its intervals flagged ``gap`` or ``restart_gap`` (storage.unmeasured), one
# row each, kept at ingest so reports say how much of a job's window no reading covers (migration 0013).
unmeasured_spans = Table(
    "unmeasured_spans",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("flag", String(24), nullable=False),
    Index(None, "device_id", "t_start_s"),
)

raw_batches = Table(
    "raw_batches",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    # hosts.id, without a foreign key (like energy_intervals since 0007: checked per row, it guarded nothing).
    Column("host_id", Integer, nullable=False),
    Column("agent_id", String(200), nullable=False),
    Column("seq", BigInteger, nullable=False),
    Column("received_at_s", Float, nullable=False),
    # The batch's earliest interval start and latest end, how many it holds and their energy summed, so
    # ad-hoc SQL can total raw energy per host and time without decoding ``body``.
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("n_intervals", Integer, nullable=False),
    Column("energy_j", Float, nullable=False),
    # How ``body`` is encoded (storage.raw_batches.FORMAT_ZLIB_MSGPACK = 1).
    Column("format", Integer, nullable=False),
    Column("body", LargeBinary, nullable=False),
    Index(None, "host_id", "t_start_s"),
    Index(None, "t_end_s"),
)

job_device_energy = Table(
    "job_device_energy",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    Column("energy_j", Float, nullable=False),
    Column("sources", String(200), nullable=False),  # comma list of distinct sources
    Column("max_power_w", Float, nullable=False),
)

job_hosts = Table(
    "job_hosts",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="CASCADE"), primary_key=True),
    Column("peak_power_w", Float, nullable=False),
    Column("first_s", Float, nullable=False),
    Column("last_s", Float, nullable=False),
    # Power now: the job's power over each device's latest pushed second, summed over the host's devices,
    # and where the latest of those ends.
    Column("power_w", Float, nullable=True),
    Column("power_at_s", Float, nullable=True),
)

idle_energy = Table(
    "idle_energy",
    metadata,
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    Column("hour_s", Float, primary_key=True),
    Column("energy_j", Float, nullable=False),
    Index(None, "hour_s"),  # a report's window selects hours across devices (migration 0008)
)

# The same idle energy per device and UTC day, added to by ingest in the same transaction as idle_energy
# (so a day's row always equals the sum of that day's idle_energy rows): a report whose idle window is whole
# days (every window reaching back past two days, idle.idle_bounds) sums about 8 rows per device for a
# week instead of 50 (migration 0012).
idle_energy_days = Table(
    "idle_energy_days",
    metadata,
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    Column("day_s", Float, primary_key=True),
    Column("energy_j", Float, nullable=False),
    Index(None, "day_s"),
)

# Each device's energy ever: the sum of its job_device_energy and idle_energy rows, added to by ingest in
# the same transaction, so /metrics reads one row per device rather than summing history (migration 0008).
device_energy = Table(
    "device_energy",
    metadata,
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    Column("job_energy_j", Float, nullable=False),
    Column("idle_energy_j", Float, nullable=False),
)

queries = Table(
    "queries",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="SET NULL"), nullable=True),
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("tokens_in", Integer, nullable=False),
    Column("tokens_out", Integer, nullable=False),
    # query | step | epoch (wire.SpanKind); the table keeps its first name, "queries".
    Column("kind", String(8), nullable=False, default="query", server_default="query"),
    # The span's share of its job's energy (J); NULL until the span is settled and computed.
    Column("energy_j", Float, nullable=True),
    Index(None, "job_id", "kind", "t_start_s"),
)

# Completed-request counts over windows (a serving engine's counters, scraped): no spans, so energy
# per query is the energy of the windows / the queries they completed.
query_counts = Table(
    "query_counts",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="SET NULL"), nullable=True),
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("queries", BigInteger, nullable=False),
    Column("tokens_in", BigInteger, nullable=False),
    Column("tokens_out", BigInteger, nullable=False),
    Column("energy_j", Float, nullable=True),  # the window's share of the job's energy, once computed
    Index(None, "job_id", "t_start_s"),
)

# Counts per job, so a report need not count the queries table (it grows with traffic).
job_query_totals = Table(
    "job_query_totals",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("queries", BigInteger, nullable=False),  # spans of kind "query" only
    Column("tokens_in", BigInteger, nullable=False),
    Column("tokens_out", BigInteger, nullable=False),
    Column("steps", BigInteger, nullable=False, default=0, server_default="0"),
    Column("epochs", BigInteger, nullable=False, default=0, server_default="0"),
    # Sums of QueryCount records (counts-only serving metrics).
    Column("counted_queries", BigInteger, nullable=False, default=0, server_default="0"),
    Column("counted_tokens_in", BigInteger, nullable=False, default=0, server_default="0"),
    Column("counted_tokens_out", BigInteger, nullable=False, default=0, server_default="0"),
)

# A job's energy per tick on one host (summed over the host's devices): what spans share. Packed,
# one row per job, host and batch (split so a row covers at most PACKED_SPAN_S of tick starts), since
# one row per tick would add as many rows as the raw intervals themselves on every batch.
job_ticks = Table(
    "job_ticks",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("host_id", Integer, ForeignKey("hosts.id", ondelete="SET NULL"), nullable=True),
    Column("t_start_s", Float, nullable=False),  # earliest tick start in the row
    Column("t_end_s", Float, nullable=False),  # latest tick end in the row
    Column("ticks", LargeBinary, nullable=False),  # little-endian float64 (t_start_s, t_end_s, energy_j) triples
    Index(None, "job_id", "t_start_s"),
)

# "Job J has new ticks, spans or counts from t_s on": appended by ingest (no shared row to lock),
# consumed by the span-energy pass, which deletes what it read in the transaction that computes it.
# max_tick_s carries the longest job_ticks row of the batch to the pass (which keeps jobs.max_tick_s).
span_dirty = Table(
    "span_dirty",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
    Column("t_s", Float, nullable=False),
    Column("max_tick_s", Float, nullable=False, default=0.0, server_default="0"),
    Index(None, "job_id"),
)

# Per job and span kind (query | step | epoch | count): the settled spans' totals and quantiles.
span_stats = Table(
    "span_stats",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("kind", String(8), primary_key=True),
    Column("max_span_s", Float, nullable=False),  # longest span (s): how far back a window looks
    Column("settled_spans", BigInteger, nullable=False),  # spans (or count windows) computed
    Column("settled_queries", BigInteger, nullable=False),  # spans, or the queries count windows hold
    Column("settled_tokens", BigInteger, nullable=False),
    Column("settled_energy_j", Float, nullable=False),
    Column("waiting_energy_j", Float, nullable=False),  # energy with no span of this kind in flight
    Column("sketch", JSON, nullable=True),  # accounting.quantiles.EnergySketch.to_json()
    Column("p50_j", Float, nullable=True),
    Column("p95_j", Float, nullable=True),
    Column("computed_to_s", Float, nullable=True),  # end of the last window computed
    Column("computed_at_s", Float, nullable=True),  # when (collector clock)
    # Where the pass's walk stands (storage.span_energy._Carry): the minute the last window reached and
    # the energy each span in flight there got before it, so the next window need not restart at a long
    # span's start (migration 0014). Null: the next window looks back for spans in flight.
    Column("carry", JSON, nullable=True),
)

# Waiting energy per job, kind and minute: a recomputed window replaces its minutes wholesale.
span_waiting = Table(
    "span_waiting",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("kind", String(8), primary_key=True),
    Column("bucket_s", Float, primary_key=True),
    Column("energy_j", Float, nullable=False),
)

ingested_batches = Table(
    "ingested_batches",
    metadata,
    Column("agent_id", String(200), primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("received_at_s", Float, nullable=False),
    Column("n_intervals", Integer, nullable=False),
    # SHA-256 (hex) of the batch as stored: the same key with other content is a conflict, not a duplicate.
    # NULL for batches stored before revision 0006 (taken as duplicates).
    Column("body_sha256", String(64), nullable=True),
)

# --- identity (storage.idempotency, storage.tokens) ---------------------------------------------------

# Which host an agent id belongs to: the first host that pushed it. Another host presenting the same id
# (a cloned spool) is refused, so the (agent_id, seq) keys of ingested_batches are one host's alone.
agents = Table(
    "agents",
    metadata,
    Column("agent_id", String(200), primary_key=True),
    Column("host", String(200), nullable=False),
    Column("first_seen_s", Float, nullable=False),
)

# Idempotency keys of span posts (POST /api/v1/jobs/{id}/queries, header Idempotency-Key), per job and
# posting host ("" when no host is known), with the hash of what was stored under the key.
span_posts = Table(
    "span_posts",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("host", String(200), primary_key=True),
    Column("key", String(200), primary_key=True),
    Column("body_sha256", String(64), nullable=False),
    Column("n_spans", Integer, nullable=False),
    Column("received_at_s", Float, nullable=False),
)

# Bearer tokens of the collector's API, stored as SHA-256 of the token (storage.tokens says why that is
# enough). ``prefix`` is the token's first characters: shown in lists, and how a presented token finds
# its row. role: admin | agent | reader; ``host`` is an agent token's host (NULL otherwise).
api_tokens = Table(
    "api_tokens",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("prefix", String(16), nullable=False),
    Column("sha256", String(64), nullable=False, unique=True),
    Column("role", String(8), nullable=False),
    Column("host", String(200), nullable=True),
    Column("created_at_s", Float, nullable=False),
    Column("last_used_s", Float, nullable=True),
    Column("revoked_at_s", Float, nullable=True),
    Index(None, "prefix"),
)

# Children first: the order to empty tables in.
DATA_TABLES = (
    "api_tokens",
    "agents",
    "span_posts",
    "span_waiting",
    "span_stats",
    "span_dirty",
    "job_ticks",
    "query_counts",
    "ingested_batches",
    "job_query_totals",
    "queries",
    "device_energy",
    "idle_energy_days",
    "idle_energy",
    "job_hosts",
    "job_device_energy",
    "energy_intervals",
    "unmeasured_spans",
    "raw_batches",
    "jobs",
    "devices",
    "hosts",
)
