"""The command line's flags as ``config.Settings``: the file and the environment, with the flags on top."""

from __future__ import annotations

import argparse
import dataclasses

from wattwatch import redact
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings, load_settings, parse_listen, resolve_token
from wattwatch.errors import ConfigError
from wattwatch.protocol.units import parse_duration_s

# Commands that talk to a collector or serve one, so need the bearer token (from --token-file too).
_TOKEN_COMMANDS = ("up", "demo", "collector", "agent", "report", "run", "top", "jobs")
_AGENT_COMMANDS = ("agent", "up", "demo")


def settings_from(args: argparse.Namespace) -> Settings:
    """Settings for this run: defaults, the TOML file, ``WATTWATCH_*``, then the flags in ``args``; each
    value checked alike (``config.check_setting``) and a bad one named as the user gave it."""
    flags: dict[str, tuple[str, object]] = {}

    def given(name: str, flag: str, value: object, shown: object = None) -> None:
        flags[name] = (f"{flag} {value if shown is None else shown}", value)

    if getattr(args, "db", None):
        given("db_url", "--db", args.db)
    if getattr(args, "listen", None):
        host, port = parse_listen(args.listen)
        given("listen", "--listen", args.listen)
        if args.command in ("up", "demo"):
            given("collector_url", "--listen", f"http://{host}:{port}", args.listen)
    metrics_listen = getattr(args, "metrics_listen", None)
    if metrics_listen is not None:
        if metrics_listen:
            try:
                parse_listen(metrics_listen)
            except ConfigError:
                raise UsageError(
                    f"--metrics-listen {metrics_listen!r} is not HOST:PORT; use e.g. 0.0.0.0:9471"
                ) from None
        given("metrics_listen", "--metrics-listen", metrics_listen)
    if args.command in _AGENT_COMMANDS:  # `top --interval` is its frame rate, not the sampling tick
        if getattr(args, "interval", None) is not None:
            given("interval_s", "--interval", args.interval)
        if getattr(args, "push_interval", None) is not None:
            given("push_interval_s", "--push-interval", args.push_interval)
        for name, flag in (("fine_interval", "fine_interval_s"), ("poison_after", "poison_after")):
            if getattr(args, name, None) is not None:
                given(flag, f"--{name.replace('_', '-')}", getattr(args, name))
        if getattr(args, "kubelet_url", None):
            given("kubelet_url", "--kubelet-url", args.kubelet_url)
        if getattr(args, "proc_root", None):
            given("proc_root", "--proc-root", args.proc_root)
        if getattr(args, "no_discover", False):
            given("discover", "--no-discover", False, "")
    for name, field in (
        ("header_timeout", "header_timeout_s"),
        ("body_timeout", "body_timeout_s"),
        ("max_connections", "max_connections"),
        ("max_reads", "max_reads"),
        ("max_writes", "max_writes"),
    ):
        if getattr(args, name, None) is not None:
            given(field, f"--{name.replace('_', '-')}", getattr(args, name))
    if getattr(args, "retention_days", None) is not None:
        given("retention_days", "--retention-days", args.retention_days)
    for flag, name in (("past", "time_window_past_s"), ("future", "time_window_future_s")):
        raw = getattr(args, f"time_window_{flag}", None)
        if raw is not None:
            try:
                given(name, f"--time-window-{flag}", parse_duration_s(raw), raw)
            except ValueError as exc:
                raise UsageError(f"--time-window-{flag}: {exc}") from None
    if args.command == "agent":
        if args.collector:
            if not args.collector.startswith(("http://", "https://")):
                raise UsageError(f"--collector {args.collector!r} is not a URL; use e.g. http://collector:8470")
            given("collector_url", "--collector", args.collector)
        if args.host:
            given("host", "--host", args.host)
    if getattr(args, "metric_labels", None) is not None:
        from wattwatch.collector.metrics import metric_label_names

        metric_label_names(args.metric_labels)  # a clash is a usage error now, not when the first scrape comes
        given("metric_labels", "--metric-labels", args.metric_labels)
    for name, value in _identity_changes(args).items():
        given(name, f"--{name.replace('_', '-')}", value, "..." if name == "token" else None)
    settings = load_settings(flags=flags)
    if getattr(args, "grid_region", None) or (args.command in _AGENT_COMMANDS and settings.grid_region):
        # Checked before a service starts anything (sensors, sockets), so a bad region is the only output.
        from wattwatch.carbon import grid

        try:
            region = grid.check_region(getattr(args, "grid_region", None) or settings.grid_region)
        except grid.UnknownRegion as exc:
            if getattr(args, "grid_region", None):
                raise UsageError(f"--grid-region: {exc}") from None
            raise ConfigError(f"{exc} (WATTWATCH_GRID_REGION or grid_region in the config file)") from None
        settings = dataclasses.replace(settings, grid_region=region)
    if args.command not in _TOKEN_COMMANDS:
        return settings
    settings = resolve_token(settings)
    redact.remember(settings.token)  # masked in every log line from now on
    return settings


def _identity_changes(args: argparse.Namespace) -> dict[str, str]:
    """The token, token file, CA and TLS files given as flags (a token given clears a token file, and the
    other way round)."""
    changes: dict[str, str] = {}
    if getattr(args, "token", None):
        changes.update(token=args.token, token_file="")
    if getattr(args, "token_file", None):
        changes.update(token_file=args.token_file, token="")
    for name in ("ca_file", "tls_cert", "tls_key"):
        if getattr(args, name, None):
            changes[name] = getattr(args, name)
    return changes
