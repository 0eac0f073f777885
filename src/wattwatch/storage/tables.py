"""The schema, as SQLAlchemy Core tables. Migrations create it; code reads and writes through these.

Times are Unix epoch seconds (``*_s``, Float) and energies joules (``*_j``, Float), like the wire
format, so nothing is converted between agent, database and report. ``energy_intervals`` is the raw
record; ``job_device_energy``, ``job_hosts``, ``idle_energy`` and ``job_query_totals`` are rollups
that ingest keeps current, so reports read O(jobs) rows, never the raw intervals.
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
    MetaData,
    String,
    Table,
    UniqueConstraint,
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
    Index(None, "started_at_s"),
    Index(None, "ended_at_s"),
)

energy_intervals = Table(
    "energy_intervals",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), nullable=False),
    Column("t_start_s", Float, nullable=False),
    Column("t_end_s", Float, nullable=False),
    Column("energy_j", Float, nullable=False),
    Column("source", String(16), nullable=False),
    Column("flags", String(200), nullable=False, default=""),
    Index(None, "device_id", "t_start_s"),
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
)

idle_energy = Table(
    "idle_energy",
    metadata,
    Column("device_id", Integer, ForeignKey("devices.id", ondelete="CASCADE"), primary_key=True),
    Column("hour_s", Float, primary_key=True),
    Column("energy_j", Float, nullable=False),
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
    Index(None, "job_id", "t_start_s"),
)

# Counts per job, so a report need not count the queries table (it grows with traffic).
job_query_totals = Table(
    "job_query_totals",
    metadata,
    Column("job_id", String(200), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True),
    Column("queries", BigInteger, nullable=False),
    Column("tokens_in", BigInteger, nullable=False),
    Column("tokens_out", BigInteger, nullable=False),
)

ingested_batches = Table(
    "ingested_batches",
    metadata,
    Column("agent_id", String(200), primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("received_at_s", Float, nullable=False),
    Column("n_intervals", Integer, nullable=False),
)

# Children first: the order to empty tables in.
DATA_TABLES = (
    "ingested_batches",
    "job_query_totals",
    "queries",
    "idle_energy",
    "job_hosts",
    "job_device_energy",
    "energy_intervals",
    "jobs",
    "devices",
    "hosts",
)
