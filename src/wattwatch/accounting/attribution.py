"""Split one interval's device energy between the jobs that held the device and idle.

The invariant every report depends on: for every interval, ``sum(jobs) + idle == energy_j``,
with no negative part. Floating point makes proportional shares add up to slightly more or less
than the whole, so the last step always hands the rounding residue to someone explicitly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping


def split_interval(
    energy_j: float, shares: Mapping[str, float], idle_weight: float = 0.0
) -> tuple[dict[str, float], float]:
    """Attribute ``energy_j`` joules to jobs by weight; return ``(job id -> joules, idle joules)``.

    ``shares`` maps job id to a non-negative weight (SM utilisation, CPU time: any unit, only ratios
    matter); ``idle_weight`` is the part of the device no job held, in the same unit.

    - no jobs: everything is idle;
    - jobs, but every weight (idle included) is zero: the jobs split it equally, because a device a
      job holds without a measurable share is still that job's device;
    - jobs with zero weight next to others with weight get 0 J but stay in the result, so the caller
      still knows they were on the device.

    Energy is conserved: the parts sum to ``energy_j`` up to one rounding of the final addition, and
    when ``idle_weight`` is 0 the idle part is exactly 0.0 (a fully held GPU has no idle energy).
    Raises ValueError for a negative or non-finite energy or weight.
    """
    if not math.isfinite(energy_j) or energy_j < 0:
        raise ValueError(f"energy_j must be a finite, non-negative number of joules, got {energy_j!r}")
    for job_id, weight in shares.items():
        if not math.isfinite(weight) or weight < 0:
            raise ValueError(f"share of job {job_id!r} must be finite and non-negative, got {weight!r}")
    if not math.isfinite(idle_weight) or idle_weight < 0:
        raise ValueError(f"idle_weight must be finite and non-negative, got {idle_weight!r}")
    if not shares:
        return {}, energy_j
    if len(shares) == 1 and idle_weight == 0.0:
        # The common case, a GPU held by one job: it gets all of it, no arithmetic to round.
        (only,) = shares
        return {only: energy_j}, 0.0

    largest = max(max(shares.values()), idle_weight)
    if largest == 0.0:
        weights = dict.fromkeys(shares, 1.0)
        idle_w = 0.0
    else:
        # Scale by the largest weight so the sum can neither overflow nor lose every small weight.
        weights = {job_id: w / largest for job_id, w in shares.items()}
        idle_w = idle_weight / largest
    total_w = math.fsum(weights.values()) + idle_w
    parts = {job_id: energy_j * (w / total_w) for job_id, w in weights.items()}

    # The job with the biggest part absorbs the rounding residue: its part is at least
    # energy / n, far larger than any residue, so it cannot go negative.
    biggest = max(parts, key=parts.__getitem__)
    if idle_w == 0.0:
        others_j = math.fsum(v for k, v in parts.items() if k != biggest)
        parts[biggest] = max(energy_j - others_j, 0.0)
        return parts, 0.0
    idle_j = energy_j - math.fsum(parts.values())
    if idle_j < 0.0:
        parts[biggest] = max(parts[biggest] + idle_j, 0.0)
        idle_j = 0.0
    return parts, idle_j
