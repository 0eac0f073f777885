"""The GPU simulator: boards with exact, reproducible power behind a fake ``pynvml`` module.

``fleet`` (the boards and what NVML reports of them), ``board`` (one board's activity timeline: the
truth), ``profiles`` (activity power as a function of time), ``generations`` (how each board
generation reports through NVML), ``flaws`` (what real hardware does besides: refresh periods, noise,
call latency, late process lists, workloads that lag their jobs), ``fake_nvml`` (the pynvml stand-in,
the hardware boundary of every GPU test and benchmark) and ``clock`` (simulated time). Nothing under
``wattwatch.sensors`` may import from here except to build a fleet when ``--simulate`` asks for one:
the sensor learns how the hardware behaves from what the fake reports, never from its constants.
"""

from wattwatch.sim.clock import FakeClock
from wattwatch.sim.flaws import Flaws
from wattwatch.sim.fleet import SimulatedFleet

__all__ = ["FakeClock", "Flaws", "SimulatedFleet"]
