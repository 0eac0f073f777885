"""The benchmarks' truth for energy per request, written apart from wattwatch's accounting on purpose.

The rule being measured: at every instant, the board's energy is shared equally by the requests in
flight then; energy at instants with none in flight is waiting energy. Cut the time line at every
request's start and end: inside each piece the set of requests in flight is constant, so each of them
gets the piece's exact energy (the simulator's integral of its true instantaneous power) divided by
their number. No tick, no interval, no wattwatch code: only the simulator's truth and this loop.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence

EnergyFn = Callable[[float, float], float]  # exact joules over [t0_s, t1_s]


def exact_request_energy(
    energy_j: EnergyFn, spans: Sequence[tuple[float, float]], t0_s: float, t1_s: float
) -> tuple[list[float], float]:
    """(exact joules of each span inside ``[t0_s, t1_s]``, waiting joules) from ``energy_j``.

    O(pieces x requests in flight): fine for the thousands of requests a benchmark serves.
    """
    cuts = {t0_s, t1_s}
    for a, b in spans:
        cuts.update(t for t in (a, b) if t0_s < t < t1_s)
    edges = sorted(cuts)
    out = [0.0] * len(spans)
    waiting_j = 0.0
    by_start = sorted(range(len(spans)), key=lambda i: spans[i][0])
    nxt = 0
    in_flight: list[int] = []
    for a, b in itertools.pairwise(edges):
        # Requests that started by the piece's start and end at or after its end are in flight all of it.
        while nxt < len(by_start) and spans[by_start[nxt]][0] <= a:
            in_flight.append(by_start[nxt])
            nxt += 1
        in_flight = [i for i in in_flight if spans[i][1] >= b]
        piece_j = energy_j(a, b)
        if in_flight:
            for i in in_flight:
                out[i] += piece_j / len(in_flight)
        else:
            waiting_j += piece_j
    return out, waiting_j


def quantile(values: Sequence[float], q: float) -> float:
    """The nearest-rank ``q``-quantile (the ceil(q x n)-th smallest value), as the reports define it."""
    ordered = sorted(values)
    rank = min(max(math.ceil(q * len(ordered)), 1), len(ordered))
    return ordered[rank - 1]
