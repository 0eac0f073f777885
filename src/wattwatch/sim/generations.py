"""How each NVIDIA board generation reports power and energy through NVML, for the simulator.

A ``BoardGeneration`` is the small set of NVML behaviours that decide how accurate a measurement can
be: how often the energy counter and power readings refresh, what ``nvmlDeviceGetPowerUsage``
averages over, whether the power sensor sees the whole of each refresh period or only part of it,
whether ``NVML_FI_DEV_POWER_INSTANT`` answers, the counter's resolution, and whether the counter
exists at all. The presets follow public measurements (NVML's documentation, and Yang et al.,
"Part-time Power Measurements: nvidia-smi's Lack of Attention", 2023, who found A100 and H100 power
sampled 25 ms out of every 100 ms); they are approximations, and ``benchmarks/gpu_check.py`` measures
the real values on a real board.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BoardGeneration:
    """NVML behaviours of one board generation (see the module docstring)."""

    name: str
    model: str
    power_limit_w: float
    memory_total_b: int
    # The energy counter and both power readings refresh on this period (per-board phase).
    update_period_s: float = 0.1
    # nvmlDeviceGetPowerUsage: the mean over this window, ending at the last refresh.
    average_window_s: float = 1.0
    # Share of each refresh period the power sensor actually sees (its last part); 1.0 = all of it.
    sampled_fraction: float = 1.0
    # nvmlDeviceGetTotalEnergyConsumption exists (Volta and newer, not on some vGPU/MIG setups).
    energy_counter: bool = True
    # NVML_FI_DEV_POWER_INSTANT answers through nvmlDeviceGetFieldValues.
    power_instant: bool = True
    # True: the instant reading is the live power (the current 10 ms slot). False: it is the mean of the
    # last sampled part of the last refresh period, held until the next refresh (part-time sampling).
    instant_live: bool = True
    # The counter moves in steps of this many mJ.
    counter_quantum_mj: int = 1
    # NVML samples each process's utilisation on this period (about six times a second).
    process_sample_period_s: float = 1.0 / 6.0

    def __post_init__(self) -> None:
        if not 0.0 < self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction must be in (0, 1], got {self.sampled_fraction}")
        if self.update_period_s <= 0 or self.average_window_s <= 0 or self.process_sample_period_s <= 0:
            raise ValueError("update_period_s, average_window_s and process_sample_period_s must be positive")
        if self.counter_quantum_mj < 1:
            raise ValueError(f"counter_quantum_mj must be >= 1, got {self.counter_quantum_mj}")

    @property
    def power_scale(self) -> float:
        """Board power relative to the 700 W H100 the activity profiles are written for."""
        return self.power_limit_w / 700.0


H100 = BoardGeneration(
    name="h100",
    model="NVIDIA H100 80GB HBM3",
    power_limit_w=700.0,
    memory_total_b=81_559 * 1024 * 1024,
)

GENERATIONS: dict[str, BoardGeneration] = {
    # The default: 100 ms counter, 1 s average power, live instant power (wattwatch's reference board).
    "h100": H100,
    # The same board as the part-time sampling study measured it: the sensor sees 25 ms of every 100 ms.
    "h100-parttime": BoardGeneration(
        name="h100-parttime",
        model=H100.model,
        power_limit_w=H100.power_limit_w,
        memory_total_b=H100.memory_total_b,
        sampled_fraction=0.25,
        instant_live=False,
    ),
    # GA100 is the Ampere exception: nvmlDeviceGetPowerUsage is not a 1 s average but the last
    # (part-time) sample, as is the instant reading.
    "a100": BoardGeneration(
        name="a100",
        model="NVIDIA A100-SXM4-80GB",
        power_limit_w=400.0,
        memory_total_b=81_920 * 1024 * 1024,
        average_window_s=0.1,
        sampled_fraction=0.25,
        instant_live=False,
    ),
    # An H100 behind a vGPU/MIG setup that hides the energy counter: power only, instant power works.
    "h100-no-counter": BoardGeneration(
        name="h100-no-counter",
        model=H100.model,
        power_limit_w=H100.power_limit_w,
        memory_total_b=H100.memory_total_b,
        energy_counter=False,
    ),
    # Pre-Volta: no energy counter, no POWER_INSTANT field; nvmlDeviceGetPowerUsage is a short average.
    "p100": BoardGeneration(
        name="p100",
        model="Tesla P100-PCIE-16GB",
        power_limit_w=250.0,
        memory_total_b=16_280 * 1024 * 1024,
        update_period_s=0.02,
        average_window_s=0.02,
        energy_counter=False,
        power_instant=False,
        instant_live=False,
    ),
}


def generation(spec: str | BoardGeneration) -> BoardGeneration:
    """The preset named ``spec`` (``h100``, ``h100-parttime``, ``a100``, ``h100-no-counter``, ``p100``),
    or ``spec`` itself when it already is a BoardGeneration. Raises ValueError naming the presets."""
    if isinstance(spec, BoardGeneration):
        return spec
    try:
        return GENERATIONS[spec.lower()]
    except KeyError:
        raise ValueError(f"unknown GPU generation {spec!r}; use one of {', '.join(GENERATIONS)}") from None
