"""The pure parts of unicron.security and unicron.certs: who a caller is, what it may call,
tokens, limits, configuration; tables of cases."""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.coordinator.coordinator import visible
from unicron import certs
from unicron.errors import InvalidArgument, PermissionDenied, Unauthenticated
from unicron.security import (
    POLICY,
    TRUSTED,
    ClientSecurity,
    Kind,
    Principal,
    StreamGate,
    TLSConfig,
    TokenBook,
    WorkerTokens,
    acting_as,
    authenticate,
    authorize,
    bearer_token,
    caller,
    caller_key,
    certificate_principal,
    default_budget,
    owner_scope,
    rule_for,
    worker_name,
)
from unicron.v1 import common_pb2, node_service_pb2

ALICE_TOKEN = "alice-token-0123456789"
ADMIN_TOKEN = "admin-token-0123456789"
JOIN_TOKEN = "join-token-0123456789ab"
BOOK = TokenBook.parse(
    {
        "join_token": JOIN_TOKEN,
        "users": [{"name": "alice", "token": ALICE_TOKEN}, {"name": "root", "token": ADMIN_TOKEN, "admin": True}],
    }
)
ALICE = Principal(Kind.USER, "alice")
ROOT = Principal(Kind.USER, "root", admin=True)
AGENT = Principal(Kind.AGENT)
N1 = Principal(Kind.NODE, "n1")
COORDINATOR = Principal(Kind.SERVICE, "coordinator")


@pytest.mark.parametrize(
    ("token", "common_name", "expected"),
    [
        (ALICE_TOKEN, None, ALICE),
        (ADMIN_TOKEN, "client:root", ROOT),
        (JOIN_TOKEN, None, AGENT),
        (None, "node:n1", N1),
        (None, "service:coordinator", COORDINATOR),
        # A token, when sent, decides: a good certificate does not excuse a bad token.
        ("wrong-token-0123456789", "node:n1", Unauthenticated),
        ("", "node:n1", Unauthenticated),
        (None, "client:alice", Unauthenticated),  # a user's certificate only encrypts
        (None, "node:", Unauthenticated),
        (None, "nodes", Unauthenticated),
        (None, None, Unauthenticated),
    ],
)
def test_authenticate(token: str | None, common_name: str | None, expected: Any) -> None:
    if isinstance(expected, Principal):
        assert authenticate(token, common_name, BOOK.lookup) == expected
    else:
        with pytest.raises(expected):
            authenticate(token, common_name, BOOK.lookup)


HEARTBEAT = "/unicron.v1.NodeService/Heartbeat"
SUBMIT = "/unicron.v1.JobService/SubmitJob"
PLAN = "/unicron.v1.PlannerService/Plan"
CONNECT = "/unicron.v1.TrainerAgentService/Connect"
READ_LOGS = "/unicron.v1.AgentLogService/ReadLogs"
STREAM_LOGS = "/unicron.v1.JobService/StreamLogs"
WORKER = Principal(Kind.WORKER, worker_name("job-1", 1, 0))


@pytest.mark.parametrize(
    ("principal", "method", "request_", "allowed"),
    [
        (ALICE, SUBMIT, None, True),
        (ROOT, SUBMIT, None, True),
        (N1, SUBMIT, None, False),
        (AGENT, SUBMIT, None, False),
        (COORDINATOR, SUBMIT, None, False),
        (WORKER, SUBMIT, None, False),
        (N1, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n1"), True),
        (N1, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n2"), False),  # bound to its node
        (AGENT, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n2"), True),  # the join token: any node
        (ALICE, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n1"), False),
        (ROOT, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n1"), False),  # admins run jobs, not nodes
        (COORDINATOR, PLAN, None, True),
        (N1, PLAN, None, False),
        (ALICE, PLAN, None, False),
        (WORKER, CONNECT, None, True),
        (N1, CONNECT, None, False),
        (COORDINATOR, READ_LOGS, None, True),  # an agent's trainers' output: the coordinator's alone
        (ROOT, READ_LOGS, None, False),
        (N1, READ_LOGS, None, False),
        (WORKER, READ_LOGS, None, False),
        (ALICE, STREAM_LOGS, None, True),  # users read it through the coordinator
        (COORDINATOR, STREAM_LOGS, None, False),
        (ALICE, "/grpc.health.v1.Health/Check", None, True),
        (ROOT, "/unicron.v1.Unknown/Method", None, False),  # not in the policy: nobody
        (TRUSTED, "/unicron.v1.Unknown/Method", None, True),  # authentication off
        (TRUSTED, PLAN, None, True),
    ],
)
def test_authorize(principal: Principal, method: str, request_: Any, allowed: bool) -> None:
    rule = rule_for(POLICY, method)
    if allowed:
        authorize(principal, rule, method, request_)
    else:
        with pytest.raises(PermissionDenied):
            authorize(principal, rule, method, request_)


def test_every_rpc_of_every_service_has_a_rule() -> None:
    from unicron.v1 import agent_service_pb2, job_service_pb2, planner_service_pb2, trainer_service_pb2

    for module in (agent_service_pb2, job_service_pb2, node_service_pb2, planner_service_pb2, trainer_service_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                assert rule_for(POLICY, f"/{service.full_name}/{method.name}") is not None, method.full_name


@pytest.mark.parametrize(
    ("metadata", "expected"),
    [
        ((), None),
        ((("x-other", "1"),), None),
        ((("authorization", "Bearer abc"),), "abc"),
        ((("authorization", b"Bearer  abc "),), "abc"),
        ((("authorization", "Basic abc"),), ""),
    ],
)
def test_bearer_token(metadata: tuple[tuple[str, str | bytes], ...], expected: str | None) -> None:
    assert bearer_token(metadata) == expected


@pytest.mark.parametrize(
    ("common_name", "expected"),
    [
        ("node:n1", N1),
        ("service:planner", Principal(Kind.SERVICE, "planner")),
        ("user:alice", None),  # users authenticate with tokens only
        ("client:alice", None),
        ("backend:redis", None),  # Redis's key, in Redis's image, opens nothing here
        ("node", None),
        ("", None),
    ],
)
def test_certificate_principal(common_name: str, expected: Principal | None) -> None:
    assert certificate_principal(common_name) == expected


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ([], "tokens_file"),
        ({"users": [{"name": "a", "token": "short"}]}, "tokens_file.users[0].token"),
        ({"users": [{"token": ALICE_TOKEN}]}, "tokens_file.users[0].name"),
        ({"users": "alice"}, "tokens_file.users"),
        ({"join_token": ALICE_TOKEN, "users": [{"name": "a", "token": ALICE_TOKEN}]}, "tokens_file.users[0].token"),
        ({"admins": []}, "tokens_file.admins"),
    ],
)
def test_a_bad_tokens_file_names_the_setting(data: Any, field: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        TokenBook.parse(data)
    assert raised.value.field == field


def test_the_token_book_keeps_digests_not_tokens() -> None:
    assert ALICE_TOKEN not in repr(BOOK)
    assert BOOK.lookup(ALICE_TOKEN) == ALICE
    assert BOOK.lookup(ALICE_TOKEN + "x") is None


def test_worker_tokens_prove_one_job_generation_and_rank() -> None:
    tokens = WorkerTokens(b"k" * 32)
    token = tokens.issue("job-2026.x/y", 3, 1)
    assert tokens.lookup(token) == Principal(Kind.WORKER, worker_name("job-2026.x/y", 3, 1))
    # Another agent's secret, a changed rank, a changed MAC, garbage: none of them.
    assert WorkerTokens(b"j" * 32).lookup(token) is None
    prefix, job, generation, _rank, mac = token.split(".")
    assert tokens.lookup(".".join([prefix, job, generation, "0", mac])) is None
    assert tokens.lookup(token[:-1] + ("0" if token[-1] != "0" else "1")) is None
    assert tokens.lookup("w1.a.b.c.d") is None
    assert tokens.lookup("") is None


@pytest.mark.parametrize(
    ("remaining", "default", "budget"),
    [
        (None, 60.0, 60.0),  # no deadline: the server's default
        (1e9, 60.0, 60.0),  # gRPC's "none" is a deadline decades away
        (3601, 60.0, 60.0),
        (3600, 60.0, None),  # the call's own deadline governs, even a long one
        (30, 60.0, None),
        (0.001, 60.0, None),
        (None, None, None),  # no default: as long as it takes
    ],
)
def test_default_budget(remaining: float | None, default: float | None, budget: float | None) -> None:
    assert default_budget(remaining, default) == budget


def test_stream_gate_caps_per_caller_and_in_all() -> None:
    gate = StreamGate(per_key=2, total=3)
    assert gate.acquire("a") and gate.acquire("a")
    assert not gate.acquire("a")  # its own cap
    assert gate.acquire("b")
    assert not gate.acquire("c")  # the total
    gate.release("a")
    assert gate.acquire("c")
    gate.release("b")
    assert gate.acquire("a")


@pytest.mark.parametrize(
    ("principal", "owner", "seen"),
    [(ALICE, "alice", True), (ALICE, "bob", False), (ROOT, "bob", True), (TRUSTED, "", True), (TRUSTED, "bob", True)],
)
def test_who_sees_a_job(principal: Principal, owner: str, seen: bool) -> None:
    assert visible(common_pb2.Job(owner=owner), owner_scope(principal)) is seen


def test_caller_is_none_outside_a_guarded_call() -> None:
    with pytest.raises(Unauthenticated):
        caller()
    with acting_as(ALICE):
        assert caller() == ALICE
    with pytest.raises(Unauthenticated):
        caller()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(
        tmp_path_factory.mktemp("pki"), nodes=["n1"], users=certs.parse_users("root:admin,alice"), hosts=["10.0.0.7"]
    )


def test_dev_pki_files_and_permissions(pki: certs.DevPKI) -> None:
    assert stat.S_IMODE(pki.directory.stat().st_mode) == 0o700
    for secret in (pki.directory / certs.CA_KEY, pki.nodes["n1"].key, pki.tokens_file, pki.join_token_file):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    book = TokenBook.load(str(pki.tokens_file))
    assert book.lookup(pki.tokens["root"]) == Principal(Kind.USER, "root", admin=True)
    assert book.lookup(pki.tokens["alice"]) == Principal(Kind.USER, "alice")
    assert book.lookup(pki.join_token_file.read_text().strip()) == AGENT
    env = pki.env("alice")
    assert ClientSecurity.from_env(env).token == pki.tokens["alice"]
    assert (pki.directory / "alice.env").read_text().count("export UNICRON_") == 4


def test_dev_pki_again_keeps_the_ca_and_tokens(pki: certs.DevPKI) -> None:
    ca = pki.ca.read_bytes()
    again = certs.create_dev_pki(pki.directory, nodes=["n2"], users=[certs.User("alice")])
    assert again.ca.read_bytes() == ca
    assert again.tokens["alice"] == pki.tokens["alice"]
    assert again.tokens["root"] == pki.tokens["root"]  # other users stay in the file
    assert again.join_token == pki.join_token
    assert {u["name"] for u in yaml.safe_load(again.tokens_file.read_text())["users"]} == {"root", "alice"}


@pytest.mark.parametrize(("spec", "problem"), [("", "users"), ("a:root", "users")])
def test_parse_users_refuses(spec: str, problem: str) -> None:
    with pytest.raises(InvalidArgument) as raised:
        certs.parse_users(spec)
    assert raised.value.field == problem


def test_names_that_would_escape_the_directory_are_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument):
        certs.create_dev_pki(tmp_path, nodes=["../etc"])


def test_tls_config_requires_certificates_unless_plaintext(pki: certs.DevPKI, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument) as raised:
        TLSConfig()
    assert raised.value.field == "tls_ca"
    assert TLSConfig(plaintext=True).tls() is None
    leaf = pki.nodes["n1"]
    config = TLSConfig(tls_ca=str(pki.ca), tls_cert=str(leaf.cert), tls_key=str(leaf.key))
    tls = config.tls()
    assert tls is not None and tls.key is not None and b"PRIVATE KEY" in tls.key
    with pytest.raises(InvalidArgument) as raised:
        TLSConfig(tls_ca=str(pki.ca), tls_cert=str(tmp_path / "missing.pem"), tls_key=str(leaf.key))
    assert raised.value.field == "tls_cert"
    not_pem = tmp_path / "not.pem"
    not_pem.write_text("hello")
    with pytest.raises(InvalidArgument) as raised:
        TLSConfig(tls_ca=str(not_pem), tls_cert=str(leaf.cert), tls_key=str(leaf.key))
    assert raised.value.field == "tls_ca"
    with pytest.raises(InvalidArgument) as raised:  # a certificate where the key belongs
        TLSConfig(tls_ca=str(pki.ca), tls_cert=str(leaf.cert), tls_key=str(leaf.cert))
    assert raised.value.field == "tls_key"


@pytest.mark.parametrize(
    ("env", "tls", "token"),
    [
        ({"UNICRON_PLAINTEXT": "1", "UNICRON_TOKEN": "t"}, False, "t"),
        ({}, True, ""),  # TLS with the system's roots
    ],
)
def test_client_security_from_env(env: dict[str, str], tls: bool, token: str) -> None:
    security = ClientSecurity.from_env(env)
    assert (security.tls is not None) is tls
    assert security.token == token


def test_client_security_token_file(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("secret-token\n")
    assert ClientSecurity.from_env({"UNICRON_TOKEN_FILE": str(path)}).token == "secret-token"
    with pytest.raises(InvalidArgument) as raised:
        ClientSecurity.from_env({"UNICRON_TOKEN_FILE": str(tmp_path / "none")})
    assert raised.value.field == "UNICRON_TOKEN_FILE"


@pytest.mark.parametrize(
    ("principal", "method", "request_", "key"),
    [
        (ALICE, SUBMIT, None, "user:alice"),
        (N1, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n1"), "node:n1"),
        # Join-token agents (and anyone when authentication is off) spend their node's budget,
        # whatever connection they share; otherwise their connection's.
        (AGENT, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n7"), "agent:node_id=n7"),
        (TRUSTED, HEARTBEAT, node_service_pb2.HeartbeatRequest(node_id="n7"), "trusted:node_id=n7"),
        (AGENT, HEARTBEAT, node_service_pb2.HeartbeatRequest(), "agent@ipv4:127.0.0.1:5000"),
        (TRUSTED, SUBMIT, None, "trusted@ipv4:127.0.0.1:5000"),
    ],
)
def test_caller_key(principal: Principal, method: str, request_: Any, key: str) -> None:
    assert caller_key(principal, "ipv4:127.0.0.1:5000", rule_for(POLICY, method), request_) == key
