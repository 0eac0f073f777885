"""Figures for people: energy, emissions and durations in readable units, never an exponent."""

from __future__ import annotations

import math


def format_energy(energy_j: float | None) -> str:
    """Joules in a readable unit: ``812 J``, ``45.2 kJ``, ``1660 kJ``, ``3.41 kWh``, ``15.7 MWh``; never
    an exponent, which people misread."""
    if energy_j is None:
        return "-"
    if energy_j >= 3.6e9:
        return f"{figure(energy_j / 3.6e9)} MWh"
    if energy_j >= 3.6e6:
        return f"{figure(energy_j / 3.6e6)} kWh"
    if energy_j >= 1e4:
        return f"{figure(energy_j / 1e3)} kJ"
    if energy_j >= 10:
        return f"{energy_j:.0f} J"
    return f"{figure(energy_j)} J"


def figure(value: float) -> str:
    """Three significant digits without an exponent: ``0.0000278``, ``1.25``, ``1660`` (not 1.66e+03)."""
    if abs(value) >= 999.5:
        return f"{value:.0f}"
    text = f"{value:.3g}"
    if "e" in text:  # tiny: as many decimals as three significant digits need
        text = f"{value:.{min(2 - math.floor(math.log10(abs(value))), 15)}f}"
    return text


def format_grams(grams: float) -> str:
    """CO2e in a readable unit: ``140 g``, ``1.06 kg``, ``3.2 t``."""
    if grams >= 1e6:
        return f"{figure(grams / 1e6)} t"
    if grams >= 1e3:
        return f"{grams / 1e3:.3g} kg"
    return f"{figure(grams)} g"


def format_duration(duration_s: float | None) -> str:
    """Seconds as ``42.0s``, ``12m03s``, ``5h07m``."""
    if duration_s is None:
        return "-"
    if duration_s < 60:
        return f"{duration_s:.1f}s"
    if duration_s < 3600:
        return f"{int(duration_s // 60)}m{int(duration_s % 60):02d}s"
    return f"{int(duration_s // 3600)}h{int(duration_s % 3600 // 60):02d}m"
