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
    if obj["kind"] not in WORKLOADS:
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
    assert coordinator_env["UNICRON_COORDINATOR_REDIS_URL"].startswith("redis://redis:")
    # Planner replicas, scaled by an autoscaler.
    hpa = by_kind(objects, "HorizontalPodAutoscaler")["planner"]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "planner"}
    assert hpa["spec"]["minReplicas"] >= 2
    # Agents: one per GPU node.
    agent = by_kind(objects, "DaemonSet")["agent"]["spec"]["template"]["spec"]
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert "nvidia.com/gpu" in agent["containers"][0]["resources"]["limits"]
    redis = by_kind(objects, "StatefulSet")["redis"]["spec"]
    args = redis["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "yes"
    assert redis["volumeClaimTemplates"]
    assert "otel-collector" in deployments
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] != "Namespace"} == {"unicron"}


def _env(workload: Object) -> dict[str, str]:
    container = workload["spec"]["template"]["spec"]["containers"][0]
    return {item["name"]: item.get("value", "") for item in container.get("env", [])}


def test_every_container_is_probed_limited_and_locked_down(objects: list[Object]) -> None:
    for obj in objects:
        if obj["kind"] not in WORKLOADS:
            continue
        name = obj["metadata"]["name"]
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in pod["containers"]:
            assert "readinessProbe" in container and "livenessProbe" in container, name
            assert {"cpu", "memory"} <= set(container["resources"]["requests"]), name
            context = container["securityContext"]
            assert context["allowPrivilegeEscalation"] is False, name
            assert context["readOnlyRootFilesystem"] is True, name
            assert context["capabilities"]["drop"] == ["ALL"], name
            if container["image"].startswith("unicron:"):
                # gRPC readiness on the port the service binds.
                port = container["ports"][0]["containerPort"]
                assert container["readinessProbe"]["grpc"]["port"] == port, name
                assert _env(obj)[f"UNICRON_{container['args'][0].upper()}_BIND"].endswith(f":{port}"), name


def test_unicron_containers_set_what_the_entrypoint_requires(objects: list[Object]) -> None:
    entrypoint = (ROOT / "deploy" / "entrypoint.sh").read_text()
    for obj in objects:
        for container in _containers(obj):
            if not container["image"].startswith("unicron:"):
                continue
            service = container["args"][0]
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
