"""Which job a GPU process belongs to when nobody told the agent: its environment, Slurm, Kubernetes, or
what its command looks like; each answer says how it was reached.

Precedence, first match wins (explicit jobs, from the SDK and ``wattwatch run``, are matched before
this module is asked, by the caller):

1. ``WATTWATCH_JOB`` (and ``WATTWATCH_KIND``) in ``/proc/PID/environ``      -> ``environ:WATTWATCH_JOB``
2. Slurm: ``SLURM_JOB_ID`` in the environment, or a ``/slurm/uid_N/job_M/`` cgroup -> ``slurm:M``
3. Kubernetes: the pod UID in ``/proc/PID/cgroup``; names, labels and the ``wattwatch.io/job`` /
   ``wattwatch.io/kind`` annotations from the kubelet                         -> ``kubernetes:<pod uid>``
4. The command of the process or an ancestor (vllm, tritonserver -> inference; torchrun -> training),
   else kind ``other``                                                        -> ``heuristic:<what matched>``

Every job carries the answer in its ``wattwatch.io/discovered-by`` label (and how its kind was chosen in
``wattwatch.io/kind-by``), so a report can always say why energy went where it went.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from wattwatch.agent.jobs import DISCOVERED_BY
from wattwatch.agent.kubelet import PodInfo, PodLookup
from wattwatch.agent.procfs import ProcFs
from wattwatch.protocol.units import JOB_KINDS, JobKind

KIND_BY = "wattwatch.io/kind-by"
JOB_ANNOTATION = "wattwatch.io/job"
KIND_ANNOTATION = "wattwatch.io/kind"

_UUID = r"[0-9a-fA-F]{8}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{4}[-_][0-9a-fA-F]{12}"
# cgroupfs:  /kubepods/burstable/pod<uid>/<container>, /kubepods/pod<uid>/<container> (v1 and v2)
# systemd:   /kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice/...
_POD_UID = re.compile(rf"kubepods.*?[/-]pod({_UUID})(?:\.slice)?(?:/|:|$)")
# cgroup v1: /slurm/uid_1000/job_12345/step_0/task_0;  v2: /system.slice/slurmstepd.scope/job_12345/step_0
_SLURM_JOB = re.compile(r"(?:/slurm[^/]*/uid_\d+|slurmstepd\.scope)/job_(\d+)(?:/|$)")
_BAD_ID_CHARS = re.compile(r"[^A-Za-z0-9_.:@/-]")

# Owners whose pods together make one run (several nodes of one training job): their UID is the job id.
RUN_OWNER_KINDS = frozenset({"Job", "PyTorchJob", "TFJob", "MPIJob", "XGBoostJob", "PaddleJob", "JAXJob", "TrainJob"})

# (what matched, kind, program names, module or process-title prefixes)
_HEURISTICS: tuple[tuple[str, JobKind, tuple[str, ...], tuple[str, ...]], ...] = (
    ("vllm", "inference", ("vllm",), ("vllm.", "vllm::")),
    ("tgi", "inference", ("text-generation-launcher", "text-generation-server", "text-generation-router"), ()),
    ("triton", "inference", ("tritonserver",), ()),
    ("sglang", "inference", ("sglang",), ("sglang.", "sglang::")),
    ("trtllm-serve", "inference", ("trtllm-serve",), ()),
    ("torchrun", "training", ("torchrun",), ("torch.distributed.run", "torch.distributed.launch")),
    ("deepspeed", "training", ("deepspeed",), ("deepspeed.launcher",)),
    ("accelerate", "training", ("accelerate",), ("accelerate.commands.launch",)),
)


@dataclass(frozen=True)
class Discovered:
    """The job a process belongs to and why. ``root_pid`` is the process whose tree is the job here (the
    matched launcher for a heuristic, else the GPU process itself)."""

    job_id: str
    name: str
    kind: JobKind
    reason: str
    root_pid: int
    labels: Mapping[str, str] = field(default_factory=dict)


class ProcessClassifier:
    """Answers "which job is this GPU process?" from ``/proc`` (and the kubelet, when given)."""

    def __init__(self, procfs: ProcFs, host: str, pods: PodLookup | None = None) -> None:
        self.procfs = procfs
        self.host = host
        self.pods = pods

    def classify(self, pid: int, lineage: Sequence[int]) -> Discovered | None:
        """The job of process ``pid`` (``lineage``: pid and its ancestors, nearest first); None when the
        process is gone."""
        st = self.procfs.stat(pid)
        if st is None:
            return None
        env = self.procfs.environ(pid) or {}
        guess = self._heuristic(lineage)
        kind, kind_by = _kind(env, None, guess)

        job = env.get("WATTWATCH_JOB", "").strip()
        if job:
            job_id = _as_id(job)
            name = env.get("WATTWATCH_NAME") or job_id
            return self._make(job_id, name, kind, kind_by, "environ:WATTWATCH_JOB", pid, {})

        slurm = env.get("SLURM_JOB_ID", "").strip() or _slurm_from_cgroups(self.procfs.cgroups(pid))
        if slurm:
            labels = {"slurm.job_id": slurm}
            for var, label in (("SLURM_JOB_USER", "slurm.user"), ("SLURM_JOB_PARTITION", "slurm.partition")):
                if env.get(var):
                    labels[label] = env[var]
            name = env.get("SLURM_JOB_NAME") or f"slurm-{slurm}"
            return self._make(_as_id(f"slurm-{slurm}"), name, kind, kind_by, f"slurm:{slurm}", pid, labels)

        uid = pod_uid_from_cgroups(self.procfs.cgroups(pid))
        if uid:
            pod = self.pods.pod(uid) if self.pods is not None else None
            job_id, name, labels = _pod_job(uid, pod)
            kind, kind_by = _kind(env, pod, guess)
            return self._make(job_id, name, kind, kind_by, f"kubernetes:{uid}", pid, labels)

        if guess is not None:
            what, _, root = guess
            root_st = self.procfs.stat(root)
            start = root_st.start_ticks if root_st is not None else st.start_ticks
            job_id = _as_id(f"proc-{self.host}-{root}-{start}")
            return self._make(job_id, self._command(root), kind, kind_by, f"heuristic:{what}", root, {})
        job_id = _as_id(f"proc-{self.host}-{pid}-{st.start_ticks}")
        return self._make(job_id, self._command(pid), kind, kind_by, "heuristic:none", pid, {})

    def _make(
        self,
        job_id: str,
        name: str,
        kind: JobKind,
        kind_by: str,
        reason: str,
        root_pid: int,
        labels: Mapping[str, str],
    ) -> Discovered:
        all_labels = {**labels, DISCOVERED_BY: reason, KIND_BY: kind_by}
        return Discovered(job_id, name[:200] or job_id, kind, reason, root_pid, all_labels)

    def _heuristic(self, lineage: Sequence[int]) -> tuple[str, JobKind, int] | None:
        """The farthest ancestor whose command is a known launcher or server: workers of one launcher
        (torchrun's ranks, vLLM's engine processes) become one job rooted at it."""
        found: tuple[str, JobKind, int] | None = None
        for pid in lineage:
            match = match_command(self.procfs.cmdline(pid))
            if match is not None:
                found = (match[0], match[1], pid)
        return found

    def _command(self, pid: int) -> str:
        """A short name from the command line: ``vllm serve Qwen/Qwen2.5-7B``, ``train.py --config x``."""
        argv = self.procfs.cmdline(pid)
        if not argv:
            return f"pid {pid}"
        words = list(argv)
        if PurePosixPath(words[0]).name.startswith("python") and len(words) > 1:
            words = words[1:]  # the interpreter says nothing; its script or module does
            while words and words[0].startswith("-") and words[0] != "-m":
                words = words[1:]
            if words[:1] == ["-m"]:
                words = words[1:]
        if not words:
            return PurePosixPath(argv[0]).name
        return " ".join([PurePosixPath(words[0]).name, *words[1:3]])


def match_command(argv: Sequence[str]) -> tuple[str, JobKind] | None:
    """``("vllm", "inference")`` when ``argv`` runs a known server or launcher, else None.

    Looks at the program, the script or ``-m`` module a Python interpreter runs, and process titles
    such as vLLM's ``VLLM::EngineCore``.
    """
    if not argv:
        return None
    names = [PurePosixPath(argv[0]).name.lower()]
    if names[0].startswith("python") and len(argv) > 1:
        rest = list(argv[1:])
        if "-m" in rest and rest.index("-m") + 1 < len(rest):
            names.append(rest[rest.index("-m") + 1].lower())
        else:
            script = next((a for a in rest if not a.startswith("-")), "")
            names.append(PurePosixPath(script).name.lower())
    for what, kind, programs, prefixes in _HEURISTICS:
        for name in names:
            if name in programs or name.removesuffix(".py") in programs or name.startswith(prefixes):
                return what, kind
    return None


def pod_uid_from_cgroups(paths: Sequence[str]) -> str | None:
    """The pod UID in any of the cgroup paths (cgroup v1/v2, cgroupfs or systemd driver), dashed."""
    for path in paths:
        m = _POD_UID.search(path)
        if m:
            return m.group(1).replace("_", "-").lower()
    return None


def _slurm_from_cgroups(paths: Sequence[str]) -> str:
    for path in paths:
        m = _SLURM_JOB.search(path)
        if m:
            return m.group(1)
    return ""


def _pod_job(uid: str, pod: PodInfo | None) -> tuple[str, str, dict[str, str]]:
    """(job id, name, labels) of a pod's process."""
    if pod is None:
        return _as_id(f"k8s-{uid}"), f"k8s-{uid}", {"k8s.pod_uid": uid}
    labels = {"k8s.namespace": pod.namespace, "k8s.pod": pod.name, "k8s.pod_uid": uid}
    labels.update({f"k8s.label.{k}": v for k, v in pod.labels.items()})
    if pod.owner_kind:
        labels["k8s.owner"] = f"{pod.owner_kind}/{pod.owner_name}"
    annotated = pod.annotations.get(JOB_ANNOTATION, "").strip()
    if annotated:
        return _as_id(annotated), annotated, labels
    if pod.owner_kind in RUN_OWNER_KINDS and pod.owner_uid:
        # One run, many nodes: every pod of a training Job reports under its owner.
        return _as_id(f"k8s-{pod.owner_uid}"), f"{pod.namespace}/{pod.owner_name}", labels
    return _as_id(f"k8s-{uid}"), f"{pod.namespace}/{pod.name}", labels


def _kind(env: Mapping[str, str], pod: PodInfo | None, guess: tuple[str, JobKind, int] | None) -> tuple[JobKind, str]:
    """The job kind and how it was chosen: environment, then annotation, then the command heuristic."""
    for value, by in (
        (env.get("WATTWATCH_KIND", ""), "environ:WATTWATCH_KIND"),
        (pod.annotations.get(KIND_ANNOTATION, "") if pod is not None else "", f"annotation:{KIND_ANNOTATION}"),
    ):
        kind = _as_kind(value.strip().lower())
        if kind is not None:
            return kind, by
    if guess is not None:
        return guess[1], f"heuristic:{guess[0]}"
    return "other", "default"


def _as_kind(text: str) -> JobKind | None:
    for kind in JOB_KINDS:
        if kind == text:
            return kind
    return None


def _as_id(text: str) -> str:
    """A valid wire job id: characters outside ``[A-Za-z0-9_.:@/-]`` become ``-``, at most 200."""
    return _BAD_ID_CHARS.sub("-", text)[:200] or "unnamed"
