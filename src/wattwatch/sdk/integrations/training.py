"""The framework-independent part of the training callbacks: one job per run, a span per step and epoch.

Every process of a run (every rank, on every host) starts the job under the same id, so each host's
agent binds its own GPUs and the collector adds the hosts up. Only the global rank-0 process records
step and epoch spans: a step's energy is the whole run's energy while it lasts, counted once.
"""

from __future__ import annotations

import atexit
import os
import time
import uuid
from collections.abc import Mapping

from wattwatch import sdk


def run_id(job_id: str | None = None) -> str:
    """The id every process of a run agrees on without talking to each other: ``job_id``, else
    ``$WATTWATCH_JOB``, else the Slurm job (``slurm-<id>``, as the agent's discovery names it), else
    torchrun's rendezvous id, else a new one (a single-process run)."""
    if job_id:
        return job_id
    if os.environ.get("WATTWATCH_JOB"):
        return os.environ["WATTWATCH_JOB"]
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm-{os.environ['SLURM_JOB_ID']}"
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return f"torchrun-{rdzv}"
    return uuid.uuid4().hex


class TrainingRecorder:
    """Starts and ends the run's job and records step and epoch spans; never raises into training."""

    def __init__(
        self,
        name: str | None = None,
        *,
        job_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        client: sdk.AgentClient | None = None,
        via: str = "sdk",
    ) -> None:
        self.name = name
        self.job_id = job_id
        self.labels = dict(labels or {})
        self.client = client
        self.via = via
        self.handle: sdk.JobHandle | None = None
        self.record_spans = True
        self._step_start_s: float | None = None
        self._epoch_start_s: float | None = None

    def train_begin(self, default_name: str, *, is_rank_zero: bool) -> None:
        """The run starts (called in every process)."""
        if self.handle is not None:
            return
        self.record_spans = is_rank_zero
        self.handle = sdk.start_job(
            self.name or default_name,
            "training",
            labels=self.labels,
            job_id=run_id(self.job_id),
            client=self.client,
            via=self.via,
        )
        # Training that dies without on_train_end still ends the job when the interpreter exits.
        atexit.register(self.handle.end)

    def train_end(self) -> None:
        """The run ended: flush spans and end the job."""
        if self.handle is not None:
            self.handle.end()
            atexit.unregister(self.handle.end)

    def step_begin(self) -> None:
        """A training step starts."""
        self._step_start_s = time.time()

    def step_end(self, tokens: int = 0) -> None:
        """A training step ended; ``tokens`` it trained on, when known."""
        self._record("step", self._step_start_s, tokens)
        self._step_start_s = None

    def epoch_begin(self) -> None:
        """An epoch starts."""
        self._epoch_start_s = time.time()

    def epoch_end(self) -> None:
        """An epoch ended."""
        self._record("epoch", self._epoch_start_s, 0)
        self._epoch_start_s = None

    def _record(self, kind: sdk.SpanKind, t_start_s: float | None, tokens: int) -> None:
        if self.handle is None or t_start_s is None or not self.record_spans:
            return
        sdk.record_span(
            kind, t_start_s, time.time(), tokens_in=max(tokens, 0), job_id=self.handle.id, client=self.client
        )
