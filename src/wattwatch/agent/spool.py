"""A durable FIFO of encoded batches, so nothing measured is lost while the collector is away.

It is a small SQLite file (stdlib ``sqlite3``: the agent never imports the collector's storage layer).
Batches are written before any push is attempted and deleted only after the collector accepted them;
the next sequence number is stored with them, so a restarted agent never reuses a batch key. The
restart checkpoint (``agent.restore``) is written with every batch, in the batch's transaction.

Between pushes the agent stages what each tick measured (``stage``): a part of the batch it will seal
next, under that batch's reserved seq, with the checkpoint as of it in the same row (one statement: the
cheapest durable write SQLite has). Sealing moves the parts into the queue as one batch and the last
part's checkpoint into ``meta`` (``seal_staged``); a batch left staged by a crash is sealed from its
parts at the next start (``agent.outbox``). So the push cadence (how many ticks one batch holds) costs a
crash nothing: what a tick measured is durable once that tick is staged.

A batch the collector refuses for good (``agent.poison``) moves to the ``dead`` table with a JSON
reason, in one transaction: kept in the same file, never retried, never deleted, until ``requeue``
(``wattwatch spool requeue``) moves it back. Another process (``wattwatch spool``, ``wattwatch doctor``)
may open the file while the agent runs: SQLite's locks keep each move whole.

A write on a full disk rolls back whole and raises SQLite's own error ("database or disk is full"), which
``disk_full`` tells from any other; the outbox keeps what it was writing in memory (``agent.outbox``).
"""

from __future__ import annotations

import errno
import json
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPOOL_FILE = "spool.db"  # under the agent's home (--home, WATTWATCH_HOME)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, created_s REAL NOT NULL);
CREATE TABLE IF NOT EXISTS dead (seq INTEGER PRIMARY KEY, body BLOB NOT NULL, reason TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS staged (
    seq INTEGER NOT NULL, part INTEGER NOT NULL, body BLOB NOT NULL, created_s REAL NOT NULL, checkpoint TEXT,
    PRIMARY KEY (seq, part)
);
"""


@dataclass(frozen=True)
class SetAside:
    """A batch the collector refused for good: its key, the reason recorded (``agent.poison``), its size."""

    seq: int
    reason: dict[str, Any]
    size_bytes: int

    @property
    def at_s(self) -> float:
        """Unix time it was set aside (0 when unknown: set aside by an older agent)."""
        at_s = self.reason.get("set_aside_at_s")
        return float(at_s) if isinstance(at_s, int | float) else 0.0


def _reason(text: str) -> dict[str, Any]:
    """A stored reason as a dict; older agents stored one line of text (``HTTP 422: ...``)."""
    try:
        record = json.loads(text)
    except ValueError:
        record = None
    if isinstance(record, dict):
        return record
    status = text[5:8] if text.startswith("HTTP ") and text[5:8].isdigit() else None
    return {"reason": "rejected", "status": int(status) if status else None, "error": text}


# SQLITE_FULL: "database or disk is full" (the disk, or a max_page_count the file may not grow past).
_SQLITE_FULL = 13
_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})


def disk_full(exc: BaseException) -> bool:
    """Whether ``exc`` (from a spool write) says the spool's disk is full: SQLite's SQLITE_FULL, or ENOSPC
    or EDQUOT (over quota) from the file system. Any other error is not a full disk."""
    if isinstance(exc, sqlite3.Error):
        code = getattr(exc, "sqlite_errorcode", None)
        return code == _SQLITE_FULL or (code is None and "disk is full" in str(exc))
    return isinstance(exc, OSError) and exc.errno in _NO_SPACE


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

    def _rollback(self) -> None:
        """Roll back the open transaction, if SQLite has not already: on a full disk it rolls back by itself,
        and a ROLLBACK then would raise "no transaction is active" in place of the error that says why."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

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
                self._rollback()
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
                self._rollback()
                raise

    def stage(self, seq: int, body: bytes, created_s: float, checkpoint: str | None = None) -> None:
        """Append one part of the batch ``seq`` (not yet sealed) durably, with the ``checkpoint`` as of it
        (``checkpoint()`` returns it from now on)."""
        with self._lock:
            self._db.execute(
                "INSERT INTO staged (seq, part, body, created_s, checkpoint) "
                "SELECT ?, COALESCE(MAX(part) + 1, 0), ?, ?, ? FROM staged WHERE seq = ?",
                (seq, body, created_s, checkpoint, seq),
            )

    def stage_new(self, part: Callable[[int], tuple[bytes, float]], checkpoint: str | None = None) -> int:
        """Reserve the next batch sequence number and stage the first part of that batch (``part(seq)``
        gives its body and created_s), with the ``checkpoint`` as of it, in one transaction; returns the
        seq. ``next_seq`` then ``stage`` does the same in two (a batch opens every push interval)."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
                seq = int(row[0]) if row else 0
                body, created_s = part(seq)
                self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_seq', ?)", (str(seq + 1),))
                self._db.execute(
                    "INSERT INTO staged (seq, part, body, created_s, checkpoint) "
                    "SELECT ?, COALESCE(MAX(part) + 1, 0), ?, ?, ? FROM staged WHERE seq = ?",
                    (seq, body, created_s, checkpoint, seq),
                )
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return seq

    def staged(self) -> dict[int, list[bytes]]:
        """The parts of every batch staged but not sealed (a crash left them), by seq, in order."""
        with self._lock:
            rows = self._db.execute("SELECT seq, body FROM staged ORDER BY seq, part").fetchall()
        out: dict[int, list[bytes]] = {}
        for seq, body in rows:
            out.setdefault(int(seq), []).append(bytes(body))
        return out

    def seal_staged(self, seq: int, body: bytes, created_s: float) -> None:
        """Queue batch ``seq`` (``body``: all its parts in one batch), keep the checkpoint of its last part
        that has one, and drop its parts, in one transaction (``seal`` with the body already built)."""
        self.seal(seq, lambda _seq: body, created_s)

    def seal(
        self, seq: int | None, body: Callable[[int], bytes], created_s: float, checkpoint: str | None = None
    ) -> int:
        """Queue a batch in one transaction: under ``seq`` (its parts' seq; None: the next seq, reserved
        here), ``body(seq)`` as its body (its staged parts and what came since, in one batch); the
        ``checkpoint`` as of it (None: its last staged part's) is kept and its parts dropped. Returns the
        seq. A stage and then ``seal_staged`` write the same in two transactions."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if seq is None:
                    row = self._db.execute("SELECT value FROM meta WHERE key = 'next_seq'").fetchone()
                    seq = int(row[0]) if row else 0
                    self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('next_seq', ?)", (str(seq + 1),))
                data = body(seq)
                self._db.execute("INSERT INTO batches (seq, body, created_s) VALUES (?, ?, ?)", (seq, data, created_s))
                if checkpoint is not None:
                    self._db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('checkpoint', ?)", (checkpoint,))
                else:
                    self._db.execute(
                        "INSERT OR REPLACE INTO meta (key, value) SELECT 'checkpoint', checkpoint FROM staged "
                        "WHERE seq = ? AND checkpoint IS NOT NULL ORDER BY part DESC LIMIT 1",
                        (seq,),
                    )
                self._db.execute("DELETE FROM staged WHERE seq = ?", (seq,))
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return seq

    def checkpoint(self) -> str | None:
        """The checkpoint stored with the latest batch or staged part (None before the first)."""
        with self._lock:
            row = self._db.execute(
                "SELECT checkpoint FROM staged WHERE checkpoint IS NOT NULL ORDER BY seq DESC, part DESC LIMIT 1"
            ).fetchone()
        return str(row[0]) if row is not None else self.meta("checkpoint")

    def peek(self, limit: int = 16, after: int = -1) -> list[tuple[int, bytes]]:
        """The oldest ``limit`` batches with a seq above ``after``, oldest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT seq, body FROM batches WHERE seq > ? ORDER BY seq LIMIT ?", (after, limit)
            ).fetchall()
        return [(int(seq), bytes(body)) for seq, body in rows]

    def ack(self, seq: int) -> None:
        """The collector stored batch ``seq``: forget it."""
        with self._lock:
            self._db.execute("DELETE FROM batches WHERE seq = ?", (seq,))

    def set_aside(self, seq: int, reason: Mapping[str, Any]) -> bool:
        """The collector refused batch ``seq`` for good: move it, with ``reason`` (a JSON object: why, the
        collector's answer, when), out of the queue into the set-aside table, in one transaction, so it is
        never lost and never retried until ``requeue``. False when ``seq`` is not queued."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                row = self._db.execute("SELECT created_s FROM batches WHERE seq = ?", (seq,)).fetchone()
                if row is not None:
                    record = json.dumps({**reason, "created_s": float(row[0])}, sort_keys=True)
                    self._db.execute(
                        "INSERT OR REPLACE INTO dead (seq, body, reason) SELECT seq, body, ? FROM batches "
                        "WHERE seq = ?",
                        (record, seq),
                    )
                    self._db.execute("DELETE FROM batches WHERE seq = ?", (seq,))
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return row is not None

    def set_aside_batches(self, limit: int | None = None) -> list[SetAside]:
        """Set-aside batches, the latest set aside first (``limit``: at most that many)."""
        with self._lock:
            rows = self._db.execute("SELECT seq, reason, length(body) FROM dead").fetchall()
        found = [SetAside(int(seq), _reason(text), int(size)) for seq, text, size in rows]
        found.sort(key=lambda b: (b.at_s, b.seq), reverse=True)
        return found if limit is None else found[:limit]

    def set_aside_body(self, seq: int) -> bytes | None:
        """The body (the batch's JSON) of set-aside batch ``seq``; None when there is none."""
        with self._lock:
            row = self._db.execute("SELECT body FROM dead WHERE seq = ?", (seq,)).fetchone()
        return None if row is None else bytes(row[0])

    def requeue(self, seqs: Sequence[int] | None = None) -> list[int]:
        """Move set-aside batches (``seqs``, or all) back into the queue, in one transaction; returns the
        seqs moved. They keep their keys, so a batch the collector did store after all is a duplicate
        it acknowledges, not a second copy."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                rows = self._db.execute("SELECT seq, body, reason FROM dead ORDER BY seq").fetchall()
                wanted = None if seqs is None else set(seqs)
                moved = [(int(seq), body, text) for seq, body, text in rows if wanted is None or int(seq) in wanted]
                for seq, body, text in moved:
                    created_s = _reason(text).get("created_s")
                    self._db.execute(
                        "INSERT OR REPLACE INTO batches (seq, body, created_s) VALUES (?, ?, ?)",
                        (seq, body, float(created_s) if isinstance(created_s, int | float) else 0.0),
                    )
                    self._db.execute("DELETE FROM dead WHERE seq = ?", (seq,))
                self._db.execute("COMMIT")
            except BaseException:
                self._rollback()
                raise
        return [seq for seq, _, _ in moved]

    def pending(self) -> int:
        """How many batches wait to be pushed."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM batches").fetchone()[0])

    def dead(self) -> int:
        """How many batches are set aside (the collector refused them for good)."""
        with self._lock:
            return int(self._db.execute("SELECT count(*) FROM dead").fetchone()[0])

    def close(self) -> None:
        """Close the file; idempotent."""
        with self._lock:
            self._db.close()
