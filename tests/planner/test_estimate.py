"""Throughput without a profile: the estimate's shape at the measurement's level, and the
reason a plan gives for a size."""

from __future__ import annotations

import pytest

from services.planner import domain, explain
from services.planner.domain import Job, ThroughputEstimate
from services.planner.estimate import ESTIMATED_FLOPS_PER_SLOT, modelled_flops

EST = ThroughputEstimate(parameters=1e6, tokens_per_step=4096.0)
COMM2 = EST.exposed_comm_seconds(1, 1, 2)


@pytest.mark.parametrize(
    ("estimate", "measured", "x", "expected"),
    [
        # No measurement: the model, or the per-slot assumption.
        (None, {}, 3, 3 * ESTIMATED_FLOPS_PER_SLOT),
        (EST, {}, 2, EST.flops(1, 1, 2)),
        # At a measured size, the measurement, whatever the model says.
        (EST, {1: 5e9}, 1, 5e9),
        (None, {2: 7e9}, 2, 7e9),
        # Without a model: per slot, at the nearest measured size's rate (a tie: the smaller).
        (None, {2: 8e9}, 4, 16e9),
        (None, {1: 1e9, 3: 6e9}, 2, 2e9),
        # With one: the model's all-reduce, with the compute measured at size 1 (all of its
        # step: one rank reduces nothing), which is 1000x slower than the model's GPU.
        (EST, {1: EST.flops(1, 1, 1) / 1000}, 2, EST.work / (1000 * EST.work / EST.flops(1, 1, 1) / 2 + COMM2)),
        # Measured at 2, the model's all-reduce there comes off the step before the compute
        # is scaled to 1 rank.
        (EST, {2: 1e9}, 1, EST.work / ((EST.work / 1e9 - COMM2) * 2)),
        # A measurement faster than the model's network allows keeps a tenth for compute.
        (EST, {2: 1e15}, 1, EST.work / (0.1 * EST.work / 1e15 * 2)),
    ],
)
def test_modelled_flops(
    estimate: ThroughputEstimate | None, measured: dict[int, float], x: int, expected: float
) -> None:
    assert modelled_flops(estimate, 1, 1, x, measured) == pytest.approx(expected)


def _job(**kwargs: object) -> Job:
    base: dict[str, object] = {"job_id": "a", "weight": 1.0, "tensor_parallel": 1, "pipeline_parallel": 1}
    base.update({"min_dp": 1, "max_dp": 4})
    base.update(kwargs)
    return Job(**base)  # type: ignore[arg-type]


def test_a_profile_wins_over_measurements() -> None:
    job = _job(throughput={1: 1e9, 2: 3e9}, measured={1: 5e9})
    assert domain.throughput(job, 1) == 1e9
    assert explain.throughput_basis(job, 1) == "profiled"


def test_a_bad_measurement_is_refused_naming_it() -> None:
    with pytest.raises(domain.FieldError, match=r"measured\[2\]"):
        _job(measured={2: -1.0})


def test_the_reason_names_each_size_and_where_its_flops_come_from() -> None:
    job = _job(estimate=EST, measured={1: 5e9})
    text = explain.throughput_text(job, 1)
    assert text.startswith("FLOP/s by size 1: 5e+09 measured, 2: ")
    assert "2: " in text and "estimated from measured compute" in text and "4: " in text
    many = _job(min_dp=1, max_dp=40)
    shown = explain.throughput_text(many, 20)
    assert shown.count(":") <= explain.SIZES_SHOWN and "1: " in shown and "40: " in shown and "20: " in shown
