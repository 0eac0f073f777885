"""Carbon: gCO2e = kWh x PUE x grid intensity."""

from __future__ import annotations

from wattwatch.protocol.units import j_to_kwh


def emissions_g(energy_j: float, grid_intensity_g_per_kwh: float, pue: float) -> float:
    """Grams of CO2e for ``energy_j`` joules measured at the device.

    ``pue`` (power usage effectiveness, >= 1 in a real data centre) scales device energy up to the
    facility's draw; ``grid_intensity_g_per_kwh`` is the grid's gCO2e per kWh delivered.
    """
    if energy_j < 0 or grid_intensity_g_per_kwh < 0 or pue < 0:
        raise ValueError("energy, grid intensity and PUE must not be negative")
    return j_to_kwh(energy_j) * pue * grid_intensity_g_per_kwh
