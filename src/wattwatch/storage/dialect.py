"""The few statements SQLite and PostgreSQL spell differently: upserts, max/min of two values, bulk appends."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    JSON,
    Boolean,
    Connection,
    Float,
    Integer,
    LargeBinary,
    String,
    Table,
    bindparam,
    case,
    cast,
    func,
    literal,
    select,
)
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
    return _base_upsert(conn, table, tuple(rows[0])), upsert_params(conn, table, rows)


def _base_upsert(conn: Connection, table: Table, names: tuple[str, ...]) -> Any:
    if conn.dialect.name != "postgresql":
        return upsert(conn, table)
    from sqlalchemy.dialects import postgresql

    arrays = (func.unnest(cast(bindparam(f"u_{n}"), postgresql.ARRAY(table.c[n].type))) for n in names)
    return postgresql.insert(table).from_select(list(names), select(*arrays))


def upsert_params(conn: Connection, table: Table, rows: Sequence[Mapping[str, Any]]) -> Any:
    """The parameters of an ``upsert_rows`` statement for ``rows``: an array per column (PostgreSQL), or
    the rows for an executemany (SQLite)."""
    if conn.dialect.name != "postgresql":
        return list(rows)
    return {f"u_{n}": pg_array([r[n] for r in rows], table.c[n].type) for n in rows[0]}


_FINISHED: dict[tuple[str, str, tuple[str, ...]], Any] = {}


def cached_upsert(
    conn: Connection, key: str, table: Table, rows: Sequence[Mapping[str, Any]], finish: Callable[[Any], Any]
) -> tuple[Any, Any]:
    """``upsert_rows`` whose statement, finished by ``finish(base)`` (its ON CONFLICT, RETURNING), is built
    once per backend, ``key`` and columns and then reused: building one (``excluded``, the column
    collections) and computing its cache key cost more CPU per group than the rows. ``key`` names the
    call site; one key must always be finished the same way."""
    names = tuple(rows[0])
    k = (conn.dialect.name, key, names)
    stmt = _FINISHED.get(k)
    if stmt is None:
        stmt = _FINISHED[k] = finish(_base_upsert(conn, table, names))
    return stmt, upsert_params(conn, table, rows)


# SQLite: a cached statement's SQL text and, per positional parameter, its key in a row (or None and its
# fixed value) and its type's bind processor.
_Plan = tuple[Any, str, tuple[tuple[str | None, Any, Any], ...]]
_SQLITE_MANY: dict[int, _Plan | None] = {}


def execute_rows(conn: Connection, stmt: Any, params: Any) -> None:
    """Execute a ``cached_upsert`` statement (no RETURNING) with its parameters.

    On SQLite the statement is compiled once and its rows go to sqlite3's executemany as tuples, through
    ``exec_driver_sql`` (errors wrapped as any statement's), each value through its type's bind processor
    as SQLAlchemy would: its executemany built every row's tuple through several layers of Python, which
    cost more than SQLite's own upsert. PostgreSQL's (one row of arrays) runs as usual.
    """
    if conn.dialect.name != "sqlite" or not isinstance(params, list) or not params:
        conn.execute(stmt, params)
        return
    plan = _SQLITE_MANY.get(id(stmt))
    if plan is None or plan[0] is not stmt:  # (a statement of the same id that was freed and replaced)
        plan = _SQLITE_MANY[id(stmt)] = _sqlite_plan(conn, stmt)
    # A column the rows leave out gets its default from SQLAlchemy: such statements run as usual.
    if plan is None or not all(key is None or key in params[0] for key, _, _ in plan[2]):
        conn.execute(stmt, params)
        return
    _, sql, binds = plan
    rows = [
        tuple(
            fixed if key is None else (row[key] if process is None else process(row[key]))
            for key, fixed, process in binds
        )
        for row in params
    ]
    conn.exec_driver_sql(sql, rows)


def _sqlite_plan(conn: Connection, stmt: Any) -> _Plan | None:
    """The statement, its SQL text and its positional parameters, or None when it is not one positional
    statement without RETURNING or expanding parameters (it then runs as usual)."""
    compiled = stmt.compile(dialect=conn.dialect)
    names = compiled.positiontup
    if names is None or compiled.effective_returning:
        return None
    binds = []
    for name in names:
        bind = compiled.binds[name]
        if bind.expanding or bind.callable is not None:
            return None
        process = bind.type.bind_processor(conn.dialect)
        # Row values bind by column key (required); literals in the statement (append_token's ",") carry
        # their value.
        if bind.required:
            binds.append((bind.key, None, process))
        else:
            value = bind.effective_value
            binds.append((None, value if process is None else process(value), None))
    return stmt, str(compiled), tuple(binds)


def pg_array(values: list[Any], type_: Any) -> Any:
    """``values`` as a PostgreSQL array literal (``{1.5,2}``, ``{"a","b"}``) for a column of ``type_``, or the
    list itself for a type not handled here (psycopg adapts it).

    psycopg formats a list parameter element by element in Python, which under load cost more than the
    rows' own work in the database (profiled: 15 % of a group's CPU); joining ``repr``s is done in C. The
    statement casts the text to the column's array type, so the server parses it. Floats go through
    ``repr``, which round-trips exactly.
    """
    if isinstance(type_, (Float, Integer, Boolean)):  # Integer covers BigInteger
        if None in values:
            return "{" + ",".join("NULL" if v is None else repr(v) for v in values) + "}"
        return "{" + ",".join(map(repr, values)) + "}"
    if isinstance(type_, LargeBinary) and all(type(v) is bytes for v in values):
        # bytea's hex form, its backslash escaped for the array literal: psycopg dumped a list of bytes
        # element by element in Python.
        return "{" + ",".join(['"\\\\x' + v.hex() + '"' for v in values]) + "}"
    if isinstance(type_, JSON):
        return _quoted([None if v is None else json.dumps(v) for v in values])
    if isinstance(type_, String) and all(v is None or type(v) is str for v in values):
        if None not in values:
            body = '","'.join(values)
            if '"' not in body and "\\" not in body:
                return '{"' + body + '"}' if values else "{}"
        return _quoted(values)
    return values


AMONG_MAX_ARRAY = 1000  # a page's ids (the CLI's default page is 100, the API's 1,000)


def among(conn: Connection, column: Any, values: Any) -> ColumnElement[bool]:
    """``column IN values``: a subquery or a list of strings. On PostgreSQL a list is one array parameter
    (``= ANY(CAST(:p AS VARCHAR[]))``), so the statement's text, and psycopg's parsing of it, is the same
    for every page: an expanded ``IN (:p1, ... :p100)`` was rendered by SQLAlchemy and re-parsed by psycopg
    on each report (seven of them, about a tenth of a 100-job page's time)."""
    if conn.dialect.name != "postgresql" or not isinstance(values, (list, tuple)) or len(values) > AMONG_MAX_ARRAY:
        # A long list stays an IN list: PostgreSQL plans it as a constant it can hash, where an array
        # parameter of 20,000 ids was searched row by row (a report of every job did not finish).
        return column.in_(values)  # type: ignore[no-any-return]
    from sqlalchemy import any_
    from sqlalchemy.dialects.postgresql import ARRAY

    array = cast(bindparam(None, pg_array([str(v) for v in values], String()), type_=String()), ARRAY(String()))
    return column == any_(array)  # type: ignore[no-any-return]


def _quoted(values: list[str | None]) -> str:
    """Strings as array elements, quoted and escaped; None as NULL."""
    return (
        "{"
        + ",".join("NULL" if v is None else '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"' for v in values)
        + "}"
    )


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

    On PostgreSQL one ``INSERT ... SELECT unnest(...)`` with an array per column (``cached_upsert``): one
    round trip, and unlike COPY it may run in a pipeline (``pipelined``) with the group's other writes.
    SQLite gets an executemany of plain tuples.
    """
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        names = tuple(columns)
        k = (conn.dialect.name, f"append:{table.name}", names)
        stmt = _FINISHED.get(k)
        if stmt is None:
            stmt = _FINISHED[k] = _base_upsert(conn, table, names)
        # A column's array straight from the tuples (no dict per row).
        by_column = zip(*rows, strict=True)
        conn.execute(
            stmt, {f"u_{n}": pg_array(list(c), table.c[n].type) for n, c in zip(names, by_column, strict=True)}
        )
        return
    # One INSERT handed to sqlite3's executemany with the tuples as they are: no per-row dicts and no
    # SQLAlchemy parameter processing, which cost more than SQLite's own insert.
    quoted = ", ".join(f'"{c}"' for c in columns)
    marks = ", ".join("?" * len(columns))
    conn.exec_driver_sql(f"INSERT INTO {table.name} ({quoted}) VALUES ({marks})", [tuple(r) for r in rows])


@contextmanager
def pipelined(conn: Connection) -> Iterator[None]:
    """Within the block, PostgreSQL statements are sent without waiting for each answer (psycopg's pipeline
    mode): a group's rollup writes need no result, and each round trip waits for the server process to be
    scheduled, which on a busy host cost more than the statements. No statement in the block may read a
    result (SQLAlchemy would see none: RETURNING, counts); an error raises when the block ends at the
    latest and fails the transaction. SQLite, and a libpq older than 14 (no pipeline mode): nothing changes."""
    if conn.dialect.name != "postgresql" or not _pipeline_supported(conn):
        yield
        return
    from sqlalchemy.exc import DBAPIError

    dbapi_error = conn.dialect.loaded_dbapi.Error
    try:
        with conn.connection.driver_connection.pipeline():  # type: ignore[union-attr]
            yield
    except dbapi_error as exc:
        # An error the server reports when the pipeline syncs comes from psycopg itself, past SQLAlchemy's
        # wrapping: wrapped here, as any statement's error is, the collector still answers 503 and retries a
        # deadlock or serialization failure (both look for SQLAlchemy's DBAPIError).
        raise DBAPIError.instance(None, None, exc, dbapi_error) from exc


def _pipeline_supported(conn: Connection) -> bool:
    """Whether ``conn``'s driver has pipeline mode: psycopg 3 on libpq 14 or later (psycopg[binary] bundles
    one; psycopg on an older system libpq has none, and ``pipeline()`` would fail every group)."""
    if conn.dialect.driver != "psycopg":
        return False
    import psycopg

    return bool(psycopg.Pipeline.is_supported())
