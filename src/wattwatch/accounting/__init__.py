"""Pure accounting: interval energy -> jobs, idle and carbon. No I/O; the data is passed in.

Everything here keeps one invariant, on every device and for every interval:
sum over jobs + idle == device energy (see ``attribution.split_interval``); and for every job,
sum over its spans + waiting == job energy (see ``spans.split_job_energy``).
"""

from wattwatch.accounting.attribution import split_interval
from wattwatch.accounting.carbon import emissions_g
from wattwatch.accounting.quantiles import EnergySketch, nearest_rank
from wattwatch.accounting.rollup import BatchRollup, IntervalIn, rollup_intervals
from wattwatch.accounting.spans import EnergySplit, split_job_energy

__all__ = [
    "BatchRollup",
    "EnergySketch",
    "EnergySplit",
    "IntervalIn",
    "emissions_g",
    "nearest_rank",
    "rollup_intervals",
    "split_interval",
    "split_job_energy",
]
