"""The domain model alone: field paths in errors, transition kinds and costs, the throughput
estimate, and the size-only objective."""

from __future__ import annotations

import itertools
import math
from typing import Any

import pytest

from services.planner import domain
from services.planner.domain import Job, Node, PlanRequest, ThroughputEstimate, Transition


def _job(job_id: str, **kw: Any) -> Job:
    args: dict[str, Any] = {"weight": 1.0, "tensor_parallel": 1, "pipeline_parallel": 1, "min_dp": 1, "max_dp": 8}
    args.update(kw)
    return Job(job_id, **args)


# --- errors name the field ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make,path",
    [
        (lambda: _job("a", weight=math.nan), "request.jobs[2].weight"),
        (lambda: _job("a", tensor_parallel=2, throughput={16: 1e14, 3: 1e14}), "request.jobs[2].throughput[3]"),
        (lambda: _job("a", throughput={4: -1.0}), "request.jobs[2].throughput[4]"),
        (lambda: _job("a", current={"n7": 0}), "request.jobs[2].current['n7']"),
        (lambda: _job("a", pipeline_parallel=-2), "request.jobs[2].pipeline_parallel"),
    ],
)
def test_field_scope_gives_the_full_path(make: Any, path: str) -> None:
    with pytest.raises(domain.FieldError) as err, domain.field_scope("request.jobs[2]"):
        make()
    assert str(err.value).startswith(f"{path}: ")
    assert err.value.path == path


def test_nested_objects_scope_too() -> None:
    with pytest.raises(ValueError, match=r"^request\.jobs\[0\]\.transition\.migrate_s: "):
        with domain.field_scope("request.jobs[0].transition"):
            Transition(migrate_s=-1.0)
    with pytest.raises(ValueError, match=r"^request\.jobs\[1\]\.estimate\.mfu: "):
        with domain.field_scope("request.jobs[1].estimate"):
            ThroughputEstimate(parameters=1e9, tokens_per_step=1e6, mfu=1.5)
    with pytest.raises(ValueError, match=r"^Job\('a'\)\.weight: "):
        _job("a", weight=0.0)  # unscoped: named by the object


@pytest.mark.parametrize(
    "nodes,jobs,path",
    [
        ([Node("n7", 8)], [_job("a", current={"n9": 2})], r"request\.jobs\[0\]\.current\['n9'\]: unknown node"),
        ([Node("n7", 8)], [_job("a", current={"n7": 16}, max_dp=16)], r"request\.jobs\[0\]\.current\['n7'\]: 16 slots"),
        (
            [Node("n7", 8)],
            [_job("a", current={"n7": 4}), _job("b", current={"n7": 3}), _job("c", current={"n7": 2})],
            r"request\.jobs\[2\]\.current\['n7'\]: jobs hold 9 slots",
        ),
        ([Node("n", 1), Node("n", 2)], [], r"request\.nodes\[1\]\.node_id: duplicate"),
        ([Node("n", 1)], [_job("a"), _job("b"), _job("a")], r"request\.jobs\[2\]\.job_id: duplicate"),
    ],
)
def test_validate_names_the_path(nodes: list[Node], jobs: list[Job], path: str) -> None:
    with pytest.raises(ValueError, match=path):
        domain.validate(PlanRequest(tuple(nodes), tuple(jobs), 0.0))


def test_a_lost_node_is_not_held_to_its_slot_count() -> None:
    # A node that died may report 0 slots; the jobs on it still name it.
    request = PlanRequest((Node("n1", 0, healthy=False),), (_job("a", current={"n1": 8}),), 0.0)
    domain.validate(request)


def test_request_fields() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"relative_gap": 1.0}, "relative_gap"),
        ({"time_limit_s": 0.0}, "time_limit_s"),
    ]
    for kw, field in cases:
        with pytest.raises(ValueError, match=rf"^request\.{field}: "):
            PlanRequest((), (), 0.0, **kw)


# --- transitions -----------------------------------------------------------------------------------


def test_transition_seconds_by_kind() -> None:
    t = Transition(restart_s=10.0, resize_s=20.0, migrate_s=30.0, state_bytes=2.5e9, bandwidth_bytes_per_s=1.25e9)
    assert (t.seconds("restart"), t.seconds("resize"), t.seconds("migrate")) == (10.0, 20.0, 32.0)
    # A more general mechanism can do a special change, so no kind costs more than a general one.
    odd = Transition(restart_s=100.0, resize_s=50.0, migrate_s=5.0)
    assert (odd.seconds("restart"), odd.seconds("resize"), odd.seconds("migrate")) == (5.0, 5.0, 5.0)
    with pytest.raises(ValueError, match="unknown transition kind"):
        t.seconds("teleport")


def test_transition_kind_follows_the_placement() -> None:
    running = _job("a", current={"n1": 4, "n2": 4})
    assert domain.transition_kind(running, {"n1": 4, "n2": 4}) is None  # kept
    assert domain.transition_kind(running, {}) is None  # paused: earns and pays nothing
    assert domain.transition_kind(running, {"n1": 4}) == "resize"  # shrunk onto its own nodes
    assert domain.transition_kind(running, {"n1": 8, "n2": 4}) == "resize"  # regrown there
    assert domain.transition_kind(running, {"n1": 4, "n3": 4}) == "migrate"  # gained n3
    hit = _job("b", current={"n1": 4}, hit_by_failure=True)
    assert domain.transition_kind(hit, {"n1": 4}) == "restart"
    assert domain.transition_kind(_job("c"), {"n1": 4}) == "migrate"  # a start


def test_job_value_charges_the_kind() -> None:
    job = _job("a", current={"n1": 4, "n2": 4}, transition=Transition(resize_s=10.0, migrate_s=100.0))
    f8, f4 = domain.weighted_throughput(job, 8), domain.weighted_throughput(job, 4)
    horizon = domain.Horizon(1000.0, healthy_slots=8)
    assert domain.job_value(job, {"n1": 4, "n2": 4}, horizon) == f8 * 1000.0
    assert domain.job_value(job, {"n1": 4}, horizon) == f4 * (1000.0 - 0.5 * 10.0)  # on half the slots
    assert domain.job_value(job, {"n3": 8}, horizon) == f8 * 900.0


@pytest.mark.parametrize(
    ("seconds", "healthy", "x", "share"),
    [
        (1800.0, 1000, 100, 0.1),  # a tenth of the cluster: hit at a tenth of its rate
        (1800.0, 1000, 1000, 1.0),  # the whole cluster: D_run is its own horizon
        (1800.0, 1000, 1, 1800.0 / domain.DEFAULT_HORIZON_S),  # no job's horizon past a day
        (domain.DEFAULT_HORIZON_S, 1000, 100, 1.0),  # no failures expected: charged whole
        (1800.0, 0, 8, 1.0),  # nothing healthy
    ],
)
def test_a_transition_is_charged_over_the_jobs_own_horizon(seconds: float, healthy: int, x: int, share: float) -> None:
    assert domain.Horizon(seconds, healthy).share(x) == pytest.approx(share)


# --- throughput ---------------------------------------------------------------------------------


def test_estimate_formula() -> None:
    est = ThroughputEstimate(parameters=7e9, tokens_per_step=4 * 2**20)
    # DP = 1: no gradient all-reduce, pure compute at MFU x peak per GPU.
    assert est.flops(2, 2, 4) == pytest.approx(4 * domain.GPU_PEAK_FLOPS * domain.DEFAULT_MFU)
    # By hand for DP = 4 on TP 2 x PP 2.
    work = 6 * 7e9 * 4 * 2**20
    compute = work / (16 * 989e12 * 0.4)
    comm = 2 * 3 / 4 * (4 * 7e9 / 4) / 50e9
    assert est.flops(2, 2, 16) == pytest.approx(work / (compute + 0.5 * comm))


def test_estimate_is_monotone_and_sublinear() -> None:
    job = _job("a", tensor_parallel=8, pipeline_parallel=4, min_dp=1, max_dp=32,
               estimate=ThroughputEstimate(parameters=70e9, tokens_per_step=4 * 2**20))  # fmt: skip
    sizes = domain.allowed_sizes(job)
    flops = [domain.throughput(job, x) for x in sizes]
    assert all(b > a for a, b in itertools.pairwise(flops))
    per_gpu = [f / x for f, x in zip(flops, sizes, strict=True)]
    assert all(b < a for a, b in itertools.pairwise(per_gpu))
    # Exposed communication larger than compute: more data parallelism only slows it down.
    tiny_batch = ThroughputEstimate(parameters=70e9, tokens_per_step=1024.0)
    assert tiny_batch.flops(8, 4, 64) < tiny_batch.flops(8, 4, 32)


def test_profile_beats_estimate_beats_linear_default() -> None:
    est = ThroughputEstimate(parameters=1e9, tokens_per_step=1e6)
    assert domain.throughput(_job("a", throughput={4: 7.0}, estimate=est), 4) == 7.0
    assert domain.throughput(_job("a", estimate=est), 4) == est.flops(1, 1, 4)
    assert domain.throughput(_job("a"), 4) == 4 * domain.ESTIMATED_FLOPS_PER_SLOT


# --- size-only ------------------------------------------------------------------------------------


def test_size_only_kinds() -> None:
    nodes = {"n1": Node("n1", 8), "n2": Node("n2", 8, healthy=False)}
    job = _job("a", tensor_parallel=2, max_dp=8, current={"n1": 6, "n2": 4})
    assert domain.size_only_kind(job, 0, nodes) is None
    assert domain.size_only_kind(job, 6, nodes) == "resize"  # fits on what it holds on n1
    assert domain.size_only_kind(job, 10, nodes) == "migrate"  # its old size needs a new node
    kept = _job("b", current={"n1": 2})
    assert domain.size_only_kind(kept, 2, nodes) is None
    assert domain.size_only_kind(kept, 1, nodes) == "resize"
    assert domain.size_only_kind(_job("c", current={"n1": 2}, hit_by_failure=True), 2, nodes) == "restart"
    horizon = domain.Horizon(100.0, healthy_slots=8)
    assert domain.size_options(_job("d", pinned=True, current={"n1": 3}), nodes, horizon).keys() == {3}
    assert 0 not in domain.size_options(_job("e", preemptible=False), nodes, horizon)
