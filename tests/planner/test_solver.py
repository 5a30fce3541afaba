"""The planner core: domain validation, the cost model, and the CP-SAT plan checked against
hand-made cases and against exhaustive search on tiny instances."""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from services.planner import domain, greedy, problem
from services.planner.domain import Job, Node, PlanRequest, PlanResult, Transition
from services.planner.solver import plan


def _job(job_id: str, **kw: Any) -> Job:
    args: dict[str, Any] = {
        "weight": 1.0,
        "tensor_parallel": 1,
        "pipeline_parallel": 1,
        "min_dp": 1,
        "max_dp": 8,
    }
    args.update(kw)
    return Job(job_id, **args)


def _request(nodes: list[Node], jobs: list[Job], rate: float = 1e-5, **kw: Any) -> PlanRequest:
    kw.setdefault("relative_gap", 0.0)  # prove optimality: the cases check exact outcomes
    return PlanRequest(tuple(nodes), tuple(jobs), rate, **kw)


def _slots(result: PlanResult) -> dict[str, dict[str, int]]:
    return {j.job_id: j.slots_by_node for j in result.jobs}


@dataclass
class Expect:
    """What one job's plan must look like; None fields are not checked."""

    size: int | None = None
    slots: dict[str, int] | None = None
    changed: bool | None = None
    reason: str | None = None  # a substring of the reason


@dataclass
class Case:
    name: str
    nodes: list[Node]
    jobs: list[Job]
    status: str = "OPTIMAL"
    expect: dict[str, Expect] = field(default_factory=dict)
    reason: str | None = None  # substring of the overall reason
    rate: float = 1e-5
    cap: int | None = None


CASES = [
    Case(
        "single job fits",
        [Node("n1", 8)],
        [_job("a")],
        expect={"a": Expect(8, {"n1": 8}, True, "started on 8 slots")},
    ),
    Case(
        "job too big, preemptible: paused",
        [Node("n1", 4)],
        [_job("a", min_dp=8, max_dp=8)],
        expect={"a": Expect(0, {}, False, "not started: needs at least 8 slots, only 4")},
    ),
    Case(
        "job too big, not preemptible: infeasible",
        [Node("n1", 4)],
        [_job("a", min_dp=8, max_dp=8, preemptible=False)],
        status="INFEASIBLE",
        reason="job a is not preemptible and needs at least 8 slots",
    ),
    Case(
        "lost node shrinks the job on it",
        [Node("n1", 4), Node("n2", 4, healthy=False)],
        [_job("a", current={"n1": 4, "n2": 4}, hit_by_failure=True)],
        expect={"a": Expect(4, {"n1": 4}, True, "shrunk from 8 to 4 slots: node n2 lost")},
    ),
    Case(
        "TP=2 groups never split across nodes",
        [Node("n1", 3), Node("n2", 3)],
        [_job("a", tensor_parallel=2, max_dp=3)],
        expect={"a": Expect(4, {"n1": 2, "n2": 2})},
    ),
    Case(
        "pinned job kept even when a heavier job wants its slots",
        [Node("n1", 4)],
        [_job("a", current={"n1": 2}, pinned=True), _job("b", weight=10.0, max_dp=4)],
        expect={"a": Expect(2, {"n1": 2}, False, "kept"), "b": Expect(2, {"n1": 2})},
    ),
    Case(
        "pinned job on a lost node: infeasible",
        [Node("n1", 4), Node("n2", 4, healthy=False)],
        [_job("a", current={"n2": 4}, pinned=True)],
        status="INFEASIBLE",
        reason="job a is pinned but cannot keep its placement: node n2 lost",
    ),
    Case(
        "stability: the unaffected job stays put",
        [Node("n1", 4), Node("n2", 4, healthy=False), Node("n3", 4)],
        [
            _job("a", max_dp=4, current={"n1": 4}),
            _job("b", max_dp=4, current={"n2": 4}, hit_by_failure=True),
        ],
        expect={
            "a": Expect(4, {"n1": 4}, False, "kept"),
            "b": Expect(4, {"n3": 4}, True, "moved: node n2 lost"),
        },
    ),
    Case(
        "two weighted jobs: the heavier gets the slots",
        [Node("n1", 4)],
        [_job("a", weight=1.0), _job("b", weight=3.0)],
        expect={"a": Expect(0, reason="not started"), "b": Expect(4, {"n1": 4})},
    ),
    Case(
        "a job grows into slots freed by a paused one",
        [Node("n1", 4), Node("n2", 4, healthy=False)],
        [
            _job("a", max_dp=4, current={"n1": 2}),
            _job("b", min_dp=6, current={"n1": 2, "n2": 4}, hit_by_failure=True),
        ],
        expect={
            "a": Expect(4, {"n1": 4}, True, "grown from 2 to 4 slots into freed slots"),
            "b": Expect(0, {}, True, "paused: node n2 lost; needs at least 6 slots, only 0"),
        },
    ),
    Case(
        "profile: sizes it omits are not allowed",
        [Node("n1", 6)],
        [_job("a", throughput={2: 1e14, 4: 1.5e14, 8: 2e14})],
        expect={"a": Expect(4, {"n1": 4})},
    ),
    Case(
        "profile: sublinear job cedes slots to a linear one",
        [Node("n1", 8)],
        [
            _job("a", max_dp=2, pipeline_parallel=4, throughput={4: 4e14, 8: 4.4e14}),
            _job("b", max_dp=4),
        ],
        expect={"a": Expect(4), "b": Expect(4)},
    ),
    Case(
        "short horizon: a start that does not pay back its transition is skipped",
        [Node("n1", 4)],
        # On the whole cluster (a job on part of it is hit less often: its transition is
        # charged in part, Horizon.share).
        [_job("a", min_dp=4, max_dp=4, transition=Transition(migrate_s=200.0))],
        rate=0.01,  # horizon 100 s
        expect={"a": Expect(0, reason="not worth its transition time")},
    ),
    Case(
        "cap 0: no voluntary change, but a hit job still moves",
        [Node("n1", 4), Node("n2", 4, healthy=False), Node("n3", 4)],
        [_job("a", max_dp=4, current={"n2": 4}, hit_by_failure=True), _job("b", max_dp=4)],
        cap=0,
        expect={
            "a": Expect(4, changed=True),
            "b": Expect(0, {}, False, "changed-jobs cap of 0 reached"),
        },
    ),
    Case(
        "hit job restarts in place",
        [Node("n1", 4)],
        [_job("a", max_dp=4, current={"n1": 4}, hit_by_failure=True)],
        expect={"a": Expect(4, {"n1": 4}, True, "restarted in place")},
    ),
    Case(
        "no healthy node, nothing must run",
        [Node("n1", 4, healthy=False)],
        [_job("a", current={"n1": 4}, hit_by_failure=True)],
        expect={"a": Expect(0, {}, True, "paused: node n1 lost")},
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_plan_cases(case: Case) -> None:
    request = _request(case.nodes, case.jobs, case.rate, max_changed_jobs=case.cap)
    result = plan(request)
    assert result.status == case.status, result.reason
    if case.reason is not None:
        assert case.reason in result.reason
    if case.status == "INFEASIBLE":
        assert result.jobs == ()
        return
    got = {j.job_id: j for j in result.jobs}
    assert set(got) == {j.job_id for j in case.jobs}
    for job_id, want in case.expect.items():
        job_plan = got[job_id]
        if want.size is not None:
            assert job_plan.size == want.size, job_plan
        if want.slots is not None:
            assert job_plan.slots_by_node == want.slots, job_plan
        if want.changed is not None:
            assert job_plan.changed == want.changed, job_plan
        if want.reason is not None:
            assert want.reason in job_plan.reason, job_plan
    assert domain.plan_problems(request, _slots(result)) == []
    assert result.objective == pytest.approx(domain.score(request, _slots(result)))
    assert result.gap == 0.0 and result.bound == result.objective


def test_plan_is_deterministic_and_fits_a_mid_sized_cluster() -> None:
    nodes = [Node(f"n{i}", 8, healthy=i != 3) for i in range(32)]
    jobs = [
        _job("big", weight=2.0, tensor_parallel=8, pipeline_parallel=2, max_dp=8,
             current={f"n{i}": 8 for i in range(16)}, hit_by_failure=True),
        _job("mid", tensor_parallel=4, max_dp=16, current={f"n{i}": 8 for i in range(16, 24)}),
        _job("small", weight=0.5, tensor_parallel=2, max_dp=16),
        _job("fixed", current={"n24": 4}, pinned=True, preemptible=False),
    ]  # fmt: skip
    request = _request(nodes, jobs, time_limit_s=5.0)
    first, second = plan(request), plan(request)
    assert first.status in ("OPTIMAL", "FEASIBLE")
    assert first.jobs == second.jobs
    assert domain.plan_problems(request, _slots(first)) == []
    by_id = {j.job_id: j for j in first.jobs}
    assert by_id["mid"].reason == "kept" and by_id["fixed"].reason == "kept"
    # 31 healthy nodes hold 248 slots: "mid" keeps 64, "fixed" 4, "big" gets its maximum of
    # 128 (off the lost n3) and "small", worth least per slot, its maximum of 32 from the rest.
    assert (by_id["big"].size, by_id["small"].size) == (128, 32)
    assert "n3" not in by_id["big"].slots_by_node


def test_tiny_time_limit_still_returns_a_valid_plan() -> None:
    # Presolve of 128 nodes outlasts 1 us, so this exercises the greedy fallback (or, on a very
    # fast machine, a solver answer); either way the plan must be valid.
    nodes = [Node(f"n{i}", 8, healthy=i % 17 != 3) for i in range(128)]
    jobs = [
        _job(f"j{k}", weight=1.0 + k % 3, tensor_parallel=[1, 2, 4, 8][k % 4], max_dp=32,
             current={f"n{i}": 8 for i in range(6 * k, 6 * k + 4)}, hit_by_failure=k % 5 == 0)
        for k in range(20)
    ]  # fmt: skip
    request = _request(nodes, jobs, time_limit_s=1e-6)
    result = plan(request)
    assert result.status in ("FEASIBLE", "OPTIMAL"), result.reason
    assert domain.plan_problems(request, _slots(result)) == []
    assert result.bound >= result.objective > 0
    if "greedy" in result.reason:
        assert result.bound == math.inf
        reasons = {j.job_id: j.reason for j in result.jobs}
        assert all(reasons.values()), reasons
        assert reasons["j1"] == "kept" or reasons["j1"].startswith("grown from 32 to"), reasons["j1"]


def test_transition_kinds_in_the_plan() -> None:
    nodes = [Node("n1", 4), Node("n2", 4, healthy=False), Node("n3", 4), Node("n4", 4)]
    jobs = [
        _job("kept", max_dp=4, current={"n4": 4}),
        _job("lost", max_dp=8, current={"n1": 4, "n2": 4}, hit_by_failure=True),
    ]
    # Slow migrations: "lost" shrinks onto n1, which it holds (a resize), and leaves n3 idle.
    slow = Transition(resize_s=10.0, migrate_s=5000.0)
    request = _request(nodes, [jobs[0], dataclasses.replace(jobs[1], transition=slow)], rate=1e-4)
    by_id = {j.job_id: j for j in plan(request).jobs}
    assert (by_id["kept"].transition, by_id["kept"].transition_s, by_id["kept"].reason) == ("", 0.0, "kept")
    assert by_id["lost"].slots_by_node == {"n1": 4} and by_id["lost"].transition == "resize"
    assert by_id["lost"].transition_s == 10.0 and "shrunk from 8 to 4 slots: node n2 lost" in by_id["lost"].reason
    # Fast migrations: it takes n3 to keep its size, a migration.
    fast = Transition(resize_s=10.0, migrate_s=20.0)
    request = _request(nodes, [jobs[0], dataclasses.replace(jobs[1], transition=fast)], rate=1e-4)
    by_id = {j.job_id: j for j in plan(request).jobs}
    assert by_id["lost"].slots_by_node == {"n1": 4, "n3": 4} and by_id["lost"].transition == "migrate"
    assert by_id["kept"].reason == "kept"


def test_infeasible_names_the_cap() -> None:
    # Starting "c" (not preemptible) needs "a" paused: two changes, and the cap is one.
    nodes = [Node("n1", 4)]
    jobs = [_job("a", max_dp=4, current={"n1": 4}), _job("c", min_dp=4, max_dp=4, preemptible=False)]
    result = plan(_request(nodes, jobs, max_changed_jobs=1))
    assert result.status == "INFEASIBLE" and result.reason.startswith("max_changed_jobs:"), result.reason
    assert plan(_request(nodes, jobs, max_changed_jobs=2)).status == "OPTIMAL"
    too_many = [_job(f"s{i}", preemptible=False) for i in range(3)]
    result = plan(_request([Node("n1", 8)], too_many, max_changed_jobs=2))
    assert result.status == "INFEASIBLE" and "3 non-preemptible jobs must start" in result.reason


def test_polish_returns_a_needlessly_moved_job() -> None:
    nodes = [Node("n1", 4), Node("n2", 4)]
    jobs = [_job("a", max_dp=4, current={"n1": 4}), _job("b", max_dp=2)]
    request = _request(nodes, jobs)
    data = problem.build_problem(request)
    # "b" took half of n1: "a" cannot go back, and stays moved.
    moved = {"a": {"n2": 4}, "b": {"n1": 2}}
    assert greedy.polish(data, moved) == moved
    # n1 is free: "a" goes back, a kept job earning more than a migrated one.
    polished = greedy.polish(data, {"a": {"n2": 4}, "b": {"n2": 0}})
    assert polished == {"a": {"n1": 4}, "b": {"n2": 0}}
    assert domain.plan_problems(request, polished) == []


def test_default_gap_still_keeps_unaffected_jobs() -> None:
    # A 0.1% gap could leave a tiny job moved for nothing; the polish puts it back.
    nodes = [Node(f"n{i}", 8) for i in range(12)]
    jobs = [_job("tiny", weight=0.01, max_dp=1, current={"n0": 1})] + [
        _job(f"big{k}", tensor_parallel=8, max_dp=2, current={f"n{2 * k + 1}": 8, f"n{2 * k + 2}": 8}) for k in range(5)
    ]
    result = plan(PlanRequest(tuple(nodes), tuple(jobs), 1e-6))
    assert {j.job_id: j.reason for j in result.jobs}["tiny"] == "kept"


def test_horizon() -> None:
    nodes = (Node("a", 8), Node("b", 8), Node("c", 8, healthy=False))
    assert domain.horizon_seconds(PlanRequest(nodes, (), 0.0)) == domain.DEFAULT_HORIZON_S
    assert domain.horizon_seconds(PlanRequest(nodes, (), 1e-4)) == pytest.approx(5000.0)


def test_sizes_and_estimated_throughput() -> None:
    job = _job("a", tensor_parallel=2, pipeline_parallel=2, min_dp=2, max_dp=4)
    assert domain.allowed_sizes(job) == [8, 12, 16]
    assert domain.throughput(job, 12) == 12 * domain.ESTIMATED_FLOPS_PER_SLOT
    assert domain.throughput(job, 0) == 0.0
    with pytest.raises(ValueError, match="size 10 is not allowed"):
        domain.throughput(job, 10)


def test_score_rejects_invalid_plans() -> None:
    request = _request(
        [Node("n1", 4), Node("n2", 4, healthy=False)],
        [_job("a", tensor_parallel=2, preemptible=False), _job("b", current={"n1": 2})],
    )
    assert domain.score(request, {"a": {"n1": 2}, "b": {"n1": 2}}) > 0
    for bad, match in [
        ({"b": {"n1": 2}}, "not preemptible but paused"),
        ({"a": {"n2": 2}}, "unhealthy node n2"),
        ({"a": {"n1": 4}, "b": {"n1": 2}}, "6 slots used of 4"),
        ({"a": {"n1": 3}}, "not whole TP groups"),
        ({"a": {"n1": 2}, "zz": {}}, "unknown job"),
    ]:
        with pytest.raises(ValueError, match=match):
            domain.score(request, bad)


BAD_INPUTS: list[tuple[str, Any, str]] = [
    ("empty node id", lambda: Node("", 4), r"Node\(''\)\.node_id"),
    ("negative slots", lambda: Node("n", -1), r"\.slots"),
    ("TP 0", lambda: _job("a", tensor_parallel=0), r"\.tensor_parallel"),
    ("min_dp > max_dp", lambda: _job("a", min_dp=3, max_dp=2), r"\.min_dp"),
    ("zero weight", lambda: _job("a", weight=0.0), r"\.weight"),
    ("nan transition", lambda: Transition(resize_s=math.nan), r"Transition\.resize_s"),
    ("zero bandwidth", lambda: Transition(bandwidth_bytes_per_s=0.0), r"bandwidth_bytes_per_s"),
    ("not a transition", lambda: _job("a", transition=30.0), r"\.transition"),
    ("nan weight", lambda: _job("a", weight=math.nan), r"\.weight"),
    ("inf weight", lambda: _job("a", weight=math.inf), r"\.weight"),
    ("negative weight", lambda: _job("a", weight=-1.0), r"\.weight"),
    ("zero profile value", lambda: _job("a", throughput={2: 0.0}), r"throughput\[2\]"),
    ("nan profile value", lambda: _job("a", throughput={2: math.nan}), r"throughput\[2\]"),
    ("profile size", lambda: _job("a", tensor_parallel=2, throughput={3: 1.0}), r"throughput"),
    ("zero current", lambda: _job("a", current={"n": 0}), r"current\['n'\]"),
    ("negative rate", lambda: PlanRequest((), (), -1.0), r"failure_rate_per_node_per_s"),
    ("zero workers", lambda: PlanRequest((), (), 0.0, workers=0), r"\.workers"),
    ("negative cap", lambda: PlanRequest((), (), 0.0, max_changed_jobs=-1), r"max_changed_jobs"),
    ("job in nodes", lambda: PlanRequest((_job("a"),), (), 0.0), r"nodes\[0\]"),  # type: ignore[arg-type]
    (
        "duplicate node",
        lambda: domain.validate(PlanRequest((Node("n", 1), Node("n", 2)), (), 0.0)),
        r"nodes\[1\]\.node_id",
    ),
    (
        "duplicate job",
        lambda: domain.validate(PlanRequest((), (_job("a"), _job("a")), 0.0)),
        r"jobs\[1\]\.job_id",
    ),
    (
        "unknown node in current",
        lambda: plan(PlanRequest((Node("n", 1),), (_job("a", current={"zz": 1}),), 0.0)),
        r"jobs\[0\]\.current\['zz'\]",
    ),
]


@pytest.mark.parametrize("make,match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_names_the_field(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


# --- exhaustive search on tiny instances --------------------------------------------------------


def _placements(job: Job, nodes: list[Node]) -> list[dict[str, int]]:
    """Every placement of the job in whole TP groups on healthy nodes, paused included."""
    healthy = [n for n in nodes if n.healthy]
    tp = job.tensor_parallel
    ranges = [range(n.slots // tp + 1) for n in healthy]
    sizes = set(domain.allowed_sizes(job)) | {0}
    out = []
    for groups in itertools.product(*ranges):
        if sum(groups) * tp in sizes:
            out.append({n.node_id: g * tp for n, g in zip(healthy, groups, strict=True) if g})
    return out


def _brute_force(request: PlanRequest) -> float | None:
    nodes = list(request.nodes)
    per_job = [_placements(job, nodes) for job in request.jobs]
    best: float | None = None
    for combo in itertools.product(*per_job):
        candidate: Mapping[str, Mapping[str, int]] = {
            job.job_id: slots for job, slots in zip(request.jobs, combo, strict=True)
        }
        if domain.plan_problems(request, candidate):
            continue
        value = domain.score(request, candidate)
        best = value if best is None else max(best, value)
    return best


_seconds = st.sampled_from([0.0, 30.0, 3000.0])
_transitions = st.builds(
    Transition,
    restart_s=_seconds,
    resize_s=_seconds,
    migrate_s=_seconds,
    state_bytes=st.sampled_from([0.0, 0.0, 1e12]),
)


@st.composite
def _tiny_requests(draw: st.DrawFn) -> PlanRequest:
    nodes = [
        Node(f"n{i}", draw(st.sampled_from([0, 1, 2, 2, 3, 4, 4])), healthy=draw(st.sampled_from([True, True, False])))
        for i in range(draw(st.integers(1, 3)))
    ]
    jobs = []
    used = {node.node_id: 0 for node in nodes}
    for j in range(draw(st.integers(1, 2))):
        tp = draw(st.sampled_from([1, 2, 2, 3]))
        pp = draw(st.sampled_from([1, 1, 2]))
        min_dp = draw(st.integers(1, 2))
        max_dp = draw(st.integers(min_dp, min_dp + 3))
        sizes = [tp * pp * dp for dp in range(min_dp, max_dp + 1)]
        profile = None
        if draw(st.booleans()):
            chosen = draw(st.lists(st.sampled_from(sizes), min_size=1, unique=True))
            profile = {x: draw(st.sampled_from([1e13, 5e13, 1e14, 3e14])) for x in chosen}
        current = {}
        for node in nodes:
            if draw(st.integers(0, 2)) == 0:
                slots = draw(st.sampled_from([tp, 2 * tp, 1]))  # 1 splits a TP group of 2 or 3
                if node.healthy and used[node.node_id] + slots > node.slots:
                    continue  # a placement must fit its healthy node (domain.validate)
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
                current=current,
                hit_by_failure=draw(st.booleans()),
                preemptible=draw(st.sampled_from([True, True, True, False])),
                pinned=draw(st.sampled_from([False, False, False, False, True])),
                transition=draw(_transitions),
                team=draw(_teams),
            )
        )
    return PlanRequest(
        tuple(nodes),
        tuple(jobs),
        draw(st.sampled_from([0.0, 1e-4, 1e-2])),
        max_changed_jobs=draw(st.sampled_from([None, None, 0, 1])),
        relative_gap=0.0,
        team_limits=draw(_team_limits(6)),
        team_guarantees=draw(_team_limits(4)),
    )


# Teams: most jobs in team a, some in b or none; a limit for a (0 included: none may run), and
# sometimes for b (teams.py).
_teams = st.sampled_from(["", "a", "a", "b"])


def _team_limits(largest: int) -> st.SearchStrategy[dict[str, int]]:
    return st.one_of(
        st.just({}),
        st.fixed_dictionaries({"a": st.integers(0, largest)}),
        st.fixed_dictionaries({"a": st.integers(0, largest), "b": st.integers(0, largest)}),
    )


@settings(
    max_examples=int(os.environ.get("PLANNER_EXAMPLES", "300")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(_tiny_requests(), st.sampled_from(["auto", "typed", "explicit"]))
def test_plan_matches_exhaustive_search(request: PlanRequest, mode: str) -> None:
    """Every capacity model (auto: pooled levels for a chain of TP degrees, else typed; typed;
    explicit) reaches the exhaustive optimum, placement included."""
    best = _brute_force(request)
    result = plan(request, _mode=mode)
    if best is None:
        event("infeasible")
        assert result.status == "INFEASIBLE"
        return
    event(f"running jobs: {sum(1 for j in result.jobs if j.size)}")
    event(f"changed jobs: {sum(1 for j in result.jobs if j.changed)}")
    event(f"transitions: {sorted(j.transition for j in result.jobs)}")
    assert result.status == "OPTIMAL", result.reason
    assert domain.plan_problems(request, _slots(result)) == []
    assert result.objective == pytest.approx(domain.score(request, _slots(result)))
    # Integer scaling rounds each term to 1 part in 2e9 of the largest one.
    horizon = domain.horizon_seconds(request)
    largest = max(
        abs(domain.weighted_throughput(job, x)) * (horizon + job.transition.seconds("migrate"))
        for job in request.jobs
        for x in domain.allowed_sizes(job)
    )
    assert result.objective == pytest.approx(best, abs=1e-6 * largest + 1e-9)


def test_a_job_on_a_tenth_of_the_cluster_moves_onto_a_spare_rather_than_shrink() -> None:
    """D_run is 30 minutes (a 100-node cluster at 1/(1800 x 99) failures per node-second); a
    node of the 10-node job fails and spares are free. Moving onto one takes 300 s, shrinking
    by a replica 10 s. Over D_run the shrink looks better (9 x 1790 > 10 x 1500), and the next
    re-plans would say so again, so the job would never grow back. Charged over its own horizon
    (the job holds a tenth of the slots, so it is hit a tenth as often), the move pays."""
    nodes = [Node(f"n{i}", 8, healthy=i != 3) for i in range(100)]
    jobs = [
        _job("big", tensor_parallel=8, min_dp=7, max_dp=10, current={f"n{i}": 8 for i in range(10)},
             hit_by_failure=True, transition=Transition(restart_s=30.0, resize_s=10.0, migrate_s=300.0)),
        _job("rest", tensor_parallel=8, min_dp=80, max_dp=80, current={f"n{i}": 8 for i in range(10, 90)},
             pinned=True),
    ]  # fmt: skip
    result = plan(_request(nodes, jobs, rate=1.0 / (1800.0 * 99)))
    assert result.status == "OPTIMAL", result.reason
    assert result.horizon_s == pytest.approx(1800.0)
    big = next(j for j in result.jobs if j.job_id == "big")
    assert (big.size, big.transition) == (80, "migrate"), big
    assert "n3" not in big.slots_by_node


def test_a_shrink_says_whether_its_slots_went_to_another_job() -> None:
    """Alone on the cluster, a job shrunk by its own profile is not told its slots went to
    another job; beside one that grows, it is."""
    d = domain
    nodes = (d.Node("n1", 2, True, "r"), d.Node("n2", 2, True, "r"))

    def job(job_id: str, throughput: dict[int, float], current: dict[str, int]) -> d.Job:
        sizes = sorted(throughput)
        return d.Job(
            job_id=job_id,
            weight=1.0,
            tensor_parallel=1,
            pipeline_parallel=1,
            min_dp=sizes[0],
            max_dp=sizes[-1],
            throughput=throughput,
            current=current,
        )

    alone = job("a", {1: 2e9, 2: 1e9}, {"n1": 2})
    (shrunk,) = plan(d.PlanRequest(nodes=nodes, jobs=(alone,), failure_rate_per_node_per_s=1e-9)).jobs
    assert shrunk.size == 1 and "fewer ranks are worth more to it" in shrunk.reason, shrunk.reason
    crowded = job("a", {2: 1e9, 4: 1.1e9}, {"n1": 2, "n2": 2})
    grower = job("b", {2: 5e9}, {})
    request = d.PlanRequest(nodes=nodes, jobs=(crowded, grower), failure_rate_per_node_per_s=1e-9)
    by_id = {p.job_id: p for p in plan(request).jobs}
    assert by_id["a"].size == 2 and "slots given to other jobs" in by_id["a"].reason, by_id["a"].reason
