"""A fake ``pynvml`` module over a SimulatedFleet: the hardware boundary of every GPU test and benchmark.

Same function names, signatures and result shapes as nvidia-ml-py, and the real module's
``NVMLError`` classes, ``NVML_*`` constants and ctypes structures, so code written against pynvml
(wattwatch's NVML sensor, CodeCarbon) runs against it unchanged. Each value is what the board's
generation would report (``SimulatedFleet.counter_mj``, ``average_power_mw``, ``instant_power_mw``).
With the fleet's flaws, every ``nvml*`` call also takes time (``Flaws.call_latency_s`` plus jitter;
the value is read at a random point inside the call) and processes are listed only once NVML knows
them (``SimulatedFleet.listed_pids``).
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from wattwatch.sim.board import Board
    from wattwatch.sim.fleet import SimulatedFleet

DRIVER_VERSION = "550.54.15"
NVML_VERSION = "12.550.54.15"
PROCESS_BUFFER_S = 10.0  # how far back the fake's per-process sample buffer reaches

_F = TypeVar("_F", bound=Callable[..., Any])


def real_pynvml() -> Any:
    """nvidia-ml-py's ``pynvml`` module, even while a fake stands in for it in ``sys.modules``.

    The real module only loads libnvidia-ml at ``nvmlInit``, so importing it works without a GPU.
    """
    import pynvml

    return getattr(pynvml, "_real", pynvml)


class _Handle:
    """What ``nvmlDeviceGetHandleBy*`` returns: opaque to callers."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<simulated nvmlDevice {self.index}>"


class FakeNvml:
    """Duck-typed ``pynvml`` over a SimulatedFleet: same function names and signatures as nvidia-ml-py,
    and the real module's ``NVMLError`` classes, ``NVML_*`` constants and ctypes structures, so code
    written against pynvml catches the fake's errors and reads its results unchanged."""

    WATTWATCH_SIMULATED = True

    def __init__(self, fleet: SimulatedFleet, view: int = 0) -> None:
        real = real_pynvml()
        for name in dir(real):
            if name.startswith(("NVML_", "NVMLError", "c_nvml", "nvmlFriendlyObject")):
                setattr(self, name, getattr(real, name))
        self._real = real
        self._fleet = fleet
        self._limit_mw = round(fleet.generation.power_limit_w * 1000)
        self._memory_total_b = fleet.generation.memory_total_b
        self._inits = 0
        self._init_lock = threading.Lock()
        # Each view (the fleet's n-th module) draws its call durations from a seeded stream of its own.
        self._cost = fleet.flaws.call_rng(view)

    def _spend(self, seconds: float) -> None:
        if seconds > 0:
            self._fleet.sleep(seconds)

    # -- library ------------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        """Initialise (reference counted, like the real library)."""
        with self._init_lock:
            self._inits += 1

    def nvmlShutdown(self) -> None:
        """Undo one ``nvmlInit``."""
        with self._init_lock:
            self._check()
            self._inits -= 1

    def _check(self) -> None:
        if self._inits <= 0:
            raise self._real.NVMLError(self._real.NVML_ERROR_UNINITIALIZED)

    def _board(self, handle: Any) -> tuple[Board, float]:
        self._check()
        if not isinstance(handle, _Handle):
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        return self._fleet.observe(handle.index)

    def nvmlSystemGetDriverVersion(self) -> str:
        """The (simulated) driver version string."""
        self._check()
        return DRIVER_VERSION

    def nvmlSystemGetNVMLVersion(self) -> str:
        """The (simulated) NVML library version string."""
        self._check()
        return NVML_VERSION

    # -- enumeration --------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        """Number of boards."""
        self._check()
        return self._fleet.n_gpus

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        """Handle of board ``index``; InvalidArgument when out of range."""
        return self._handle(index)

    def _handle(self, index: int) -> _Handle:
        self._check()
        if not isinstance(index, int) or not 0 <= index < self._fleet.n_gpus:
            raise self._real.NVMLError(self._real.NVML_ERROR_INVALID_ARGUMENT)
        with self._fleet.lock:
            self._fleet.observe(index)
        return _Handle(index)

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> _Handle:
        """Handle of the board with ``uuid``; NotFound otherwise."""
        self._check()
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        for i in range(self._fleet.n_gpus):
            if self._fleet.uuid(i) == text:
                return self._handle(i)
        raise self._real.NVMLError(self._real.NVML_ERROR_NOT_FOUND)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        """Marketing name of the board."""
        with self._fleet.lock:
            self._board(handle)
        return self._fleet.model

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        """``GPU-...`` UUID of the board."""
        with self._fleet.lock:
            board, _ = self._board(handle)
        return board.uuid

    def nvmlDeviceGetIndex(self, handle: Any) -> int:
        """NVML index of the board."""
        with self._fleet.lock:
            board, _ = self._board(handle)
        return board.index

    # -- power and energy ---------------------------------------------------------------------------

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        """mJ since driver load (or the last reset), as of the last refresh; NotSupported without a counter."""
        with self._fleet.lock:
            board, now = self._board(handle)
            if not board.counter_supported:
                raise self._real.NVMLError(self._real.NVML_ERROR_NOT_SUPPORTED)
            return self._fleet.counter_mj(board.index, now)

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        """mW, the mean over the generation's averaging window as of the last refresh (1 s on H100)."""
        with self._fleet.lock:
            board, now = self._board(handle)
            return self._fleet.average_power_mw(board.index, now)

    def nvmlDeviceGetFieldValues(self, handle: Any, fieldIds: list[Any]) -> Any:
        """Array of ``c_nvmlFieldValue_t``; POWER_INSTANT (where the generation has it) and POWER_AVERAGE, mW."""
        real = self._real
        values = (real.c_nvmlFieldValue_t * len(fieldIds))()
        with self._fleet.lock:
            board, now = self._board(handle)
            for i, field_id in enumerate(fieldIds):
                fid, scope = field_id if isinstance(field_id, tuple) else (field_id, 0)
                v = values[i]
                v.fieldId, v.scopeId = fid, scope
                v.timestamp = int(now * 1e6)
                v.latencyUsec = 0
                v.valueType = real.NVML_VALUE_TYPE_UNSIGNED_INT
                if fid == real.NVML_FI_DEV_POWER_INSTANT and self._fleet.generation.power_instant:
                    v.value.uiVal = self._fleet.instant_power_mw(board.index, now)
                    v.nvmlReturn = real.NVML_SUCCESS
                elif fid == real.NVML_FI_DEV_POWER_AVERAGE:
                    v.value.uiVal = self._fleet.average_power_mw(board.index, now)
                    v.nvmlReturn = real.NVML_SUCCESS
                else:
                    v.nvmlReturn = real.NVML_ERROR_NOT_SUPPORTED
        return values

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        """mW."""
        with self._fleet.lock:
            self._board(handle)
        return self._limit_mw

    def nvmlDeviceGetPowerManagementLimit(self, handle: Any) -> int:
        """mW."""
        with self._fleet.lock:
            self._board(handle)
        return self._limit_mw

    # -- load ---------------------------------------------------------------------------------------

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> Any:
        """``c_nvmlUtilization_t`` in percent, derived from the 1 s average power (busy boards draw more)."""
        with self._fleet.lock:
            board, now = self._board(handle)
            avg_mw = self._fleet.average_power_mw(board.index, now)
        scale = self._fleet.generation.power_scale
        busy = min(1.0, max(0.0, (avg_mw - 70_000 * scale) / ((600_000 - 70_000) * scale)))
        return self._real.c_nvmlUtilization_t(gpu=round(100 * busy), memory=round(60 * busy))

    def _memory_used_b(self, board: Board, now: float) -> int:
        kind = board.segments[board.segment_at(now)].kind
        fraction = {"idle": 0.006, "training": 0.88, "inference": 0.75, "square": 0.5}[kind]
        return int(self._memory_total_b * fraction)

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        """``c_nvmlMemory_t`` (or ``_v2_t`` when ``version`` is given) in bytes."""
        with self._fleet.lock:
            board, now = self._board(handle)
            used = self._memory_used_b(board, now)
        if version:
            mem = self._real.c_nvmlMemory_v2_t()
            mem.version, mem.reserved = version, 0
        else:
            mem = self._real.c_nvmlMemory_t()
        total = self._memory_total_b
        mem.total, mem.used, mem.free = total, used, total - used
        return mem

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[Any]:
        """Objects with ``pid``, ``usedGpuMemory`` (bytes), ``gpuInstanceId``, ``computeInstanceId``."""
        with self._fleet.lock:
            board, now = self._board(handle)
            used = self._memory_used_b(board, now)
            pids = self._fleet.listed_pids(board.index, now)
        share = used // len(pids) if pids else 0
        fields = {"usedGpuMemory": share, "gpuInstanceId": 0xFFFFFFFF, "computeInstanceId": 0xFFFFFFFF}
        return [self._real.nvmlFriendlyObject({"pid": pid, **fields}) for pid in pids]

    def nvmlDeviceGetProcessUtilization(self, handle: Any, timeStamp: int) -> list[Any]:
        """``c_nvmlProcessUtilizationSample_t`` per process and sample since ``timeStamp`` (CPU time, µs).

        Like NVML: samples on the fleet's process sample period (~1/6 s, per-board phase), each the
        process's mean utilisation over the sample period, only for processes with some utilisation in
        it and only once NVML lists the process; ``NVMLError_NotFound`` when there is no sample since
        ``timeStamp``. The buffer reaches back ``PROCESS_BUFFER_S``.
        """
        real = self._real
        samples: list[Any] = []
        period_s = self._fleet.process_sample_period_s
        with self._fleet.lock:
            board, now = self._board(handle)
            origin_s = self._fleet.created_s + board.phase_fraction * period_s
            since_s = max(int(timeStamp) / 1e6, now - PROCESS_BUFFER_S)
            k = math.floor((since_s - origin_s) / period_s) + 1
            listed_from = {pid: self._fleet.visible_from_s(board.index, pid) for pid in board.proc_util}
            while (grid_s := origin_s + k * period_s) <= now:
                stamp_us = int(grid_s * 1e6)
                if stamp_us > int(timeStamp):
                    for pid in sorted(board.proc_util):
                        if grid_s < listed_from[pid]:
                            continue  # NVML did not know the process yet
                        sm = board.mean_process_util(pid, grid_s - period_s, grid_s)
                        if sm > 0:
                            samples.append(
                                real.c_nvmlProcessUtilizationSample_t(
                                    pid=pid,
                                    timeStamp=stamp_us,
                                    smUtil=round(sm),
                                    memUtil=round(0.6 * sm),
                                    encUtil=0,
                                    decUtil=0,
                                )
                            )
                k += 1
        if not samples:
            raise real.NVMLError(real.NVML_ERROR_NOT_FOUND)
        return samples

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[Any]:
        """None: simulated boards run compute only."""
        with self._fleet.lock:
            self._board(handle)
        return []

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        """Degrees C, rising with the average power (for tools that ask, such as CodeCarbon)."""
        with self._fleet.lock:
            board, now = self._board(handle)
            avg_mw = self._fleet.average_power_mw(board.index, now)
        return round(30 + 50 * avg_mw / self._limit_mw)

    def nvmlDeviceGetComputeMode(self, handle: Any) -> int:
        """``NVML_COMPUTEMODE_DEFAULT``."""
        with self._fleet.lock:
            self._board(handle)
        return int(self._real.NVML_COMPUTEMODE_DEFAULT)


def _costs_time(fn: _F) -> _F:
    """``fn`` as an NVML call that takes time: part before the value is read, the rest after."""

    @functools.wraps(fn)
    def call(self: FakeNvml, *args: Any, **kwargs: Any) -> Any:
        before_s, after_s = self._cost.draw()
        self._spend(before_s)
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._spend(after_s)

    return call  # type: ignore[return-value]


for _name in [n for n in vars(FakeNvml) if n.startswith("nvml")]:
    setattr(FakeNvml, _name, _costs_time(getattr(FakeNvml, _name)))
