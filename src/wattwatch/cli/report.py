"""``wattwatch report``: fetch a report from a database or a collector, by the same rules either way.

A job reference (``--job``) is a full id, a unique id prefix or a job name (``storage.job_refs``); the
collector's ``GET /api/v1/report?job=`` resolves it with the same code, so both sources agree.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from wattwatch.cli import options
from wattwatch.cli.errors import RuntimeFailure, UsageError
from wattwatch.config import Settings


def run(args: argparse.Namespace, settings: Settings) -> int:
    """``wattwatch report``: print the report in ``--format``, one page (``--limit``, ``--cursor``), in
    ``--sort`` order, per ``--group-by`` group if given, with totals; to ``--output`` if given.

    With none of ``--since``, ``--until`` and ``--job`` it covers the last 7 days, like the collector's
    API, and says so (``window`` in JSON; a line under the table)."""
    import sys

    from wattwatch.reporting import group as report_group
    from wattwatch.reporting.options import emit, table_style
    from wattwatch.reporting.render import render, window_note

    check_view(args)
    width, color = table_style(args)
    report = fetch(args, settings)
    report_group.shape(report, group_by=args.group_by, sort=args.sort)
    emit(render(report, args.format, width=width, color=color), args, what=f"the report ({args.format})")
    if args.format in ("csv", "json"):
        # Machine formats stay parseable on stdout (JSON holds window and next_cursor); people read stderr.
        note = window_note(report)
        if note:
            sys.stderr.write(note + "\n")
    return 0


def fetch(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """The report the filters of ``args`` select (``--job``, ``--kind``, ``--since`` ...), from ``--server``
    or the database; a usage error when ``--job`` alone names no job."""
    import re

    from wattwatch.protocol.limits import CURSOR_PATTERN, REPORT_DEFAULT_SINCE, REPORT_MAX_LIMIT
    from wattwatch.protocol.units import iso_utc
    from wattwatch.reporting.options import page_limit

    limit = page_limit(args)
    if not 1 <= limit <= REPORT_MAX_LIMIT:
        raise UsageError(f"--limit {limit} is out of range; use 1 to {REPORT_MAX_LIMIT}")
    if args.cursor is not None and not re.fullmatch(CURSOR_PATTERN, args.cursor):
        raise UsageError(BAD_CURSOR)
    now_s = time.time()
    default = not args.since and not args.until and not args.job
    since = REPORT_DEFAULT_SINCE if default else args.since
    since_s = _when(since, "--since", now_s)
    if since_s is not None:
        since_s = max(since_s, 0.0)
    until_s = _when(args.until, "--until", now_s)
    if since_s is not None and until_s is not None and since_s >= until_s:
        raise UsageError(f"--since {args.since} is not before --until {args.until}; swap them or widen the window")
    labels = parse_labels(args.label)
    server = args.server or ("" if args.db else settings.report_server)
    if server and not server.lower().startswith(("http://", "https://")):
        raise UsageError(f"--server / WATTWATCH_SERVER {server!r} is not a URL; use e.g. http://collector:8470")
    if server:
        params: dict[str, Any] = {
            k: v
            for k, v in (
                ("job", args.job),
                ("kind", args.kind),
                ("since", args.since),
                ("until", args.until),
                ("host", args.host),
                ("name", args.name),
                ("cursor", args.cursor),
            )
            if v
        }
        params["limit"] = limit
        if args.label:
            params["label"] = list(args.label)
        report = get_json(server, "/api/v1/report", settings, params=params)
    else:
        url = args.db or settings.resolved_db_url
        report = local_report(
            url,
            settings,
            job_ref=args.job,
            since_s=since_s,
            until_s=until_s,
            kind=args.kind,
            host=args.host,
            name=args.name,
            labels=labels,
            limit=limit,
            cursor=args.cursor,
        )
        report["window"] = {"since": since, "since_s": since_s, "since_at": iso_utc(since_s), "default": default}
    if args.job and not report["jobs"] and _only_job(args):
        raise UsageError(
            f"no job {args.job!r} (an id, id prefix or name) in this database; list jobs with `wattwatch jobs`"
        )
    return report


def check_view(args: argparse.Namespace) -> None:
    """Usage errors in ``--group-by`` and ``--width``, before anything is read."""
    from wattwatch.reporting.group import parse_group_by

    if getattr(args, "group_by", None):
        try:
            parse_group_by(args.group_by)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    if getattr(args, "width", None) is not None and args.width < 0:
        raise UsageError(f"--width {args.width} is negative; give a number of columns, or 0 for no limit")


BAD_CURSOR = "--cursor is not one a report printed; copy it from the line `more jobs: --cursor ...`"


def _only_job(args: argparse.Namespace) -> bool:
    """Whether --job is the only filter (then finding nothing means the reference is wrong)."""
    return not any((args.kind, args.since, args.until, args.host, args.name, args.label))


def _when(text: str | None, flag: str, now_s: float) -> float | None:
    from wattwatch.protocol.units import parse_time_s

    if text is None:
        return None
    try:
        return parse_time_s(text, now_s)
    except ValueError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def parse_labels(items: list[str]) -> dict[str, str | None]:
    """``--label K=V`` / ``--label K`` items as a dict (None: any value)."""
    out: dict[str, str | None] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not key:
            raise UsageError(f"--label {item!r} has no key; use K=V (e.g. team=nlp) or K")
        out[key] = value if sep else None
    return out


def local_report(url: str, settings: Settings, *, job_ref: str | None = None, **filters: Any) -> dict[str, Any]:
    """The report read straight from the database at ``url``; ``job_ref`` resolved as ``job_refs`` says."""
    from wattwatch.carbon import policy as carbon_policy
    from wattwatch.storage.engine import check_ready
    from wattwatch.storage.job_refs import AmbiguousJob
    from wattwatch.storage.reads import BadCursor, build_report, resolve_job

    policy = carbon_policy.from_settings(settings)  # a bad region or PUE is named before the database is opened
    engine = check_ready(url)
    try:
        job_id = None
        if job_ref:
            try:
                job_id = resolve_job(engine, job_ref)
            except AmbiguousJob as exc:
                raise UsageError(str(exc)) from None
            if job_id is None:
                return {"jobs": [], "idle": [], "filters": {"job": job_ref}, "jobs_recorded": True}
        try:
            return build_report(engine, job_id=job_id, carbon=policy, **filters)
        except BadCursor:
            raise UsageError(BAD_CURSOR) from None
    finally:
        engine.dispose()


def get_json(
    server: str, path: str, settings: Settings, *, params: dict[str, Any] | None = None, missing_ok: bool = False
) -> dict[str, Any]:
    """GET ``path`` of the collector at ``server`` as JSON. A 4xx is a UsageError naming the collector's
    reason (404 with ``missing_ok``: an empty dict); no answer or a 5xx is a RuntimeFailure."""
    # wattwatch.client (and with it httpx) is imported only by the commands that read from a collector.
    import json
    import urllib.parse

    from wattwatch import client
    from wattwatch.tls import client_verify, untrusted_certificate, untrusted_message

    url = server.rstrip("/") + path
    if params:
        url += "?" + urllib.parse.urlencode(params, doseq=True)
    verify = client_verify(settings.ca_file) if url.lower().startswith("https:") else True
    try:
        reply = client.get(url, token=settings.token, timeout_s=30.0, verify=verify)
    except client.RedirectRefused as exc:
        raise UsageError(f"collector at {server}: {exc} (the token is not sent to another origin)") from None
    except client.ClientError as exc:
        reason = untrusted_certificate(exc)
        if reason:
            raise UsageError(untrusted_message(server, reason)) from None
        raise RuntimeFailure(f"collector at {server} unreachable ({exc}); check --server and that it runs") from None
    status, body = reply.status, reply.body
    if status == 404 and missing_ok:
        return {}
    text = body.decode("utf-8", errors="replace")
    if status != 200:
        try:
            message = str(json.loads(text).get("error") or text)
        except (ValueError, AttributeError):
            message = text
        message = " ".join(message.split())[:300]
        what = f"collector at {server} answered HTTP {status}: {message}"
        if status in (401, 403):
            raise UsageError(f"{what}; give a reader token (--token-file or WATTWATCH_TOKEN)")
        if status < 500:
            raise UsageError(what)
        raise RuntimeFailure(what)
    try:
        result: dict[str, Any] = json.loads(text)
    except ValueError:
        raise RuntimeFailure(f"collector at {server} answered {path} with something other than JSON") from None
    return result


EPILOG = """examples:
  wattwatch report --since 7d
  wattwatch report --since 2026-11-30 --until 2026-12-01 --name 'llama-*' --label team=nlp
  wattwatch report --job 3f2a9c1e         an id prefix as the table shows it, or a job name
  wattwatch report --since 7d --group-by label:team --sort energy --format markdown --output week.md
  wattwatch report --server http://collector:8470 --kind inference --format json
  WATTWATCH_TOKEN_FILE=reader.token wattwatch report --server https://collector:8470 --ca-file ca.pem"""


def add_parser(sub: Any) -> None:
    """Add ``report`` to the command parsers ``sub``."""
    from wattwatch.reporting import options as report_options

    rep = options.add_command(sub, "report", help="per-job energy summaries", epilog=EPILOG)
    report_options.add_source(rep)
    rep.add_argument("--job", metavar="REF", help="only this job: its id, a unique prefix of it, or its name")
    report_options.add_filters(rep)
    report_options.add_view(rep)
    options.add_reader_auth(rep)
