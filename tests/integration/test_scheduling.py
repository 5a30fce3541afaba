"""The agent-facing API and the reconcile loop against a real Redis and two real planner
replicas: placement, commands, progress, completion, failures, lost nodes, failover."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.conftest import ControlPlane, FakeClock
from tests.integration.test_job_api import register, tiny_spec
from unicron.v1 import common_pb2, node_service_pb2

pytestmark = pytest.mark.integration


def commands_for(plane: ControlPlane, node_id: str, after: str, count: int) -> list[node_service_pb2.NodeCommand]:
    stream = plane.node_stub().StreamCommands(
        node_service_pb2.StreamCommandsRequest(node_id=node_id, after_command_id=after), timeout=10
    )
    out = []
    for reply in stream:
        out.append(reply.command)
        if len(out) == count:
            stream.cancel()
            break
    return out


def scheduled_job(plane: ControlPlane, data: int = 4) -> tuple[common_pb2.Job, dict[str, str]]:
    cursors = {node: register(plane, node).last_command_id for node in ("n1", "n2")}
    with plane.client() as client:
        job = client.submit(tiny_spec(data=data))
    plane.coordinator.reconcile_once()
    with plane.client() as client:
        return client.get(job.job_id), cursors


def test_pending_job_is_placed_across_nodes_and_agents_get_start_commands(control_plane: ControlPlane) -> None:
    job, cursors = scheduled_job(control_plane)
    assert job.state == common_pb2.JOB_STATE_SCHEDULED
    placement = {w.node_id: list(w.ranks) for w in job.assignment.workers}
    assert sorted(placement) == ["n1", "n2"]
    assert sorted(r for ranks in placement.values() for r in ranks) == [0, 1, 2, 3]
    assert job.assignment.world_size == 4 and job.assignment.generation == 1
    assert job.assignment.master_port > 0
    for node_id in ("n1", "n2"):
        (command,) = commands_for(control_plane, node_id, cursors[node_id], 1)
        assert command.start_workers.job_id == job.job_id
        assert command.start_workers.assignment == job.assignment
        assert command.command_id


def test_progress_then_clean_exits_succeed_the_job(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    for iteration, loss in ((1, 4.0), (2, 3.5)):
        stub.ReportProgress(
            node_service_pb2.ReportProgressRequest(
                node_id="n1",
                reports=[
                    node_service_pb2.IterationReport(
                        job_id=job.job_id,
                        generation=1,
                        rank=rank,
                        iteration=iteration,
                        loss=loss,
                        seconds=0.5,
                        tokens=64,
                        flops=1e9,
                    )
                    for rank in range(4)
                ],
            ),
            timeout=5,
        )
    with control_plane.client() as client:
        running = client.get(job.job_id)
        assert running.state == common_pb2.JOB_STATE_RUNNING
        assert running.progress.iteration == 2 and running.progress.loss == pytest.approx(3.5)
        assert running.progress.tokens == 128
        assert running.progress.flops_per_second == pytest.approx(2e9)
        for worker in job.assignment.workers:
            for rank in worker.ranks:
                stub.ReportWorkerExit(
                    node_service_pb2.ReportWorkerExitRequest(
                        node_id=worker.node_id, job_id=job.job_id, generation=1, rank=rank, exit_code=0
                    ),
                    timeout=5,
                )
        done = client.get(job.job_id)
    assert done.state == common_pb2.JOB_STATE_SUCCEEDED
    assert done.reason == "all 4 ranks finished"


def test_failed_rank_fails_the_job_and_stops_the_other_nodes(control_plane: ControlPlane) -> None:
    job, cursors = scheduled_job(control_plane)
    failed = job.assignment.workers[0]
    other = job.assignment.workers[1].node_id
    control_plane.node_stub().ReportWorkerExit(
        node_service_pb2.ReportWorkerExitRequest(
            node_id=failed.node_id,
            job_id=job.job_id,
            generation=1,
            rank=failed.ranks[0],
            exit_code=1,
            stderr_tail="Traceback...\nRuntimeError: boom\n",
        ),
        timeout=5,
    )
    with control_plane.client() as client:
        after = client.get(job.job_id)
    assert after.state == common_pb2.JOB_STATE_FAILED
    assert "exit code 1" in after.reason and "RuntimeError: boom" in after.reason
    start, stop = commands_for(control_plane, other, cursors[other], 2)
    assert start.HasField("start_workers") and stop.stop_workers.job_id == job.job_id


def test_stale_generation_reports_are_ignored(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    control_plane.node_stub().ReportWorkerExit(
        node_service_pb2.ReportWorkerExitRequest(node_id="n1", job_id=job.job_id, generation=99, rank=0, exit_code=1),
        timeout=5,
    )
    with control_plane.client() as client:
        assert client.get(job.job_id).state == common_pb2.JOB_STATE_SCHEDULED


def test_silent_node_is_lost_and_its_job_fails(control_plane: ControlPlane, clock: FakeClock) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    clock.advance(2.0)
    assert stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5).known
    clock.advance(2.0)  # n2 silent for 4 s > 3 s timeout; n1 heard from 2 s ago
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        states = {n.node_id: n.state for n in client.nodes()}
        after = client.get(job.job_id)
    assert states == {"n1": common_pb2.NODE_STATE_READY, "n2": common_pb2.NODE_STATE_LOST}
    assert after.state == common_pb2.JOB_STATE_FAILED
    assert "node unreachable (node n2)" in after.reason and "no heartbeat" in after.reason
    # Registering again brings it back.
    register(control_plane, "n2")
    with control_plane.client() as client:
        assert all(n.state == common_pb2.NODE_STATE_READY for n in client.nodes())


def test_unknown_node_heartbeat_asks_to_register(control_plane: ControlPlane) -> None:
    reply = control_plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id="ghost"), timeout=5)
    assert not reply.known


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (node_service_pb2.RegisterNodeRequest(node_id="", address="h:1", slots=1), "node_id"),
        (node_service_pb2.RegisterNodeRequest(node_id="n", address="nohost", slots=1), "address"),
        (node_service_pb2.RegisterNodeRequest(node_id="n", address="h:1", slots=0), "slots"),
    ],
)
def test_bad_registration_is_invalid_argument(control_plane: ControlPlane, request_, field: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as error:
        control_plane.node_stub().RegisterNode(request_, timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith(field)
    assert control_plane.redis.keys("*") == []


def test_commands_for_unregistered_node_is_not_found(control_plane: ControlPlane) -> None:
    with pytest.raises(grpc.RpcError) as error:
        commands_for(control_plane, "ghost", "", 1)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND


def test_scheduling_fails_over_when_a_planner_replica_dies(control_plane: ControlPlane) -> None:
    control_plane.planners[0].stop()
    register(control_plane, "n1")
    register(control_plane, "n2")
    with control_plane.client() as client:
        jobs = [client.submit(tiny_spec(f"job-{i}", data=1)) for i in range(3)]
        for _ in range(3):  # round-robin start: every call that begins at the dead replica fails over
            control_plane.coordinator.reconcile_once()
        states = [client.get(job.job_id).state for job in jobs]
    assert states == [common_pb2.JOB_STATE_SCHEDULED] * 3


def test_health_and_reflection(control_plane: ControlPlane) -> None:
    channel = grpc.insecure_channel(control_plane.address)
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "unicron.v1.JobService", "unicron.v1.NodeService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = reflection.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
    )
    names = {s.name for reply in replies for s in reply.list_services_response.service}
    assert {"unicron.v1.JobService", "unicron.v1.NodeService", "grpc.health.v1.Health"} <= names
