"""The few statements SQLite and PostgreSQL spell differently: upserts, max/min of two values, bulk appends."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import Connection, Table, bindparam, case, cast, func, literal, select
from sqlalchemy.sql.elements import ColumnElement

from wattwatch.errors import StorageError


def upsert(conn: Connection, table: Table) -> Any:
    """``INSERT ... ON CONFLICT`` for ``conn``'s backend (both offer ``on_conflict_do_update/nothing``)."""
    # Each backend's dialect package is imported when a statement for it is built (the engine has loaded it
    # already): importing both at start cost every command 45 ms, PostgreSQL's drivers included.
    name = conn.dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert(table)
    if name == "sqlite":
        from sqlalchemy.dialects import sqlite

        return sqlite.insert(table)
    raise StorageError(f"wattwatch stores into SQLite or PostgreSQL, not {name}; use a sqlite:// or postgresql:// URL")


def upsert_rows(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> tuple[Any, Any]:
    """An ``upsert`` of ``rows`` (dicts with the same keys), and the parameters to execute it with.

    Like ``upsert`` it takes ``on_conflict_do_update/nothing`` and ``returning``. On PostgreSQL the rows
    travel as one array per column, unnested by the server: one statement and one round trip for any
    number of rows, where psycopg's executemany sends, binds and answers each row (under load that
    cost more than the rows' own work). SQLite gets the rows for an executemany, which runs in-process.
    """
    if conn.dialect.name != "postgresql":
        return upsert(conn, table), list(rows)
    from sqlalchemy.dialects import postgresql

    names = list(rows[0])
    arrays = (func.unnest(cast(bindparam(f"u_{n}"), postgresql.ARRAY(table.c[n].type))) for n in names)
    stmt = postgresql.insert(table).from_select(names, select(*arrays))
    return stmt, {f"u_{n}": [r[n] for r in rows] for n in names}


def greatest(conn: Connection, a: Any, b: Any) -> ColumnElement[Any]:
    """The larger of two non-NULL values (SQLite's two-argument ``max``, PostgreSQL's ``greatest``)."""
    return func.greatest(a, b) if conn.dialect.name == "postgresql" else func.max(a, b)


def least(conn: Connection, a: Any, b: Any) -> ColumnElement[Any]:
    """The smaller of two non-NULL values."""
    return func.least(a, b) if conn.dialect.name == "postgresql" else func.min(a, b)


def append_token(existing: Any, token: Any) -> ColumnElement[Any]:
    """``existing`` (a comma list) with ``token`` added unless it is already there.

    Done in SQL, inside the upsert, so two collectors adding sources to one row cannot lose either.
    Tokens are source names (no commas, no LIKE wildcards).
    """
    return case(
        (existing == "", token),
        ((literal(",") + existing + literal(",")).contains(literal(",") + token + literal(",")), existing),
        else_=existing + literal(",") + token,
    )


def append_rows(conn: Connection, table: Table, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Append ``rows`` (tuples in ``columns`` order) to ``table`` within ``conn``'s transaction.

    COPY on PostgreSQL (about twice executemany's speed, and it is the path high-rate data takes),
    executemany of plain tuples on SQLite.
    """
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        # The driver connection is the one SQLAlchemy's transaction runs on, so COPY commits with it.
        names = ", ".join(f'"{c}"' for c in columns)
        with (
            conn.connection.driver_connection.cursor() as cursor,  # type: ignore[union-attr]
            cursor.copy(f"COPY {table.name} ({names}) FROM STDIN") as copy,
        ):
            for row in rows:
                copy.write_row(row)
        return
    # One INSERT handed to sqlite3's executemany with the tuples as they are: no per-row dicts and no
    # SQLAlchemy parameter processing, which cost more than SQLite's own insert.
    names = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join("?" * len(columns))
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({names}) VALUES ({marks})", [tuple(r) for r in rows])
