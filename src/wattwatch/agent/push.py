"""Pushes spooled batches to the collector over HTTP, oldest first, with backoff.

A batch leaves the queue only when the collector answered 2xx (stored, or already stored: batches are
idempotent by key), or when it is poison (``agent.poison``): a 4xx about the batch itself sets it aside
at once; a 5xx, or no answer once the request was sent, counts against it only while later batches land,
and ``poison_after`` such strikes set it aside. Set aside means kept in the spool file with its reason,
said at ERROR once, counted by reason, shown by ``wattwatch doctor`` and put back by ``wattwatch spool
requeue``. The batches behind a failing one flow on meanwhile.

A refused token (401/403) never sets anything aside: every batch waits, and the agent says so at ERROR
once a minute until the token is fixed. So does a 409 naming ``agent_id`` (another host pushed this
agent id first: a cloned spool). A 409 naming ``seq`` means that key was stored with other content (two
agents sharing one spool): retrying cannot help, so the batch is set aside. Both count in
``PushStats.conflicts``.
"""

from __future__ import annotations

import gzip
import json
import logging
import random
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from wattwatch import redact
from wattwatch.agent.poison import (
    DEFAULT_POISON_AFTER,
    KEY_CONFLICT,
    REASONS,
    REJECTED,
    REPEATED_FAILURE,
    Suspects,
    Verdict,
    describe,
    reason_record,
    verdict_of,
)
from wattwatch.agent.spool import Spool
from wattwatch.client import Poster, Reply, SentReset, SentTimeout, Unreachable
from wattwatch.tls import untrusted_certificate, untrusted_message

log = logging.getLogger(__name__)

# How many batches in a row may fail before a round stops: enough to see past a few poison batches to one
# that lands, few enough that a collector failing everything costs little before backing off.
_PROBE_LIMIT = 8
_LOUD_EVERY_S = 60.0
# A wait before retrying is drawn from [wait, wait x (1 + this)] (see Pusher._fail).
BACKOFF_JITTER = 0.5
_WHY = {
    REJECTED: "the collector refused it for good",
    KEY_CONFLICT: "the collector holds its key with other content (two agents on one spool?)",
    REPEATED_FAILURE: "it kept failing while later batches landed",
}


def _set_aside_counts() -> dict[str, int]:
    return dict.fromkeys(REASONS, 0)


@dataclass
class PushStats:
    """Counters for the agent's self-metrics (``agent.metrics``)."""

    pushed: int = 0  # batches the collector accepted
    failures: int = 0  # attempts that failed: collector away, 5xx, auth
    refused: int = 0  # batches set aside, all reasons
    conflicts: int = 0  # 409s: agent id of another host, or a seq stored with other content (cloned spool)
    set_aside: dict[str, int] = field(default_factory=_set_aside_counts)  # reason (agent.poison) -> batches
    last_error: str = ""
    last_pushed_at_s: float = 0.0  # Unix time of the last accepted batch; 0: none yet


class Pusher:
    """Sends batches from a Spool to ``{collector_url}/api/v1/ingest``."""

    def __init__(
        self,
        spool: Spool,
        collector_url: str,
        *,
        token: str = "",
        client: Any | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_backoff_s: float = 30.0,
        verify: ssl.SSLContext | bool = True,
        poison_after: int = DEFAULT_POISON_AFTER,
    ) -> None:
        self.spool = spool
        self.url = collector_url.rstrip("/") + "/api/v1/ingest"
        # What messages, the spool's set-aside records and doctor show: no userinfo password.
        self.shown_url = redact.url(self.url)
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        # One keep-alive connection (wattwatch.client); ``client``: an httpx-style client instead (tests).
        self._client = Poster(collector_url, timeout_s=10.0, verify=verify, client=client)
        self._headers = headers
        self._clock = clock
        self._wall_clock = wall_clock
        self._max_backoff_s = max_backoff_s
        self._backoff_s = 0.0
        self._rng = random.Random()
        self._not_before = 0.0
        self._loud_at: dict[str, float] = {}
        self.suspects = Suspects(poison_after, max_backoff_s)
        self.stats = PushStats()

    def push_pending(self, *, force: bool = False) -> bool:
        """One round: push every queued batch in order, skipping those waiting for their own retry; True
        when the collector took what it could (the queue is empty, or holds only batches waiting for their
        own retry), False when it is away, refused us or failed with nothing landing after.

        During backoff nothing is attempted unless ``force`` (used at shutdown).
        """
        if not force and self._clock() < self._not_before:
            return False
        failed: list[int] = []  # transient failures no later batch has yet vouched for
        after = -1
        page_size = 8
        while True:
            page = self.spool.peek(limit=page_size, after=after)
            if not page:
                break
            for seq, body in page:
                after = seq
                if self.suspects.waiting(seq, self._clock()):
                    continue
                verdict = self._push_one(seq, body)
                if verdict is Verdict.LANDED:
                    # The collector works: what failed before this batch failed on its own.
                    for suspect in failed:
                        self._strike(suspect)
                    failed.clear()
                elif verdict is Verdict.TRANSIENT:
                    failed.append(seq)
                    if len(failed) >= _PROBE_LIMIT:
                        return self._round_failed(seq)
                elif verdict is Verdict.BLOCKED:
                    return False
            if len(page) < page_size:
                break  # that was the queue's end (a batch sealed since wakes the push again)
        if failed:
            return self._round_failed(failed[-1])
        self._backoff_s = 0.0
        return True

    def _push_one(self, seq: int, body: bytes) -> Verdict:
        """Send one batch and act on the answer (ack, set aside, or note the failure)."""
        payload = gzip.compress(body, compresslevel=5)
        try:
            try:
                resp = self._client.post(self.url, payload, self._headers)
            except SentReset:
                # The collector (or its proxy) dropped the request, maybe because of this batch; a reset on a
                # reused keep-alive connection is common and harmless: retried once, on a new connection.
                resp = self._client.post(self.url, payload, self._headers)
        except (SentReset, SentTimeout) as exc:
            self.stats.failures += 1
            self.suspects.failed(seq, None, f"no answer after the request was sent ({exc})")
            return Verdict.TRANSIENT
        except Unreachable as exc:
            reason = untrusted_certificate(exc)
            self._fail(
                untrusted_message(self.shown_url, reason)
                if reason
                else f"collector {self.shown_url} unreachable: {redact.text(str(exc))}"
            )
            return Verdict.BLOCKED
        if 200 <= resp.status < 300:  # the usual answer: its body says nothing the verdict needs
            field = error = ""
        else:
            field, error = _field_of(resp), _error_of(resp)
        verdict = verdict_of(resp.status, field)
        if resp.status == 503 and resp.headers.get("retry-after"):
            # A busy collector (its ingest queue full) says when to come back: about it, not the batch.
            verdict = Verdict.BLOCKED
        if verdict is Verdict.LANDED:
            self.spool.ack(seq)
            self.suspects.forget(seq)
            self.stats.pushed += 1
            self.stats.last_pushed_at_s = self._wall_clock()
            return verdict
        if resp.status == 409:
            self.stats.conflicts += 1
        if verdict is Verdict.REFUSED:
            self.suspects.failed(seq, resp.status, error, field)
            self._set_aside(seq, KEY_CONFLICT if resp.status == 409 else REJECTED)
        elif verdict is Verdict.TRANSIENT:
            self.stats.failures += 1
            self.suspects.failed(seq, resp.status, error, field)
        else:
            self._blocked(seq, resp.status, error, field, resp.headers.get("retry-after"))
        return verdict

    def _blocked(self, seq: int, status: int, error: str, field: str, retry_after: str | None) -> None:
        """An answer about us, not the batch: nothing is set aside; say it (loudly for a setup problem)."""
        if status in (401, 403):
            self._fail(
                f"collector refused our token (HTTP {status}: {error}); check --token, --token-file or "
                "WATTWATCH_TOKEN(_FILE), and that --host is the token's host; nothing is set aside",
                loud="token",
            )
        elif status == 409 and field == "agent_id":
            self._fail(f"collector refused batch {seq}: {error}", loud="agent_id")
        elif status in (429, 503):
            self._fail(f"collector asked us to slow down (HTTP {status}: {error})", retry_after=retry_after)
        elif status in (404, 405, 410, 415):
            self._fail(
                f"{self.shown_url} answered HTTP {status} ({error}); is --collector the collector's URL?", loud="url"
            )
        else:
            self._fail(f"collector answered HTTP {status}: {error}")

    def _strike(self, seq: int) -> None:
        """Count a failure of ``seq`` while later batches landed; set it aside at ``poison_after``."""
        if self.suspects.strike(seq, self._clock()):
            self._set_aside(seq, REPEATED_FAILURE)
            return
        tries = self.suspects.tries(seq)
        log.warning(
            "batch %d failed %d time(s) while later batches landed (%s); set aside after %d; the batches "
            "behind it flow on",
            seq,
            tries.strikes,
            describe({"status": tries.status, "error": tries.error, "field": tries.field}),
            self.suspects.poison_after,
        )

    def _set_aside(self, seq: int, reason: str) -> None:
        """Move ``seq`` aside with its reason; say so once, at ERROR, with how to retry it."""
        record = reason_record(reason, self.suspects.tries(seq), collector_url=self.shown_url, now_s=self._wall_clock())
        self.suspects.forget(seq)
        if not self.spool.set_aside(seq, record):
            return  # requeued or set aside by someone else meanwhile
        self.stats.refused += 1
        self.stats.set_aside[reason] += 1
        log.error(
            "batch %d set aside (%s): %s (%s); kept in %s, not deleted: fix the cause, then "
            "`wattwatch spool requeue %d` (see `wattwatch doctor`)",
            seq,
            reason,
            _WHY[reason],
            describe(record),
            self.spool.path,
            seq,
        )

    def _round_failed(self, seq: int) -> bool:
        """Batches failed and none landed after them: the collector, not a batch, is in trouble."""
        tries = self.suspects.tries(seq)
        failure = describe({"status": tries.status, "error": tries.error})
        self._fail(f"collector failed batch {seq} ({failure}) and took none after it", counted=True)
        return False

    def _fail(
        self,
        message: str,
        *,
        loud: str = "",
        retry_after: str | None = None,
        counted: bool = False,
    ) -> None:
        """A round stops: count the attempt (unless ``counted``), say it (``loud`` ones at ERROR once a minute
        each, others at WARNING when the message changes), back off."""
        if not counted:
            self.stats.failures += 1
        now = self._clock()
        if loud:
            if now - self._loud_at.get(loud, float("-inf")) >= _LOUD_EVERY_S:
                self._loud_at[loud] = now
                log.error("%s; batches stay spooled in %s", message, self.spool.path)
        elif message != self.stats.last_error:
            log.warning("%s; batches stay spooled and will be retried", message)
        self.stats.last_error = message
        self._backoff_s = min(max(self._backoff_s * 2, 0.5), self._max_backoff_s)
        wait_s = max(self._backoff_s, _retry_after_s(retry_after, self._max_backoff_s))
        # Up to half as long again, at random: a fleet told the same Retry-After (or backing off from the
        # same outage) comes back spread out, not all in the same second.
        self._not_before = now + wait_s * self._rng.uniform(1.0, 1.0 + BACKOFF_JITTER)

    def close(self) -> None:
        """Close the connection to the collector."""
        self._client.close()


def _retry_after_s(header: str | None, most_s: float) -> float:
    """A ``Retry-After`` in seconds, at most ``most_s``; 0 when absent or an HTTP date."""
    try:
        seconds = float(header or 0)
    except ValueError:
        return 0.0
    return min(seconds, most_s) if seconds > 0 else 0.0  # NaN and negatives: none


def _json_of(resp: Reply) -> Any:
    try:
        return json.loads(resp.body)
    except ValueError:
        return None


def _field_of(resp: Reply) -> str:
    """The ``field`` of the collector's JSON error body ("" if there is none)."""
    try:
        return str(_json_of(resp).get("field") or "")[:500]
    except AttributeError:
        return ""


def _error_of(resp: Reply) -> str:
    """The ``error`` of the collector's JSON error body, else the start of the body."""
    try:
        return str(_json_of(resp)["error"])[:500]
    except (KeyError, TypeError):
        return resp.body[:500].decode(errors="replace")
