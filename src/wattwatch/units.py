"""Plain measurement values and unit conversions. Imports nothing of ours.

Every quantity in wattwatch carries its unit in its name: ``energy_j`` (joules), ``power_w`` (watts),
``t_s``/``duration_s`` (seconds; absolute times are Unix epoch seconds, UTC).
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Literal

DeviceKind = Literal["gpu", "cpu", "dram"]
DEVICE_KINDS: tuple[DeviceKind, ...] = ("gpu", "cpu", "dram")

# Where an interval's energy came from. Reports show it: an estimate is never presented as a measurement.
Source = Literal["counter", "power", "estimate", "simulated"]
SOURCES: tuple[Source, ...] = ("counter", "power", "estimate", "simulated")

JobKind = Literal["training", "inference", "other"]
JOB_KINDS: tuple[JobKind, ...] = ("training", "inference", "other")

J_PER_KWH = 3.6e6


def mj_to_j(energy_mj: float) -> float:
    """Millijoules (NVML's energy counter unit) to joules."""
    return energy_mj / 1000.0


def uj_to_j(energy_uj: float) -> float:
    """Microjoules (RAPL's ``energy_uj`` unit) to joules."""
    return energy_uj / 1e6


def mw_to_w(power_mw: float) -> float:
    """Milliwatts (NVML's power unit) to watts."""
    return power_mw / 1000.0


def j_to_kwh(energy_j: float) -> float:
    """Joules to kilowatt-hours."""
    return energy_j / J_PER_KWH


def iso_utc(t_s: float | None) -> str | None:
    """Unix seconds to an ISO 8601 UTC string (``None`` stays ``None``)."""
    if t_s is None:
        return None
    return datetime.fromtimestamp(t_s, tz=UTC).isoformat().replace("+00:00", "Z")


def parse_duration_s(text: str) -> float:
    """Parse ``90s``, ``15m``, ``12h``, ``7d`` or a bare number of seconds into seconds.

    Raises ValueError with a message that says what a valid value looks like.
    """
    factors = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
    raw = text.strip().lower()
    try:
        value = float(raw[:-1]) * factors[raw[-1]] if raw and raw[-1] in factors else float(raw)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration; use e.g. 90s, 15m, 12h or 7d") from None
    if not math.isfinite(value):  # "nan", "inf", "1e400s": float() takes them all
        raise ValueError(f"{text!r} is not a finite duration; use e.g. 90s, 15m, 12h or 7d")
    if value < 0:
        raise ValueError(f"{text!r} is negative; use e.g. 7d")
    return value
