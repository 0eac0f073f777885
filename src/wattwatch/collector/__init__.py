"""The central collector: HTTP ingest from agents, job routes, reports and /metrics.

Build it with ``create_app(settings)``; nothing is created at import time.
"""

from wattwatch.collector.app import create_app

__all__ = ["create_app"]
