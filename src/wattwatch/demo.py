"""``wattwatch demo``: synthetic training and inference jobs on simulated GPUs.

GPU 0-1 run a training job, GPU 2 serves inference requests (sent as query spans through the SDK
client), GPU 3 stays idle: every part of the report has something to show.
"""

from __future__ import annotations

import random
import threading
import time
import uuid

from wattwatch.config import Settings
from wattwatch.sdk import AgentClient

DEMO_GPUS = 4


def drive(settings: Settings, stop: threading.Event) -> None:
    """Run the demo jobs until ``stop`` is set, then end them."""
    client = AgentClient(settings.socket_path, timeout_s=2.0)
    run = uuid.uuid4().hex[:6]
    train = client.request(
        {
            "op": "job_start",
            "id": f"demo-train-{run}",
            "name": "llama-ft (demo)",
            "kind": "training",
            "labels": {"team": "demo"},
            "cuda_visible_devices": "0,1",
        }
    )
    serve = client.request(
        {
            "op": "job_start",
            "id": f"demo-serve-{run}",
            "name": "chat-serve (demo)",
            "kind": "inference",
            "labels": {"team": "demo"},
            "cuda_visible_devices": "2",
        }
    )
    rng = random.Random(7)
    try:
        while not stop.wait(rng.uniform(0.1, 0.5)):
            t_end_s = time.time()
            client.send(
                {
                    "op": "query",
                    "job": serve["id"],
                    "t_start_s": t_end_s - rng.uniform(0.2, 1.2),
                    "t_end_s": t_end_s,
                    "tokens_in": rng.randint(20, 800),
                    "tokens_out": rng.randint(10, 400),
                }
            )
    finally:
        client.request({"op": "job_end", "id": train["id"]})
        client.request({"op": "job_end", "id": serve["id"]})
        client.close()
