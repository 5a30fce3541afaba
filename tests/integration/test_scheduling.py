"""The agent-facing API and the reconcile loop against a real Redis and two real planner
replicas: placement, commands, progress, completion, failures, lost nodes, failover."""

from __future__ import annotations

import dataclasses
import queue
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from services.coordinator.planner_client import PlannerClient
from tests.integration.conftest import ControlPlane, FakeClock
from tests.integration.test_job_api import register, tiny_spec
from unicron.redisutil import free_port
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


def _report(stub: Any, job: common_pb2.Job, iteration: int, loss: float) -> None:
    """An iteration of every rank, each reported by the node it runs on (only that node may)."""
    for worker in job.assignment.workers:
        reports = [
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
            for rank in worker.ranks
        ]
        stub.ReportProgress(node_service_pb2.ReportProgressRequest(node_id=worker.node_id, reports=reports), timeout=5)


def test_a_clean_exit_before_the_last_iteration_fails_the_job_once(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    _report(stub, job, 1, 4.0)
    worker = job.assignment.workers[0]
    stub.ReportWorkerExit(
        node_service_pb2.ReportWorkerExitRequest(
            node_id=worker.node_id, job_id=job.job_id, generation=1, rank=worker.ranks[0], exit_code=0, last_iteration=1
        ),
        timeout=5,
    )
    with control_plane.client() as client:
        deadline = time.monotonic() + 10
        while (done := client.get(job.job_id)).state != common_pb2.JOB_STATE_FAILED and time.monotonic() < deadline:
            time.sleep(0.05)
    assert done.state == common_pb2.JOB_STATE_FAILED, done.reason
    assert "exited 0 after iteration 1 of 3, before its last" in done.reason
    assert not done.remedies  # failed once: nothing was restarted


def test_progress_then_clean_exits_succeed_the_job(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    for iteration, loss in ((1, 4.0), (2, 3.5)):
        _report(stub, job, iteration, loss)
    with control_plane.client() as client:
        running = client.get(job.job_id)
        assert running.state == common_pb2.JOB_STATE_RUNNING
        assert running.progress.iteration == 2 and running.progress.loss == pytest.approx(3.5)
        assert running.progress.tokens == 128
        assert running.progress.flops_per_second == pytest.approx(2e9)
        _report(stub, job, 3, 3.0)  # the last of the spec's 3 iterations
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


def exit_report(job: common_pb2.Job, generation: int, code: int = 1) -> node_service_pb2.ReportWorkerExitRequest:
    failed = job.assignment.workers[0]
    return node_service_pb2.ReportWorkerExitRequest(
        node_id=failed.node_id,
        job_id=job.job_id,
        generation=generation,
        rank=failed.ranks[0],
        exit_code=code,
        stderr_tail="Traceback...\nRuntimeError: boom\n",
    )


def report_exit(plane: ControlPlane, request: node_service_pb2.ReportWorkerExitRequest) -> None:
    """Reports a rank's exit and lets the coordinator's short hold for its peers' reports
    pass (they never come here), so the ladder decides."""
    plane.node_stub().ReportWorkerExit(request, timeout=5)
    assert isinstance(plane.clock, FakeClock)
    plane.clock.advance(0.5)
    plane.coordinator.reconcile_once()


def report_iteration(
    plane: ControlPlane, job: common_pb2.Job, generation: int, iteration: int, **extra: object
) -> None:
    node_id = job.assignment.workers[0].node_id
    plane.node_stub().ReportProgress(
        node_service_pb2.ReportProgressRequest(
            node_id=node_id,
            reports=[
                node_service_pb2.IterationReport(
                    job_id=job.job_id,
                    generation=generation,
                    rank=0,
                    iteration=iteration,
                    loss=3.0,
                    seconds=0.5,
                    tokens=64,
                    flops=1e9,
                    **extra,  # type: ignore[arg-type]
                )
            ],
        ),
        timeout=5,
    )


def test_a_rank_that_dies_after_its_last_iteration_does_not_restart_the_job(control_plane: ControlPlane) -> None:
    """Killed while it tore down, after its last iteration: nothing is left to redo. (A restart
    here waited on the peers, which had finished for good, until the recovery timeout.)"""
    job, _ = scheduled_job(control_plane, data=2)
    (worker,) = job.assignment.workers
    stub = control_plane.node_stub()
    last = job.spec.training.iterations

    def exit_of(rank: int, last_iteration: int, **how: int) -> None:
        stub.ReportWorkerExit(
            node_service_pb2.ReportWorkerExitRequest(
                node_id=worker.node_id,
                job_id=job.job_id,
                generation=1,
                rank=rank,
                last_iteration=last_iteration,
                **how,  # type: ignore[arg-type]
            ),
            timeout=5,
        )

    exit_of(1, last, signal=9)
    exit_of(0, last, exit_code=0)
    with control_plane.client() as client:
        done = client.get(job.job_id)
        assert done.state == common_pb2.JOB_STATE_SUCCEEDED, done.reason
        assert client.incidents(job.job_id) == []
        notes = [e.message for e in client.watch(job.job_id, after_event_id="0-0")]
    assert f"rank 1 ended with signal 9 after its last iteration {last}" in notes
    # One iteration short, the same death is a failure with a remedy.
    with control_plane.client() as client:
        job = client.submit(tiny_spec("short", data=2))
        control_plane.coordinator.reconcile_once()
        job = client.get(job.job_id)
    (worker,) = job.assignment.workers
    exit_of(1, last - 1, signal=9)
    with control_plane.client() as client:
        (incident,) = client.incidents(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_PROCESS_EXIT


def test_crashed_rank_restarts_the_job_in_place_and_it_resumes(control_plane: ControlPlane, clock: FakeClock) -> None:
    # The classic restart (stop every rank, start them all): reforms off. With them, the
    # crashed rank alone starts again (test_healing_edges.py).
    coordinator = control_plane.coordinator
    coordinator.settings = dataclasses.replace(coordinator.settings, reform_restarts=False)
    job, cursors = scheduled_job(control_plane)
    report_iteration(control_plane, job, 1, 1)
    report_iteration(control_plane, job, 1, 2)
    report_exit(control_plane, exit_report(job, 1))
    with control_plane.client() as client:
        after = client.get(job.job_id)
        (incident,) = client.incidents(job.job_id)
    assert after.state == common_pb2.JOB_STATE_RECOVERING
    assert after.assignment.generation == 2
    assert {w.node_id for w in after.assignment.workers} == {w.node_id for w in job.assignment.workers}
    (attempt,) = after.remedies
    assert attempt.remedy == common_pb2.REMEDY_RESTART and attempt.generation == 2
    assert attempt.incident_id == incident.incident_id
    assert incident.remedy == common_pb2.REMEDY_RESTART and incident.HasField("remedy_started")
    # Each node gets: start gen 1, stop gen 1, start gen 2.
    for worker in job.assignment.workers:
        _start, stop, restart = commands_for(control_plane, worker.node_id, cursors[worker.node_id], 3)
        assert stop.stop_workers.generation == 1
        assert restart.start_workers.assignment.generation == 2
    states = {(w.node_id, w.generation): w.state for w in after.workers}
    assert set(states.values()) == {common_pb2.WORKER_STATE_STOPPING, common_pb2.WORKER_STATE_STARTING}
    # Acks: stops and starts.
    stub = control_plane.node_stub()
    for worker in job.assignment.workers:
        for generation in (1, 2):
            stub.AckCommand(
                node_service_pb2.AckCommandRequest(
                    node_id=worker.node_id, job_id=job.job_id, generation=generation, ok=True
                ),
                timeout=5,
            )
    # A duplicate ack changes nothing.
    stub.AckCommand(
        node_service_pb2.AckCommandRequest(node_id="n1", job_id=job.job_id, generation=2, ok=True), timeout=5
    )
    with control_plane.client() as client:
        acked = client.get(job.job_id)
    assert [w.state for w in acked.workers] == [common_pb2.WORKER_STATE_LAUNCHED] * 2
    # Old-generation exits (the stop) are not new failures.
    stub.ReportWorkerExit(exit_report(job, 1, code=143), timeout=5)
    clock.advance(5.0)
    report_iteration(control_plane, acked, 2, 1, state_source="checkpoint", restored_iteration=0)
    with control_plane.client() as client:
        resumed = client.get(job.job_id)
        (incident,) = client.incidents(job.job_id)
    assert resumed.state == common_pb2.JOB_STATE_RUNNING
    assert "resumed after restart" in resumed.reason and "2 iterations recomputed" in resumed.reason
    assert resumed.remedies[0].HasField("resumed")
    assert resumed.progress.iteration == 1
    assert incident.HasField("resumed") and incident.cost.transition_seconds == pytest.approx(
        5.5, abs=0.1
    )  # hold + 5 s
    assert incident.cost.healthy_waf == pytest.approx(2e9)


def test_a_job_that_keeps_failing_climbs_the_ladder_then_fails(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    remedies = []
    for _ in range(4):
        with control_plane.client() as client:
            current = client.get(job.job_id)
        if current.state == common_pb2.JOB_STATE_FAILED:
            break
        report_exit(control_plane, exit_report(current, current.assignment.generation))
        with control_plane.client() as client:
            after = client.get(job.job_id)
        remedies = [a.remedy for a in after.remedies]
    assert remedies[:3] == [common_pb2.REMEDY_RESTART, common_pb2.REMEDY_RESTART, common_pb2.REMEDY_RECONFIGURE]
    with control_plane.client() as client:
        nodes = {n.node_id: n.state for n in client.nodes()}
    assert common_pb2.NODE_STATE_ISOLATED in nodes.values()


def test_stale_generation_reports_are_ignored_and_unmade_ones_refused(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stale = node_service_pb2.ReportWorkerExitRequest(node_id="n1", job_id=job.job_id, generation=0, rank=0, exit_code=1)
    control_plane.node_stub().ReportWorkerExit(stale, timeout=5)
    unmade = node_service_pb2.ReportWorkerExitRequest(node_id="n1", job_id=job.job_id, generation=99, rank=0)
    with pytest.raises(grpc.RpcError) as error:
        control_plane.node_stub().ReportWorkerExit(unmade, timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "no generation 99" in (
        error.value.details() or ""
    )
    with control_plane.client() as client:
        assert client.get(job.job_id).state == common_pb2.JOB_STATE_SCHEDULED


def test_silent_node_is_lost_and_its_job_is_replanned(control_plane: ControlPlane, clock: FakeClock) -> None:
    job, _ = scheduled_job(control_plane, data=2)
    stub = control_plane.node_stub()
    lost = job.assignment.workers[0].node_id
    alive = "n1" if lost == "n2" else "n2"
    for _ in range(4):  # the job's node silent for 4 s > 3 s timeout; the other beats every second
        clock.advance(1.0)
        assert stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id=alive), timeout=5).known
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        states = {n.node_id: n.state for n in client.nodes()}
        after = client.get(job.job_id)
        (incident,) = client.incidents(job.job_id)
    assert states == {alive: common_pb2.NODE_STATE_READY, lost: common_pb2.NODE_STATE_LOST}
    # When each happened, by the coordinator's clock: the node's loss, the job's new placement.
    with control_plane.client() as client:
        since = {n.node_id: n.state_since.ToNanoseconds() / 1e9 for n in client.nodes()}
    assert since == {alive: clock.now - 4.0, lost: clock.now}
    assert after.assignment.assigned.ToNanoseconds() / 1e9 == clock.now
    assert after.state == common_pb2.JOB_STATE_RECOVERING
    assert [w.node_id for w in after.assignment.workers] == [alive]
    assert after.remedies[0].remedy == common_pb2.REMEDY_RECONFIGURE
    assert after.remedies[0].generation == after.assignment.generation == 2
    assert "node unreachable" in incident.summary and incident.remedy == common_pb2.REMEDY_RECONFIGURE
    # Registering again brings it back.
    register(control_plane, lost)
    with control_plane.client() as client:
        assert all(n.state == common_pb2.NODE_STATE_READY for n in client.nodes())


def test_a_job_that_no_longer_fits_waits_paused_and_the_others_are_still_planned(
    control_plane: ControlPlane, clock: FakeClock
) -> None:
    """The job needs both nodes and one is lost: no plan keeps it running. It waits, paused,
    for capacity (before, the re-plan kept failing and the job sat in recovery for good), and
    starts again once the node is back."""
    job, _ = scheduled_job(control_plane, data=4)
    stub = control_plane.node_stub()
    for _ in range(4):  # n2 silent for 4 s > 3 s timeout
        clock.advance(1.0)
        stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        paused = client.get(job.job_id)
        small = client.submit(tiny_spec("small", data=2))
    assert paused.state == common_pb2.JOB_STATE_PENDING
    assert "needs at least 4 slots" in paused.reason, paused.reason
    assert paused.remedies[0].remedy == common_pb2.REMEDY_RECONFIGURE
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert client.get(small.job_id).state == common_pb2.JOB_STATE_SCHEDULED  # planning goes on
        # What it waits for, in terms its user can act on (n2 lost, n1 taken by "small").
        waiting = client.get(job.job_id).reason
        assert waiting == "waiting for 4 free slots (tensor 1 x pipeline 1 x data 4): 0 free now", waiting
        client.cancel(small.job_id)
    register(control_plane, "n2")
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        again = client.get(job.job_id)
    assert again.state == common_pb2.JOB_STATE_SCHEDULED and again.assignment.world_size == 4


def test_a_job_moved_off_a_lost_node_does_not_land_on_one_about_to_be_lost(
    control_plane: ControlPlane, clock: FakeClock
) -> None:
    """A rack vanishes: its nodes' last heartbeats lie a second apart, so they are declared
    lost over a second. The job moved off the first must not be moved onto the next (three
    moves in a row are, by the ladder, a job to give up on)."""
    cursors = {node: register(control_plane, node).last_command_id for node in ("n1", "n2", "n3", "n4")}
    assert cursors
    with control_plane.client() as client:
        job = client.submit(tiny_spec(data=2))
    control_plane.coordinator.reconcile_once()
    stub = control_plane.node_stub()
    with control_plane.client() as client:
        placed = client.get(job.job_id)
    (first,) = {w.node_id for w in placed.assignment.workers}
    others = sorted({"n1", "n2", "n3", "n4"} - {first})
    going, staying = others[0], others[1:]
    for step in range(1, 9):  # 4 s: the job's node silent all along (lost), `going` for the last 2 (quiet)
        clock.advance(0.5)
        for node in staying + ([going] if step <= 4 else []):
            stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id=node), timeout=5)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        moved = client.get(job.job_id)
        states = {n.node_id: n.state for n in client.nodes()}
    assert states[first] == common_pb2.NODE_STATE_LOST and states[going] == common_pb2.NODE_STATE_READY
    assert moved.assignment.generation == 2
    assert {w.node_id for w in moved.assignment.workers} <= set(staying)


def test_a_reconfiguration_is_carried_out_when_the_lost_node_is_back_before_the_replan(
    control_plane: ControlPlane, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression (chaos test): the node's agent restarted before the re-plan, so no node was
    unavailable any more and the plan kept the job where it was: RECOVERING for good, its
    ranks on that node dead with the old agent."""
    job, _ = scheduled_job(control_plane, data=2)
    stub = control_plane.node_stub()
    lost = job.assignment.workers[0].node_id
    alive = "n1" if lost == "n2" else "n2"
    # The planners out of reach for one step: a real client to a port nothing listens on.
    monkeypatch.setattr(control_plane.coordinator, "planner", PlannerClient([f"127.0.0.1:{free_port()}"], timeout_s=2))
    clock.advance(2.0)
    assert stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id=alive), timeout=5).known
    clock.advance(2.0)
    control_plane.coordinator.reconcile_once()  # lost, RECONFIGURE chosen, no plan yet
    register(control_plane, lost)  # the agent is back
    monkeypatch.undo()
    clock.advance(2.0)  # past the re-plan's backoff
    assert stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id=alive), timeout=5).known
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        after = client.get(job.job_id)
    assert after.remedies[0].remedy == common_pb2.REMEDY_RECONFIGURE
    assert after.remedies[0].generation == after.assignment.generation == 2
    assert after.state == common_pb2.JOB_STATE_RECOVERING
    assert all(w.state == common_pb2.WORKER_STATE_STARTING for w in after.workers if w.generation == 2)


def test_a_node_registered_again_is_not_judged_by_its_old_heartbeat(
    control_plane: ControlPlane, clock: FakeClock
) -> None:
    """Regression: the coordinator's memory of a node's last heartbeat outranked the newer
    registration, so a node whose agent came back was declared lost again at once."""
    register(control_plane, "n1")
    assert control_plane.node_stub().Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5).known
    clock.advance(4.0)
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert [n.state for n in client.nodes()] == [common_pb2.NODE_STATE_LOST]
    register(control_plane, "n1")
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert [n.state for n in client.nodes()] == [common_pb2.NODE_STATE_READY]


def test_a_lost_node_that_heartbeats_is_asked_to_register_again(control_plane: ControlPlane, clock: FakeClock) -> None:
    """A node declared LOST while its agent lives on (a partition, a late heartbeat racing
    the verdict) comes back by registering again, not by staying out of every plan."""
    register(control_plane, "n1")
    stub = control_plane.node_stub()
    clock.advance(4.0)
    control_plane.coordinator.reconcile_once()
    assert not stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5).known
    register(control_plane, "n1")
    assert stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5).known
    control_plane.coordinator.reconcile_once()
    with control_plane.client() as client:
        assert [n.state for n in client.nodes()] == [common_pb2.NODE_STATE_READY]


def test_heartbeats_on_one_stream(control_plane: ControlPlane, clock: FakeClock) -> None:
    """What agents use: each message keeps its node alive, and each answer says whether the
    node must register again (unknown, or declared LOST), as the unary Heartbeat does."""
    register(control_plane, "n1")
    beats: queue.Queue[node_service_pb2.StreamHeartbeatsRequest | None] = queue.Queue()
    stream = control_plane.node_stub().StreamHeartbeats(iter(beats.get, None), timeout=10)

    def beat(node_id: str) -> bool:
        beats.put(node_service_pb2.StreamHeartbeatsRequest(node_id=node_id))
        return next(stream).known

    assert beat("n1")
    clock.advance(2.5)
    assert beat("n1")
    clock.advance(2.5)  # 2.5 s since the last beat: within the timeout
    control_plane.coordinator.reconcile_once()
    assert beat("ghost") is False
    clock.advance(4.0)
    control_plane.coordinator.reconcile_once()  # silent for 4 s: lost
    assert beat("n1") is False
    beats.put(None)
    assert list(stream) == []
    with control_plane.client() as client:
        assert [n.state for n in client.nodes()] == [common_pb2.NODE_STATE_LOST]


def test_a_bad_heartbeat_ends_the_stream_with_invalid_argument(control_plane: ControlPlane) -> None:
    requests = [node_service_pb2.StreamHeartbeatsRequest(node_id="")]
    with pytest.raises(grpc.RpcError) as error:
        list(control_plane.node_stub().StreamHeartbeats(iter(requests), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith("node_id")


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


def test_a_second_host_for_a_node_or_a_taken_address_is_already_exists(control_plane: ControlPlane) -> None:
    stub = control_plane.node_stub()
    stub.RegisterNode(node_service_pb2.RegisterNodeRequest(node_id="n1", address="10.9.9.1:7000", slots=1), timeout=5)
    stored = control_plane.redis.get(b"unicron:node:n1")
    for request in (
        node_service_pb2.RegisterNodeRequest(node_id="n1", address="10.9.9.2:7000", slots=1),
        node_service_pb2.RegisterNodeRequest(node_id="n2", address="10.9.9.1:7001", slots=1),
    ):
        with pytest.raises(grpc.RpcError) as error:
            stub.RegisterNode(request, timeout=5)
        assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS, error.value.details()
    assert control_plane.redis.get(b"unicron:node:n1") == stored
    assert control_plane.redis.get(b"unicron:node:n2") is None


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
