"""Who is calling the collector, and what they may do.

Credentials, each sent as ``Authorization: Bearer <token>``:

- tokens made by ``wattwatch token create`` (``storage.tokens``): ``agent`` (writes for its own host
  only), ``reader`` (reports, job lists, /metrics, the OpenAPI document) and ``admin`` (everything);
- the static ``WATTWATCH_TOKEN`` (``--token``/``--token-file``): an admin token, as before tokens existed;
- ``local_token``: the in-process agent of ``wattwatch up`` (admin; never switches authentication on).

Callers without a token (``anonymous``): ``nobody`` (``wattwatch collector``'s default: every route but
/healthz and /readyz needs a token), ``loopback`` (``--open``, and ``wattwatch up``: requests from this
machine, straight to the collector, need none) or ``anyone`` (an app embedded in-process, as tests build
it). Either way anonymous access ends for good once tokens were ever configured: a static token, or any
row in the token table, revoked ones included, so revoking the last token never reopens the collector.
A request carrying ``Forwarded``, ``X-Forwarded-For`` or ``X-Real-IP`` came through a proxy and is never
from this machine, whatever its peer address. The database's tokens are re-read every ``refresh_s``, so a
token created or revoked while the collector runs counts within that time; if the database is away the
last set read stays in force (so /metrics can still report a database that is down).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Request
from sqlalchemy import Engine
from sqlalchemy.exc import SQLAlchemyError
from starlette.types import Scope

from wattwatch.collector.errors import ApiError
from wattwatch.storage import tokens

log = logging.getLogger(__name__)

# How often the database's tokens are re-read: the longest a revoked token keeps working.
DEFAULT_REFRESH_S = 2.0
# How often last-used times are written (each write is a small transaction).
LAST_USED_EVERY_S = 60.0
CREATE_HINT = "create one with `wattwatch token create --role reader` (or --role agent --host HOST)"
# Who may call without a token while none was ever configured (module docstring).
Anonymous = Literal["nobody", "loopback", "anyone"]
ANONYMOUS_MODES: tuple[Anonymous, ...] = ("nobody", "loopback", "anyone")
# Headers a reverse proxy adds: their presence means the peer address is the proxy's, not the caller's.
PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip")


@dataclass(frozen=True)
class Principal:
    """An authenticated caller. ``role`` is admin, agent, reader, or open (no authentication configured)."""

    role: str
    host: str | None = None
    token_id: int | None = None

    def require_read(self) -> None:
        """Raise 403 unless this caller may read reports and metrics."""
        if self.role == "agent":
            raise ApiError(
                403,
                "an agent token writes only; reading needs a reader token (`wattwatch token create --role reader`)",
                "Authorization",
            )

    def require_write(self, host: str | None, field: str = "host") -> str | None:
        """Raise 403 unless this caller may write for ``host``; returns the host to write as.

        An agent token writes only as its own host (``host`` None: its host); ``field`` names where the
        host came from in the request, for the error.
        """
        if self.role == "reader":
            raise ApiError(
                403,
                "a reader token cannot write; agents need an agent token "
                "(`wattwatch token create --role agent --host HOST`)",
                "Authorization",
            )
        if self.role != "agent":
            return host
        if host is not None and host != self.host:
            raise ApiError(403, f"{field}: this agent token is for host {self.host!r}, not {host!r}", field)
        return self.host

    def require_host_of(self, job_id: str, job_hosts: set[str] | None) -> None:
        """Raise 403 when an agent token touches a job its host never reported (None: no job; 404 comes later)."""
        if self.role == "agent" and job_hosts is not None and self.host not in job_hosts:
            raise ApiError(
                403,
                f"job {job_id!r} is not on host {self.host!r}; an agent token writes for its own host only",
                "job_id",
            )


OPEN = Principal("open")


@dataclass(frozen=True)
class _Snapshot:
    by_prefix: dict[str, list[tokens.ActiveToken]]
    loaded_at_s: float
    configured: bool  # any token row, revoked ones too: anonymous access is over for good


def is_local(scope: Scope) -> bool:
    """Whether an ASGI HTTP ``scope`` is a request from this machine, straight to the collector.

    The peer must be a loopback address and the request carry no proxy header (``PROXY_HEADERS``): a
    reverse proxy on this host connects from loopback on behalf of callers anywhere.
    """
    headers: Iterable[tuple[bytes, bytes]] = scope.get("headers", ())
    if any(name in PROXY_HEADERS for name, _ in headers):
        return False
    client = scope.get("client")
    if not client:
        return False  # no peer address (a Unix socket, an in-process call): nothing says it is local
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # ::ffff:127.0.0.1 from a dual-stack socket
    return address.is_loopback


class Authenticator:
    """A FastAPI dependency: the request's Principal, or 401. ``reader`` and ``writer`` add the role checks."""

    def __init__(
        self,
        engine: Engine,
        *,
        static_token: str = "",
        local_token: str = "",
        anonymous: Anonymous = "anyone",
        refresh_s: float = DEFAULT_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._engine = engine
        self._static = static_token.encode()
        self._local = local_token.encode()
        if anonymous not in ANONYMOUS_MODES:
            raise ValueError(f"anonymous must be one of {ANONYMOUS_MODES}, not {anonymous!r}")
        # A static token is a configured token: nobody gets in without one.
        self._anonymous: Anonymous = "nobody" if static_token else anonymous
        self._refresh_s = refresh_s
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._used: dict[int, float] = {}
        self._used_flushed_at_s = float("-inf")

    def preload(self) -> None:
        """Read the database's tokens now if it answers, so /metrics can still be authenticated (and say the
        database is down) if it goes away before the first request."""
        try:
            self._current()
        except SQLAlchemyError as exc:
            log.debug("API tokens not read at start (%s); the first request reads them", exc)

    def __call__(self, request: Request) -> Principal:
        """Authenticate ``request`` (any role)."""
        return self.for_scope(request.scope)

    def for_scope(self, scope: Scope) -> Principal:
        """Authenticate an ASGI HTTP ``scope`` from its headers alone (``collector.guard`` calls this before
        anything reads the body)."""
        authorization = None
        for name, value in scope.get("headers", ()):
            if name == b"authorization":  # the first, as Starlette's Headers.get
                authorization = value.decode("latin-1")
                break
        return self.authenticate(authorization, local=is_local(scope))

    def reader(self, request: Request) -> Principal:
        """Authenticate and require the right to read."""
        who = self(request)
        who.require_read()
        return who

    def writer(self, request: Request) -> Principal:
        """Authenticate and require a role that writes (the host is checked where the route knows it)."""
        who = self(request)
        who.require_write(None)
        return who

    def authenticate(self, authorization: str | None, *, local: bool = False) -> Principal:
        """The Principal for an ``Authorization`` header value of a request (``local``: ``is_local``);
        raises ApiError(401) naming what is missing."""
        scheme, _, given = (authorization or "").partition(" ")
        given = given.strip()
        bearer = given if scheme.lower() == "bearer" and given else None
        if bearer is not None:
            raw = bearer.encode()
            # Constant-time compares: a token is the only thing between the network and the database.
            if self._static and hmac.compare_digest(raw, self._static):
                return Principal("admin")
            if self._local and hmac.compare_digest(raw, self._local):
                return Principal("admin")
        snapshot = self._current()
        if bearer is not None:
            for candidate in snapshot.by_prefix.get(tokens.prefix_of(bearer), []):
                if tokens.matches(bearer, candidate.sha256):
                    self._used[candidate.id] = self._wall_clock()
                    return Principal(candidate.role, candidate.host, candidate.id)
        if bearer is not None:
            raise ApiError(401, "bearer token unknown or revoked; see `wattwatch token list`", "Authorization")
        if snapshot.configured or self._static:
            raise ApiError(401, f"this collector needs `Authorization: Bearer <token>`; {CREATE_HINT}", "Authorization")
        if self._anonymous == "nobody":
            raise ApiError(
                401,
                "this collector takes no anonymous requests and has no token yet; "
                f"{CREATE_HINT}, or start it with --open for anonymous access from this machine",
                "Authorization",
            )
        if self._anonymous == "anyone" or local:
            return OPEN
        raise ApiError(
            401,
            "anonymous requests are taken from this machine only, straight to the collector (not through a "
            f"proxy: Forwarded / X-Forwarded-For); send `Authorization: Bearer <token>`; {CREATE_HINT}",
            "Authorization",
        )

    def is_fresh(self) -> bool:
        """Whether authenticating now needs no database read (the tokens read last are still current)."""
        snap = self._snapshot
        return snap is not None and self._clock() - snap.loaded_at_s < self._refresh_s

    def _current(self) -> _Snapshot:
        now_s = self._clock()
        snap = self._snapshot
        if snap is not None and now_s - snap.loaded_at_s < self._refresh_s:
            return snap
        with self._lock:
            snap = self._snapshot
            if snap is not None and now_s - snap.loaded_at_s < self._refresh_s:
                return snap  # another thread refreshed while this one waited
            try:
                by_prefix = tokens.active_tokens(self._engine)
                # Once configured, always: a table emptied by hand does not reopen a running collector.
                configured = bool(by_prefix) or (snap is not None and snap.configured) or tokens.any_ever(self._engine)
                snap = _Snapshot(by_prefix, now_s, configured)
            except SQLAlchemyError as exc:
                if snap is None:
                    raise  # never read: the database error handler answers 503 saying why
                log.warning(
                    "cannot re-read API tokens (%s); the last set read stays in force", str(exc).splitlines()[0]
                )
                return snap
            self._snapshot = snap
            self._flush_used(now_s)
            return snap

    def _flush_used(self, now_s: float) -> None:
        # Called under the lock. Best effort: a lost last-used time is not worth failing a request for.
        if not self._used or now_s - self._used_flushed_at_s < LAST_USED_EVERY_S:
            return
        used, self._used = self._used, {}
        self._used_flushed_at_s = now_s
        try:
            tokens.record_use(self._engine, used)
        except SQLAlchemyError as exc:
            log.warning("cannot record when API tokens were last used: %s", str(exc).splitlines()[0])


def is_loopback(host: str) -> bool:
    """Whether a listen host is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def open_collector_error(listen: str) -> str:
    """The one line a collector prints when it would listen beyond loopback with no token."""
    return (
        f"refusing to listen on {listen} with no token: no agent on another machine could write to it; "
        "create one with `wattwatch token create --db URL --role agent --host HOST` (or set WATTWATCH_TOKEN / "
        "--token-file), or pass --allow-open to start now and create tokens later"
    )


# The scope key under which ``guard.WriteGuard`` leaves a write request's Principal for the routes.
PRINCIPAL = "wattwatch.principal"


def principal_of(scope: Mapping[str, Any]) -> Principal | None:
    """The Principal the write guard found for this request, if it ran."""
    who = scope.get(PRINCIPAL)
    return who if isinstance(who, Principal) else None
