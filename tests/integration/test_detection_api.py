"""Failure reports and fault injection through the coordinator's APIs, real Redis."""

from __future__ import annotations

import math

import grpc
import pytest

from tests.integration.conftest import ControlPlane
from tests.integration.test_job_api import register, snapshot, tiny_spec
from tests.integration.test_scheduling import commands_for, scheduled_job
from unicron.client import ClientError
from unicron.v1 import common_pb2, node_service_pb2

pytestmark = pytest.mark.integration


def report(
    job: common_pb2.Job,
    rank: int,
    kind: common_pb2.FailureKind,
    source: common_pb2.DetectionSource,
    node: str = "n1",
) -> node_service_pb2.ReportFailureRequest:
    out = common_pb2.FailureReport(
        job_id=job.job_id, generation=job.assignment.generation, rank=rank, kind=kind, source=source, message="boom"
    )
    out.first_seen.GetCurrentTime()
    return node_service_pb2.ReportFailureRequest(node_id=node, report=out)


def test_reports_from_many_ranks_are_one_incident_with_one_remedy(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    stub.ReportFailure(
        report(job, 1, common_pb2.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS, common_pb2.DETECTION_SOURCE_EXCEPTION), timeout=5
    )
    for rank, node in ((0, "n1"), (2, "n2"), (3, "n2")):
        stub.ReportFailure(
            report(job, rank, common_pb2.FAILURE_KIND_CONNECTION_RESET, common_pb2.DETECTION_SOURCE_EXCEPTION, node),
            timeout=5,
        )
    with control_plane.client() as client:
        (incident,) = client.incidents(job.job_id)
        restarted = client.get(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS
    assert incident.severity == common_pb2.SEVERITY_SEV2
    assert sorted(r.rank for r in incident.reports) == [0, 1, 2, 3]
    assert all(r.HasField("received") for r in incident.reports)
    assert incident.remedy == common_pb2.REMEDY_RESTART
    assert incident.action_taken.startswith("restart: illegal_memory_access")
    assert restarted.state == common_pb2.JOB_STATE_RECOVERING and restarted.assignment.generation == 2
    assert "illegal memory access" in restarted.reason and "rank 1" in restarted.reason
    assert [a.remedy for a in restarted.remedies] == [common_pb2.REMEDY_RESTART]


@pytest.mark.parametrize(
    ("mutate", "code", "field"),
    [
        (lambda r: setattr(r.report, "kind", common_pb2.FAILURE_KIND_UNSPECIFIED), "INVALID_ARGUMENT", "report.kind"),
        (lambda r: setattr(r.report, "kind", 999), "INVALID_ARGUMENT", "report.kind"),
        (lambda r: setattr(r.report, "node_id", "n2"), "INVALID_ARGUMENT", "report.node_id"),
        (lambda r: setattr(r, "node_id", "ghost"), "NOT_FOUND", "node"),
        (lambda r: setattr(r.report, "job_id", "job-nope"), "NOT_FOUND", "no job"),
        (lambda r: r.ClearField("report"), "INVALID_ARGUMENT", "report"),
    ],
)
def test_bad_failure_reports_change_nothing(control_plane: ControlPlane, mutate, code: str, field: str) -> None:  # type: ignore[no-untyped-def]
    job, _ = scheduled_job(control_plane)
    request = report(job, 0, common_pb2.FAILURE_KIND_PROCESS_EXIT, common_pb2.DETECTION_SOURCE_PROCESS_SUPERVISION)
    mutate(request)
    before = snapshot(control_plane.redis)
    with pytest.raises(grpc.RpcError) as error:
        control_plane.node_stub().ReportFailure(request, timeout=5)
    assert error.value.code().name == code
    assert (error.value.details() or "").startswith(field)
    assert snapshot(control_plane.redis) == before


def test_a_stale_report_opens_no_incident_and_one_from_the_future_is_refused(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    request = report(job, 0, common_pb2.FAILURE_KIND_PROCESS_EXIT, common_pb2.DETECTION_SOURCE_PROCESS_SUPERVISION)
    request.report.generation = 0  # older than the job's: stale, accepted, changes nothing
    control_plane.node_stub().ReportFailure(request, timeout=5)
    request.report.generation = 7  # a generation the coordinator never made
    before = snapshot(control_plane.redis)
    with pytest.raises(grpc.RpcError) as error:
        control_plane.node_stub().ReportFailure(request, timeout=5)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith("report.generation")
    assert snapshot(control_plane.redis) == before
    with control_plane.client() as client:
        assert client.incidents() == []
        assert client.get(job.job_id).state == common_pb2.JOB_STATE_SCHEDULED


@pytest.mark.parametrize(
    ("field", "value"), [("seconds", -1.0), ("seconds", math.nan), ("flops", math.inf), ("iteration", 0)]
)
def test_bad_progress_is_rejected_whole(control_plane: ControlPlane, field: str, value: float) -> None:
    job, _ = scheduled_job(control_plane)
    good = node_service_pb2.IterationReport(job_id=job.job_id, generation=1, rank=0, iteration=1, seconds=1.0)
    bad = node_service_pb2.IterationReport()
    bad.CopyFrom(good)
    bad.iteration = 2
    setattr(bad, field, value)
    before = snapshot(control_plane.redis)
    with pytest.raises(grpc.RpcError) as error:
        control_plane.node_stub().ReportProgress(
            node_service_pb2.ReportProgressRequest(node_id="n1", reports=[good, bad]), timeout=5
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith(f"reports[1].{field}")
    assert snapshot(control_plane.redis) == before


def test_a_flood_of_reports_is_rate_limited(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)
    stub = control_plane.node_stub()
    codes: list[str] = []
    # Until refused (at most 5,000 calls): the limit is a rate, and on a loaded machine a
    # fixed count of calls can take long enough for the bucket to refill.
    for i in range(5000):
        if codes and codes[-1] == "RESOURCE_EXHAUSTED":
            break
        request = node_service_pb2.ReportProgressRequest(
            node_id="n2",
            reports=[
                node_service_pb2.IterationReport(job_id=job.job_id, generation=1, rank=2, iteration=i + 1, seconds=1)
            ],
        )
        try:
            stub.ReportProgress(request, timeout=5)
            codes.append("OK")
        except grpc.RpcError as exc:
            codes.append(exc.code().name)
    assert "RESOURCE_EXHAUSTED" in codes and codes[0] == "OK"
    # Another node is not starved by n2's flood.
    stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id="n1"), timeout=5)
    stub.ReportProgress(node_service_pb2.ReportProgressRequest(node_id="n1", reports=[]), timeout=5)


def test_fault_injection_needs_an_enabled_agent(control_plane: ControlPlane) -> None:
    job, cursors = scheduled_job(control_plane)
    fault = common_pb2.Fault(kind=common_pb2.FAULT_KIND_CRASH, rank=1)
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.inject(job.job_id, fault)
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION and "disabled" in str(error.value)
    # The node registered again with injection on accepts it, through its command stream.
    rank_node = next(w.node_id for w in job.assignment.workers if 1 in w.ranks)
    control_plane.node_stub().RegisterNode(
        node_service_pb2.RegisterNodeRequest(
            node_id=rank_node, address="127.0.0.1:7002", slots=2, fault_injection=True
        ),
        timeout=5,
    )
    with control_plane.client() as client:
        assert client.inject(job.job_id, fault) == rank_node
    _, inject = commands_for(control_plane, rank_node, cursors[rank_node], 2)
    assert inject.inject_fault.fault == fault and inject.inject_fault.generation == 1


@pytest.mark.parametrize(
    ("fault", "code"),
    [
        (common_pb2.Fault(), "INVALID_ARGUMENT"),
        (common_pb2.Fault(kind=common_pb2.FAULT_KIND_EXCEPTION), "INVALID_ARGUMENT"),
        (common_pb2.Fault(kind=common_pb2.FAULT_KIND_SLOW), "INVALID_ARGUMENT"),
        (common_pb2.Fault(kind=common_pb2.FAULT_KIND_CRASH, rank=99), "INVALID_ARGUMENT"),
    ],
)
def test_bad_faults_are_rejected(control_plane: ControlPlane, fault: common_pb2.Fault, code: str) -> None:
    job, _ = scheduled_job(control_plane)
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.inject(job.job_id, fault)
    assert error.value.code.name == code


def test_faults_only_go_to_running_jobs(control_plane: ControlPlane) -> None:
    register(control_plane, "n1")
    with control_plane.client() as client:
        job = client.submit(tiny_spec())  # the reconcile loop is not running: stays pending
    with control_plane.client() as client, pytest.raises(ClientError) as error:
        client.inject(job.job_id, common_pb2.Fault(kind=common_pb2.FAULT_KIND_CRASH))
    assert error.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_a_slow_rank_on_another_node_is_a_straggler_seen_by_the_coordinator(control_plane: ControlPlane) -> None:
    job, _ = scheduled_job(control_plane)  # ranks 0,1 on one node, 2,3 on the other
    slow = 3
    slow_node = next(w.node_id for w in job.assignment.workers if slow in w.ranks)
    stub = control_plane.node_stub()
    for iteration in range(1, 16):
        control_plane.clock.advance(1.0)  # type: ignore[attr-defined]
        for worker in job.assignment.workers:
            stub.ReportProgress(
                node_service_pb2.ReportProgressRequest(
                    node_id=worker.node_id,
                    reports=[
                        node_service_pb2.IterationReport(
                            job_id=job.job_id, generation=1, rank=rank, iteration=iteration, seconds=1.0,
                            compute_seconds=0.8 if rank == slow else 0.4,
                        )
                        for rank in worker.ranks
                    ],
                ),
                timeout=5,
            )  # fmt: skip
    with control_plane.client() as client:
        (incident,) = client.incidents(job.job_id)
        running = client.get(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_STRAGGLER
    assert incident.reports[0].rank == slow and incident.node_id == slow_node
    assert incident.reports[0].statistics["score"] == pytest.approx(2.0)
    assert running.state == common_pb2.JOB_STATE_RUNNING  # a straggler is reported, not fatal
