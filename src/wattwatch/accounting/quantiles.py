"""Percentiles of per-span energies: exact for a list, and a mergeable sketch for a job that never ends.

A serving job can complete millions of requests, and its per-query energies are recomputed window
by window as data arrives. Its p50/p95 must not cost a read of every query ever served, so the
collector keeps an ``EnergySketch`` per job: a histogram on logarithmic buckets (the DDSketch idea)
whose quantiles are within ``relative_accuracy`` of the exact order statistic. Values can be taken
out again (``remove``), which is what lets a window be recomputed: remove the old values, add the new.

Quantiles here are *nearest rank*: the q-quantile of n values is the ceil(q * n)-th smallest.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

DEFAULT_RELATIVE_ACCURACY = 0.002
# Enough for values spread over about 4 decades at 0.2 %; past it the lowest buckets merge, which
# only blurs quantiles far below the median.
DEFAULT_MAX_BUCKETS = 2048


def nearest_rank(values: Iterable[float], q: float) -> float | None:
    """The exact nearest-rank ``q``-quantile (0 < q <= 1) of ``values``; None when there are none."""
    ordered = sorted(values)
    if not ordered:
        return None
    return ordered[_rank(q, len(ordered)) - 1]


def _rank(q: float, n: int) -> int:
    if not 0.0 < q <= 1.0:
        raise ValueError(f"quantile must be in (0, 1], got {q!r}")
    return min(max(math.ceil(q * n), 1), n)


class EnergySketch:
    """Counts of non-negative values (joules) in buckets ``(gamma**(i-1), gamma**i]``; zeros apart.

    ``gamma = (1 + a) / (1 - a)`` for relative accuracy ``a``: every value in bucket ``i`` is within
    ``a`` of the bucket's representative ``2 gamma**i / (gamma + 1)``. The bucket of a value is a
    pure function of it, so ``remove(x)`` finds exactly the bucket ``add(x)`` used, in any process.
    """

    def __init__(
        self,
        relative_accuracy: float = DEFAULT_RELATIVE_ACCURACY,
        *,
        max_buckets: int = DEFAULT_MAX_BUCKETS,
    ) -> None:
        if not 0.0 < relative_accuracy < 1.0:
            raise ValueError(f"relative_accuracy must be in (0, 1), got {relative_accuracy!r}")
        self.relative_accuracy = relative_accuracy
        self.max_buckets = max_buckets
        self._gamma = (1.0 + relative_accuracy) / (1.0 - relative_accuracy)
        self._log_gamma = math.log(self._gamma)
        self.buckets: dict[int, int] = {}
        self.zeros = 0
        # Once buckets merged, every index below this one counts in it.
        self.floor_index: int | None = None

    @property
    def count(self) -> int:
        """How many values the sketch holds."""
        return self.zeros + sum(self.buckets.values())

    def _index(self, value_j: float) -> int:
        index = math.ceil(math.log(value_j) / self._log_gamma)
        return index if self.floor_index is None else max(index, self.floor_index)

    def add(self, value_j: float, n: int = 1) -> None:
        """Count ``value_j`` (>= 0, finite) ``n`` more times."""
        if not math.isfinite(value_j) or value_j < 0.0:
            raise ValueError(f"a sketch holds finite energies >= 0, got {value_j!r}")
        if value_j == 0.0:
            self.zeros += n
            return
        index = self._index(value_j)
        self.buckets[index] = self.buckets.get(index, 0) + n
        if len(self.buckets) > self.max_buckets:
            self._merge_lowest()

    def remove(self, value_j: float, n: int = 1) -> None:
        """Take back ``n`` counts of a value added before. Raises ValueError if it is not there."""
        if value_j == 0.0:
            if self.zeros < n:
                raise ValueError("removing a zero the sketch does not hold")
            self.zeros -= n
            return
        index = self._index(value_j)
        have = self.buckets.get(index, 0)
        if have < n:
            raise ValueError(f"removing {value_j!r} J, which the sketch does not hold")
        if have == n:
            del self.buckets[index]
        else:
            self.buckets[index] = have - n

    def quantile(self, q: float) -> float | None:
        """The nearest-rank ``q``-quantile, within ``relative_accuracy``; None when empty."""
        n = self.count
        if n == 0:
            return None
        rank = _rank(q, n)
        if rank <= self.zeros:
            return 0.0
        seen = self.zeros
        for index in sorted(self.buckets):
            seen += self.buckets[index]
            if seen >= rank:
                return 2.0 * self._gamma**index / (self._gamma + 1.0)
        raise AssertionError("unreachable: ranks never exceed the count")

    def _merge_lowest(self) -> None:
        ordered = sorted(self.buckets)
        keep = ordered[-self.max_buckets :]
        new_floor = keep[0]
        merged = sum(self.buckets.pop(i) for i in ordered[: len(ordered) - self.max_buckets])
        self.buckets[new_floor] += merged
        self.floor_index = new_floor

    def to_json(self) -> dict[str, Any]:
        """A plain dict (JSON column) that ``from_json`` turns back into an equal sketch."""
        return {
            "relative_accuracy": self.relative_accuracy,
            "max_buckets": self.max_buckets,
            "zeros": self.zeros,
            "floor_index": self.floor_index,
            "buckets": {str(i): c for i, c in sorted(self.buckets.items())},
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | None) -> EnergySketch:
        """The sketch ``to_json`` wrote; an empty default sketch for None."""
        if not data:
            return cls()
        sketch = cls(float(data["relative_accuracy"]), max_buckets=int(data["max_buckets"]))
        sketch.zeros = int(data["zeros"])
        floor = data.get("floor_index")
        sketch.floor_index = None if floor is None else int(floor)
        sketch.buckets = {int(i): int(c) for i, c in data["buckets"].items()}
        return sketch
