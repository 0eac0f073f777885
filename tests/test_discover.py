"""Job discovery from /proc, cgroups and the kubelet: a fixture /proc tree (tests/fixtures/proc), a real
kubelet-shaped HTTP server on loopback, and simulated GPUs behind the fake NVML module."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from wattwatch.agent.discover import ProcessClassifier, match_command, pod_uid_from_cgroups
from wattwatch.agent.jobs import DISCOVERED_BY
from wattwatch.agent.kubelet import KubeletPods
from wattwatch.agent.options import AgentOptions
from wattwatch.agent.procfs import ProcFs
from wattwatch.agent.runner import Agent
from wattwatch.agent.spool import Spool
from wattwatch.config import Settings, load_settings
from wattwatch.errors import ConfigError
from wattwatch.protocol import wire
from wattwatch.sensors.nvml import NvmlSensor
from wattwatch.sim.fleet import SimulatedFleet

FIXTURES = Path(__file__).parent / "fixtures"
PROC = FIXTURES / "proc"
POD_VLLM = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
POD_TRAIN = "7a8b9c0d-1e2f-3a4b-5c6d-7e8f9a0b1c2d"
TRAIN_OWNER = "9f8e7d6c-5b4a-4392-8170-6f5e4d3c2b1a"
POD_UNKNOWN = "deadbeef-0000-4000-8000-000000000001"


@dataclass
class Kubelet:
    url: str
    status: int = 200
    requests: list[dict[str, str]] = field(default_factory=list)


@pytest.fixture
def kubelet() -> Iterator[Kubelet]:
    """A loopback HTTP server answering GET /pods with the fixture PodList, as a kubelet does."""
    body = (FIXTURES / "kubelet-pods.json").read_bytes()
    state = Kubelet(url="")

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            state.requests.append(dict(self.headers))
            payload = body if state.status == 200 else b'{"kind":"Status","code":403}'
            self.send_response(state.status if self.path == "/pods" else 404)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    state.url = f"http://127.0.0.1:{server.server_address[1]}/pods"
    yield state
    server.shutdown()
    server.server_close()


# -- /proc parsing ----------------------------------------------------------------------------------


def test_procfs_reads_stat_environ_cmdline_cgroups_and_lineage() -> None:
    proc = ProcFs(PROC, clock_ticks_per_s=100)
    st = proc.stat(4242)
    assert st is not None
    assert (st.ppid, st.start_ticks) == (4200, 90200)
    assert st.cpu_s == pytest.approx(102.0) and st.children_cpu_s == pytest.approx(3.4)
    env = proc.environ(4242)
    assert env is not None and env["SLURM_JOB_ID"] == "12345"
    assert proc.environ(4343) is None  # not readable: the classifier must cope
    assert proc.cmdline(5151) == ["VLLM::EngineCore"]
    assert proc.cgroups(4242)[0] == "/slurm/uid_1000/job_12345/step_0/task_0"
    assert proc.lineage(4242) == [4242, 4200, 4100]
    assert proc.descendants([4100]) == {4100, 4200, 4242}
    assert proc.stat(31337) is None and proc.cmdline(31337) == [] and proc.cgroups(31337) == []


def test_stat_with_a_command_holding_spaces_and_parentheses(tmp_path: Path) -> None:
    (tmp_path / "77").mkdir()
    fields = " ".join(["S", "1", *["0"] * 9, "250", "50", "0", "0", *["0"] * 4, "4242", "0"])
    (tmp_path / "77" / "stat").write_text(f"77 (my (odd) cmd) {fields}\n")
    st = ProcFs(tmp_path, clock_ticks_per_s=100).stat(77)
    assert st is not None and (st.ppid, st.start_ticks, st.cpu_s) == (1, 4242, 3.0)


@pytest.mark.parametrize(
    ("cgroup", "uid"),
    [
        # cgroup v1, cgroupfs driver, burstable / guaranteed / besteffort
        (f"/kubepods/burstable/pod{POD_VLLM}/0123abcd", POD_VLLM),
        (f"/kubepods/pod{POD_VLLM}/0123abcd", POD_VLLM),
        (f"/kubepods/besteffort/pod{POD_VLLM}/0123abcd", POD_VLLM),
        # systemd driver (v1 and v2): dashes in the UID become underscores
        (
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
            f"{POD_VLLM.replace('-', '_')}.slice/cri-containerd-0123.scope",
            POD_VLLM,
        ),
        (f"/kubepods.slice/kubepods-pod{POD_VLLM.replace('-', '_')}.slice/crio-0123.scope", POD_VLLM),
        # containerd nested under its own service (kind, some k3s setups)
        (
            f"/system.slice/containerd.service/kubepods-besteffort-pod{POD_VLLM.replace('-', '_')}.slice:cri:0123",
            POD_VLLM,
        ),
        ("/user.slice/user-1000.slice/session-3.scope", None),
        ("/docker/0123456789abcdef", None),
    ],
)
def test_pod_uid_from_every_common_cgroup_form(cgroup: str, uid: str | None) -> None:
    assert pod_uid_from_cgroups(["/", cgroup]) == uid


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["/usr/local/bin/vllm", "serve", "m"], ("vllm", "inference")),
        (["python3", "-m", "vllm.entrypoints.openai.api_server"], ("vllm", "inference")),
        (["VLLM::EngineCore"], ("vllm", "inference")),
        (["text-generation-launcher", "--model-id", "m"], ("tgi", "inference")),
        (["/opt/tritonserver/bin/tritonserver", "--model-repository=/m"], ("triton", "inference")),
        (["python", "-m", "sglang.launch_server"], ("sglang", "inference")),
        (["/venv/bin/python3", "/venv/bin/torchrun", "train.py"], ("torchrun", "training")),
        (["python", "-m", "torch.distributed.run", "train.py"], ("torchrun", "training")),
        (["deepspeed", "train.py"], ("deepspeed", "training")),
        (["accelerate", "launch", "train.py"], ("accelerate", "training")),
        (["python3", "train.py"], None),
        ([], None),
    ],
)
def test_command_heuristics(argv: list[str], expected: tuple[str, str] | None) -> None:
    assert match_command(argv) == expected


# -- classification ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pid", "job_id", "name", "kind", "reason", "kind_by"),
    [
        (4242, "slurm-12345", "llama-pretrain", "training", "slurm:12345", "heuristic:torchrun"),
        (4343, "slurm-777", "slurm-777", "other", "slurm:777", "default"),
        (5151, "chat-prod", "chat-prod", "inference", f"kubernetes:{POD_VLLM}", "heuristic:vllm"),
        (6161, f"k8s-{TRAIN_OWNER}", "research/llama-ft", "training", f"kubernetes:{POD_TRAIN}", "annotation"),
        (6262, f"k8s-{POD_UNKNOWN}", f"k8s-{POD_UNKNOWN}", "other", f"kubernetes:{POD_UNKNOWN}", "default"),
        (7171, "proc-node-3-7170-94000", "vllm serve Qwen/Qwen2.5-7B", "inference", "heuristic:vllm", "heuristic:vllm"),
        (8181, "proc-node-3-8181-95000", "notebook_cell.py", "other", "heuristic:none", "default"),
        (9191, "exp-42", "exp-42", "training", "environ:WATTWATCH_JOB", "environ:WATTWATCH_KIND"),
    ],
)
def test_each_process_is_classified_with_its_reason(
    kubelet: Kubelet, pid: int, job_id: str, name: str, kind: str, reason: str, kind_by: str
) -> None:
    proc = ProcFs(PROC)
    classifier = ProcessClassifier(proc, "node-3", KubeletPods(kubelet.url))
    found = classifier.classify(pid, proc.lineage(pid))
    assert found is not None
    assert (found.job_id, found.name, found.kind, found.reason) == (job_id, name, kind, reason)
    assert found.labels[DISCOVERED_BY] == reason
    assert found.labels["wattwatch.io/kind-by"].startswith(kind_by)


def test_pod_labels_reach_the_job_and_a_refusing_kubelet_still_names_the_pod(kubelet: Kubelet, tmp_path: Path) -> None:
    proc = ProcFs(PROC)
    found = ProcessClassifier(proc, "n", KubeletPods(kubelet.url)).classify(5151, proc.lineage(5151))
    assert found is not None
    assert found.labels["k8s.namespace"] == "serving" and found.labels["k8s.label.app"] == "chat"
    assert found.labels["k8s.owner"] == "ReplicaSet/chat-7d9f"
    kubelet.status = 403
    (tmp_path / "token").write_text("s3cret-token\n")
    pods = KubeletPods(kubelet.url, token_file=tmp_path / "token", min_refresh_s=0)
    again = ProcessClassifier(proc, "n", pods).classify(5151, proc.lineage(5151))
    assert again is not None and again.job_id == f"k8s-{POD_VLLM}"
    assert kubelet.requests[-1]["Authorization"] == "Bearer s3cret-token"


def test_kubelet_is_asked_again_only_for_new_pods_and_at_most_every_min_refresh(kubelet: Kubelet) -> None:
    now = [0.0]
    pods = KubeletPods(kubelet.url, min_refresh_s=5.0, monotonic=lambda: now[0])
    assert pods.pod(POD_VLLM) is not None
    assert pods.pod(POD_TRAIN) is not None  # cached: no second request
    assert pods.pod(POD_UNKNOWN) is None
    assert len(kubelet.requests) == 1
    now[0] = 6.0
    assert pods.pod(POD_UNKNOWN) is None
    assert len(kubelet.requests) == 2


def _options(
    env: dict[str, str], flags: dict[str, tuple[str, object]] | None = None, scrape: tuple[str, ...] = ()
) -> AgentOptions:
    settings = load_settings({"WATTWATCH_HOME": "/nonexistent", **env}, flags=flags)
    return AgentOptions.from_settings(settings, scrape=scrape)


def test_options_from_the_environment() -> None:
    opts = _options(
        {
            "WATTWATCH_DISCOVER": "0",
            "WATTWATCH_PROC_ROOT": "/host/proc",
            "WATTWATCH_KUBELET_URL": "https://10.0.0.3:10250/pods",
            "WATTWATCH_KUBELET_INSECURE": "1",
            "WATTWATCH_SCRAPE": "vllm:http://127.0.0.1:8000/metrics#job=chat, triton:http://127.0.0.1:8002/metrics",
        }
    )
    assert opts.discover is False and opts.proc_root == Path("/host/proc") and opts.kubelet_verify is False
    assert [(t.preset, t.url, t.job) for t in opts.scrape] == [
        ("vllm", "http://127.0.0.1:8000/metrics", "chat"),
        ("triton", "http://127.0.0.1:8002/metrics", None),
    ]
    # Command-line values win over the environment; --scrape adds to WATTWATCH_SCRAPE.
    flags = _options(
        {"WATTWATCH_DISCOVER": "yes", "WATTWATCH_SCRAPE": "triton:http://127.0.0.1:8002/metrics"},
        flags={
            "kubelet_url": ("--kubelet-url http://127.0.0.1:10255/pods", "http://127.0.0.1:10255/pods"),
            "proc_root": ("--proc-root /host/proc", "/host/proc"),
            "discover": ("--no-discover", False),
        },
        scrape=("tgi:http://127.0.0.1:3000/metrics",),
    )
    assert flags.discover is False and flags.proc_root == Path("/host/proc")
    assert [t.preset for t in flags.scrape] == ["triton", "tgi"]
    assert flags.kubelet_url == "http://127.0.0.1:10255/pods" and flags.kubelet_token_file is None
    assert _options({"WATTWATCH_KUBELET_CA_FILE": "/etc/kubelet-ca.pem"}).kubelet_verify == "/etc/kubelet-ca.pem"
    with pytest.raises(ConfigError, match="not a URL"):
        _options({"WATTWATCH_KUBELET_URL": "10.0.0.3:10250"})
    with pytest.raises(ConfigError, match=r"^WATTWATCH_DISCOVER=maybe is not a yes/no value"):
        _options({"WATTWATCH_DISCOVER": "maybe"})
    with pytest.raises(ConfigError, match="WATTWATCH_SCRAPE"):
        _options({"WATTWATCH_SCRAPE": "nginx:http://x/metrics"})
    with pytest.raises(ConfigError, match=r"^--scrape: "):
        _options({}, scrape=("nginx:http://x/metrics",))


def test_agent_options_come_from_the_toml_file_too(tmp_path: Path) -> None:
    (tmp_path / "wattwatch.toml").write_text(
        'discover = false\nscrape = "vllm:http://127.0.0.1:8000/metrics"\npoison_after = 3\nfine_tick_hold_s = 2\n'
    )
    opts = AgentOptions.from_settings(load_settings({"WATTWATCH_HOME": str(tmp_path)}))
    assert opts.discover is False and [t.preset for t in opts.scrape] == ["vllm"]
    assert opts.poison_after == 3 and opts.fine_tick_hold_s == 2.0
    (tmp_path / "wattwatch.toml").write_text('discover = "sometimes"\n')
    with pytest.raises(ConfigError, match=r"discover = 'sometimes' in .* is not a yes/no value"):
        load_settings({"WATTWATCH_HOME": str(tmp_path)})


# -- the agent, end to end on simulated GPUs ------------------------------------------------------------


class CountingProcFs(ProcFs):
    """Counts the files read, to hold the tracker to "no scan of all of /proc per tick"."""

    def __init__(self, root: Path) -> None:
        super().__init__(root)
        self.reads: list[tuple[int, str]] = []

    def _read(self, pid: int, name: str) -> bytes | None:
        self.reads.append((pid, name))
        return super()._read(pid, name)


def spooled(home: Path) -> list[wire.Batch]:
    spool = Spool(home / "spool.db")
    try:
        return [wire.decode_batch(body) for _, body in spool.peek(limit=10_000)]
    finally:
        spool.close()


def test_slurm_and_kubernetes_processes_on_simulated_gpus_are_attributed_right(
    tmp_path: Path, kubelet: Kubelet
) -> None:
    fleet = SimulatedFleet(3)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    proc = CountingProcFs(PROC)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="node-3")
    agent = Agent(
        settings,
        [sensor],
        gpu_processes=sensor,
        serve_socket=False,
        procfs=proc,
        pods=KubeletPods(kubelet.url),
    )
    agent.start()
    try:
        t0 = fleet.clock()
        fleet.set_activity(0, "training", t0, pid=4242)  # Slurm rank
        fleet.set_activity(1, "inference", t0, pid=5151)  # vLLM engine in a pod
        fleet.set_activity(2, "training", t0, pid=6161)  # PyTorchJob worker in a pod
        assert agent.tick()
        jobs = {j["id"]: j for j in agent.jobs()}
        assert set(jobs) == {"slurm-12345", "chat-prod", f"k8s-{TRAIN_OWNER}"}
        assert jobs["slurm-12345"]["devices"] == ["gpu0"] and jobs["slurm-12345"]["discovered_by"] == "slurm:12345"
        assert jobs["chat-prod"]["devices"] == ["gpu1"] and jobs["chat-prod"]["kind"] == "inference"
        assert jobs[f"k8s-{TRAIN_OWNER}"]["discovered_by"] == f"kubernetes:{POD_TRAIN}"

        proc.reads.clear()
        assert agent.tick()
        # Steady state: one stat per GPU process, and the CPU meter's reads of the jobs' own trees.
        gpu_reads = [r for r in proc.reads if r[1] != "stat"]
        assert {pid for pid, _ in proc.reads} <= {4242, 4200, 4100, 5151, 5150, 6161}
        assert gpu_reads == []

        fleet.set_activity(0, "idle", fleet.clock(), pid=4242)  # the Slurm rank leaves its GPU
        assert agent.tick()
        assert {j["id"] for j in agent.jobs()} == {"chat-prod", f"k8s-{TRAIN_OWNER}"}
    finally:
        agent.stop(flush_timeout_s=0.2)
    batches = spooled(tmp_path)
    records = [j for b in batches for j in b.jobs]
    slurm = [j for j in records if j.id == "slurm-12345"]
    assert [j.ended_at_s is None for j in slurm] == [True, False]
    assert slurm[0].labels["slurm.user"] == "alice" and slurm[0].kind == "training"
    start_s, end_s = slurm[0].started_at_s, slurm[1].ended_at_s
    assert end_s is not None and end_s > start_s
    # Stopping the agent ends the jobs it discovered: nobody else would.
    assert all(any(r.id == j and r.ended_at_s for r in records) for j in ("chat-prod", f"k8s-{TRAIN_OWNER}"))
    for iv in (iv for b in batches for iv in b.intervals if iv.device == "gpu0"):
        # The job opens and ends at a tick's stamp, and every reading of a tick is carried to its stamp.
        held = start_s <= iv.t_start_s and iv.t_end_s <= end_s
        assert iv.shares == ({"slurm-12345": 1.0} if held else {}), (iv, start_s, end_s)
    gpu1 = [iv for b in batches for iv in b.intervals if iv.device == "gpu1" and iv.shares]
    assert gpu1 and all(iv.shares == {"chat-prod": 1.0} for iv in gpu1)


def test_explicit_jobs_win_over_discovery_and_bind_to_their_gpu(tmp_path: Path) -> None:
    fleet = SimulatedFleet(2)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="n")
    agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(PROC))
    agent.start()
    try:
        # `wattwatch run` wrapping torchrun (pid 4200): its rank 4242 is on gpu1 and carries SLURM_JOB_ID,
        # but the explicit job is its ancestor, so it is that job's process.
        agent.handle({"op": "job_start", "id": "llama", "name": "llama", "kind": "training", "pid": 4200})
        fleet.set_activity(1, "training", fleet.clock(), pid=4242)
        assert agent.tick()
        jobs = {j["id"]: j for j in agent.jobs()}
        assert set(jobs) == {"llama"}
        assert jobs["llama"]["devices"] == ["gpu1"] and jobs["llama"]["discovered_by"] == "sdk"
    finally:
        agent.stop(flush_timeout_s=0.2)


def test_a_gpu_process_the_agent_cannot_see_is_reported_once_it_persists(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = SimulatedFleet(1)
    sensor = NvmlSensor(fleet.module(), clock=fleet.clock)
    settings = Settings(home=tmp_path, collector_url="http://127.0.0.1:9", interval_s=3600, host="n")
    agent = Agent(settings, [sensor], gpu_processes=sensor, serve_socket=False, procfs=ProcFs(PROC))
    agent.start()
    try:
        fleet.set_activity(0, "training", fleet.clock(), pid=31337)  # in another PID namespace
        assert agent.tick() and agent.tick()
        assert "hostPID" not in caplog.text  # one or two ticks: maybe a process that just exited
        assert agent.tick() and agent.tick()
        assert caplog.text.count("hostPID") == 1
        assert agent.jobs() == []
    finally:
        agent.stop(flush_timeout_s=0.2)


def test_a_kubelet_ca_file_that_is_missing_or_not_pem_is_one_error_naming_its_variable(tmp_path: Path) -> None:
    not_pem = tmp_path / "ca.pem"
    not_pem.write_text("not a certificate\n")
    for path, said in ((tmp_path / "missing.pem", "does not exist"), (not_pem, "is not a PEM certificate")):
        with pytest.raises(ConfigError, match=f"{said}.*; check WATTWATCH_KUBELET_CA_FILE$"):
            KubeletPods("https://127.0.0.1:10250/pods", verify=str(path))
