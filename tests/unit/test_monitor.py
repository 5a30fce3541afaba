from __future__ import annotations

import math
import random
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from unicron.monitor import Finding, JobMonitor, MonitorSettings, ReportRejected, robust_mean
from unicron.v1 import common_pb2

HANG = common_pb2.FAILURE_KIND_TASK_HANG
STRAGGLER = common_pb2.FAILURE_KIND_STRAGGLER


def make(ranks: tuple[int, ...] = (0, 1), started_at: float = 100.0, **overrides: float) -> JobMonitor:
    return JobMonitor("job-a", 2, ranks, MonitorSettings(**overrides), started_at)  # type: ignore[arg-type]


def run_steady(
    monitor: JobMonitor,
    iterations: int,
    period: float,
    start: float,
    first_iteration: int = 1,
    compute: dict[int, float] | None = None,
) -> float:
    """Every rank finishes each iteration `period` after the previous one; returns the time
    of the last report."""
    now = start
    for i in range(first_iteration, first_iteration + iterations):
        now += period
        for rank in sorted(monitor.ranks):
            c = (compute or {}).get(rank, period * 0.6)
            monitor.observe(rank, i, period, c, now)
    return now


def hangs(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind == HANG]


def stragglers(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.kind == STRAGGLER]


# --- settings --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("k", 1.0),
        ("k", math.nan),
        ("k", math.inf),
        ("floor_s", -0.1),
        ("floor_s", math.nan),
        ("warmup_iterations", 0),
        ("window", 0),
        ("straggler_ratio", 1.0),
        ("straggler_ratio", math.inf),
        ("straggler_min_iterations", 0),
        ("straggler_min_iterations", 21),
    ],
)
def test_settings_reject_bad_values_naming_the_field(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        MonitorSettings(**{field: value})  # type: ignore[arg-type]


def test_defaults_match_the_design() -> None:
    s = MonitorSettings()
    assert (s.k, s.floor_s, s.warmup_iterations, s.window) == (3.0, 0.75, 3, 20)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"ranks": ()},
        {"job_id": ""},
        {"generation": -1},
        {"started_at": math.nan},
    ],
)
def test_monitor_rejects_bad_construction(kwargs: dict[str, object]) -> None:
    args: dict[str, object] = {
        "job_id": "j",
        "generation": 0,
        "ranks": (0,),
        "settings": MonitorSettings(),
        "started_at": 0.0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError):
        JobMonitor(**args)  # type: ignore[arg-type]


# --- robust mean -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        ([5.0], 5.0),
        ([1.0, 3.0], 2.0),
        ([30.0, 1.0, 1.0], 1.0),  # a compile-time first iteration is ignored
        ([1.0] * 19 + [60.0], 1.0),  # a checkpoint is discarded outright
        ([1.0, 3.0] * 10, 2.0),  # two modes: between them, not the faster one
        ([1.0, 2.0, 3.0, 4.0, 100.0], 3.0),
    ],
)
def test_robust_mean(samples: list[float], expected: float) -> None:
    assert robust_mean(samples) == pytest.approx(expected)


# --- hang --------------------------------------------------------------------------------


def test_no_hang_during_warm_up() -> None:
    monitor = make(warmup_iterations=3)
    last = run_steady(monitor, 2, 1.0, 100.0)
    for later in (10.0, 100.0, 10_000.0):
        assert monitor.check(last + later) == []


def test_no_hang_before_any_iteration() -> None:
    # Rendezvous and start-up hangs are for process supervision and collective timeouts.
    monitor = make()
    assert monitor.check(1e9) == []


@pytest.mark.parametrize(
    ("period", "threshold"),
    [
        (1.0, 3.0),  # k x mean
        (5.0, 15.0),
        (0.1, 2.0),  # very fast iterations: the floor applies
        (0.5, 2.0),
        (0.75, 2.25),
    ],
)
def test_hang_exactly_after_the_threshold_and_not_before(period: float, threshold: float) -> None:
    monitor = make(floor_s=2.0)
    last = run_steady(monitor, 10, period, 100.0)
    assert monitor.mean_iteration_s == pytest.approx(period)
    assert monitor.hang_due_at() == pytest.approx(last + threshold)  # when an observer should look
    assert monitor.check(last + threshold - 1e-6) == []
    assert monitor.check(last + threshold) == []  # "within" the threshold is not a hang
    [finding] = monitor.check(last + threshold + 1e-6)
    assert finding.kind == HANG
    assert (finding.job_id, finding.generation, finding.rank) == ("job-a", 2, None)
    assert finding.first_seen == pytest.approx(last + threshold)  # not the time of the check
    assert finding.evidence["threshold_s"] == pytest.approx(threshold)
    assert finding.evidence["mean_s"] == pytest.approx(period)
    assert finding.evidence["silent_s"] == pytest.approx(threshold + 1e-6)
    assert finding.evidence["last_iteration"] == 10.0
    assert "no iteration for" in finding.message
    assert monitor.hang_due_at() is None  # reported: nothing more is due until progress re-arms it


def test_no_hang_is_due_during_warm_up() -> None:
    monitor = make(warmup_iterations=3)
    assert monitor.hang_due_at() is None
    last = run_steady(monitor, 3, 0.1, 100.0)
    assert monitor.hang_due_at() == pytest.approx(last + 0.75)  # the default floor


def test_hang_first_seen_does_not_depend_on_when_checked() -> None:
    monitor = make()
    last = run_steady(monitor, 10, 1.0, 100.0)
    [finding] = monitor.check(last + 500.0)
    assert finding.first_seen == pytest.approx(last + 3.0)
    assert finding.evidence["silent_s"] == pytest.approx(500.0)


def test_hang_reported_once_per_silent_episode_and_rearmed_by_progress() -> None:
    monitor = make()
    last = run_steady(monitor, 10, 1.0, 100.0)
    assert len(hangs(monitor.check(last + 4.0))) == 1
    for later in (5.0, 50.0, 500.0):
        assert monitor.check(last + later) == []
    # Progress resumes: one more iteration re-arms the detector.
    resumed = last + 600.0
    monitor.observe(0, 11, 1.0, 0.6, resumed)
    monitor.observe(1, 11, 1.0, 0.6, resumed)
    assert monitor.check(resumed + 2.9) == []
    assert len(hangs(monitor.check(resumed + 3.1))) == 1


def test_progress_clock_is_the_first_completion_of_an_iteration() -> None:
    monitor = make(ranks=(0, 1, 2))
    last = run_steady(monitor, 10, 1.0, 100.0)
    # Rank 0 finishes iteration 11; the others report it a little later (same event).
    monitor.observe(0, 11, 1.0, 0.6, last + 1.0)
    monitor.observe(1, 11, 1.0, 0.6, last + 1.5)
    monitor.observe(2, 11, 1.0, 0.6, last + 1.9)
    assert monitor.last_progress == last + 1.0
    [finding] = monitor.check(last + 1.0 + 3.0 + 1e-6)
    assert finding.first_seen == pytest.approx(last + 4.0)


def test_one_slow_iteration_does_not_inflate_the_threshold() -> None:
    monitor = make()
    last = run_steady(monitor, 10, 1.0, 100.0)
    # A checkpoint: one 60 s iteration (reported and observed as such).
    last += 60.0
    monitor.observe(0, 11, 60.0, 0.6, last)
    monitor.observe(1, 11, 60.0, 0.6, last)
    monitor.check(last)  # the silence itself may have been a hang episode; that is over now
    last = run_steady(monitor, 5, 1.0, last, first_iteration=12)
    mean = monitor.mean_iteration_s
    assert mean is not None and mean < 1.1
    assert len(hangs(monitor.check(last + 3.5))) == 1


def test_a_moderately_slow_iteration_is_not_a_hang() -> None:
    monitor = make()
    last = run_steady(monitor, 10, 1.0, 100.0)
    for t in (0.5, 1.5, 2.5, 2.9):
        assert monitor.check(last + t) == []
    monitor.observe(0, 11, 2.9, 0.6, last + 2.9)
    assert monitor.check(last + 2.9 + 2.9) == []


def test_observed_spacing_counts_when_the_trainer_under_reports() -> None:
    # The trainer says 0.5 s but reports arrive every 1.5 s (data loading outside its
    # timer): the threshold must follow what the observer sees.
    monitor = make(floor_s=0.0)
    now = 100.0
    for i in range(1, 11):
        now += 1.5
        monitor.observe(0, i, 0.5, 0.3, now)
    assert monitor.mean_iteration_s == pytest.approx(1.5)
    assert monitor.check(now + 4.4) == []


def test_warm_up_iterations_do_not_dominate_the_mean() -> None:
    monitor = make(warmup_iterations=3)
    monitor.observe(0, 1, 40.0, 0.0, 140.0)  # rendezvous + compile
    monitor.observe(0, 2, 1.0, 0.0, 141.0)
    monitor.observe(0, 3, 1.0, 0.0, 142.0)
    assert monitor.mean_iteration_s == pytest.approx(1.0)
    assert len(hangs(monitor.check(145.1))) == 1


def test_a_rank_claiming_a_huge_iteration_cannot_freeze_the_clock() -> None:
    monitor = make(ranks=(0, 1))
    last = run_steady(monitor, 10, 1.0, 100.0)
    monitor.observe(0, 10**12, 1.0, 0.6, last + 1.0)  # garbage, but not provably so
    now = last + 1.0
    for i in range(11, 40):  # rank 1 keeps training
        now += 1.0
        monitor.observe(1, i, 1.0, 0.6, now)
        assert monitor.check(now + 0.9) == []


# --- straggler ---------------------------------------------------------------------------


def test_straggler_detected_for_a_rank_with_twice_the_compute() -> None:
    monitor = make(ranks=(0, 1, 2, 3))
    compute = {0: 0.5, 1: 0.5, 2: 1.0, 3: 0.5}
    last = run_steady(monitor, 7, 1.0, 100.0, compute=compute)
    # 3 warm-up iterations do not count: 4 samples, fewer than straggler_min_iterations.
    assert stragglers(monitor.check(last)) == []
    last = run_steady(monitor, 1, 1.0, last, first_iteration=8, compute=compute)
    [finding] = stragglers(monitor.check(last))
    assert finding.rank == 2
    assert finding.first_seen == last
    assert finding.evidence["score"] == pytest.approx(2.0)
    assert finding.evidence["rank_compute_s"] == pytest.approx(1.0)
    assert finding.evidence["median_compute_s"] == pytest.approx(0.5)
    assert monitor.scores() == pytest.approx({0: 1.0, 1: 1.0, 2: 2.0, 3: 1.0})
    # Reported once while it stays slow.
    last = run_steady(monitor, 5, 1.0, last, first_iteration=9, compute=compute)
    assert stragglers(monitor.check(last)) == []


def test_straggler_with_only_two_ranks() -> None:
    monitor = make(ranks=(0, 1))
    last = run_steady(monitor, 9, 1.0, 100.0, compute={0: 0.4, 1: 0.8})
    assert [f.rank for f in stragglers(monitor.check(last))] == [1]


def test_jitter_is_not_a_straggler() -> None:
    rng = random.Random(7)
    monitor = make(ranks=tuple(range(8)))
    now = 100.0
    for i in range(1, 200):
        now += 1.0
        for rank in range(8):
            monitor.observe(rank, i, 1.0, 0.5 * rng.uniform(0.7, 1.4), now)
        assert stragglers(monitor.check(now)) == []
    assert all(0.8 < s < 1.25 for s in monitor.scores().values())


def test_one_slow_compute_report_is_not_a_straggler() -> None:
    monitor = make(ranks=(0, 1, 2))
    compute = {0: 0.5, 1: 0.5, 2: 0.5}
    last = run_steady(monitor, 10, 1.0, 100.0, compute=compute)
    monitor.observe(2, 11, 1.0, 5.0, last + 1.0)  # one bad step (e.g. a page fault storm)
    assert stragglers(monitor.check(last + 1.0)) == []


def test_straggler_rearms_after_recovery() -> None:
    monitor = make(ranks=(0, 1, 2))
    slow = {0: 0.5, 1: 0.5, 2: 1.0}
    fast = {0: 0.5, 1: 0.5, 2: 0.5}
    last = run_steady(monitor, 10, 1.0, 100.0, compute=slow)
    assert len(stragglers(monitor.check(last))) == 1
    last = run_steady(monitor, 20, 1.0, last, first_iteration=11, compute=fast)
    assert stragglers(monitor.check(last)) == []
    assert monitor.scores()[2] == pytest.approx(1.0)
    last = run_steady(monitor, 20, 1.0, last, first_iteration=31, compute=slow)
    assert [f.rank for f in stragglers(monitor.check(last))] == [2]


def test_unknown_compute_gives_no_straggler_verdict() -> None:
    monitor = make(ranks=(0, 1, 2))
    last = run_steady(monitor, 10, 1.0, 100.0, compute={0: 0.0, 1: 0.0, 2: 0.0})
    assert monitor.scores() == {}
    assert stragglers(monitor.check(last)) == []


# --- bad input ---------------------------------------------------------------------------


BAD_REPORTS = [
    pytest.param(0, 11, -1.0, 0.5, id="negative seconds"),
    pytest.param(0, 11, math.nan, 0.5, id="nan seconds"),
    pytest.param(0, 11, math.inf, 0.5, id="inf seconds"),
    pytest.param(0, 11, 1.0, -0.5, id="negative compute"),
    pytest.param(0, 11, 1.0, math.nan, id="nan compute"),
    pytest.param(0, 11, 1.0, math.inf, id="inf compute"),
    pytest.param(0, 9, 1.0, 0.5, id="iteration backwards"),
    pytest.param(0, 10, 1.0, 0.5, id="iteration repeated"),
    pytest.param(0, -3, 1.0, 0.5, id="negative iteration"),
    pytest.param(7, 11, 1.0, 0.5, id="unknown rank"),
]


def snapshot(monitor: JobMonitor) -> tuple[object, ...]:
    return (
        monitor.mean_iteration_s,
        monitor.scores(),
        monitor.last_progress,
        monitor.last_iteration,
        monitor.iterations_completed,
    )


@pytest.mark.parametrize(("rank", "iteration", "seconds", "compute"), BAD_REPORTS)
def test_bad_report_is_rejected_and_changes_nothing(rank: int, iteration: int, seconds: float, compute: float) -> None:
    monitor = make(ranks=(0, 1, 2))
    twin = make(ranks=(0, 1, 2))
    compute_by_rank = {0: 0.5, 1: 0.5, 2: 0.9}
    last = run_steady(monitor, 10, 1.0, 100.0, compute=compute_by_rank)
    run_steady(twin, 10, 1.0, 100.0, compute=compute_by_rank)
    before = snapshot(monitor)
    with pytest.raises(ReportRejected):
        monitor.observe(rank, iteration, seconds, compute, last + 0.5)
    assert snapshot(monitor) == before
    # And the verdicts that follow are the twin's, which never saw the bad report.
    for t in (last + 1.0, last + 2.9, last + 3.1, last + 100.0):
        assert monitor.check(t) == twin.check(t)


def test_non_finite_clock_is_rejected() -> None:
    monitor = make()
    with pytest.raises(ReportRejected):
        monitor.observe(0, 1, 1.0, 0.5, math.nan)
    assert monitor.iterations_completed == 0


def test_a_flood_of_rejected_reports_creates_no_incident() -> None:
    monitor = make(ranks=(0, 1))
    last = run_steady(monitor, 10, 1.0, 100.0)
    for n in range(10_000):
        with pytest.raises(ReportRejected):
            monitor.observe(n % 2, 10, 0.001, 0.001, last + n * 1e-5)
    assert monitor.check(last + 2.9) == []
    assert monitor.mean_iteration_s == pytest.approx(1.0)


def test_a_flood_of_valid_reports_is_cheap() -> None:
    monitor = make(ranks=tuple(range(8)))
    reports = [(rank, i, 0.1, 0.05 + 0.001 * rank, i * 0.1) for i in range(1, 12_501) for rank in range(8)]
    started = time.perf_counter()
    for rank, iteration, seconds, compute, now in reports:
        monitor.observe(rank, iteration, seconds, compute, now)
    elapsed = time.perf_counter() - started
    assert len(reports) == 100_000
    # A bound for the complexity, not a benchmark: O(1) per report takes well under a second
    # on an idle machine, a window scan per report would take minutes; the slack is for load.
    assert elapsed < 10.0, f"100k observes took {elapsed:.2f}s"
    assert monitor.iterations_completed == 12_500


# --- property ----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    period=st.floats(min_value=0.01, max_value=100.0),
    factors=st.lists(st.floats(min_value=0.7, max_value=1.3), min_size=1, max_size=60),
    skews=st.lists(st.floats(min_value=0.0, max_value=0.05), min_size=1, max_size=8),
    probes=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=4),
    k=st.sampled_from([2.0, 3.0, 5.0]),
    floor_s=st.sampled_from([0.0, 0.5, 2.0]),
)
def test_steady_on_time_reports_never_hang(
    period: float, factors: list[float], skews: list[float], probes: list[float], k: float, floor_s: float
) -> None:
    """Iteration times within +-30% of a steady period and ranks up to 5% of a period apart:
    however often and whenever checked between reports, no hang is found."""
    ranks = tuple(range(len(skews)))
    monitor = JobMonitor("j", 0, ranks, MonitorSettings(k=k, floor_s=floor_s, warmup_iterations=1), 0.0)
    finished = 0.0
    events: list[tuple[float, int, int, float]] = []
    for iteration, factor in enumerate(factors, start=1):
        duration = period * factor
        finished += duration
        events.extend((finished + skew * period, rank, iteration, duration) for rank, skew in enumerate(skews))
    events.sort()
    for (at, rank, iteration, duration), (next_at, *_) in zip(
        events, [*events[1:], (events[-1][0], 0, 0, 0.0)], strict=True
    ):
        monitor.observe(rank, iteration, duration, duration * 0.5, at)
        for probe in probes:
            assert hangs(monitor.check(at + (next_at - at) * probe)) == []


def test_millisecond_jitter_is_not_a_straggler() -> None:
    # 2.3x slower, but by 30 ms: scheduler noise on a busy host, not a slow rank.
    monitor = JobMonitor("j", 1, [0, 1], MonitorSettings(), started_at=0.0)
    now = 0.0
    for iteration in range(1, 21):
        now += 0.08
        monitor.observe(0, iteration, 0.08, 0.053, now)
        monitor.observe(1, iteration, 0.08, 0.023, now)
    assert monitor.check(now) == []


def test_each_ranks_last_iteration_is_kept_for_its_exit_report() -> None:
    monitor = make()
    monitor.observe(0, 1, 1.0, 0.5, 101.0)
    monitor.observe(0, 2, 1.0, 0.5, 102.0)
    monitor.observe(1, 1, 1.0, 0.5, 101.0)
    assert (monitor.last_iteration_of(0), monitor.last_iteration_of(1)) == (2, 1)
    assert make().last_iteration_of(0) == 0
