"""Grid carbon intensity per host, from codecarbon's own data files.

The files are read directly (JSON and CSV from the installed package, found with ``find_spec``, which
does not import it): importing codecarbon pulls pandas and probes drivers, which neither the agent nor a
report should pay for. codecarbon is an optional extra (``wattwatch[estimate]``); without it every host
gets the configured default intensity, and reports say so.

A region is either a country (ISO 3166-1: ``FR`` or ``FRA``, kept as alpha-3, codecarbon's key) or a
cloud provider and region (``gcp:europe-west9``, the rows of codecarbon's ``cloud/impact.csv``).
Countries use codecarbon's ``global_energy_mix.json`` figure (``carbon_intensity``, gCO2e/kWh, of the
year the file gives), as ``codecarbon.core.emissions`` does for private infrastructure.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from wattwatch.protocol import limits

COUNTRY_FILE = "data/private_infra/global_energy_mix.json"
CLOUD_FILE = "data/cloud/impact.csv"
_SYNTAX = re.compile(limits.GRID_REGION_PATTERN)
EXAMPLES = "an ISO country code such as FR or USA, or a cloud region such as gcp:europe-west9"


class UnknownRegion(ValueError):
    """A grid region that is malformed or not in codecarbon's data; the message says what to give."""


@dataclass(frozen=True)
class GridIntensity:
    """gCO2e per kWh delivered by a host's grid, with where the figure comes from."""

    g_per_kwh: float
    source: str  # "codecarbon data: France (FRA) 2023", "config default"
    region: str | None = None  # canonical: "FRA", "gcp:europe-west9"; None for the configured default


def package_file(package: str, relative: str) -> Path | None:
    """``relative`` inside the installed ``package`` (None when either is missing), without importing it."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / relative
        if path.is_file():
            return path
    return None


@cache
def country_table() -> dict[str, tuple[float, str, int | None]] | None:
    """alpha-3 code -> (gCO2e/kWh, country name, year) from codecarbon's energy mix; None without the file."""
    path = package_file("codecarbon", COUNTRY_FILE)
    if path is None:
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    world = _world_average()
    table: dict[str, tuple[float, str, int | None]] = {}
    for code, row in data.items():
        # codecarbon computes a figure from the mix when the country has none; the file gives one for all
        # but a few, and for those codecarbon's fallback is the world average: so is ours.
        intensity = row.get("carbon_intensity")
        year = row.get("year")
        table[code.upper()] = (
            float(intensity if intensity is not None else world),
            str(row.get("country_name") or code),
            int(year) if year is not None else None,
        )
    return table


def _world_average() -> float:
    path = package_file("codecarbon", "data/private_infra/carbon_intensity_per_source.json")
    if path is None:
        return 475.0  # the figure codecarbon 3.x ships (IEA 2019)
    return float(json.loads(path.read_text(encoding="utf-8"))["world_average"])


@cache
def cloud_table() -> dict[str, tuple[float, str]] | None:
    """``provider:region`` -> (gCO2e/kWh, country) from codecarbon's cloud file; None without the file."""
    path = package_file("codecarbon", CLOUD_FILE)
    if path is None:
        return None
    table: dict[str, tuple[float, str]] = {}
    with path.open(encoding="utf-8-sig", newline="") as f:  # the file starts with a byte-order mark
        for row in csv.DictReader(f):
            try:
                table[f"{row['provider']}:{row['region']}".lower()] = (float(row["impact"]), row["country_name"])
            except (KeyError, ValueError):
                continue
    return table


@cache
def _alpha2() -> dict[str, str]:
    """alpha-2 -> alpha-3 from pycountry's ISO 3166-1 file (a codecarbon dependency); empty without it."""
    path = package_file("pycountry", "databases/iso3166-1.json")
    if path is None:
        return {}
    rows = json.loads(path.read_text(encoding="utf-8"))["3166-1"]
    return {r["alpha_2"].upper(): r["alpha_3"].upper() for r in rows}


def normalize(region: str) -> str:
    """``region`` in canonical form (``FRA``, ``gcp:europe-west9``); UnknownRegion when it is malformed.

    An alpha-2 code stays as given (upper case) where pycountry's table is not installed (a slim agent):
    the collector, which has the data, maps it.
    """
    text = region.strip()
    if not _SYNTAX.match(text):
        raise UnknownRegion(f"grid region {region!r} is not {EXAMPLES}")
    if ":" in text:
        return text.lower()
    code = text.upper()
    return _alpha2().get(code, code) if len(code) == 2 else code


def lookup(region: str) -> GridIntensity | None:
    """The intensity of ``region`` (any accepted spelling) from codecarbon's data; None when codecarbon's
    data is not installed; UnknownRegion when the region is malformed or not in the data."""
    code = normalize(region)
    if ":" in code:
        clouds = cloud_table()
        if clouds is None:
            return None
        if code not in clouds:
            known = ", ".join(sorted(clouds)[:6])
            raise UnknownRegion(
                f"grid region {region!r} is not a cloud region in codecarbon's data (it lists only providers that "
                f"publish figures, e.g. {known}); give the region's country code instead, e.g. USA"
            )
        g, country = clouds[code]
        return GridIntensity(g, f"codecarbon data: {code} ({country}, provider's figure)", code)
    countries = country_table()
    if countries is None:
        return None
    if len(code) == 2 and _alpha2():
        raise UnknownRegion(f"grid region {region!r} is not an ISO 3166 country code; use e.g. FR, USA, DEU")
    if code not in countries:
        raise UnknownRegion(f"grid region {region!r} is not a country in codecarbon's data; use e.g. FR, USA, DEU")
    g, name, year = countries[code]
    return GridIntensity(g, f"codecarbon data: {name} ({code}) {year or ''}".rstrip(), code)


@cache
def exact_regions() -> frozenset[str] | None:
    """Every region a batch may name, each spelled as the agent sends it (``check_region``'s canonical form,
    or an alpha-2 code an agent without pycountry keeps): what the collector's OpenAPI document lists. None
    without codecarbon's data, when only a region's form can be checked."""
    countries, clouds = country_table(), cloud_table()
    if countries is None or clouds is None:
        return None
    alpha2 = {a2 for a2, a3 in _alpha2().items() if a3 in countries}
    return frozenset({*countries, *alpha2, *clouds})


def check_region(region: str) -> str:
    """``region`` in canonical form, refused (UnknownRegion) when malformed or, with codecarbon's data
    installed, not in it. Without the data only its form can be checked."""
    code = normalize(region)
    lookup(code)
    return code


def data_installed() -> bool:
    """Whether codecarbon's intensity data is installed (the ``estimate`` extra)."""
    return country_table() is not None
