"""The raw record: every stored batch's intervals, shares included, one compressed row per batch.

What it is for: auditing and rebuilding. Reports read the rollups ingest keeps (``job_device_energy``,
``idle_energy``, ...), never this table; but because a row holds the intervals exactly as the agent sent
them (device key, times, energy, source, shares, idle weight, flags), running them through
``accounting.rollup`` again gives the rollups back (``tests/test_raw_batches.py`` does). A row per batch
instead of one per interval is what makes keeping them affordable: the collector formats one value per
batch rather than six per interval, and the database stores one tuple and two index entries per batch.

Encoding (``format`` 1, ``FORMAT_ZLIB_MSGPACK``): ``body`` is zlib-compressed MessagePack of an array of
maps, each an interval with the field names of the JSON wire format (``wattwatch.protocol.wire.Interval``). Any
language with zlib and MessagePack reads it; ``read_intervals`` and ``wattwatch db raw`` do it here.
Device keys are the host's (``devices.key`` with ``devices.host_id = raw_batches.host_id``).

``t_start_s``/``t_end_s`` are the batch's earliest start and latest end, and ``energy_j`` the sum of its
intervals, so plain SQL can total raw energy per host and time without decoding anything.
"""

from __future__ import annotations

import math
import operator
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from sqlalchemy import Connection, select

from wattwatch.protocol import wire
from wattwatch.storage.tables import hosts, raw_batches

FORMAT_ZLIB_MSGPACK = 1
# Level 1: most of the gain (device keys, job ids and sources repeat in every interval) for the least CPU;
# the collector compresses every batch it stores.
ZLIB_LEVEL = 1
COLUMNS = (
    "host_id",
    "agent_id",
    "seq",
    "received_at_s",
    "t_start_s",
    "t_end_s",
    "n_intervals",
    "energy_j",
    "format",
    "body",
)

_encoder = msgspec.msgpack.Encoder()
_START = operator.attrgetter("t_start_s")
_END = operator.attrgetter("t_end_s")
_ENERGY = operator.attrgetter("energy_j")
_decoder = msgspec.msgpack.Decoder(list[wire.Interval])


def encode_intervals(intervals: Sequence[wire.Interval]) -> bytes:
    """``intervals`` in the stored encoding (format 1)."""
    return zlib.compress(_encoder.encode(intervals), ZLIB_LEVEL)


def decode_intervals(body: bytes, fmt: int = FORMAT_ZLIB_MSGPACK) -> list[wire.Interval]:
    """The intervals of a stored ``body``; raises ValueError for a format this version does not know."""
    if fmt != FORMAT_ZLIB_MSGPACK:
        raise ValueError(f"raw batch format {fmt} is not known to this version of wattwatch; upgrade it")
    return _decoder.decode(zlib.decompress(body))


def batch_row(host_id: int, batch: wire.Batch, received_at_s: float) -> tuple[Any, ...] | None:
    """The ``raw_batches`` row of ``batch`` (in ``COLUMNS`` order), or None when it holds no interval."""
    ivs = batch.intervals
    if not ivs:
        return None
    return (
        host_id,
        batch.agent_id,
        batch.seq,
        received_at_s,
        # map and attrgetter run in C: generator expressions here were a fiftieth of ingest's CPU.
        min(map(_START, ivs)),
        max(map(_END, ivs)),
        len(ivs),
        math.fsum(map(_ENERGY, ivs)),
        FORMAT_ZLIB_MSGPACK,
        encode_intervals(ivs),
    )


@dataclass(frozen=True)
class RawInterval:
    """One stored interval and where it came from."""

    host: str
    agent_id: str
    seq: int
    interval: wire.Interval


def read_intervals(
    conn: Connection, *, host: str | None = None, since_s: float | None = None, until_s: float | None = None
) -> Iterator[RawInterval]:
    """Every stored interval of batches overlapping ``[since_s, until_s)`` (of ``host``, when given), in
    the order they were stored; intervals are filtered to those overlapping the window too."""
    rb = raw_batches
    stmt = select(hosts.c.name, rb.c.agent_id, rb.c.seq, rb.c.format, rb.c.body).join(hosts, hosts.c.id == rb.c.host_id)
    if host is not None:
        stmt = stmt.where(hosts.c.name == host)
    if since_s is not None:
        stmt = stmt.where(rb.c.t_end_s > since_s)
    if until_s is not None:
        stmt = stmt.where(rb.c.t_start_s < until_s)
    for name, agent_id, seq, fmt, body in conn.execute(stmt.order_by(rb.c.id)):
        for iv in decode_intervals(bytes(body), int(fmt)):
            if (since_s is None or iv.t_end_s > since_s) and (until_s is None or iv.t_start_s < until_s):
                yield RawInterval(str(name), str(agent_id), int(seq), iv)
