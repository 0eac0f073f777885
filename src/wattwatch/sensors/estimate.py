"""CPU and DRAM energy estimated by rule, for hosts without readable RAPL counters for them.

The CPU rule (an estimate, and every reading says so with ``source="estimate"``)::

    power_w = tdp_w * max(IDLE_FRACTION, utilisation)

with ``utilisation`` the busy fraction of all CPUs since the previous read, and ``IDLE_FRACTION``
(12 %) the floor a package draws even when idle. The TDP comes from codecarbon's CPU table (the CSV
shipped in the installed package, read with ``csv``, without importing codecarbon or pandas) matched to
the model in ``/proc/cpuinfo``, times the number of sockets; failing that, ``DEFAULT_W_PER_CORE``
per physical core. ``tdp_source`` says which.

The DRAM rule, for hosts whose RAPL has no DRAM zone (many AMD parts) or no RAPL at all::

    power_w = DRAM_W_PER_GIB * installed_gib

a constant: DRAM power follows the number and type of DIMMs and the memory traffic, not the bytes in
use, and without a counter neither is visible. 0.125 W/GiB is 4 W per 32 GiB or 8 W per 64 GiB
RDIMM, between the idle and full-bandwidth draw of current DDR4/DDR5 server modules (the old
"3 W per 8 GB" rule overstates a 1 TiB server more than threefold).
"""

from __future__ import annotations

import csv
import importlib.util
import logging
import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from itertools import pairwise
from pathlib import Path

from wattwatch.sensors.base import DeviceInfo, EnergyReading

log = logging.getLogger(__name__)

IDLE_FRACTION = 0.12  # an idle server package draws roughly 10-15 % of its TDP
DRAM_W_PER_GIB = 0.125  # see the module docstring
DEFAULT_W_PER_CORE = 6.0  # current server parts: 64-core EPYC 9554 is 360 W, 5.6 W/core
MIN_DEFAULT_TDP_W = 15.0

# Words that vendors put in /proc/cpuinfo but codecarbon's table leaves out.
_NOISE = re.compile(r"\((?:r|tm)\)|\bcpu\b|\bprocessor\b|@.*$|\b\d+-core\b|\bwith\b.*$", re.IGNORECASE)


def codecarbon_cpu_table() -> Path | None:
    """Path of codecarbon's ``cpu_power.csv`` in the installed package, without importing codecarbon."""
    spec = importlib.util.find_spec("codecarbon")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "data" / "hardware" / "cpu_power.csv"
        if path.is_file():
            return path
    return None


def _tokens(name: str) -> list[str]:
    return _NOISE.sub(" ", name).lower().replace("-", " ").split()


def match_cpu_tdp_w(model: str, table: Path) -> tuple[str, float] | None:
    """Best row of the codecarbon table for ``model``: ``(table name, TDP W)``, or None.

    A row matches when all its words appear in the model's words (after dropping ``(R)``, ``CPU``,
    ``@ 2.50GHz`` ...) and it names the model number (a word with a digit); the row with the most words
    wins, so ``Xeon Gold 6248R`` beats ``Xeon Gold 6248`` when the model says 6248R.
    """
    want = _tokens(model)
    if not want:
        return None
    want_set = set(want)
    best: tuple[int, str, float] | None = None
    with table.open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            name, tdp = row.get("Name") or "", row.get("TDP") or ""
            words = _tokens(name)
            # Every word of the row must be in the model, and one of them must be the model number.
            if not words or not set(words) <= want_set or not any(ch.isdigit() for w in words for ch in w):
                continue
            try:
                tdp_w = float(tdp)
            except ValueError:
                continue
            if best is None or len(words) > best[0]:
                best = (len(words), name, tdp_w)
    return None if best is None else (best[1], best[2])


def read_cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str | None, int, int | None]:
    """``(model name, sockets, physical cores)`` from a /proc/cpuinfo file; unknowns are None (sockets 1)."""
    try:
        text = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None, 1, None
    model: str | None = None
    sockets: set[str] = set()
    cores: set[tuple[str, str]] = set()
    physical = "0"
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "model name" and model is None:
            model = value
        elif key == "physical id":
            physical = value
            sockets.add(value)
        elif key == "core id":
            cores.add((physical, value))
    return model, max(1, len(sockets)), (len(cores) or None)


class CpuTimesUtilisation:
    """Busy fraction of all CPUs between calls, from the cumulative CPU times of ``/proc/stat``'s first
    line (psutil's ``cpu_times()`` where there is none).

    Keeps its own previous sample, unlike ``psutil.cpu_percent()``, whose module-wide state other
    callers in the process would disturb. Read directly on Linux: one line, where psutil builds a
    named tuple through several layers every tick, from a descriptor kept open (``pread`` at offset 0
    makes the kernel render the file afresh; opening and closing it every tick cost as much again).
    """

    def __init__(self, proc_stat: str = "/proc/stat") -> None:
        self._proc_stat = proc_stat
        self._fd: int | None = None
        self._last = self._times()

    def _first_line(self) -> bytes:
        if self._fd is None:
            self._fd = os.open(self._proc_stat, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            head = os.pread(self._fd, 512, 0)
        except OSError:
            self.close()  # read again through a fresh descriptor next time
            raise
        return head.split(b"\n", 1)[0]

    def _times(self) -> tuple[float, float]:
        """(total, idle + iowait) CPU time so far, in any one unit."""
        try:
            fields = self._first_line().split()
            if fields[:1] == [b"cpu"] and len(fields) >= 6:
                values = [float(v) for v in fields[1:]]
                return sum(values), values[3] + values[4]
        except (OSError, ValueError):
            pass
        import psutil

        times = psutil.cpu_times()
        return sum(times), sum(getattr(times, n, 0.0) for n in ("idle", "iowait"))

    def close(self) -> None:
        """Close the kept descriptor; idempotent (a later call opens it again)."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __call__(self) -> float:
        """Percent busy since the previous call (0-100)."""
        now = self._times()
        delta_total, delta_idle = now[0] - self._last[0], now[1] - self._last[1]
        self._last = now
        if delta_total <= 0:
            return 0.0
        return float(max(0.0, min(100.0, 100.0 * (1.0 - delta_idle / delta_total))))


class CpuEstimateSensor:
    """Whole-host CPU energy estimated from TDP and utilisation; one device, ``cpu0``."""

    name = "estimate"

    def __init__(
        self,
        *,
        tdp_w: float | None = None,
        cpu_model: str | None = None,
        clock: Callable[[], float] = time.time,
        cpu_percent: Callable[[], float] | None = None,
        cpuinfo_path: Path = Path("/proc/cpuinfo"),
        cpu_table: Path | None = None,
    ) -> None:
        self._clock = clock
        found_model, sockets, cores = read_cpuinfo(cpuinfo_path)
        self.cpu_model = cpu_model or found_model
        self.tdp_w, self.tdp_source = self._resolve_tdp(tdp_w, sockets, cores, cpu_table)
        self._cpu_percent = cpu_percent if cpu_percent is not None else CpuTimesUtilisation()
        self._lock = threading.Lock()
        self._t_s = clock()
        self._energy_j = 0.0
        self._power_w = self.tdp_w * IDLE_FRACTION
        self._returned_j = 0.0
        self._history: deque[tuple[float, float]] = deque([(self._t_s, 0.0)], maxlen=64)
        self._info = DeviceInfo(key="cpu0", kind="cpu", index=0, model=self.cpu_model, power_limit_w=self.tdp_w)
        log.info("estimating CPU power: %s", self.tdp_source)

    def _resolve_tdp(
        self, tdp_w: float | None, sockets: int, cores: int | None, cpu_table: Path | None
    ) -> tuple[float, str]:
        if tdp_w is not None:
            return float(tdp_w), f"TDP {tdp_w:g} W as configured"
        table = cpu_table or codecarbon_cpu_table()
        if self.cpu_model and table is not None:
            match = match_cpu_tdp_w(self.cpu_model, table)
            if match is not None:
                name, per_socket_w = match
                return per_socket_w * sockets, (
                    f"TDP {per_socket_w:g} W x {sockets} socket(s) for {name!r} from codecarbon's CPU table "
                    f"(model {self.cpu_model!r})"
                )
        n_cores = cores or os.cpu_count() or 1
        total_w = max(MIN_DEFAULT_TDP_W, DEFAULT_W_PER_CORE * n_cores)
        why = "no CPU model" if not self.cpu_model else f"{self.cpu_model!r} not in codecarbon's CPU table"
        if table is None:
            why = "codecarbon's CPU table not found"
        return (
            total_w,
            f"default {DEFAULT_W_PER_CORE:g} W x {n_cores} core(s)"
            + (f", at least {MIN_DEFAULT_TDP_W:g} W" if total_w > DEFAULT_W_PER_CORE * n_cores else "")
            + f" = {total_w:g} W ({why}); set WATTWATCH_CPU_TDP (watts) to do better",
        )

    def power_w(self, utilisation_percent: float) -> float:
        """The estimated power at ``utilisation_percent`` (0-100): TDP x max(idle floor, utilisation)."""
        return self.tdp_w * max(IDLE_FRACTION, min(1.0, utilisation_percent / 100.0))

    def _advance(self) -> float:
        """Integrate from the previous read to now at the utilisation measured over that interval."""
        now_s = self._clock()
        if now_s > self._t_s:
            self._power_w = self.power_w(self._cpu_percent())
            self._energy_j += self._power_w * (now_s - self._t_s)
            self._t_s = now_s
            self._history.append((now_s, self._energy_j))
        return now_s

    def _emit(self, t_s: float, energy_j: float) -> list[EnergyReading]:
        self._returned_j = max(self._returned_j, energy_j)
        return [EnergyReading(device="cpu0", t_s=t_s, energy_j=self._returned_j, source="estimate")]

    def devices(self) -> Sequence[DeviceInfo]:
        """The whole host's CPUs as one device, ``cpu0``."""
        return [self._info]

    def read(self) -> list[EnergyReading]:
        """Estimated cumulative J, now."""
        with self._lock:
            now_s = self._advance()
            return self._emit(now_s, self._energy_j)

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Estimated cumulative J at ``t_s``: linear within the interval that holds it, which is exactly
        how the estimate spreads power over time, so boundary and tick readings agree."""
        with self._lock:
            self._advance()
            hist = list(self._history)
            last_t, last_j = hist[-1]
            # Past the last read (t_s is "just past", so rare): extrapolate at the current power.
            energy_j = last_j + self._power_w * (t_s - last_t) if t_s >= last_t else hist[0][1]
            for (t0, e0), (t1, e1) in pairwise(hist):
                if t0 <= t_s <= t1:
                    energy_j = e0 + (e1 - e0) * (t_s - t0) / (t1 - t0)
                    break
            return self._emit(t_s, energy_j)

    def close(self) -> None:
        """Close what the utilisation reader keeps open; idempotent."""
        close = getattr(self._cpu_percent, "close", None)
        if callable(close):
            close()


def installed_memory_gib(meminfo_path: Path = Path("/proc/meminfo")) -> float | None:
    """Installed memory in GiB from ``MemTotal`` in a /proc/meminfo file; None when unreadable."""
    try:
        text = meminfo_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "MemTotal":
            parts = value.split()
            if parts and parts[0].isdigit():
                return int(parts[0]) / (1024 * 1024)  # kB -> GiB
    return None


class DramEstimateSensor:
    """Host DRAM energy by the documented rule (``DRAM_W_PER_GIB`` x installed GiB); one device, ``dram0``."""

    name = "dram-estimate"

    def __init__(
        self,
        *,
        memory_gib: float | None = None,
        clock: Callable[[], float] = time.time,
        meminfo_path: Path = Path("/proc/meminfo"),
    ) -> None:
        self._clock = clock
        gib = memory_gib if memory_gib is not None else installed_memory_gib(meminfo_path)
        if gib is None:
            import psutil

            gib = psutil.virtual_memory().total / 2**30
        self.memory_gib = float(gib)
        self.power_w = DRAM_W_PER_GIB * self.memory_gib
        self.rule = f"{DRAM_W_PER_GIB:g} W/GiB x {self.memory_gib:.1f} GiB = {self.power_w:.1f} W (constant)"
        self._start_s = clock()
        self._returned_j = 0.0
        self._lock = threading.Lock()
        self._info = DeviceInfo(key="dram0", kind="dram", index=0, model=f"DRAM {self.memory_gib:.0f} GiB (estimated)")

    def devices(self) -> Sequence[DeviceInfo]:
        """The host's memory as one device, ``dram0``."""
        return [self._info]

    def _emit(self, t_s: float) -> list[EnergyReading]:
        with self._lock:
            # Constant power makes energy a function of time alone; never below what was returned.
            self._returned_j = max(self._returned_j, self.power_w * max(0.0, t_s - self._start_s))
            return [EnergyReading(device="dram0", t_s=t_s, energy_j=self._returned_j, source="estimate")]

    def read(self) -> list[EnergyReading]:
        """Estimated cumulative J, now."""
        return self._emit(self._clock())

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Estimated cumulative J at ``t_s`` (exact for the rule: the power is constant)."""
        return self._emit(t_s)

    def close(self) -> None:
        """Nothing to release; idempotent."""
