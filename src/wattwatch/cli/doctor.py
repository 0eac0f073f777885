"""``wattwatch doctor``: which energy sources work on this host, why the others don't, and how to fix them.

Runs the same discovery the agent runs (``sensors.discovery``), then describes every source: for
each GPU its model, UUID, power limit, whether it has an energy counter (exact) and whether
``NVML_FI_DEV_POWER_INSTANT`` works, and the timings the sensor learned from it while starting (the
counter's refresh period and phase, live or held instant power, NVML's per-process sample period,
NVML call latency; or why one is not learned yet); for RAPL its zones and how often they must be
read; for an estimate the rule it uses. Given the agent's spool file, it also says how many batches
wait and how many the collector refused for good (set aside, ``agent.poison``), why, and how to retry
them. Given the agent's socket, it asks the running agent whether its spool can be written (a full
disk) and how many intervals it had to drop since it started. The exit code is 0 when nothing here
needs fixing (absent hardware, such as no GPU or no RAPL in a VM, is not a problem) and 1 when a source
exists but is unusable for a reason the user can fix (permissions, a failing driver, a GPU that cannot
be opened), batches are set aside or the running agent cannot write its spool.
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wattwatch.cli import options
from wattwatch.cli.errors import UsageError
from wattwatch.config import Settings

if TYPE_CHECKING:
    from wattwatch.sensors.base import Sensor
    from wattwatch.sensors.discovery import Discovery
    from wattwatch.sensors.nvml import GpuTiming
    from wattwatch.sim.fleet import SimulatedFleet

OK, SKIP, WARN = "ok  ", "skip", "FIX "
LATEST_SET_ASIDE = 5  # reasons shown; `wattwatch spool list` shows them all

EPILOG = """examples:
  wattwatch doctor
  wattwatch doctor --simulate 2 --generation p100
  wattwatch --home /var/lib/wattwatch doctor    the agent's spool in another home"""


def add_parser(sub: Any) -> None:
    """Add ``doctor`` to the command parsers ``sub``."""
    doc = options.add_command(
        sub,
        "doctor",
        help="which sensors work here, why the others don't, and batches the collector refused",
        epilog=EPILOG,
    )
    options.add_simulate(doc, "examine N simulated GPUs instead")
    doc.add_argument("--generation", default="h100", help="board generation of simulated GPUs (default h100)")
    options.add_sim_flaws(doc)


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Print the doctor's report; exit 1 when something is to fix."""
    from wattwatch.agent.spool import SPOOL_FILE

    fleet = None
    flaws = options.sim_flaws(args, args.simulate)
    if args.simulate:
        options.check_simulate(args.simulate)
        from wattwatch.sim.fleet import SimulatedFleet
        from wattwatch.sim.generations import GENERATIONS

        if args.generation.lower() not in GENERATIONS:
            raise UsageError(f"--generation {args.generation!r} is unknown; use one of {', '.join(GENERATIONS)}")
        fleet = SimulatedFleet(args.simulate, generation=args.generation, flaws=flaws)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a sensor's library warning is no finding; the report says what is wrong
        text, code = run_doctor(
            simulate_fleet=fleet,
            cpu_tdp_w=settings.cpu_tdp_w or None,
            spool_path=settings.home / SPOOL_FILE,
            agent_socket=settings.socket_path,
        )
    print(text)
    return code


def run_doctor(
    *,
    simulate_fleet: SimulatedFleet | None = None,
    powercap_root: Path = Path("/sys/class/powercap"),
    nvml: Any | None = None,
    cpu_tdp_w: float | None = None,
    spool_path: Path | None = None,
    agent_socket: Path | None = None,
) -> tuple[str, int]:
    """The doctor's report as text, and the exit code (0: nothing to fix; 1: something to fix).

    ``simulate_fleet`` examines simulated GPUs instead of NVML; ``powercap_root`` and ``nvml`` (a
    pynvml-like module) are the hardware boundaries, passed in so tests use fixtures. ``spool_path``: the
    agent's spool file, described when given; ``agent_socket``: the agent's local API, asked (when an agent
    answers there) whether it can write its spool and what it dropped.
    """
    from wattwatch.sensors.discovery import discover

    found = discover(simulate_fleet=simulate_fleet, powercap_root=powercap_root, nvml=nvml, cpu_tdp_w=cpu_tdp_w)
    try:
        lines, problems = _describe(found)
    finally:
        for sensor in found.sensors:
            sensor.close()
    if spool_path is not None:
        spool_lines, spool_problems = describe_spool(spool_path)
        lines += ["", "Agent spool", *spool_lines]
        problems += spool_problems
    if agent_socket is not None:
        agent_lines, agent_problems = describe_agent_spool(agent_socket)
        if spool_path is None:
            lines += ["", "Agent spool"]
        lines += agent_lines
        problems += agent_problems
    lines.append("")
    if problems:
        lines.append(f"{problems} problem(s) to fix (marked FIX above); wattwatch measures what it can meanwhile.")
    else:
        lines.append("Nothing to fix: every energy source this host has is in use.")
    return "\n".join(lines), 1 if problems else 0


def _describe(found: Discovery) -> tuple[list[str], int]:
    lines = ["wattwatch doctor: energy sources on this host"]
    problems = 0
    for title, group in (("GPUs", ("nvml",)), ("CPUs and memory", ("rapl", "rapl-dram", "estimate", "dram-estimate"))):
        lines += ["", title]
        for sensor in found.sensors:
            if sensor.name in group:
                sensor_lines, sensor_problems = _describe_sensor(sensor)
                lines += sensor_lines
                problems += sensor_problems
        for skipped in found.skipped:
            if skipped.name not in group:
                continue
            problems += skipped.problem
            lines.append(f"{WARN if skipped.problem else SKIP}  {skipped.name:14s} {skipped.reason}")
            if skipped.fix:
                lines.append(f"      {'':14s} fix: {skipped.fix}")
            if skipped.detail and skipped.detail != skipped.reason:
                lines.append(f"      {'':14s} ({skipped.detail})")
    return lines, problems


def _describe_sensor(sensor: Sensor) -> tuple[list[str], int]:
    from wattwatch.sensors.estimate import CpuEstimateSensor, DramEstimateSensor
    from wattwatch.sensors.nvml import NvmlSensor
    from wattwatch.sensors.rapl import RaplSensor

    if isinstance(sensor, NvmlSensor):
        return _describe_nvml(sensor)
    if isinstance(sensor, RaplSensor):
        keys = ", ".join(f"{d.key} ({d.model})" for d in sensor.devices())
        return [
            f"{OK}  {'rapl':14s} measured by energy counters: {keys}",
            f"      {'':14s} counters wrap; read at least every {sensor.max_poll_interval_s:.0f} s "
            "(the agent's default 1 s tick is far shorter)",
        ], 0
    if isinstance(sensor, CpuEstimateSensor):
        return [f"{OK}  {sensor.name:14s} cpu0 ESTIMATED (no readable RAPL): {sensor.tdp_source}"], 0
    if isinstance(sensor, DramEstimateSensor):
        return [f"{OK}  {sensor.name:14s} dram0 ESTIMATED by rule: {sensor.rule}"], 0
    devices = ", ".join(d.key for d in sensor.devices())
    return [f"{OK}  {sensor.name:14s} {devices}"], 0


def _describe_nvml(sensor: Any) -> tuple[list[str], int]:
    caps = sensor.capabilities()
    for cap in caps:
        if not cap.lost:
            sensor.learn_process_samples(cap.key)  # from what NVML's sample buffer already holds
    timings = sensor.timing()
    driver = sensor.driver_version() or "unknown"
    kind = ("SIMULATED " if sensor.simulated else "") + ("GPU" if len(caps) == 1 else "GPUs")
    lines = [f"{OK}  {'nvml':14s} {len(caps)} {kind}, NVIDIA driver {driver}"]
    problems = 0
    for cap in caps:
        limit = f"{cap.power_limit_w:.0f} W" if cap.power_limit_w is not None else "unknown"
        lines.append(f"      {cap.key:6s} {cap.model}  {cap.uuid}  power limit {limit}")
        counter = "yes" if cap.energy_counter else "NO"
        instant = "yes" if cap.power_instant else "no"
        if cap.energy_counter:
            how = "exact: energy counter deltas, boundaries pinned to its updates"
        elif cap.power_instant:
            how = "no counter (pre-Volta, or hidden by vGPU/MIG): instant power integrated at ~100 Hz"
        else:
            how = "no counter and no instant power: the short-window average power integrated at ~100 Hz"
        lines.append(f"      {'':6s} energy counter: {counter}   POWER_INSTANT: {instant}   -> {how}")
        if not cap.lost:
            lines += [f"      {'':6s} {line}" for line in _describe_timing(timings[cap.key])]
        if cap.lost:
            problems += 1
            lines.append(f"{WARN}  {'':14s} {cap.key} fell off the bus: check `dmesg` for Xid errors")
    for index, why in sorted(sensor.unopened.items()):
        problems += 1
        lines.append(f"{WARN}  {'nvml':14s} GPU {index} is not measured: {why}")
    return lines, problems


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms" if seconds < 0.01 else f"{seconds * 1000:.1f} ms"


def _describe_timing(timing: GpuTiming) -> list[str]:
    """What the sensor learned about one GPU's timing (nothing here is assumed: see ``nvml_timing``)."""
    if not timing.energy_counter:
        refresh = "counter refresh: none (no energy counter)"
    elif timing.refresh_period_s is None:
        refresh = f"counter refresh: not learned yet: {timing.refresh_why_not}"
    else:
        err = f" (±{_ms(timing.refresh_period_err_s)})" if timing.refresh_period_err_s is not None else ""
        refresh = f"counter refresh: every {_ms(timing.refresh_period_s)}{err}, from {timing.refreshes_seen} seen"
        if timing.phase_window_s is None:
            refresh += "; phase not learned yet"
        else:
            placed = "placed" if timing.phase_trusted else "only loosely placed (relearned at the next read)"
            refresh += f"; next refresh {placed} within ±{_ms(timing.phase_window_s / 2)}"
    power = {
        "live": "instant power: live (it changes between counter refreshes)",
        "held": "instant power: held (it changes only with the counter: a sample of the last refresh period)",
        "unknown": "instant power: not learned yet: it did not change while the counter was polled",
        "none": "instant power: none (NVML_FI_DEV_POWER_INSTANT does not answer)",
    }[timing.instant_power]
    if timing.process_sample_period_s is None:
        samples = "per-process samples: not learned yet: no process was busy on this GPU in NVML's sample buffer"
    else:
        samples = (
            f"per-process samples: every {_ms(timing.process_sample_period_s)}"
            f" (from {timing.process_stamps_seen} NVML timestamps)"
        )
    if timing.call_latency_s is None:
        latency = "NVML call latency: not measured yet"
    else:
        median_s, p95_s, calls = timing.call_latency_s
        latency = f"NVML call latency: median {_ms(median_s)}, p95 {_ms(p95_s)} (over {calls} reads)"
    return [refresh, power, samples, latency]


def describe_spool(path: Path) -> tuple[list[str], int]:
    """Batches waiting in the agent's spool, and those set aside with their latest reasons (1 problem if any)."""
    from wattwatch.agent.poison import describe
    from wattwatch.agent.spool import Spool

    if not path.is_file():
        return [f"{SKIP}  {'spool':14s} no agent spool at {path} (no agent ran with this --home / WATTWATCH_HOME)"], 0
    spool = Spool(path)
    try:
        pending, latest, n_aside = spool.pending(), spool.set_aside_batches(LATEST_SET_ASIDE), spool.dead()
    finally:
        spool.close()
    waiting = f"{pending} batch(es) waiting to be pushed"
    if not n_aside:
        return [f"{OK}  {'spool':14s} {path}: {waiting}, none set aside"], 0
    lines = [
        f"{WARN}  {'spool':14s} {path}: {n_aside} batch(es) SET ASIDE (the collector refused them; kept, not "
        f"stored); {waiting}",
        f"      {'':14s} latest:",
    ]
    for batch in latest:
        lines.append(f"      {'':14s}   seq {batch.seq}: {batch.reason.get('reason', '?')}, {describe(batch.reason)}")
    lines.append(
        f"      {'':14s} fix: remove the cause (often: upgrade the collector), then `wattwatch spool requeue --all` "
        "(`wattwatch spool list` shows them all)"
    )
    return lines, 1


def describe_agent_spool(socket_path: Path) -> tuple[list[str], int]:
    """What the agent running at ``socket_path`` says of its spool (``ping``): whether it can write it, what
    it holds in memory meanwhile and how many intervals it dropped since it started (1 problem while it
    cannot write). No line when no agent answers there, or an agent too old to say."""
    from wattwatch.sdk import AgentClient

    if not socket_path.exists():
        return [], 0
    client = AgentClient(socket_path, timeout_s=2.0)
    try:
        state = client.request({"op": "ping"}).get("spool")
    except (OSError, ValueError):
        return [], 0
    finally:
        client.close()
    if not isinstance(state, dict):
        return [], 0
    dropped = int(state.get("dropped_intervals") or 0)
    lost = (
        f"; {dropped} interval(s) dropped since it started (their time is sent as gap intervals: reports show "
        "it as not measured)"
        if dropped
        else "; no interval dropped since it started"
    )
    if not state.get("unwritable"):
        return [f"{OK}  {'agent':14s} the running agent writes its spool{lost}"], 0
    return [
        f"{WARN}  {'agent':14s} the running agent CANNOT WRITE its spool ({state['unwritable']}): "
        f"{state.get('held_intervals', 0)} interval(s) held in memory{lost}",
        f"      {'':14s} fix: free space on the disk of {state.get('path', 'its spool')} (or give the agent another "
        "--home); it writes what it holds by itself",
    ], 1
