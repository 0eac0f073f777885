"""Pure accounting: interval energy -> jobs, idle and carbon. No I/O; the data is passed in.

Everything here keeps one invariant, on every device and for every interval:
sum over jobs + idle == device energy (see ``attribution.split_interval``).
"""

from wattwatch.accounting.attribution import split_interval
from wattwatch.accounting.carbon import emissions_g
from wattwatch.accounting.rollup import BatchRollup, IntervalIn, rollup_intervals

__all__ = ["BatchRollup", "IntervalIn", "emissions_g", "rollup_intervals", "split_interval"]
