"""PyTorch Lightning callback: the fit as a job, its training batches and epochs as spans.

    from wattwatch.sdk.integrations.lightning import WattwatchCallback
    trainer = lightning.Trainer(callbacks=[WattwatchCallback()])

The class derives from ``lightning.pytorch.Callback`` (or ``pytorch_lightning.Callback``) when one is
installed; without them, it is a plain class with the same hook signatures
(``on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx)`` ...), which is how the tests
drive it: Lightning and torch are too large to install in CI, so plain objects with the documented
attributes (``trainer.is_global_zero``) stand in for the trainer and the module.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from wattwatch import sdk
from wattwatch.sdk.integrations.training import TrainingRecorder


def _base() -> Any:
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return importlib.import_module(module).Callback
        except (ImportError, AttributeError):
            continue
    return object


_Callback: Any = _base()


class WattwatchCallback(_Callback):  # type: ignore[misc]
    """Reports a Lightning fit to the local wattwatch agent.

    ``name`` defaults to the LightningModule's class name; ``job_id`` to ``$WATTWATCH_JOB``, the Slurm
    job, or torchrun's run id (so all ranks and hosts share it). Each training batch is a step span.
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        job_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        client: sdk.AgentClient | None = None,
    ) -> None:
        super().__init__()
        self.recorder = TrainingRecorder(
            name, job_id=job_id, labels={"framework": "lightning", **(labels or {})}, client=client, via="lightning"
        )

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        """Start the fit's job (every process)."""
        self.recorder.train_begin(type(pl_module).__name__, is_rank_zero=bool(getattr(trainer, "is_global_zero", True)))

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        """End the fit's job."""
        self.recorder.train_end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        """A failed fit still ends its job."""
        self.recorder.train_end()

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        """A training batch starts."""
        self.recorder.step_begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        """A training batch ended: record its step span."""
        self.recorder.step_end()

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        """A training epoch starts."""
        self.recorder.epoch_begin()

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        """A training epoch ended: record its span."""
        self.recorder.epoch_end()
