"""CPU package and DRAM energy from Linux powercap RAPL counters (``/sys/class/powercap/intel-rapl:*``).

Each zone's ``energy_uj`` is a wrapping counter; a value lower than the previous one wrapped once
(add ``max_energy_range_uj``). Two wraps in one interval look exactly like one, so the reader must come
back before the counter can wrap twice: ``max_poll_interval_s`` is half the shortest wrap period at
the zones' maximum power (``constraint_0_max_power_uw``; the package's for a DRAM zone without its
own; ``DEFAULT_MAX_POWER_W`` when the kernel gives none), and an interval longer than a whole wrap
period is flagged ``wrap_ambiguous``. AMD packages appear under the same ``intel-rapl`` names. The
root is a constructor parameter so tests read a fixture tree.

Zones: ``intel-rapl:N`` named ``package-P`` -> device ``cpuP``; its sub-zone named ``dram`` ->
``dramP``; ``psys`` (whole SoC platform) only with ``include_psys=True``, since it contains the packages
and would count them twice next to them. ``core``/``uncore`` sub-zones are parts of the package and skipped.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from wattwatch.errors import DeviceNotFound, PermissionDenied, SensorError
from wattwatch.protocol.units import DeviceKind, uj_to_j
from wattwatch.sensors.base import DeviceInfo, EnergyReading

log = logging.getLogger(__name__)

_ZONE = re.compile(r"^intel-rapl:(\d+)(?::(\d+))?$")

# No server package today draws this much (EPYC 9965: 500 W TDP); the halving in max_poll_interval_s
# covers short-term limits (PL2) above the long-term maximum.
DEFAULT_MAX_POWER_W = 500.0
POLL_SAFETY_FACTOR = 2.0

PERMISSION_FIX = (
    "run the agent as root, or make energy_uj readable with a udev rule such as "
    'SUBSYSTEM=="powercap", ACTION=="add", RUN+="/bin/chmod a+r /sys%p/energy_uj" '
    "(since Linux 5.10 only root may read it)"
)


@dataclass
class _Zone:
    info: DeviceInfo
    path: Path
    max_range_uj: int
    last_uj: int
    t_s: float
    max_power_w: float = DEFAULT_MAX_POWER_W
    total_uj: int = 0  # unwrapped energy since the sensor started
    power_w: float = 0.0  # over the last interval, for read_at
    ambiguous: bool = False  # the last interval was long enough to hide a second wrap

    @property
    def wrap_period_s(self) -> float:
        """Seconds the counter takes to wrap at the zone's maximum power (inf without a range)."""
        if self.max_range_uj <= 0:
            return float("inf")
        return self.max_range_uj / (self.max_power_w * 1e6)


def _max_power_w(path: Path) -> float | None:
    """The zone's ``constraint_0_max_power_uw`` in W; None when absent, unreadable or 0 (unknown)."""
    try:
        value_uw = int((path / "constraint_0_max_power_uw").read_text().strip())
    except (OSError, ValueError):
        return None
    return value_uw / 1e6 if value_uw > 0 else None


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text().strip())
    except PermissionError:
        raise PermissionDenied(f"cannot read {path}: permission denied; {PERMISSION_FIX}") from None
    except (OSError, ValueError) as exc:
        raise SensorError(f"cannot read {path} ({exc}); is the intel_rapl_common module loaded?") from None


class RaplSensor:
    """CPU packages (``cpuN``) and their DRAM (``dramN``) through powercap RAPL ``energy_uj`` counters."""

    name = "rapl"

    def __init__(
        self,
        root: Path = Path("/sys/class/powercap"),
        clock: Callable[[], float] = time.time,
        *,
        include_psys: bool = False,
    ) -> None:
        self.root = root
        self._clock = clock
        self._lock = threading.Lock()
        self._zones = self._discover(include_psys)
        if not self._zones:
            raise DeviceNotFound(
                f"no RAPL package zones under {root}; this CPU or kernel offers no RAPL (common in VMs), "
                "or the intel_rapl_common module is not loaded (modprobe intel_rapl_common)"
            )

    def _discover(self, include_psys: bool) -> list[_Zone]:
        try:
            entries = sorted(p for p in self.root.iterdir() if _ZONE.match(p.name))
        except OSError:
            return []
        zones: list[_Zone] = []
        package_of: dict[str, int] = {}  # "intel-rapl:N" -> package number P
        package_max_w: dict[str, float] = {}  # "intel-rapl:N" -> the package's max power
        for path in sorted(entries, key=lambda p: p.name.count(":")):  # packages before their sub-zones
            m = _ZONE.match(path.name)
            assert m is not None
            try:
                zone_name = (path / "name").read_text().strip()
            except OSError:
                continue
            kind: DeviceKind
            if m.group(2) is None:
                if zone_name.startswith("package-"):
                    number = int(zone_name.split("-", 1)[1]) if zone_name[8:].isdigit() else int(m.group(1))
                    package_of[f"intel-rapl:{m.group(1)}"] = number
                    key, kind = f"cpu{number}", "cpu"
                elif zone_name == "psys" and include_psys:
                    key, kind, number = "psys0", "cpu", 0
                else:
                    continue
            elif zone_name == "dram":
                number = package_of.get(f"intel-rapl:{m.group(1)}", int(m.group(1)))
                key, kind = f"dram{number}", "dram"
            else:
                continue  # core/uncore are inside the package's own count
            if not (path / "energy_uj").exists():
                continue
            raw_uj = _read_int(path / "energy_uj")
            try:
                max_range_uj = int((path / "max_energy_range_uj").read_text().strip())
            except (OSError, ValueError):
                max_range_uj = 0
            parent = f"intel-rapl:{m.group(1)}"
            max_w = _max_power_w(path) or package_max_w.get(parent) or DEFAULT_MAX_POWER_W
            if m.group(2) is None:
                package_max_w[parent] = max_w
            info = DeviceInfo(key=key, kind=kind, index=number, model=f"RAPL {zone_name}")
            zones.append(
                _Zone(
                    info=info,
                    path=path,
                    max_range_uj=max_range_uj,
                    last_uj=raw_uj,
                    t_s=self._clock(),
                    max_power_w=max_w,
                )
            )
        return zones

    def _advance(self, zone: _Zone) -> None:
        raw_uj = _read_int(zone.path / "energy_uj")
        now_s = self._clock()
        if now_s - zone.t_s > zone.wrap_period_s:
            # Long enough to wrap twice at full power: the delta below may be short by whole ranges.
            zone.ambiguous = True
            log.warning(
                "%s: %.1f s between reads, longer than the counter's %.1f s wrap period at %.0f W; energy may "
                "be missing; read at least every %.1f s",
                zone.info.key,
                now_s - zone.t_s,
                zone.wrap_period_s,
                zone.max_power_w,
                self.max_poll_interval_s,
            )
        delta_uj = raw_uj - zone.last_uj
        if delta_uj < 0:
            # Went down: wrapped once (the agent reads far more often than the wrap period).
            delta_uj += zone.max_range_uj
            if delta_uj < 0:
                log.warning("%s: counter went down with no usable max_energy_range_uj; interval skipped", zone.path)
                delta_uj = 0
        if now_s > zone.t_s:
            zone.power_w = uj_to_j(delta_uj) / (now_s - zone.t_s)
        zone.total_uj += delta_uj
        zone.last_uj, zone.t_s = raw_uj, now_s

    def devices(self) -> Sequence[DeviceInfo]:
        """``cpuN`` per package and ``dramN`` where the package exposes a DRAM zone."""
        return [z.info for z in self._zones]

    @property
    def max_poll_interval_s(self) -> float:
        """The longest safe time between reads: half the shortest wrap period at maximum power, so two
        wraps never fit in one interval. The agent ticks at least this often (inf: no zone wraps)."""
        return min(z.wrap_period_s for z in self._zones) / POLL_SAFETY_FACTOR

    def wrap_periods_s(self) -> dict[str, float]:
        """Per device key, the seconds its counter takes to wrap at the zone's maximum power."""
        return {z.info.key: z.wrap_period_s for z in self._zones}

    def _reading(self, zone: _Zone, t_s: float, energy_j: float) -> EnergyReading:
        flags: tuple[str, ...] = ("wrap_ambiguous",) if zone.ambiguous else ()
        zone.ambiguous = False
        # energy_uj's own value at t_s: the unwrapped total and the raw counter differ by whole ranges
        # (and the initial value), so the difference maps one onto the other.
        counter_j = energy_j - uj_to_j(zone.total_uj - zone.last_uj)
        wrap_j = uj_to_j(zone.max_range_uj) if zone.max_range_uj > 0 else 0.0
        if wrap_j:
            counter_j %= wrap_j
        return EnergyReading(zone.info.key, t_s, energy_j, "counter", flags, counter_j=counter_j, counter_wrap_j=wrap_j)

    def read(self) -> list[EnergyReading]:
        """Cumulative J per zone since the sensor started, unwrapped."""
        with self._lock:
            out = []
            for zone in self._zones:
                self._advance(zone)
                out.append(self._reading(zone, zone.t_s, uj_to_j(zone.total_uj)))
            return out

    def read_at(self, t_s: float) -> list[EnergyReading]:
        """Cumulative J at ``t_s`` (just past): RAPL updates every ~1 ms, so read now and take off the
        energy since ``t_s`` at the power of the interval just read."""
        with self._lock:
            out = []
            for zone in self._zones:
                previous_j = uj_to_j(zone.total_uj)
                self._advance(zone)
                energy_j = uj_to_j(zone.total_uj) - zone.power_w * max(0.0, zone.t_s - t_s)
                out.append(self._reading(zone, t_s, max(previous_j, energy_j)))
            return out

    def close(self) -> None:
        """Nothing to release; idempotent."""
