"""The Python SDK: ``wattwatch.job()``, and spans inside it: ``query()`` per inference request,
``step()`` / ``epoch()`` for training.

They must never hurt the workload. ``job()`` talks to the agent's Unix socket
(``$WATTWATCH_HOME/agent.sock``) with a short timeout; spans never touch the socket on the workload's
thread: they are appended to a buffer that a background thread sends as one ``queries`` message every
``FLUSH_INTERVAL_S`` or ``FLUSH_SPANS`` spans, whichever comes first. Nothing here raises into the
workload; with no agent reachable everything is a no-op after a single warning, and the buffer drops its
oldest spans past ``MAX_BUFFERED_SPANS`` rather than grow without bound.

Spans and labels are checked against ``wattwatch.limits`` as they are recorded, the way the collector will
check them: one that would be refused there (a time in milliseconds, an end before its start, a token count
beyond 2**31 - 1, a label too long) is dropped here alone, with a warning the first time per reason and a
count in ``refused()``, and the rest flow on.
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
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from wattwatch import limits
from wattwatch.config import default_home

_current_job: ContextVar[str | None] = ContextVar("wattwatch_job", default=None)
# Jobs open in this process, newest last. New threads start with an empty context, so a request
# handled on a server's worker thread would not see the job() its main thread opened; it falls back
# to the newest job open in the process.
_open_jobs: list[str] = []
_open_jobs_lock = threading.Lock()

CONNECT_TIMEOUT_S = 0.5
FLUSH_INTERVAL_S = 0.1
FLUSH_SPANS = 256
MAX_BUFFERED_SPANS = 100_000
MAX_SPANS_PER_MESSAGE = 2_000
SpanKind = Literal["query", "step", "epoch"]


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
                    _warn_once(f"no agent reachable at {self.client.path} ({exc}); start one with `wattwatch up`")
                    return False


_client_lock = threading.Lock()
_client: AgentClient | None = None
_warned = False
_refused: collections.Counter[str] = collections.Counter()
_refused_lock = threading.Lock()


def refused() -> dict[str, int]:
    """Spans and labels this process dropped as out of bounds, by reason (``limits.REASONS``)."""
    with _refused_lock:
        return dict(_refused)


def _refuse(what: str, exc: limits.BoundError) -> None:
    with _refused_lock:
        first = _refused[exc.reason] == 0
        _refused[exc.reason] += 1
    if first:
        warnings.warn(
            f"wattwatch: {what} dropped: {exc} (further ones for this reason are counted in wattwatch.sdk.refused())",
            RuntimeWarning,
            stacklevel=4,
        )


_at_fork_registered = False


def _shared_client() -> AgentClient:
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


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"wattwatch: {message}; energy is not being recorded", RuntimeWarning, stacklevel=3)


@dataclass
class JobHandle:
    """A started job (``start_job``); ``end()`` it once. ``started`` is False when no agent took it."""

    id: str
    client: AgentClient
    started: bool
    ended: bool = field(default=False)

    def end(self) -> None:
        """Send the job's buffered spans, then end it at the agent; never raises."""
        if self.ended:
            return
        self.ended = True
        try:
            if self.client._spans is not None:
                self.client._spans.flush(timeout_s=1.0)
            if self.started:
                self.client.request({"op": "job_end", "id": self.id})
        except (OSError, ValueError):
            pass


def start_job(
    name: str,
    kind: str = "training",
    *,
    labels: Mapping[str, str] | None = None,
    job_id: str | None = None,
    client: AgentClient | None = None,
    via: str = "sdk",
) -> JobHandle:
    """Start a job at the agent and return its handle (for code whose start and end are in different
    callbacks; otherwise use ``job()``). Never raises: without an agent the handle is inert."""
    client = client or _shared_client()
    jid = job_id or os.environ.get("WATTWATCH_JOB") or uuid.uuid4().hex
    started = False
    fitted, dropped = limits.fit_labels(labels or {})
    for exc in dropped:
        _refuse("a job label was", exc)
    try:
        reply = client.request(
            {
                "op": "job_start",
                "id": jid,
                "name": name,
                "kind": kind,
                "labels": fitted,
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "via": via,
            }
        )
        if reply.get("ok"):
            started = True
            if reply.get("warning"):
                warnings.warn(f"wattwatch: {reply['warning']}", RuntimeWarning, stacklevel=3)
        else:
            warnings.warn(f"wattwatch: agent refused the job: {reply.get('error')}", RuntimeWarning, stacklevel=3)
    except (OSError, ValueError) as exc:
        _warn_once(f"no agent reachable at {client.path} ({exc}); start one with `wattwatch up`")
    return JobHandle(jid, client, started)


@contextlib.contextmanager
def job(
    name: str,
    kind: str = "training",
    *,
    labels: Mapping[str, str] | None = None,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> Iterator[str]:
    """Measure the enclosed block as a job; yields the job id.

    The id is ``job_id``, else ``$WATTWATCH_JOB`` (so every host of one training run reports under the
    same id), else a new one. Devices come from ``CUDA_VISIBLE_DEVICES`` or, if unset, from the GPUs
    where NVML lists this process. Example::

        with wattwatch.job("llama-ft", kind="training", labels={"team": "nlp"}):
            trainer.train()
    """
    handle = start_job(name, kind, labels=labels, job_id=job_id, client=client)
    token = _current_job.set(handle.id)
    with _open_jobs_lock:
        _open_jobs.append(handle.id)
    try:
        yield handle.id
    finally:
        _current_job.reset(token)
        with _open_jobs_lock:
            _open_jobs.remove(handle.id)
        handle.end()


def _newest_open_job() -> str | None:
    with _open_jobs_lock:
        return _open_jobs[-1] if _open_jobs else None


def record_span(
    kind: SpanKind,
    t_start_s: float,
    t_end_s: float,
    *,
    tokens_in: int = 0,
    tokens_out: int = 0,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> None:
    """Queue one finished span (Unix seconds) for the current job; never blocks, never raises.

    A span out of bounds (``limits.check_span``) is dropped with a warning and counted in ``refused()``."""
    try:
        jid = job_id or _current_job.get() or _newest_open_job() or os.environ.get("WATTWATCH_JOB")
        if jid is None:
            _warn_once(f"wattwatch.{kind}() outside any job; wrap the code in wattwatch.job() or `wattwatch run`")
            return
        try:
            start_s, end_s, n_in, n_out = limits.check_span(
                t_start_s, t_end_s, tokens_in, tokens_out, now_s=time.time()
            )
        except limits.BoundError as exc:
            _refuse(f"a {kind} span was", exc)
            return
        span: dict[str, Any] = {"job": jid, "kind": kind, "t_start_s": start_s, "t_end_s": end_s}
        if n_in:
            span["tokens_in"] = n_in
        if n_out:
            span["tokens_out"] = n_out
        (client or _shared_client()).spans.add(span)
    except Exception as exc:  # the workload comes first
        _warn_once(f"could not record a span ({exc!r})")


@contextlib.contextmanager
def _span(
    kind: SpanKind, counts: dict[str, int], job_id: str | None, client: AgentClient | None
) -> Iterator[dict[str, int]]:
    t_start_s = time.time()
    try:
        yield counts
    finally:
        tokens_in, tokens_out = counts.get("tokens_in", 0), counts.get("tokens_out", 0)
        record_span(
            kind, t_start_s, time.time(), tokens_in=tokens_in, tokens_out=tokens_out, job_id=job_id, client=client
        )


def query(
    tokens_in: int = 0,
    tokens_out: int = 0,
    *,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one inference request of the current job.

    Token counts can be set inside the block through the yielded dict (``q["tokens_out"] = n``) when
    they are only known at the end. Example::

        with wattwatch.query(tokens_in=len(prompt_ids)) as q:
            out = model.generate(prompt_ids)
            q["tokens_out"] = len(out)
    """
    return _span("query", {"tokens_in": tokens_in, "tokens_out": tokens_out}, job_id, client)


def step(
    tokens: int = 0, *, job_id: str | None = None, client: AgentClient | None = None
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one training step of the current job (energy per step in reports).

    ``tokens`` (or ``s["tokens_in"] = n`` inside) are the tokens the step trained on. Example::

        for batch in loader:
            with wattwatch.step(tokens=batch.numel()):
                loss = model(batch).loss; loss.backward(); opt.step()
    """
    return _span("step", {"tokens_in": tokens}, job_id, client)


def epoch(
    *, job_id: str | None = None, client: AgentClient | None = None
) -> contextlib.AbstractContextManager[dict[str, int]]:
    """Record the enclosed block as one training epoch of the current job. Example::

    for _ in range(epochs):
        with wattwatch.epoch():
            train_one_epoch()
    """
    return _span("epoch", {}, job_id, client)
