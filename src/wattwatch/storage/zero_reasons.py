"""Why a job shows no energy, or no GPU, and what to do about it: every report format carries it.

A job is bound to GPUs by the agent (``agent.jobs``): from its ``CUDA_VISIBLE_DEVICES``, or, without one,
to the GPUs where NVML lists one of its processes. A job that got neither holds no GPU, and a report that
shows it at 0 J (or with CPU joules only) while idle energy rises must say so. ``explain`` reads only the
report entry (and whether its hosts have GPUs), so the CLI, the API and the dashboards say the same.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

GPU_KINDS = ("training", "inference")


def explain(job: Mapping[str, Any], gpu_hosts: set[str], *, held_gpu: bool) -> tuple[str | None, str | None]:
    """``(reason, fix)`` for a job whose figures need one (0 J, no device, or a training/inference job with
    no GPU); ``(None, None)`` otherwise. ``gpu_hosts``: hosts that reported at least one GPU; ``held_gpu``:
    some interval gave the job a share of a GPU (even of 0 J: ``devices`` lists only those with energy)."""
    devices = list(job.get("devices") or [])
    has_gpu = any(d.rsplit("/", 1)[-1].startswith("gpu") for d in devices)
    energy_j = float(job.get("energy_j") or 0.0)
    running = bool(job.get("running"))
    hosts = list(job.get("hosts") or [])
    if running and energy_j == 0.0:
        return (
            "no energy stored for it yet: the agent pushes its measurements every few seconds",
            "report again in a few seconds; if it stays at 0 J, check the agent with `wattwatch doctor`",
        )
    if not hosts:
        return (
            "no measurement named this job: no agent interval held it",
            "start jobs through a running agent (`wattwatch run`, wattwatch.job()); check it with `wattwatch doctor`",
        )
    if held_gpu and not has_gpu:
        return (
            "its GPUs reported no energy within its window (shorter than the counters refresh?)",
            "measure longer jobs, or a finer --interval on the agent",
        )
    if has_gpu or (energy_j > 0.0 and job.get("kind") not in GPU_KINDS):
        return None, None
    if hosts and not any(h in gpu_hosts for h in hosts):
        return (
            f"its host ({', '.join(hosts)}) reported no GPU, so only CPU energy was counted",
            "run it on a GPU host, or see `wattwatch doctor` there for why no GPU is visible",
        )
    return (
        "never appeared on a GPU and had no CUDA_VISIBLE_DEVICES naming one, so it held no GPU"
        + ("" if energy_j > 0.0 else " and no CPU time"),
        "set CUDA_VISIBLE_DEVICES for it (e.g. `CUDA_VISIBLE_DEVICES=0 wattwatch run ...`), or run the GPU "
        "work in the job's own process or a child of it",
    )
