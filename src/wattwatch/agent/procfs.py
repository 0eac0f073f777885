"""Reads what the agent needs about a process from ``/proc``: environment, cgroups, command line, parent,
start time and CPU time.

The root is a constructor parameter (``ProcFs(Path("/host/proc"))`` in a container that mounts the host's
``/proc``; a fixture tree in tests). Nothing here scans every process on a tick: callers ask about the pids
NVML lists on GPUs and about known job pids; children come from ``/proc/PID/task/TID/children``, and only
kernels without that file fall back to one full scan, at most every ``scan_interval_s``.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

# /proc/PID/stat fields after the command, counted from 3 (state) as in proc(5).
_PPID, _UTIME, _STIME, _CUTIME, _CSTIME, _STARTTIME = 4, 14, 15, 16, 17, 22


@dataclass(frozen=True)
class ProcStat:
    """The parts of ``/proc/PID/stat`` the agent uses. CPU times in seconds; ``start_ticks`` identifies
    the process together with its pid (pids are reused, start times are not)."""

    pid: int
    ppid: int
    start_ticks: int
    cpu_s: float  # user + system of the process itself
    children_cpu_s: float  # user + system of its reaped children


class ProcFs:
    """One ``/proc`` tree. Every read returns None (or empty) when the process is gone or unreadable."""

    def __init__(
        self,
        root: Path = Path("/proc"),
        *,
        clock_ticks_per_s: int | None = None,
        scan_interval_s: float = 10.0,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self._hz = clock_ticks_per_s or _clock_ticks()
        self._scan_interval_s = scan_interval_s
        self._monotonic = monotonic
        self._ppid_map: dict[int, list[int]] = {}
        self._ppid_map_at = -float("inf")

    def exists(self, pid: int) -> bool:
        """Whether ``/proc/PID`` is there."""
        return (self.root / str(pid)).is_dir()

    def stat(self, pid: int) -> ProcStat | None:
        """Parsed ``/proc/PID/stat``."""
        raw = self._read(pid, "stat")
        if raw is None:
            return None
        text = raw.decode(errors="replace")
        # The command (field 2) is in parentheses and may itself contain spaces and parentheses.
        close = text.rfind(")")
        if close < 0:
            return None
        rest = text[close + 2 :].split()
        try:

            def field(n: int) -> int:
                return int(rest[n - 3])

            return ProcStat(
                pid=pid,
                ppid=field(_PPID),
                start_ticks=field(_STARTTIME),
                cpu_s=(field(_UTIME) + field(_STIME)) / self._hz,
                children_cpu_s=(field(_CUTIME) + field(_CSTIME)) / self._hz,
            )
        except (IndexError, ValueError):
            return None

    def environ(self, pid: int) -> dict[str, str] | None:
        """``/proc/PID/environ`` as a dict; None when gone or not readable (another user's process)."""
        raw = self._read(pid, "environ")
        if raw is None:
            return None
        env: dict[str, str] = {}
        for item in raw.split(b"\0"):
            key, sep, value = item.partition(b"=")
            if sep and key:
                env[key.decode(errors="replace")] = value.decode(errors="replace")
        return env

    def cmdline(self, pid: int) -> list[str]:
        """``/proc/PID/cmdline`` split into arguments (empty for kernel threads and gone processes)."""
        raw = self._read(pid, "cmdline")
        if not raw:
            return []
        return [a.decode(errors="replace") for a in raw.rstrip(b"\0").split(b"\0")]

    def cgroups(self, pid: int) -> list[str]:
        """The cgroup paths of ``/proc/PID/cgroup`` (v1 has one line per hierarchy, v2 one ``0::`` line)."""
        raw = self._read(pid, "cgroup")
        if raw is None:
            return []
        paths: list[str] = []
        for line in raw.decode(errors="replace").splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and parts[2] not in paths:
                paths.append(parts[2])
        return paths

    def lineage(self, pid: int, max_depth: int = 16) -> list[int]:
        """``pid`` and its ancestors, nearest first, stopping before pid 1 (init adopts orphans)."""
        chain: list[int] = []
        current = pid
        while current > 1 and len(chain) < max_depth and current not in chain:
            st = self.stat(current)
            if st is None:
                break
            chain.append(current)
            current = st.ppid
        return chain

    def children(self, pid: int) -> list[int]:
        """Direct children of ``pid``, from every thread's ``children`` file (CONFIG_PROC_CHILDREN)."""
        task_dir = self.root / str(pid) / "task"
        try:
            tids = [t.name for t in task_dir.iterdir()]
        except OSError:
            return []
        out: list[int] = []
        have_file = False
        for tid in tids:
            try:
                text = (task_dir / tid / "children").read_text()
            except FileNotFoundError:
                continue
            except OSError:
                continue
            have_file = True
            out.extend(int(c) for c in text.split() if c.isdigit())
        if not have_file and tids:
            return list(self._children_by_scan().get(pid, []))
        return out

    def descendants(self, pids: Iterable[int]) -> set[int]:
        """The given pids (those still alive) and all their descendants."""
        seen: set[int] = set()
        stack = [p for p in pids if self.exists(p)]
        while stack:
            pid = stack.pop()
            if pid in seen:
                continue
            seen.add(pid)
            stack.extend(c for c in self.children(pid) if c not in seen)
        return seen

    def _children_by_scan(self) -> dict[int, list[int]]:
        # Kernels without /proc/PID/task/TID/children: one scan of every pid, reused for a while.
        now = self._monotonic()
        if now - self._ppid_map_at >= self._scan_interval_s:
            mapping: dict[int, list[int]] = {}
            with contextlib.suppress(OSError):
                for entry in self.root.iterdir():
                    if entry.name.isdigit():
                        st = self.stat(int(entry.name))
                        if st is not None:
                            mapping.setdefault(st.ppid, []).append(st.pid)
            self._ppid_map, self._ppid_map_at = mapping, now
        return self._ppid_map

    def _read(self, pid: int, name: str) -> bytes | None:
        try:
            return (self.root / str(pid) / name).read_bytes()
        except OSError:  # gone (ENOENT/ESRCH) or not ours to read (EACCES)
            return None


def _clock_ticks() -> int:
    try:
        return int(os.sysconf("SC_CLK_TCK"))
    except (ValueError, OSError, AttributeError):
        return 100


def listening_socket_inodes(root: Path, port: int) -> set[int]:
    """Inodes of TCP sockets listening on ``port`` (IPv4 and IPv6), from ``ROOT/net/tcp{,6}``.

    ``/proc/net`` shows the reader's network namespace: the agent sees a server's socket when both share
    it (``hostNetwork`` on Kubernetes, the host otherwise).
    """
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (root / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; the inode is column 10.
            if len(cols) < 10 or cols[3] != "0A":
                continue
            try:
                if int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(cols[9]))
            except (IndexError, ValueError):
                continue
    return inodes


def socket_inodes(root: Path, pid: int) -> set[int]:
    """Inodes of the sockets process ``pid`` holds open (from its ``fd`` links; needs the same user or root)."""
    out: set[int] = set()
    fd_dir = root / str(pid) / "fd"
    try:
        fds = list(fd_dir.iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            with contextlib.suppress(ValueError):
                out.add(int(target[8:-1]))
    return out
