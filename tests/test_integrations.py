"""Training callbacks against their frameworks' documented hook signatures.

transformers, Lightning and torch are too large to install in CI, so plain objects with the documented
attributes stand in for ``TrainingArguments``/``TrainerState``/``TrainerControl`` and for Lightning's
``Trainer``/``LightningModule``; tiny stand-in packages check that the callbacks derive from the real
base classes when those are importable.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings
from wattwatch.protocol import wire
from wattwatch.sdk import AgentClient
from wattwatch.sdk.integrations import lightning as wl
from wattwatch.sdk.integrations import transformers as wt

HF_HOOK = ["self", "args", "state", "control", "kwargs"]
LIGHTNING_HOOKS = {
    "on_train_start": ["self", "trainer", "pl_module"],
    "on_train_end": ["self", "trainer", "pl_module"],
    "on_train_batch_start": ["self", "trainer", "pl_module", "batch", "batch_idx"],
    "on_train_batch_end": ["self", "trainer", "pl_module", "outputs", "batch", "batch_idx"],
    "on_train_epoch_start": ["self", "trainer", "pl_module"],
    "on_train_epoch_end": ["self", "trainer", "pl_module"],
    "on_exception": ["self", "trainer", "pl_module", "exception"],
}


class NullSensor:
    name = "null"

    def devices(self) -> list[object]:
        return []

    def read(self) -> list[object]:
        return []

    def read_at(self, t_s: float) -> list[object]:
        return []

    def close(self) -> None:
        pass


def run_with_agent(tmp_path: Path, drive: Callable[[AgentClient], None]) -> list[wire.Batch]:
    settings = replace(Settings(home=tmp_path), collector_url="http://127.0.0.1:9", interval_s=3600)
    agent = Agent(settings, [NullSensor()])  # type: ignore[list-item]
    agent.start()
    try:
        drive(AgentClient(settings.socket_path))
        deadline = time.monotonic() + 10
        while agent.registry.snapshot() and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        agent.stop(flush_timeout_s=0.2)
    spool = Spool(tmp_path / "spool.db")
    try:
        return [wire.decode_batch(body) for _, body in spool.peek(limit=1000)]
    finally:
        spool.close()


def test_hook_signatures_match_the_documented_ones() -> None:
    for hook in ("on_train_begin", "on_train_end", "on_step_begin", "on_step_end", "on_epoch_begin", "on_epoch_end"):
        assert list(inspect.signature(getattr(wt.WattwatchCallback, hook)).parameters) == HF_HOOK, hook
    for hook, params in LIGHTNING_HOOKS.items():
        assert list(inspect.signature(getattr(wl.WattwatchCallback, hook)).parameters) == params, hook


def test_transformers_callback_reports_the_run_its_steps_and_epochs(tmp_path: Path) -> None:
    def drive(client: AgentClient) -> None:
        cb = wt.WattwatchCallback(job_id="hf-run", labels={"team": "nlp"}, client=client)
        args = SimpleNamespace(run_name="llama-ft", output_dir="out")
        state = SimpleNamespace(is_world_process_zero=True, global_step=0, epoch=0.0, num_input_tokens_seen=0)
        control = SimpleNamespace(should_training_stop=False)
        cb.on_train_begin(args, state, control, model=None, processing_class=None)
        for _ in range(2):
            cb.on_epoch_begin(args, state, control, model=None)
            for _ in range(3):
                cb.on_step_begin(args, state, control, model=None, optimizer=None, lr_scheduler=None)
                state.num_input_tokens_seen += 512
                state.global_step += 1
                cb.on_step_end(args, state, control, model=None, optimizer=None, lr_scheduler=None)
            cb.on_epoch_end(args, state, control, model=None)
        cb.on_train_end(args, state, control, model=None)

    batches = run_with_agent(tmp_path, drive)
    jobs = [j for b in batches for j in b.jobs]
    assert [(j.id, j.name, j.kind, j.ended_at_s is None) for j in jobs] == [
        ("hf-run", "llama-ft", "training", True),
        ("hf-run", "llama-ft", "training", False),
    ]
    assert jobs[0].labels == {"team": "nlp", "framework": "transformers", "wattwatch.io/discovered-by": "transformers"}
    spans = [q for b in batches for q in b.queries]
    assert [(q.kind, q.tokens_in) for q in spans if q.kind == "step"] == [("step", 512)] * 6
    assert len([q for q in spans if q.kind == "epoch"]) == 2
    assert all(jobs[0].started_at_s <= q.t_start_s <= q.t_end_s <= (jobs[1].ended_at_s or 0) for q in spans)


def test_lightning_callback_only_rank_zero_records_spans(tmp_path: Path) -> None:
    class LlamaModule:
        pass

    def drive(client: AgentClient) -> None:
        module = LlamaModule()
        ranks = [
            (
                wl.WattwatchCallback(job_id="pl-run", client=client),
                SimpleNamespace(is_global_zero=r == 0, global_rank=r),
            )
            for r in (0, 1)  # two ranks of one run on this host
        ]
        for cb, trainer in ranks:
            cb.on_train_start(trainer, module)
        for cb, trainer in ranks:
            cb.on_train_epoch_start(trainer, module)
            for i in range(4):
                cb.on_train_batch_start(trainer, module, batch=[i], batch_idx=i)
                cb.on_train_batch_end(trainer, module, outputs={"loss": 0.1}, batch=[i], batch_idx=i)
            cb.on_train_epoch_end(trainer, module)
        ranks[0][0].on_train_end(ranks[0][1], module)
        ranks[1][0].on_exception(ranks[1][1], module, RuntimeError("CUDA out of memory"))

    batches = run_with_agent(tmp_path, drive)
    jobs = [j for b in batches for j in b.jobs]
    # Both ranks joined one job (one reference each); it ended with the last of them.
    assert [(j.id, j.name, j.ended_at_s is None) for j in jobs] == [("pl-run", "LlamaModule", True)] * 2 + [
        ("pl-run", "LlamaModule", False)
    ]
    spans = [q for b in batches for q in b.queries]
    assert sorted(q.kind for q in spans) == ["epoch"] + ["step"] * 4


def test_callbacks_are_harmless_without_an_agent(tmp_path: Path) -> None:
    from wattwatch.sdk import notices

    notices._warned = False
    cb = wt.WattwatchCallback(client=AgentClient(tmp_path / "none.sock"))
    args, state, control = SimpleNamespace(run_name=None), SimpleNamespace(), SimpleNamespace()
    with pytest.warns(RuntimeWarning):
        cb.on_train_begin(args, state, control)
    cb.on_step_begin(args, state, control)
    cb.on_step_end(args, state, control)
    cb.on_train_end(args, state, control)


FAKE_PACKAGES = {
    "transformers/__init__.py": "class TrainerCallback:\n    def on_log(self, args, state, control, **kw): ...\n",
    "lightning/__init__.py": "",
    "lightning/pytorch/__init__.py": "class Callback:\n    def on_fit_start(self, trainer, pl_module): ...\n",
}


def test_callbacks_derive_from_the_frameworks_bases_and_wattwatch_never_imports_them(tmp_path: Path) -> None:
    for rel, text in FAKE_PACKAGES.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    script = textwrap.dedent(
        """
        import sys
        import wattwatch, wattwatch.sdk, wattwatch.sdk.integrations, wattwatch.agent.runner
        assert "transformers" not in sys.modules and "lightning" not in sys.modules
        import transformers, lightning.pytorch
        from wattwatch.sdk.integrations import transformers as wt, lightning as wl
        assert issubclass(wt.WattwatchCallback, transformers.TrainerCallback)
        assert issubclass(wl.WattwatchCallback, lightning.pytorch.Callback)
        assert hasattr(wt.WattwatchCallback(), "on_log")  # the Trainer's other hooks come from the base
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
