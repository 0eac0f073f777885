"""The agent's own Prometheus /metrics (``--metrics-listen``): what this host measures now, and the agent's
health. Names, types and labels are the contract in docs/metrics.md (Agent).

Almost everything is read at scrape time from state the agent keeps anyway (the job registry, the spool,
the pusher's and the sampler's counters, NVML's utilisation), so the agent pays nothing between scrapes.
The exception is device energy and power: the worker adds each closed interval to ``DeviceTotals`` (a
few dict updates per tick). The registry is per agent, never prometheus_client's global one, so several
agents in one process (tests) never share series.
"""

from __future__ import annotations

import logging
import socket
import sqlite3
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from wattwatch import __version__
from wattwatch.agent import quiet_server
from wattwatch.config import parse_listen
from wattwatch.errors import ConfigError, WattwatchError
from wattwatch.protocol import wire
from wattwatch.protocol.limits import REASONS
from wattwatch.sensors.base import DeviceInfo, Sensor

if TYPE_CHECKING:
    from wattwatch.agent.runner import Agent

log = logging.getLogger(__name__)

DEVICE_LABELS = ["host", "device", "device_kind", "gpu", "UUID", "modelName", "source"]
UTILIZATION_LABELS = ["host", "device", "gpu", "UUID", "modelName"]
JOB_INFO_LABELS = ["host", "device", "device_kind", "UUID", "job_id", "job_name", "kind"]
METRICS_LISTEN_EXAMPLE = "0.0.0.0:9471"


class DeviceTotals:
    """Per device: energy since the agent started (per source) and power over the last closed interval.

    The worker adds intervals as they close; scrapes read copies. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._energy_j: dict[tuple[str, str], float] = {}  # (device, source) -> J
        self._power: dict[str, tuple[float, str]] = {}  # device -> (W, source)

    def add(self, intervals: Iterable[wire.Interval]) -> None:
        """Count closed intervals: their energy, and the power of each device's latest one."""
        with self._lock:
            for iv in intervals:
                key = (iv.device, iv.source)
                self._energy_j[key] = self._energy_j.get(key, 0.0) + iv.energy_j
                duration_s = iv.t_end_s - iv.t_start_s
                # A zero-length interval (two boundaries at one instant) says nothing about power.
                if duration_s > 0:
                    self._power[iv.device] = (iv.energy_j / duration_s, iv.source)

    def energy_j(self) -> dict[tuple[str, str], float]:
        """(device, source) -> joules measured since the agent started."""
        with self._lock:
            return dict(self._energy_j)

    def power_w(self) -> dict[str, tuple[float, str]]:
        """device -> (watts over its last closed interval, that interval's source)."""
        with self._lock:
            return dict(self._power)


def build_registry(agent: Agent) -> CollectorRegistry:
    """A fresh registry with the agent's collector in it."""
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    return registry


def _device_labels(host: str, key: str, dev: DeviceInfo | None) -> list[str]:
    """host, device, device_kind, gpu, UUID, modelName: dcgm-exporter's labels on GPUs, "" elsewhere."""
    if dev is None:
        return [host, key, "", "", "", ""]
    if dev.kind != "gpu":
        return [host, key, dev.kind, "", "", ""]
    return [host, key, dev.kind, str(dev.index), dev.uuid or "", dev.model or ""]


@dataclass
class _Families:
    """Every agent family, empty; ``collect`` fills them."""

    energy: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_device_energy_joules",
            "Energy this agent measured on the device since it started (J).",
            labels=DEVICE_LABELS,
        )
    )
    power: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_device_power_watts", "Power over the device's last closed interval (W).", labels=DEVICE_LABELS
        )
    )
    utilization: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_gpu_utilization_ratio", "NVML GPU utilisation, 0-1.", labels=UTILIZATION_LABELS
        )
    )
    job_info: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_device_job_info", "1 per job holding the device now.", labels=JOB_INFO_LABELS
        )
    )
    info: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_agent_info", "1 per agent: its id and version.", labels=["host", "agent_id", "version"]
        )
    )
    jobs: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily("wattwatch_agent_jobs", "Jobs active on the host.", labels=["host"])
    )
    spool: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_agent_spool_batches", "Batches waiting to be pushed.", labels=["host"]
        )
    )
    dead: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_agent_spool_dead_batches",
            "Batches set aside in the spool: the collector refused them for good (`wattwatch spool list`).",
            labels=["host"],
        )
    )
    set_aside: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_batches_set_aside",
            "Batches this agent set aside since it started, by reason (rejected, key_conflict, repeated_failure).",
            labels=["host", "reason"],
        )
    )
    pushed: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_batches_pushed", "Batches the collector accepted.", labels=["host"]
        )
    )
    push_failures: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_push_failures", "Push attempts that failed (collector away, 5xx).", labels=["host"]
        )
    )
    push_conflicts: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_push_conflicts",
            "Pushes refused as a cloned spool's (409: agent id of another host, or a seq stored with other content).",
            labels=["host"],
        )
    )
    last_push: GaugeMetricFamily = field(
        default_factory=lambda: GaugeMetricFamily(
            "wattwatch_agent_last_push_timestamp_seconds",
            "Unix time of the last accepted push (0: none yet).",
            labels=["host"],
        )
    )
    dropped_intervals: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_dropped_intervals",
            "Intervals dropped because the spool could not be written (a full disk) for longer than memory holds; "
            "their time is sent as zero-energy intervals flagged gap.",
            labels=["host"],
        )
    )
    sample_duration: HistogramMetricFamily = field(
        default_factory=lambda: HistogramMetricFamily(
            "wattwatch_agent_sample_duration_seconds", "Time to read every sensor once (s).", labels=["host"]
        )
    )
    sensor_errors: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_sensor_errors", "Sensor reads that failed.", labels=["host", "sensor"]
        )
    )
    refused: CounterMetricFamily = field(
        default_factory=lambda: CounterMetricFamily(
            "wattwatch_agent_refused",
            "Records refused as out of bounds (wattwatch.protocol.limits), by reason: spans and labels at the local "
            "API, the agent's own records at sealing.",
            labels=["host", "reason"],
        )
    )

    def all(self) -> list[Metric]:
        """The families in the order of docs/metrics.md."""
        return [getattr(self, f.name) for f in fields(self)]


class AgentCollector(Collector):
    """Every agent metric, computed at scrape time from one look at the agent's state."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def describe(self) -> Iterable[Metric]:
        """The families without samples, so registering reads nothing."""
        return _Families().all()

    def collect(self) -> Iterable[Metric]:
        """The agent's state now, as every family of docs/metrics.md (Agent)."""
        out = _Families()
        agent = self._agent
        host = agent.host
        devices = agent.sampler.devices
        for (key, source), energy_j in sorted(agent.device_totals.energy_j().items()):
            out.energy.add_metric([*_device_labels(host, key, devices.get(key)), source], energy_j)
        for key, (power_w, source) in sorted(agent.device_totals.power_w().items()):
            out.power.add_metric([*_device_labels(host, key, devices.get(key)), source], power_w)
        _add_utilization(out.utilization, host, agent.sampler.sensors)
        jobs = agent.registry.snapshot()
        for job in jobs:
            for key in sorted(job.held_devices):
                dev = devices.get(key)
                kind, uuid = (dev.kind, dev.uuid or "") if dev is not None else ("", "")
                out.job_info.add_metric([host, key, kind, uuid, job.id, job.name, job.kind], 1.0)
        out.info.add_metric([host, agent.agent_id, __version__], 1.0)
        out.jobs.add_metric([host], float(len(jobs)))
        try:
            pending, dead = agent.spool.pending(), agent.spool.dead()
        except sqlite3.Error as exc:  # closed under a scrape racing the agent's stop
            log.debug("agent metrics: spool unreadable: %s", exc)
        else:
            out.spool.add_metric([host], float(pending))
            out.dead.add_metric([host], float(dead))
        stats = agent.pusher.stats
        for reason, n in stats.set_aside.items():
            out.set_aside.add_metric([host, reason], float(n))
        out.pushed.add_metric([host], float(stats.pushed))
        out.push_failures.add_metric([host], float(stats.failures))
        out.push_conflicts.add_metric([host], float(stats.conflicts))
        out.last_push.add_metric([host], stats.last_pushed_at_s)
        out.dropped_intervals.add_metric([host], float(agent.outbox.dropped.intervals))
        cumulative, count, sum_s = agent.sampler.stats.histogram()
        buckets = [(repr(bound_s), float(n)) for bound_s, n in cumulative] + [("+Inf", float(count))]
        out.sample_duration.add_metric([host], buckets, sum_s)
        for sensor, n in sorted(agent.sampler.stats.errors().items()):
            out.sensor_errors.add_metric([host, sensor], float(n))
        refused = agent.refused.counts()
        for reason in REASONS:  # every reason from the start, so rate() sees the first refusal
            out.refused.add_metric([host, reason], float(refused.get(reason, 0)))
        return out.all()


def _add_utilization(family: GaugeMetricFamily, host: str, sensors: Sequence[Sensor]) -> None:
    """NVML's utilisation of every GPU of the sensors that offer ``utilization_ratio`` (the NVML one)."""
    for sensor in sensors:
        ratio_of: Callable[[str], float | None] | None = getattr(sensor, "utilization_ratio", None)
        if ratio_of is None:
            continue
        for dev in sensor.devices():
            if dev.kind != "gpu":
                continue
            try:
                ratio = ratio_of(dev.key)
            except WattwatchError as exc:  # one GPU must never fail the whole scrape
                log.debug("agent metrics: no utilisation for %s: %s", dev.key, exc)
                continue
            if ratio is not None:
                labels = _device_labels(host, dev.key, dev)
                family.add_metric([*labels[:2], *labels[3:]], ratio)  # GPUs only: no device_kind


class MetricsServer:
    """Serves a registry as Prometheus text over HTTP, from a daemon thread, at ``HOST:PORT``."""

    def __init__(self, registry: CollectorRegistry, listen: str) -> None:
        try:
            self.host, self.port = parse_listen(listen)
        except ConfigError:
            raise ConfigError(
                f"--metrics-listen (WATTWATCH_METRICS_LISTEN) {listen!r} is not HOST:PORT; "
                f"use e.g. {METRICS_LISTEN_EXAMPLE}, or leave it empty for no agent metrics"
            ) from None
        self.listen = listen
        self._registry = registry
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> str:
        """Bind and serve; returns the URL of /metrics. A taken port or a bad host raises ConfigError."""
        try:
            self._server = _wsgi_server(self.host, self.port, self._registry)
        except OSError as exc:
            raise ConfigError(
                f"--metrics-listen {self.listen}: cannot listen there ({exc.strerror or exc}); "
                "choose a free port on an address of this host"
            ) from None
        self.port = int(self._server.server_port)  # the real one when asked for port 0
        self._thread = quiet_server.serve(self._server, "wattwatch-metrics")
        return self.url

    @property
    def url(self) -> str:
        """Where /metrics answers (a wildcard host is shown as loopback)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::", "") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def stop(self) -> None:
        """Stop serving and release the port; idempotent."""
        server, self._server = self._server, None
        if server is None:
            return
        quiet_server.stop(server, self._thread)  # closes the socket too: shutdown() alone keeps the port bound


class _QuietHandler(WSGIRequestHandler):
    """Logs no request (a scrape every 15 s is not news)."""

    def log_message(self, format: str, *args: object) -> None:
        """Log nothing."""


def _wsgi_server(host: str, port: int, registry: CollectorRegistry) -> WSGIServer:
    """prometheus_client's exposition app on ``host:port`` (IPv4 or IPv6, as the address resolves), not yet
    serving: ``quiet_server.serve`` runs it."""
    family = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]

    class _Server(ThreadingWSGIServer):
        address_family = family

    return make_server(host, port, make_wsgi_app(registry), _Server, handler_class=_QuietHandler)
