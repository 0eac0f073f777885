"""A database filled as a user fills one, for tests that read it back through the CLI: ``wattwatch up
--simulate 2`` (real collector and agent, simulated GPUs) and jobs tagged by ``wattwatch run``. ``up`` is
stopped before the tests read, so every report of the database sees the same figures (idle included)."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from procs import WATTWATCH
from test_e2e import start_up
from wattwatch.cli.main import main

# (name, kind, labels, CUDA_VISIBLE_DEVICES: None for none). Two at a time: llama-a and chat, then
# llama-b (both GPUs, sharing them with nothing) and no-gpu, a training job that never touches a GPU.
JOBS: tuple[tuple[str, str, tuple[str, ...], str | None], ...] = (
    ("llama-a", "training", ("team=nlp",), "0"),
    ("chat", "inference", ("team=web",), "1"),
    ("llama-b", "training", ("team=nlp", "tier=gold"), "0,1"),
    ("no-gpu", "training", (), None),
)


@dataclass(frozen=True)
class Filled:
    """The filled database and the environment (its ``WATTWATCH_HOME``) to run ``wattwatch`` in."""

    db_url: str
    env: dict[str, str]
    tmp: Path


def fill(db_url: str, tmp: Path) -> Filled:
    """Run ``JOBS`` under ``wattwatch up --simulate 2`` on ``db_url``, then stop it."""
    up = start_up(tmp, db_url, simulate=2)
    try:
        for pair in (JOBS[:2], JOBS[2:]):
            procs = []
            for name, kind, labels, cvd in pair:
                env = dict(up.env)
                if cvd is not None:
                    env["CUDA_VISIBLE_DEVICES"] = cvd
                argv = [*WATTWATCH, "run", "--kind", kind, "--name", name, "--summary-wait", "0"]
                argv += [a for label in labels for a in ("--label", label)]
                procs.append(subprocess.Popen([*argv, "--", "sleep", "1.5"], env=env, stderr=subprocess.PIPE))
            for proc in procs:
                _, err = proc.communicate(timeout=120)
                assert proc.returncode == 0, err
    finally:
        log = up.stop()
    assert up.proc.returncode == 0, log
    env = {k: v for k, v in up.env.items() if k not in ("COLUMNS", "NO_COLOR")}
    return Filled(db_url, env, tmp)


def cli(
    filled: Filled, *args: str, code: int = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``wattwatch ARGS`` as a user runs it with stdout piped (no terminal), in ``filled``'s environment and
    directory; its exit code must be ``code``. In this process (``main`` as the entry point calls it): a
    process per call was most of these tests' time, its start-up being SQLAlchemy's import, which
    ``tests/test_report_startup_bench.py`` and the end-to-end tests measure in real processes."""
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    out, err = io.StringIO(), io.StringIO()
    os.environ.clear()
    os.environ.update({**filled.env, **(env or {})})
    try:
        os.chdir(filled.tmp)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                returncode = main(list(args))
            except SystemExit as exc:
                returncode = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
    done = subprocess.CompletedProcess(["wattwatch", *args], returncode, out.getvalue(), err.getvalue())
    assert done.returncode == code, (args, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    return done
