"""Ends the running jobs no host has reported on for too long: their agent died and did not come back.

A job is ended when every host it ran on (``job_hosts``) was last seen (``hosts.last_seen_s``, the
collector's receive time) before ``now - silent_after_s``; it ends at the last instant any of them
measured it (``job_hosts.last_s``), with ``ended_by`` ``collector-silent-agent``. That end is
provisional: an end the agent sends later replaces it, and a restarted agent that re-adopted the job
opens it again (``job_writes.reopen_jobs``). Safe to run on several collector replicas at once: a job is
only ended while it is still open.
"""

from __future__ import annotations

import math

from sqlalchemy import Engine, func, select, update

from wattwatch.storage.engine import WRITE_TX
from wattwatch.storage.job_writes import ENDED_BY_SILENT_AGENT
from wattwatch.storage.tables import hosts, job_hosts, jobs


def end_jobs_of_silent_hosts(engine: Engine, *, now_s: float, silent_after_s: float) -> list[str]:
    """End the running jobs whose hosts all went silent ``silent_after_s`` before ``now_s``; returns their ids."""
    cutoff_s = now_s - silent_after_s
    ended: list[str] = []
    with engine.connect().execution_options(**{WRITE_TX: True}) as conn, conn.begin():
        rows = conn.execute(
            select(jobs.c.id, jobs.c.started_at_s, func.max(job_hosts.c.last_s))
            .select_from(
                jobs.join(job_hosts, job_hosts.c.job_id == jobs.c.id).join(hosts, hosts.c.id == job_hosts.c.host_id)
            )
            .where(jobs.c.ended_at_s.is_(None))
            .group_by(jobs.c.id, jobs.c.started_at_s)
            .having(func.max(hosts.c.last_seen_s) < cutoff_s)
            .order_by(jobs.c.id)  # one lock order for every writer
        ).all()
        for job_id, started_at_s, last_s in rows:
            end_s = max(float(last_s), started_at_s) if last_s is not None and math.isfinite(last_s) else started_at_s
            done = conn.execute(
                update(jobs)
                .where(jobs.c.id == job_id, jobs.c.ended_at_s.is_(None))
                .values(ended_at_s=end_s, ended_by=ENDED_BY_SILENT_AGENT)
                .returning(jobs.c.id)
            )
            if done.first() is not None:
                ended.append(str(job_id))
    return ended
