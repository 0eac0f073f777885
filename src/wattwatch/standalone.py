"""Process wiring for the long-running commands: ``up``, ``demo``, ``collector`` and ``agent``.

``up`` runs the collector (uvicorn, in a thread) and a local agent in one process; the agent pushes
to the collector over loopback HTTP, the same path a remote agent uses. Shutdown order matters: the
agent closes its last intervals and pushes them while the collector still listens.
"""

from __future__ import annotations

import gc
import logging
import secrets
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from types import FrameType
from typing import TYPE_CHECKING, Any

from wattwatch import redact, vital
from wattwatch.config import Settings
from wattwatch.errors import ConfigError

if TYPE_CHECKING:
    from wattwatch.agent.options import AgentOptions
    from wattwatch.sim.flaws import Flaws

log = logging.getLogger("wattwatch")

# The collector's youngest GC generation is collected after this many new container objects instead of
# Python's 700: a batch of 300 intervals allocates well over 700 short-lived tuples and lists, nearly all
# freed by reference counting, so the default collected every batch or two (about 4 % of the collector's
# CPU per stored interval, benchmarks/ingest_cpu.py). Cyclic garbage waits a little longer; nothing else.
GC_GEN0_THRESHOLD = 50_000


def reuse_port_socket(host: str, port: int) -> Any:
    """A listening TCP socket on ``host:port`` that other processes may bind too (SO_REUSEPORT)."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on connections whose socket says TCP, and
    # without it every answer waited out the client's delayed ACK (a fixed 40-50 ms per request with
    # --workers 2: 47k intervals/s where one worker, on asyncio's own socket, did 117k).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} ({exc.strerror}); choose another with --listen") from None
    sock.listen(2048)
    return sock


class SimulatedWorkload:
    """Turns job boundaries into load on simulated GPUs: the last job to start on a board sets its load."""

    def __init__(self, fleet: Any) -> None:
        self.fleet = fleet
        self._lock = threading.Lock()
        self._holders: dict[int, list[tuple[str, str, int | None]]] = {}

    def job_started(self, job_id: str, kind: str, devices: Sequence[str], pid: int | None, t_s: float) -> None:
        """Load the job's boards with its kind's profile from ``t_s`` (later by the fleet's workload lag:
        a real job's kernels start some time after it opens)."""
        t_s += self.fleet.load_lag_s(job_id, "start")
        with self._lock:
            for index in _gpu_indices(devices):
                self._holders.setdefault(index, []).append((job_id, kind, pid))
                self.fleet.set_activity(index, kind if kind in ("training", "inference") else "training", t_s, pid)

    def job_ended(self, job_id: str, t_s: float) -> None:
        """Return the job's boards to idle (or to the job still holding them) at ``t_s``, moved by the
        fleet's workload lag (a load that ends before the job closes cannot end before what NVML has
        already reported: the fleet never rewrites that)."""
        t_s += self.fleet.load_lag_s(job_id, "end")
        with self._lock:
            for index, holders in self._holders.items():
                if not any(h[0] == job_id for h in holders):
                    continue
                holders[:] = [h for h in holders if h[0] != job_id]
                if holders:
                    _, kind, pid = holders[-1]
                    self.fleet.set_activity(index, kind if kind in ("training", "inference") else "training", t_s, pid)
                else:
                    self.fleet.set_activity(index, "idle", t_s, None)


def _flaws_note(fleet: Any) -> str:
    """``", flaws: ..."`` for a simulated fleet with flaws, else empty."""
    if fleet is None or fleet.flaws.ideal:
        return ""
    return f", flaws: {fleet.flaws.describe()}"


def _gpu_indices(devices: Sequence[str]) -> list[int]:
    return [int(key[3:]) for key in devices if key.startswith("gpu") and key[3:].isdigit()]


@dataclass
class AgentParts:
    """The agent and what it was built from (the fleet when GPUs are simulated)."""

    agent: Any
    fleet: Any = None
    skipped: list[Any] = field(default_factory=list)


def build_agent(
    settings: Settings,
    simulate: int = 0,
    seed: int = 0,
    options: AgentOptions | None = None,
    flaws: Flaws | None = None,
) -> AgentParts:
    """Discover sensors (or simulate ``simulate`` GPUs, with ``flaws``, through the fake NVML module) and
    build an Agent.

    ``options`` (``agent.options.AgentOptions``: job discovery, kubelet, scrape targets) default to the
    ones ``settings`` holds.
    """
    from wattwatch.agent.options import AgentOptions
    from wattwatch.agent.runner import Agent
    from wattwatch.sensors.discovery import discover
    from wattwatch.sensors.nvml import resolve_visible
    from wattwatch.sim.fleet import SimulatedFleet

    options = options if options is not None else AgentOptions.from_settings(settings)
    fleet = None
    if simulate:
        if simulate < 0 or simulate > 64:
            raise ConfigError(f"--simulate takes 1 to 64 GPUs, got {simulate}")
        settings.home.mkdir(parents=True, exist_ok=True)
        # The boards outlive the agent, as real ones do: a restarted agent finds their counters still counting.
        fleet = SimulatedFleet.resume(settings.home / "simulated-gpus.jsonl", simulate, seed=seed, flaws=flaws)
    found = discover(simulate_fleet=fleet, cpu_tdp_w=settings.cpu_tdp_w or None)  # 0: look the TDP up
    agent = Agent(
        settings,
        found.sensors,
        gpu_processes=found.nvml,
        resolve_visible=resolve_visible,
        workload_hook=SimulatedWorkload(fleet) if fleet is not None else None,
        options=options,
    )
    return AgentParts(agent=agent, fleet=fleet, skipped=list(found.skipped))


class StopFlag:
    """Set by SIGINT/SIGTERM; the main thread waits on it. A second signal sets ``again``: stop pushing the
    spool at shutdown (what is left stays in it for the next start)."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.again = threading.Event()

    def install(self) -> None:
        """Route SIGINT and SIGTERM to this flag (main thread only)."""

        def handler(signum: int, frame: FrameType | None) -> None:
            if self.event.is_set():
                self.again.set()
            self.event.set()

        signal.signal(signal.SIGINT, handler)
        signal.signal(signal.SIGTERM, handler)


class Collector:
    """The collector app served by uvicorn in a background thread.

    Closed by default: every request but /healthz and /readyz needs a token. ``open_local`` (``--open``)
    lets requests from this machine, straight to it (no proxy header), in without one while no token was
    ever configured (``collector.auth``). Beyond loopback it refuses to start with no token at all (static or
    in the database) unless ``allow_open``: else ConfigError, one line saying how to make one.
    ``local_token`` authenticates ``wattwatch up``'s own agent. With ``settings.tls_cert`` and ``tls_key`` it
    serves HTTPS.
    """

    def __init__(
        self,
        settings: Settings,
        *,
        migrate: bool,
        allow_open: bool = False,
        open_local: bool = False,
        local_token: str = "",
        reuse_port: bool = False,
        periodic: bool = True,
    ) -> None:
        import uvicorn

        from wattwatch.collector import server
        from wattwatch.collector.app import create_app
        from wattwatch.collector.auth import is_loopback, open_collector_error
        from wattwatch.storage import engine as storage_engine
        from wattwatch.storage import migrate as storage_migrate
        from wattwatch.storage.tokens import any_active
        from wattwatch.tls import check_server_files

        url = settings.resolved_db_url
        if migrate:
            if not settings.db_url:
                settings.home.mkdir(parents=True, exist_ok=True)
            storage_migrate.upgrade(url)
        host, port = settings.listen_host_port()
        check_server_files(settings.tls_cert, settings.tls_key)
        self.engine = storage_engine.check_ready(url)
        # Beyond loopback with no token at all, no agent elsewhere could write: say so unless told to start anyway.
        if not is_loopback(host) and not allow_open and not settings.token and not any_active(self.engine):
            self.engine.dispose()
            raise ConfigError(open_collector_error(settings.listen))
        app = create_app(
            settings,
            engine=self.engine,
            local_token=local_token,
            anonymous="loopback" if open_local else "nobody",
            periodic=periodic,
        )
        tls: dict[str, Any] = {}
        if settings.tls_cert:
            tls = {"ssl_certfile": settings.tls_cert, "ssl_keyfile": settings.tls_key}
        config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            access_log=False,
            timeout_keep_alive=server.KEEP_ALIVE_S,
            # Read deadlines and a connection limit (collector.server): no caller holds a socket for ever.
            http=server.protocol_class(
                header_timeout_s=settings.header_timeout_s,
                body_timeout_s=settings.body_timeout_s,
                max_connections=server.connection_limit(int(settings.max_connections)),
            ),
            # The client address stays the TCP peer's: X-Forwarded-For never makes a caller look local.
            proxy_headers=False,
            **tls,
        )
        self.server = uvicorn.Server(config)
        # Worker processes of `collector --workers N` each listen on the same address (SO_REUSEPORT); the
        # kernel spreads the connections between them.
        sockets = [reuse_port_socket(host, port)] if reuse_port else None
        # The main thread owns SIGINT/SIGTERM; uvicorn leaves signals alone outside the main thread.
        self._thread = threading.Thread(
            target=self.server.run, args=(sockets,), name="wattwatch-collector", daemon=True
        )
        scheme = "https" if settings.tls_cert else "http"
        self.url = f"{scheme}://{host if host not in ('0.0.0.0', '::') else '127.0.0.1'}:{port}"

    def start(self, timeout_s: float = 15.0) -> None:
        """Start serving; raise ConfigError when the port cannot be bound."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise ConfigError(
                    f"the collector could not listen on {self.url}; is the port taken? choose another with --listen"
                )
            time.sleep(0.02)
        # Everything built so far (the app, SQLAlchemy's tables and caches) lives as long as the process:
        # keep the collector's cyclic GC from scanning it again and again under load.
        gc.collect()
        gc.freeze()
        gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])

    def stop(self) -> None:
        """Stop serving and wait for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self.engine.dispose()


def run_up(
    settings: Settings,
    *,
    simulate: int = 0,
    flaws: Flaws | None = None,
    announce: Callable[[str], None] = print,
    driver: Callable[[Settings, threading.Event], None] | None = None,
    duration_s: float | None = None,
    options: AgentOptions | None = None,
    allow_open: bool = False,
) -> None:
    """Collector + local agent until SIGINT/SIGTERM (or ``duration_s``); ``driver`` runs beside them (demo);
    ``options`` as for ``build_agent``. Plain HTTP: the agent talks to its collector over loopback."""
    stop = StopFlag()
    stop.install()
    vital.DEATHS.install(stop.event)
    settings = replace(settings, tls_cert="", tls_key="")
    # The local agent's own credential: it works once tokens exist, and never switches authentication on.
    local_token = settings.token or secrets.token_urlsafe(32)
    redact.remember(local_token)
    # Open to anonymous callers on this machine (the quickstart's `wattwatch report`), until a token exists.
    collector = Collector(settings, migrate=True, allow_open=allow_open, open_local=True, local_token=local_token)
    collector.start()
    try:
        agent_settings = replace(settings, collector_url=collector.url, token=local_token, ca_file="")
        parts = build_agent(agent_settings, simulate=simulate, options=options, flaws=flaws)
        agent = parts.agent
        agent.start()
    except BaseException:
        collector.stop()  # e.g. --metrics-listen on a taken port: leave nothing listening
        raise
    gpus = [d for d in agent.sampler.devices.values() if d.kind == "gpu"]
    sources = sorted({f"{d.key}" for d in agent.sampler.devices.values()})
    announce(f"wattwatch up: collector on {collector.url} (database {redact.url(settings.resolved_db_url)})")
    announce(
        "wattwatch up: --open: requests from this machine need no token until one exists "
        "(`wattwatch token create` closes it for good)"
    )
    announce(
        f"wattwatch up: agent measuring {', '.join(sources) or 'nothing'}"
        + (f" ({simulate} simulated GPUs{_flaws_note(parts.fleet)})" if simulate else "")
    )
    if not gpus:
        why = "; ".join(f"{s.name}: {s.reason}" for s in parts.skipped) or "NVML found no GPU"
        announce(
            f"wattwatch up: no NVIDIA GPU found here ({why}). Try `wattwatch up --simulate 4` to see "
            "wattwatch measure simulated GPUs."
        )
    announce(
        f"wattwatch up: tag jobs with `wattwatch run --kind training --name NAME -- CMD`; "
        f"report: `wattwatch report` or {collector.url}/api/v1/report; metrics: {collector.url}/metrics"
    )
    if agent.metrics_url:
        announce(f"wattwatch up: the agent's own metrics on {agent.metrics_url}")
    drv: threading.Thread | None = None
    if driver is not None:
        # The driver talks to this collector, whatever collector_url and token the settings name elsewhere.
        drv = threading.Thread(target=driver, args=(agent_settings, stop.event), name="wattwatch-demo", daemon=True)
        drv.start()
    try:
        stop.event.wait(timeout=duration_s)
        stop.event.set()
        if drv is not None:
            drv.join(timeout=15)
    finally:
        announce("wattwatch up: stopping; pushing the last measurements")
        agent.stop(say=_say("wattwatch up"), give_up=stop.again)
        collector.stop()
    vital.DEATHS.finish()


def run_collector(
    settings: Settings,
    *,
    migrate: bool,
    announce: Callable[[str], None] = print,
    allow_open: bool = False,
    open_local: bool = False,
    workers: int = 1,
    worker_index: int | None = None,
    argv: Sequence[str] = (),
) -> None:
    """The central service until SIGINT/SIGTERM (``allow_open``: start beyond loopback without any token;
    ``open_local``: anonymous requests from this machine while no token was ever configured, ``Collector``).

    ``workers`` > 1 (PostgreSQL only) makes this process a supervisor of that many worker processes, each
    ``wattwatch ARGV --worker-index I``, all listening on one address (SO_REUSEPORT). The collector keeps no
    state between requests, so any worker can take any request; worker 0 alone runs the periodic passes.
    If a worker dies the supervisor stops the others and fails, for the service manager to restart it all.
    """
    stop = StopFlag()
    stop.install()
    vital.DEATHS.install(stop.event)
    if workers > 1 and worker_index is None:
        _supervise(settings, migrate=migrate, allow_open=allow_open, workers=workers, argv=argv, stop=stop)
        return
    worker = worker_index is not None
    collector = Collector(
        settings,
        migrate=migrate and not worker,
        allow_open=allow_open,
        open_local=open_local,
        reuse_port=worker,
        periodic=worker_index in (None, 0),
    )
    collector.start()
    what = f"worker {worker_index} of " if worker else ""
    announce(f"wattwatch collector: {what}{collector.url} (database {redact.url(settings.resolved_db_url)})")
    if open_local and not worker_index:
        announce("wattwatch collector: --open: requests from this machine need no token until one exists")
    try:
        stop.event.wait()
    finally:
        collector.stop()
    vital.DEATHS.finish()


def _supervise(
    settings: Settings, *, migrate: bool, allow_open: bool, workers: int, argv: Sequence[str], stop: StopFlag
) -> None:
    """Check the configuration once, then run ``workers`` worker processes until stopped or one dies."""
    import subprocess
    import sys

    from wattwatch.collector.auth import is_loopback, open_collector_error
    from wattwatch.errors import WattwatchError
    from wattwatch.storage import engine as storage_engine
    from wattwatch.storage import migrate as storage_migrate
    from wattwatch.storage.tokens import any_active
    from wattwatch.tls import check_server_files

    url = settings.resolved_db_url
    if migrate:
        storage_migrate.upgrade(url)
    host, port = settings.listen_host_port()
    check_server_files(settings.tls_cert, settings.tls_key)
    engine = storage_engine.check_ready(url)
    try:
        if not is_loopback(host) and not allow_open and not settings.token and not any_active(engine):
            raise ConfigError(open_collector_error(settings.listen))
    finally:
        engine.dispose()
    children = [
        subprocess.Popen([sys.executable, "-m", "wattwatch.cli.main", *argv, "--worker-index", str(i)])
        for i in range(workers)
    ]
    log.info("collector: %d worker processes on %s:%d", workers, host, port)
    failed = None
    try:
        while not stop.event.wait(0.5):
            dead = [(i, c.returncode) for i, c in enumerate(children) if c.poll() is not None]
            if dead:
                failed = dead[0]
                break
    finally:
        for c in children:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 30
        for c in children:
            try:
                c.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait()
    if failed is not None:
        raise WattwatchError(
            f"collector worker {failed[0]} exited with status {failed[1]}; stopped the others (see its error above)"
        )


def run_agent(
    settings: Settings,
    *,
    simulate: int = 0,
    flaws: Flaws | None = None,
    announce: Callable[[str], None] = print,
    options: AgentOptions | None = None,
) -> None:
    """The per-host sidecar until SIGINT/SIGTERM; ``options`` as for ``build_agent``."""
    stop = StopFlag()
    stop.install()
    vital.DEATHS.install(stop.event)
    parts = build_agent(settings, simulate=simulate, options=options, flaws=flaws)
    parts.agent.start()
    announce(
        f"wattwatch agent: measuring {', '.join(parts.agent.sampler.devices) or 'nothing'}; "
        f"pushing to {redact.url(settings.collector_url)}; socket {settings.socket_path}"
    )
    if _flaws_note(parts.fleet):
        announce(f"wattwatch agent: simulated GPUs{_flaws_note(parts.fleet)}")
    for s in parts.skipped:
        announce(f"wattwatch agent: skipped {s.name}: {s.reason}")
    if parts.agent.metrics_url:
        announce(f"wattwatch agent: metrics on {parts.agent.metrics_url}")
    options = parts.agent.options
    if parts.agent.tracker is not None:
        what = "discovering untagged GPU processes" if options.discover else "binding jobs by process only"
        kubelet = f"; pods from {options.kubelet_url}" if options.kubelet_url else ""
        announce(f"wattwatch agent: {what} (/proc at {options.proc_root}{kubelet})")
    for target in options.scrape:
        announce(f"wattwatch agent: scraping {target.preset} counters from {target.url}")
    try:
        stop.event.wait()
    finally:
        if parts.agent.spool.pending():
            announce("wattwatch agent: stopping; pushing what the spool holds (Ctrl-C again: keep it for next start)")
        parts.agent.stop(say=_say("wattwatch agent"), give_up=stop.again)
    vital.DEATHS.finish()


def _say(prefix: str) -> Callable[[str], None]:
    """Lines for the user on stderr (shutdown progress), beside the log but without its timestamps."""
    import sys

    def say(line: str) -> None:
        # Banners and stop messages name URLs: shown without their credentials, like every log line.
        sys.stderr.write(f"{prefix}: {redact.text(line)}\n")
        sys.stderr.flush()

    return say
