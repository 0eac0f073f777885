"""Settings from an optional TOML file plus ``WATTWATCH_*`` environment variables. No globals.

Precedence, lowest to highest: defaults, the TOML file (``$WATTWATCH_HOME/wattwatch.toml`` or
``WATTWATCH_CONFIG``), environment variables, then command-line flags (applied by the CLI with
``record.replace``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from wattwatch import limits
from wattwatch.errors import ConfigError
from wattwatch.record import field, field_names, record, replace


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """``$WATTWATCH_HOME``, else ``~/.local/share/wattwatch``."""
    env = os.environ if env is None else env
    raw = env.get("WATTWATCH_HOME")
    return Path(raw).expanduser() if raw else Path.home() / ".local" / "share" / "wattwatch"


@record
class Settings:
    """Everything a wattwatch process can be told. Units are in the names."""

    home: Path = field(default_factory=default_home)
    db_url: str = ""  # empty: embedded SQLite at home/wattwatch.db
    listen: str = "127.0.0.1:8470"
    collector_url: str = "http://127.0.0.1:8470"
    # The collector `report` and `jobs` ask when neither --server nor --db is given (WATTWATCH_SERVER): set
    # once where the database is a fleet's PostgreSQL, so a report needs no database driver or credentials.
    report_server: str = ""
    token: str = ""
    # Identity (issue 9): the bearer token from a file instead (resolve_token reads it); the CA an agent or
    # `report --server` trusts for an https collector; the collector's TLS certificate and key.
    token_file: str = ""
    ca_file: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    interval_s: float = 1.0
    # How often the agent seals and pushes a batch (and at once when a job starts or ends): several ticks
    # per batch, so a fleet sends fewer, larger batches. Each tick is durable in the spool meanwhile.
    push_interval_s: float = 5.0
    host: str = ""  # empty: the machine's hostname
    # Carbon: gCO2e = kWh x PUE x grid intensity (wattwatch.carbon_policy). The intensity is per host, from
    # codecarbon's data for the host's grid region: the collector's per-host override (grid_regions,
    # "HOSTGLOB=REGION,..."), else the region the host's agent sends (its grid_region), else the collector's
    # own grid_region; with none of them, or without codecarbon's data, grid_intensity_g_per_kwh.
    # A region: ISO 3166 country code (FR, USA) or cloud provider:region (gcp:europe-west9).
    grid_intensity_g_per_kwh: float = 400.0
    grid_region: str = ""
    grid_regions: str = ""
    pue: float = 1.0
    # Cost = kWh x PUE x price (0: no cost in reports), in ``currency``.
    price_per_kwh: float = 0.0
    currency: str = "USD"
    # CPU TDP for the estimate where RAPL is missing; 0 looks it up in codecarbon's CPU table.
    cpu_tdp_w: float = 0.0
    # Finished jobs leave /metrics after this long, so label cardinality stays bounded.
    metrics_retention_s: float = 3600.0
    # Job label keys exported as metric labels on the collector's job series (comma list, e.g. "team,namespace").
    metric_labels: str = ""
    # The agent's own Prometheus /metrics (HOST:PORT); empty: not served.
    metrics_listen: str = ""
    # A restarted agent bridges a device's gap by its energy counter's delta up to this long (longer: the
    # gap is flagged, no energy invented).
    restart_bridge_max_s: float = 21600.0
    # The collector ends the running jobs of hosts it has not heard from for this long (0: never).
    host_silent_after_s: float = 600.0
    # The collector refuses (422) times further than this before or after its own clock (limits.TimeWindow).
    time_window_past_s: float = limits.DEFAULT_PAST_S
    time_window_future_s: float = limits.DEFAULT_FUTURE_S
    # Raw intervals older than this are deleted by the collector's prune pass (storage.retention), and
    # spans, ticks and idempotency keys once older than both this and the time window; 0 keeps everything.
    # Rollups of jobs and idle energy are never deleted.
    retention_days: float = 14.0

    @property
    def socket_path(self) -> Path:
        """The agent's Unix socket for the SDK and ``wattwatch run``."""
        return self.home / "agent.sock"

    @property
    def resolved_db_url(self) -> str:
        """``db_url`` or the embedded SQLite database under ``home``."""
        return self.db_url or f"sqlite:///{self.home / 'wattwatch.db'}"

    def time_window(self) -> limits.TimeWindow:
        """The window of times the collector accepts around now; ConfigError when not positive seconds."""
        try:
            return limits.TimeWindow(self.time_window_past_s, self.time_window_future_s)
        except ValueError:
            raise ConfigError(
                f"the time window ({self.time_window_past_s!r} s back, {self.time_window_future_s!r} s ahead) "
                "must be positive durations; set e.g. --time-window-past 30d --time-window-future 1d"
            ) from None

    def listen_host_port(self) -> tuple[str, int]:
        """Split ``listen`` (``HOST:PORT``) with a clear error."""
        return parse_listen(self.listen)


def parse_listen(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8470"`` -> ``("127.0.0.1", 8470)``; raises ConfigError saying what is expected."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT; use e.g. 127.0.0.1:8470")
    return host.strip("[]") or "0.0.0.0", int(port)


_ENV = {
    "db_url": "WATTWATCH_DB",
    "listen": "WATTWATCH_LISTEN",
    "collector_url": "WATTWATCH_COLLECTOR",
    "report_server": "WATTWATCH_SERVER",
    "token": "WATTWATCH_TOKEN",
    "token_file": "WATTWATCH_TOKEN_FILE",
    "ca_file": "WATTWATCH_CA_FILE",
    "tls_cert": "WATTWATCH_TLS_CERT",
    "tls_key": "WATTWATCH_TLS_KEY",
    "interval_s": "WATTWATCH_INTERVAL",
    "push_interval_s": "WATTWATCH_PUSH_INTERVAL",
    "host": "WATTWATCH_HOST",
    "grid_intensity_g_per_kwh": "WATTWATCH_GRID_INTENSITY",
    "pue": "WATTWATCH_PUE",
    "grid_region": "WATTWATCH_GRID_REGION",
    "grid_regions": "WATTWATCH_GRID_REGIONS",
    "price_per_kwh": "WATTWATCH_PRICE_PER_KWH",
    "currency": "WATTWATCH_CURRENCY",
    "metrics_retention_s": "WATTWATCH_METRICS_RETENTION",
    "metric_labels": "WATTWATCH_METRIC_LABELS",
    "cpu_tdp_w": "WATTWATCH_CPU_TDP",
    "metrics_listen": "WATTWATCH_METRICS_LISTEN",
    "restart_bridge_max_s": "WATTWATCH_RESTART_BRIDGE_MAX",
    "host_silent_after_s": "WATTWATCH_HOST_SILENT_AFTER",
    "time_window_past_s": "WATTWATCH_TIME_WINDOW_PAST",
    "time_window_future_s": "WATTWATCH_TIME_WINDOW_FUTURE",
    "retention_days": "WATTWATCH_RETENTION_DAYS",
}


def resolve_token(settings: Settings) -> Settings:
    """``settings`` with ``token`` read from ``token_file`` when one is named (ConfigError saying what to fix).

    A token in a file (or an environment variable) stays out of process lists, where argv is visible.
    """
    if not settings.token_file:
        return settings
    if settings.token:
        raise ConfigError("both a token and a token file are set; use one (WATTWATCH_TOKEN or WATTWATCH_TOKEN_FILE)")
    path = Path(settings.token_file).expanduser()
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read the token file {path} ({exc.strerror}); check --token-file") from None
    if not token or any(c.isspace() for c in token):
        raise ConfigError(f"the token file {path} must hold one token on one line; check --token-file")
    return replace(settings, token=token)


def load_settings(env: Mapping[str, str] | None = None, config_file: Path | None = None) -> Settings:
    """Build Settings from defaults, the TOML file and the environment; raise ConfigError naming the bad key."""
    env = os.environ if env is None else env
    home = default_home(env)
    values: dict[str, object] = {"home": home}
    path = config_file or Path(env.get("WATTWATCH_CONFIG", home / "wattwatch.toml"))
    if path.exists():
        import tomllib  # only where there is a file to read (1.5 ms of a read command's start-up)

        try:
            values.update(tomllib.loads(path.read_text()))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML ({exc}); fix or remove it") from None
    for name, var in _ENV.items():
        if var in env:
            values[name] = env[var]
    return _coerce(values, source=str(path))


def _coerce(values: Mapping[str, object], source: str) -> Settings:
    known = set(field_names(Settings))
    defaults = Settings(home=Path("."))
    kwargs: dict[str, object] = {}
    for name, raw in values.items():
        if name not in known:
            raise ConfigError(f"unknown setting {name!r} in {source}; known: {', '.join(sorted(known))}")
        default = getattr(defaults, name)
        try:
            if isinstance(default, float):
                value: object = float(raw)  # type: ignore[arg-type]
            elif isinstance(default, Path):
                value = Path(str(raw)).expanduser()
            else:
                value = str(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"setting {name!r} = {raw!r} is not a number; e.g. {name} = {default}") from None
        kwargs[name] = value
    return Settings(**kwargs)  # type: ignore[arg-type]
