"""Agent settings for job discovery and scraping, from ``WATTWATCH_*`` environment variables.

They live here, beside the code that uses them, until ``config.Settings`` carries them;
``AgentOptions.from_env()`` is what ``wattwatch agent`` and ``wattwatch up`` read, and takes the
command line's values on top.

    WATTWATCH_DISCOVER=0                 do not attribute untagged GPU processes (default: on)
    WATTWATCH_PROC_ROOT=/host/proc       where the host's /proc is (default /proc)
    WATTWATCH_KUBELET_URL=https://$(NODE_IP):10250/pods   names, labels, annotations of pods
    WATTWATCH_KUBELET_TOKEN_FILE=...     bearer token (default: the pod's service account token, if any)
    WATTWATCH_KUBELET_CA_FILE=...        CA bundle for the kubelet's certificate
    WATTWATCH_KUBELET_INSECURE=1         skip verifying it (kubelets often serve self-signed certificates)
    WATTWATCH_SCRAPE="vllm:http://127.0.0.1:8000/metrics#job=chat triton:http://127.0.0.1:8002/metrics"
    WATTWATCH_FINE_INTERVAL=0.1          tick while query spans arrive (s; 0: never tick faster than usual)
    WATTWATCH_FINE_HOLD=5                how long after the last query span the fine tick lasts (s)
    WATTWATCH_POISON_AFTER=5             set a batch aside after this many 5xx/no-answer failures while
                                         later batches land (agent.poison)
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from wattwatch.agent.kubelet import SERVICE_ACCOUNT_TOKEN
from wattwatch.agent.poison import DEFAULT_POISON_AFTER, poison_after_from_env
from wattwatch.agent.scrape import ScrapeTarget, parse_target, parse_targets
from wattwatch.errors import ConfigError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}

MIN_FINE_INTERVAL_S = 0.01
MAX_FINE_HOLD_S = 3600.0


@dataclass(frozen=True)
class AgentOptions:
    """What the agent discovers and scrapes, beyond ``config.Settings``."""

    discover: bool = True
    proc_root: Path = Path("/proc")
    kubelet_url: str = ""
    kubelet_token_file: Path | None = None
    kubelet_verify: bool | str = True
    scrape: tuple[ScrapeTarget, ...] = ()
    # While a job on this host sends query spans (and ``fine_tick_hold_s`` after the last one), intervals
    # close every ``fine_interval_s``: per-query energy needs the power's shape within a tick (1 s ticks put
    # p95 J/query ~6 % low; 0.1 s, the NVML counter's update period, within 1-2 %). 0 turns it off.
    fine_interval_s: float = 0.1
    fine_tick_hold_s: float = 5.0
    # A batch failing with 5xx (or no answer) this many times while later batches land is set aside.
    poison_after: int = DEFAULT_POISON_AFTER

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        scrape: Sequence[str] = (),
        kubelet_url: str | None = None,
        proc_root: str | None = None,
        discover: bool | None = None,
        fine_interval_s: float | None = None,
        poison_after: int | None = None,
    ) -> AgentOptions:
        """Read the ``WATTWATCH_*`` variables above, then apply command-line values (given ones win;
        ``scrape`` specs are added to the variable's); raises ConfigError naming the bad value."""
        env = os.environ if env is None else env
        url = (kubelet_url if kubelet_url is not None else env.get("WATTWATCH_KUBELET_URL", "")).strip()
        if url and not url.startswith(("http://", "https://")):
            raise ConfigError(f"kubelet URL {url!r} is not a URL; e.g. https://$(NODE_IP):10250/pods")
        token_file: Path | None = None
        if env.get("WATTWATCH_KUBELET_TOKEN_FILE"):
            token_file = Path(env["WATTWATCH_KUBELET_TOKEN_FILE"])
        elif url.startswith("https://") and SERVICE_ACCOUNT_TOKEN.exists():
            token_file = SERVICE_ACCOUNT_TOKEN
        verify: bool | str = True
        if env.get("WATTWATCH_KUBELET_CA_FILE"):
            verify = env["WATTWATCH_KUBELET_CA_FILE"]
        if _flag(env, "WATTWATCH_KUBELET_INSECURE", False):
            verify = False
        try:
            targets = parse_targets(env.get("WATTWATCH_SCRAPE", ""))
        except ConfigError as exc:
            raise ConfigError(f"WATTWATCH_SCRAPE: {exc}") from None
        targets += tuple(parse_target(spec) for spec in scrape)
        fine_s = _seconds(env, "WATTWATCH_FINE_INTERVAL", 0.1) if fine_interval_s is None else fine_interval_s
        # NaN fails every comparison. Under 10 ms a fine tick is shorter than the fastest board's refresh:
        # every interval would be an estimate, at hundreds of reads a second.
        if not (fine_s == 0 or (fine_s >= MIN_FINE_INTERVAL_S and math.isfinite(fine_s))):
            raise ConfigError(
                f"the fine tick interval must be 0 (off) or {MIN_FINE_INTERVAL_S:g} seconds or more, got {fine_s}"
            )
        hold_s = _seconds(env, "WATTWATCH_FINE_HOLD", 5.0)
        if hold_s > MAX_FINE_HOLD_S:
            raise ConfigError(f"WATTWATCH_FINE_HOLD={hold_s:g} is out of range; the fine tick holds 0 to 3600 seconds")
        return cls(
            discover=_flag(env, "WATTWATCH_DISCOVER", True) if discover is None else discover,
            proc_root=Path(proc_root or env.get("WATTWATCH_PROC_ROOT") or "/proc"),
            kubelet_url=url,
            kubelet_token_file=token_file,
            kubelet_verify=verify,
            scrape=targets,
            fine_interval_s=fine_s,
            fine_tick_hold_s=hold_s,
            poison_after=poison_after_from_env(env, poison_after),
        )


def _flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    if name not in env:
        return default
    value = env[name].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ConfigError(f"{name}={env[name]!r} is not a yes/no value; use 1 or 0")


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    if not env.get(name, "").strip():
        return default
    try:
        value = float(env[name])
    except ValueError:
        raise ConfigError(f"{name}={env[name]!r} is not a number of seconds") from None
    if not (value >= 0 and math.isfinite(value)):
        raise ConfigError(f"{name}={env[name]!r} must be 0 or more seconds")
    return value
