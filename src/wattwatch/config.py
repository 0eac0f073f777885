"""Settings from an optional TOML file plus ``WATTWATCH_*`` environment variables. No globals.

Precedence, lowest to highest: defaults, the TOML file (``$WATTWATCH_HOME/wattwatch.toml`` or
``WATTWATCH_CONFIG``), environment variables, then command-line flags (``load_settings(flags=...)``).
Every value from any of them passes the same checks (``check_setting``: a number, finite, in its range)
and a bad one is a ConfigError of one line naming it as the user gave it (``--interval 0``,
``WATTWATCH_INTERVAL=0``, ``interval_s = 0 in wattwatch.toml``) and what is allowed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from wattwatch import redact
from wattwatch.errors import ConfigError
from wattwatch.protocol import limits


def default_home(env: Mapping[str, str] | None = None) -> Path:
    """``$WATTWATCH_HOME``, else ``~/.local/share/wattwatch``."""
    env = os.environ if env is None else env
    raw = env.get("WATTWATCH_HOME")
    return Path(raw).expanduser() if raw else Path.home() / ".local" / "share" / "wattwatch"


@dataclass(frozen=True)
class Settings:
    """Everything a wattwatch process can be told. Units are in the names."""

    home: Path = field(default_factory=default_home)
    db_url: str = ""  # empty: embedded SQLite at home/wattwatch.db
    listen: str = "127.0.0.1:8470"
    collector_url: str = "http://127.0.0.1:8470"
    # The collector `report` and `jobs` ask when neither --server nor --db is given (WATTWATCH_SERVER): set
    # once where the database is a fleet's PostgreSQL, so a report needs no database driver or credentials.
    report_server: str = ""
    token: str = field(default="", repr=False)  # a secret: never in a repr or a log line
    # Identity: the bearer token from a file instead (resolve_token reads it); the CA an agent or
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
    # Carbon: gCO2e = kWh x PUE x grid intensity (wattwatch.carbon.policy). The intensity is per host, from
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
    # The collector's HTTP server (collector.server): a request's headers are due this long after its
    # connection or first byte, its body this long after its headers; beyond ``max_connections`` open at
    # once a new connection is answered 503 with Retry-After. Each open connection is a file descriptor.
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_connections: int = 4096
    # Requests the collector works on at once (collector.load); one more is answered 429 with Retry-After.
    # Reads: about what two cores answer within a second (a report page takes tens of milliseconds).
    # Writes: agents' batches wait for their group's commit without a thread, so many may be in flight.
    max_reads: int = 16
    max_writes: int = 2048
    # Agent: which processes become jobs and what the agent scrapes (wattwatch.agent.options turns these
    # into its parsed options). Untagged GPU processes are attributed to jobs unless ``discover`` is off;
    # ``proc_root`` is the host's /proc (/host/proc in a pod).
    discover: bool = True
    proc_root: str = "/proc"
    # The kubelet's pods API (names, labels, annotations of pods), its bearer token file (empty: the pod's
    # service account token when there is one), the CA its certificate is checked against, or no check.
    kubelet_url: str = ""
    kubelet_token_file: str = ""
    kubelet_ca_file: str = ""
    kubelet_insecure: bool = False
    # Serving engines' metrics to count requests from: PRESET:URL[#job=ID] items, space or comma separated.
    scrape: str = ""
    # While a job on this host sends query spans (and ``fine_tick_hold_s`` after the last one), intervals
    # close every ``fine_interval_s``: per-query energy needs the power's shape within a tick (1 s ticks put
    # p95 J/query ~6 % low; 0.1 s, the NVML counter's update period, within 1-2 %). 0 turns it off.
    fine_interval_s: float = 0.1
    fine_tick_hold_s: float = 5.0
    # A batch failing with 5xx (or no answer) this many times while later batches land is set aside.
    poison_after: int = 5

    def __repr__(self) -> str:
        # The dataclass's own form, less what must never be printed: the token (repr=False) and any
        # credential inside a URL (db_url, collector_url, report_server, kubelet_url, scrape).
        shown = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if f.repr)
        return redact.text(f"Settings({shown})")

    def __post_init__(self) -> None:
        # The one check of every numeric setting, however the Settings was made (load_settings has already
        # checked each value under the name the user gave it, so its errors say --interval or
        # WATTWATCH_INTERVAL; this one names the field). Stored as float: "5" and 5 are 5.0.
        for name in RANGES:
            value = getattr(self, name)
            object.__setattr__(self, name, check_setting(name, value, f"setting {name}={value!r}"))
        for name in SWITCHES:
            value = getattr(self, name)
            object.__setattr__(self, name, check_switch(value, f"setting {name}={value!r}"))

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


@dataclass(frozen=True)
class Range:
    """The values a numeric setting may take: ``low`` to ``high``, both included unless ``above_low``;
    0 as well where ``or_zero`` (0 meaning off); only whole numbers where ``whole``."""

    low: float
    high: float
    allowed: str  # what to tell the user, as a clause: "the sampling tick is 0.05 to 3600 seconds"
    above_low: bool = False
    or_zero: bool = False
    whole: bool = False

    def holds(self, value: float) -> bool:
        """Whether ``value`` is in the range (NaN never is)."""
        if self.or_zero and value == 0:
            return True
        return (value > self.low if self.above_low else value >= self.low) and value <= self.high


_YEAR_S = 365.0 * 86400.0
# Every numeric setting and its range; Settings refuses a value outside it, whatever its source.
RANGES: dict[str, Range] = {
    "interval_s": Range(0.05, 3600.0, "the sampling tick is 0.05 to 3600 seconds"),
    "push_interval_s": Range(0.1, 3600.0, "the push interval is 0.1 to 3600 seconds"),
    "grid_intensity_g_per_kwh": Range(0.0, 5000.0, "the grid intensity is 0 to 5000 gCO2e/kWh"),
    "pue": Range(1.0, 10.0, "the PUE is 1 (no overhead) to 10"),
    "price_per_kwh": Range(0.0, 1e6, "the price is 0 (no cost in reports) or more per kWh"),
    "cpu_tdp_w": Range(0.0, 10000.0, "the CPU TDP is 0 (look it up) to 10000 W"),
    "metrics_retention_s": Range(0.0, _YEAR_S, "finished jobs stay on /metrics 0 to 31536000 seconds (a year)"),
    "restart_bridge_max_s": Range(0.0, _YEAR_S, "a restart's gap is bridged 0 to 31536000 seconds (a year)"),
    "host_silent_after_s": Range(
        0.0, _YEAR_S, "a host is silent after 0 (never) to 31536000 seconds (a year) without a word"
    ),
    "time_window_past_s": Range(
        0.0,
        math.inf,
        "the time window back is a positive number of seconds (as a flag a duration: --time-window-past 30d)",
        True,
    ),
    "time_window_future_s": Range(
        0.0,
        math.inf,
        "the time window ahead is a positive number of seconds (as a flag a duration: --time-window-future 1d)",
        True,
    ),
    "retention_days": Range(0.0, 36500.0, "retention is 0 (keep everything) or up to 36500 days"),
    "header_timeout_s": Range(0.1, 3600.0, "the header timeout is 0.1 to 3600 seconds (default 10)"),
    "body_timeout_s": Range(0.1, 3600.0, "the body timeout is 0.1 to 3600 seconds (default 60)"),
    "max_reads": Range(1, 100_000, "reads at once are 1 to 100000 (default 16)", whole=True),
    "max_writes": Range(1, 100_000, "writes at once are 1 to 100000 (default 2048)", whole=True),
    "max_connections": Range(1, 1_000_000, "the connection limit is 1 to 1000000 (default 4096)", whole=True),
    # Under 10 ms a fine tick is shorter than the fastest board's refresh: every interval would be an
    # estimate, at hundreds of reads a second.
    "fine_interval_s": Range(0.01, 3600.0, "the fine tick is 0 (off) or 0.01 to 3600 seconds", or_zero=True),
    "fine_tick_hold_s": Range(0.0, 3600.0, "the fine tick holds 0 to 3600 seconds after the last query span"),
    "poison_after": Range(1, 1000, "a batch is set aside after 1 to 1000 failed attempts (default 5)", whole=True),
}

# What each text setting holds (the settings reference page shows it beside the ranges above).
TEXT_FORMS: dict[str, str] = {
    "db_url": "a SQLAlchemy URL (postgresql+psycopg://...); empty: embedded SQLite at home/wattwatch.db",
    "listen": "HOST:PORT the collector listens on",
    "collector_url": "the collector's http:// or https:// URL the agent pushes to",
    "report_server": "the collector `report` and `jobs` ask when neither --server nor --db is given",
    "token": "a bearer token; a secret, never printed",
    "token_file": "a file holding the bearer token on one line",
    "ca_file": "a PEM CA bundle trusted for an https collector",
    "tls_cert": "the collector's PEM certificate (serves https with tls_key)",
    "tls_key": "the collector's PEM private key",
    "host": "this host's name in reports; empty: the machine's hostname",
    "grid_region": "ISO 3166 country code (FR, USA) or provider:region (gcp:europe-west9)",
    "grid_regions": "per-host regions on the collector: HOSTGLOB=REGION,...",
    "currency": "the currency of price_per_kwh, e.g. USD or EUR",
    "metric_labels": "job label keys exported as labels on the collector's job series: team,namespace",
    "metrics_listen": "HOST:PORT of the agent's own /metrics; empty: not served",
    "proc_root": "the host's /proc (/host/proc in a pod)",
    "kubelet_url": "the kubelet's pods API: https://$(NODE_IP):10250/pods; empty: not asked",
    "kubelet_token_file": "its bearer token file; empty: the pod's service account token, if any",
    "kubelet_ca_file": "a PEM CA bundle for the kubelet's certificate",
    "scrape": "serving engines' metrics: PRESET:URL[#job=ID] items (vllm, tgi, triton, sglang, custom)",
}

# The yes/no settings, and the words that say yes or no in the environment.
SWITCHES = ("discover", "kubelet_insecure")
_YES = frozenset({"1", "true", "yes", "on"})
_NO = frozenset({"0", "false", "no", "off", ""})


def check_setting(name: str, raw: object, where: str) -> float:
    """``raw`` as setting ``name``'s type, checked against its range; ConfigError naming ``where`` (how the
    user gave it: ``--interval 0``, ``WATTWATCH_INTERVAL=0``) and what is allowed otherwise. A whole-number
    setting comes back as an int."""
    rule = RANGES[name]
    if isinstance(raw, bool):  # TOML's true/false: a bool is an int to Python, never a setting's number
        raise ConfigError(f"{where} is not a number; {rule.allowed}")
    try:
        value = float(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(f"{where} is not a number; {rule.allowed}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{where} is not a finite number; {rule.allowed}")
    if rule.whole and not value.is_integer():
        raise ConfigError(f"{where} is not a whole number; {rule.allowed}")
    if not rule.holds(value):
        raise ConfigError(f"{where} is out of range; {rule.allowed}")
    return int(value) if rule.whole else value


def check_switch(raw: object, where: str) -> bool:
    """``raw`` as a yes/no setting: a bool, or one of 1/0, true/false, yes/no, on/off as text."""
    if isinstance(raw, bool):
        return raw
    if isinstance(raw, str) and raw.strip().lower() in _YES | _NO:
        return raw.strip().lower() in _YES
    raise ConfigError(f"{where} is not a yes/no value; use 1 or 0 (true or false in the TOML file)")


def parse_listen(text: str) -> tuple[str, int]:
    """``"127.0.0.1:8470"`` -> ``("127.0.0.1", 8470)``; raises ConfigError saying what is expected."""
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"listen address {text!r} is not HOST:PORT; use e.g. 127.0.0.1:8470")
    return host.strip("[]") or "0.0.0.0", int(port)


ENV_VARS = {
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
    "header_timeout_s": "WATTWATCH_HEADER_TIMEOUT",
    "body_timeout_s": "WATTWATCH_BODY_TIMEOUT",
    "max_connections": "WATTWATCH_MAX_CONNECTIONS",
    "max_reads": "WATTWATCH_MAX_READS",
    "max_writes": "WATTWATCH_MAX_WRITES",
    "discover": "WATTWATCH_DISCOVER",
    "proc_root": "WATTWATCH_PROC_ROOT",
    "kubelet_url": "WATTWATCH_KUBELET_URL",
    "kubelet_token_file": "WATTWATCH_KUBELET_TOKEN_FILE",
    "kubelet_ca_file": "WATTWATCH_KUBELET_CA_FILE",
    "kubelet_insecure": "WATTWATCH_KUBELET_INSECURE",
    "scrape": "WATTWATCH_SCRAPE",
    "fine_interval_s": "WATTWATCH_FINE_INTERVAL",
    "fine_tick_hold_s": "WATTWATCH_FINE_HOLD",
    "poison_after": "WATTWATCH_POISON_AFTER",
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


_SECRETS = frozenset(f.name for f in fields(Settings) if not f.repr)  # the secrets: kept out of repr


def load_settings(
    env: Mapping[str, str] | None = None,
    config_file: Path | None = None,
    flags: Mapping[str, tuple[str, object]] | None = None,
) -> Settings:
    """Build Settings from defaults, the TOML file, the environment and ``flags`` (setting name ->
    (the flag as typed, e.g. ``"--interval 0"``, its value)); raise ConfigError naming the bad one."""
    env = os.environ if env is None else env
    home = default_home(env)
    values: dict[str, object] = {"home": home}
    named = config_file or (Path(env["WATTWATCH_CONFIG"]) if env.get("WATTWATCH_CONFIG", "").strip() else None)
    path = named or home / "wattwatch.toml"
    known = {f.name for f in fields(Settings)}
    if named is not None and not path.is_file():
        # A file asked for by name and not there is a mistake to say, not a default to fall back on.
        raise ConfigError(f"config file {path} {'is not a file' if path.exists() else 'does not exist'}")
    if path.exists():
        import tomllib  # only where there is a file to read (1.5 ms of a read command's start-up)

        try:
            table = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{path} is not valid TOML ({exc}); fix or remove it") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from None
        for name, raw in table.items():
            if name not in known:
                raise ConfigError(f"unknown setting {name!r} in {path}; known: {', '.join(sorted(known))}")
            if name == "home":
                # The home is where this file is looked for: it comes from WATTWATCH_HOME or --home.
                raise ConfigError(f"home cannot be set in {path}; use WATTWATCH_HOME or --home")
            # A secret's value stays out of the error, as out of every repr.
            shown = "(hidden)" if name in _SECRETS else repr(raw)
            values[name] = _coerce(name, raw, f"{name} = {shown} in {path}")
    for name, var in ENV_VARS.items():
        if var in env:
            values[name] = _coerce(name, env[var], f"{var}={env[var]}")
    for name, (where, raw) in (flags or {}).items():
        values[name] = _coerce(name, raw, where)
    return Settings(**values)  # type: ignore[arg-type]


def _coerce(name: str, raw: object, where: str) -> object:
    """``raw`` as the type of setting ``name`` (numbers checked by ``check_setting``)."""
    if name in RANGES:
        return check_setting(name, raw, where)
    if name in SWITCHES:
        return check_switch(raw, where)
    if name == "home":
        return Path(str(raw)).expanduser()
    if not isinstance(raw, str):
        raise ConfigError(f"{where} is not a string; give it in quotes")
    return raw
