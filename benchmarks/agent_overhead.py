"""What the wattwatch agent costs the host it measures, beside CodeCarbon's tracker measured in the same run.

Starts, all at once, and measures over the same window after a warm-up:

- a real ``wattwatch agent --simulate N --interval S`` pushing to a real ``wattwatch collector`` (both
  ``python -m wattwatch.cli.main``, in temporary homes, SQLite), so the push path is included; with
  ``--metrics`` the agent also serves ``--metrics-listen`` and this script scrapes it every ``--scrape-every`` s;
- CodeCarbon's ``OfflineEmissionsTracker`` (``measure_power_secs`` = the tick) tracking the same
  simulated boards through the same fake ``pynvml`` (``overhead_workers.py codecarbon``);
- the simulator alone, its boards read once per tick (``overhead_workers.py simulator``): the
  simulator runs inside the agent (and inside CodeCarbon) here, and on real GPUs it is not there;
- a bare ``python -c "import time; time.sleep(...)"``: the interpreter's floor.

CPU is user + system CPU-seconds of each process and its children over the window, per wall second
(100 % = one core), read from each process's kernel CPU clock in ns (psutil's process totals count
10 ms ticks, too coarse for figures well under 1 %; they are checked against it);
RSS is the process tree's resident set, sampled every 0.5 s (peak) and at the end, USS at the end.
Prints the command line, one markdown table, a line saying what was measured against what, and checks
(the collector stored the agent's batches, CodeCarbon measured every GPU).

    PYTHONPATH=src python benchmarks/agent_overhead.py [--duration 30] [--warmup 5] [--gpus 8] [--interval 1]
        [--metrics]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import psutil

HERE = Path(__file__).resolve().parent
WATTWATCH = [sys.executable, "-m", "wattwatch.cli.main"]
MB = 1e6
SAMPLE_EVERY_S = 0.5
START_TIMEOUT_S = 60.0
AGENT = "wattwatch agent"
CODECARBON = "CodeCarbon OfflineEmissionsTracker"


def process_cpu_clock(pid: int) -> int:
    """The clock id of process ``pid``'s CPU time (Linux's ``clock_getcpuclockid``: user + system, all
    threads), readable with ``time.clock_gettime``."""
    return ((~pid) << 3) | 2  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def _cpu_clocks_work() -> bool:
    try:
        return time.clock_gettime(process_cpu_clock(os.getpid())) > 0
    except (OSError, AttributeError):
        return False


CPU_CLOCKS = _cpu_clocks_work()


class BenchError(Exception):
    """The benchmark could not run; ``str()`` is one line saying why and what to do."""


@dataclass(eq=False)  # hashable by identity: used as a dict key while waiting for readiness
class Measured:
    """One process under measurement and what was measured of it."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    proc: psutil.Process = field(init=False)
    ticks_start_s: float = math.nan
    ticks_end_s: float = math.nan
    precise_start_s: float = math.nan
    precise_end_s: float = math.nan
    rss_peak_b: int = 0
    rss_end_b: int = 0
    uss_end_b: int = 0

    def __post_init__(self) -> None:
        self.proc = psutil.Process(self.popen.pid)

    def tree(self) -> list[psutil.Process]:
        """The process and its live descendants."""
        try:
            return [self.proc, *self.proc.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def ticks_s(self) -> float:
        """psutil's user + system CPU-seconds of the tree, reaped children included (10 ms ticks)."""
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            total += t.user + t.system + t.children_user + t.children_system
        return total

    def precise_s(self) -> float:
        """The same, with each live process's CPU from its kernel CPU clock (ns, every thread, ended ones
        too); reaped children still come from psutil's ticks."""
        total = 0.0
        for p in self.tree():
            try:
                t = p.cpu_times()
                total += time.clock_gettime(process_cpu_clock(p.pid)) + t.children_user + t.children_system
            except (psutil.NoSuchProcess, psutil.AccessDenied, OSError):
                continue
        return total

    def start_window(self) -> None:
        """Take the CPU readings the window starts from."""
        self.ticks_start_s, self.precise_start_s = self.ticks_s(), self.precise_s()

    def sample(self) -> None:
        """Fold the tree's RSS now into the peak."""
        self.rss_peak_b = max(self.rss_peak_b, _sum_memory(self.tree(), lambda p: int(p.memory_info().rss)))

    def end_window(self) -> None:
        """Take the CPU readings the window ends with."""
        self.precise_end_s, self.ticks_end_s = self.precise_s(), self.ticks_s()

    def ticks_cpu_s(self) -> float:
        """CPU-seconds in the window by psutil's process totals (10 ms resolution)."""
        return self.ticks_end_s - self.ticks_start_s

    def cpu_s(self) -> float:
        """CPU-seconds in the window: from the kernel's CPU clocks where they can be read (a 30 s window
        at 0.3 % of a core is only 9 of psutil's 10 ms ticks), else psutil's totals."""
        return self.precise_end_s - self.precise_start_s if CPU_CLOCKS else self.ticks_cpu_s()

    def finish_memory(self) -> None:
        """RSS and USS of the tree now (USS reads smaps: once, at the end)."""
        tree = self.tree()
        self.rss_end_b = _sum_memory(tree, lambda p: int(p.memory_info().rss))
        self.uss_end_b = _sum_memory(tree, lambda p: int(p.memory_full_info().uss))
        self.rss_peak_b = max(self.rss_peak_b, self.rss_end_b)

    def log_tail(self, lines: int = 5) -> str:
        """The last lines the process wrote (stdout and stderr)."""
        try:
            text = self.log.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])


def _sum_memory(tree: list[psutil.Process], what: Callable[[psutil.Process], int]) -> int:
    total = 0
    for p in tree:
        try:
            total += what(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return total


@dataclass
class Run:
    """Everything one benchmark run measured."""

    rows: list[Measured]
    window_s: float
    collector: Measured
    scrapes_ok: int = 0
    scrapes_failed: int = 0
    ingest: dict[str, float] = field(default_factory=dict)
    codecarbon: dict[str, float] = field(default_factory=dict)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_get(url: str, timeout_s: float = 2.0) -> str | None:
    """The body of a 200 answer, else None."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return resp.read().decode() if resp.status == 200 else None
    except (urllib.error.URLError, OSError):
        return None


def start(name: str, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> Measured:
    """Start ``cmd`` with its output in ``log``."""
    with log.open("wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL)
    return Measured(name, popen, log)


def wait_ready(procs: dict[Measured, Callable[[], bool]], on_exit: Callable[[Measured, int], None]) -> None:
    """Wait until every process's readiness check holds; ``on_exit`` is told of one that exits first."""
    pending = dict(procs)
    deadline = time.monotonic() + START_TIMEOUT_S
    while pending:
        for m, ready in list(pending.items()):
            code = m.popen.poll()
            if code is not None:
                on_exit(m, code)
                raise BenchError(f"{m.name} exited with {code} while starting: {m.log_tail()}")
            if ready():
                del pending[m]
        if time.monotonic() > deadline:
            m = next(iter(pending))
            raise BenchError(f"{m.name} not ready after {START_TIMEOUT_S:.0f} s: {m.log_tail() or 'no output'}")
        time.sleep(0.1)


def agent_exit(m: Measured, code: int, metrics: bool) -> None:
    """Explain an agent that refused ``--metrics-listen`` (an older wattwatch)."""
    if m.name == AGENT and metrics and code == 2 and "metrics-listen" in m.log_tail(20):
        raise BenchError(
            f"this wattwatch agent has no --metrics-listen yet (it exited 2: {m.log_tail(1)}); run without --metrics"
        )


def ingest_counts(collector_url: str) -> dict[str, float]:
    """The collector's ingest counters (batches and intervals stored), from its /metrics."""
    body = http_get(f"{collector_url}/metrics", timeout_s=10.0) or ""
    out: dict[str, float] = {}
    for line in body.splitlines():
        for key in ("wattwatch_ingest_batches_total", "wattwatch_ingest_intervals_total"):
            if line.startswith(key + " "):
                out[key] = float(line.split()[1])
    return out


def stop_all(procs: list[Measured]) -> None:
    """SIGTERM and reap every process but the last, then the last (the collector: the agent's final
    push still finds it)."""
    for group in (procs[:-1], procs[-1:]):
        for m in group:
            if m.popen.poll() is None:
                m.popen.terminate()
        for m in group:
            try:
                m.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                m.popen.kill()
                m.popen.wait()


def measure(args: argparse.Namespace, tmp: Path) -> Run:
    """Start everything, warm up, measure the window, stop everything."""
    env = {**os.environ}
    col_port, metrics_port = free_port(), free_port()
    collector_url = f"http://127.0.0.1:{col_port}"
    metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
    (tmp / "collector").mkdir()
    db_url = f"sqlite:///{tmp / 'collector' / 'wattwatch.db'}"
    (tmp / "agent").mkdir()
    procs: list[Measured] = []
    try:
        collector = start(
            "wattwatch collector (receives the pushes)",
            [*WATTWATCH, "collector", "--migrate", "--open", "--db", db_url, "--listen", f"127.0.0.1:{col_port}"],
            tmp / "collector.log",
            {**env, "WATTWATCH_HOME": str(tmp / "collector")},
        )
        procs.append(collector)
        wait_ready({collector: lambda: http_get(f"{collector_url}/healthz") is not None}, lambda m, c: None)
        agent_cmd = [*WATTWATCH, "agent", "--simulate", str(args.gpus), "--interval", str(args.interval)]
        agent_cmd += ["--collector", collector_url]
        if args.push_interval is not None:
            agent_cmd += ["--push-interval", str(args.push_interval)]
        if args.metrics:
            agent_cmd += ["--metrics-listen", f"127.0.0.1:{metrics_port}"]
        agent = start(AGENT, agent_cmd, tmp / "agent.log", {**env, "WATTWATCH_HOME": str(tmp / "agent")})
        procs.insert(0, agent)
        worker = [sys.executable, str(HERE / "overhead_workers.py")]
        common = ["--gpus", str(args.gpus), "--interval", str(args.interval)]
        codecarbon = start(
            CODECARBON,
            [*worker, "codecarbon", *common, "--ready", str(tmp / "cc.ready"), "--result", str(tmp / "cc.json")],
            tmp / "codecarbon.log",
        )
        simulator = start(
            "simulator alone (fake boards read each tick)",
            [*worker, "simulator", *common, "--ready", str(tmp / "sim.ready")],
            tmp / "simulator.log",
        )
        sleeper = start(
            "bare python (time.sleep)",
            [sys.executable, "-c", "import time; time.sleep(86400)"],
            tmp / "sleep.log",
        )
        procs[1:1] = [codecarbon, simulator, sleeper]

        def agent_ready() -> bool:
            if not (tmp / "agent" / "agent.sock").exists():
                return False
            return not args.metrics or http_get(metrics_url) is not None

        wait_ready(
            {
                agent: agent_ready,
                codecarbon: (tmp / "cc.ready").exists,
                simulator: (tmp / "sim.ready").exists,
                sleeper: lambda: True,
            },
            lambda m, code: agent_exit(m, code, args.metrics),
        )
        rows = [agent, codecarbon, simulator, sleeper]
        run = Run(rows=rows, window_s=0.0, collector=collector)
        watched = [*rows, collector]
        monitor(run, watched, args.warmup, metrics_url if args.metrics else None, args.scrape_every, measuring=False)
        t0 = time.monotonic()
        for m in watched:
            m.start_window()
        monitor(run, watched, args.duration, metrics_url if args.metrics else None, args.scrape_every, measuring=True)
        for m in watched:
            m.end_window()
        run.window_s = time.monotonic() - t0
        for m in watched:
            m.finish_memory()
        for m in watched:
            if m.popen.poll() is not None:
                raise BenchError(f"{m.name} exited with {m.popen.returncode} during the run: {m.log_tail()}")
        run.ingest = ingest_counts(collector_url)
    finally:
        stop_all(procs)
    if (tmp / "cc.json").exists():
        run.codecarbon = json.loads((tmp / "cc.json").read_text())
    return run


def monitor(
    run: Run,
    watched: list[Measured],
    seconds: float,
    metrics_url: str | None,
    scrape_every_s: float,
    *,
    measuring: bool,
) -> None:
    """For ``seconds``: sample RSS every ``SAMPLE_EVERY_S`` (when ``measuring``) and scrape the agent's
    /metrics every ``scrape_every_s`` (when asked), failing early if a process dies."""
    now = time.monotonic()
    end = now + seconds
    next_sample = next_scrape = now
    while (now := time.monotonic()) < end:
        if measuring and now >= next_sample:
            for m in watched:
                m.sample()
            next_sample += SAMPLE_EVERY_S
        if metrics_url is not None and now >= next_scrape:
            if http_get(metrics_url) is None:
                run.scrapes_failed += 1
            else:
                run.scrapes_ok += 1
            next_scrape += scrape_every_s
        for m in watched:
            if m.popen.poll() is not None:
                raise BenchError(f"{m.name} exited with {m.popen.returncode} during the run: {m.log_tail()}")
        wake = min(end, next_sample if measuring else end, next_scrape if metrics_url else end)
        time.sleep(max(0.0, min(wake - time.monotonic(), 0.5)))


def cpu_percent(m: Measured, window_s: float) -> float:
    """CPU-seconds per wall second over the window, in % of one core."""
    return 100.0 * m.cpu_s() / window_s


def format_table(run: Run, args: argparse.Namespace, command: str) -> str:
    """The command line, the markdown table and the line saying what was measured against what."""
    by_name = {m.name: m for m in run.rows}
    cc_cpu = cpu_percent(by_name[CODECARBON], run.window_s)
    agent_label = f"{AGENT} (--simulate {args.gpus}, {args.interval:g} s tick, pushing" + (
        ", serving /metrics)" if args.metrics else ")"
    )
    lines = [
        f"`{command}`",
        "",
        "| process | CPU % of a core | RSS MB (peak) | ratio to CodeCarbon CPU | RSS MB (end) | USS MB (end) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for m in [*run.rows, run.collector]:
        label = agent_label if m.name == AGENT else m.name
        if m.name == CODECARBON:
            label = f"{CODECARBON} ({args.gpus} simulated GPUs, measure_power_secs={args.interval:g})"
        cpu = cpu_percent(m, run.window_s)
        ratio = f"{cpu / cc_cpu:.2f}x" if cc_cpu > 0 else "n/a"
        lines.append(
            f"| {label} | {cpu:.3f} | {m.rss_peak_b / MB:.1f} | {ratio} | {m.rss_end_b / MB:.1f} | "
            f"{m.uss_end_b / MB:.1f} |"
        )
    lines.append("")
    cpu_name = platform.processor() or platform.machine()
    lines.append(
        f"Measured together over the same {run.window_s:.1f} s window after a {args.warmup:g} s warm-up: the wattwatch "
        f"agent reading {args.gpus} simulated GPUs every {args.interval:g} s and pushing to a real collector (SQLite)"
        + (f", its /metrics scraped every {args.scrape_every:g} s" if args.metrics else "")
        + f", against CodeCarbon {_version('codecarbon')}'s OfflineEmissionsTracker reading the same simulated boards "
        "through the same fake pynvml and keeping its figures in memory (save_to_file=False); CPU = user+sys "
        "CPU-seconds of the process and its children per wall second; "
        f"both carry the simulator's reads, which real GPUs replace with driver calls "
        f"({psutil.cpu_count()} cores, {cpu_name}, Python {platform.python_version()}, psutil {psutil.__version__})."
    )
    checks = [
        f"collector stored {run.ingest.get('wattwatch_ingest_batches_total', 0):.0f} batches "
        f"({run.ingest.get('wattwatch_ingest_intervals_total', 0):.0f} intervals) from the agent",
        f"CodeCarbon measured {run.codecarbon.get('gpu_count', 0):.0f} GPUs, "
        f"{run.codecarbon.get('gpu_energy_j', 0.0):.0f} J over {run.codecarbon.get('duration_s', 0.0):.0f} s",
    ]
    for m in [*run.rows, run.collector]:
        # The CPU clocks and psutil's ticks must agree to a few ticks; if not, say so rather than print a
        # doubtful figure silently.
        if CPU_CLOCKS and abs(m.cpu_s() - m.ticks_cpu_s()) > 0.03 + 0.05 * m.ticks_cpu_s():
            checks.append(f"{m.name}: CPU clock {m.cpu_s():.3f} s but psutil ticks {m.ticks_cpu_s():.3f} s of CPU")
    if args.metrics:
        checks.append(f"agent /metrics scraped {run.scrapes_ok} times ({run.scrapes_failed} failed)")
    lines.append("Checks: " + "; ".join(checks) + ".")
    return "\n".join(lines)


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The benchmark's options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=30.0, help="measured window in seconds (default 30)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds after start-up before measuring (default 5)")
    p.add_argument("--gpus", type=int, default=8, help="simulated GPUs (default 8)")
    p.add_argument("--interval", type=float, default=1.0, help="sampling tick in seconds, both tools (default 1)")
    p.add_argument(
        "--push-interval",
        type=float,
        metavar="S",
        help="seconds between the agent's pushes (default: the agent's own, 5 s); a short run needs less",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        help="agent serves --metrics-listen 127.0.0.1:PORT, scraped every --scrape-every seconds",
    )
    p.add_argument(
        "--scrape-every",
        type=float,
        default=15.0,
        metavar="S",
        help="with --metrics: seconds between scrapes (default 15, a common Prometheus scrape interval)",
    )
    args = p.parse_args(argv)
    if args.duration <= 0 or args.warmup < 0 or args.interval <= 0 or not 1 <= args.gpus <= 64:
        p.error("--duration and --interval must be > 0, --warmup >= 0, --gpus 1 to 64")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table; 2 when it could not run (the reason on stderr)."""
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    command = shlex.join(["python", "benchmarks/agent_overhead.py", *argv])
    with tempfile.TemporaryDirectory(prefix="wattwatch-overhead-") as tmp:
        try:
            run = measure(args, Path(tmp))
        except BenchError as exc:
            sys.stderr.write(f"agent_overhead: {exc}\n")
            return 2
    print(format_table(run, args, command))
    return 0


if __name__ == "__main__":
    sys.exit(main())
