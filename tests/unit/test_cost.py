"""Failure cost and cluster efficiency (services/coordinator/cost.py), and the metrics
built on them (services/coordinator/metrics.py)."""

from __future__ import annotations

from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from services.coordinator import cost
from services.coordinator.metrics import CoordinatorMetrics
from unicron.v1 import common_pb2 as pb
from unicron.v1 import job_service_pb2

NOW = 1_000_000.0
GF = 1e9


def make_job(
    job_id: str = "j1",
    state: int = pb.JOB_STATE_RUNNING,
    weight: float = 2.0,
    flops: float = 1.5 * GF,
    ranks: tuple[int, ...] = (2, 2),
    changed: float = NOW - 100,
) -> pb.Job:
    job = pb.Job(job_id=job_id, state=state)  # type: ignore[arg-type]
    job.spec.name = f"name-{job_id}"
    job.spec.weight = weight
    job.progress.flops_per_second = flops
    rank = 0
    for node, count in enumerate(ranks):
        job.assignment.workers.add(node_id=f"n{node}", ranks=range(rank, rank + count))
        rank += count
    job.history.add(state=pb.JOB_STATE_SCHEDULED).time.FromNanoseconds(int((changed - 10) * 1e9))
    job.history.add(state=state).time.FromNanoseconds(int(changed * 1e9))
    return job


def make_incident(
    incident_id: str = "i1",
    job_id: str = "j1",
    first_seen: float = NOW - 60,
    detected: float = NOW - 58,
    **fields: Any,
) -> pb.Incident:
    incident = pb.Incident(incident_id=incident_id, job_id=job_id, kind=pb.FAILURE_KIND_PROCESS_EXIT, **fields)
    incident.first_seen.FromNanoseconds(int(first_seen * 1e9))
    incident.detected.FromNanoseconds(int(detected * 1e9))
    return incident


def node(node_id: str, state: int, slots: int) -> pb.Node:
    return pb.Node(node_id=node_id, state=state, slots=slots)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("state", "weight", "flops", "expected"),
    [
        (pb.JOB_STATE_RUNNING, 2.0, 1.5 * GF, 3.0 * GF),
        (pb.JOB_STATE_RUNNING, 0.0, 1.5 * GF, 1.5 * GF),  # unset weight means 1.0
        (pb.JOB_STATE_RUNNING, 2.0, 0.0, 0.0),
        (pb.JOB_STATE_RECOVERING, 2.0, 1.5 * GF, 0.0),
        (pb.JOB_STATE_SCHEDULED, 2.0, 1.5 * GF, 0.0),
        (pb.JOB_STATE_PENDING, 2.0, 1.5 * GF, 0.0),
        (pb.JOB_STATE_SUCCEEDED, 2.0, 1.5 * GF, 0.0),
    ],
)
def test_job_waf(state: int, weight: float, flops: float, expected: float) -> None:
    assert cost.job_waf(make_job(state=state, weight=weight, flops=flops)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("first_seen", "detected", "resumed_at", "healthy", "resumed", "want"),
    [
        # detection 2 s, transition 8 s at 3 GF; resumed at full rate
        (100.0, 102.0, 110.0, 3 * GF, 3 * GF, (2.0, 8.0, 6 * GF, 24 * GF, 0.0)),
        # resumed smaller: 1 GF/s lost per sub-healthy second
        (100.0, 102.0, 110.0, 3 * GF, 2 * GF, (2.0, 8.0, 6 * GF, 24 * GF, 1 * GF)),
        # resumed faster than before: no negative sub-healthy rate
        (100.0, 102.0, 110.0, 3 * GF, 4 * GF, (2.0, 8.0, 6 * GF, 24 * GF, 0.0)),
        # clock skew: a report stamped after detection costs no negative detection time
        (103.0, 102.0, 110.0, 3 * GF, 3 * GF, (0.0, 8.0, 0.0, 24 * GF, 0.0)),
        # resumed_at before detection (should not happen): no negative transition
        (100.0, 102.0, 101.0, 3 * GF, 3 * GF, (2.0, 0.0, 6 * GF, 0.0, 0.0)),
        # a job that was not earning anything loses nothing
        (100.0, 102.0, 110.0, 0.0, 0.0, (2.0, 8.0, 0.0, 0.0, 0.0)),
    ],
)
def test_incident_cost(
    first_seen: float,
    detected: float,
    resumed_at: float,
    healthy: float,
    resumed: float,
    want: tuple[float, float, float, float, float],
) -> None:
    incident = make_incident(first_seen=first_seen, detected=detected)
    c = cost.incident_cost(incident, healthy, resumed, resumed_at)
    got = (
        c.detection_seconds,
        c.transition_seconds,
        c.detection_waf_seconds,
        c.transition_waf_seconds,
        c.sub_healthy_waf,
    )
    assert got == pytest.approx(want)
    assert c.healthy_waf == healthy and c.resumed_waf == resumed
    assert c.sub_healthy_seconds == 0 and c.sub_healthy_waf_seconds == 0
    assert cost.total_waf_seconds(c) == pytest.approx(want[2] + want[3])


def _stamp(seconds: float) -> Any:
    out = pb.Incident().detected
    out.FromNanoseconds(int(seconds * 1e9))
    return out


@pytest.mark.parametrize("note_first", [True, False])
def test_resumed_cost_is_the_same_whichever_edit_lands_first(note_first: bool) -> None:
    incident = pb.Incident(incident_id="i")
    incident.first_seen.CopyFrom(_stamp(NOW - 2))
    incident.detected.CopyFrom(_stamp(NOW - 1))

    def note(current: pb.Incident) -> None:  # the remedy chosen, at the healthy rate and size
        current.cost.healthy_waf, current.cost.healthy_slots = 4 * GF, 4
        if current.HasField("resumed"):
            current.cost.CopyFrom(cost.resumed_cost(current))

    def close(current: pb.Incident) -> None:  # training resumed on 2 of the 4 slots
        current.resumed.CopyFrom(_stamp(NOW + 3))
        current.cost.resumed_waf, current.cost.resumed_slots = 1 * GF, 2
        current.cost.CopyFrom(cost.resumed_cost(current))

    for edit in (note, close) if note_first else (close, note):
        edit(incident)
    got = incident.cost
    assert (got.detection_seconds, got.transition_seconds) == pytest.approx((1.0, 4.0))
    assert got.transition_waf_seconds == pytest.approx(16 * GF)
    assert got.sub_healthy_waf == pytest.approx(2 * GF)  # half the size, by size alone
    assert (got.healthy_slots, got.resumed_slots) == (4, 2)


def test_accrue_sub_healthy_adds_up_and_does_not_mutate() -> None:
    start = cost.incident_cost(make_incident(first_seen=100, detected=102), 3 * GF, 2 * GF, 110)
    once = cost.accrue_sub_healthy(start, 5.0)
    twice = cost.accrue_sub_healthy(once, 2.5)
    ignored = cost.accrue_sub_healthy(twice, -4.0)
    assert start.sub_healthy_seconds == 0 and once.sub_healthy_seconds == 5.0
    assert twice.sub_healthy_seconds == pytest.approx(7.5)
    assert twice.sub_healthy_waf_seconds == pytest.approx(7.5 * GF)
    assert ignored == twice
    assert cost.total_waf_seconds(twice) == pytest.approx(6 * GF + 24 * GF + 7.5 * GF)


def test_accrue_at_full_size_costs_nothing() -> None:
    c = cost.accrue_sub_healthy(cost.incident_cost(make_incident(), 3 * GF, 3 * GF, NOW), 100.0)
    assert c.sub_healthy_seconds == 100.0 and c.sub_healthy_waf_seconds == 0.0


def costed(incident: pb.Incident, waf_seconds: float) -> pb.Incident:
    incident.cost.transition_waf_seconds = waf_seconds
    incident.resumed.FromNanoseconds(int((NOW - 30) * 1e9))
    return incident


def test_cluster_summary_counts_nodes_slots_and_waf() -> None:
    jobs = [
        make_job("run", pb.JOB_STATE_RUNNING, weight=2.0, flops=1.5 * GF, ranks=(2, 2)),
        make_job("sched", pb.JOB_STATE_SCHEDULED, ranks=(1,)),
        make_job("rec", pb.JOB_STATE_RECOVERING, ranks=(2,)),
        make_job("pend", pb.JOB_STATE_PENDING, ranks=()),
        make_job("done-recently", pb.JOB_STATE_SUCCEEDED, changed=NOW - 60, ranks=(2,)),
        make_job("done-long-ago", pb.JOB_STATE_FAILED, changed=NOW - cost.RECENT_S - 1, ranks=(2,)),
    ]
    nodes = [
        node("a", pb.NODE_STATE_READY, 4),
        node("b", pb.NODE_STATE_READY, 4),
        node("c", pb.NODE_STATE_LOST, 8),
        node("d", pb.NODE_STATE_UNSPECIFIED, 2),
    ]
    summary = cost.cluster_summary(jobs, nodes, [], NOW)
    assert isinstance(summary, job_service_pb2.GetClusterResponse)
    assert (summary.nodes_ready, summary.nodes_lost, summary.slots_total) == (2, 1, 8)
    assert summary.slots_used == 4 + 1 + 2
    assert summary.waf == pytest.approx(3 * GF)
    assert [j.job_id for j in summary.jobs] == ["run", "sched", "rec", "pend", "done-recently"]
    run = summary.jobs[0]
    assert (run.name, run.state, run.weight, run.slots) == ("name-run", pb.JOB_STATE_RUNNING, 2.0, 4)
    assert (run.flops_per_second, run.waf) == (1.5 * GF, 3 * GF)
    rec = summary.jobs[2]
    assert (rec.slots, rec.flops_per_second, rec.waf) == (2, 0.0, 0.0)
    assert summary.jobs[4].slots == 0
    assert (summary.failure_waf_seconds, summary.incidents) == (0.0, 0)


def test_cluster_summary_attributes_failure_cost_to_jobs() -> None:
    jobs = [make_job("a"), make_job("b"), make_job("old", pb.JOB_STATE_FAILED, changed=NOW - 10 * cost.RECENT_S)]
    incidents = [
        costed(make_incident("i1", "a"), 10 * GF),
        costed(make_incident("i2", "a"), 5 * GF),
        make_incident("i3", "b"),  # the job is running: nothing open, nothing known
        costed(make_incident("i4", "old"), 7 * GF),  # counted in the totals only
        make_incident("i5", ""),  # a node-level incident
    ]
    summary = cost.cluster_summary(jobs, [], incidents, NOW)
    by_id = {j.job_id: j for j in summary.jobs}
    assert set(by_id) == {"a", "b"}
    assert (by_id["a"].incidents, by_id["a"].failure_waf_seconds) == (2, pytest.approx(15 * GF))
    assert (by_id["b"].incidents, by_id["b"].failure_waf_seconds) == (1, 0.0)
    assert summary.incidents == 5
    assert summary.failure_waf_seconds == pytest.approx(22 * GF)


def test_recovering_job_accrues_provisional_cost_for_its_newest_incident() -> None:
    job = make_job("r", pb.JOB_STATE_RECOVERING, weight=2.0, flops=1.5 * GF)
    older = make_incident("old", "r", first_seen=NOW - 200, detected=NOW - 199)
    newest = make_incident("new", "r", first_seen=NOW - 12, detected=NOW - 10)
    summary = cost.cluster_summary([job], [], [older, newest], NOW)
    # detection 2 s + transition 10 s so far, at 3 GF/s; the older one is not counted twice
    assert summary.jobs[0].failure_waf_seconds == pytest.approx(12 * 3 * GF, rel=1e-6)
    assert summary.failure_waf_seconds == pytest.approx(36 * GF, rel=1e-6)
    provisional = cost.current_cost(newest, job, NOW)
    assert provisional.transition_seconds == pytest.approx(10.0, abs=1e-3)
    # the recorded cost wins once there is one
    assert cost.total_waf_seconds(cost.current_cost(costed(newest, 1.0), job, NOW)) == 1.0


@pytest.mark.parametrize(
    ("state", "incidents", "want"),
    [
        (pb.JOB_STATE_RUNNING, [], 1.0),
        # scheduled at NOW-110; 12 s of the 110 lost to detection + transition
        (pb.JOB_STATE_RUNNING, ["costed"], 1 - 12 / 110),
        # still recovering: detection 2 s + transition 58 s so far
        (pb.JOB_STATE_RECOVERING, ["open"], 1 - 60 / 110),
        (pb.JOB_STATE_PENDING, [], 1.0),
    ],
)
def test_effective_training_time_ratio(state: int, incidents: list[str], want: float) -> None:
    job = make_job(state=state)
    if state == pb.JOB_STATE_PENDING:
        del job.history[:]
    found = []
    for kind in incidents:
        incident = make_incident()
        if kind == "costed":
            incident.cost.CopyFrom(cost.incident_cost(incident, 3 * GF, 3 * GF, NOW - 48))
            incident.resumed.FromNanoseconds(int((NOW - 48) * 1e9))
        found.append(incident)
    assert cost.effective_training_time_ratio(job, found, NOW) == pytest.approx(want, rel=1e-6)


def metric_points(reader: InMemoryMetricReader) -> dict[str, list[Any]]:
    data = reader.get_metrics_data()
    assert data is not None
    out: dict[str, list[Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                out[metric.name] = list(metric.data.data_points)
    return out


def test_metrics_gauges_read_one_snapshot_per_collection() -> None:
    calls = []

    def snapshot() -> job_service_pb2.GetClusterResponse:
        calls.append(1)
        return cost.cluster_summary([make_job("a"), make_job("b", weight=1.0, flops=GF)], [], [], NOW)

    reader = InMemoryMetricReader()
    clock = [0.0]
    CoordinatorMetrics(snapshot, MeterProvider(metric_readers=[reader]), clock=lambda: clock[0])
    points = metric_points(reader)
    assert [p.value for p in points["unicron.cluster.waf"]] == [pytest.approx(4 * GF)]
    jobs = {p.attributes["job"]: p.value for p in points["unicron.job.waf"]}
    assert jobs == {"name-a": pytest.approx(3 * GF), "name-b": pytest.approx(GF)}
    assert len(calls) == 1
    clock[0] = 5.0
    metric_points(reader)
    assert len(calls) == 2


def test_metrics_record_incident_cost_by_phase() -> None:
    reader = InMemoryMetricReader()
    m = CoordinatorMetrics(job_service_pb2.GetClusterResponse, MeterProvider(metric_readers=[reader]))
    incident = make_incident(remedy=pb.REMEDY_RESTART)
    m.record_incident(incident)  # not resumed yet: nothing to record
    incident.cost.CopyFrom(
        cost.accrue_sub_healthy(cost.incident_cost(make_incident(first_seen=100, detected=102), 3 * GF, 2 * GF, 110), 1)
    )
    m.record_incident(incident)
    m.record_sub_healthy(incident, 4 * GF)
    points = metric_points(reader)
    (detection,) = points["unicron.incident.detection_seconds"]
    (transition,) = points["unicron.incident.transition_seconds"]
    assert (detection.count, detection.sum) == (1, pytest.approx(2.0))
    assert (transition.count, transition.sum) == (1, pytest.approx(8.0))
    assert dict(detection.attributes) == {"kind": "process_exit", "remedy": "restart"}
    lost = {p.attributes["phase"]: p.value for p in points["unicron.incident.waf_seconds"]}
    assert lost == {
        "detection": pytest.approx(6 * GF),
        "transition": pytest.approx(24 * GF),
        "sub_healthy": pytest.approx(5 * GF),
    }
