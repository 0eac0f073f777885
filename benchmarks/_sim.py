"""The simulator, imported here and nowhere else in benchmarks/ that this module serves: where the
simulator's module moves, this import is the one line to change."""

from __future__ import annotations

from wattwatch.sim.fleet import SimulatedFleet

__all__ = ["SimulatedFleet"]
