"""`unicron logs` over real gRPC servers: a real agent's trainers' output relayed by the
in-process coordinator (whole, tailed, followed until the worker ends), the bad input that
must be refused and change nothing, a node that cannot be reached, whose jobs a user sees,
and who an agent lets read over mutual TLS."""

from __future__ import annotations

import asyncio
import re
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from services.agent.__main__ import AgentConfig
from services.agent.__main__ import security as agent_security
from services.agent.agent import Agent, AgentSettings, serve
from services.agent.log_service import POLL_S, LogService
from services.agent.supervisor import Supervisor, WorkerExit
from services.coordinator import logs
from tests.integration.conftest import ControlPlane
from tests.integration.test_job_api import snapshot, tiny_spec
from tests.integration.test_security import SecurePlane, as_user, leaf_tls, make_plane
from unicron import certs, cli, rpc
from unicron.client import ClientError, UnicronClient
from unicron.errors import FailedPrecondition
from unicron.redisutil import free_port
from unicron.security import ClientSecurity, WorkerTokens
from unicron.v1 import (
    agent_service_pb2,
    agent_service_pb2_grpc,
    common_pb2,
    job_service_pb2,
    logs_pb2,
    node_service_pb2,
)

pytestmark = pytest.mark.integration

OUT, ERR = logs_pb2.LOG_STREAM_STDOUT, logs_pb2.LOG_STREAM_STDERR
# The agent's trainers: a line on stderr at start, then a numbered line on stdout every 50 ms.
PRINTER = (
    "import os, sys, time\n"
    "rank = os.environ.get('UNICRON_TRAINER_RANK', '?')\n"
    "print(f'rank {rank} started', file=sys.stderr, flush=True)\n"
    "i = 0\n"
    "while True:\n"
    "    print(f'rank {rank} line {i}', flush=True)\n"
    "    i += 1\n"
    "    time.sleep(0.05)\n"
)


@pytest.fixture
def agent(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Agent]:
    settings = AgentSettings(
        node_id="n1",
        slots=2,
        failure_domain="",
        work_dir=tmp_path,
        stop_grace_s=1.0,
        monitoring=False,  # no iteration reports come from these trainers
        trainer_command=(sys.executable, "-c", PRINTER),
    )
    instance = Agent(settings, control_plane.address)
    server = rpc.Server(bind="127.0.0.1:0", max_workers=8, grace_s=0.5)
    serve(server, instance)
    server.start()
    instance.start(server.address)
    yield instance
    server.stop()


def running_job(plane: ControlPlane, agent: Agent, data: int = 2) -> common_pb2.Job:
    deadline = time.monotonic() + 20
    with plane.client() as client:
        while not [n for n in client.nodes() if n.node_id == "n1"]:
            assert time.monotonic() < deadline, "the agent never registered"
            time.sleep(0.05)
        job = client.submit(tiny_spec("printer", data=data))
        plane.coordinator.reconcile_once()
        while len(agent.supervisor.running(job.job_id)) < data:
            assert time.monotonic() < deadline, "the agent never started the job"
            time.sleep(0.05)
        return client.get(job.job_id)


def text(chunks: Iterator[logs_pb2.LogChunk] | list[logs_pb2.LogChunk], stream: int) -> str:
    return b"".join(c.data for c in chunks if c.stream == stream).decode()


def lines_of(client: UnicronClient, job_id: str, rank: int, want: int) -> list[str]:
    """Reads the rank's stdout until it has at least `want` lines (the trainer just started)."""
    deadline = time.monotonic() + 20
    while True:
        lines = text(list(client.logs(job_id, rank, streams=[OUT])), OUT).splitlines()
        if len(lines) >= want:
            return lines
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)


def test_each_rank_s_output_comes_from_its_worker(control_plane: ControlPlane, agent: Agent) -> None:
    job = running_job(control_plane, agent)
    with control_plane.client() as client:
        for rank in (0, 1):
            lines = lines_of(client, job.job_id, rank, want=5)
            assert lines[:5] == [f"rank {rank} line {i}" for i in range(5)]
        chunks = list(client.logs(job.spec.name, rank=1, tail_lines=2))  # by name, the last lines
        out = text(chunks, OUT).splitlines()
        assert len(out) == 2 and all(re.fullmatch(r"rank 1 line \d+", line) for line in out), out
        assert text(chunks, ERR) == "rank 1 started\n"
        assert [c.stream for c in chunks] == sorted(c.stream for c in chunks)  # stdout's, then stderr's
        assert text(client.logs(job.job_id, rank=0, streams=[ERR]), OUT) == ""


def test_follow_sends_new_lines_until_the_worker_ends(control_plane: ControlPlane, agent: Agent) -> None:
    job = running_job(control_plane, agent)
    with control_plane.client() as client:
        seen = lines_of(client, job.job_id, 1, want=1)
        followed = client.logs(job.job_id, rank=1, follow=True, tail_lines=0, streams=[OUT])
        received = ""
        while received.count("\n") < 5:
            received += next(followed).data.decode()
        numbers = [int(line.rsplit(" ", 1)[1]) for line in received.splitlines()]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers))) and numbers[0] >= len(seen)
        # Cancelling the job stops its trainers: the follow ends with them, by itself.
        ended = threading.Event()

        def drain() -> None:
            for _ in followed:
                pass
            ended.set()

        threading.Thread(target=drain, daemon=True).start()
        client.cancel(job.job_id)
        control_plane.coordinator.reconcile_once()
        assert ended.wait(20), "the follow outlived the worker"
        # What it wrote stays readable after it ended.
        assert "rank 1 line 0" in text(client.logs(job.job_id, rank=1), OUT)


def test_a_reader_that_goes_away_frees_the_agent(control_plane: ControlPlane, agent: Agent) -> None:
    job = running_job(control_plane, agent, data=1)
    with control_plane.client() as client:
        lines_of(client, job.job_id, 0, want=1)
        for _ in range(10):  # more than the 8 streams a caller may hold open on the agent
            followed = client.logs(job.job_id, rank=0, follow=True, tail_lines=1)
            assert next(followed).data
            followed.close()
            time.sleep(2 * POLL_S)  # the agent sees the cancel at its next look
        assert text(client.logs(job.job_id, rank=0, tail_lines=1), OUT)


# ---- bad input, and a node that cannot be reached --------------------------------------


@pytest.fixture
def unreachable(control_plane: ControlPlane) -> tuple[ControlPlane, common_pb2.Job, str]:
    """A job placed on a node with no agent listening (nothing else running: Redis stays
    still unless a call writes)."""
    address = f"127.0.0.1:{free_port()}"
    control_plane.node_stub().RegisterNode(
        node_service_pb2.RegisterNodeRequest(node_id="n9", address=address, slots=2), timeout=5
    )
    with control_plane.client() as client:
        job = client.submit(tiny_spec("elsewhere", data=2))
        control_plane.coordinator.reconcile_once()
        return control_plane, client.get(job.job_id), address


@pytest.mark.parametrize(
    ("change", "code", "text_in"),
    [
        ({"job_id": "job-nope"}, grpc.StatusCode.NOT_FOUND, "no job with id or name 'job-nope'"),
        ({"job_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "job_id: is required"),
        ({"rank": 2}, grpc.StatusCode.INVALID_ARGUMENT, "rank: must be below the job's world size 2"),
        ({"rank": 2**32 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "rank: "),
        ({"streams": [9]}, grpc.StatusCode.INVALID_ARGUMENT, "streams: "),
        ({"streams": [0]}, grpc.StatusCode.INVALID_ARGUMENT, "streams: "),
    ],
)
def test_bad_input_is_refused_and_changes_nothing(
    unreachable: tuple[ControlPlane, common_pb2.Job, str],
    change: dict[str, object],
    code: grpc.StatusCode,
    text_in: str,
) -> None:
    plane, job, _ = unreachable
    request = job_service_pb2.StreamLogsRequest(**{"job_id": job.job_id, "rank": 0, **change})  # type: ignore[arg-type]
    before = snapshot(plane.redis)
    with plane.client() as client:
        with pytest.raises(ClientError) as refused:
            list(client.logs(request.job_id, request.rank, streams=list(request.streams)))
    assert refused.value.code == code and text_in in str(refused.value), refused.value
    assert snapshot(plane.redis) == before


def test_a_job_not_placed_yet_is_failed_precondition(control_plane: ControlPlane) -> None:
    control_plane.node_stub().RegisterNode(
        node_service_pb2.RegisterNodeRequest(node_id="n9", address="127.0.0.1:1", slots=2), timeout=5
    )
    with control_plane.client() as client:
        job = client.submit(tiny_spec("waiting", data=2))  # and no plan yet
        with pytest.raises(ClientError) as refused:
            list(client.logs(job.job_id))
    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION and "not been placed" in str(refused.value)


def test_an_unreachable_node_is_unavailable_in_one_readable_line(
    unreachable: tuple[ControlPlane, common_pb2.Job, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plane, job, address = unreachable
    node = job.assignment.workers[0].node_id
    with plane.client() as client:
        started = time.monotonic()
        with pytest.raises(ClientError) as refused:
            list(client.logs(job.job_id, rank=1, follow=True))
        assert time.monotonic() - started < logs.CONNECT_TIMEOUT_S + 5
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    assert str(refused.value).startswith(f"node {node} ({address}) is unreachable"), refused.value
    monkeypatch.setenv("UNICRON_PLAINTEXT", "1")
    assert cli.main(["--coordinator", plane.address, "logs", job.job_id]) == cli.EXIT_FAILED
    err = capsys.readouterr().err
    assert err.startswith(f"unicron: node {node} ({address}) is unreachable") and err.count("\n") == 1, err


# ---- whose logs, and who reads them from an agent --------------------------------------


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> certs.DevPKI:
    return certs.create_dev_pki(
        tmp_path_factory.mktemp("pki"), nodes=["n1"], users=certs.parse_users("root:admin,alice,bob")
    )


@pytest.fixture
def secure_plane(pki: certs.DevPKI, redis_client: redis.Redis) -> Iterator[SecurePlane]:
    made = make_plane(pki, redis_client)
    yield made
    made.server.stop()
    made.planner.stop()


def test_another_user_s_job_is_not_found_as_for_get_job(secure_plane: SecurePlane) -> None:
    secure_plane.register("n1")  # at 127.0.0.1:7000, where no agent listens
    with secure_plane.client("alice") as alice:
        job = alice.submit(tiny_spec("alices", data=1))
    secure_plane.coordinator.reconcile_once()
    with secure_plane.client("bob") as bob:
        for name in (job.job_id, job.spec.name):
            with pytest.raises(ClientError) as hidden:
                list(bob.logs(name))
            with pytest.raises(ClientError) as get:
                bob.get(name)
            assert (hidden.value.code, str(hidden.value)) == (get.value.code, str(get.value))
            assert hidden.value.code == grpc.StatusCode.NOT_FOUND
    # Its owner and an admin get as far as the node.
    for user in ("alice", "root"):
        with secure_plane.client(user) as client, pytest.raises(ClientError) as reached:
            list(client.logs(job.job_id))
        assert reached.value.code == grpc.StatusCode.UNAVAILABLE and str(reached.value).startswith("node n1 ")


@pytest.fixture
def secure_agent(pki: certs.DevPKI, tmp_path: Path) -> Iterator[tuple[rpc.Server, Path]]:
    """An agent's server as `python -m services.agent` secures it, serving logs of files
    written as a worker would have (gen1-rank0 of job-1)."""
    node = pki.nodes["n1"]
    config = AgentConfig(tls_ca=str(pki.ca), tls_cert=str(node.cert), tls_key=str(node.key), work_dir=str(tmp_path))
    server = rpc.Server(bind="127.0.0.1:0", max_workers=8, grace_s=0.2, security=agent_security(config, WorkerTokens()))
    exits: list[WorkerExit] = []
    service = LogService(Supervisor(tmp_path, exits.append), "n1", tmp_path)
    server.add(agent_service_pb2_grpc.add_AgentLogServiceServicer_to_server, service, "unicron.v1.AgentLogService")
    server.start()
    (tmp_path / "job-1").mkdir()
    (tmp_path / "job-1" / "gen1-rank0.out").write_text("hello from rank 0\n")
    yield server, tmp_path
    server.stop()


def read_as(server: rpc.Server, security: ClientSecurity) -> tuple[grpc.StatusCode, str]:
    stub = agent_service_pb2_grpc.AgentLogServiceStub(rpc.channel(server.address, security))
    try:
        replies = list(stub.ReadLogs(agent_service_pb2.ReadLogsRequest(job_id="job-1", rank=0), timeout=10))
    except grpc.RpcError as exc:
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, b"".join(r.chunk.data for r in replies).decode()


def test_an_agent_serves_logs_to_the_coordinator_alone(
    secure_agent: tuple[rpc.Server, Path], pki: certs.DevPKI
) -> None:
    server, _ = secure_agent
    coordinator = ClientSecurity(leaf_tls(pki, pki.services["coordinator"]))
    assert read_as(server, coordinator) == (grpc.StatusCode.OK, "hello from rank 0\n")
    for other in (
        ClientSecurity(leaf_tls(pki, pki.services["planner"])),  # another service
        ClientSecurity(leaf_tls(pki, pki.nodes["n1"])),  # what a trainer shows (its agent's own)
        as_user(pki, "root"),  # an admin's certificate and token: users go through the coordinator
    ):
        assert read_as(server, other)[0] == grpc.StatusCode.UNAUTHENTICATED
    trainer = ClientSecurity(leaf_tls(pki, pki.nodes["n1"]), WorkerTokens().issue("job-1", 1, 0))
    assert read_as(server, trainer)[0] == grpc.StatusCode.UNAUTHENTICATED  # another agent's token


def test_the_coordinator_relays_over_tls(secure_agent: tuple[rpc.Server, Path], pki: certs.DevPKI) -> None:
    server, _ = secure_agent
    source = logs.LogSource("job-1", 0, "n1", server.address, 1)
    read = agent_service_pb2.ReadLogsRequest(job_id="job-1", rank=0)

    async def relayed(service: str) -> list[logs_pb2.LogChunk]:
        security = ClientSecurity(leaf_tls(pki, pki.services[service]))
        return [chunk async for chunk in logs.relay(source, read, security)]

    assert text(asyncio.run(relayed("coordinator")), OUT) == "hello from rank 0\n"
    with pytest.raises(FailedPrecondition, match=r"node n1 .* refused the coordinator"):
        asyncio.run(relayed("planner"))
