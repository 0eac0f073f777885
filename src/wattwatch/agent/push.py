"""Pushes spooled batches to the collector over HTTP, oldest first, with backoff.

A batch leaves the spool only when the collector answered 2xx (stored, or already stored: batches
are idempotent by key). A 4xx other than auth means the batch itself is bad and retrying cannot help:
it is set aside (never silently dropped). Anything else is retried with exponential backoff.

A 409 naming ``agent_id`` means another host pushed this agent id first (a cloned spool): the batches stay
spooled and the agent says so at ERROR once a minute until someone gives this host its own spool. A 409
naming ``seq`` means that key was stored with other content (two agents sharing one spool): retrying
cannot help, so the batch is set aside, loudly. Both count in ``PushStats.conflicts``.
"""

from __future__ import annotations

import gzip
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from wattwatch.agent.spool import Spool
from wattwatch.tls import untrusted_certificate, untrusted_message

log = logging.getLogger(__name__)


@dataclass
class PushStats:
    """Counters for the agent's self-metrics (``agent.metrics``)."""

    pushed: int = 0  # batches the collector accepted
    failures: int = 0  # attempts that failed: collector away, 5xx, auth
    refused: int = 0  # batches refused for good and set aside
    conflicts: int = 0  # 409s: agent id of another host, or a seq stored with other content (cloned spool)
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
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        max_backoff_s: float = 30.0,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.spool = spool
        self.url = collector_url.rstrip("/") + "/api/v1/ingest"
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._client = client or httpx.Client(timeout=10.0, verify=verify)
        self._headers = headers
        self._clock = clock
        self._wall_clock = wall_clock
        self._max_backoff_s = max_backoff_s
        self._backoff_s = 0.0
        self._not_before = 0.0
        self._conflict_logged_at = float("-inf")
        self.stats = PushStats()

    def push_pending(self, *, force: bool = False) -> bool:
        """Push until the spool is empty or a push fails; True when the spool was drained.

        During backoff nothing is attempted unless ``force`` (used once at shutdown).
        """
        if not force and self._clock() < self._not_before:
            return False
        while True:
            batch = self.spool.peek(limit=8)
            if not batch:
                return True
            for seq, body in batch:
                if not self._push_one(seq, body):
                    return False

    def _push_one(self, seq: int, body: bytes) -> bool:
        try:
            resp = self._client.post(self.url, content=gzip.compress(body, compresslevel=5), headers=self._headers)
        except httpx.HTTPError as exc:
            reason = untrusted_certificate(exc)
            self._fail(untrusted_message(self.url, reason) if reason else f"collector {self.url} unreachable: {exc}")
            return False
        if resp.is_success:
            self.spool.ack(seq)
            self.stats.pushed += 1
            self.stats.last_pushed_at_s = self._wall_clock()
            self._backoff_s = 0.0
            return True
        if resp.status_code in (401, 403):
            self._fail(
                f"collector refused our token (HTTP {resp.status_code}: {_error_of(resp)}); check --token, "
                "--token-file or WATTWATCH_TOKEN(_FILE), and that --host is the token's host"
            )
            return False
        if resp.status_code == 409:
            return self._conflict(seq, resp)
        if 400 <= resp.status_code < 500 and resp.status_code not in (408, 409, 429):
            reason = f"HTTP {resp.status_code}: {resp.text[:500]}"
            log.error("collector refused batch %d for good (%s); kept aside in %s", seq, reason, self.spool.path)
            self.spool.bury(seq, reason)
            self.stats.refused += 1
            return True
        self._fail(f"collector answered HTTP {resp.status_code}")
        return False

    def _conflict(self, seq: int, resp: httpx.Response) -> bool:
        """A 409: the batch's key is someone else's (agent_id) or held other content (seq)."""
        field, error = _field_of(resp), _error_of(resp)
        if field == "seq":
            self.stats.conflicts += 1
            log.error("collector refused batch %d: %s; kept aside in %s", seq, error, self.spool.path)
            self.spool.bury(seq, f"HTTP 409: {error}")
            self.stats.refused += 1
            return True
        if field == "agent_id":
            self.stats.conflicts += 1
            # Loud but bounded: once a minute, while every retry meets the same refusal.
            if self._clock() - self._conflict_logged_at >= 60.0:
                self._conflict_logged_at = self._clock()
                log.error("collector refused batch %d: %s; batches stay spooled", seq, error)
            self._fail(f"collector refused this agent id (HTTP 409): {error}", quiet=True)
            return False
        self._fail(f"collector answered HTTP 409: {error}")
        return False

    def _fail(self, message: str, *, quiet: bool = False) -> None:
        self.stats.failures += 1
        if message != self.stats.last_error and not quiet:
            log.warning("%s; batches stay spooled and will be retried", message)
        self.stats.last_error = message
        self._backoff_s = min(max(self._backoff_s * 2, 0.5), self._max_backoff_s)
        self._not_before = self._clock() + self._backoff_s

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()


def _field_of(resp: httpx.Response) -> str:
    """The ``field`` of the collector's JSON error body ("" if there is none)."""
    try:
        return str(resp.json().get("field") or "")
    except (ValueError, AttributeError):
        return ""


def _error_of(resp: httpx.Response) -> str:
    """The ``error`` of the collector's JSON error body, else the start of the body."""
    try:
        return str(resp.json()["error"])[:500]
    except (ValueError, KeyError, TypeError):
        return resp.text[:500]
