"""Team slot limits (services/planner/teams.py) by tables of cases: each part of the planner keeps
them (CP-SAT with placement, CP-SAT size-only, the paper's DP, the greedy plan), says when they
make a request infeasible, and names the field of a bad one."""

from __future__ import annotations

from typing import Any

import pytest

from services.planner import domain, greedy, problem
from services.planner.domain import FieldError, Job, Node, PlanRequest
from services.planner.dp import plan_sizes_dp
from services.planner.solver import plan, plan_sizes


def _job(job_id: str, team: str, **kw: Any) -> Job:
    args: dict[str, Any] = {"weight": 1.0, "tensor_parallel": 1, "pipeline_parallel": 1, "min_dp": 1, "max_dp": 8}
    args.update(kw)
    return Job(job_id, team=team, **args)


def _request(jobs: list[Job], limits: dict[str, int], slots: int = 16) -> PlanRequest:
    nodes = tuple(Node(f"n{i}", 4) for i in range(slots // 4))
    return PlanRequest(nodes, tuple(jobs), 1e-6, relative_gap=0.0, team_limits=limits)


def _sizes(result: domain.PlanResult) -> dict[str, int]:
    return {j.job_id: j.size for j in result.jobs}


@pytest.mark.parametrize(
    ("limits", "want"),
    [
        # No limit: vision's heavier jobs take the whole cluster, nlp gets nothing.
        ({}, {"v1": 8, "v2": 8, "n1": 0}),
        # vision may hold 6 together; nlp, unlimited, takes its most.
        ({"vision": 6}, {"v1": 6, "v2": 0, "n1": 8}),
        # A limit of 0 pauses the team's (preemptible) jobs.
        ({"vision": 0, "nlp": 5}, {"v1": 0, "v2": 0, "n1": 5}),
    ],
)
def test_every_planner_keeps_the_team_limits(limits: dict[str, int], want: dict[str, int]) -> None:
    jobs = [
        _job("v1", "vision", weight=3.0),
        _job("v2", "vision", weight=2.0),
        _job("n1", "nlp", weight=1.0),
    ]
    request = _request(jobs, limits)
    placed = plan(request)
    assert placed.status == "OPTIMAL", placed.reason
    assert _sizes(placed) == want
    assert domain.plan_problems(request, {j.job_id: j.slots_by_node for j in placed.jobs}) == []
    sizes_only = plan_sizes(request)
    reference = plan_sizes_dp(request)
    assert sizes_only.sizes == reference.sizes == want
    assert sizes_only.objective == pytest.approx(reference.objective)
    data = problem.build_problem(request)
    assert domain.plan_problems(request, greedy.greedy_plan(data)) == []


def test_a_plan_over_a_limit_is_named() -> None:
    request = _request([_job("v1", "vision"), _job("v2", "vision")], {"vision": 4})
    assert domain.plan_problems(request, {"v1": {"n0": 4}, "v2": {"n1": 2}}) == [
        "team 'vision': 6 slots held, its limit is 4"
    ]
    with pytest.raises(ValueError, match="team 'vision': 6 slots held"):
        domain.size_only_score(request, {"v1": 4, "v2": 2})


def test_a_running_job_over_its_limit_shrinks_in_place() -> None:
    """Limits changed under a running job: it shrinks onto its own nodes (a resize), it is not
    stopped."""
    running = _job("v1", "vision", current={"n0": 4, "n1": 4})
    result = plan(_request([running], {"vision": 4}))
    assert result.status == "OPTIMAL", result.reason
    (job,) = result.jobs
    assert job.size == 4 and set(job.slots_by_node) <= {"n0", "n1"} and job.transition == "resize"
    assert job.reason.startswith("shrunk from 8 to 4 slots: team vision holds 4 of its limit of 4 slots")


def test_a_job_its_teams_limit_keeps_out_says_so() -> None:
    result = plan(_request([_job("v1", "vision", weight=3.0), _job("v2", "vision", min_dp=4)], {"vision": 6}))
    reasons = {j.job_id: j.reason for j in result.jobs}
    assert reasons["v2"].startswith("not started: team vision holds 6 of its limit of 6 slots (FLOP/s by size")


def test_non_preemptible_jobs_over_their_limit_are_infeasible_with_the_reason() -> None:
    jobs = [_job("v1", "vision", min_dp=4, preemptible=False), _job("v2", "vision", min_dp=2, preemptible=False)]
    result = plan(_request(jobs, {"vision": 5}))
    assert result.status == "INFEASIBLE"
    assert result.reason == "team_limits: team 'vision''s pinned and non-preemptible jobs need 6 slots, its limit is 5"


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"vision": -1}, r"team_limits\['vision'\]"),
        ({"": 4}, r"team_limits \(key\)"),
        ({"vision": 2.5}, r"team_limits\['vision'\]"),
    ],
)
def test_a_bad_limit_names_its_field(limits: dict[str, Any], match: str) -> None:
    with pytest.raises(FieldError, match=match):
        _request([_job("v1", "vision")], limits)


def test_a_job_team_must_be_a_string() -> None:
    with pytest.raises(FieldError, match=r"team"):
        Job("j", 1.0, 1, 1, 1, 2, team=3)  # type: ignore[arg-type]


def test_borrowed_slots_are_given_back_first_when_their_owner_needs_them() -> None:
    """16 slots, vision and nlp guaranteed 8 each. vision's heavier job runs on 12 (4 borrowed
    from nlp's idle guarantee); nlp's job arrives. By weight alone vision keeps its 12; with the
    guarantees it gives back the 4 it borrowed, and nlp gets its 8."""
    vision = _job("v1", "vision", weight=4.0, max_dp=12, current={"n0": 4, "n1": 4, "n2": 4})
    nlp = _job("n1", "nlp", weight=1.0, min_dp=2, max_dp=8)
    by_weight = plan(_request([vision, nlp], {}))
    assert _sizes(by_weight) == {"v1": 12, "n1": 4}
    request = PlanRequest(
        tuple(Node(f"n{i}", 4) for i in range(4)),
        (vision, nlp),
        1e-6,
        relative_gap=0.0,
        team_guarantees={"vision": 8, "nlp": 8},
    )
    guaranteed = plan(request)
    assert guaranteed.status == "OPTIMAL", guaranteed.reason
    assert _sizes(guaranteed) == {"v1": 8, "n1": 8}
    assert plan_sizes(request).sizes == plan_sizes_dp(request).sizes == {"v1": 8, "n1": 8}
    assert domain.plan_problems(request, greedy.greedy_plan(problem.build_problem(request))) == []
    # While nlp has no job, its guarantee is idle and vision may borrow all of it.
    alone = PlanRequest(request.nodes, (vision,), 1e-6, relative_gap=0.0, team_guarantees=request.team_guarantees)
    assert _sizes(plan(alone)) == {"v1": 12}


def test_a_reserve_is_what_the_teams_jobs_could_use_and_fits_a_shrunk_cluster() -> None:
    from services.planner import teams

    small = _job("n1", "nlp", max_dp=3)
    pinned = _job("v1", "vision", current={"n0": 4, "n1": 4}, pinned=True)
    request = PlanRequest(
        tuple(Node(f"n{i}", 4) for i in range(4)), (small, pinned), 1e-6, team_guarantees={"nlp": 8, "vision": 4}
    )
    # nlp's job can use 3 of its 8; vision's pinned job must keep 8 of its 4.
    assert teams.reserves(request, 16) == {"nlp": 3, "vision": 8}
    # On 10 healthy slots vision's 8 must stay: nlp's reserve is cut to the 2 left.
    assert teams.reserves(request, 10) == {"nlp": 2, "vision": 8}
