"""The Python SDK: ``wattwatch.job()`` and ``wattwatch.query()``, talking to the local agent.

Both are context managers that must never hurt the workload: they connect to the agent's Unix socket
(``$WATTWATCH_HOME/agent.sock``) with a short timeout, send one line per event, and become no-ops with a
single warning when no agent is reachable. Query spans are fire-and-forget.
"""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

from wattwatch.config import default_home

_current_job: ContextVar[str | None] = ContextVar("wattwatch_job", default=None)

CONNECT_TIMEOUT_S = 0.5


class AgentClient:
    """A line-oriented client for the agent's socket. Thread-safe; reconnects lazily."""

    def __init__(self, path: Path | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path or default_home() / "agent.sock"
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._file: Any = None
        self._lock = threading.Lock()

    def request(self, msg: Mapping[str, Any]) -> dict[str, Any]:
        """Send ``msg`` and wait (at most ``timeout_s``) for the reply; raises OSError when unreachable."""
        line = json.dumps(dict(msg)).encode() + b"\n"
        with self._lock:
            sock = self._connect()
            try:
                sock.sendall(line)
                reply = self._file.readline()
            except OSError:
                self._close()
                raise
            if not reply:
                self._close()
                raise ConnectionError(f"the wattwatch agent at {self.path} closed the connection")
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
        """Close the connection."""
        with self._lock:
            self._close()


_client_lock = threading.Lock()
_client: AgentClient | None = None
_warned = False


def _shared_client() -> AgentClient:
    global _client
    with _client_lock:
        if _client is None:
            _client = AgentClient()
        return _client


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(f"wattwatch: {message}; energy is not being recorded", RuntimeWarning, stacklevel=3)


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
    client = client or _shared_client()
    jid = job_id or os.environ.get("WATTWATCH_JOB") or uuid.uuid4().hex
    started = False
    try:
        reply = client.request(
            {
                "op": "job_start",
                "id": jid,
                "name": name,
                "kind": kind,
                "labels": dict(labels or {}),
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
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
    token = _current_job.set(jid)
    try:
        yield jid
    finally:
        _current_job.reset(token)
        if started:
            with contextlib.suppress(OSError, ValueError):
                client.request({"op": "job_end", "id": jid})


@contextlib.contextmanager
def query(
    tokens_in: int = 0,
    tokens_out: int = 0,
    *,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> Iterator[dict[str, int]]:
    """Record the enclosed block as one inference request of the current job.

    Token counts can be set inside the block through the yielded dict (``q["tokens_out"] = n``) when
    they are only known at the end. Example::

        with wattwatch.query(tokens_in=len(prompt_ids)) as q:
            out = model.generate(prompt_ids)
            q["tokens_out"] = len(out)
    """
    counts = {"tokens_in": tokens_in, "tokens_out": tokens_out}
    t_start_s = time.time()
    try:
        yield counts
    finally:
        jid = job_id or _current_job.get() or os.environ.get("WATTWATCH_JOB")
        if jid is None:
            _warn_once("wattwatch.query() outside any job; wrap the server in wattwatch.job() or `wattwatch run`")
        else:
            client = client or _shared_client()
            try:
                client.send({"op": "query", "job": jid, "t_start_s": t_start_s, "t_end_s": time.time(), **counts})
            except OSError as exc:
                _warn_once(f"no agent reachable at {client.path} ({exc}); start one with `wattwatch up`")
