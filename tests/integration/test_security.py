"""Trust and load on real gRPC servers over mutual TLS on 127.0.0.1, with a development CA:
who may call what, what a refusal answers and that it writes nothing, and the limits."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml

from services.agent.supervisor import WorkerKey
from services.agent.trainer_link import LinkHandlers, TrainerLink
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.planner_client import PlannerClient
from services.coordinator.quotas import Quota, Quotas
from services.coordinator.redis_store import RedisStore
from services.coordinator.server import serve
from services.planner.server import Limits as PlannerLimits
from services.planner.server import PlannerServicer
from tests.integration.conftest import FakeClock
from tests.integration.test_job_api import snapshot, tiny_spec
from unicron import certs, rpc
from unicron.client import ClientError, UnicronClient
from unicron.security import (
    TLS,
    ClientSecurity,
    Limits,
    ServerSecurity,
    TokenBook,
    WorkerTokens,
    load_tls,
    token_authenticator,
)
from unicron.v1 import (
    common_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    node_service_pb2,
    node_service_pb2_grpc,
    planner_service_pb2,
    planner_service_pb2_grpc,
    trainer_service_pb2,
    trainer_service_pb2_grpc,
)
from unicron_dev.localcluster import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(
        tmp_path_factory.mktemp("pki"), nodes=["n1", "n2"], users=certs.parse_users("root:admin,alice")
    )


def leaf_tls(pki: certs.DevPKI, leaf: certs.Leaf) -> TLS:
    return load_tls(str(pki.ca), str(leaf.cert), str(leaf.key))


def as_user(pki: certs.DevPKI, user: str, token: str | None = None) -> ClientSecurity:
    return ClientSecurity(leaf_tls(pki, pki.clients[user]), pki.tokens[user] if token is None else token)


def as_node(pki: certs.DevPKI, node: str, token: str = "") -> ClientSecurity:
    return ClientSecurity(leaf_tls(pki, pki.nodes[node]), token)


@dataclass
class SecurePlane:
    pki: certs.DevPKI
    coordinator: Coordinator
    server: rpc.Server
    planner: rpc.Server
    redis: redis.Redis

    @property
    def address(self) -> str:
        return self.server.address

    def client(self, user: str, token: str | None = None) -> UnicronClient:
        return UnicronClient(self.address, timeout_s=5, security=as_user(self.pki, user, token))

    def nodes(self, security: ClientSecurity) -> node_service_pb2_grpc.NodeServiceStub:
        return node_service_pb2_grpc.NodeServiceStub(rpc.channel(self.address, security))

    def register(self, node_id: str = "n1") -> None:
        request = node_service_pb2.RegisterNodeRequest(node_id=node_id, address="127.0.0.1:7000", slots=4)
        self.nodes(as_node(self.pki, node_id)).RegisterNode(request, timeout=5)


def secure_server(
    pki: certs.DevPKI,
    leaf: certs.Leaf,
    limits: Limits | None = None,
    lookup: Any = None,
    certificates: bool = True,
    asyncio: bool = False,
) -> rpc.Server:
    security = ServerSecurity(
        tls=leaf_tls(pki, leaf),
        authenticator=token_authenticator(lookup or (lambda _token: None), certificates),
        limits=limits or Limits(),
    )
    return rpc.Server(bind="127.0.0.1:0", max_workers=8, grace_s=0.2, security=security, asyncio=asyncio)


def make_plane(
    pki: certs.DevPKI,
    redis_client: redis.Redis,
    limits: Limits | None = None,
    settings: Settings | None = None,
    tokens: TokenBook | None = None,
) -> SecurePlane:
    planner = secure_server(pki, pki.services["planner"])
    planner.add(
        planner_service_pb2_grpc.add_PlannerServiceServicer_to_server,
        PlannerServicer(PlannerLimits(max_jobs=64, max_nodes=64)),
        "unicron.v1.PlannerService",
    )
    planner.start()
    coordinator_tls = ClientSecurity(leaf_tls(pki, pki.services["coordinator"]))
    coordinator = Coordinator(
        RedisStore(redis_client),
        PlannerClient([planner.address], timeout_s=10, security=coordinator_tls),
        settings or Settings(heartbeat_timeout_s=3.0),
        clock=FakeClock(),
    )
    book = tokens or TokenBook.load(str(pki.tokens_file))
    server = secure_server(pki, pki.services["coordinator"], limits, book.lookup, asyncio=True)
    serve(server, coordinator)
    server.start()
    return SecurePlane(pki, coordinator, server, planner, redis_client)


@pytest.fixture
def plane(pki: certs.DevPKI, redis_client: redis.Redis) -> Iterator[SecurePlane]:
    made = make_plane(pki, redis_client)
    yield made
    made.server.stop()
    made.planner.stop()


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    try:
        call()
    except ClientError as exc:
        return exc.code
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_missing_or_wrong_token_is_unauthenticated_and_writes_nothing(plane: SecurePlane) -> None:
    plane.register()
    before = snapshot(plane.redis)
    with plane.client("alice", token="") as anonymous:
        assert code_of(lambda: anonymous.submit(tiny_spec())) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(anonymous.list_jobs) == grpc.StatusCode.UNAUTHENTICATED
    with plane.client("alice", token="not-a-token-of-this-cluster") as forger:
        assert code_of(lambda: forger.submit(tiny_spec())) == grpc.StatusCode.UNAUTHENTICATED
    # The join token admits agents, not users.
    with plane.client("alice", token=plane.pki.join_token) as agent:
        assert code_of(lambda: agent.submit(tiny_spec())) == grpc.StatusCode.PERMISSION_DENIED
    assert snapshot(plane.redis) == before


def test_users_see_and_cancel_only_their_own_jobs(plane: SecurePlane) -> None:
    plane.register()
    with plane.client("alice") as alice, plane.client("root") as root:
        mine = alice.submit(tiny_spec("mine"))
        theirs = root.submit(tiny_spec("theirs"))
        assert (mine.owner, theirs.owner) == ("alice", "root")
        assert [j.job_id for j in alice.list_jobs()] == [mine.job_id]
        assert {j.job_id for j in root.list_jobs()} == {mine.job_id, theirs.job_id}  # an admin sees all
        before = snapshot(plane.redis)
        for call in (
            lambda: alice.get(theirs.job_id),
            lambda: alice.get("theirs"),  # by name too
            lambda: alice.cancel(theirs.job_id, "mine now"),
            lambda: alice.incidents(theirs.job_id),
            lambda: alice.inject(theirs.job_id, common_pb2.Fault(kind=common_pb2.FAULT_KIND_CRASH)),
            lambda: next(iter(alice.watch(theirs.job_id))),
        ):
            # As for a job that does not exist: the name tells alice nothing.
            assert code_of(call) == grpc.StatusCode.NOT_FOUND
        assert snapshot(plane.redis) == before
        assert root.get(theirs.job_id).state == common_pb2.JOB_STATE_PENDING
        assert [line.job_id for line in alice.cluster().jobs] == [mine.job_id]
        assert alice.cancel(mine.job_id).state == common_pb2.JOB_STATE_CANCELLED
        assert root.cancel(theirs.job_id).state == common_pb2.JOB_STATE_CANCELLED


def test_a_user_names_a_priority_class_and_only_an_admin_sets_a_raw_weight(plane: SecurePlane) -> None:
    """A weight is the number the planner maximizes: alice cannot outrank the cluster with one
    (PERMISSION_DENIED) nor name a class that does not exist (INVALID_ARGUMENT), and nothing is
    written; her class sets her job's weight; root, an admin, may set any."""
    plane.register()
    with plane.client("alice") as alice, plane.client("root") as root:
        before = snapshot(plane.redis)
        greedy = tiny_spec("greedy")
        greedy.weight = 1e9
        assert code_of(lambda: alice.submit(greedy)) == grpc.StatusCode.PERMISSION_DENIED
        unknown = tiny_spec("unknown")
        unknown.priority_class = "urgent"
        assert code_of(lambda: alice.submit(unknown)) == grpc.StatusCode.INVALID_ARGUMENT
        assert snapshot(plane.redis) == before
        classed = tiny_spec("classed")
        classed.priority_class = "production"
        job = alice.submit(classed)
        assert (job.spec.priority_class, job.spec.weight, job.spec.preemptible) == ("production", 10.0, False)
        assert root.submit(greedy).spec.weight == 1e9
        for done in (job, root.get("greedy")):
            root.cancel(done.job_id)


def test_the_queue_shows_alice_her_place_and_not_what_the_jobs_before_her_are(plane: SecurePlane) -> None:
    """Jobs that wait (this plane's coordinator plans nothing: no reconcile loop) in the order
    the planner prefers them; alice sees her own by name and root's as a place and a class."""
    plane.register()
    with plane.client("alice") as alice, plane.client("root") as root:
        heavy = tiny_spec("heavy-wait")
        heavy.priority_class = "production"
        theirs = root.submit(heavy)
        mine = alice.submit(tiny_spec("light-wait"))
        try:
            seen = alice.queue()
            places = [(e.position, e.name, e.priority_class) for e in seen]
            assert places == [(1, "", "production"), (2, "light-wait", "research")]
            assert seen[1].job_id == mine.job_id and seen[1].waiting_for and seen[0].waiting_for == ""
            assert [e.name for e in root.queue()] == ["heavy-wait", "light-wait"]  # an admin sees all
        finally:
            root.cancel(theirs.job_id)
            alice.cancel(mine.job_id)


def test_a_job_counts_against_its_owners_team_and_a_quota_it_can_never_fit_is_refused(
    pki: certs.DevPKI, redis_client: redis.Redis, tmp_path: Path
) -> None:
    """alice is in team vision (the tokens file), whose quota is 2 slots guaranteed and 1 to
    borrow: her job needing 4 is FAILED_PRECONDITION naming the quota and writes nothing; one
    needing 2 is taken, as hers and vision's. root, an admin in no team, is not limited."""
    data = yaml.safe_load(pki.tokens_file.read_text())
    for user in data["users"]:
        if user["name"] == "alice":
            user["team"] = "vision"
    tokens = tmp_path / "tokens.yaml"
    tokens.write_text(yaml.safe_dump(data))
    quotas = Quotas({"vision": Quota("vision", 2, 1)})
    made = make_plane(pki, redis_client, settings=Settings(quotas=quotas), tokens=TokenBook.load(str(tokens)))
    try:
        made.register()
        with made.client("alice") as alice, made.client("root") as root:
            big = tiny_spec("big")
            big.parallelism.data = big.parallelism.min_data = big.parallelism.max_data = 4
            before = snapshot(made.redis)
            with pytest.raises(ClientError) as error:
                alice.submit(big)
            assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "team vision's quota: 2 slots guaranteed, may borrow 1 more, 3 in all" in str(error.value)
            assert snapshot(made.redis) == before
            small = tiny_spec("small")
            small.parallelism.data = small.parallelism.min_data = small.parallelism.max_data = 2
            mine = alice.submit(small)
            assert (mine.owner, mine.team) == ("alice", "vision")
            theirs = root.submit(big)
            assert theirs.team == ""
            for job in (mine, theirs):
                root.cancel(job.job_id)
    finally:
        made.server.stop()
        made.planner.stop()


def test_a_node_certificate_speaks_only_for_its_node(plane: SecurePlane) -> None:
    plane.register("n1")
    before = snapshot(plane.redis)
    n1 = plane.nodes(as_node(plane.pki, "n1"))
    as_n2 = node_service_pb2.RegisterNodeRequest(node_id="n2", address="127.0.0.1:7001", slots=4)
    assert code_of(lambda: n1.RegisterNode(as_n2, timeout=5)) == grpc.StatusCode.PERMISSION_DENIED
    assert code_of(lambda: n1.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n2"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    # A user's token does not make an agent, even an admin's.
    users_agent = plane.nodes(as_user(plane.pki, "root"))
    assert code_of(lambda: users_agent.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5)) == (
        grpc.StatusCode.PERMISSION_DENIED
    )
    assert snapshot(plane.redis) == before
    assert n1.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5).known
    # The join token admits an agent by any node id (its certificate here names no node).
    joined = plane.nodes(ClientSecurity(leaf_tls(plane.pki, plane.pki.clients["alice"]), plane.pki.join_token))
    joined.RegisterNode(as_n2, timeout=5)
    assert {n.node_id for n in plane.coordinator.nodes()} == {"n1", "n2"}


def test_a_heartbeat_stream_speaks_only_for_its_node_in_every_message(plane: SecurePlane) -> None:
    plane.register("n1")
    n1 = plane.nodes(as_node(plane.pki, "n1"))

    def beats(*nodes: str) -> tuple[list[bool], grpc.StatusCode]:
        answers: list[bool] = []
        requests = iter([node_service_pb2.StreamHeartbeatsRequest(node_id=n) for n in nodes])
        try:
            answers.extend(reply.known for reply in n1.StreamHeartbeats(requests, timeout=5))
        except grpc.RpcError as exc:
            return answers, exc.code()
        return answers, grpc.StatusCode.OK

    assert beats("n1", "n1") == ([True, True], grpc.StatusCode.OK)
    assert beats("n2") == ([], grpc.StatusCode.PERMISSION_DENIED)  # refused when it opens
    answers, code = beats("n1", "n2", "n1")  # and on any later message
    assert code == grpc.StatusCode.PERMISSION_DENIED and answers in ([], [True])
    anonymous = plane.nodes(ClientSecurity(leaf_tls(plane.pki, plane.pki.clients["alice"]), ""))
    requests = iter([node_service_pb2.StreamHeartbeatsRequest(node_id="n1")])
    assert code_of(lambda: list(anonymous.StreamHeartbeats(requests, timeout=5))) == grpc.StatusCode.UNAUTHENTICATED


def test_a_plaintext_or_unknown_client_cannot_reach_a_tls_server(
    plane: SecurePlane, tmp_path: Path, pki: certs.DevPKI
) -> None:
    def health(security: ClientSecurity | None) -> bool:
        return rpc.wait_ready(plane.address, timeout_s=1, security=security)

    assert health(as_user(plane.pki, "alice"))
    assert not health(None)  # plaintext
    assert not health(ClientSecurity(TLS(pki.ca.read_bytes())))  # no client certificate
    other = certs.create_dev_pki(tmp_path / "other", nodes=["n1"])
    assert not health(ClientSecurity(leaf_tls(other, other.nodes["n1"])))  # another CA's certificate
    with UnicronClient(plane.address, timeout_s=2, security=ClientSecurity.plaintext(pki.tokens["root"])) as client:
        assert code_of(client.list_jobs) == grpc.StatusCode.UNAVAILABLE


def test_the_planner_admits_only_services(plane: SecurePlane) -> None:
    request = planner_service_pb2.PlanRequest(failure_rate_per_node_per_second=1e-6, time_limit_seconds=1)
    request.nodes.add(node_id="n1", slots=4, healthy=True)

    def plan(security: ClientSecurity) -> grpc.StatusCode:
        stub = planner_service_pb2_grpc.PlannerServiceStub(rpc.channel(plane.planner.address, security))
        return code_of(lambda: stub.Plan(request, timeout=10))

    assert plan(ClientSecurity(leaf_tls(plane.pki, plane.pki.services["coordinator"]))) == grpc.StatusCode.OK
    assert plan(as_node(plane.pki, "n1")) == grpc.StatusCode.PERMISSION_DENIED
    assert plan(as_user(plane.pki, "root")) == grpc.StatusCode.UNAUTHENTICATED  # no tokens valid here


def test_a_call_without_a_deadline_is_served_under_the_default(plane: SecurePlane) -> None:
    """grpcurl and most generated stubs set no deadline: served, not refused."""
    raw = grpc.secure_channel(plane.address, as_user(plane.pki, "alice").credentials())  # no default timeout
    stub = job_service_pb2_grpc.JobServiceStub(raw)
    metadata = [("authorization", f"Bearer {plane.pki.tokens['alice']}")]
    assert stub.ListJobs(job_service_pb2.ListJobsRequest(), metadata=metadata) is not None
    assert stub.ListJobs(job_service_pb2.ListJobsRequest(), metadata=metadata, timeout=5) is not None
    raw.close()


@pytest.fixture
def tight_plane(pki: certs.DevPKI, redis_client: redis.Redis) -> Iterator[SecurePlane]:
    limits = Limits(max_message_bytes=64 * 1024, rate_per_s=2.0, burst=5.0, streams_per_caller=1)
    made = make_plane(pki, redis_client, limits)
    yield made
    made.server.stop()
    made.planner.stop()


def test_an_oversize_message_is_resource_exhausted_and_writes_nothing(tight_plane: SecurePlane) -> None:
    tight_plane.register()
    before = snapshot(tight_plane.redis)
    big = tiny_spec()
    big.name = "x" * (100 * 1024)
    with tight_plane.client("alice") as alice:
        assert code_of(lambda: alice.submit(big)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert snapshot(tight_plane.redis) == before


def test_a_flooding_caller_is_rate_limited_while_others_proceed(tight_plane: SecurePlane) -> None:
    with tight_plane.client("alice") as alice, tight_plane.client("root") as root:
        codes = [code_of(alice.list_jobs) for _ in range(20)]
        assert codes[:5] == [grpc.StatusCode.OK] * 5  # the burst
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert code_of(root.list_jobs) == grpc.StatusCode.OK  # another caller is not held up
        time.sleep(1.0)  # and the flooder gets its rate back
        assert code_of(alice.list_jobs) == grpc.StatusCode.OK


def test_streams_per_caller_are_capped(tight_plane: SecurePlane) -> None:
    tight_plane.register()
    with tight_plane.client("alice") as alice, tight_plane.client("root") as root:
        job = alice.submit(tiny_spec())
        first = alice.watch(job.job_id)
        assert next(iter(first)).type == common_pb2.JOB_EVENT_TYPE_SNAPSHOT  # holds one stream
        assert code_of(lambda: next(iter(alice.watch(job.job_id)))) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert next(iter(root.watch(job.job_id))).type == common_pb2.JOB_EVENT_TYPE_SNAPSHOT
        first.close()  # type: ignore[attr-defined]


@pytest.fixture
def trainer_link(pki: certs.DevPKI) -> Iterator[tuple[rpc.Server, WorkerTokens]]:
    """An agent's trainer-facing server over TLS, admitting trainers by their worker tokens."""
    tokens = WorkerTokens()
    known = {WorkerKey("job-1", 1, 0), WorkerKey("job-1", 1, 1)}
    link = TrainerLink(
        "n1",
        LinkHandlers(
            is_known=lambda key: key in known,
            on_iteration=lambda key, report: None,
            on_error=lambda key, error: None,
            on_fault_fired=lambda key, fired: None,
        ),
    )
    server = secure_server(pki, pki.nodes["n1"], lookup=tokens.lookup, certificates=False)  # as the agent
    server.add(
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server, link, "unicron.v1.TrainerAgentService"
    )
    server.start()
    yield server, tokens
    server.stop()


def connect(server: rpc.Server, security: ClientSecurity, rank: int) -> tuple[grpc.StatusCode, str]:
    """Says hello as job-1 generation 1 `rank`; the first answer's kind, or the refusal."""
    stub = trainer_service_pb2_grpc.TrainerAgentServiceStub(rpc.channel(server.address, security))
    outbox: queue.Queue[trainer_service_pb2.ConnectRequest | None] = queue.Queue()
    outbox.put(
        trainer_service_pb2.ConnectRequest(
            hello=trainer_service_pb2.TrainerHello(job_id="job-1", generation=1, rank=rank)
        )
    )
    responses = stub.Connect(iter(outbox.get, None), timeout=10)
    try:
        first = next(responses)
        return grpc.StatusCode.OK, first.WhichOneof("message") or ""
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    finally:
        outbox.put(None)
        responses.cancel()


def test_a_trainer_speaks_only_for_its_own_job_and_rank(
    trainer_link: tuple[rpc.Server, WorkerTokens], pki: certs.DevPKI
) -> None:
    server, tokens = trainer_link
    node_tls = leaf_tls(pki, pki.nodes["n1"])
    rank1 = ClientSecurity(node_tls, tokens.issue("job-1", 1, 1))
    assert connect(server, rank1, rank=1) == (grpc.StatusCode.OK, "welcome")
    code, details = connect(server, rank1, rank=0)
    assert code == grpc.StatusCode.PERMISSION_DENIED, details
    assert connect(server, ClientSecurity(node_tls), rank=0)[0] == grpc.StatusCode.UNAUTHENTICATED
    forged = ClientSecurity(node_tls, WorkerTokens().issue("job-1", 1, 0))  # another agent's secret
    assert connect(server, forged, rank=0)[0] == grpc.StatusCode.UNAUTHENTICATED
    old_generation = ClientSecurity(node_tls, tokens.issue("job-1", 0, 0))
    assert connect(server, old_generation, rank=0)[0] == grpc.StatusCode.PERMISSION_DENIED


def run_planner(*args: str, wait_for: bytes = b"", timeout_s: float = 30) -> tuple[int | None, bytes]:
    """Starts `python -m services.planner`; returns its exit code (None: still serving once
    `wait_for` appeared, then stopped) and what it printed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.planner", "--bind", "127.0.0.1:0", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    output = b""
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                return proc.wait(timeout=timeout_s), output
            output += line
            if wait_for and wait_for in output:
                return None, output
        raise AssertionError(f"no {wait_for!r} within {timeout_s}s: {output!r}")
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=10)
        proc.stdout.close()


def test_a_service_without_certificates_says_which_and_exits(tmp_path: Path, pki: certs.DevPKI) -> None:
    code, output = run_planner()
    assert code == 2
    assert output.decode().strip().splitlines() == [
        "unicron-planner: tls_ca: is required (make certs writes one), or run with --plaintext"
    ]
    leaf = pki.services["planner"]
    code, output = run_planner(
        "--tls-ca", str(pki.ca), "--tls-cert", str(tmp_path / "nope.pem"), "--tls-key", str(leaf.key)
    )
    assert code == 2
    assert output.decode().strip() == f"unicron-planner: tls_cert: no such file: {tmp_path / 'nope.pem'}"


def test_plaintext_is_said_loudly(pki: certs.DevPKI) -> None:
    code, output = run_planner("--plaintext", wait_for=b"planner serving")
    assert code is None
    warnings = [line for line in output.decode().splitlines() if '"level": "warning"' in line]
    assert any("PLAINTEXT" in line for line in warnings), output
    assert any("authenticates NO ONE" in line for line in warnings), output
    leaf = pki.services["planner"]
    code, output = run_planner(
        "--tls-ca", str(pki.ca), "--tls-cert", str(leaf.cert), "--tls-key", str(leaf.key), wait_for=b"planner serving"
    )
    assert code is None
    assert b"PLAINTEXT" not in output
