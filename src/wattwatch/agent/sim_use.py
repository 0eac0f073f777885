"""The ``sim_gpu_use`` local-API op, for simulated GPUs only (``--simulate N``): a process says it uses
GPUs outside any job of its own, as a model loading before its job opens or a server warming up. From
then on the simulated NVML lists it on those GPUs (at ``sm_util_percent``, when given) and their load
follows ``kind``, so the agent finds it exactly as it finds a real process; ``leave`` takes it off.
Tests and demos use it; on real GPUs, creating a CUDA context does this.

Message: ``{"op": "sim_gpu_use", "pid": 123, "cuda_visible_devices": "0", "kind": "training",
"sm_util_percent": 70}`` or ``{"op": "sim_gpu_use", "pid": 123, "leave": true}``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from wattwatch.agent.requests import ResolveVisible
from wattwatch.errors import ConfigError
from wattwatch.sensors.base import DeviceInfo

# The simulated workload's holder id for a process's own use of its GPUs (outside its jobs).
RESIDENT_PREFIX = "sim-resident-"


class Workload(Protocol):
    """The simulated workload hook (``standalone.SimulatedWorkload``), as this op uses it."""

    def job_started(self, job_id: str, kind: str, devices: Sequence[str], pid: int | None, t_s: float) -> None:
        """Load ``devices`` with ``kind`` from ``t_s``, listing ``pid`` on them."""
        ...

    def job_ended(self, job_id: str, t_s: float) -> None:
        """Take the load of ``job_id`` off its devices at ``t_s``."""
        ...


def sim_gpu_use(
    msg: Mapping[str, Any],
    hook: Workload | None,
    gpus: Sequence[DeviceInfo],
    resolve_visible: ResolveVisible | None,
    clock: Callable[[], float],
) -> dict[str, Any]:
    """Answer one ``sim_gpu_use`` message (see the module docstring); raises ConfigError on bad input."""
    fleet = getattr(hook, "fleet", None)
    if hook is None or fleet is None or resolve_visible is None:
        raise ConfigError("sim_gpu_use works only on simulated GPUs; start the agent with --simulate N")
    pid = msg.get("pid")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        raise ConfigError("sim_gpu_use needs the process's pid (a positive integer)")
    holder = f"{RESIDENT_PREFIX}{pid}"
    t_s = clock()
    if msg.get("leave"):
        hook.job_ended(holder, t_s)
        for index in range(fleet.n_gpus):
            if fleet.process_utilization(index, pid, t_s) > 0:
                fleet.set_process_utilization(index, pid, 0.0, t_s)
        return {"ok": True, "t_s": t_s}
    kind = str(msg.get("kind") or "training")
    if kind not in ("training", "inference"):
        raise ConfigError(f"sim_gpu_use kind {kind!r} is not training or inference")
    devices = resolve_visible(str(msg.get("cuda_visible_devices") or ""), gpus)
    if not devices:
        raise ConfigError("sim_gpu_use needs cuda_visible_devices naming the simulated GPUs to use")
    util = msg.get("sm_util_percent")
    if util is not None and not (isinstance(util, int | float) and 0 <= util <= 100):
        raise ConfigError(f"sm_util_percent must be within 0-100, got {util!r}")
    hook.job_started(holder, kind, devices, pid, t_s)
    if util is not None:
        for key in devices:
            fleet.set_process_utilization(int(key.removeprefix("gpu")), pid, float(util), t_s)
    return {"ok": True, "t_s": t_s, "devices": devices}
