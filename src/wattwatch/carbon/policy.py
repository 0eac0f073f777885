"""Which grid intensity, PUE and price each host's energy is charged at, and how reports state them.

A host's region is, first to last: the collector's per-host override (``grid_regions``), the region its
agent sent (``hosts.grid_region``), the collector's own ``grid_region``. A region's intensity comes from
codecarbon's data (``wattwatch.carbon.grid``); with no region, or a region the data cannot answer, the host gets
``grid_intensity_g_per_kwh`` and its source says why.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from wattwatch.accounting.carbon import emissions_g
from wattwatch.carbon import grid
from wattwatch.config import Settings
from wattwatch.errors import ConfigError
from wattwatch.protocol.units import j_to_kwh


@dataclass(frozen=True)
class CarbonPolicy:
    """The carbon and cost settings a report applies. Build it with ``from_settings``."""

    default_g_per_kwh: float = 400.0
    pue: float = 1.0
    price_per_kwh: float = 0.0
    currency: str = "USD"
    default_region: str = ""
    host_regions: tuple[tuple[str, str], ...] = ()  # (host glob, canonical region), first match wins

    def region_of(self, host: str, sent_region: str | None) -> tuple[str | None, str]:
        """``host``'s region and who set it (``collector override``, ``agent``, ``collector default``)."""
        for pattern, region in self.host_regions:
            if fnmatch.fnmatchcase(host, pattern):
                return region, "collector override"
        if sent_region:
            return sent_region, "agent"
        if self.default_region:
            return self.default_region, "collector default"
        return None, ""

    def intensity(self, host: str, sent_region: str | None = None) -> grid.GridIntensity:
        """The grid intensity ``host``'s energy is charged at, with its source."""
        region, by = self.region_of(host, sent_region)
        if region is None:
            return grid.GridIntensity(self.default_g_per_kwh, "config default")
        try:
            found = grid.lookup(region)
        except grid.UnknownRegion:
            return grid.GridIntensity(self.default_g_per_kwh, f"config default ({region} is not in codecarbon's data)")
        if found is None:
            why = f"region {region} set, but codecarbon's data is not installed: pip install 'wattwatch[estimate]'"
            return grid.GridIntensity(self.default_g_per_kwh, f"config default ({why})")
        return grid.GridIntensity(found.g_per_kwh, f"{found.source}, region set by {by}", found.region)

    def emissions_g(self, energy_j: float, intensity: grid.GridIntensity) -> float:
        """Grams CO2e for ``energy_j`` device joules at ``intensity`` and this PUE."""
        return emissions_g(energy_j, intensity.g_per_kwh, self.pue)

    def cost(self, energy_j: float) -> float | None:
        """The energy's cost in ``currency`` (PUE included); None when no price is configured."""
        if self.price_per_kwh <= 0:
            return None
        return j_to_kwh(energy_j) * self.pue * self.price_per_kwh

    def summary(self, hosts: Iterable[tuple[str, str | None]], jobs: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
        """The report's ``carbon`` section: PUE, price, each host's intensity and source, totals per kind."""
        by_kind: dict[str, dict[str, float]] = {}
        for job in jobs:
            k = by_kind.setdefault(str(job["kind"]), {"energy_j": 0.0, "emissions_g": 0.0, "cost": 0.0})
            k["energy_j"] += float(job["energy_j"])
            k["emissions_g"] += float(job["emissions_g"])
            k["cost"] += float(job.get("cost") or 0.0)
        priced = self.price_per_kwh > 0
        return {
            "pue": self.pue,
            "price_per_kwh": self.price_per_kwh if priced else None,
            "currency": self.currency if priced else None,
            "default_g_per_kwh": self.default_g_per_kwh,
            "hosts": [
                {"host": name, "region": i.region, "g_per_kwh": i.g_per_kwh, "source": i.source}
                for name, sent in sorted(set(hosts))
                for i in [self.intensity(name, sent)]
            ],
            "by_kind": [
                {
                    "kind": kind,
                    "energy_j": v["energy_j"],
                    "emissions_g": v["emissions_g"],
                    "cost": v["cost"] if priced else None,
                }
                for kind, v in sorted(by_kind.items())
            ],
            "emissions_g": math.fsum(v["emissions_g"] for v in by_kind.values()),
            "cost": math.fsum(v["cost"] for v in by_kind.values()) if priced else None,
        }


def parse_host_regions(text: str) -> tuple[tuple[str, str], ...]:
    """``"gpu-par-*=FR, gpu-ohio-*=USA"`` -> ((glob, canonical region), ...); ConfigError saying what to fix."""
    pairs: list[tuple[str, str]] = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        pattern, sep, region = item.partition("=")
        if not sep or not pattern.strip():
            raise ConfigError(
                f"grid_regions item {item!r} is not HOSTGLOB=REGION; use e.g. gpu-par-*=FR,gpu-ohio-*=USA"
            )
        try:
            pairs.append((pattern.strip(), grid.check_region(region)))
        except grid.UnknownRegion as exc:
            raise ConfigError(f"grid_regions {item!r}: {exc}") from None
    return tuple(pairs)


def from_settings(settings: Settings) -> CarbonPolicy:
    """The policy ``settings`` describe; ConfigError naming the setting when a region, PUE or price is bad."""
    if not (math.isfinite(settings.pue) and settings.pue >= 1.0):
        raise ConfigError(f"PUE {settings.pue!r} must be a number >= 1 (WATTWATCH_PUE / pue)")
    if not (math.isfinite(settings.grid_intensity_g_per_kwh) and settings.grid_intensity_g_per_kwh >= 0):
        raise ConfigError("grid_intensity_g_per_kwh must be a number >= 0 (WATTWATCH_GRID_INTENSITY)")
    if not (math.isfinite(settings.price_per_kwh) and settings.price_per_kwh >= 0):
        raise ConfigError("price_per_kwh must be a number >= 0 (WATTWATCH_PRICE_PER_KWH)")
    region = ""
    if settings.grid_region:
        try:
            region = grid.check_region(settings.grid_region)
        except grid.UnknownRegion as exc:
            raise ConfigError(f"{exc} (grid_region / WATTWATCH_GRID_REGION)") from None
    return CarbonPolicy(
        default_g_per_kwh=settings.grid_intensity_g_per_kwh,
        pue=settings.pue,
        price_per_kwh=settings.price_per_kwh,
        currency=settings.currency,
        default_region=region,
        host_regions=parse_host_regions(settings.grid_regions),
    )
