"""bench.load_verdict: a load step is judged only where its generator kept to its schedule, and a
step that broke is a row that says why."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from bench.load_verdict import (
    LAG_LIMIT_MS,
    LOSS_LAG_MS,
    Marks,
    Measured,
    exit_code,
    format_steps,
    format_table,
    judge,
    latency_row,
    losses_while_generator_late,
    skipped_row,
    step_report,
    step_row,
)

ALL_MET = {"rpc_p99": True, "errors": True, "false_node_losses": True, "burst": True, "memory": True}


@pytest.mark.parametrize(
    ("met", "failure", "lag_p99", "died", "judged", "targets_met", "text"),
    [
        (ALL_MET, None, 3.0, 0, True, True, "met"),
        ({**ALL_MET, "rpc_p99": False}, None, 3.0, 0, True, False, "missed: rpc_p99"),
        # The generator fell behind: the coordinator is blamed for nothing, pass or fail.
        ({**ALL_MET, "rpc_p99": False}, None, 80.0, 0, False, None, "not judged: the load generator fell behind"),
        (ALL_MET, None, 80.0, 0, False, None, "not judged: the load generator fell behind (lag p99 80.0 ms)"),
        # At the limit it still kept up.
        (ALL_MET, None, LAG_LIMIT_MS, 0, True, True, "met"),
        ({}, "jobs_starting: ClientError: did not answer in time", 4.0, 0, True, False, "failed: jobs_starting"),
        ({}, "registration: RuntimeError: too slow", 300.0, 0, False, None, "not judged: the load generator fell"),
        ({}, "setup: Unavailable: redis", None, 0, True, False, "failed: setup: Unavailable: redis"),
        (ALL_MET, None, 2.0, 1, False, None, "not judged: the load generator failed (1 agent process(es) died)"),
        (ALL_MET, None, None, 0, False, None, "not judged: the load generator's lag was not measured"),
    ],
)
def test_the_verdict(
    met: dict[str, bool],
    failure: str | None,
    lag_p99: float | None,
    died: int,
    judged: bool,
    targets_met: bool | None,
    text: str,
) -> None:
    verdict = judge(met, failure, lag_p99, died)
    assert (verdict.judged, verdict.targets_met) == (judged, targets_met)
    assert verdict.text.startswith(text)


def test_a_failure_while_the_generator_was_behind_says_both() -> None:
    text = judge({}, "registration: too slow", 120.0).text
    assert text == (
        "not judged: the load generator fell behind (lag p99 120.0 ms); the step failed: registration: too slow"
    )


@pytest.mark.parametrize(
    ("rows", "code"),
    [
        ([{"judged": True, "targets_met": True}, {"judged": False, "targets_met": None}], 0),
        ([{"judged": True, "targets_met": True}, {"judged": True, "targets_met": False}], 1),
        ([{"judged": False, "targets_met": None}, skipped_row(2000, 200, "the 1000-agent step failed")], 2),
        ([], 2),
    ],
)
def test_the_exit_code_says_whether_every_judged_step_met_its_targets(rows: list[dict[str, Any]], code: int) -> None:
    assert exit_code(rows) == code


# Agents 0-499 in one process, 500-999 in another; times in seconds.
QUIET = [(100.0 + i * 0.05, 1.0) for i in range(200)]
STALL = [*QUIET, (105.0, 900.0)]  # woke at 105 s, 0.9 s late: stalled from 104.1 s


@pytest.mark.parametrize(
    ("losses", "lags", "late"),
    [
        ({"sim-00007": 106.0}, [(range(500), STALL), (range(500, 1000), QUIET)], ["sim-00007"]),
        # The other process stalled, not this agent's.
        ({"sim-00007": 106.0}, [(range(500), QUIET), (range(500, 1000), STALL)], []),
        # The stall ended long before the loss: more than the timeout and an interval.
        ({"sim-00007": 110.0}, [(range(500), STALL), (range(500, 1000), QUIET)], []),
        # It began after the loss was declared.
        ({"sim-00007": 104.0}, [(range(500), STALL), (range(500, 1000), QUIET)], []),
        # Below the limit, a stall is the machine's ordinary noise.
        ({"sim-00007": 106.0}, [(range(500), [(105.0, LOSS_LAG_MS - 1)]), (range(500, 1000), QUIET)], []),
        # A process that died loses its agents itself.
        ({"sim-00600": 106.0, "sim-00007": 106.0}, [(range(500), QUIET), (range(500, 1000), None)], ["sim-00600"]),
    ],
)
def test_false_losses_that_coincide_with_the_generators_stall(
    losses: dict[str, float], lags: list[tuple[range, Any]], late: list[str]
) -> None:
    assert losses_while_generator_late(losses, lags) == late


def test_latency_rows_take_a_column_and_a_span() -> None:
    calls = [(1.0, 10.0, 0.5), (2.0, 20.0, 1.5), (3.0, 30.0, 2.5)]
    assert latency_row(calls, 1.5, 3.0) == {"n": 1, "p50_ms": 20.0, "p99_ms": 20.0, "max_ms": 20.0}
    assert latency_row(calls, column=2)["max_ms"] == 2.5
    assert latency_row([], 0.0) == {"n": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


def test_phases_run_until_the_next_one_began() -> None:
    marks = Marks(registration=10.0, jobs_starting=20.0, steady=30.0)
    assert marks.spans() == {"registration": (10.0, 20.0), "jobs_starting": (20.0, 30.0), "steady": (30.0, math.inf)}
    assert marks.reached() == "steady"
    assert Marks().reached() == "setup"


def stats(lag_ms: float, *, t0: float = 1000.0, agents: int = 20) -> dict[str, Any]:
    """Agents' merged statistics: beats of 2 ms every second from t0 for 100 s, the generator
    lagging `lag_ms` throughout."""
    beats = [(t0 + s + i / agents, 2.0, lag_ms) for s in range(100) for i in range(agents)]
    return {
        "heartbeats": beats,
        "progress": [(t, 5.0, lag_ms) for t, _, _ in beats[::10]],
        "errors": {"register:DEADLINE_EXCEEDED": 2},
        "unknown_heartbeats": 0,
        "commands": {"start_workers": 4},
        "vanished": {},
        "loop_lag": [(range(agents), [(t0 + i * 0.05, lag_ms) for i in range(2000)])],
        "processes_died": 0,
    }


def measured(false_losses: dict[str, float] | None = None) -> Measured:
    return Measured(
        registration_s=1.5,
        jobs_running=2,
        rss=[(5.0 * i, 100.0) for i in range(1, 13)],
        cpu_cores=0.3,
        redis_cpu_cores=0.05,
        false_losses=false_losses or {},
        vanished=["sim-00001", "sim-00002"],
        hit={"job-1"},
        detected_s=3.1,
        replanned_s=3.4,
    )


MARKS = Marks(registration=990.0, jobs_starting=1000.0, steady=1010.0, burst=1090.0)
BASELINE = {"agents": 10, "heartbeat": {"n": 100, "p50_ms": 0.5, "p99_ms": 1.0, "max_ms": 2.0}, "errors": {}}
HEADER = {"agents": 20, "jobs": 2, "redis": "single", "redis_replicas": 0, "baseline": BASELINE}


def test_a_step_that_kept_up_is_judged() -> None:
    report = {**HEADER, **step_report(stats(1.0), MARKS, measured(), None, BASELINE)}
    assert report["verdict"] == "met" and report["judged"] and report["targets_met"]
    assert report["generator"]["lag"]["p99_ms"] == 1.0
    assert report["generator"]["heartbeat_send_late"]["p99_ms"] == 1.0
    assert report["phases"]["steady"]["generator_lag"]["n"] > 0
    assert report["registration_retries"] == 2 and report["errors"] == 0
    json.dumps(report, allow_nan=False)  # strict JSON, as write_results writes it
    row = step_row(report)
    assert row["generator_lag_p99_ms"] == 1.0 and row["redis"] == "single" and row["verdict"] == "met"
    assert "generator: loop lag p99" in format_table(report)


def test_a_step_whose_generator_fell_behind_is_not_judged() -> None:
    # 285 false losses while the generator stalled 800 ms: none of them the coordinator's.
    losses = {f"sim-{i:05d}": 1050.0 for i in range(5)}
    report = {**HEADER, **step_report(stats(800.0), MARKS, measured(losses), None, BASELINE)}
    assert report["verdict"] == "not judged: the load generator fell behind (lag p99 800.0 ms)"
    assert report["targets_met"] is None and not report["judged"]
    assert report["false_node_losses"] == report["false_node_losses_while_generator_late"] == 5
    assert report["met"]["false_node_losses"]  # not the coordinator's, were it judged
    assert "(not judged)" in format_table(report)


def test_false_losses_while_the_generator_kept_up_are_the_coordinators() -> None:
    losses = {"sim-00003": 1050.0}
    report = {**HEADER, **step_report(stats(1.0), MARKS, measured(losses), None, BASELINE)}
    assert report["verdict"] == "missed: false_node_losses"
    assert report["false_node_losses_while_generator_late"] == 0


def test_a_step_that_broke_is_a_row_with_its_reason() -> None:
    failure = "jobs_starting: ClientError: the coordinator did not answer in time"
    marks = Marks(registration=990.0, jobs_starting=1000.0)
    report = {**HEADER, **step_report(stats(1.0), marks, Measured(registration_s=293.7), failure, BASELINE)}
    assert report["verdict"] == f"failed: {failure}" and report["judged"] and report["targets_met"] is False
    assert report["generator"]["lag_from"] == "registration"
    format_table(report)
    rows = [step_row(report), skipped_row(4000, 400, "the 2000-agent step failed")]
    table = format_steps(rows)
    assert "failed: jobs_starting" in table and "skipped: the 2000-agent step failed" in table
    json.dumps(rows, allow_nan=False)


def test_a_cluster_that_would_not_start_is_a_failed_row() -> None:
    report = {**HEADER, "baseline": None, **step_report(None, Marks(), Measured(), "setup: Unavailable: x", None)}
    assert report["verdict"] == "failed: setup: Unavailable: x"
    assert report["rpc_p99_ms"] is None and report["generator"]["lag"]["n"] == 0
    format_table(report)
    format_steps([step_row(report)])
