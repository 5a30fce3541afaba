"""The paper's dynamic program as the reference for CP-SAT on the size-only problem."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.planner import domain, solver
from services.planner.domain import Job, Node, PlanRequest, ThroughputEstimate, Transition
from services.planner.dp import plan_sizes_dp


def _job(job_id: str, **kw: Any) -> Job:
    args: dict[str, Any] = {"weight": 1.0, "tensor_parallel": 1, "pipeline_parallel": 1, "min_dp": 1, "max_dp": 8}
    args.update(kw)
    return Job(job_id, **args)


def test_dp_by_hand() -> None:
    # 12 healthy slots. "a" (weight 3) is worth most per slot, "b" was running on 4 and would
    # pay a migration to grow; "c" cannot pause and takes its minimum of 2.
    nodes = (Node("n1", 8), Node("n2", 4), Node("n3", 8, healthy=False))
    jobs = (
        _job("a", weight=3.0, max_dp=6),
        _job("b", current={"n1": 4}, max_dp=8),
        _job("c", min_dp=2, preemptible=False),
    )
    request = PlanRequest(nodes, jobs, 1e-4, relative_gap=0.0)
    result = plan_sizes_dp(request)
    assert result.status == "OPTIMAL"
    assert result.sizes == {"a": 6, "b": 4, "c": 2}
    assert result.objective == pytest.approx(domain.size_only_score(request, result.sizes))
    cp = solver.plan_sizes(request)
    assert cp.status == "OPTIMAL" and cp.sizes == result.sizes


def test_dp_infeasible_when_required_sizes_do_not_fit() -> None:
    request = PlanRequest(
        (Node("n1", 4),), (_job("a", min_dp=3, preemptible=False), _job("b", min_dp=2, preemptible=False)), 0.0
    )
    assert plan_sizes_dp(request).status == "INFEASIBLE"
    assert solver.plan_sizes(request).status == "INFEASIBLE"


def test_dp_is_fast_at_scale() -> None:
    # 256 jobs on 16384 slots: the vectorized DP stays well under a second.
    nodes = tuple(Node(f"n{i}", 8) for i in range(2048))
    jobs = tuple(_job(f"j{k}", tensor_parallel=2, min_dp=4, max_dp=36, weight=1 + k % 3) for k in range(256))
    result = plan_sizes_dp(PlanRequest(nodes, jobs, 1e-6))
    assert sum(result.sizes.values()) <= 2048 * 8


@st.composite
def _size_requests(draw: st.DrawFn) -> PlanRequest:
    nodes = [
        Node(f"n{i}", draw(st.sampled_from([2, 4, 8])), healthy=draw(st.sampled_from([True, True, True, False])))
        for i in range(draw(st.integers(1, 4)))
    ]
    used = {n.node_id: 0 for n in nodes}
    jobs = []
    for j in range(draw(st.integers(1, 5))):
        tp, pp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 1, 2]))
        min_dp = draw(st.integers(1, 3))
        max_dp = draw(st.integers(min_dp, min_dp + 4))
        sizes = [tp * pp * d for d in range(min_dp, max_dp + 1)]
        profile = estimate = None
        kind = draw(st.sampled_from(["linear", "profile", "estimate"]))
        if kind == "profile":
            chosen = draw(st.lists(st.sampled_from(sizes), min_size=1, unique=True))
            profile = {x: draw(st.sampled_from([1e13, 5e13, 1e14, 3e14])) for x in chosen}
        elif kind == "estimate":
            estimate = ThroughputEstimate(
                parameters=draw(st.sampled_from([1e9, 3e10, 2e11])), tokens_per_step=draw(st.sampled_from([1e4, 4e6]))
            )
        current = {}
        for node in nodes:
            if draw(st.integers(0, 2)) == 0:
                slots = draw(st.sampled_from([tp, 2 * tp, 1]))
                if node.healthy and used[node.node_id] + slots > node.slots:
                    continue
                current[node.node_id] = slots
                used[node.node_id] += slots
        jobs.append(
            Job(
                f"j{j}",
                weight=draw(st.sampled_from([0.5, 1.0, 3.0])),
                tensor_parallel=tp,
                pipeline_parallel=pp,
                min_dp=min_dp,
                max_dp=max_dp,
                throughput=profile,
                estimate=estimate,
                current=current,
                hit_by_failure=draw(st.booleans()),
                preemptible=draw(st.sampled_from([True] * 7 + [False])),
                pinned=draw(st.sampled_from([False] * 9 + [True])),
                transition=Transition(
                    restart_s=draw(st.sampled_from([0.0, 30.0, 3000.0])),
                    resize_s=draw(st.sampled_from([0.0, 45.0, 3000.0])),
                    migrate_s=draw(st.sampled_from([0.0, 60.0, 3000.0])),
                    state_bytes=draw(st.sampled_from([0.0, 1e12])),
                ),
                team=draw(st.sampled_from(["", "a", "a", "b"])),
            )
        )
    limits = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries({"a": st.integers(0, 16)}),
            st.fixed_dictionaries({"a": st.integers(0, 16), "b": st.integers(0, 16)}),
        )
    )
    guarantees = draw(
        st.one_of(
            st.just({}),
            st.fixed_dictionaries({"a": st.integers(0, 12)}),
            st.fixed_dictionaries({"a": st.integers(0, 12), "b": st.integers(0, 12)}),
        )
    )
    return PlanRequest(
        tuple(nodes),
        tuple(jobs),
        draw(st.sampled_from([0.0, 1e-4, 1e-2])),
        relative_gap=0.0,
        team_limits=limits,
        team_guarantees=guarantees,
    )


@settings(
    max_examples=int(os.environ.get("PLANNER_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_size_requests())
def test_cp_sat_size_only_objective_equals_the_dp_optimum(request: PlanRequest) -> None:
    reference = plan_sizes_dp(request)
    result = solver.plan_sizes(request)
    if reference.status == "INFEASIBLE":
        event("infeasible")
        assert result.status == "INFEASIBLE"
        return
    event(f"running jobs: {sum(1 for x in reference.sizes.values() if x)}")
    assert result.status == "OPTIMAL", result.reason
    assert reference.objective == pytest.approx(domain.size_only_score(request, reference.sizes))
    assert result.objective == pytest.approx(domain.size_only_score(request, result.sizes))
    # CP-SAT rounds each value to 1 part in 2e9 of the largest; the optima agree to that.
    largest = max(
        (abs(v) for job in request.jobs for v in domain.size_options(job, {n.node_id: n for n in request.nodes},
                                                                      domain.horizon_of(request)).values()),
        default=0.0,
    )  # fmt: skip
    assert result.objective == pytest.approx(reference.objective, abs=1e-6 * largest + 1e-9)
