"""``CUDA_VISIBLE_DEVICES`` resolved to wattwatch's GPU device keys (indices, UUIDs, UUID prefixes)."""

from __future__ import annotations

from collections.abc import Sequence

from wattwatch.errors import ConfigError
from wattwatch.sensors.base import DeviceInfo


def resolve_visible(spec: str, devices: Sequence[DeviceInfo]) -> list[str]:
    """Map a ``CUDA_VISIBLE_DEVICES`` value to device keys (``gpuN``), in the order given.

    Entries are NVML indices, full UUIDs or unique UUID prefixes (with or without ``GPU-``), comma
    separated. As in CUDA, a negative index ends the list (``-1`` hides every GPU). Raises ConfigError
    naming the entry for anything unknown or ambiguous.
    """
    gpus = [d for d in devices if d.kind == "gpu"]
    keys: list[str] = []
    for raw in spec.split(","):
        entry = raw.strip()
        if not entry:
            continue
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if index < 0:
                break
            found = [d for d in gpus if d.index == index]
            if not found:
                have = ", ".join(str(d.index) for d in gpus) or "none"
                raise ConfigError(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r}: no GPU with that index here (indices: {have})"
                )
        else:
            want = entry.lower()
            found = [
                d
                for d in gpus
                if d.uuid and (d.uuid.lower().startswith(want) or d.uuid.lower().startswith("gpu-" + want))
            ]
            if not found:
                raise ConfigError(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no GPU UUID here; "
                    "use indices or UUIDs from `nvidia-smi -L`"
                )
            if len(found) > 1:
                raise ConfigError(
                    f"CUDA_VISIBLE_DEVICES entry {entry!r} is ambiguous (matches "
                    f"{', '.join(str(d.uuid) for d in found)}); give more of the UUID"
                )
        if found[0].key not in keys:
            keys.append(found[0].key)
    return keys
