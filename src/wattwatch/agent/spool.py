"""A durable FIFO of encoded batches, so nothing measured is lost while the collector is away.

It is a small SQLite file (stdlib ``sqlite3``: the agent never imports the collector's storage layer).
Batches are written before any push is attempted and deleted only after the collector accepted them;
the next sequence number is stored with them, so a restarted agent never reuses a batch key. The
restart checkpoint (``agent.restore``) is written with every batch, in the batch's transaction.
"""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, created_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS dead (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class Spool:
    """Durable queue of ``(seq, body)``; thread-safe."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = threading.Lock()
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        # WAL + NORMAL survives a process crash (not a power cut mid-commit), at a fraction of FULL's cost.
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def meta(self, key: str) -> str | None:
        """A stored string (the agent id lives here), or None."""
        with self._lock:
            row = self._db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return None if row is None else str(row[0])

    def set_meta(self, key: str, value: str) -> None:
        """Store a string under ``key``."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    def next_seq(self) -> int:
        """Reserve and return the next batch sequence number (persisted before it is used)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
                seq = int(row[0]) if row else 0
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_seq', ?)", (str(seq + 1),))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return seq

    def put(self, seq: int, body: bytes, created_s: float, checkpoint: str | None = None) -> None:
        """Append a batch durably; with ``checkpoint`` (``agent.restore``), store it in the same transaction,
        so the checkpoint never describes readings whose intervals the spool does not hold."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT INTO batches (seq, body, created_s) VALUES (?, ?, ?)", (seq, body, created_s))
                if checkpoint is not None:
                    self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('checkpoint', ?)", (checkpoint,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def checkpoint(self) -> str | None:
        """The checkpoint stored with the latest batch (None before the first)."""
        return self.meta("checkpoint")

    def peek(self, limit: int = 16) -> list[tuple[int, bytes]]:
        """The oldest ``limit`` batches, oldest first."""
        with self._lock:
            rows = self._db.execute("SELECT seq, body FROM batches ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return [(int(seq), bytes(body)) for seq, body in rows]

    def ack(self, seq: int) -> None:
        """The collector stored batch ``seq``: forget it."""
        with self._lock:
            self._db.execute("DELETE FROM batches WHERE seq = ?", (seq,))

    def bury(self, seq: int, reason: str) -> None:
        """The collector refused batch ``seq`` for good: keep it aside for inspection, stop retrying it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            self._db.execute(
                "INSERT OR REPLACE INTO dead (seq, body, reason) SELECT seq, body, ? FROM batches WHERE seq = ?",
                (reason, seq),
            )
            self._db.execute("DELETE FROM batches WHERE seq = ?", (seq,))
            self._db.execute("COMMIT")

    def pending(self) -> int:
        """How many batches wait to be pushed."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM batches").fetchone()[0])

    def dead(self) -> int:
        """How many batches the collector refused."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM dead").fetchone()[0])

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            self._db.close()
