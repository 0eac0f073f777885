"""wattwatch's error tree. Imports nothing of ours.

Every error a user can see says what happened and what to do next::

    WattwatchError
     ├── ConfigError          bad setting, flag or file; fix the named setting
     ├── SensorError          a power/energy source failed
     │    ├── DeviceNotFound      no such device, or none at all
     │    ├── DeviceLost          the device vanished (GPU fell off the bus)
     │    ├── NotSupported        this device has no such counter/reading
     │    └── PermissionDenied    the OS refused access (RAPL energy_uj as non-root)
     ├── StorageError         database missing, unmigrated or unreachable
     └── AgentUnreachable     the local agent socket is not there (SDK, ``wattwatch run``)
"""

from __future__ import annotations


class WattwatchError(Exception):
    """Base of every error wattwatch raises on purpose. ``str(err)`` is meant for users."""


class ConfigError(WattwatchError):
    """A setting, flag or configuration file is invalid."""


class SensorError(WattwatchError):
    """A power or energy source failed."""


class DeviceNotFound(SensorError):
    """The device (or any device of that kind) does not exist here."""


class DeviceLost(SensorError):
    """The device disappeared while being measured."""


class NotSupported(SensorError):
    """The device does not offer the requested reading."""


class PermissionDenied(SensorError):
    """The operating system refused access to the reading."""


class StorageError(WattwatchError):
    """The database is missing, unmigrated or unreachable."""


class AgentUnreachable(WattwatchError):
    """No local agent listens on the expected Unix socket."""
