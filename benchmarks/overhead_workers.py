"""The processes ``agent_overhead.py`` measures beside the wattwatch agent, each run as its own program:

- ``codecarbon``: CodeCarbon's ``OfflineEmissionsTracker`` (``measure_power_secs`` = the tick) tracking
  the GPUs of a simulated fleet through the same fake ``pynvml`` module ``--simulate`` uses (made
  visible to CodeCarbon by ``accuracy_methods.CodeCarbonShim``), plus whatever CPU and RAM tracking
  CodeCarbon does by default on this machine;
- ``simulator``: only the simulated fleet, its boards read once per tick through the fake module as the
  agent's tick reads them (energy counter, instant power, process list), so the simulator's own share
  of the agent's figure can be told apart.

Each writes ``--ready`` once it is measuring and runs until SIGTERM; ``codecarbon`` then writes what the
tracker measured to ``--result`` (JSON), so the caller can check it really tracked the GPUs.

    PYTHONPATH=src python benchmarks/overhead_workers.py codecarbon --gpus 8 --interval 1 --ready R --result J
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from wattwatch.sim.fleet import SimulatedFleet

J_PER_KWH = 3.6e6


def stop_on_sigterm() -> threading.Event:
    """An event set by SIGTERM or SIGINT."""
    stop = threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def run_codecarbon(gpus: int, interval_s: float, ready: Path, result: Path) -> int:
    """CodeCarbon's offline tracker on ``gpus`` simulated boards until SIGTERM; exit 3 if it cannot run."""
    stop = stop_on_sigterm()
    from accuracy_methods import CodeCarbonShim

    shim = CodeCarbonShim()
    if shim.error:
        sys.stderr.write(f"overhead_workers codecarbon: {shim.error}\n")
        return 3
    shim.point_at(SimulatedFleet(gpus))
    from codecarbon import OfflineEmissionsTracker

    tracker = OfflineEmissionsTracker(
        country_iso_code="USA",
        save_to_file=False,
        log_level="error",
        allow_multiple_runs=True,
        gpu_ids=list(range(gpus)),
        measure_power_secs=interval_s,
        tracking_mode="machine",
    )
    tracker.start()
    ready.write_text("measuring\n")
    stop.wait()
    tracker.stop()
    data: Any = tracker.final_emissions_data
    result.write_text(
        json.dumps(
            {
                "gpu_count": float(getattr(data, "gpu_count", 0) or 0),
                "gpu_energy_j": float(getattr(data, "gpu_energy", 0.0) or 0.0) * J_PER_KWH,
                "duration_s": float(getattr(data, "duration", 0.0) or 0.0),
            }
        )
    )
    shim.close()
    return 0


def run_simulator(gpus: int, interval_s: float, ready: Path) -> int:
    """Read ``gpus`` simulated boards every ``interval_s`` through the fake NVML module until SIGTERM."""
    stop = stop_on_sigterm()
    fleet = SimulatedFleet(gpus)
    nv = fleet.module()
    nv.nvmlInit()
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
    field = nv.NVML_FI_DEV_POWER_INSTANT
    ready.write_text("measuring\n")
    next_s = time.monotonic()
    while not stop.wait(max(0.0, next_s - time.monotonic())):
        for handle in handles:
            nv.nvmlDeviceGetTotalEnergyConsumption(handle)
            nv.nvmlDeviceGetFieldValues(handle, [field])
            nv.nvmlDeviceGetComputeRunningProcesses(handle)
        next_s += interval_s
    nv.nvmlShutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run one worker (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("worker", choices=("codecarbon", "simulator"))
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--interval", type=float, default=1.0)
    p.add_argument("--ready", type=Path, required=True, help="file written once measuring")
    p.add_argument("--result", type=Path, help="codecarbon: where to write what it measured (JSON)")
    args = p.parse_args(argv)
    if args.worker == "codecarbon":
        if args.result is None:
            p.error("codecarbon needs --result")
        return run_codecarbon(args.gpus, args.interval, args.ready, args.result)
    return run_simulator(args.gpus, args.interval, args.ready)


if __name__ == "__main__":
    sys.exit(main())
