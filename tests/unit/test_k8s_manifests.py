"""deploy/k8s, offline: the kustomization rendered here (namespace, labels, images: all it
uses), every object validated against the Kubernetes JSON schemas bundled with
kubernetes-validate (strict: an unknown field fails), and what the issue asks of each
workload checked. Where kubectl is installed, its own rendering must match ours."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
# The oldest Kubernetes these manifests are meant for (gRPC probes are GA from 1.27) and
# the newest whose schemas the package bundles.
VERSIONS = ("1.30.0", "1.37.0")
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "ClusterRole", "ClusterRoleBinding", "StorageClass"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}
# What holds a pod template: the workloads, and the Job that makes the certificates.
POD_HOLDERS = WORKLOADS | {"Job"}
SERVICES = ("coordinator", "planner", "agent")
HEALTH = ["python", "/usr/local/lib/unicron/health.py"]
SUPPORTED = {"apiVersion", "kind", "namespace", "labels", "images", "resources"}

Object = dict[str, Any]


def render() -> list[Object]:
    """The kustomization's output, for the features it uses (anything else fails here)."""
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    unsupported = set(kustomization) - SUPPORTED
    assert not unsupported, f"this renderer does not know {unsupported}: teach it, or kubectl will differ"
    objects: list[Object] = []
    for resource in kustomization["resources"]:
        objects += [doc for doc in yaml.safe_load_all((K8S / resource).read_text()) if doc]
    for obj in objects:
        if kustomization.get("namespace") and obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kustomization["namespace"]
        for entry in kustomization.get("labels", []):
            _label(obj, entry["pairs"], entry.get("includeSelectors", False))
        for image in kustomization.get("images", []):
            for container in _containers(obj):
                name, _, _ = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image['newTag']}"
    return objects


def _label(obj: Object, pairs: dict[str, str], selectors: bool) -> None:
    obj["metadata"].setdefault("labels", {}).update(pairs)
    if not selectors:
        return
    spec = obj.get("spec", {})
    if obj["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)
    if obj["kind"] == "Job":
        # A Job's selector is made by the API server; kustomize labels its pods only.
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)
    if obj["kind"] in WORKLOADS:
        spec["selector"].setdefault("matchLabels", {}).update(pairs)
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)
        for claim in spec.get("volumeClaimTemplates", []):
            claim["metadata"].setdefault("labels", {}).update(pairs)
        # Selectors of (anti-)affinity terms too, so that they still match the pods.
        for kind in ("podAffinity", "podAntiAffinity"):
            rules = spec["template"]["spec"].get("affinity", {}).get(kind, {})
            terms = list(rules.get("requiredDuringSchedulingIgnoredDuringExecution", []))
            terms += [t["podAffinityTerm"] for t in rules.get("preferredDuringSchedulingIgnoredDuringExecution", [])]
            for term in terms:
                term["labelSelector"].setdefault("matchLabels", {}).update(pairs)


def _containers(obj: Object) -> list[Object]:
    if obj["kind"] not in POD_HOLDERS:
        return []
    pod = obj["spec"]["template"]["spec"]
    return list(pod.get("initContainers", [])) + list(pod["containers"])


def by_kind(objects: list[Object], kind: str) -> dict[str, Object]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


@pytest.fixture(scope="module")
def objects() -> list[Object]:
    return render()


@pytest.mark.parametrize("version", VERSIONS)
def test_every_manifest_is_valid_kubernetes(objects: list[Object], version: str) -> None:
    assert len(objects) >= 12
    for obj in objects:
        kubernetes_validate.validate(copy.deepcopy(obj), version, strict=True)


def test_the_schema_check_catches_a_wrong_field(objects: list[Object]) -> None:
    agent = copy.deepcopy(by_kind(objects, "DaemonSet")["agent"])
    agent["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpcc"] = {"port": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(agent, VERSIONS[0], strict=True)


def test_the_workloads_the_issue_asks_for(objects: list[Object]) -> None:
    deployments = by_kind(objects, "Deployment")
    # Coordinators: more than one, on the Redis lease; only the active one is Ready.
    assert deployments["coordinator"]["spec"]["replicas"] >= 2
    coordinator_env = _env(deployments["coordinator"])
    sentinels = ",".join(f"redis-{i}.redis:26379" for i in range(3))
    assert coordinator_env["UNICRON_COORDINATOR_REDIS_URL"] == f"rediss+sentinel://{sentinels}/unicron"
    # Planner replicas, scaled by an autoscaler.
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["planner"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "planner"}
    assert hpa["spec"]["minReplicas"] >= 2
    # Agents: one per GPU node.
    agent = by_kind(objects, "DaemonSet")["agent"]["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nvidia.com/gpu" in agent["containers"][0]["resources"]["limits"]
    # Redis under Sentinel: three pods, each a server and a sentinel on a node of its own.
    redis = by_kind(objects, "StatefulSet")["redis"]["spec"]
    assert redis["replicas"] == 3 and redis["volumeClaimTemplates"]
    assert [c["name"] for c in redis["template"]["spec"]["containers"]] == ["redis", "sentinel"]
    (spread,) = redis["template"]["spec"]["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert spread["topologyKey"] == "kubernetes.io/hostname"
    scripts = by_kind(objects, "ConfigMap")["redis"]["data"]
    for flag in ("--appendonly yes", "--min-replicas-to-write 1", "--tls-replication yes", "--tls-auth-clients yes"):
        assert flag in scripts["redis.sh"], flag
    assert "sentinel monitor unicron redis-0.redis 6379 2" in scripts["sentinel.sh"]
    assert "otel-collector" in deployments
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] != "Namespace"} == {"unicron"}


def _env(workload: Object) -> dict[str, str]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def test_every_container_is_probed_limited_and_locked_down(objects: list[Object]) -> None:
    for obj in objects:
        if obj["kind"] not in POD_HOLDERS:
            continue
        name = obj["metadata"]["name"]
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in _containers(obj):
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
        for container in pod["containers"] if obj["kind"] != "Job" else []:
            assert "readinessProbe" in container and "livenessProbe" in container, name
            if _service(container):
                # Readiness by health.py, over the service's own TLS (Kubernetes' gRPC probe
                # speaks plaintext only), on the port the service binds.
                assert container["readinessProbe"]["exec"]["command"] == HEALTH, name
                port = container["ports"][0]["containerPort"]
                assert _env(obj)[f"UNICRON_{container['args'][0].upper()}_BIND"].endswith(f":{port}"), name


def _service(container: Object) -> str:
    """The Unicron service a container runs ("" for anything else: init steps, others' images)."""
    args = container.get("args") or [""]
    unicron = container["image"].startswith("unicron:") and "command" not in container
    return str(args[0]) if unicron and args[0] in SERVICES else ""


def test_every_service_runs_mutual_tls_by_default(objects: list[Object]) -> None:
    """No plaintext unless asked for: every Unicron service has a CA, a certificate and a key,
    each a file some volume of its pod provides; the coordinator checks tokens."""
    seen = set()
    for obj in objects:
        for container in _containers(obj):
            service = _service(container)
            if not service:
                continue
            seen.add(service)
            env = {item["name"]: item.get("value", "") for item in container.get("env", [])}
            prefix = f"UNICRON_{service.upper()}_"
            assert env.get(f"{prefix}PLAINTEXT", "false").lower() in ("", "0", "false"), service
            mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
            for setting in ("TLS_CA", "TLS_CERT", "TLS_KEY"):
                path = env[f"{prefix}{setting}"]
                assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in mounts), (service, path)
            assert "--plaintext" not in container["args"], service
    assert seen == set(SERVICES)
    coordinator = by_kind(objects, "Deployment")["coordinator"]
    assert _env(coordinator)["UNICRON_COORDINATOR_TOKENS_FILE"].endswith("tokens.yaml")


def _mounted(container: Object, path: str) -> bool:
    return any(
        path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/")
        for m in container.get("volumeMounts", [])
    )


def test_redis_and_the_collector_take_mutual_tls_alone(objects: list[Object]) -> None:
    redis_pod = by_kind(objects, "StatefulSet")["redis"]["spec"]["template"]["spec"]
    scripts = by_kind(objects, "ConfigMap")["redis"]["data"]
    args = scripts["redis.sh"].split()
    assert args[args.index("--port") + 1] == "0" and args[args.index("--tls-auth-clients") + 1] == "yes"
    sentinel = dict(line.split(" ", 1) for line in scripts["sentinel.sh"].splitlines() if line.startswith("tls-"))
    assert sentinel["tls-auth-clients"] == "yes" and sentinel["tls-replication"] == "yes"
    for container in redis_pod["containers"]:
        for option in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
            assert _mounted(container, args[args.index(option) + 1]), option
        for option in ("tls-cert-file", "tls-key-file", "tls-ca-cert-file"):
            assert _mounted(container, sentinel[option]), option
        assert "--tls" in container["readinessProbe"]["exec"]["command"]
    # The Job writes the keys 0600 as uid 10001: Redis must run as that user to read its own.
    assert redis_pod["securityContext"]["runAsUser"] == 10001

    collector_pod = by_kind(objects, "Deployment")["otel-collector"]["spec"]["template"]["spec"]
    (collector,) = collector_pod["containers"]
    config = yaml.safe_load(by_kind(objects, "ConfigMap")["otel-collector"]["data"]["config.yaml"])
    tls = config["receivers"]["otlp"]["protocols"]["grpc"]["tls"]
    assert set(tls) == {"cert_file", "key_file", "client_ca_file"}
    assert all(_mounted(collector, path) for path in tls.values()), tls
    assert collector_pod["securityContext"]["runAsUser"] == 10001

    for obj in objects:
        for container in _containers(obj):
            if not _service(container):
                continue
            env = {item["name"]: item.get("value", "") for item in container.get("env", [])}
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "https://otel-collector:4317", obj["metadata"]["name"]
            prefix = f"UNICRON_{_service(container).upper()}_"
            assert env["OTEL_EXPORTER_OTLP_CLIENT_KEY"] == env[f"{prefix}TLS_KEY"], obj["metadata"]["name"]
            assert env["OTEL_EXPORTER_OTLP_CERTIFICATE"] == env[f"{prefix}TLS_CA"], obj["metadata"]["name"]


def test_the_certificates_are_made_by_an_init_step(objects: list[Object]) -> None:
    job = by_kind(objects, "Job")["certs"]["spec"]["template"]["spec"]
    (maker,) = job["containers"]
    assert maker["args"][:2] == ["certs", "/var/lib/unicron/pki/unicron"]
    hosts = maker["args"][maker["args"].index("--hosts") + 1].split(",")
    # The names the agents and the coordinator dial, Redis's and the collector's too.
    assert {"coordinator", "planner", "redis", "otel-collector"} <= set(hosts)
    assert {f"redis-{i}.redis" for i in range(3)} <= set(hosts)  # the names the servers announce
    assert by_kind(objects, "PersistentVolumeClaim")["pki"]["spec"]["accessModes"] == ["ReadWriteMany"]
    # Each agent issues its own node certificate from the CA; its agent sees no CA key.
    agent = by_kind(objects, "DaemonSet")["agent"]["spec"]["template"]["spec"]
    (issuer,) = agent["initContainers"]
    assert issuer["args"][0] == "certs" and "$(NODE_NAME)" in issuer["args"]
    assert {e["name"]: e.get("value") for e in issuer["env"]}["UNICRON_CA_FROM"].startswith("/var/lib/unicron/pki")
    (main,) = agent["containers"]
    assert "pki" not in {m["name"] for m in main["volumeMounts"]}
    # The services wait for theirs, and so do Redis and the collector.
    pods = {**by_kind(objects, "Deployment"), **by_kind(objects, "StatefulSet")}
    for name in ("coordinator", "planner", "redis", "otel-collector"):
        pod = pods[name]["spec"]["template"]["spec"]
        assert [c["name"] for c in pod["initContainers"]] == ["wait-for-certs"], name


def test_the_agent_runs_the_gpu_image_and_holds_the_gpus(objects: list[Object]) -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    gpu = next(i for i in kustomization["images"] if i["name"] == "unicron-gpu")
    assert re.fullmatch(r"\d+\.\d+\.\d+-(cuda|cu\d+)", gpu["newTag"]), gpu
    pod = by_kind(objects, "DaemonSet")["agent"]["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    assert agent["image"] == f"{gpu.get('newName', 'unicron')}:{gpu['newTag']}"
    resources = agent["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] > 0
    assert (
        str(resources["limits"]["nvidia.com/gpu"])
        == _env(by_kind(objects, "DaemonSet")["agent"])["UNICRON_AGENT_SLOTS"]
    )


def test_unicron_containers_set_what_the_entrypoint_requires(objects: list[Object]) -> None:
    entrypoint = (ROOT / "deploy" / "entrypoint.sh").read_text()
    for obj in objects:
        for container in _containers(obj):
            service = _service(container)
            if not service:
                continue
            block = entrypoint.split(f"\n{service})\n", 1)[1].split(";;", 1)[0]
            required = re.findall(r"need (\w+) ", block)
            assert required, service
            missing = set(required) - set(_env(obj))
            assert not missing, f"{obj['metadata']['name']} lacks {missing}"


def test_services_select_their_pods(objects: list[Object]) -> None:
    pods = [o["spec"]["template"]["metadata"]["labels"] for o in objects if o["kind"] in WORKLOADS]
    for name, service in by_kind(objects, "Service").items():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= labels.items() for labels in pods), name


def test_kubectl_renders_the_same(objects: list[Object]) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the renderer above stands alone")
    done = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.skip(f"kubectl kustomize failed: {done.stderr.strip()[:200]}")
    theirs = [doc for doc in yaml.safe_load_all(done.stdout) if doc]

    def key(obj: Object) -> tuple[str, str]:
        return obj["kind"], obj["metadata"]["name"]

    assert sorted(theirs, key=key) == sorted(objects, key=key)
