"""The whole pipeline with real processes, against the simulator's exact integral: docs/accuracy.md's
"Whole pipeline" tables.

``--part pipeline``: ``wattwatch up --simulate 4 --interval 2``; ``wattwatch run`` holds GPUs 0 and 1 for a
6 s training command while an SDK inference server on GPU 2 serves 12 queries (about 4.7 s); then a 0.3 s SDK
job on GPU 1, shorter than one tick. After ``up`` stops, ``wattwatch report --format json``.

``--part setup``: ``wattwatch up --simulate 1 --interval 1``, twice. (a) One SDK process put on the GPU
(the agent's ``sim_gpu_use`` op: what creating a CUDA context does on a real board) and found by the agent
before it opens its first job, then ``--jobs`` 1 s jobs in turn with 0.2 s between them: each job's
energy, its setup energy (the process's time on the GPU before the job), and the whole stretch from the
first job's start to the last one's end. (b) Two processes on the GPU at 70 % and 30 % SM utilisation, both
there before either opens its ``--share-s`` job.

``--sim-flaws SPEC`` runs every ``wattwatch up`` with ``--sim-flaws SPEC`` (the simulator with real
hardware's flaws, e.g. ``realistic`` or ``realistic,refresh_ms=20``; see ``wattwatch.sim.flaws``); the
tables' captions say which.

The truth, every time: the simulator's exact integral of its boards' power between the instants the
report gives (a job's start and end), computed by the simulator from its own log (``simulated-gpus.jsonl``,
replayed), never by wattwatch's accounting; for the shared GPU, each process's set share (70/30) of it.
Each scenario runs ``--runs`` times; the tables give min to max over runs (and over the jobs of a row).

Run: ``python benchmarks/pipeline.py [--runs 3] [--part all|pipeline|setup] [--db sqlite|postgresql|both]
[--postgres URL] [--sim-flaws SPEC]`` (about 12 s per pipeline run and 25 s per setup run on a 2-core
machine: some 2 minutes at the defaults, twice that with ``--db both``). PostgreSQL runs get a scratch
database each on the ``--postgres`` server (default WATTWATCH_TEST_PG_URL, else postgresql://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import command, paragraph, table
from realprocs import PG_DEFAULT_URL, WATTWATCH, BenchError, Up, check_exit, running_up, scratch_postgres

from wattwatch.sim.flaws import parse_flaws
from wattwatch.storage import repository
from wattwatch.storage.engine import make_engine

DATABASES = {"sqlite": "SQLite", "postgresql": "PostgreSQL"}

# -- the pipeline scenario (as tests/test_e2e.py runs it) ---------------------------------------------

SERVE = textwrap.dedent(
    """
    import time, wattwatch
    with wattwatch.job("chat-serve", kind="inference"):
        time.sleep(0.5)
        for i in range(12):
            with wattwatch.query(tokens_in=100 + i, tokens_out=50):
                time.sleep(0.25)
            time.sleep(0.1)
    """
)
TRAIN = [sys.executable, "-c", "import time; time.sleep(6)"]
SHORT = "import time, wattwatch\nwith wattwatch.job('blip', kind='training'):\n    time.sleep(0.3)\n"
PIPELINE_ROWS = (
    ("llama-ft", "training on two GPUs (`wattwatch run`)", ["gpu0", "gpu1"]),
    ("chat-serve", "inference on one GPU (SDK, 12 queries)", ["gpu2"]),
    ("blip", "a job inside one tick (SDK)", ["gpu1"]),
)


@dataclass
class Row:
    """One table row's measurements over runs: durations (s) and relative errors (measured / exact - 1)."""

    durations_s: list[float] = field(default_factory=list)
    errors: dict[str, list[float]] = field(default_factory=dict)

    def add(self, db: str, duration_s: float, measured: float, exact: float) -> None:
        """Record one job's (or stretch's) figures; an exact of zero is a broken run, not a figure."""
        if not exact > 0:
            raise BenchError(f"the simulator's exact energy is {exact} J: nothing ran on the board")
        self.durations_s.append(duration_s)
        self.errors.setdefault(db, []).append(measured / exact - 1)


def gpus_of(job: dict[str, Any]) -> list[str]:
    """The GPU keys (``gpu0``) of a report entry's devices (``host/gpu0``)."""
    return sorted(k for k in (d.rsplit("/", 1)[-1] for d in job["devices"]) if k.startswith("gpu"))


def exact_gpu_j(up: Up, job: dict[str, Any], t0_s: float | None = None, t1_s: float | None = None) -> float:
    """The simulator's exact energy of the job's GPUs over [t0_s, t1_s] (default: the job's start to end)."""
    fleet = up.fleet()
    t0 = job["started_at_s"] if t0_s is None else t0_s
    t1 = job["ended_at_s"] if t1_s is None else t1_s
    return sum(fleet.exact_energy_j(int(k[3:]), t0, t1) for k in gpus_of(job))


def jobs_by_name(report: dict[str, Any], names: Sequence[str]) -> dict[str, dict[str, Any]]:
    """The report's jobs by name; every one of ``names`` must be there."""
    jobs = {j["name"]: j for j in report["jobs"]}
    missing = [n for n in names if n not in jobs]
    if missing:
        raise BenchError(f"the report has no job {missing}: {sorted(jobs)}")
    return jobs


def pipeline_once(workdir: Path, db_url: str, db: str, rows: dict[str, Row], sim: Sequence[str] = ()) -> None:
    """One run of the pipeline scenario (``sim``: more ``wattwatch up`` arguments, e.g. its flaws); adds
    each job's figures to ``rows``."""
    with running_up(workdir, db_url, "--interval", "2", *sim, gpus=4) as up:
        train = subprocess.Popen(
            [*WATTWATCH, "run", "--kind", "training", "--name", "llama-ft", "--label", "team=nlp", "--", *TRAIN],
            env={**up.env, "CUDA_VISIBLE_DEVICES": "0,1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        serve = subprocess.Popen(
            [sys.executable, "-c", SERVE],
            env={**up.env, "CUDA_VISIBLE_DEVICES": "2"},
            stderr=subprocess.PIPE,
            text=True,
        )
        check_exit(train, "wattwatch run")
        check_exit(serve, "the SDK server")
        short = subprocess.Popen(
            [sys.executable, "-c", SHORT],
            env={**up.env, "CUDA_VISIBLE_DEVICES": "1"},
            stderr=subprocess.PIPE,
            text=True,
        )
        check_exit(short, "the short SDK job")
        up.stop()
        jobs = jobs_by_name(up.report(), [name for name, _, _ in PIPELINE_ROWS])
        for name, _, gpus in PIPELINE_ROWS:
            job = jobs[name]
            if gpus_of(job) != gpus:
                raise BenchError(f"{name} holds {gpus_of(job)}, expected {gpus}")
            rows[name].add(db, job["duration_s"], job["gpu_energy_j"], exact_gpu_j(up, job))
        if jobs["chat-serve"]["queries"] != 12:
            raise BenchError(f"chat-serve has {jobs['chat-serve']['queries']} queries, expected 12")


# -- the setup-energy scenario (as tests/test_setup_energy.py runs it) -------------------------------

ON_GPU = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    import wattwatch
    from wattwatch.sdk import AgentClient

    client = AgentClient(Path(os.environ["WATTWATCH_HOME"]) / "agent.sock", timeout_s=5)
    pid = os.getpid()

    def use_gpu(**extra):
        reply = client.request({"op": "sim_gpu_use", "pid": pid, "cuda_visible_devices": "0", **extra})
        assert reply["ok"], reply

    def wait(condition, what):
        deadline = time.monotonic() + 30
        while not condition():
            if time.monotonic() > deadline:
                sys.exit(f"timed out waiting for {what}")
            time.sleep(0.02)

    def found():
        return any(pid in j["pids"] for j in client.request({"op": "jobs"})["jobs"])
    """
)

JOBS_IN_TURN = ON_GPU + textwrap.dedent(
    """
    n_jobs = int(sys.argv[1])
    use_gpu(kind="training")
    wait(found, "the agent to find this process on its GPU")
    time.sleep(0.5)  # the model keeps loading: setup energy of the first job
    for i in range(n_jobs):
        with wattwatch.job(f"job-{i}", kind="inference"):
            time.sleep(1.0)
        time.sleep(0.2)  # between jobs: setup energy of the next one
    use_gpu(leave=True)
    """
)

SHARER = ON_GPU + textwrap.dedent(
    """
    util, me, other, flags, job_s = float(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), float(sys.argv[5])
    use_gpu(kind="training", sm_util_percent=util)
    wait(found, "the agent to find this process on its GPU")
    (flags / f"{me}.ready").touch()
    wait((flags / f"{other}.ready").exists, "the other process")  # both on the GPU before either job opens
    time.sleep(0.3)
    with wattwatch.job(me, kind="inference"):
        time.sleep(job_s)
    (flags / f"{me}.done").touch()
    wait((flags / f"{other}.done").exists, "the other job to end")  # both on the GPU until both jobs end
    use_gpu(leave=True)
    """
)

SETUP_ROWS = {
    "jobs": "one SDK process, {n} jobs of 1 s in turn: each job",
    "first-setup": "its first setup (found on the GPU, then 0.5 s of model load)",
    "setups": "its setups between jobs (0.2 s each)",
    "stretch": "first job's start to last job's end (jobs + setups between)",
    "big": "two processes on one GPU at 70/30 SM: the 70 % job",
    "small": "the 30 % job",
    "both": "the two jobs together",
}


def on_gpu0(up: Up, script: str, *args: str) -> subprocess.Popen[str]:
    """Start an SDK script on the simulated GPU 0 of ``up``."""
    env = {**up.env, "CUDA_VISIBLE_DEVICES": "0"}
    return subprocess.Popen([sys.executable, "-c", script, *args], env=env, text=True, stderr=subprocess.PIPE)


def setup_gpu_j(up: Up, job: dict[str, Any]) -> float:
    """The GPU part of a job's setup energy as stored (the report's setup figure adds the process's CPU share)."""
    engine = make_engine(up.db_url)
    try:
        entries = [repository.get_job(engine, p["id"]) for p in job["phases"] if p["phase"] == "setup"]
    finally:
        engine.dispose()
    return float(sum(e["gpu_energy_j"] for e in entries if e is not None))


def jobs_in_turn_once(
    workdir: Path, db_url: str, db: str, n_jobs: int, rows: dict[str, Row], sim: Sequence[str] = ()
) -> None:
    """One run of the jobs-in-turn scenario (``sim`` as for ``pipeline_once``); adds its figures to ``rows``."""
    with running_up(workdir, db_url, "--interval", "1", *sim, gpus=1) as up:
        check_exit(on_gpu0(up, JOBS_IN_TURN, str(n_jobs)), "the SDK process")
        up.stop()
        names = [f"job-{i}" for i in range(n_jobs)]
        by_name = jobs_by_name(up.report(), names)
        jobs = [by_name[n] for n in names]
        for i, job in enumerate(jobs):
            rows["jobs"].add(db, job["duration_s"], job["gpu_energy_j"], exact_gpu_j(up, job))
            setup_s = job["setup_duration_s"]
            if not setup_s:
                raise BenchError(f"{job['name']} has no setup energy")
            exact = exact_gpu_j(up, job, job["started_at_s"] - setup_s, job["started_at_s"])
            rows["first-setup" if i == 0 else "setups"].add(db, setup_s, setup_gpu_j(up, job), exact)
        first, last = jobs[0], jobs[-1]
        held_j = sum(j["gpu_energy_j"] for j in jobs) + sum(setup_gpu_j(up, j) for j in jobs[1:])
        stretch_s = last["ended_at_s"] - first["started_at_s"]
        rows["stretch"].add(db, stretch_s, held_j, exact_gpu_j(up, first, first["started_at_s"], last["ended_at_s"]))


def sharing_once(
    workdir: Path, db_url: str, db: str, job_s: float, rows: dict[str, Row], sim: Sequence[str] = ()
) -> None:
    """One run of the two-processes-sharing scenario (``sim`` as for ``pipeline_once``); adds its figures
    to ``rows``."""
    flags = workdir / "flags"
    flags.mkdir(parents=True)
    with running_up(workdir, db_url, "--interval", "1", *sim, gpus=1) as up:
        a = on_gpu0(up, SHARER, "70", "big", "small", str(flags), str(job_s))
        b = on_gpu0(up, SHARER, "30", "small", "big", str(flags), str(job_s))
        check_exit(a, "the 70 % process")
        check_exit(b, "the 30 % process")
        up.stop()
        jobs = jobs_by_name(up.report(), ["big", "small"])
        exact = {name: share * exact_gpu_j(up, jobs[name]) for name, share in (("big", 0.7), ("small", 0.3))}
        for name in exact:
            rows[name].add(db, jobs[name]["duration_s"], jobs[name]["gpu_energy_j"], exact[name])
        mean_s = statistics.fmean(jobs[n]["duration_s"] for n in exact)
        rows["both"].add(db, mean_s, sum(jobs[n]["gpu_energy_j"] for n in exact), sum(exact.values()))


# -- running and printing -------------------------------------------------------------------------


@contextmanager
def database(db: str, workdir: Path, server_url: str) -> Iterator[str]:
    """A fresh database for one run: an SQLite file in ``workdir``, or a scratch PostgreSQL database."""
    if db == "sqlite":
        workdir.mkdir(parents=True, exist_ok=True)
        yield f"sqlite:///{workdir / 'wattwatch.db'}"
    else:
        with scratch_postgres(server_url) as url:
            yield url


def span(values: Sequence[float]) -> str:
    """Min to max of relative errors as percentages (one value when they agree to the digits shown)."""
    lo, hi = f"{min(values):+.3%}", f"{max(values):+.3%}"
    return lo if lo == hi else f"{lo} to {hi}"


def render(first: str, rows: dict[str, Row], labels: dict[str, str], dbs: Sequence[str]) -> str:
    """The markdown table: row label, mean duration, then min to max per database."""
    header = (first, "duration", *(f"measured vs exact, {DATABASES[db]}" for db in dbs))
    cells = []
    for key, label in labels.items():
        row = rows[key]
        duration = statistics.fmean(row.durations_s)
        cells.append([label, f"{duration:.2f} s", *(span(row.errors[db]) for db in dbs)])
    return table(header, cells, right=[False, True, *([True] * len(dbs))])


def run_all(
    dbs: Sequence[str], runs: int, server_url: str, once: Callable[[Path, str, str], None], tmp: Path, tag: str
) -> None:
    """``once(workdir, db_url, db)`` for every run and database, each on a fresh database."""
    for k in range(runs):
        for db in dbs:
            workdir = tmp / f"{tag}-{db}-{k}"
            with database(db, workdir, server_url) as url:
                once(workdir, url, db)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the chosen parts and print each table under the command that produced it."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="runs of each scenario (the tables give min to max)")
    ap.add_argument("--part", choices=("all", "pipeline", "setup"), default="all")
    ap.add_argument("--db", choices=("sqlite", "postgresql", "both"), default="sqlite", help="database(s) to run on")
    ap.add_argument("--postgres", default=PG_DEFAULT_URL, metavar="URL", help="PostgreSQL server for --db postgresql")
    ap.add_argument("--jobs", type=int, default=8, help="jobs in turn in the setup part")
    ap.add_argument("--share-s", type=float, default=4.0, help="length of each sharing job in the setup part")
    ap.add_argument(
        "--sim-flaws",
        default="",
        metavar="SPEC",
        help="simulated hardware flaws for every run (wattwatch up --sim-flaws)",
    )
    args = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    if args.runs < 1 or args.jobs < 2 or args.share_s <= 0:
        ap.error("--runs must be at least 1, --jobs at least 2 and --share-s positive")
    sim: list[str] = []
    flaws_note = ""
    if args.sim_flaws:
        try:
            flaws = parse_flaws(args.sim_flaws)
        except ValueError as exc:
            ap.error(f"--sim-flaws: {exc}")
        sim = ["--sim-flaws", args.sim_flaws]
        flaws_note = f", `--sim-flaws {args.sim_flaws}` ({flaws.describe()})"
    dbs = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    where = " and ".join(DATABASES[db] for db in dbs)
    runs = f"{args.runs} run{'s' if args.runs > 1 else ''} on {where}"
    truth = (
        "the simulator's exact integral of its boards' power over the same window (the instants the report"
        " gives), computed by the simulator from its own log, not by wattwatch's accounting"
    )
    print(command("pipeline.py", argv))
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        if args.part in ("all", "pipeline"):
            rows = {name: Row() for name, _, _ in PIPELINE_ROWS}
            run_all(dbs, args.runs, args.postgres, lambda w, u, d: pipeline_once(w, u, d, rows, sim), tmp, "pipeline")
            print(
                paragraph(
                    f"**Whole pipeline** (real `wattwatch up --simulate 4`, 2 s tick{flaws_note}, `wattwatch run` and"
                    f" SDK processes, `wattwatch report --format json`; {runs}): each job's GPU energy against {truth};"
                    " min to max"
                    " over runs:"
                )
            )
            print(render("job", rows, {name: label for name, label, _ in PIPELINE_ROWS}, dbs))
        if args.part in ("all", "setup"):
            rows = {key: Row() for key in SETUP_ROWS}
            run_all(
                dbs,
                args.runs,
                args.postgres,
                lambda w, u, d: jobs_in_turn_once(w, u, d, args.jobs, rows, sim),
                tmp,
                "turn",
            )
            run_all(
                dbs,
                args.runs,
                args.postgres,
                lambda w, u, d: sharing_once(w, u, d, args.share_s, rows, sim),
                tmp,
                "share",
            )
            labels = {key: label.format(n=args.jobs) for key, label in SETUP_ROWS.items()}
            print(
                paragraph(
                    "**Processes on the GPU before their jobs** (real `wattwatch up --simulate 1`, 1 s tick"
                    f"{flaws_note}, SDK processes; {runs}): GPU energy of each job and of its setup (the process's"
                    f" time on the GPU before the job) against {truth}; for the shared GPU, each process's set share"
                    " of it (70/30); min to max over runs and jobs:"
                )
            )
            print(render("energy of", rows, labels, dbs))
    print(f"pipeline.py: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BenchError as exc:
        raise SystemExit(f"pipeline.py: {exc}") from None
