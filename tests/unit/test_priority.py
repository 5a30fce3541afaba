"""Priority classes (services/coordinator/priority.py) by tables: the weight and preemption a
job gets from its class, what only an admin may do, and the classes file's errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from services.coordinator import priority
from unicron.errors import InvalidArgument, PermissionDenied
from unicron.v1 import common_pb2


def spec(priority_class: str = "", weight: float = 0.0, preemptible: bool = False) -> common_pb2.JobSpec:
    return common_pb2.JobSpec(name="j", priority_class=priority_class, weight=weight, preemptible=preemptible)


@pytest.mark.parametrize(
    ("given", "admin", "want_class", "want_weight", "want_preemptible"),
    [
        (spec(), False, "research", 1.0, False),  # no class: the default's weight
        (spec(weight=1.0), False, "research", 1.0, False),  # 1.0: what normalization fills in
        (spec("production"), False, "production", 10.0, False),
        (spec("production", weight=1.0), False, "production", 10.0, False),  # unset, not a raw 1.0
        (spec("best-effort"), False, "best-effort", 0.1, True),  # the class preempts
        (spec("research", preemptible=True), False, "research", 1.0, True),  # a user may offer it
        (spec("best-effort", preemptible=False), False, "best-effort", 0.1, True),  # but not refuse it
        (spec(weight=4.0), True, "research", 4.0, False),  # an admin's raw weight is kept
        (spec("production", weight=2.5), True, "production", 2.5, False),
        (spec("production", weight=10.0), False, "production", 10.0, False),  # the class's own: not raw
    ],
)
def test_a_job_gets_its_class(
    given: common_pb2.JobSpec, admin: bool, want_class: str, want_weight: float, want_preemptible: bool
) -> None:
    out = priority.apply(given, priority.BUILT_IN, admin)
    assert (out.priority_class, out.weight, out.preemptible) == (want_class, want_weight, want_preemptible)
    assert given.priority_class == spec(given.priority_class).priority_class  # the input is not changed


def test_an_unknown_class_is_invalid_naming_the_field_and_the_classes() -> None:
    with pytest.raises(InvalidArgument) as caught:
        priority.apply(spec("urgent"), priority.BUILT_IN, admin=True)
    assert caught.value.field == "spec.priority_class"
    assert "'urgent'" in str(caught.value) and "best-effort, production, research" in str(caught.value)


@pytest.mark.parametrize("weight", [1e9, 2.0, 0.5])
def test_only_an_admin_sets_a_raw_weight(weight: float) -> None:
    with pytest.raises(PermissionDenied, match=r"spec\.weight: only an admin"):
        priority.apply(spec(weight=weight), priority.BUILT_IN, admin=False)


def test_a_classes_file_replaces_the_built_in_ones(tmp_path: Path) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text("classes:\n  gold: {weight: 5}\n  spot: {weight: 0.2, preemptible: true}\ndefault: spot\n")
    loaded = priority.load(path)
    assert loaded.default == "spot" and loaded.classes["gold"] == priority.PriorityClass("gold", 5.0, False)
    assert priority.apply(spec(), loaded, admin=False).weight == 0.2


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("", "expected 'classes"),
        ("classes:\n  gold: {weight: 5}\ndefault: silver\n", "default 'silver' is not one of the classes (gold)"),
        ("classes:\n  gold: {weight: 0}\ndefault: gold\n", "weight must be a number above 0"),
        ("classes:\n  gold: {weight: true}\ndefault: gold\n", "weight must be a number above 0"),
        ("classes:\n  Gold: {weight: 1}\ndefault: Gold\n", "must be lowercase"),
        ("classes:\n  gold: {weight: 1, quota: 3}\ndefault: gold\n", "takes weight and preemptible only"),
    ],
)
def test_a_bad_classes_file_is_named(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "classes.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=re.escape(problem)):
        priority.load(path)
