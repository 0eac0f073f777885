"""The agent's Unix-socket API for the SDK and ``wattwatch run``: one JSON object per line.

Requests (``op`` names the operation; ``noreply: true`` makes it fire-and-forget):

    {"op": "ping"}
    {"op": "job_start", "id": "...", "name": "...", "kind": "training", "labels": {}, "pid": 123,
     "cuda_visible_devices": "0,1" | null, "via": "sdk" | "run"}
    {"op": "job_end", "id": "..."}
    {"op": "query", "job": "...", "t_start_s": 1.0, "t_end_s": 2.0, "tokens_in": 5, "tokens_out": 9,
     "kind": "query" | "step" | "epoch", "noreply": true}
    {"op": "queries", "spans": [{"job": "...", "t_start_s": 1.0, "t_end_s": 2.0, ...}, ...],
     "noreply": true}                      (up to 10,000 spans; what the SDK's span buffer sends)
    {"op": "jobs"}                         (the active jobs and why: ``discovered_by``)
    {"op": "sim_gpu_use", "pid": 123, "cuda_visible_devices": "0", "kind": "training",
     "sm_util_percent": 70 | "leave": true}  (simulated GPUs only: ``agent.sim_use``)

Replies: ``{"ok": true, ...}`` or ``{"ok": false, "error": "what to fix"}``; ``queries`` keeps the
good spans of a message and answers ``accepted`` / ``rejected`` counts.

``pid`` in ``job_start`` means "the process asking". The socket knows that process better than the
message does: a client in a container (a Kubernetes pod mounting the agent's socket) sends its pid in
its own namespace, while the agent (hostPID) needs the host's. So when the kernel names the peer
(``SO_PEERCRED``, translated into the agent's pid namespace), that pid replaces the one sent; it is 0 for
a peer outside the agent's namespace, and then the message's pid stands.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wattwatch.agent import quiet_server
from wattwatch.errors import ConfigError, WattwatchError

log = logging.getLogger(__name__)

Handler = Callable[[dict[str, Any]], dict[str, Any]]
MAX_LINE_BYTES = 1 << 20


class LocalApi:
    """Serves ``handler`` on a Unix socket at ``path`` from a small thread pool."""

    def __init__(self, path: Path, handler: Handler) -> None:
        self.path = path
        self._handler = handler
        self._server: socketserver.ThreadingUnixStreamServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Bind the socket (replacing a stale one) and serve in a background thread."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            if _is_listening(self.path):
                raise ConfigError(
                    f"another wattwatch agent already listens on {self.path}; stop it, or set "
                    "WATTWATCH_HOME to a different directory for this one"
                )
            self.path.unlink()  # left behind by an agent that died
        handler = self._handler

        class _Conn(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                peer_pid = _peer_pid(self.request)
                for raw in self.rfile:
                    if len(raw) > MAX_LINE_BYTES:
                        break
                    reply = _dispatch(handler, raw, peer_pid)
                    if reply is not None:
                        try:
                            self.wfile.write(json.dumps(reply).encode() + b"\n")
                            self.wfile.flush()
                        except OSError:
                            return

        server = socketserver.ThreadingUnixStreamServer(str(self.path), _Conn)
        server.daemon_threads = True
        # Owner and group only: other local users must not tag jobs on this host.
        os.chmod(self.path, 0o660)
        self._server = server
        self._thread = quiet_server.serve(server, "wattwatch-local-api")

    def stop(self) -> None:
        """Stop serving and remove the socket file; idempotent."""
        if self._server is not None:
            quiet_server.stop(self._server, self._thread)
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()


def _peer_pid(sock: Any) -> int:
    """The connected process's pid in this process's pid namespace; 0 when unknown (or outside it)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except (OSError, AttributeError):  # not Linux, or not a Unix socket
        return 0
    pid, _uid, _gid = struct.unpack("3i", raw)
    return max(int(pid), 0)


def _dispatch(handler: Handler, raw: bytes, peer_pid: int = 0) -> dict[str, Any] | None:
    try:
        msg = json.loads(raw)
        if not isinstance(msg, dict):
            raise ValueError("a request is a JSON object")
    except ValueError as exc:
        return {"ok": False, "error": f"bad request: {exc}"}
    if peer_pid and msg.get("op") == "job_start" and "pid" in msg:
        msg["pid"] = peer_pid
    noreply = bool(msg.get("noreply"))
    try:
        reply = handler(msg)
    except WattwatchError as exc:
        reply = {"ok": False, "error": str(exc)}
    except Exception as exc:  # never let one request kill the connection thread
        log.exception("local API request %r failed", msg.get("op"))
        reply = {"ok": False, "error": f"internal error: {exc}"}
    return None if noreply else reply


def _is_listening(path: Path) -> bool:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(0.5)
    try:
        sock.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        sock.close()
