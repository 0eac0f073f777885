"""Jobs from the SDK: ``job()`` measures a block as a job, ``start_job()`` returns a handle to end later.

The job a span belongs to is the context's (``current_job``); a thread that did not open it (a server's
worker thread) falls back to the newest job open in the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
import warnings
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field

from wattwatch.protocol import limits
from wattwatch.sdk.client import AgentClient, shared_client
from wattwatch.sdk.notices import refuse, warn_once

current_job: ContextVar[str | None] = ContextVar("wattwatch_job", default=None)
# Jobs open in this process, newest last. New threads start with an empty context, so a request
# handled on a server's worker thread would not see the job() its main thread opened; it falls back
# to the newest job open in the process.
_open_jobs: list[str] = []
_open_jobs_lock = threading.Lock()


@dataclass
class JobHandle:
    """A started job (``start_job``); ``end()`` it once. ``started`` is False when no agent took it."""

    id: str
    client: AgentClient
    started: bool
    ended: bool = field(default=False)

    def end(self) -> None:
        """Send the job's buffered spans, then end it at the agent; never raises."""
        if self.ended:
            return
        self.ended = True
        try:
            if self.client._spans is not None:
                self.client._spans.flush(timeout_s=1.0)
            if self.started:
                self.client.request({"op": "job_end", "id": self.id})
        except (OSError, ValueError):
            pass


def start_job(
    name: str,
    kind: str = "training",
    *,
    labels: Mapping[str, str] | None = None,
    job_id: str | None = None,
    client: AgentClient | None = None,
    via: str = "sdk",
) -> JobHandle:
    """Start a job at the agent and return its handle (for code whose start and end are in different
    callbacks; otherwise use ``job()``). Never raises: without an agent the handle is inert."""
    client = client or shared_client()
    jid = job_id or os.environ.get("WATTWATCH_JOB") or uuid.uuid4().hex
    started = False
    fitted, dropped = limits.fit_labels(labels or {})
    for exc in dropped:
        refuse("a job label was", exc)
    try:
        reply = client.request(
            {
                "op": "job_start",
                "id": jid,
                "name": name,
                "kind": kind,
                "labels": fitted,
                "pid": os.getpid(),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "via": via,
            }
        )
        if reply.get("ok"):
            started = True
            if reply.get("warning"):
                warnings.warn(f"wattwatch: {reply['warning']}", RuntimeWarning, stacklevel=3)
        else:
            warnings.warn(f"wattwatch: agent refused the job: {reply.get('error')}", RuntimeWarning, stacklevel=3)
    except (OSError, ValueError) as exc:
        warn_once(f"no agent reachable at {client.path} ({exc}); start one with `wattwatch up`")
    return JobHandle(jid, client, started)


@contextlib.contextmanager
def job(
    name: str,
    kind: str = "training",
    *,
    labels: Mapping[str, str] | None = None,
    job_id: str | None = None,
    client: AgentClient | None = None,
) -> Iterator[str]:
    """Measure the enclosed block as a job; yields the job id.

    The id is ``job_id``, else ``$WATTWATCH_JOB`` (so every host of one training run reports under the
    same id), else a new one. Devices come from ``CUDA_VISIBLE_DEVICES`` or, if unset, from the GPUs
    where NVML lists this process. Example::

        with wattwatch.job("llama-ft", kind="training", labels={"team": "nlp"}):
            trainer.train()
    """
    handle = start_job(name, kind, labels=labels, job_id=job_id, client=client)
    token = current_job.set(handle.id)
    with _open_jobs_lock:
        _open_jobs.append(handle.id)
    try:
        yield handle.id
    finally:
        current_job.reset(token)
        with _open_jobs_lock:
            _open_jobs.remove(handle.id)
        handle.end()


def newest_open_job() -> str | None:
    """The job this process opened last and has not ended (None: none)."""
    with _open_jobs_lock:
        return _open_jobs[-1] if _open_jobs else None
