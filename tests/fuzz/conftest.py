"""Servers under fuzzing, started once per test module: the coordinator (JobService and
NodeService, its writes fenced by a held lease as in production) over a real Redis with a
seeded cluster, the planner, and an agent's TrainerAgentService. Every channel comes from
`harness.open_channel`."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from services.agent.agent import Agent, AgentSettings
from services.agent.agent import serve as serve_agent
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.lease import FENCE_KEY, LEASE_KEY, Lease, LeaseKeeper, lease_client
from services.coordinator.planner_client import PlannerClient
from services.coordinator.redis_store import RedisStore
from services.coordinator.server import serve
from tests.fuzz import harness
from tests.integration.conftest import FakeClock, start_planner
from tests.integration.test_job_api import tiny_spec
from unicron import rpc
from unicron.redisutil import LocalRedis, connect
from unicron.v1 import (
    common_pb2,
    job_service_pb2,
    job_service_pb2_grpc,
    node_service_pb2,
    node_service_pb2_grpc,
    planner_service_pb2,
    trainer_service_pb2,
)

# Keys that change with no call at all, left out of the before/after comparison.
LEASE_KEYS = {
    LEASE_KEY: "the lease keeper renews it on its own thread (and a new holder rewrites it)",
    FENCE_KEY: "incremented by every acquisition of the lease, not by any RPC",
}
AGENT_KEYS = {
    **LEASE_KEYS,
    "unicron:node:*:heartbeat": "the agent's heartbeat loop writes its node's every second",
}


@dataclass
class Plane:
    """A coordinator with its lease, Redis and planners, as the fuzz modules use it."""

    coordinator: Coordinator
    server: rpc.Server
    planners: list[rpc.Server]
    redis: redis.Redis
    keeper: LeaseKeeper
    lease_lost: list[str]

    @property
    def address(self) -> str:
        return self.server.address

    def stop(self) -> None:
        self.server.stop()
        for planner in self.planners:
            planner.stop()
        self.keeper.stop()
        self.keeper.lease.release()
        self.redis.close()


def start_plane(url: str) -> Plane:
    """Coordinator (reconcile loop not started, fake clock: nothing changes unless a call
    or the test changes it) with a held lease, and two planner replicas."""
    client = connect(url)
    client.flushall()
    lease = Lease(lease_client(url), "fuzz")
    assert lease.try_acquire()
    lost: list[str] = []
    keeper = LeaseKeeper(lease, on_lost=lost.append)
    keeper.start()
    planners = [start_planner(), start_planner()]
    coordinator = Coordinator(
        RedisStore(client, lease=lease),
        PlannerClient([p.address for p in planners], timeout_s=10),
        Settings(heartbeat_timeout_s=3.0),
        clock=FakeClock(),
    )
    server = rpc.Server(bind="127.0.0.1:0", max_workers=16, grace_s=0.5, asyncio=True)
    serve(server, coordinator)
    server.start()
    return Plane(coordinator, server, planners, client, keeper, lost)


def seed_cluster(plane: Plane) -> dict[str, str]:
    """Two nodes, a running job with an incident, a cancelled job; returns the run-time ids
    the strategies' tokens stand for."""
    channel = harness.open_channel(plane.address)
    jobs = job_service_pb2_grpc.JobServiceStub(channel)
    nodes = node_service_pb2_grpc.NodeServiceStub(channel)
    for node_id, port, faults in (("n1", 7001, True), ("n2", 7002, False)):
        nodes.RegisterNode(
            node_service_pb2.RegisterNodeRequest(
                node_id=node_id, address=f"127.0.0.1:{port}", slots=4, failure_domain="rack-a", fault_injection=faults
            ),
            timeout=10,
        )
    running = jobs.SubmitJob(job_service_pb2.SubmitJobRequest(spec=tiny_spec("fuzz-running", data=2)), timeout=10).job
    plane.coordinator.reconcile_once()
    running = jobs.GetJob(job_service_pb2.GetJobRequest(job_id=running.job_id), timeout=10).job
    generation = running.assignment.generation
    assert generation, "the seeded job was not placed"
    for worker in running.assignment.workers:
        nodes.AckCommand(
            node_service_pb2.AckCommandRequest(
                node_id=worker.node_id, job_id=running.job_id, generation=generation, ok=True
            ),
            timeout=10,
        )
    first = running.assignment.workers[0].node_id
    for worker in running.assignment.workers:  # each node reports its own ranks (only it may)
        nodes.ReportProgress(
            node_service_pb2.ReportProgressRequest(
                node_id=worker.node_id,
                reports=[
                    node_service_pb2.IterationReport(
                        job_id=running.job_id, generation=generation, rank=rank, iteration=1, loss=5.0, seconds=0.1
                    )
                    for rank in worker.ranks
                ],
            ),
            timeout=10,
        )
    done = jobs.SubmitJob(job_service_pb2.SubmitJobRequest(spec=tiny_spec("fuzz-done", data=1)), timeout=10).job
    jobs.CancelJob(job_service_pb2.CancelJobRequest(job_id=done.job_id, reason="seeded"), timeout=10)
    straggler = common_pb2.FailureReport(
        job_id=running.job_id,
        generation=generation,
        rank=0,
        node_id=first,
        kind=common_pb2.FAILURE_KIND_STRAGGLER,
        severity=common_pb2.SEVERITY_SEV3,
        source=common_pb2.DETECTION_SOURCE_STATISTICAL,
        message="seeded straggler",
    )
    nodes.ReportFailure(node_service_pb2.ReportFailureRequest(node_id=first, report=straggler), timeout=10)
    running = jobs.GetJob(job_service_pb2.GetJobRequest(job_id=running.job_id), timeout=10).job
    assert running.state == common_pb2.JOB_STATE_RUNNING, running
    incidents = jobs.ListIncidents(job_service_pb2.ListIncidentsRequest(job_id=running.job_id), timeout=10).incidents
    assert incidents
    store = plane.coordinator.store
    channel.close()
    return {
        "job": running.job_id,
        "job_name": running.spec.name,
        "done_job": done.job_id,
        "event": store.last_event_id(running.job_id),
        "command": store.last_command_id("n1"),
        "incident": incidents[0].incident_id,
        "node": "n1",
        "node2": "n2",
    }


@pytest.fixture(scope="module")
def coordinator_target(redis_server: LocalRedis) -> Iterator[harness.Target]:
    plane = start_plane(redis_server.url)
    try:
        known = seed_cluster(plane)
        keyspace = harness.Keyspace(plane.redis, LEASE_KEYS)
        channel = harness.open_channel(plane.address)
        yield harness.Target(
            "coordinator",
            channel,
            harness.catalog(job_service_pb2, node_service_pb2),
            known,
            keyspace,
            keyspace.snapshot(),
            read_only=frozenset(
                {
                    "GetJob",
                    "ListJobs",
                    "ListQueue",
                    "ListQuotas",
                    "WatchJob",
                    "ListNodes",
                    "ListIncidents",
                    "GetCluster",
                    "StreamCommands",
                    "StreamLogs",
                }
            ),
            reaches_nodes=frozenset({"StreamLogs"}),
        )
        channel.close()
        assert not plane.lease_lost, plane.lease_lost
    finally:
        plane.stop()


@pytest.fixture(scope="module")
def planner_target() -> Iterator[harness.Target]:
    server = start_planner()
    channel = harness.open_channel(server.address)
    yield harness.Target("planner", channel, harness.catalog(planner_service_pb2))
    channel.close()
    server.stop()


class ForwardFailures(logging.Handler):
    """The agent's 'could not send ...' errors: a report it accepted from a trainer that the
    coordinator then refused (or never got)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.msg == "could not send %s":
            self.messages.append(f"{record.getMessage()}: {getattr(record, 'error', '')}")


@dataclass
class AgentUnderTest:
    target: harness.Target
    agent: Agent
    plane: Plane
    work_dir: Path
    forward_failures: ForwardFailures

    def running_key(self) -> tuple[str, int, int]:
        """The (job, generation, rank) of a trainer the agent runs now, submitting a new job
        when fuzzed reports have made the last one end."""
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            for key in self.agent.supervisor.running():
                return key.job_id, key.generation, key.rank
            if not self._active_job():
                self._submit()
            time.sleep(0.05)
        raise AssertionError("the agent runs no trainer")

    def _active_job(self) -> bool:
        return any(
            job.state
            in (
                common_pb2.JOB_STATE_PENDING,
                common_pb2.JOB_STATE_SCHEDULED,
                common_pb2.JOB_STATE_RUNNING,
                common_pb2.JOB_STATE_RECOVERING,
            )
            for job in self.plane.coordinator.list_jobs()
        )

    def _submit(self) -> None:
        name = f"fuzz-agent-{len(self.plane.coordinator.list_jobs())}"
        self.plane.coordinator.submit(tiny_spec(name, data=1))
        self.plane.coordinator.reconcile_once()


@pytest.fixture(scope="module")
def agent_target(redis_server: LocalRedis, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AgentUnderTest]:
    """A real agent (its trainers are sleepers: the fuzz test plays the trainer over the
    agent protocol) registered with a real coordinator."""
    plane = start_plane(redis_server.url)
    work_dir = tmp_path_factory.mktemp("fuzz-agent")
    settings = AgentSettings(
        node_id="n1",
        slots=2,
        failure_domain="",
        work_dir=work_dir,
        stop_grace_s=1.0,
        fault_injection=True,
        # The statistical detectors act on the clock alone (a hang after accepted reports
        # stop), which would change the state between a call and its check; the reports
        # they consume are still validated, by the monitor, on every call.
        monitoring=False,
        trainer_command=(sys.executable, "-c", "import time; time.sleep(600)"),
    )
    agent = Agent(settings, plane.address)
    failures = ForwardFailures()
    agent_log = logging.getLogger("services.agent")  # its client logs "could not send"
    agent_log.addHandler(failures)
    server = rpc.Server(bind="127.0.0.1:0", max_workers=8, grace_s=0.5)
    serve_agent(server, agent)
    server.start()
    agent.start(server.address)
    channel = harness.open_channel(server.address)
    try:
        deadline = time.monotonic() + 10
        while not plane.coordinator.nodes():
            assert time.monotonic() < deadline, "the agent never registered"
            time.sleep(0.05)
        target = harness.Target(
            "agent", channel, harness.catalog(trainer_service_pb2), keyspace=harness.Keyspace(plane.redis, AGENT_KEYS)
        )
        under_test = AgentUnderTest(target, agent, plane, work_dir, failures)
        under_test.running_key()
        yield under_test
        assert not plane.lease_lost, plane.lease_lost
    finally:
        agent_log.removeHandler(failures)
        channel.close()
        server.stop()
        plane.stop()
