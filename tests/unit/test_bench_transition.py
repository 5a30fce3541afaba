"""The transition benchmark's pure parts (failure steps, lost iterations, the coordinator's resume
line, recovery from a job's events, the report's shape and verdicts), so the bench cannot rot
between the rare runs of `make bench-transition`. No cluster and no trainer here."""

from __future__ import annotations

import json

import pytest

from bench import transition
from bench.transition import BaselineSample, Event, Resumed, Sample
from unicron.faults import parse_fault
from unicron.v1 import common_pb2 as pb


def test_failure_steps_are_reproducible_in_range_and_never_on_a_checkpoint() -> None:
    steps = transition.draw_steps(transition.ACTIONS, 20, seed=0)
    assert steps == transition.draw_steps(transition.ACTIONS, 20, seed=0)
    assert steps != transition.draw_steps(transition.ACTIONS, 20, seed=1)
    for action in transition.ACTIONS:
        assert len(steps[action]) == 20
        assert all(55 <= s <= 95 and s % 50 for s in steps[action])
    # An action's draws do not depend on which other actions run.
    assert transition.draw_steps(["resize"], 20, seed=0)["resize"] == steps["resize"]
    assert set(transition.draw_steps(["restart"], 30, seed=0, low=49, high=51)["restart"]) == {49, 51}
    with pytest.raises(ValueError):
        transition.draw_steps(["restart"], 1, seed=0, low=50, high=50)


def test_checkpoint_lost_counts_back_to_the_last_multiple() -> None:
    assert transition.checkpoint_lost(58) == 8
    assert transition.checkpoint_lost(94) == 44
    assert transition.checkpoint_lost(100) == 0
    assert transition.checkpoint_lost(7, interval=10) == 7
    assert transition.checkpoint_lost(23, interval=10) == 3


def test_every_action_has_a_fault_the_cli_accepts() -> None:
    for action in transition.ACTIONS:
        fault = parse_fault(f"{transition.FAULTS[action]}@60", rank=1)
        assert fault.step == 60 and fault.rank == 1
        assert action in transition.EXPECTED_KIND and action in transition.EXPECTED_REMEDY
        assert transition.TARGET_SPEEDUP[action] > 1
    assert parse_fault(transition.FAULTS["reattempt"]).exception_kind == pb.FAILURE_KIND_COLLECTIVE_TIMEOUT
    assert parse_fault(transition.FAULTS["resize"]).exception_kind == pb.FAILURE_KIND_ECC_ERROR


def test_resume_line_of_the_coordinator_is_parsed() -> None:
    line = (
        "training resumed after restart at iteration 51 (state: checkpoint at iteration 50, 44 iterations recomputed)"
    )
    assert transition.parse_resumed(line) == Resumed("restart", 51, "checkpoint", 50, 44)
    live = "training resumed after reattempt at iteration 59 (state: live at iteration 58, 0 iterations recomputed)"
    assert transition.parse_resumed(live) == Resumed("reattempt", 59, "live", 58, 0)
    replan = "training resumed after re-plan at iteration 3 (state: fresh at iteration 0, 0 iterations recomputed)"
    parsed = transition.parse_resumed(replan)
    assert parsed is not None and parsed.remedy == "re-plan" and parsed.source == "fresh"
    assert transition.parse_resumed("training") is None


def test_lost_iterations_trust_the_fault_step_when_the_coordinator_lags() -> None:
    # The coordinator last heard of iteration 50 (a report batch was still in flight) but every
    # rank had completed 58 before the fault fired at 59.
    assert transition.lost_iterations(58, Resumed("reconfigure", 51, "checkpoint", 50, 0)) == 8
    assert transition.lost_iterations(94, Resumed("restart", 51, "checkpoint", 50, 44)) == 44
    assert transition.lost_iterations(58, Resumed("reattempt", 59, "live", 58, 0)) == 0
    assert transition.lost_iterations(58, Resumed("restart", 59, "peer", 58, 0)) == 0


def _events() -> list[Event]:
    return [
        Event("progress", 9.8, 55),
        Event("progress", 9.9, 56),
        Event("progress", 10.0, 57),
        Event("progress", 10.1, 58),
        Event("failure", 10.2, incident_id="inc-1"),
        Event("remedy", 10.21, incident_id="inc-1"),
        Event(
            "resumed",
            14.0,
            message="training resumed after restart at iteration 51 (state: checkpoint at iteration 50, "
            "8 iterations recomputed)",
            incident_id="inc-1",
        ),
        Event("progress", 14.0, 51),
        Event("progress", 14.5, 57),
        Event("progress", 14.6, 58),
        Event("progress", 14.7, 59),
        Event("progress", 14.8, 60),
    ]


def test_recovery_is_read_from_the_events_around_the_first_resume() -> None:
    recovery = transition.recovery_from_events(_events(), detected=10.2)
    assert recovery is not None
    assert recovery["pre_failure_iteration"] == 58
    assert recovery["resumed"] == Resumed("restart", 51, "checkpoint", 50, 8)
    assert recovery["resumed_at"] == 14.0 and recovery["incident_id"] == "inc-1"
    assert recovery["first_iteration"] == 51
    assert recovery["regained_at"] == 14.6
    # Read LOST_SPAN (2) iterations past the failure: iteration 60 done at 14.8; without the
    # failure it would have been at 10.1 + 2 * 0.1.
    assert transition.LOST_SPAN == 2
    assert recovery["lost_s"] == pytest.approx(4.5)
    # The job got further than its progress events show: regain when it is back there.
    assert transition.recovery_from_events(_events(), 10.2, at_least=59)["regained_at"] == 14.7  # type: ignore[index]
    assert transition.recovery_from_events(_events(), detected=15.0) is None
    assert transition.recovery_from_events(_events()[:4], detected=10.2) is None
    # It resumed at iteration 51, which it had done before: no failure-free time to compare.
    assert recovery["free_resumed_at"] is None


def test_a_failure_free_run_s_time_to_the_resumed_iteration_is_its_floor() -> None:
    # A reattempt: the iteration it was in (59) is reported 1.5 s after iteration 58, against
    # 0.1 s per iteration before; a failure-free run would have reported it 0.2 s (a whole
    # cycle of LOST_SPAN iterations) after iteration 57, at 10.2.
    events = [e for e in _events() if e.kind != "resumed" and e.time < 14.0]
    events += [
        Event("resumed", 11.6, message="training resumed after reattempt at iteration 59", incident_id="inc-1"),
        Event("progress", 11.6, 59),
        Event("progress", 11.7, 60),
    ]
    recovery = transition.recovery_from_events(events, detected=10.15)
    assert recovery is not None and recovery["first_iteration"] == 59
    assert recovery["free_resumed_at"] == pytest.approx(10.2)


def test_the_failure_free_time_predicts_a_slow_iteration_slow() -> None:
    # Iterations alternate 3 s (after a snapshot, every even one) and 1 s: the one after 58
    # is slow. Counted from 58 at the mean 2 s, it would be due at 60 s; from 57, a cycle
    # earlier, at 61 s, as it is in a failure-free run.
    done, at = {}, 0.0
    for iteration in range(48, 59):
        at += 3.0 if iteration % 2 else 1.0
        done[iteration] = at
    events = [Event("progress", t, i) for i, t in done.items()]
    events += [Event("resumed", done[58] + 3.5, message="training resumed after reattempt at iteration 59")]
    events += [Event("progress", done[58] + 3.5, 59)]
    recovery = transition.recovery_from_events(events, detected=done[58] + 0.5)
    assert recovery is not None
    assert recovery["free_resumed_at"] == pytest.approx(done[58] + 3.0)


def test_time_lost_is_against_a_failure_free_run() -> None:
    # Reports in batches of two, 0.5 s an iteration: the mean over the window, not the gaps.
    done = {i: 100.0 + 0.5 * (i - i % 2) for i in range(40, 61)}
    assert transition.time_lost(done, 60, next_done=done[60] + 0.5) == pytest.approx(0.0, abs=0.06)
    assert transition.time_lost(done, 60, next_done=done[60] + 3.5) == pytest.approx(3.0, abs=0.06)
    assert transition.time_lost(done, 60, next_done=done[60]) == 0.0  # never negative
    assert transition.time_lost({60: 1.0}, 60, next_done=5.0) is None  # no iteration time
    # A checkpoint made iteration 50 take 20 s: the iteration time is still 0.5 s.
    slow = {i: 100.0 + 0.5 * i + (20.0 if i >= 50 else 0.0) for i in range(40, 61)}
    assert transition.time_lost(slow, 60, next_done=slow[60] + 2.5) == pytest.approx(2.0)
    assert transition.time_lost(done, 61, next_done=200.0) is None  # the failed-at iteration unseen


def test_time_lost_sees_through_a_cycle_of_slow_and_fast_iterations() -> None:
    """A snapshot every other iteration makes the next one slow (100M: 5 s, against 2 s). A
    failure after an even iteration, followed by iterations exactly as a failure-free run
    would have had them, lost nothing; one iteration past it against the median of all
    counted the slow iteration's extra as lost."""
    done, at = {}, 100.0
    for iteration in range(40, 61):
        at += 5.0 if iteration % 2 else 2.0
        done[iteration] = at
    failure_free = {61: done[60] + 5.0, 62: done[60] + 7.0}
    assert transition.time_lost(done, 60, failure_free[62], done_iteration=62, span=2) == pytest.approx(0.0)
    assert transition.time_lost(done, 60, failure_free[62] + 1.0, done_iteration=62, span=2) == pytest.approx(1.0)
    assert transition.time_lost(done, 60, failure_free[61]) == pytest.approx(1.5)  # the old reading


def test_lost_time_ratio_floors_unicrons_side_at_the_report_batching() -> None:
    fast = _sample("reattempt", 0.4, lost_s=0.05)
    (row,) = transition.build_report([fast], [_baseline("reattempt", 5.0, lost_s=12.0)])["actions"]
    assert (row["lost_s_p50"], row["baseline_lost_s_p50"]) == (0.05, 12.0)
    assert row["lost_time_speedup"] == pytest.approx(12.0 / transition.LOST_FLOOR_S)
    (row,) = transition.build_report([_sample("reattempt", 0.4)], [])["actions"]
    assert row["lost_time_speedup"] is None


def test_lost_time_is_also_compared_pair_by_pair_and_to_training_again_against_its_ceiling() -> None:
    # Pairs by drawn step: the baseline lost little at step 12 (near its checkpoint).
    samples = [
        _sample("reattempt", 4.0, lost_s=0.0, step=12, free_s=3.9),
        _sample("reattempt", 5.0, lost_s=0.1, step=18, free_s=4.9),
    ]
    baseline = [_baseline("reattempt", 9.0, lost_s=24.0), _baseline("reattempt", 8.0, lost_s=1.5)]
    baseline[0].step, baseline[1].step = 18, 12
    (row,) = transition.build_report(samples, baseline)["actions"]
    assert row["lost_time_speedup_pairs"] == [7.5, 120.0]
    assert row["lost_time_speedup_min"] == 7.5
    assert row["free_p50_s"] == pytest.approx(4.4)
    assert row["speedup_ceiling"] == pytest.approx(8.5 / 4.4, abs=0.01)


def _sample(action: str, seconds: float | None, lost: int = 0, source: str = "live", **extra: object) -> Sample:
    sample = Sample(
        action=action,
        fault=transition.FAULTS[action],
        rank=0,
        step=58,
        transition_s=seconds,
        cost_transition_s=seconds,
        regain_s=seconds,
        recomputed=lost,
        lost_iterations=lost,
        state_source=source if seconds is not None else "",
        remedy=transition._remedy_name(transition.EXPECTED_REMEDY[action]),
        resumed_by=transition._remedy_name(transition.EXPECTED_REMEDY[action]),
        size_before=2,
        size_after=1 if action == "resize" else 2,
        chain=["X:y"],
    )
    for key, value in extra.items():
        setattr(sample, key, value)
    return sample


def _baseline(action: str, seconds: float | None, lost: int = 8, lost_s: float | None = None) -> BaselineSample:
    return BaselineSample(
        lost_s=lost_s,
        action=action,
        step=58,
        world_before=2,
        world_after=2,
        step_at_kill=58,
        restored_iteration=50,
        state_source="checkpoint",
        lost_iterations=lost,
        restart_s=seconds,
        regain_s=None if seconds is None else seconds + 0.5,
    )


def test_report_has_the_issue_shape_and_is_strict_json() -> None:
    samples = [_sample("reattempt", t) for t in (0.4, 0.5, 0.6)]
    samples += [_sample("restart", t, lost=8, source="checkpoint") for t in (5.0, 6.0, 7.0)]
    baseline = [_baseline("reattempt", t) for t in (9.0, 10.0, 11.0)]
    baseline += [_baseline("restart", t) for t in (9.0, 10.0, 11.0)]
    report = transition.build_report(samples, baseline, extra={"settings": {"repeats": 3}})
    text = json.dumps(report, allow_nan=False)  # NaN would make the file unreadable to strict parsers
    assert json.loads(text) == report
    assert [row["action"] for row in report["actions"]] == ["reattempt", "restart"]
    reattempt, restart = report["actions"]
    for key in ("action", "n", "p50_s", "baseline_p50_s", "speedup", "lost_iterations", "baseline_lost_iterations"):
        assert key in reattempt
    assert reattempt["n"] == 3 and reattempt["p50_s"] == 0.5 and reattempt["baseline_p50_s"] == 10.0
    assert reattempt["speedup"] == 20.0 and reattempt["lost_iterations"] == 0
    assert reattempt["baseline_lost_iterations"] == 8 and reattempt["baseline_regain_p50_s"] == 10.5
    assert reattempt["met"] is True
    assert restart["speedup"] == pytest.approx(10.0 / 6.0, abs=0.01) and restart["speedup_met"] is False
    assert restart["lost_iterations"] == 8 and restart["lost_met"] is False and restart["met"] is False
    assert restart["state_sources"] == {"checkpoint": 3}
    assert report["targets_met"] is False
    assert report["settings"] == {"repeats": 3}


def test_targets_per_action() -> None:
    def row(action: str, seconds: float, base: float, lost: int = 0) -> dict:
        report = transition.build_report([_sample(action, seconds, lost=lost)], [_baseline(action, base)])
        return report["actions"][0]

    assert row("reattempt", 1.0, 10.0)["met"] is True  # exactly 10x
    assert row("reattempt", 1.01, 10.0)["met"] is False
    assert row("restart", 3.0, 9.0)["met"] is True
    assert row("restart", 3.0, 9.0, lost=1)["met"] is False  # fast, but an iteration was lost
    assert row("resize", 5.0, 10.0)["met"] is True
    assert row("resize", 5.1, 10.0)["met"] is False


def test_failures_and_missing_measurements_never_pass() -> None:
    failed = _sample("reattempt", None, error="the job did not resume")
    report = transition.build_report([_sample("reattempt", 0.1), failed], [_baseline("reattempt", 10.0)])
    row = report["actions"][0]
    assert row["n"] == 1 and row["failed_samples"] == 1 and row["met"] is False
    assert "1 sample(s) failed" in transition.verdict_reasons(row)
    no_baseline = transition.build_report([_sample("reattempt", 0.1)], [_baseline("reattempt", None)])
    assert no_baseline["actions"][0]["speedup"] is None and no_baseline["actions"][0]["met"] is False
    assert no_baseline["actions"][0]["p50_s"] == 0.1
    nothing = transition.build_report([], [])
    assert nothing["actions"] == [] and nothing["targets_met"] is False


def test_the_coordinators_undercount_is_reported() -> None:
    sample = _sample("resize", 4.0, lost=8, source="checkpoint", recomputed=0)
    row = transition.build_report([sample], [_baseline("resize", 4.0)])["actions"][0]
    assert row["lost_iterations"] == 8 and row["coordinator_recomputed"] == [0]
    assert row["coordinator_undercounts"] == 1


def test_table_says_why_an_action_fails() -> None:
    samples = [
        _sample("reattempt", 0.5),
        _sample("restart", 8.0, lost=44, source="checkpoint", chain=["PROCESS_EXIT:restart", "PROCESS_EXIT:restart"]),
        _sample("resize", 4.0, lost=8, source="checkpoint"),
    ]
    baseline = [_baseline("reattempt", 10.0), _baseline("restart", 10.0, lost=44), _baseline("resize", 4.0)]
    table = transition.format_table(transition.build_report(samples, baseline))
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["action", "n", "p50_s"]
    reattempt = next(line for line in lines if line.startswith("reattempt "))
    assert reattempt.endswith("PASS") and "20.00x" in reattempt and " live " in reattempt
    restart = next(line for line in lines if line.startswith("restart "))
    assert restart.endswith("FAIL") and "1.25x" in restart and "checkpoint" in restart
    assert any(line.startswith("restart: FAIL: speedup 1.25x < 3x; up to 44 iterations recomputed") for line in lines)
    assert "restart: 1 of 1 sample(s) restored the persistent checkpoint, not a live peer's state" in lines
    assert any(
        "first remedy failed" in line and "PROCESS_EXIT:restart -> PROCESS_EXIT:restart" in line for line in lines
    )
    assert any(line.startswith("resize: FAIL: speedup 1x < 2x") for line in lines)
    assert lines[-1] == "all targets met: False"
