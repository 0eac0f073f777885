"""What one collector app's routes and its ingest handler share: settings, the database, the metrics,
the clock, the span-energy scheduler and the group-commit writer."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from sqlalchemy import Engine

from wattwatch.collector.group_commit import GroupCommitter
from wattwatch.collector.metrics import IngestMetrics
from wattwatch.collector.span_scheduler import SpanEnergyScheduler
from wattwatch.config import Settings


@dataclass(frozen=True)
class Context:
    """What one collector app's routes share."""

    settings: Settings
    engine: Engine
    registry: CollectorRegistry
    ingest: IngestMetrics
    clock: Callable[[], float]
    span_energy: SpanEnergyScheduler
    # Ingest goes through group commit: concurrent batches share one transaction (collector.group_commit).
    writer: GroupCommitter
