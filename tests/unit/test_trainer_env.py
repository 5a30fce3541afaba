"""A trainer never gets its node's credentials: the environment the agent starts it in (and
its warm spares in) carries the CA to check the agent by, its worker token, and no path to
the agent's key or certificate, nor any key material."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from services.agent.__main__ import AgentConfig, trainer_env
from services.agent.agent import Agent, AgentSettings, trainer_base_env
from services.agent.supervisor import without_node_secrets
from unicron import certs
from unicron.v1 import common_pb2
from unicron.v1 import node_service_pb2 as pb

# Writes its environment as JSON to the file named by its argument, then waits.
DUMP_ENV = "import json, os, sys, time; json.dump(dict(os.environ), open(sys.argv[1], 'w')); time.sleep(60)"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(tmp_path_factory.mktemp("pki"), nodes=["n1"], users=certs.parse_users("alice"))


@pytest.fixture
def tls_config(pki: certs.DevPKI, tmp_path: Path) -> AgentConfig:
    token_file = tmp_path / "join-token"
    token_file.write_text(pki.join_token)
    leaf = pki.nodes["n1"]
    return AgentConfig(
        node_id="n1",
        tls_ca=str(pki.ca),
        tls_cert=str(leaf.cert),
        tls_key=str(leaf.key),
        join_token_file=str(token_file),
    )


def secrets_of(pki: certs.DevPKI, config: AgentConfig) -> list[str]:
    """What must appear in no trainer's environment: the paths of the node's key, certificate
    and join token file (as given and resolved), and the key's own bytes."""
    paths = [config.tls_key, config.tls_cert, config.join_token_file]
    found = [*paths, *(str(Path(p).resolve()) for p in paths)]
    return [*found, pki.nodes["n1"].key.read_text().strip().splitlines()[1], pki.join_token]


def leaks(env: dict[str, str], secrets: list[str]) -> list[str]:
    return [f"{name}={value[:60]}" for name, value in env.items() for s in secrets if s in value] + [
        name for name in env if name.startswith("UNICRON_AGENT_") or "PRIVATE KEY" in env[name]
    ]


def test_the_trainer_settings_name_the_ca_alone(pki: certs.DevPKI, tls_config: AgentConfig, tmp_path: Path) -> None:
    env = trainer_env(tls_config, tmp_path)
    assert env["UNICRON_TRAINER_TLS_CA"] == str(pki.ca.resolve())
    assert env["UNICRON_TRAINER_PLAINTEXT"] in ("0", "false")
    assert not [name for name in env if name.endswith(("_TLS_CERT", "_TLS_KEY"))], env
    assert leaks(env, secrets_of(pki, tls_config)) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="an agent with a trainer user runs as root")
def test_a_trainer_user_is_named_a_copy_of_the_ca_it_can_read(
    pki: certs.DevPKI, tls_config: AgentConfig, tmp_path: Path
) -> None:
    Path(tls_config.join_token_file).chmod(0o600)  # as `unicron certs` writes it
    config = dataclasses.replace(tls_config, trainer_user="nobody")
    env = trainer_env(config, tmp_path)
    copy = Path(env["UNICRON_TRAINER_TLS_CA"])
    assert copy.parent == tmp_path and copy.read_bytes() == pki.ca.read_bytes()
    assert copy.stat().st_mode & 0o777 == 0o644
    assert leaks(env, secrets_of(pki, tls_config)) == []


@pytest.mark.parametrize(
    ("env", "kept"),
    [
        ({"PATH": "/bin", "UNICRON_TRAINER_TOKEN": "w1.x"}, {"PATH", "UNICRON_TRAINER_TOKEN"}),
        ({"UNICRON_AGENT_TLS_KEY": "/certs/node.key", "UNICRON_AGENT_NODE_ID": "n1"}, set()),
        (
            {"UNICRON_TRAINER_TLS_KEY": "/k", "UNICRON_TRAINER_TLS_CERT": "/c", "UNICRON_TRAINER_TLS_CA": "/ca"},
            {"UNICRON_TRAINER_TLS_CA"},
        ),
        ({"MY_KEY": "-----BEGIN PRIVATE KEY-----\nMIIE...\n-----END PRIVATE KEY-----\n"}, set()),
        ({"MY_EC_KEY": "-----BEGIN EC PRIVATE KEY-----\n..."}, set()),
        (  # the agent's OTLP exporter shows the node's certificate; its trainers export nothing
            {
                "OTEL_EXPORTER_OTLP_ENDPOINT": "https://otel-collector:4317",
                "OTEL_EXPORTER_OTLP_CERTIFICATE": "/certs/ca.pem",
                "OTEL_EXPORTER_OTLP_CLIENT_KEY": "/certs/node-key.pem",
                "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE": "/certs/node.pem",
            },
            {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_CERTIFICATE"},
        ),
    ],
)
def test_what_a_trainer_never_inherits(env: dict[str, str], kept: set[str]) -> None:
    assert set(without_node_secrets(env)) == kept


def test_a_started_trainer_and_the_spares_get_no_node_secret(
    pki: certs.DevPKI, tls_config: AgentConfig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The agent configured by its environment, as in the containers (deploy/), with its key
    # inline in a variable besides.
    for name, value in {
        "UNICRON_AGENT_TLS_CA": tls_config.tls_ca,
        "UNICRON_AGENT_TLS_CERT": tls_config.tls_cert,
        "UNICRON_AGENT_TLS_KEY": tls_config.tls_key,
        "UNICRON_AGENT_JOIN_TOKEN_FILE": tls_config.join_token_file,
        "NODE_KEY_PEM": pki.nodes["n1"].key.read_text(),
    }.items():
        monkeypatch.setenv(name, value)
    dumped = tmp_path / "env.json"
    settings = AgentSettings(
        node_id="n1",
        slots=1,
        failure_domain="",
        work_dir=tmp_path / "work",
        stop_grace_s=1.0,
        trainer_command=(sys.executable, "-c", DUMP_ENV, str(dumped)),
        trainer_env=trainer_env(tls_config, tmp_path),
        trainer_address="127.0.0.1:50999",
    )
    agent = Agent(settings, "127.0.0.1:1")
    try:
        start = pb.StartWorkers(job_id="job-1", spec=common_pb2.JobSpec(name="tiny"))
        start.assignment.generation, start.assignment.world_size = 1, 1
        start.assignment.master_addr, start.assignment.master_port = "127.0.0.1", 29500
        start.assignment.workers.add(node_id="n1", ranks=[0])
        agent.executor.start_workers(start)
        env = _read_when_written(dumped)
    finally:
        agent.stop()
    secrets = secrets_of(pki, tls_config)
    assert leaks(env, secrets) == []
    assert leaks(trainer_base_env(), secrets) == []  # what the warm spares start in
    # What it does get: the CA, its own token, and the trainer port of its agent.
    assert env["UNICRON_TRAINER_TLS_CA"] == str(pki.ca.resolve())
    assert env["UNICRON_TRAINER_TOKEN"].startswith("w1.")
    assert env["UNICRON_TRAINER_AGENT"] == "127.0.0.1:50999"


def _read_when_written(path: Path) -> dict[str, str]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            loaded: dict[str, str] = json.loads(path.read_text())
            return loaded
        except (OSError, ValueError):
            time.sleep(0.05)
    raise AssertionError(f"the trainer never wrote {path}")
