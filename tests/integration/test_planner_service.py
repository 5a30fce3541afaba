"""PlannerService over gRPC: plans, explain, bad input and limits."""

from __future__ import annotations

import math
from collections.abc import Iterator

import grpc
import pytest

from tests.integration.conftest import start_planner
from unicron import rpc
from unicron.v1 import planner_service_pb2 as pb
from unicron.v1 import planner_service_pb2_grpc

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def planner() -> Iterator[planner_service_pb2_grpc.PlannerServiceStub]:
    server: rpc.Server = start_planner()
    yield planner_service_pb2_grpc.PlannerServiceStub(grpc.insecure_channel(server.address))
    server.stop()


def cluster(*jobs: pb.PlanJob, lost: tuple[str, ...] = ()) -> pb.PlanRequest:
    request = pb.PlanRequest(failure_rate_per_node_per_second=1e-6, time_limit_seconds=5)
    for name in ("n1", "n2", "n3"):
        request.nodes.add(node_id=name, slots=8, healthy=name not in lost)
    request.jobs.extend(jobs)
    return request


def job(job_id: str = "j", **fields: object) -> pb.PlanJob:
    base: dict[str, object] = dict(
        job_id=job_id, weight=1.0, tensor_parallel=2, pipeline_parallel=1, min_data_parallel=1, max_data_parallel=8
    )
    base.update(fields)
    return pb.PlanJob(**base)  # type: ignore[arg-type]


def test_a_new_job_takes_the_free_slots(planner: planner_service_pb2_grpc.PlannerServiceStub) -> None:
    reply = planner.Plan(cluster(job(max_data_parallel=12)), timeout=30)
    assert reply.status == pb.SOLVE_STATUS_OPTIMAL
    (plan,) = reply.jobs
    assert plan.size == 24 and sum(plan.slots_by_node.values()) == 24
    assert all(v % 2 == 0 for v in plan.slots_by_node.values())
    assert reply.horizon_seconds == pytest.approx(1 / (1e-6 * 3))
    assert "started" in plan.reason
    assert plan.transition == "migrate" and plan.transition_seconds > 0


def test_a_lost_node_shrinks_the_job_on_it_and_says_why(planner: planner_service_pb2_grpc.PlannerServiceStub) -> None:
    hit = job(current={"n1": 8, "n2": 8}, hit_by_failure=True, max_data_parallel=8)
    other = job("other", current={"n3": 8}, max_data_parallel=4)
    reply = planner.Plan(cluster(hit, other, lost=("n2",)), timeout=30)
    assert reply.status in (pb.SOLVE_STATUS_OPTIMAL, pb.SOLVE_STATUS_FEASIBLE)
    plans = {p.job_id: p for p in reply.jobs}
    assert "n2" not in plans["j"].slots_by_node and plans["j"].size <= 8
    assert "n2" in plans["j"].reason
    assert dict(plans["other"].slots_by_node) == {"n3": 8} and plans["other"].reason == "kept"


def test_explain_scores_the_plan_the_planner_chose(planner: planner_service_pb2_grpc.PlannerServiceStub) -> None:
    request = cluster(job(current={"n1": 4}, preemptible=True), job("b", weight=2.0, preemptible=True))
    reply = planner.Plan(request, timeout=30)
    explained = planner.Explain(pb.ExplainRequest(request=request, plan=reply.jobs), timeout=30)
    assert explained.objective == pytest.approx(reply.objective, rel=1e-9)
    worse = planner.Explain(pb.ExplainRequest(request=request, plan=[]), timeout=30)  # everything paused
    assert worse.objective < reply.objective


def test_an_infeasible_request_is_a_reply_naming_the_constraint(
    planner: planner_service_pb2_grpc.PlannerServiceStub,
) -> None:
    reply = planner.Plan(cluster(job(current={"n2": 8}, pinned=True), lost=("n2",)), timeout=30)
    assert reply.status == pb.SOLVE_STATUS_INFEASIBLE
    assert "pinned" in reply.reason and "n2" in reply.reason


def test_a_teams_limit_holds_its_jobs_together(planner: planner_service_pb2_grpc.PlannerServiceStub) -> None:
    """Team vision may hold 8 slots: its two jobs share them, however heavy; nlp's job takes
    what is left."""
    request = cluster(
        job("v1", team="vision", weight=5.0, preemptible=True),
        job("v2", team="vision", weight=5.0, preemptible=True),
        job("n1", team="nlp", preemptible=True),
    )
    request.team_limits["vision"] = 8
    reply = planner.Plan(request, timeout=30)
    assert reply.status == pb.SOLVE_STATUS_OPTIMAL, reply.reason
    sizes = {p.job_id: p.size for p in reply.jobs}
    assert sizes["v1"] + sizes["v2"] == 8 and sizes["n1"] == 16


def test_a_team_gives_back_borrowed_slots_when_their_owner_needs_them(
    planner: planner_service_pb2_grpc.PlannerServiceStub,
) -> None:
    """24 slots, 12 guaranteed to each team: vision's heavy job holds 20, nlp's arrives."""
    request = cluster(
        job("v1", team="vision", weight=5.0, max_data_parallel=10, current={"n1": 8, "n2": 8, "n3": 4}),
        job("n1", team="nlp", preemptible=True, min_data_parallel=2, max_data_parallel=6),
    )
    request.team_guarantees.update({"vision": 12, "nlp": 12})
    reply = planner.Plan(request, timeout=30)
    assert reply.status == pb.SOLVE_STATUS_OPTIMAL, reply.reason
    assert {p.job_id: p.size for p in reply.jobs} == {"v1": 12, "n1": 12}


def with_nodes(request: pb.PlanRequest, *nodes: pb.PlanNode) -> pb.PlanRequest:
    request.nodes.extend(nodes)
    return request


BAD = [
    (cluster(job(), job()), "request.jobs"),
    (with_nodes(cluster(job()), pb.PlanNode(node_id="n1", slots=8, healthy=True)), "request.nodes"),
    (cluster(job(weight=0.0)), "request.jobs[0].weight"),
    (cluster(job(weight=-1.0)), "request.jobs[0].weight"),
    (cluster(job(weight=math.nan)), "request.jobs[0].weight"),
    (cluster(job(weight=math.inf)), "request.jobs[0].weight"),
    (cluster(job(tensor_parallel=0)), "request.jobs[0].tensor_parallel"),
    (cluster(job(min_data_parallel=3, max_data_parallel=2)), "request.jobs[0]"),
    (cluster(job(throughput={3: 1e12})), "request.jobs[0].throughput"),
    (cluster(job(throughput={2: -1.0})), "request.jobs[0].throughput"),
    (cluster(job(throughput={2: math.nan})), "request.jobs[0].throughput"),
    (cluster(job(current={"n9": 2})), "request.jobs[0].current"),
    (cluster(job(current={"n1": 10})), "request.jobs[0].current"),
    (cluster(job(current={"n1": 6}), job("b", current={"n1": 4})), "request.jobs"),
    (cluster(job(transition=pb.TransitionCosts(state_bytes=-1.0))), "request.jobs[0].transition.state_bytes"),
    (pb.PlanRequest(team_limits={"": 4}), "request.team_limits"),
]


@pytest.mark.parametrize(("request_", "field"), BAD)
def test_bad_input_is_invalid_argument_naming_the_field(
    planner: planner_service_pb2_grpc.PlannerServiceStub, request_: pb.PlanRequest, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as error:
        planner.Plan(request_, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.value.details() or "").startswith(field), error.value.details()


def test_a_request_over_the_limits_is_resource_exhausted(planner: planner_service_pb2_grpc.PlannerServiceStub) -> None:
    too_many = cluster(*(job(f"j{i}") for i in range(65)))  # the test replica accepts 64 jobs
    with pytest.raises(grpc.RpcError) as error:
        planner.Plan(too_many, timeout=30)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "65 jobs" in (error.value.details() or "")
