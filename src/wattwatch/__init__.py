"""wattwatch: energy and power measurement for AI workloads.

The public SDK is two context managers that talk to the local agent:

    with wattwatch.job("llama-ft", kind="training"):
        train()

    with wattwatch.query(tokens_in=512, tokens_out=128):
        serve_one_request()

Both are no-ops (with one warning) when no agent is reachable, and never block the workload.
"""

from wattwatch.sdk import job, query

__all__ = ["__version__", "job", "query"]
__version__ = "0.1.0"
