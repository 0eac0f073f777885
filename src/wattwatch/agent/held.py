"""What the agent holds in memory while its spool cannot be written (a full disk), and the time it dropped.

The outbox (``agent.outbox``) keeps what was added and not yet written in memory; a write that fails
puts its records back, in order, so they wait for the next one. That memory is bounded: past
``MAX_HELD_INTERVALS`` intervals the oldest are dropped, and past ``MAX_HELD_SPANS`` spans and counts
the oldest of those. A dropped interval is not forgotten: ``Dropped`` keeps, per device, the spans of
time whose intervals went, merged, and the first write that succeeds sends each as one zero-energy
interval flagged ``gap`` (like a restart's ``restart_gap``), so reports say "N s not measured" instead
of counting less.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from wattwatch.protocol import limits, wire
from wattwatch.protocol.units import Source

GAP = "gap"
# An hour of 10 devices (8 GPUs, a CPU package and its DRAM) at the default 1 s tick: a full disk freed
# within the hour loses nothing. An interval takes 0.4 kB in memory (its struct, a one-job shares dict and
# its flags list, measured with tracemalloc), so the buffer holds at most about 15 MB.
MAX_HELD_INTERVALS = 36_000
# Request spans and scraped counts: an hour of 25 requests a second. A span takes 0.14 kB, so at most
# about 13 MB. Spans dropped leave no gap (their energy is still measured); they are counted and said.
MAX_HELD_SPANS = 90_000


@dataclass
class _Span:
    """Dropped time on one device: ``[t_start_s, t_end_s]``, the source and the jobs that held it then."""

    t_start_s: float
    t_end_s: float
    source: Source
    holders: set[str] = field(default_factory=set)


class Dropped:
    """Per device, the time spans whose intervals were dropped (merged where they touch); not thread-safe
    (the outbox calls it under its lock)."""

    def __init__(self) -> None:
        self._spans: dict[str, list[_Span]] = {}
        self.intervals = 0  # measured intervals dropped since the agent started (gap intervals not counted)

    def __bool__(self) -> bool:
        return bool(self._spans)

    def add(self, intervals: Iterable[wire.Interval]) -> None:
        """Note ``intervals`` as dropped: their time joins their device's dropped spans. A gap interval
        dropped again (it was waiting to be written) is the same time, not a measured interval more."""
        for iv in intervals:
            if GAP not in iv.flags:
                self.intervals += 1
            spans = self._spans.setdefault(iv.device, [])
            merged = _Span(iv.t_start_s, iv.t_end_s, iv.source, set(iv.shares))
            kept: list[_Span] = []
            for span in spans:
                # Touching spans merge: a device's intervals follow each other end to start.
                if span.t_start_s <= merged.t_end_s and merged.t_start_s <= span.t_end_s:
                    merged.t_start_s = min(merged.t_start_s, span.t_start_s)
                    merged.t_end_s = max(merged.t_end_s, span.t_end_s)
                    merged.holders |= span.holders
                    merged.source = span.source
                else:
                    kept.append(span)
            kept.append(merged)
            kept.sort(key=lambda s: s.t_start_s)
            self._spans[iv.device] = kept

    def dropped_s(self) -> float:
        """Device time waiting to be sent as gaps, summed over devices (s)."""
        return math.fsum(s.t_end_s - s.t_start_s for spans in self._spans.values() for s in spans)

    def take(self) -> list[wire.Interval]:
        """One zero-energy interval flagged ``gap`` per dropped span, covering exactly that span; forgets
        them (a failed write hands them back through ``add``)."""
        out = []
        for key, spans in self._spans.items():
            for span in spans:
                holders = sorted(span.holders)[: limits.MAX_SHARES]
                out.append(
                    wire.Interval(
                        device=key,
                        t_start_s=span.t_start_s,
                        t_end_s=span.t_end_s,
                        energy_j=0.0,
                        source=span.source,
                        shares=dict.fromkeys(holders, 1.0),
                        flags=[GAP],
                    )
                )
        self._spans = {}
        return out
