"""NVML's errors translated into wattwatch's error tree, each with what to do next: the only place that
knows NVML's error codes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from wattwatch.errors import DeviceLost, DeviceNotFound, NotSupported, PermissionDenied, SensorError

NO_DRIVER = "NVML library not found / no NVIDIA driver"
NO_DRIVER_FIX = "install the NVIDIA driver, or try --simulate N"


def translate_nvml_error(nvml: Any, exc: BaseException, what: str) -> SensorError:
    """The wattwatch error for an ``NVMLError`` raised while doing ``what``; says what to do next."""
    code = getattr(exc, "value", None)

    def is_(*names: str) -> bool:
        return any(code == getattr(nvml, f"NVML_ERROR_{name}", object()) for name in names)

    if is_("GPU_IS_LOST"):
        return DeviceLost(
            f"{what}: the GPU fell off the bus (NVML: {exc}); check `dmesg` for Xid errors and "
            "`nvidia-smi`; the GPU needs a reset or the host a reboot"
        )
    if is_("NOT_SUPPORTED", "FUNCTION_NOT_FOUND"):
        return NotSupported(
            f"{what}: not supported by this GPU or driver (NVML: {exc}); energy counters need a Volta or "
            "newer GPU and a recent driver; wattwatch falls back to integrating power"
        )
    if is_("NO_PERMISSION"):
        return PermissionDenied(
            f"{what}: the NVIDIA driver refused access (NVML: {exc}); run the agent as a user that may "
            "open /dev/nvidia* (root, or the group owning those files)"
        )
    if is_("LIBRARY_NOT_FOUND", "DRIVER_NOT_LOADED"):
        return DeviceNotFound(f"{what}: {NO_DRIVER} (NVML: {exc}); {NO_DRIVER_FIX}")
    if is_("NOT_FOUND", "GPU_NOT_FOUND"):
        return DeviceNotFound(f"{what}: no such GPU (NVML: {exc}); list the GPUs with `nvidia-smi -L`")
    return SensorError(f"{what}: NVML error {exc} (code {code}); check the driver with `nvidia-smi`")


@contextmanager
def nvml_errors(nvml: Any, what: str) -> Iterator[None]:
    """Context manager turning ``NVMLError`` into wattwatch's error tree (``translate_nvml_error``)."""
    try:
        yield
    except Exception as exc:
        if not isinstance(exc, nvml.NVMLError):
            raise
        raise translate_nvml_error(nvml, exc, what) from exc
