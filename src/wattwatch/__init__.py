"""wattwatch: energy and power measurement for AI workloads.

The public SDK is a few context managers that talk to the local agent:

    with wattwatch.job("llama-ft", kind="training"):
        for batch in loader:
            with wattwatch.step():          # energy per training step (and wattwatch.epoch())
                train_step(batch)

    with wattwatch.query(tokens_in=512, tokens_out=128):
        serve_one_request()

All are no-ops (with one warning) when no agent is reachable, and never block the workload.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from wattwatch.sdk import epoch, job, query, step

__all__ = ["__version__", "epoch", "job", "query", "step"]
__version__ = "0.1.0"
_SDK = frozenset({"epoch", "job", "query", "step"})


def __getattr__(name: str) -> Any:
    """The SDK's context managers, imported on first use: every ``wattwatch`` command imports this package,
    and most need no SDK (its imports cost a command start some 40 ms)."""
    if name in _SDK or name == "sdk":  # `import wattwatch; wattwatch.sdk` worked when it loaded eagerly
        # import_module, not `from wattwatch import sdk`: that asks this function for "sdk" again.
        sdk = importlib.import_module("wattwatch.sdk")
        return sdk if name == "sdk" else getattr(sdk, name)
    raise AttributeError(f"module 'wattwatch' has no attribute {name!r}")
