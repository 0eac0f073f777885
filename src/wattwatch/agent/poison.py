"""Poison batches: which refusals are a batch's own fault, and when a batch that keeps failing is set aside.

The pusher retries the oldest batch first, so one batch the collector can never take would stop every
batch behind it. Each answer is sorted into a ``Verdict``:

- ``LANDED``: 2xx, stored (or stored before).
- ``REFUSED``: a 4xx that is about this batch (422 a field out of bounds, 413 too big, 400 undecodable, 409
  on ``seq``: the key was stored with other content). Retrying cannot help: set aside at once.
- ``TRANSIENT``: a 5xx, 408/425, or no answer after the request was sent (connection reset, read
  timeout). Maybe the batch, maybe the collector: it counts against the batch only when a later batch
  lands in the same round (the collector works, this batch does not). After ``poison_after`` such
  strikes in a row the batch is set aside. A collector failing every batch (its database down) gives
  no strike, so an outage never sets data aside.
- ``BLOCKED``: not the batch's fault: the collector unreachable, our token refused (401/403), the URL
  wrong (404/405/410/415...), this agent id taken by another host (409 on ``agent_id``: a cloned spool),
  429. Nothing is set aside; the round stops and backs off.

Set-aside batches stay in the spool file (``Spool.set_aside``) with a JSON reason, until
``wattwatch spool requeue`` puts them back in the queue.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from wattwatch.config import Settings

DEFAULT_POISON_AFTER = Settings.poison_after  # set by poison_after (WATTWATCH_POISON_AFTER, --poison-after)

# The ``reason`` label of wattwatch_agent_batches_set_aside_total, and the ``reason`` of a set-aside batch.
REJECTED = "rejected"  # a 4xx about the batch
KEY_CONFLICT = "key_conflict"  # 409 on seq: this (agent_id, seq) was stored with other content
REPEATED_FAILURE = "repeated_failure"  # 5xx or no answer, poison_after times while later batches landed
REASONS = (REJECTED, KEY_CONFLICT, REPEATED_FAILURE)

# 4xx that every batch would get alike: the URL, the token, the proxy or the protocol is wrong, or the
# collector asks us to slow down. Setting batches aside for these would empty the queue into the side.
SYSTEMIC_4XX = frozenset({401, 403, 404, 405, 407, 410, 411, 415, 426, 429, 431})
# 4xx that say "try again": a timeout while the collector waited for us, or a replay it will take later.
TRANSIENT_4XX = frozenset({408, 425})


class Verdict(enum.Enum):
    """What one push attempt says about the batch and about the collector."""

    LANDED = "landed"
    REFUSED = "refused"
    TRANSIENT = "transient"
    BLOCKED = "blocked"


def verdict_of(status: int, field: str) -> Verdict:
    """The verdict of an HTTP answer ``status`` whose JSON error names ``field`` ("" if none)."""
    if 200 <= status < 300:
        return Verdict.LANDED
    if status == 409:
        # seq: the key holds other content, whatever we resend; agent_id (or anything else): not this batch.
        return Verdict.REFUSED if field == "seq" else Verdict.BLOCKED
    if status in SYSTEMIC_4XX:
        return Verdict.BLOCKED
    if status in TRANSIENT_4XX or status >= 500:
        return Verdict.TRANSIENT
    if 400 <= status < 500:
        return Verdict.REFUSED
    return Verdict.BLOCKED  # 1xx/3xx: not a collector answering (a redirecting proxy): a setup problem


@dataclass
class Tries:
    """One batch's failed attempts since the agent started (forgotten when it lands or is set aside)."""

    attempts: int = 0  # every failed send
    strikes: int = 0  # failures while later batches landed: the batch's own
    not_before: float = 0.0  # monotonic time before which the batch is not tried again (after a strike)
    status: int | None = None  # the last answer's HTTP status; None: no answer
    error: str = ""  # the last answer's error (the collector's ``error``, or what went wrong)
    field: str = ""  # the field the last answer named


class Suspects:
    """Per batch: failed attempts and strikes; which batches wait for their own retry time.

    After the k-th strike a batch waits ``min(0.5 * 2**(k-1), max_backoff_s)`` before its next try, so a
    brief hiccup of the collector (a failover) is not mistaken for poison, while the batches behind
    it flow on meanwhile.
    """

    def __init__(self, poison_after: int = DEFAULT_POISON_AFTER, max_backoff_s: float = 30.0) -> None:
        self.poison_after = poison_after
        self._max_backoff_s = max_backoff_s
        self._tries: dict[int, Tries] = {}

    def failed(self, seq: int, status: int | None, error: str, field: str = "") -> Tries:
        """Record a failed attempt of batch ``seq`` (not yet a strike)."""
        tries = self._tries.setdefault(seq, Tries())
        tries.attempts += 1
        tries.status, tries.error, tries.field = status, error, field
        return tries

    def strike(self, seq: int, now_s: float) -> bool:
        """A later batch landed after ``seq`` failed: count it against ``seq``; True when ``seq`` is poison."""
        tries = self._tries.setdefault(seq, Tries())
        tries.strikes += 1
        tries.not_before = now_s + min(0.5 * 2 ** (tries.strikes - 1), self._max_backoff_s)
        return tries.strikes >= self.poison_after

    def waiting(self, seq: int, now_s: float) -> bool:
        """True while ``seq`` waits for its own retry time."""
        tries = self._tries.get(seq)
        return tries is not None and now_s < tries.not_before

    def tries(self, seq: int) -> Tries:
        """What is known of ``seq``'s failures (empty when none)."""
        return self._tries.get(seq) or Tries()

    def forget(self, seq: int) -> None:
        """``seq`` landed or was set aside."""
        self._tries.pop(seq, None)


def reason_record(reason: str, tries: Tries, *, collector_url: str, now_s: float) -> dict[str, Any]:
    """The JSON reason stored with a set-aside batch: why, the collector's answer and when."""
    return {
        "reason": reason,
        "status": tries.status,
        "error": tries.error,
        "field": tries.field or None,
        "attempts": tries.attempts,
        "collector": collector_url,
        "set_aside_at_s": now_s,
        "set_aside_at": datetime.fromtimestamp(now_s, UTC).isoformat(timespec="seconds"),
    }


def describe(record: Mapping[str, Any]) -> str:
    """One line for a set-aside batch's reason: ``HTTP 422 on intervals[0].energy_j: ...``."""
    status = record.get("status")
    what = f"HTTP {status}" if status else "no answer"
    field = record.get("field")
    if field:
        what += f" on {field}"
    error = str(record.get("error") or "").strip()
    attempts = record.get("attempts")
    tail = f" ({attempts} attempts)" if isinstance(attempts, int) and attempts > 1 else ""
    return f"{what}: {error}{tail}" if error else f"{what}{tail}"
