"""Plain measurement values and unit conversions. Imports nothing of ours.

Every quantity in wattwatch carries its unit in its name: ``energy_j`` (joules), ``power_w`` (watts),
``t_s``/``duration_s`` (seconds; absolute times are Unix epoch seconds, UTC).
"""

from __future__ import annotations

import re
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


# A duration as people type one: a number of seconds, or a number and a unit (s, m, h, d, w); no exponents,
# inf, nan, signs or blanks. Nine digits of weeks reach 17 million years. The collector's ``since`` and
# ``until`` parameters use these patterns too (collector.contract), so the CLI and the API agree.
DURATION_PATTERN = r"^[0-9]{1,9}(\.[0-9]{1,6})?[smhdwSMHDW]?$"
# An ISO 8601 date, or date and time (UTC unless it has an offset), that is a real one: the pattern holds
# each month's days and the leap years, so every string it admits parses (the OpenAPI document states it,
# and a value it admits must not be refused).
_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_MONTH_DAY = r"((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
_LEAP_DAY = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][48]|[13579][26]|[2468]0)00)-02-29"
_CLOCK = r"([T ]([01][0-9]|2[0-3]):[0-5][0-9](:[0-5][0-9](\.[0-9]{1,6})?)?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])?)?"
DATE_PATTERN = f"^({_YEAR}-{_MONTH_DAY}|{_LEAP_DAY}){_CLOCK}$"
# ``--since`` / ``--until`` / ``since=`` / ``until=``: how far back from now, or a date.
TIME_PATTERN = f"({DURATION_PATTERN})|({DATE_PATTERN})"
_DURATION_RE = re.compile(DURATION_PATTERN)
_DATE_RE = re.compile(DATE_PATTERN)
_DURATION_EXAMPLES = "e.g. 90s, 15m, 12h or 7d"
TIME_EXAMPLES = "a duration back from now (90s, 15m, 12h, 7d) or a date (2026-11-30, 2026-11-30T08:00Z)"


def parse_duration_s(text: str) -> float:
    """Parse ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` or a bare number of seconds (``DURATION_PATTERN``).

    Raises ValueError with a message that says what a valid value looks like.
    """
    raw = text.strip()
    if raw.startswith("-") and _DURATION_RE.match(raw[1:]):
        raise ValueError(f"{text!r}: negative durations are invalid; use e.g. {raw[1:]}")
    if not _DURATION_RE.match(raw):
        raise ValueError(f"{text!r} is not a duration; use {_DURATION_EXAMPLES}")
    factors = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
    unit = raw[-1].lower()
    return float(raw[:-1]) * factors[unit] if unit in factors else float(raw)


def parse_time_s(text: str, now_s: float) -> float:
    """An instant from ``TIME_PATTERN``: ``now_s`` less a duration, or a date (UTC unless it says otherwise).

    Raises ValueError saying what a valid value looks like.
    """
    raw = text.strip()
    if _DATE_RE.match(raw):
        try:
            when = datetime.fromisoformat(raw)
            if when.tzinfo is None:
                when = when.replace(tzinfo=UTC)
            t_s = when.timestamp()
        except OverflowError:  # year 1 less an offset, or 9999-12-31 plus one: before or after any instant
            t_s = _EARLIEST_S if when.year == 1 else _LATEST_S
        except ValueError:  # what the pattern admits parses; kept for a caller that skips it
            raise ValueError(f"{text!r} is not a real date; use {TIME_EXAMPLES}") from None
    else:
        if raw.startswith("-") and _DURATION_RE.match(raw[1:]):
            raise ValueError(f"{text!r}: negative durations are invalid; give how far back as a positive one")
        if re.match(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}", raw):
            raise ValueError(f"{text!r} is not a real date; use {TIME_EXAMPLES}")
        if not _DURATION_RE.match(raw):
            raise ValueError(f"{text!r} is not {TIME_EXAMPLES}")
        t_s = now_s - parse_duration_s(raw)
    # Reports print these instants as dates (and round the idle window out to whole hours): kept a day inside
    # what a date can show, or the answer would fail where the question was accepted. Clamped, not refused:
    # "since 300000 years ago" asks for everything, as "since 0001-01-02" does.
    return min(max(t_s, _EARLIEST_S), _LATEST_S)


_EARLIEST_S = datetime(1, 1, 2, tzinfo=UTC).timestamp()
_LATEST_S = datetime(9999, 12, 30, tzinfo=UTC).timestamp()
