"""Which collector replica exports the database-derived metrics, so that replicas never double count.

Every replica reads the same database, so each would export the same job, idle and host totals, and a
``sum`` over replicas would count them once per replica. Instead, exactly one replica exports them: the one
holding a PostgreSQL session-level advisory lock on a connection of its own. If that replica dies, the
database ends its session and releases the lock, and the next replica that is scraped takes it. SQLite
has one collector process per database, which always leads.

Session locks need a real session: behind a transaction-pooling PgBouncer, point the collector at
PostgreSQL directly (or a session-pooling pool).
"""

from __future__ import annotations

import logging
import threading

from sqlalchemy import Connection, Engine, text
from sqlalchemy.exc import SQLAlchemyError

log = logging.getLogger(__name__)

# An arbitrary 64-bit key of wattwatch's own ("wattmetr" in ASCII) in PostgreSQL's advisory-lock space.
ADVISORY_LOCK_KEY = 0x776174746D657472


class MetricsLeader:
    """``is_leader()`` says whether this replica exports the database-derived series now."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._lock = threading.Lock()
        self._conn: Connection | None = None
        self._always = engine.dialect.name != "postgresql"

    def is_leader(self) -> bool:
        """True while this replica holds the lock; tries to take it when nobody does. Never raises."""
        if self._always:
            return True
        with self._lock:
            if self._conn is not None and self._alive(self._conn):
                return True
            self._drop()
            return self._acquire()

    def close(self) -> None:
        """Give the lock up (closing the session releases it); idempotent."""
        with self._lock:
            self._drop()

    def _alive(self, conn: Connection) -> bool:
        try:
            conn.execute(text("SELECT 1"))
            conn.commit()
            return True
        except SQLAlchemyError as exc:
            log.warning("lost the metrics-leader connection (%s); another replica may take over", exc)
            return False

    def _acquire(self) -> bool:
        try:
            conn = self._engine.connect()
        except SQLAlchemyError as exc:
            log.warning("cannot connect to decide the metrics leader: %s", exc)
            return False
        try:
            got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": ADVISORY_LOCK_KEY}).scalar())
            conn.commit()
        except SQLAlchemyError as exc:
            log.warning("cannot take the metrics-leader lock: %s", exc)
            got = False
        if not got:
            conn.close()  # hold no idle connection while another replica leads
            return False
        log.info("this collector now exports the database-derived metrics (metrics leader)")
        self._conn = conn
        return True

    def _drop(self) -> None:
        if self._conn is None:
            return
        conn, self._conn = self._conn, None
        try:
            # Release first: a closed socket frees the lock only when the server's backend notices the
            # disconnect, later, so a replica asking at once would still find it taken.
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": ADVISORY_LOCK_KEY})
            conn.commit()
        except SQLAlchemyError:
            pass  # a dead connection: the server frees the lock when it sees the session end
        try:
            # The pool would keep the session (and the lock) alive: end it for real.
            conn.invalidate()
            conn.close()
        except SQLAlchemyError:
            pass
