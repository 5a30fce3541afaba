"""A real agent against the in-process control plane; the test plays a misbehaving trainer
over the agent protocol (the agent's supervised process is a sleeper standing in for it)."""

from __future__ import annotations

import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from services.agent.agent import Agent, AgentSettings, serve
from services.agent.supervisor import WorkerKey
from tests.integration.conftest import ControlPlane
from tests.integration.test_job_api import tiny_spec
from unicron import rpc
from unicron.v1 import common_pb2, node_service_pb2, trainer_service_pb2, trainer_service_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture
def agent(control_plane: ControlPlane, tmp_path: Path) -> Iterator[Agent]:
    settings = AgentSettings(
        node_id="n1",
        slots=2,
        failure_domain="",
        work_dir=tmp_path,
        stop_grace_s=1.0,
        trainer_command=(sys.executable, "-c", "import time; time.sleep(60)"),
    )
    instance = Agent(settings, control_plane.address)
    server = rpc.Server(bind="127.0.0.1:0", max_workers=8, grace_s=0.5)
    serve(server, instance)
    server.start()
    instance.start(server.address)
    yield instance
    server.stop()


def running_job(plane: ControlPlane, agent: Agent) -> common_pb2.Job:
    deadline = time.monotonic() + 10
    with plane.client() as client:
        while not [n for n in client.nodes() if n.node_id == "n1"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        job = client.submit(tiny_spec(data=1))
        plane.coordinator.reconcile_once()
        while not agent.supervisor.running(job.job_id):
            assert time.monotonic() < deadline, "the agent never started the job"
            time.sleep(0.05)
        return client.get(job.job_id)


class Trainer:
    """The test's end of a Connect stream."""

    def __init__(self, address: str, hello: trainer_service_pb2.TrainerHello) -> None:
        self.outbox: queue.Queue[trainer_service_pb2.ConnectRequest | None] = queue.Queue()
        self.outbox.put(trainer_service_pb2.ConnectRequest(hello=hello))
        stub = trainer_service_pb2_grpc.TrainerAgentServiceStub(grpc.insecure_channel(address))
        self.replies = stub.Connect(iter(self.outbox.get, None), timeout=20)

    def send_iteration(self, job: common_pb2.Job, iteration: int, seconds: float = 0.1) -> None:
        self.outbox.put(
            trainer_service_pb2.ConnectRequest(
                iteration=node_service_pb2.IterationReport(
                    job_id=job.job_id, generation=1, rank=0, iteration=iteration, seconds=seconds
                )
            )
        )

    def next_reply(self) -> trainer_service_pb2.ConnectResponse:
        reply: trainer_service_pb2.ConnectResponse = next(self.replies)
        return reply

    def close(self) -> None:
        self.outbox.put(None)


def test_an_unknown_trainer_is_not_found(control_plane: ControlPlane, agent: Agent) -> None:
    trainer = Trainer(agent.address, trainer_service_pb2.TrainerHello(job_id="job-nope", generation=1, rank=0))
    with pytest.raises(grpc.RpcError) as error:
        trainer.next_reply()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_bad_and_flooded_reports_are_rejected_and_the_agent_carries_on(
    control_plane: ControlPlane, agent: Agent
) -> None:
    job = running_job(control_plane, agent)
    trainer = Trainer(agent.address, trainer_service_pb2.TrainerHello(job_id=job.job_id, generation=1, rank=0))
    assert trainer.next_reply().HasField("welcome")
    trainer.send_iteration(job, 1)
    trainer.send_iteration(job, 1)  # repeated
    rejected = trainer.next_reply().rejected
    assert rejected.code == "INVALID_ARGUMENT" and "iteration" in rejected.reason
    trainer.send_iteration(job, 2, seconds=-1.0)
    trainer.send_iteration(job, 2)  # a good one in between re-arms the refusal message
    trainer.send_iteration(job, 3, seconds=float("nan"))
    assert trainer.next_reply().rejected.code == "INVALID_ARGUMENT"
    for i in range(1000):
        trainer.send_iteration(job, 10 + i)
    assert trainer.next_reply().rejected.code == "RESOURCE_EXHAUSTED"
    trainer.close()
    # The good reports reached the coordinator; the bad ones changed nothing there.
    deadline = time.monotonic() + 10
    with control_plane.client() as client:
        while client.get(job.job_id).progress.iteration < 2:
            assert time.monotonic() < deadline, "good reports never arrived"
            time.sleep(0.1)
        assert client.incidents() == []
    assert rpc.wait_ready(agent.address, timeout_s=5)


def test_an_error_of_a_group_the_trainer_has_left_keeps_that_groups_generation(
    control_plane: ControlPlane, agent: Agent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reform can rekey a trainer (generation 1 -> 2) while the error of its old group is on
    the way: reported under generation 1, the coordinator sees it is stale."""
    reports: list[common_pb2.FailureReport] = []
    monkeypatch.setattr(agent, "_report", reports.append)
    key = WorkerKey("job-1", 2, 0)
    for generation in (1, 0):  # 0: the trainer did not say; the agent's key counts
        error = trainer_service_pb2.TrainerError(
            kind=common_pb2.FAILURE_KIND_CONNECTION_RESET, message="reset", generation=generation
        )
        agent._trainer_error(key, error)
    assert [r.generation for r in reports] == [1, 2]


def test_a_trainer_reformed_before_it_connected_gets_the_reform_with_its_welcome(
    control_plane: ControlPlane, agent: Agent
) -> None:
    """A restarted rank still starting (importing torch) when a second failure moves the job
    on: its hello names the generation it was started for; the agent takes it as the trainer
    it re-keyed and hands it the reform it could not deliver before."""
    job = running_job(control_plane, agent)
    started = job.assignment
    for generation in (2, 3):  # two reforms before the trainer says hello
        assignment = common_pb2.Assignment()
        assignment.CopyFrom(started)
        assignment.generation, assignment.master_port = generation, started.master_port + generation
        agent.executor.reform(
            node_service_pb2.Reform(
                job_id=job.job_id,
                from_generation=generation - 1,
                spec=job.spec,
                assignment=assignment,
                rank_map={0: 0},
                incident_id=f"inc-{generation}",
            )
        )
    assert [k.generation for k in agent.supervisor.running(job.job_id)] == [3]
    trainer = Trainer(agent.address, trainer_service_pb2.TrainerHello(job_id=job.job_id, generation=1, rank=0))
    try:
        assert trainer.next_reply().HasField("welcome")
        reform = trainer.next_reply().reform
        assert (reform.generation, reform.incident_id, reform.master_port) == (3, "inc-3", started.master_port + 3)
    finally:
        trainer.close()
    # Only once: a second hello under the old key is a stranger.
    stranger = Trainer(agent.address, trainer_service_pb2.TrainerHello(job_id=job.job_id, generation=1, rank=0))
    with pytest.raises(grpc.RpcError) as error:
        stranger.next_reply()
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_trainer_the_agent_does_not_know_fails_to_connect_at_once(agent: Agent) -> None:
    from unicron.trainer.agent_link import AgentLink, LinkCallbacks

    link = AgentLink(
        agent.address,
        trainer_service_pb2.TrainerHello(job_id="job-nope", generation=1, rank=0),
        LinkCallbacks(on_stop=lambda r: None, on_inject=lambda f: None, on_lost=lambda r: None),
    )
    started = time.monotonic()
    with pytest.raises(ConnectionError, match="NOT_FOUND"):
        link.open(timeout_s=30)
    assert time.monotonic() - started < 10  # not the welcome timeout
    link.close()


def test_a_job_for_another_image_is_refused_with_the_reason(control_plane: ControlPlane, agent: Agent) -> None:
    # The agent starts trainers in its own image; the job's image is not here. The start
    # command is acknowledged with the reason and no trainer starts.
    spec = tiny_spec(data=1)
    spec.program.image = "team/llm:7"
    job = common_pb2.Job(job_id="job-img", spec=spec)
    start = node_service_pb2.StartWorkers(job_id=job.job_id, spec=spec, assignment=common_pb2.Assignment(generation=1))
    start.assignment.workers.add(node_id="n1", ranks=[0])
    with pytest.raises(OSError, match=r"program\.image is 'team/llm:7', but this node runs no named image"):
        agent.executor.start_workers(start)
    assert not agent.supervisor.running(job.job_id)


def test_a_reform_that_leaves_the_node_out_stops_its_ranks_and_starts_none(
    control_plane: ControlPlane, agent: Agent
) -> None:
    """A resize moves the job onto other nodes: this node's reform names none of its ranks.
    It stops them, starts nothing, and still takes the next command (it once raised on the
    empty rank list and ended its command stream)."""
    job = running_job(control_plane, agent)
    reform = node_service_pb2.Reform(
        job_id=job.job_id,
        from_generation=job.assignment.generation,
        spec=job.spec,
        assignment=common_pb2.Assignment(generation=job.assignment.generation + 1, world_size=1),
    )
    reform.assignment.workers.add(node_id="elsewhere", ranks=[0], address="10.0.0.9:7000")
    (pid,) = agent.supervisor.pids(job.job_id).values()
    agent.executor.reform(reform)
    assert all(k.generation == job.assignment.generation for k in agent.supervisor.running(job.job_id))
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the left-out rank was not stopped"
        time.sleep(0.05)
    start = node_service_pb2.StartWorkers(
        job_id="job-next", spec=job.spec, assignment=common_pb2.Assignment(generation=1)
    )
    start.assignment.workers.add(node_id="n1", ranks=[0])
    agent.executor.start_workers(start)
    assert agent.supervisor.running("job-next")


def test_a_trainer_error_does_not_wait_for_an_unreachable_coordinator(tmp_path: Path) -> None:
    # The link's reader thread hands the report over and goes on reading that trainer; the
    # urgent-reports thread retries it until the coordinator is back.
    settings = AgentSettings(node_id="n1", slots=1, failure_domain="", work_dir=tmp_path)
    lonely = Agent(settings, "127.0.0.1:1")
    error = trainer_service_pb2.TrainerError(kind=common_pb2.FAILURE_KIND_SOFTWARE_ERROR, message="ValueError: x")
    start = time.monotonic()
    lonely._trainer_error(WorkerKey("job-1", 1, 0), error)
    assert time.monotonic() - start < 1.0
    assert lonely.client.urgent_backlog() == ["failure report"]
    lonely.stop()


def test_an_agent_frees_at_start_the_snapshots_a_killed_run_left(tmp_path: Path) -> None:
    """Killed with SIGKILL, an agent freed nothing; starting again it frees every job's
    snapshots but those of a trainer of that run still alive, and nothing it did not write."""
    import json
    import os

    snapshots = tmp_path / "shm"
    left, alive, foreign = "job-20261206-0000dead", "job-20261206-0000a11e", "my-notes"
    for name in (left, alive, foreign):
        (snapshots / name).mkdir(parents=True)
        (snapshots / name / "rank0.pt").write_bytes(b"state")
    work = tmp_path / "work"
    work.mkdir()
    (work / "trainers.json").write_text(
        json.dumps([{"pid": os.getpid(), "job_id": alive}, {"pid": 2**22 + 1, "job_id": left}])
    )
    settings = AgentSettings(node_id="n1", slots=1, failure_domain="", work_dir=work, snapshot_dir=snapshots)
    restarted = Agent(settings, "127.0.0.1:1")
    restarted.start("127.0.0.1:1")
    try:
        assert sorted(p.name for p in snapshots.iterdir()) == sorted([alive, foreign])
    finally:
        restarted.stop()
    assert [p.name for p in snapshots.iterdir()] == [foreign]  # stopping frees the rest, not the user's
