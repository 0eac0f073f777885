"""The SDK's connection to the local agent: one Unix-socket client per process, and the buffer through
which spans reach the agent from a background thread, never from the workload's.

The socket (``$WATTWATCH_HOME/agent.sock``) is asked with a short timeout; spans are sent as one
``queries`` message every ``FLUSH_INTERVAL_S`` or ``FLUSH_SPANS`` spans, whichever comes first, and the
buffer drops its oldest spans past ``MAX_BUFFERED_SPANS`` rather than grow without bound.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wattwatch.config import default_home
from wattwatch.sdk.notices import warn_once

CONNECT_TIMEOUT_S = 0.5
FLUSH_INTERVAL_S = 0.1
FLUSH_SPANS = 256
MAX_BUFFERED_SPANS = 100_000
MAX_SPANS_PER_MESSAGE = 2_000


class AgentClient:
    """A line-oriented client for the agent's socket. Thread-safe; reconnects lazily."""

    def __init__(self, path: Path | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path or default_home() / "agent.sock"
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._lock = threading.Lock()
        self._spans: SpanBuffer | None = None
        self._spans_lock = threading.Lock()

    @property
    def spans(self) -> SpanBuffer:
        """This client's span buffer (its sender thread starts with the first span)."""
        with self._spans_lock:
            if self._spans is None:
                self._spans = SpanBuffer(self)
            return self._spans

    def request(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``msg`` and wait (at most ``timeout_s``) for the reply; raises OSError when unreachable.

        A connection that broke since its last use (the agent restarted) is replaced once, so a job that
        the restarted agent re-adopted still ends when its process says so.
        """
        line = json.dumps(dict(msg)).encode() + b"\n"
        with self._lock:
            while True:
                reused = self._sock is not None
                sock = self._connect()
                try:
                    sock.sendall(line)
                    reply = self._file.readline()
                except OSError as exc:
                    self._close()
                    # Only a connection the agent's end dropped; after a timeout it may have acted on it.
                    if reused and isinstance(exc, BrokenPipeError | ConnectionResetError):
                        continue
                    raise
                if not reply:
                    self._close()
                    if reused:
                        continue
                    raise ConnectionError(f"the wattwatch agent at {self.path} closed the connection")
                break
        result: dict[str, Any] = json.loads(reply)
        return result

    def send(self, msg: Mapping[str, Any]) -> None:
        """Send ``msg`` without waiting for a reply; raises OSError when unreachable."""
        line = json.dumps({**msg, "noreply": True}).encode() + b"\n"
        with self._lock:
            sock = self._connect()
            try:
                sock.sendall(line)
            except OSError:
                self._close()
                raise

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.timeout_s)
            try:
                sock.connect(str(self.path))
            except OSError:
                sock.close()
                raise
            self._sock = sock
            self._file = sock.makefile("rb")
        return self._sock

    def _close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._file.close()
                self._sock.close()
        self._sock = None
        self._file = None

    def close(self) -> None:
        """Send buffered spans (for up to a second) and close the connection."""
        if self._spans is not None:
            self._spans.close()
        with self._lock:
            self._close()


class SpanBuffer:
    """Spans waiting for the agent, sent by one daemon thread in ``queries`` messages.

    ``add`` only appends under a lock held for microseconds: it never waits on the socket. The thread
    sends ``flush_interval_s`` after a span arrives, or as soon as ``flush_spans`` are waiting, and
    sleeps while the buffer is empty. When the agent cannot be reached the spans are kept (the oldest
    dropped past ``max_spans``) and retried with backoff.
    """

    def __init__(
        self,
        client: AgentClient,
        *,
        flush_interval_s: float = FLUSH_INTERVAL_S,
        flush_spans: int = FLUSH_SPANS,
        max_spans: int = MAX_BUFFERED_SPANS,
    ) -> None:
        self.client = client
        self.flush_interval_s = flush_interval_s
        self.flush_spans = flush_spans
        self.dropped = 0
        self.sent = 0
        self.failed_sends = 0
        self._spans: collections.deque[dict[str, Any]] = collections.deque(maxlen=max_spans)
        self._lock = threading.Lock()
        self._wake = threading.Event()  # enough spans for a message: send now
        self._nonempty = threading.Event()  # the sender sleeps without waking while nothing is buffered
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, span: dict[str, Any]) -> None:
        """Queue one span; returns at once."""
        with self._lock:
            if len(self._spans) == self._spans.maxlen:
                self.dropped += 1  # the deque drops the oldest
            self._spans.append(span)
            self._nonempty.set()
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="wattwatch-spans", daemon=True)
                self._thread.start()
            wake = len(self._spans) >= self.flush_spans
        if wake:
            self._wake.set()

    def pending(self) -> int:
        """Spans not yet handed to the agent."""
        with self._lock:
            return len(self._spans)

    def flush(self, timeout_s: float = 1.0) -> bool:
        """Send what is buffered now, waiting at most ``timeout_s``; True when nothing is left."""
        deadline = time.monotonic() + timeout_s
        while self.pending():
            if not self._send_some() or time.monotonic() >= deadline:
                break
        return self.pending() == 0

    def close(self, timeout_s: float = 1.0) -> None:
        """Flush (bounded) and stop the thread."""
        self._closed = True
        self.flush(timeout_s)
        self._nonempty.set()
        self._wake.set()

    def _run(self) -> None:
        backoff_s = 0.0
        while not self._closed:
            self._nonempty.wait()
            self._wake.wait(self.flush_interval_s + backoff_s)
            self._wake.clear()
            backoff_s = 0.0 if self._send_some() else min(max(backoff_s * 2, 0.2), 5.0)

    def _send_some(self) -> bool:
        """Send everything buffered; False when the agent was unreachable (the spans stay queued)."""
        with self._send_lock:
            while True:
                with self._lock:
                    if not self._spans:
                        self._nonempty.clear()
                        return True
                    batch = [self._spans.popleft() for _ in range(min(len(self._spans), MAX_SPANS_PER_MESSAGE))]
                try:
                    self.client.send({"op": "queries", "spans": batch})
                    self.sent += len(batch)
                except (OSError, ValueError) as exc:
                    with self._lock:
                        self.failed_sends += 1
                        room = (self._spans.maxlen or 0) - len(self._spans)
                        keep = batch[-room:] if room > 0 else []
                        self.dropped += len(batch) - len(keep)
                        self._spans.extendleft(reversed(keep))
                    warn_once(f"no agent reachable at {self.client.path} ({exc}); start one with `wattwatch up`")
                    return False


_client_lock = threading.Lock()
_client: AgentClient | None = None


_at_fork_registered = False


def shared_client() -> AgentClient:
    """The process's one AgentClient (made on first use; a forked child makes its own)."""
    global _client, _at_fork_registered
    with _client_lock:
        if _client is None:
            _client = AgentClient()
            atexit.register(_flush_at_exit)
            if not _at_fork_registered:
                _at_fork_registered = True
                # A forked child (a data-loader worker) must not inherit the parent's socket, locks or
                # sender thread (threads do not survive fork): it starts over with its own client.
                os.register_at_fork(after_in_child=_forget_client)
        return _client


def _forget_client() -> None:
    global _client, _client_lock
    _client = None
    _client_lock = threading.Lock()


def _flush_at_exit() -> None:
    client = _client
    if client is not None and client._spans is not None:
        client._spans.flush(timeout_s=1.0)
