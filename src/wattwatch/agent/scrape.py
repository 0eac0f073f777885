"""Zero-code query counts: scrape a serving engine's Prometheus endpoint every tick and turn its request
and token counters into ``wire.QueryCount`` windows for the job of the serving process.

Presets carry the engines' own metric names (vLLM ``vllm:request_success_total``, TGI
``tgi_request_success``, Triton ``nv_inference_request_success``, SGLang); any other server works with
``custom`` and named counters. Every series of a counter is followed on its own: a series that went
down was reset (the server restarted) and counts from zero; a series that first appears counts whole;
a changed ``process_start_time_seconds`` resets them all. Windows run from one successful scrape to the
next, zero counts included, so the collector knows which stretch of the job's energy the counts cover.

The job is the one given in the target (``#job=ID``), else the job of the process listening on the
URL's port, looked for among the GPU processes, their ancestors and those ancestors' children (never by
scanning all of /proc).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from wattwatch.agent.procfs import ProcFs, listening_socket_inodes, socket_inodes
from wattwatch.agent.requests import JOB_ID
from wattwatch.client import make_client
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Counters:
    """Sample names to sum per quantity (several names: whichever the server exposes)."""

    queries: tuple[str, ...]
    tokens_in: tuple[str, ...] = ()
    tokens_out: tuple[str, ...] = ()


PRESETS: Mapping[str, Counters] = {
    "vllm": Counters(("vllm:request_success_total",), ("vllm:prompt_tokens_total",), ("vllm:generation_tokens_total",)),
    # TGI's counters carry no _total suffix; token counts are the sums of its per-request histograms.
    "tgi": Counters(("tgi_request_success",), ("tgi_request_input_length_sum",), ("tgi_request_generated_tokens_sum",)),
    "triton": Counters(("nv_inference_request_success",)),
    "sglang": Counters(
        ("sglang:num_requests_total",), ("sglang:prompt_tokens_total",), ("sglang:generation_tokens_total",)
    ),
}
_START_TIME = "process_start_time_seconds"


@dataclass(frozen=True)
class ScrapeTarget:
    """One endpoint: its URL, the counters to read, and optionally the job to attribute them to."""

    url: str
    counters: Counters
    preset: str = "custom"
    job: str | None = None


def parse_target(spec: str) -> ScrapeTarget:
    """``PRESET:URL[#job=ID&queries=NAME|NAME&tokens_in=NAME&tokens_out=NAME]`` -> ScrapeTarget.

    Example: ``vllm:http://127.0.0.1:8000/metrics#job=chat``. The fragment never reaches the server.
    Raises ConfigError saying what a valid spec looks like.
    """
    preset, sep, url = spec.strip().partition(":")
    if not sep or not url.startswith(("http://", "https://")):
        raise ConfigError(f"scrape target {spec!r} is not PRESET:URL; e.g. vllm:http://127.0.0.1:8000/metrics")
    preset = preset.lower()
    parts = urlsplit(url)
    options = dict(parse_qsl(parts.fragment))
    unknown = set(options) - {"job", "queries", "tokens_in", "tokens_out"}
    if unknown:
        raise ConfigError(f"scrape target {spec!r}: unknown option(s) {', '.join(sorted(unknown))}")
    base = PRESETS.get(preset)
    if base is None and preset != "custom":
        raise ConfigError(f"scrape preset {preset!r} is not one of {', '.join([*PRESETS, 'custom'])}")
    if base is None and "queries" not in options:
        raise ConfigError(f"scrape target {spec!r}: custom targets need #queries=COUNTER_NAME")

    def names(key: str, default: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(n for n in options[key].split("|") if n) if key in options else default

    counters = Counters(
        names("queries", base.queries if base else ()),
        names("tokens_in", base.tokens_in if base else ()),
        names("tokens_out", base.tokens_out if base else ()),
    )
    job = options.get("job")
    if job is not None and not JOB_ID.fullmatch(job):
        raise ConfigError(f"scrape target {spec!r}: job id {job!r} may only contain letters, digits and _.:@/-")
    return ScrapeTarget(url=parts._replace(fragment="").geturl(), counters=counters, preset=preset, job=job)


def parse_targets(text: str) -> tuple[ScrapeTarget, ...]:
    """Comma- or whitespace-separated target specs (``WATTWATCH_SCRAPE``)."""
    return tuple(parse_target(s) for s in text.replace(",", " ").split())


def read_counters(text: str, counters: Counters) -> tuple[dict[tuple[str, tuple[tuple[str, str], ...]], float], float]:
    """(series -> value for every wanted sample, process start time or NaN) from exposition text."""
    wanted = set()
    for name in (*counters.queries, *counters.tokens_in, *counters.tokens_out):
        wanted.add(name)
        # Exposition libraries disagree on the _total suffix: accept the name with or without it.
        wanted.add(name.removesuffix("_total") if name.endswith("_total") else name + "_total")
    values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    start_s = math.nan
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == _START_TIME:
                start_s = float(sample.value)
            elif sample.name in wanted and math.isfinite(sample.value):
                values[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return values, start_s


@dataclass
class _State:
    last: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    start_s: float = math.nan
    t_s: float | None = None
    pid: int | None = None
    warned: str = ""


class Scraper:
    """Scrapes every target once per ``scrape_once()`` and hands the windows to ``emit``."""

    def __init__(
        self,
        targets: Iterable[ScrapeTarget],
        emit: Callable[[list[wire.QueryCount]], None],
        *,
        job_of_pid: Callable[[int], str | None],
        candidate_pids: Callable[[], set[int]],
        proc_root: Path = Path("/proc"),
        client: httpx.Client | None = None,
        clock: Callable[[], float] = time.time,
        timeout_s: float = 2.0,
    ) -> None:
        self.targets = list(targets)
        self._emit = emit
        self._job_of_pid = job_of_pid
        self._candidates = candidate_pids
        self._proc_root = proc_root
        self._client = client or make_client(timeout_s=timeout_s)
        self._clock = clock
        self._state = {t.url: _State() for t in self.targets}
        self._procfs = ProcFs(proc_root)

    def scrape_once(self) -> list[wire.QueryCount]:
        """Scrape every target; emit and return the windows closed now."""
        out: list[wire.QueryCount] = []
        for target in self.targets:
            try:
                count = self._scrape(target)
            except Exception:  # one bad endpoint must not stop the others
                log.exception("scraping %s failed", target.url)
                continue
            if count is not None:
                out.append(count)
        if out:
            self._emit(out)
        return out

    def close(self) -> None:
        """Close the HTTP client."""
        self._client.close()

    def _scrape(self, target: ScrapeTarget) -> wire.QueryCount | None:
        state = self._state[target.url]
        try:
            resp = self._client.get(target.url)
            resp.raise_for_status()
            values, start_s = read_counters(resp.text, target.counters)
        except (httpx.HTTPError, ValueError) as exc:
            self._warn(state, f"cannot scrape {target.url} ({exc}); its window stays open until it answers")
            return None
        t_s = self._clock()
        restarted = not math.isnan(state.start_s) and not math.isnan(start_s) and start_s != state.start_s
        deltas = {"queries": 0.0, "tokens_in": 0.0, "tokens_out": 0.0}
        for series, value in values.items():
            before = None if restarted else state.last.get(series)
            # A new series (or every series after a restart) counted from zero since the last scrape.
            delta = value if before is None or value < before else value - before
            deltas[_quantity(series[0], target.counters)] += delta
        first = state.t_s is None
        t_prev_s = state.t_s
        state.last, state.start_s, state.t_s = values, start_s, t_s
        if first or t_prev_s is None:
            return None  # the first scrape is the baseline: what came before it is nobody's window
        job = target.job or self._job(target, state)
        if job is None:
            self._warn(state, f"no job found for {target.url}: no GPU process listens on its port; set #job=ID")
            return None
        state.warned = ""
        return wire.QueryCount(
            job=job,
            t_start_s=t_prev_s,
            t_end_s=max(t_s, t_prev_s),
            queries=round(deltas["queries"]),
            tokens_in=round(deltas["tokens_in"]),
            tokens_out=round(deltas["tokens_out"]),
        )

    def _job(self, target: ScrapeTarget, state: _State) -> str | None:
        if state.pid is not None:
            job = self._job_of_pid(state.pid)
            if job is not None:
                return job
            state.pid = None  # the server went away or its job ended: look again
        inodes = listening_socket_inodes(self._proc_root, _port(target.url))
        if not inodes:
            return None
        candidates = sorted(self._candidates())
        for pid in candidates:
            if socket_inodes(self._proc_root, pid) & inodes:
                state.pid = pid
                return self._job_of_pid(pid)
        # A server whose HTTP front is a sibling of its GPU processes (TGI's router beside its shards,
        # both children of the launcher): the front belongs to the job of its parent.
        for parent in candidates:
            for pid in self._procfs.children(parent):
                if pid not in candidates and socket_inodes(self._proc_root, pid) & inodes:
                    state.pid = parent
                    return self._job_of_pid(parent)
        return None

    def _warn(self, state: _State, message: str) -> None:
        if message != state.warned:
            log.warning("%s", message)
        state.warned = message


def _quantity(name: str, counters: Counters) -> str:
    for quantity, names in (("queries", counters.queries), ("tokens_in", counters.tokens_in)):
        if name in names or name + "_total" in names or name.removesuffix("_total") in names:
            return quantity
    return "tokens_out"


def _port(url: str) -> int:
    parts = urlsplit(url)
    if parts.port is not None:
        return parts.port
    return 443 if parts.scheme == "https" else 80
