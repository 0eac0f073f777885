"""What a collector's writer threads remember between groups: each host's device ids, agent bindings,
host ids and the jobs known to have a row, so a group whose batches change none of them skips those
statements. Only what a committed transaction wrote enters it.
"""

from __future__ import annotations

import threading
from typing import Any

DeviceRows = tuple[tuple[Any, ...], ...]


class DeviceCache:
    """Device ids per host as last committed, with the descriptions they were stored with; and the ids of
    jobs known to have a row.

    An agent sends its devices in every batch; they change about never. A host whose batch describes its
    devices exactly as cached needs no devices upsert (a statement and ten row versions per batch).
    Likewise every interval names its jobs, and a job named for the first time gets a placeholder row: a
    job whose row is known to exist needs none (a statement per group, rows per job). Only committed ids
    enter the cache (``commit``), so a rolled-back group leaves nothing behind; nothing deletes devices or
    jobs, so a cached id stays valid.
    """

    # Job ids remembered at most; past it the set starts over (a few more placeholder upserts, no harm).
    MAX_JOBS = 100_000

    def __init__(self) -> None:
        self._hosts: dict[int, tuple[DeviceRows, dict[str, int]]] = {}
        self.jobs: set[str] = set()
        # Agent id -> the host it is bound to: a binding is written once and never changed nor deleted, so
        # a committed one is valid for good (saves a SELECT per group).
        self.owners: dict[str, str] = {}
        # Host name -> id: a host row is never deleted nor renamed (saves SQLite a SELECT per group).
        self.host_ids: dict[str, int] = {}
        # What each writer thread's running transaction wrote: one cache serves every writer thread, so a
        # host's devices are upserted once per collector process, not once per thread.
        self._local = threading.local()
        self._lock = threading.Lock()

    @property
    def _staged(self) -> dict[int, tuple[DeviceRows, dict[str, int]]]:
        staged: dict[int, tuple[DeviceRows, dict[str, int]]] | None = getattr(self._local, "staged", None)
        if staged is None:
            staged = self._local.staged = {}
        return staged

    @property
    def _staged_jobs(self) -> set[str]:
        staged: set[str] | None = getattr(self._local, "jobs", None)
        if staged is None:
            staged = self._local.jobs = set()
        return staged

    @property
    def _staged_owners(self) -> dict[str, str]:
        staged: dict[str, str] | None = getattr(self._local, "owners", None)
        if staged is None:
            staged = self._local.owners = {}
        return staged

    @property
    def _staged_host_ids(self) -> dict[str, int]:
        staged: dict[str, int] | None = getattr(self._local, "host_ids", None)
        if staged is None:
            staged = self._local.host_ids = {}
        return staged

    def stage_host_ids(self, host_ids: dict[str, int]) -> None:
        """Remember host ids the running transaction read, for ``commit``."""
        self._staged_host_ids.update(host_ids)

    def stage_owners(self, owners: dict[str, str]) -> None:
        """Remember agent bindings the running transaction read or wrote, for ``commit``."""
        self._staged_owners.update(owners)

    def stage_jobs(self, job_ids: set[str]) -> None:
        """Remember job ids the running transaction gave a row, for ``commit``."""
        self._staged_jobs.update(job_ids)

    def get(self, host_id: int, described: DeviceRows) -> dict[str, int] | None:
        """The host's device ids when ``described`` is what was stored, else None."""
        with self._lock:
            found = self._hosts.get(host_id)
        return found[1] if found is not None and found[0] == described else None

    def stage(self, host_id: int, described: DeviceRows, ids: dict[str, int]) -> None:
        """Remember ids written by the running transaction, for ``commit``."""
        self._staged[host_id] = (described, ids)

    def commit(self) -> None:
        """The calling thread's transaction committed: its staged ids are valid."""
        with self._lock:
            self._hosts.update(self._staged)
            if len(self.jobs) + len(self._staged_jobs) > self.MAX_JOBS:
                self.jobs = set()
            # In place: other threads only test membership, which the GIL keeps whole.
            self.jobs |= self._staged_jobs
            if len(self.owners) + len(self._staged_owners) > self.MAX_JOBS:
                self.owners = {}
            self.owners.update(self._staged_owners)
            if len(self.host_ids) + len(self._staged_host_ids) > self.MAX_JOBS:
                self.host_ids = {}
            self.host_ids.update(self._staged_host_ids)
        self.rollback()

    def rollback(self) -> None:
        """The calling thread's transaction rolled back: forget what it staged."""
        self._local.staged = {}
        self._local.jobs = set()
        self._local.owners = {}
        self._local.host_ids = {}
