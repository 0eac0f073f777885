"""The collector's API tokens: made, listed and revoked here (``wattwatch token``), checked by
``collector.auth``.

A token is ``ww_`` followed by 43 URL-safe characters: 256 random bits from ``secrets``. The database
keeps only its SHA-256 and its first ``PREFIX_CHARS`` characters. A plain hash is enough because the
token is random and long: nobody can guess 256 bits, so the slow, salted hashes that protect
human-chosen passwords would add nothing but milliseconds to every request. The prefix finds the row
and names the token in lists; the hash comparison is constant-time (``hmac.compare_digest``).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass

from sqlalchemy import Engine, insert, or_, select, update

from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.tables import api_tokens

ROLES = ("admin", "agent", "reader")
TOKEN_PREFIX = "ww_"
PREFIX_CHARS = 11  # "ww_" + 8 characters: 48 bits, enough to tell tokens apart in a list


@dataclass(frozen=True)
class TokenRow:
    """One stored token (never the token itself)."""

    id: int
    prefix: str
    role: str
    host: str | None
    created_at_s: float
    last_used_s: float | None
    revoked_at_s: float | None


@dataclass(frozen=True)
class ActiveToken:
    """What the collector needs to recognise a token."""

    id: int
    sha256: str
    role: str
    host: str | None


class TokenError(ValueError):
    """A token request that cannot be done (unknown token, wrong role/host combination)."""


def hash_token(token: str) -> str:
    """SHA-256 of ``token`` as hex: what the database stores."""
    return hashlib.sha256(token.encode()).hexdigest()


def prefix_of(token: str) -> str:
    """The stored, listable prefix of ``token``."""
    return token[:PREFIX_CHARS]


def matches(token: str, stored_sha256: str) -> bool:
    """Whether ``token`` hashes to ``stored_sha256``, compared in constant time."""
    return hmac.compare_digest(hash_token(token).encode(), stored_sha256.encode())


def create_token(engine: Engine, role: str, host: str | None = None, *, now_s: float | None = None) -> tuple[int, str]:
    """Make and store a token; returns ``(id, token)``. The token is never stored and cannot be shown again."""
    if role not in ROLES:
        raise TokenError(f"role {role!r} is not one of {', '.join(ROLES)}")
    if role == "agent" and not host:
        raise TokenError("an agent token is for one host: give --host NAME (the agent's --host / WATTWATCH_HOST)")
    if role != "agent" and host:
        raise TokenError(f"a {role} token is not tied to a host; drop --host (only --role agent takes one)")
    if host is not None and len(host) > 200:
        raise TokenError("--host is longer than 200 characters")
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        token_id = conn.execute(
            insert(api_tokens)
            .values(
                prefix=prefix_of(token),
                sha256=hash_token(token),
                role=role,
                host=host,
                created_at_s=time.time() if now_s is None else now_s,
            )
            .returning(api_tokens.c.id)
        ).scalar_one()
    return int(token_id), token


def list_tokens(engine: Engine) -> list[TokenRow]:
    """Every token, revoked ones too, oldest first."""
    t = api_tokens
    with engine.connect() as conn:
        rows = conn.execute(
            select(
                t.c.id, t.c.prefix, t.c.role, t.c.host, t.c.created_at_s, t.c.last_used_s, t.c.revoked_at_s
            ).order_by(t.c.id)
        ).all()
    return [TokenRow(int(r[0]), r[1], r[2], r[3], r[4], r[5], r[6]) for r in rows]


def revoke_token(engine: Engine, which: str, *, now_s: float | None = None) -> tuple[TokenRow, bool]:
    """Revoke the token with id or prefix ``which``; returns it and whether it was active until now.

    Raises TokenError when nothing (or more than one token) matches.
    """
    t = api_tokens
    cond = or_(t.c.id == int(which), t.c.prefix == which) if which.isdigit() else t.c.prefix == which
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        ids = [int(r[0]) for r in conn.execute(select(t.c.id).where(cond))]
        if not ids:
            raise TokenError(f"no token with id or prefix {which!r}; see `wattwatch token list`")
        if len(ids) > 1:
            raise TokenError(f"{which!r} names {len(ids)} tokens; revoke by id (see `wattwatch token list`)")
        newly = conn.execute(
            update(t)
            .where(t.c.id == ids[0], t.c.revoked_at_s.is_(None))
            .values(revoked_at_s=time.time() if now_s is None else now_s)
            .returning(t.c.id)
        ).first()
    (row,) = [r for r in list_tokens(engine) if r.id == ids[0]]
    return row, newly is not None


def active_tokens(engine: Engine) -> dict[str, list[ActiveToken]]:
    """Tokens not revoked, by prefix (normally one per prefix)."""
    t = api_tokens
    by_prefix: dict[str, list[ActiveToken]] = {}
    with engine.connect() as conn:
        rows = conn.execute(
            select(t.c.id, t.c.prefix, t.c.sha256, t.c.role, t.c.host).where(t.c.revoked_at_s.is_(None))
        )
        for token_id, prefix, sha, role, host in rows:
            by_prefix.setdefault(prefix, []).append(ActiveToken(int(token_id), sha, role, host))
    return by_prefix


def any_active(engine: Engine) -> bool:
    """Whether any token is not revoked (then the collector requires one on every endpoint)."""
    with engine.connect() as conn:
        return (
            conn.execute(select(api_tokens.c.id).where(api_tokens.c.revoked_at_s.is_(None)).limit(1)).first()
            is not None
        )


def any_ever(engine: Engine) -> bool:
    """Whether any token was ever made, revoked ones too (then the collector takes no anonymous requests)."""
    with engine.connect() as conn:
        return conn.execute(select(api_tokens.c.id).limit(1)).first() is not None


def record_use(engine: Engine, last_used_s: dict[int, float]) -> None:
    """Store when tokens were last used (the collector batches this, at most about once a minute)."""
    if not last_used_s:
        return
    t = api_tokens
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        for token_id, used_s in sorted(last_used_s.items()):
            conn.execute(update(t).where(t.c.id == token_id).values(last_used_s=used_s))
