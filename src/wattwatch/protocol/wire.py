"""The versioned batch format agents push to the collector. The ONLY module agent and collector share.

A batch is idempotent by ``(agent_id, seq)``: the collector stores each key once, so an agent may
retry a push as often as it likes and several collector replicas may receive the same batch.

Intervals carry the energy a device used between two reads of its counter, and who held the device
during that interval (``shares``: job id -> weight). The collector, not the agent, turns weights into
joules (``wattwatch.accounting``), so the arithmetic that conserves energy lives in one place.
"""

from __future__ import annotations

import gzip
import math
import operator
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

from wattwatch.protocol import limits
from wattwatch.protocol.units import DeviceKind, JobKind, Source

WIRE_VERSION = 1
T = TypeVar("T")

# A job record with these labels is a phase of another job's process, not a job of its own: its energy is
# that job's ``setup`` (drawn before the job opened: model load, warm-up, the gap since the process's
# previous job) or ``after`` (drawn after it ended, while the process stayed on its GPUs). Reports fold
# it into the job named by PHASE_OF_LABEL; an agent may relabel a phase (after -> setup of the next job).
PHASE_LABEL = "wattwatch.io/phase"
PHASE_OF_LABEL = "wattwatch.io/phase-of"
PHASES = ("setup", "after")
SpanKind = Literal["query", "step", "epoch"]

# Every bound comes from ``wattwatch.protocol.limits``; msgspec checks them while decoding (not on construction).
Energy_j = Annotated[float, msgspec.Meta(ge=0.0, le=limits.MAX_ENERGY_J)]
Power_w = Annotated[float, msgspec.Meta(ge=0.0, le=limits.MAX_POWER_W)]
Weight = Annotated[float, msgspec.Meta(ge=0.0, le=limits.MAX_WEIGHT)]
Epoch_s = Annotated[
    float,
    msgspec.Meta(ge=limits.MIN_EPOCH_S, le=limits.MAX_EPOCH_S, description="Unix seconds (not milliseconds)"),
]
# A time no earlier than its record's start. JSON Schema cannot compare two fields, so the OpenAPI document
# states the rule in words and as ``x-not-before`` (the contract test generates its cases by it).
EndEpoch_s = Annotated[
    Epoch_s,
    msgspec.Meta(
        description="Unix seconds (not milliseconds), not earlier than t_start_s",
        extra_json_schema={"x-not-before": "t_start_s"},
    ),
]
# A span's end: no earlier than its start, and at most ``limits.MAX_SPAN_S`` after it (``x-lasts-at-most-s``).
SpanEndEpoch_s = Annotated[
    Epoch_s,
    msgspec.Meta(
        description=f"Unix seconds (not milliseconds), not earlier than t_start_s nor more than "
        f"{limits.MAX_SPAN_S:g} s after it",
        extra_json_schema={"x-not-before": "t_start_s", "x-lasts-at-most-s": limits.MAX_SPAN_S},
    ),
]
JobEndEpoch_s = Annotated[
    Epoch_s,
    msgspec.Meta(
        description="Unix seconds (not milliseconds), not earlier than started_at_s",
        extra_json_schema={"x-not-before": "started_at_s"},
    ),
]
Int32 = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_INT32)]
Count = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_COUNT)]
Tokens = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_TOKENS)]
Seq = Annotated[int, msgspec.Meta(ge=0, le=limits.MAX_SEQ)]
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.MAX_NAME_CHARS, pattern=limits.NO_NUL)]
Text = Annotated[str, msgspec.Meta(max_length=limits.MAX_NAME_CHARS, pattern=limits.NO_NUL)]
KEY_CHARS = r"^[A-Za-z0-9_.:@/-]+$"  # for regexes whose `$` is the end of the text (pydantic's)
KEY_PATTERN = r"^[A-Za-z0-9_.:@/-]+(?!\n)$"  # for Python's re (msgspec's): see limits.FLAG_PATTERN
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.MAX_NAME_CHARS, pattern=KEY_PATTERN)]
# A Key whose pattern ``Batch`` checks once per distinct value instead of msgspec once per occurrence: an
# interval's device and job ids repeat in every interval, and the per-string regex was half of decoding
# a batch (Python's re, called by msgspec). An Interval decoded outside a Batch does not check it.
KeyRef = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=limits.MAX_NAME_CHARS, extra_json_schema={"pattern": KEY_PATTERN}),
]
# An interval's device: one of its batch's devices, a rule the document states as ``x-listed-in``.
DeviceRef = Annotated[
    KeyRef,
    msgspec.Meta(description="the key of one of the batch's devices", extra_json_schema={"x-listed-in": "devices"}),
]
_key_re = re.compile(KEY_PATTERN)
_DEVICE = operator.attrgetter("device")
_START = operator.attrgetter("t_start_s")
_END = operator.attrgetter("t_end_s")
LabelKey = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.MAX_LABEL_KEY_CHARS, pattern=limits.NO_NUL)]
LabelValue = Annotated[str, msgspec.Meta(max_length=limits.MAX_LABEL_VALUE_CHARS, pattern=limits.NO_NUL)]
Labels = Annotated[dict[LabelKey, LabelValue], msgspec.Meta(max_length=limits.MAX_LABELS)]
Flag = Annotated[str, msgspec.Meta(min_length=1, max_length=limits.MAX_FLAG_CHARS, pattern=limits.FLAG_PATTERN)]
GridRegion = Annotated[
    str,
    msgspec.Meta(
        min_length=2,
        max_length=limits.MAX_GRID_REGION_CHARS,
        pattern=limits.GRID_REGION_PATTERN,
        description="the host's grid: ISO 3166 country code (FR, USA) or cloud provider:region (gcp:europe-west9)",
    ),
]
DeviceKeys = Annotated[list[Key], msgspec.Meta(max_length=limits.MAX_DEVICES)]


class Device(msgspec.Struct, forbid_unknown_fields=True):
    """One measured device on the agent's host. ``key`` is unique per host (``gpu0``, ``cpu0``)."""

    key: Key
    kind: DeviceKind
    index: Int32 = 0
    uuid: Text | None = None
    model: Text | None = None
    power_limit_w: Power_w | None = None


# gc=False: the collector decodes hundreds of thousands of intervals a second, and tracking each for the
# cyclic GC (which an interval of strings, numbers, a dict of floats and a list of strings can never be
# part of) cost a fifth of decoding and more collections.
class Interval(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Energy one device used in ``[t_start_s, t_end_s]`` and the jobs that held it then.

    ``shares`` maps job id to a non-negative weight; ``idle_weight`` is the part nobody held
    (used for CPU packages, where jobs hold only part of the machine). With no shares at all
    the whole interval is idle. ``flags`` records anything unusual (``counter_reset``).
    """

    device: DeviceRef
    t_start_s: Epoch_s
    t_end_s: EndEpoch_s
    energy_j: Energy_j
    source: Source
    shares: Annotated[dict[KeyRef, Weight], msgspec.Meta(max_length=limits.MAX_SHARES)] = {}
    idle_weight: Weight = 0.0
    flags: Annotated[list[Flag], msgspec.Meta(max_length=limits.MAX_FLAGS)] = []

    def __post_init__(self) -> None:
        if self.t_end_s < self.t_start_s:
            raise ValueError("@t_end_s: must not be earlier than t_start_s")
        # msgspec rejects NaN in JSON, but a msgpack body or a Python caller could still send one.
        if not math.isfinite(self.energy_j):
            raise ValueError("@energy_j: must be finite")


EndedBy = Annotated[str, msgspec.Meta(min_length=1, max_length=40, pattern=r"^[a-z0-9-]+(?!\n)$")]


class Job(msgspec.Struct, forbid_unknown_fields=True):
    """A job as one host sees it: sent at start (``ended_at_s`` null) and again at end.

    ``ended_by`` says why an end was not the job's own (null: its process or client ended it):
    ``agent-restart`` (its processes were gone when the agent came back; ended when last seen) or
    ``process-gone`` (a job the restarted agent re-adopted ended without telling it).
    """

    id: Key
    name: Name
    kind: JobKind = "other"
    started_at_s: Epoch_s = 0.0
    ended_at_s: JobEndEpoch_s | None = None
    devices: DeviceKeys = []
    labels: Labels = {}
    pid: Int32 | None = None
    ended_by: EndedBy | None = None

    def __post_init__(self) -> None:
        if self.ended_at_s is not None and self.ended_at_s < self.started_at_s:
            raise ValueError("@ended_at_s: must not be earlier than started_at_s")


class Query(msgspec.Struct, forbid_unknown_fields=True):
    """One span of ``job`` between ``t_start_s`` and ``t_end_s``: an inference request (``kind="query"``)
    or a training step or epoch marked through the SDK (``"step"``, ``"epoch"``)."""

    job: Key
    t_start_s: Epoch_s
    t_end_s: SpanEndEpoch_s
    tokens_in: Tokens = 0
    tokens_out: Tokens = 0
    kind: SpanKind = "query"

    def __post_init__(self) -> None:
        if self.t_end_s < self.t_start_s:
            raise ValueError("@t_end_s: must not be earlier than t_start_s")


class QueryCount(msgspec.Struct, forbid_unknown_fields=True):
    """Requests ``job`` completed in ``[t_start_s, t_end_s]`` without per-request spans (counter deltas
    scraped from a serving engine's metrics): energy per query is then window energy / count."""

    job: Key
    t_start_s: Epoch_s
    t_end_s: EndEpoch_s
    queries: Count
    tokens_in: Tokens = 0
    tokens_out: Tokens = 0

    def __post_init__(self) -> None:
        if self.t_end_s < self.t_start_s:
            raise ValueError("@t_end_s: must not be earlier than t_start_s")


class Batch(msgspec.Struct, forbid_unknown_fields=True):
    """What an agent pushes: everything it measured since its previous batch."""

    agent_id: Key
    seq: Seq
    host: Name
    version: int = WIRE_VERSION
    sent_at_s: Epoch_s = 0.0
    devices: Annotated[list[Device], msgspec.Meta(max_length=limits.MAX_DEVICES)] = []
    intervals: list[Interval] = []
    jobs: list[Job] = []
    queries: list[Query] = []
    query_counts: list[QueryCount] = []
    # Where the host draws its power from, for its emissions (agent --grid-region); absent: the collector's
    # own setting for the host, else its default. UNSET is left out of the encoded batch, so an agent
    # without a region sends what collectors before this field accept.
    grid_region: GridRegion | msgspec.UnsetType = msgspec.UNSET

    def __post_init__(self) -> None:
        if self.version != WIRE_VERSION:
            raise ValueError(f"@version: unsupported wire version {self.version}; this collector speaks {WIRE_VERSION}")
        # Devices' keys are Keys (checked by msgspec): an interval's device listed among them is one too.
        known = {d.key for d in self.devices}
        # Devices by a set operation in C; the loop runs only to name the first interval whose device is not
        # listed (job ids: iterating each interval's dict is as fast as any set operation here).
        if not known.issuperset(map(_DEVICE, self.intervals)):
            for i, iv in enumerate(self.intervals):
                if iv.device not in known:
                    if not _key_re.match(iv.device):  # what msgspec said of it before KeyRef: the same reason
                        raise ValueError(f"@intervals[{i}].device: Expected `str` matching regex {KEY_PATTERN!r}")
                    raise ValueError(f"@intervals[{i}].device: {iv.device!r} is not listed in devices")
        # A span longer than limits.MAX_SPAN_S is refused by decoding (not only by the collector's later
        # checks), so that an agent sealing a batch leaves it out alone, as it does every record decoding
        # refuses. Told by the longest (in C), then named.
        if self.queries:
            starts, ends = list(map(_START, self.queries)), list(map(_END, self.queries))
            if max(map(operator.sub, ends, starts)) > limits.MAX_SPAN_S:
                for i, q in enumerate(self.queries):
                    if q.t_end_s - q.t_start_s > limits.MAX_SPAN_S:
                        raise ValueError(f"@queries[{i}].t_end_s: {limits.span_too_long(q.t_start_s, q.t_end_s)}")
        job_ids: set[str] = set()
        for iv in self.intervals:
            job_ids.update(iv.shares)
        bad = [job_id for job_id in job_ids if not _key_re.match(job_id)]
        if bad:
            i = next(i for i, iv in enumerate(self.intervals) if any(job_id in iv.shares for job_id in bad))
            raise ValueError(f"@intervals[{i}].shares: a key: Expected `str` matching regex {KEY_PATTERN!r}")


_encoder = msgspec.json.Encoder()
_batch_decoder = msgspec.json.Decoder(Batch)


def encode(obj: object) -> bytes:
    """Encode a wire object (or any msgspec-encodable value) as JSON bytes."""
    return _encoder.encode(obj)


def decode_batch(body: bytes, content_encoding: str | None = None) -> Batch:
    """Decode (and gunzip, if asked) a batch; raises ``WireError`` naming the offending field."""
    if content_encoding and content_encoding.lower() == "gzip":
        try:
            body = gzip.decompress(body)
        except (OSError, EOFError) as exc:
            raise WireError("body", f"Content-Encoding is gzip but the body is not valid gzip: {exc}") from None
    return decode_as(body, Batch)


# A body that does not fit the wire format: ``field`` is a dotted path such as ``intervals[0].energy_j``.
# The same class as every bound's error, so one ``except`` answers both with a 422 naming the field.
WireError = limits.BoundError


def decode_as(body: bytes, typ: type[T]) -> T:
    """Decode JSON ``body`` as ``typ``, turning msgspec's errors into a ``WireError`` with the field path."""
    try:
        try:
            return msgspec.json.decode(body, type=typ)
        except msgspec.ValidationError as exc:
            # JSON has one number type: 1575.0 is the integer 1575 to JSON Schema (and so to the OpenAPI
            # document), while msgspec's strict decoding refuses it. Retried on this error only, so the fast
            # path stays one C call; a fraction (1575.5) or a string is still refused.
            if not _WHOLE_NUMBER_REFUSED.search(str(exc)):
                raise
            return msgspec.convert(_whole_floats_as_ints(msgspec.json.decode(body)), type=typ)
    except msgspec.ValidationError as exc:
        field, message = _split_msgspec_error(str(exc))
        reason = _reason(field, message)
        if reason == limits.REASON_TIME and "<=" in message:
            message += " (after 2286): times are Unix seconds (time.time()), not milliseconds"
        raise WireError(field, message, reason) from None
    except msgspec.DecodeError as exc:
        raise WireError("body", f"not valid JSON: {exc}") from None


_WHOLE_NUMBER_REFUSED = re.compile(r"Expected `int[^`]*`, got `float`")


def _whole_floats_as_ints(value: Any) -> Any:
    """``value`` (decoded JSON) with every float that is a whole number as an int."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _split_msgspec_error(text: str) -> tuple[str, str]:
    """``"Expected int - at `$.a[0].b`"`` -> ``("a[0].b", "Expected int")``; names missing/unknown fields."""
    message, sep, where = text.rpartition(" - at `")
    # msgspec gives no location for errors in the top-level object itself.
    where = where.rstrip("`")
    if where.startswith("key` in `"):  # a dictionary's key (a label's): name the dictionary
        where = where.removeprefix("key` in `")
        message = f"a key: {message}"
    path = where.removeprefix("$").lstrip(".") if sep else ""
    if not sep:
        message = text
    # msgspec reports missing/unknown fields at the parent path; put the field's own name in the path.
    # Our own __post_init__ checks name their field as "@field: message".
    if message.startswith("@") and ": " in message:
        name, message = message[1:].split(": ", 1)
        path = f"{path}.{name}" if path else name
    for marker in ("missing required field `", "unknown field `"):
        if marker in message:
            name = message.split(marker, 1)[1].split("`", 1)[0]
            path = f"{path}.{name}" if path else name
    return path or "body", message


def _reason(field: str, message: str) -> str:
    """Which of ``limits.REASONS`` a msgspec error is (what the agent counts its own refusals by)."""
    if "must not be earlier" in message:
        return limits.REASON_ORDER
    if limits.SPAN_TOO_LONG in message:
        return limits.REASON_RANGE
    bounded = "<=" in message or ">=" in message
    if bounded and field.endswith("_s"):
        return limits.REASON_TIME
    if ".labels" in f".{field}":
        return limits.REASON_LABELS
    if "length" in message or "regex" in message:
        return limits.REASON_STRING
    return limits.REASON_RANGE if bounded else limits.REASON_MALFORMED
