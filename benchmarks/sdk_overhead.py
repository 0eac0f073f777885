"""What a span costs the workload's thread: ``with wattwatch.query():`` and ``with wattwatch.step():``,
against a baseline measured in the same process: an empty ``with`` of a trivial context manager (a
``contextlib.contextmanager`` generator that only yields, the machinery the SDK's spans are built on).

Each column runs in a fresh interpreter (the SDK keeps one client per process), inside one
``wattwatch.job(..., kind="inference")``:

- agent socket present: a real ``wattwatch up --simulate 1`` (SQLite, temporary home) runs meanwhile and
  the SDK's sender thread hands the spans to it (the count it handed over is checked);
- agent socket absent: the home has no socket; the SDK warns once and keeps spans in its bounded buffer.

Timing: ``--repeats`` rounds of one loop of ``--spans`` back-to-back spans per case (baseline, query,
step, in turn, so every case sees the same machine); per-span time is a loop's wall time
(``perf_counter_ns``) over its spans; the table gives the median over rounds. The SDK's sender thread
shares the interpreter, so whatever it does while a loop runs (encoding and sending spans) is in that
loop's time.

Run: ``python benchmarks/sdk_overhead.py [--spans 10000] [--repeats 15]`` (about 20 s at the defaults on a
2-core machine).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import command, paragraph, table
from realprocs import BenchError, clean_env, running_up

JOB_KIND = "inference"  # an inference job sending spans also runs the agent's fine tick: its busiest case
WARM_UP = 1000


@contextlib.contextmanager
def trivial() -> Iterator[None]:
    """The baseline: a context manager that does nothing."""
    yield


def loop_ns(make: Callable[[], contextlib.AbstractContextManager[Any]], spans: int) -> float:
    """Nanoseconds per span of ``spans`` back-to-back empty ``with make():`` blocks."""
    t0 = time.perf_counter_ns()
    for _ in range(spans):
        with make():
            pass
    return (time.perf_counter_ns() - t0) / spans


def worker(spans: int, repeats: int) -> dict[str, Any]:
    """In a fresh interpreter homed where the caller says: the baseline and each SDK span, timed."""
    import wattwatch
    from wattwatch.sdk import client as sdk_client

    makers: dict[str, Callable[[], contextlib.AbstractContextManager[Any]]] = {
        "baseline": trivial,
        "query": wattwatch.query,
        "step": wattwatch.step,
    }
    result: dict[str, Any] = {key: [] for key in makers}
    with wattwatch.job("sdk-overhead", kind=JOB_KIND):
        for make in makers.values():
            loop_ns(make, WARM_UP)  # the sender thread starts with the first span
        for _ in range(repeats):
            for key, make in makers.items():  # round robin: every case sees the same machine
                gc.collect()
                result[key].append(loop_ns(make, spans))
    # How many spans the sender handed to the agent's socket (the SDK's private counters; a check only).
    client = sdk_client._client
    buffer = client._spans if client is not None else None
    if buffer is not None:
        buffer.flush(timeout_s=60)
    result["recorded"] = (repeats * spans + WARM_UP) * (len(makers) - 1)
    result["sent"] = buffer.sent if buffer is not None else 0
    return result


def run_worker(home: Path, spans: int, repeats: int) -> dict[str, Any]:
    """``worker`` in a child interpreter with ``WATTWATCH_HOME=home``."""
    out = subprocess.run(
        [sys.executable, __file__, "--worker", "--spans", str(spans), "--repeats", str(repeats)],
        env={**clean_env(home), "CUDA_VISIBLE_DEVICES": "0"},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if out.returncode != 0:
        raise BenchError(f"the timing process failed: {out.stderr.strip()}")
    return dict(json.loads(out.stdout))


def us(ns: float) -> str:
    """Nanoseconds as microseconds, two decimals."""
    return f"{ns / 1000:.2f} µs"


def main(argv: Sequence[str] | None = None) -> int:
    """Time the spans with the agent's socket present and absent; print the table under its command."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--spans", type=int, default=10_000, help="spans per timed loop")
    ap.add_argument("--repeats", type=int, default=15, help="rounds of timed loops (the table gives the median)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.spans < 1 or args.repeats < 1:
        ap.error("--spans and --repeats must be at least 1")
    if args.worker:
        print(json.dumps(worker(args.spans, args.repeats)))
        return 0
    argv = list(sys.argv[1:] if argv is None else argv)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        with running_up(tmp / "up", f"sqlite:///{tmp / 'up.db'}", gpus=1) as up:
            present = run_worker(up.home, args.spans, args.repeats)
            up.stop()
        absent_home = tmp / "no-agent"
        absent_home.mkdir()
        absent = run_worker(absent_home, args.spans, args.repeats)
    if present["sent"] != present["recorded"]:
        raise BenchError(f"the SDK handed {present['sent']} of {present['recorded']} spans to the agent")
    if absent["sent"] != 0:
        raise BenchError(f"with no agent the SDK claims to have sent {absent['sent']} spans")
    rows = []
    for label, key in (
        ("empty `with` of a trivial context manager (baseline)", "baseline"),
        ("`with wattwatch.query():`", "query"),
        ("`with wattwatch.step():`", "step"),
    ):
        cells = [label]
        for result in (present, absent):
            median_ns = statistics.median(result[key])
            cells += [us(median_ns), f"{median_ns / statistics.median(result['baseline']):.1f}x"]
        rows.append(cells)
    print(command("sdk_overhead.py", argv))
    print(
        paragraph(
            f"**SDK cost per span on the workload's thread** (median of {args.repeats} loops of {args.spans:,}"
            " back-to-back empty spans, one process per column, inside an inference job), against a baseline timed"
            " in turn with them in the same process: an empty `with` of a trivial context manager. With the"
            " agent's socket present (a real `wattwatch up`), the SDK's sender thread handed all"
            f" {present['recorded']:,} spans to it, and its work while a loop ran is in that loop's time; with no"
            " socket the SDK warned once and buffered:"
        )
    )
    header = ("span", "socket present", "÷ baseline", "no agent socket", "÷ baseline")
    print(table(header, rows))
    print(f"sdk_overhead.py: {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except BenchError as exc:
        raise SystemExit(f"sdk_overhead.py: {exc}") from None
