"""The self-healing loop at its edges, against a real Redis and real planners: a planner
that is down, a cancel in the middle of a transition, acknowledgements that are late,
duplicate or for nothing, a missed start deadline, and a Redis killed and restarted."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from services.coordinator import decide
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.planner_client import PlannerClient
from services.coordinator.redis_store import RedisStore
from tests.integration.conftest import ControlPlane, FakeClock, start_planner
from tests.integration.test_scheduling import commands_for, exit_report, report_exit, report_iteration, scheduled_job
from unicron import redisutil
from unicron.v1 import common_pb2, node_service_pb2

pytestmark = pytest.mark.integration


def lose(plane: ControlPlane, clock: FakeClock, node_id: str, others: list[str]) -> None:
    clock.advance(2.0)
    for other in others:
        plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id=other), timeout=5)
    clock.advance(2.0)
    plane.coordinator.reconcile_once()


def test_a_planner_outage_keeps_the_job_and_retries_with_backoff(control_plane: ControlPlane, clock: FakeClock) -> None:
    job, _ = scheduled_job(control_plane, data=2)
    for worker in job.workers:  # the agents started the ranks
        control_plane.node_stub().AckCommand(
            node_service_pb2.AckCommandRequest(node_id=worker.node_id, job_id=job.job_id, generation=1, ok=True),
            timeout=5,
        )
    lost = job.assignment.workers[0].node_id
    alive = "n1" if lost == "n2" else "n2"
    addresses = [p.address for p in control_plane.planners]
    for planner in control_plane.planners:
        planner.stop()
    lose(control_plane, clock, lost, [alive])
    with control_plane.client() as client:
        waiting = client.get(job.job_id)
    # Nothing lost, nothing half-done: the job waits for a plan with its remedy recorded.
    assert waiting.state == common_pb2.JOB_STATE_RECOVERING
    assert waiting.remedies[-1].remedy == common_pb2.REMEDY_RECONFIGURE
    assert waiting.remedies[-1].generation == 0 and waiting.assignment.generation == 1
    # The planners come back on the same addresses; after the backoff the plan goes through.
    control_plane.planners[:] = [start_planner(address) for address in addresses]
    clock.advance(0.5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert client.get(job.job_id).assignment.generation == 1  # still backing off
    deadline = time.monotonic() + 20  # the channel reconnects to the restarted planners in real time
    while True:
        clock.advance(31.0)
        control_plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id=alive), timeout=5)
        control_plane.coordinator.reconcile_once()
        with control_plane.client() as client:
            moved = client.get(job.job_id)
        if moved.assignment.generation > 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert moved.assignment.generation == 2
    assert [w.node_id for w in moved.assignment.workers] == [alive]


def test_cancel_during_a_transition_stops_every_worker(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    report_exit(control_plane, exit_report(job, 1))
    with control_plane.client() as client:
        assert client.get(job.job_id).state == common_pb2.JOB_STATE_RECOVERING
        cancelled = client.cancel(job.job_id, "changed my mind")
    assert cancelled.state == common_pb2.JOB_STATE_CANCELLED
    current = [w for w in cancelled.workers if w.generation == cancelled.assignment.generation]
    assert current and all(w.state == common_pb2.WORKER_STATE_STOPPING for w in current)
    # A late iteration of the restarted generation does not revive it.
    report_iteration(control_plane, cancelled, 2, 1)
    with control_plane.client() as client:
        assert client.get(job.job_id).state == common_pb2.JOB_STATE_CANCELLED


def test_acks_for_unknown_jobs_are_not_found_and_late_ones_change_nothing(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    with pytest.raises(grpc.RpcError) as error:
        stub.AckCommand(node_service_pb2.AckCommandRequest(node_id="n1", job_id="job-nope", generation=1), timeout=5)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as error:
        stub.AckCommand(node_service_pb2.AckCommandRequest(node_id="n1", generation=1), timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "job_id" in (error.value.details() or "")
    with control_plane.client() as client:
        before = client.get(job.job_id)
    stub.AckCommand(
        node_service_pb2.AckCommandRequest(node_id="n1", job_id=job.job_id, generation=7, ok=True), timeout=5
    )
    with control_plane.client() as client:
        assert client.get(job.job_id).version == before.version


def test_a_missed_start_deadline_is_a_failure_of_the_transition(control_plane: ControlPlane, clock: FakeClock) -> None:
    job, _ = scheduled_job(control_plane)
    for worker in job.workers:
        control_plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id=worker.node_id), timeout=5)
    clock.advance(Settings().ack_timeout_s + 1)
    for node_id in ("n1", "n2"):
        control_plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id=node_id), timeout=5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        after = client.get(job.job_id)
        incidents = client.incidents(job.job_id)
    assert incidents and incidents[0].kind == common_pb2.FAILURE_KIND_TRANSITION_TIMEOUT
    assert after.remedies[0].remedy == common_pb2.REMEDY_RESTART
    assert after.assignment.generation == 2


def test_a_killed_redis_comes_back_with_everything(tmp_path: Path, clock: FakeClock) -> None:
    local = redisutil.LocalRedis(tmp_path / "redis").start()
    planner = start_planner()
    try:
        client = redisutil.connect(local.url)
        coordinator = Coordinator(RedisStore(client), PlannerClient([planner.address]), Settings(), clock=clock)
        coordinator.register_node("n1", "127.0.0.1:1", 2, "")
        spec = jobs_spec()
        job = coordinator.submit(spec)
        coordinator.reconcile_once()
        scheduled = coordinator.get(job.job_id)
        coordinator.report_worker_exit(
            node_service_pb2.ReportWorkerExitRequest(
                node_id="n1", job_id=job.job_id, generation=1, rank=0, exit_code=1, error="boom"
            )
        )
        clock.advance(0.5)  # the hold for the peers' reports
        coordinator.reconcile_once()
        before = coordinator.get(job.job_id)
        incidents_before = coordinator.list_incidents(job.job_id)
        commands_before = coordinator.store.read_commands("n1", "0-0", block_ms=0)
        assert before.state == common_pb2.JOB_STATE_RECOVERING and scheduled.assignment.generation == 1
        client.close()
        local.kill()
        local = redisutil.LocalRedis(tmp_path / "redis", port=local.port).start()
        client = redisutil.connect(local.url)
        restarted = Coordinator(RedisStore(client), PlannerClient([planner.address]), Settings(), clock=clock)
        after = restarted.get(job.job_id)
        assert after == before
        assert restarted.list_incidents(job.job_id) == incidents_before
        assert restarted.store.read_commands("n1", "0-0", block_ms=0) == commands_before
        assert [n.node_id for n in restarted.store.list_nodes()] == ["n1"]
        client.close()
    finally:
        local.stop()
        planner.stop()


def jobs_spec() -> common_pb2.JobSpec:
    from tests.integration.test_job_api import tiny_spec

    return tiny_spec(data=2)


def test_a_sev1_health_report_isolates_the_node_and_moves_its_jobs(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane, data=2)
    (worker,) = job.assignment.workers
    other = "n1" if worker.node_id == "n2" else "n2"
    report = common_pb2.FailureReport(
        node_id=worker.node_id,
        kind=common_pb2.FAILURE_KIND_DISK_FULL,
        source=common_pb2.DETECTION_SOURCE_NODE_HEALTH,
        message="disk 99% full",
    )
    control_plane.node_stub().ReportFailure(
        node_service_pb2.ReportFailureRequest(node_id=worker.node_id, report=report), timeout=5
    )
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        nodes = {n.node_id: n.state for n in client.nodes()}
        moved = client.get(job.job_id)
        (incident,) = client.incidents(job.job_id)
    assert nodes == {worker.node_id: common_pb2.NODE_STATE_ISOLATED, other: common_pb2.NODE_STATE_READY}
    assert incident.kind == common_pb2.FAILURE_KIND_DISK_FULL and incident.remedy == common_pb2.REMEDY_RECONFIGURE
    assert [w.node_id for w in moved.assignment.workers] == [other]
    assert moved.state == common_pb2.JOB_STATE_RECOVERING and moved.assignment.generation == 2
    # The volume cleaned outside the agent: an admin's uncordon returns the node.
    with control_plane.client() as client:
        back = client.uncordon(worker.node_id)
        assert back.state == common_pb2.NODE_STATE_READY
        assert {n.node_id: n.state for n in client.nodes()}[worker.node_id] == common_pb2.NODE_STATE_READY


def reset_report(job: common_pb2.Job, rank: int, node_id: str, at: float) -> node_service_pb2.ReportFailureRequest:
    report = common_pb2.FailureReport(
        job_id=job.job_id,
        generation=job.assignment.generation,
        rank=rank,
        node_id=node_id,
        kind=common_pb2.FAILURE_KIND_CONNECTION_RESET,
        source=common_pb2.DETECTION_SOURCE_EXCEPTION,
        message="Connection reset by peer",
    )
    report.first_seen.FromNanoseconds(int(at * 1e9))
    return node_service_pb2.ReportFailureRequest(node_id=node_id, report=report)


def test_a_network_error_waits_briefly_for_the_failure_that_explains_it(
    control_plane: ControlPlane, clock: FakeClock
) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    survivor = job.assignment.workers[1]
    stub.ReportFailure(reset_report(job, survivor.ranks[0], survivor.node_id, clock()), timeout=5)
    with control_plane.client() as client:
        assert not client.get(job.job_id).remedies  # held: the dead rank's exit may be on its way
    report_exit(control_plane, exit_report(job, 1, code=-9))
    with control_plane.client() as client:
        after = client.get(job.job_id)
    assert [a.remedy for a in after.remedies] == [common_pb2.REMEDY_RESTART]


def test_a_network_error_alone_is_reattempted_after_the_hold(control_plane: ControlPlane, clock: FakeClock) -> None:
    job, cursors = scheduled_job(control_plane)
    worker = job.assignment.workers[0]
    control_plane.node_stub().ReportFailure(reset_report(job, worker.ranks[0], worker.node_id, clock()), timeout=5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert not client.get(job.job_id).remedies
    clock.advance(0.5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        after = client.get(job.job_id)
    assert [a.remedy for a in after.remedies] == [common_pb2.REMEDY_REATTEMPT]
    assert after.state == common_pb2.JOB_STATE_RECOVERING
    # The same ranks on the same nodes form a new process group: a new generation.
    assert after.assignment.generation == 2 and after.remedies[0].generation == 2
    assert decide.slots_by_node(after) == decide.slots_by_node(job)
    _start, command = commands_for(control_plane, worker.node_id, cursors[worker.node_id], 2)
    assert dict(command.reform.rank_map) == {r: r for w in job.assignment.workers for r in w.ranks}


@pytest.mark.parametrize("peers_report", [True, False])
def test_a_dead_rank_is_restarted_alone_and_its_peers_keep_their_state(
    control_plane: ControlPlane, clock: FakeClock, peers_report: bool
) -> None:
    """Whether or not the peers reported their broken collective before the hold ended: a
    silent peer's collective breaks as the others leave the old group, so it is kept too."""
    job, cursors = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    victim_node = job.assignment.workers[1]
    victim = victim_node.ranks[0]
    for worker in job.assignment.workers:
        for rank in worker.ranks:
            if rank != victim and peers_report:
                stub.ReportFailure(reset_report(job, rank, worker.node_id, clock()), timeout=5)
    request = exit_report(job, 1, code=1)
    request.node_id, request.rank = victim_node.node_id, victim
    stub.ReportWorkerExit(request, timeout=5)
    if not peers_report:  # the exit alone waits out the hold for its peers' reports
        clock.advance(0.5)
        control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        after = client.get(job.job_id)
    assert [a.remedy for a in after.remedies] == [common_pb2.REMEDY_RESTART]
    assert after.assignment.generation == 2 and after.state == common_pb2.JOB_STATE_RECOVERING
    survivors = {r: r for w in job.assignment.workers for r in w.ranks if r != victim}
    for worker in job.assignment.workers:
        _start, reform = commands_for(control_plane, worker.node_id, cursors[worker.node_id], 2)
        assert reform.reform.from_generation == 1 and reform.reform.assignment.generation == 2
        assert dict(reform.reform.rank_map) == survivors
