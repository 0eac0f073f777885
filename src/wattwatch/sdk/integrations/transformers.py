"""Hugging Face ``transformers.Trainer`` callback: the run as a job, its optimizer steps and epochs as spans.

    from wattwatch.sdk.integrations.transformers import WattwatchCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[WattwatchCallback()])

The class derives from ``transformers.TrainerCallback`` when transformers is installed (the Trainer then
finds every other hook on the base); without it, it is a plain class with the same hook signatures
(``on_*(self, args, state, control, **kwargs)``), which is how the tests drive it: transformers and
torch are too large to install in CI, so the tests stand in plain objects for ``args``/``state``/``control``
with the attributes the documentation names (``args.run_name``, ``state.is_world_process_zero``,
``state.num_input_tokens_seen``).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from wattwatch import sdk
from wattwatch.sdk.integrations.training import TrainingRecorder


def _base() -> Any:
    try:
        return importlib.import_module("transformers").TrainerCallback
    except (ImportError, AttributeError):
        return object


_TrainerCallback: Any = _base()


class WattwatchCallback(_TrainerCallback):  # type: ignore[misc]
    """Reports the Trainer's run to the local wattwatch agent.

    ``name`` defaults to ``args.run_name``; ``job_id`` to ``$WATTWATCH_JOB``, the Slurm job, or
    torchrun's run id (so all ranks and hosts share it). Steps are optimizer steps; their tokens come
    from ``state.num_input_tokens_seen`` when the Trainer counts them (``include_num_input_tokens_seen``).
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
            name,
            job_id=job_id,
            labels={"framework": "transformers", **(labels or {})},
            client=client,
            via="transformers",
        )
        self._tokens_seen = 0

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start the run's job (every process)."""
        name = getattr(args, "run_name", None) or "transformers-train"
        self.recorder.train_begin(str(name), is_rank_zero=bool(getattr(state, "is_world_process_zero", True)))
        self._tokens_seen = _tokens(state)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """End the run's job."""
        self.recorder.train_end()

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step starts."""
        self.recorder.step_begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An optimizer step ended: record its span with the tokens seen since the last one."""
        seen = _tokens(state)
        self.recorder.step_end(tokens=max(seen - self._tokens_seen, 0))
        self._tokens_seen = seen

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An epoch starts."""
        self.recorder.epoch_begin()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """An epoch ended: record its span."""
        self.recorder.epoch_end()


def _tokens(state: Any) -> int:
    value = getattr(state, "num_input_tokens_seen", 0)
    return int(value) if isinstance(value, int | float) else 0
