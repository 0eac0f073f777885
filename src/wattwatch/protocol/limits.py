"""Every bound on what enters wattwatch, in one place: the collector's HTTP API, the agent's socket and the
SDK all check against these, so a value one of them accepts the others accept too.

Why each bound is where it is:

- Strings fit their columns: names, ids, device keys, GPU UUIDs and models are ``String(200)`` on
  PostgreSQL (SQLite would store anything, so without the bound the two backends disagree). No string
  may hold a NUL character: PostgreSQL refuses it in text, SQLite stores it.
- Integers fit their columns: token counts are 32-bit ``Integer`` columns (``queries.tokens_in``), so
  every count of one record is at most 2**31 - 1; the sums of such counts are ``BigInteger`` and need
  2**32 records at the maximum before they could overflow. A batch's ``seq`` is a 64-bit ``BigInteger``.
- Floats are finite and bounded so that no sum can reach infinity: an interval holds at most
  ``MAX_ENERGY_J`` (10 GJ, a megawatt for almost three hours: far above any device), so even 2**63 of
  them sum to a finite double.
- Times are Unix seconds (a millisecond timestamp is beyond ``MAX_EPOCH_S``, the year 2286) and, where
  data enters, within a window around now (``TimeWindow``: 30 days back, 1 day ahead by default; the
  collector's ``--time-window-past`` / ``--time-window-future``). A span from 1970 is a client's bug, and
  taking it would cost every pass that walks the job's time line.
- A span (query, step, epoch) lasts at most ``MAX_SPAN_S`` (7 days): the span-energy pass looks back
  over a kind's longest span when it starts a job afresh, so one span of a month would make that cost
  a month of the job's spans and ticks.
- Labels are a small dictionary of short strings: at most ``MAX_LABELS`` of them.

Imports nothing of wattwatch's: ``wire`` builds its msgspec types from these constants.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wattwatch.protocol import wire

# --- strings -------------------------------------------------------------------------------------------
MAX_NAME_CHARS = 200  # names, ids, keys, UUIDs, models: String(200) columns
MAX_LABELS = 64
MAX_LABEL_KEY_CHARS = 512  # "k8s.label." + a Kubernetes label key (up to 317 characters) fits
MAX_LABEL_VALUE_CHARS = 1024
MAX_FLAGS = 8
MAX_FLAG_CHARS = 24  # 8 flags x 24 characters + 7 commas = 199: the joined flags fit a String(200) column
NO_NUL = r"^[^\x00]*$"  # a msgspec / JSON Schema pattern: no NUL anywhere
# Patterns that end a whole value say `(?!\n)$`: msgspec matches with Python's re, where a bare `$` also
# matches before a final newline, so `gpu0\n` passed as a key. The look-ahead means nothing to JSON
# Schema's (ECMA) regexes, where `$` is the end already, so the published contract is unchanged in effect.
FLAG_PATTERN = r"^[a-z0-9_]+(?!\n)$"
# A host's grid region (``wattwatch.carbon.grid``): an ISO 3166 country code (FR, FRA) or a cloud
# provider and region (gcp:europe-west9). Stored in hosts.grid_region, a String(64) column.
MAX_GRID_REGION_CHARS = 64
GRID_REGION_PATTERN = r"^(?:[A-Za-z]{2,3}|[A-Za-z0-9]+:[A-Za-z0-9_-]+)(?!\n)$"
OWN_LABEL_PREFIX = "wattwatch.io/"  # labels wattwatch itself sets (phases, discovery): kept first

# --- integers ------------------------------------------------------------------------------------------
MAX_INT32 = 2**31 - 1
MAX_INT64 = 2**63 - 1
MAX_TOKENS = MAX_INT32  # per span or count window
MAX_COUNT = MAX_INT32  # queries per count window
MAX_DEVICE_INDEX = MAX_INT32  # devices.index is an Integer column
MAX_PID = MAX_INT32
MAX_SEQ = MAX_INT64
MAX_DEVICES = 1024  # per batch, and per job
MAX_SHARES = 1024  # jobs sharing one device in one interval

# --- floats --------------------------------------------------------------------------------------------
MAX_ENERGY_J = 1e10  # per interval
MAX_POWER_W = 1e6  # a device's power limit
MAX_WEIGHT = 1e15  # a share weight (CPU seconds, bytes of GPU memory, ...): 1024 of them sum finitely

# --- times ---------------------------------------------------------------------------------------------
MIN_EPOCH_S = 0.0
MAX_EPOCH_S = 1e10  # 2286-11-20: a larger "Unix time" is in milliseconds (time.time() * 1000)
DEFAULT_PAST_S = 30 * 86400.0
DEFAULT_FUTURE_S = 86400.0
# A job's start may lie further back than the window: a training run of months sends its start with its end.
MAX_JOB_AGE_S = 400 * 86400.0
# The longest span (query, step or epoch; count windows are the agent's own and not bounded by it). The
# span-energy pass, starting a job's window afresh (late data, a restart), reads every span of the kind
# that began up to the kind's longest span before it, and ticks from the earliest in flight: a 30-day
# span would make that a month of rows per window. A week covers any epoch or request worth one record; a
# longer phase is several spans.
MAX_SPAN_S = 7 * 86400.0

# --- report pages (GET /api/v1/report, `wattwatch report`) ----------------------------------------------
REPORT_DEFAULT_LIMIT = 1000
REPORT_MAX_LIMIT = 10_000
# With neither a window nor one job asked for, a report covers this (and says so), never all history.
REPORT_DEFAULT_SINCE = "7d"
# What storage.reads.encode_cursor writes: the page's last start time as float.hex(), "~", and its job id.
# Exact: every string it admits is a position (an unknown job id included), so none is refused once admitted.
CURSOR_PATTERN = r"^-?0x[01]\.[0-9a-f]{0,13}p[+-][0-9]{1,3}~[A-Za-z0-9_.:@/-]{1,200}$"

# --- why something was refused (the agent's wattwatch_agent_refused_total{reason}) ---------------------
REASON_TIME = "timestamp"  # not finite, not Unix seconds, or outside the time window
REASON_ORDER = "end_before_start"
REASON_RANGE = "out_of_range"  # a count, energy, power, weight or span length beyond its bound
REASON_STRING = "string"  # too long, empty, or holding a NUL
REASON_LABELS = "labels"
REASON_MALFORMED = "malformed"  # missing, of the wrong type, or not one of the allowed values
REASONS = (REASON_TIME, REASON_ORDER, REASON_RANGE, REASON_STRING, REASON_LABELS, REASON_MALFORMED)


class BoundError(ValueError):
    """A value outside its bound or not fitting the wire format.

    ``field`` is its dotted path (``intervals[3].energy_j``), ``message`` says what to fix, ``reason``
    is one of ``REASONS`` (what the agent counts refusals by).
    """

    def __init__(self, field: str, message: str, reason: str = REASON_MALFORMED) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message
        self.reason = reason


def _iso(t_s: float) -> str:
    try:
        return datetime.fromtimestamp(t_s, tz=UTC).isoformat().replace("+00:00", "Z")
    except (OverflowError, OSError, ValueError):
        return repr(t_s)


def _duration(seconds: float) -> str:
    if seconds >= 86400 and seconds % 86400 == 0:
        return f"{seconds / 86400:g} d"
    if seconds >= 3600 and seconds % 3600 == 0:
        return f"{seconds / 3600:g} h"
    return f"{seconds:g} s"


def check_epoch(field: str, t_s: Any) -> float:
    """``t_s`` as a float if it is Unix seconds (finite, 1970 to 2286); else BoundError naming ``field``."""
    # type() first: the SDK's spans are plain floats, and an ABC check costs more than the rest together.
    if type(t_s) is not float and (isinstance(t_s, bool) or not isinstance(t_s, numbers.Real)):
        raise BoundError(field, f"expected Unix seconds (a number), got {type(t_s).__name__}", REASON_MALFORMED)
    t = float(t_s)
    if not MIN_EPOCH_S <= t <= MAX_EPOCH_S:  # also false for NaN
        if t > MAX_EPOCH_S and math.isfinite(t):
            hint = "; times are Unix seconds (time.time()), not milliseconds"
        else:
            hint = ""
        raise BoundError(field, f"{t_s!r} is not Unix seconds between 0 and {MAX_EPOCH_S:g}{hint}", REASON_TIME)
    return t


@dataclass(frozen=True)
class TimeWindow:
    """Times accepted where data enters: from ``past_s`` before now to ``future_s`` after it."""

    past_s: float = DEFAULT_PAST_S
    future_s: float = DEFAULT_FUTURE_S

    def __post_init__(self) -> None:
        for name in ("past_s", "future_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"the time window's {name} must be a positive number of seconds, got {value!r}")

    def check(self, field: str, t_s: float, now_s: float, *, past_s: float | None = None) -> None:
        """BoundError naming ``field`` unless ``t_s`` lies in the window around ``now_s`` (reaching back
        ``past_s`` instead, when given)."""
        back_s = self.past_s if past_s is None else past_s
        if t_s < now_s - back_s:
            raise BoundError(
                field,
                f"{_iso(t_s)} is more than {_duration(back_s)} before now ({_iso(now_s)}); "
                f"accepted: {_duration(back_s)} back to {_duration(self.future_s)} ahead",
                REASON_TIME,
            )
        if t_s > now_s + self.future_s:
            raise BoundError(
                field,
                f"{_iso(t_s)} is more than {_duration(self.future_s)} after now ({_iso(now_s)}); "
                f"accepted: {_duration(back_s)} back to {_duration(self.future_s)} ahead",
                REASON_TIME,
            )


DEFAULT_WINDOW = TimeWindow()


def _check_range(field: str, start_s: float, end_s: float, now_s: float, window: TimeWindow) -> None:
    window.check(f"{field}t_start_s", start_s, now_s)
    window.check(f"{field}t_end_s", end_s, now_s)


def check_job_times(job: wire.Job, now_s: float, window: TimeWindow, prefix: str = "") -> None:
    """The job's end lies in the window, its start (0: unknown, taken as now by the collector) in the window
    stretched back to ``MAX_JOB_AGE_S``: a long run's end record carries its start."""
    if job.started_at_s != 0.0:
        window.check(f"{prefix}started_at_s", job.started_at_s, now_s, past_s=max(window.past_s, MAX_JOB_AGE_S))
    if job.ended_at_s is not None:
        window.check(f"{prefix}ended_at_s", job.ended_at_s, now_s)


_START = operator.attrgetter("t_start_s")
_END = operator.attrgetter("t_end_s")


SPAN_TOO_LONG = "a span lasts at most"  # in every message about a span's length (wire tells its reason by it)


def span_too_long(t_start_s: float, t_end_s: float, max_span_s: float = MAX_SPAN_S) -> str:
    """What to say of a span from ``t_start_s`` to ``t_end_s``, longer than ``max_span_s``."""
    length_s = t_end_s - t_start_s
    return (
        f"the span lasts {length_s / 86400:.2f} days ({length_s:.0f} s); {SPAN_TOO_LONG} "
        f"{_duration(max_span_s)} ({max_span_s:g} s): send a longer phase as several spans"
    )


def check_span_length(field: str, t_start_s: float, t_end_s: float, max_span_s: float = MAX_SPAN_S) -> None:
    """BoundError naming ``field`` (the span's end) if the span lasts longer than ``max_span_s``."""
    if t_end_s - t_start_s > max_span_s:
        raise BoundError(field, span_too_long(t_start_s, t_end_s, max_span_s), REASON_RANGE)


def check_span_times(
    spans: Any, now_s: float, window: TimeWindow, prefix: str = "queries", max_span_s: float | None = MAX_SPAN_S
) -> None:
    """Every span (anything with ``t_start_s`` and ``t_end_s``) of ``spans`` lies in the window and, unless
    ``max_span_s`` is None (intervals, count windows), lasts at most ``max_span_s``."""
    if spans:
        # The usual case, all in the window, told by the extremes (min and max run in C: a Python loop over
        # every span was a twentieth of the collector's CPU per stored interval); the same comparisons as
        # ``TimeWindow.check``. Otherwise the loop below names the first span out of the window.
        low_s, high_s = now_s - window.past_s, now_s + window.future_s
        starts, ends = list(map(_START, spans)), list(map(_END, spans))
        # (A NaN makes a comparison false: the loop then decides, as before.)
        in_window = low_s <= min(starts) and max(starts) <= high_s and low_s <= min(ends) and max(ends) <= high_s
        if in_window and (max_span_s is None or max(map(operator.sub, ends, starts)) <= max_span_s):
            return
    for i, span in enumerate(spans):
        _check_range(f"{prefix}[{i}].", span.t_start_s, span.t_end_s, now_s, window)
        if max_span_s is not None:
            check_span_length(f"{prefix}[{i}].t_end_s", span.t_start_s, span.t_end_s, max_span_s)


def check_batch_times(batch: wire.Batch, now_s: float, window: TimeWindow) -> None:
    """Every time in an agent batch lies in the window around ``now_s`` and no span lasts longer than
    ``MAX_SPAN_S``; BoundError names the first that does not. ``sent_at_s`` 0 means "not said"."""
    if batch.sent_at_s != 0.0:
        window.check("sent_at_s", batch.sent_at_s, now_s)
    check_span_times(batch.intervals, now_s, window, "intervals", None)
    for i, job in enumerate(batch.jobs):
        check_job_times(job, now_s, window, f"jobs[{i}].")
    check_span_times(batch.queries, now_s, window, "queries")
    check_span_times(batch.query_counts, now_s, window, "query_counts", None)


def check_count(field: str, value: Any, maximum: int = MAX_TOKENS) -> int:
    """``value`` as an int if it is a whole number in ``[0, maximum]``; else BoundError naming ``field``."""
    if type(value) is not int:
        try:
            if isinstance(value, bool):
                raise TypeError
            value = operator.index(value)  # numpy and torch integers too
        except TypeError:
            if not (isinstance(value, float) and value.is_integer()):
                raise BoundError(field, f"expected a whole number, got {value!r}", REASON_MALFORMED) from None
            value = int(value)
    if not 0 <= value <= maximum:
        raise BoundError(field, f"{value} is outside 0 to {maximum}", REASON_RANGE)
    return int(value)


def check_span(
    t_start_s: Any,
    t_end_s: Any,
    tokens_in: Any = 0,
    tokens_out: Any = 0,
    *,
    now_s: float,
    window: TimeWindow = DEFAULT_WINDOW,
) -> tuple[float, float, int, int]:
    """One span's values, checked as the collector will check them: Unix seconds in the window, an end not
    before the start and at most ``MAX_SPAN_S`` after it, token counts in range. Returns them normalised;
    raises BoundError naming the field.

    Cheap: the SDK calls it on the workload's thread for every span, so a span of plain floats and ints
    within every bound passes one chained comparison (the checks below say the same, and name the field).
    """
    if (
        type(t_start_s) is float
        and type(t_end_s) is float
        and type(tokens_in) is int
        and type(tokens_out) is int
        and MIN_EPOCH_S <= t_start_s <= t_end_s <= MAX_EPOCH_S
        and t_end_s - t_start_s <= MAX_SPAN_S
        and now_s - window.past_s <= t_start_s
        and t_end_s <= now_s + window.future_s
        and 0 <= tokens_in <= MAX_TOKENS
        and 0 <= tokens_out <= MAX_TOKENS
    ):
        return t_start_s, t_end_s, tokens_in, tokens_out
    start = check_epoch("t_start_s", t_start_s)
    end = check_epoch("t_end_s", t_end_s)
    if end < start:
        raise BoundError("t_end_s", f"{end!r} is before t_start_s {start!r}", REASON_ORDER)
    window.check("t_start_s", start, now_s)
    window.check("t_end_s", end, now_s)
    check_span_length("t_end_s", start, end)
    return start, end, check_count("tokens_in", tokens_in), check_count("tokens_out", tokens_out)


def check_text(field: str, value: Any, max_chars: int = MAX_NAME_CHARS, *, empty_ok: bool = False) -> str:
    """``value`` if it is a string of at most ``max_chars`` characters without NUL; else BoundError."""
    if not isinstance(value, str):
        raise BoundError(field, f"expected a string, got {type(value).__name__}", REASON_MALFORMED)
    if "\x00" in value:
        raise BoundError(field, "must not contain a NUL character", REASON_STRING)
    if len(value) > max_chars:
        raise BoundError(field, f"is {len(value)} characters; at most {max_chars}", REASON_STRING)
    if not value and not empty_ok:
        raise BoundError(field, "must not be empty", REASON_STRING)
    return value


def fit_text(value: str, max_chars: int = MAX_NAME_CHARS) -> str:
    """``value`` without NUL characters, cut to ``max_chars``: for names a client may not control."""
    return value.replace("\x00", "")[:max_chars]


def fit_labels(labels: Mapping[Any, Any], field: str = "labels") -> tuple[dict[str, str], list[BoundError]]:
    """The labels that fit (strings, sizes, no NUL; at most ``MAX_LABELS``, wattwatch's own first, then in
    key order) and a BoundError per label left out, so one bad label costs that label, not the job."""
    kept: dict[str, str] = {}
    dropped: list[BoundError] = []
    for key in sorted(labels, key=lambda k: (not str(k).startswith(OWN_LABEL_PREFIX), str(k))):
        value = labels[key]
        where = f"{field}[{str(key)[:40]!r}]"
        try:
            check_text(where, key, MAX_LABEL_KEY_CHARS)
            check_text(where, value, MAX_LABEL_VALUE_CHARS, empty_ok=True)
        except BoundError as exc:
            dropped.append(BoundError(exc.field, f"label left out: {exc.message}", REASON_LABELS))
            continue
        if len(kept) >= MAX_LABELS:
            dropped.append(BoundError(where, f"label left out: at most {MAX_LABELS} labels per job", REASON_LABELS))
            continue
        kept[key] = value
    return kept, dropped
