"""The pooled-node model against the explicit one, node naming, and the benchmark's generator."""

from __future__ import annotations

import math
import os
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import planner as bench
from services.planner import domain, problem, solver
from services.planner.domain import Job, Node, PlanRequest, PlanResult, Transition


def _job(job_id: str, **kw: Any) -> Job:
    args: dict[str, Any] = {"weight": 1.0, "tensor_parallel": 1, "pipeline_parallel": 1, "min_dp": 1, "max_dp": 8}
    args.update(kw)
    return Job(job_id, **args)


def _slots(result: PlanResult) -> dict[str, dict[str, int]]:
    return {j.job_id: j.slots_by_node for j in result.jobs}


@st.composite
def _medium_requests(draw: st.DrawFn) -> PlanRequest:
    """Up to 6 nodes of 4 or 8 slots and 5 jobs with TP 1, 2, 4 or 3: too big to enumerate,
    small enough for the explicit model to prove its optimum quickly."""
    nodes = [
        Node(f"n{i}", draw(st.sampled_from([4, 8, 8])), healthy=draw(st.sampled_from([True, True, True, False])))
        for i in range(draw(st.integers(2, 6)))
    ]
    free = {n.node_id: n.slots for n in nodes}
    jobs = []
    for j in range(draw(st.integers(1, 5))):
        tp = draw(st.sampled_from([1, 2, 4, 3]))
        min_dp = draw(st.integers(1, 2))
        current = {}
        for node in nodes:
            if draw(st.integers(0, 3)) == 0:
                slots = tp * draw(st.integers(1, 2))
                if node.healthy and slots > free[node.node_id]:
                    continue
                current[node.node_id] = slots
                free[node.node_id] -= slots
        jobs.append(
            _job(
                f"j{j}",
                weight=draw(st.sampled_from([0.5, 1.0, 2.0])),
                tensor_parallel=tp,
                pipeline_parallel=draw(st.sampled_from([1, 2])),
                min_dp=min_dp,
                max_dp=draw(st.integers(min_dp, 6)),
                current=current,
                hit_by_failure=draw(st.booleans()),
                preemptible=draw(st.sampled_from([True, True, True, False])),
                transition=Transition(migrate_s=draw(st.sampled_from([60.0, 600.0])), resize_s=45.0),
            )
        )
    return PlanRequest(
        tuple(nodes),
        tuple(jobs),
        draw(st.sampled_from([1e-5, 1e-3])),
        max_changed_jobs=draw(st.sampled_from([None, None, 1])),
        relative_gap=0.0,
        time_limit_s=20.0,
    )


@settings(
    max_examples=int(os.environ.get("PLANNER_EXAMPLES", "60")) // 2,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_medium_requests())
def test_pooled_and_typed_nodes_reach_the_explicit_optimum(request: PlanRequest) -> None:
    explicit = solver.plan(request, _mode="explicit")
    modes = ["typed"]
    if problem.is_chain(problem.build_problem(request).levels):
        modes.append("pool")  # exact only for a chain of TP degrees
    for mode in modes:
        result = solver.plan(request, _mode=mode)
        assert result.status == explicit.status, mode
        if result.status == "INFEASIBLE":
            continue
        assert result.status == "OPTIMAL"
        assert domain.plan_problems(request, _slots(result)) == []
        assert result.objective == pytest.approx(explicit.objective, rel=1e-6), mode


def test_non_chain_tp_degrees_use_typed_capacity() -> None:
    # TP 2 and 3 do not divide each other: per-level counting would not be exact, so the solver
    # counts groups per TP degree. 2 + 3 + 3 fills the 8-slot node only with the right mix.
    nodes = (Node("n1", 8), Node("n2", 3))
    jobs = (_job("a", tensor_parallel=2, max_dp=1), _job("b", tensor_parallel=3, max_dp=3))
    request = PlanRequest(nodes, jobs, 1e-5, relative_gap=0.0)
    assert problem.build_problem(request).capacity == "typed"
    result = solver.plan(request)
    assert result.status == "OPTIMAL"
    assert {j.job_id: j.size for j in result.jobs} == {"a": 2, "b": 9}
    assert domain.plan_problems(request, _slots(result)) == []


def test_pooled_groups_pack_whole_tp_groups_onto_few_nodes() -> None:
    nodes = tuple(Node(f"n{i}", 8) for i in range(6))
    jobs = (
        _job("keep", tensor_parallel=2, max_dp=2, current={"n0": 4}),
        _job("big", tensor_parallel=8, min_dp=3, max_dp=3),
        _job("small", tensor_parallel=2, min_dp=5, max_dp=5, weight=0.5),
    )
    request = PlanRequest(nodes, jobs, 1e-6, relative_gap=0.0)
    result = solver.plan(request)
    by_id = {j.job_id: j for j in result.jobs}
    assert by_id["keep"].slots_by_node == {"n0": 4} and by_id["keep"].reason == "kept"
    assert sorted(by_id["big"].slots_by_node.values()) == [8, 8, 8]  # 3 whole nodes
    # 10 slots in TP groups of 2: the 4 left on n0 plus one more node, or two fresh nodes.
    assert sum(by_id["small"].slots_by_node.values()) == 10 and len(by_id["small"].slots_by_node) == 2
    assert domain.plan_problems(request, _slots(result)) == []


def test_stopped_search_reports_its_real_gap() -> None:
    request = bench.make_instance(128, 1024, 0, time_limit_s=0.3)
    request = PlanRequest(
        request.nodes, request.jobs, request.failure_rate_per_node_per_s, time_limit_s=0.3, relative_gap=0.0
    )
    result = solver.plan(request)
    assert result.status in ("FEASIBLE", "OPTIMAL")
    assert domain.plan_problems(request, _slots(result)) == []
    assert result.objective == pytest.approx(domain.score(request, _slots(result)))
    assert result.bound >= result.objective
    if result.status == "FEASIBLE":
        assert "time limit" in result.reason or "greedy" in result.reason
        assert result.gap == math.inf or result.gap == pytest.approx((result.bound - result.objective) / result.bound)


def test_bench_generator_and_one_small_case() -> None:
    first, second = bench.make_instance(8, 16, 3), bench.make_instance(8, 16, 3)
    assert first == second  # reproducible
    domain.validate(first)
    assert any(not n.healthy for n in first.nodes)
    assert any(j.current for j in first.jobs) and any(j.hit_by_failure for j in first.jobs)
    case = bench.run_case(8, 16, 1)
    assert case["status"] == ["OPTIMAL"]
    assert {"solve_s_p50", "solve_s_p95", "gap_max", "dp_s_p50", "peak_rss_mb"} <= case.keys()
    assert case["gap_max"] <= 1e-3 and case["peak_rss_mb"] > 0
    assert [t["metric"] for t in bench._targets([case])] == ["peak_rss_mb"]


def test_non_chain_tp_degrees_at_scale() -> None:
    # 64 jobs of TP 2 or 3 on 512 nodes: typed capacity keeps it a fraction of a second.
    nodes = tuple(Node(f"n{i:03d}", 8, healthy=i != 5) for i in range(512))
    jobs = []
    for k in range(64):
        tp = 2 + k % 2
        current = {f"n{2 * k:03d}": 2 * tp, f"n{2 * k + 1:03d}": 2 * tp} if k % 3 else {}
        jobs.append(_job(f"j{k}", weight=1.0 + k % 4, tensor_parallel=tp, max_dp=24, current=current))
    request = PlanRequest(nodes, tuple(jobs), 1e-6, time_limit_s=10.0)
    result = solver.plan(request)
    assert result.status == "OPTIMAL", result.reason
    assert result.solve_seconds < 5.0
    assert domain.plan_problems(request, _slots(result)) == []
