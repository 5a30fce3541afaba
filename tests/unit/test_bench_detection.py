"""The detection benchmark's pure parts (statistics, targets, baselines, report shape), so the
bench cannot rot between the rare runs of `make bench-detect`. No cluster here."""

from __future__ import annotations

import json
import math
import subprocess
import time

import psutil
import pytest

from bench import detection
from bench.detection import BaselineSettings, Sample
from unicron.faults import parse_fault
from unicron.v1 import common_pb2 as pb


def test_percentile_interpolates_like_numpy() -> None:
    assert math.isnan(detection.percentile([], 0.5))
    assert detection.percentile([7.0], 0.95) == 7.0
    assert detection.percentile([4.0, 1.0, 3.0, 2.0], 0.5) == pytest.approx(2.5)
    assert detection.percentile([float(i) for i in range(1, 11)], 0.95) == pytest.approx(9.55)
    assert detection.percentile([1.0, 2.0], 1.0) == 2.0


def test_every_kind_has_a_fault_and_an_expected_classification() -> None:
    expected = {
        "crash": pb.FAILURE_KIND_PROCESS_EXIT,
        "exit": pb.FAILURE_KIND_PROCESS_EXIT,
        "vanish-in-allreduce": pb.FAILURE_KIND_PROCESS_EXIT,
        "hang": pb.FAILURE_KIND_TASK_HANG,
        "stuck-collective": pb.FAILURE_KIND_TASK_HANG,
        "slow": pb.FAILURE_KIND_STRAGGLER,
        "agent-loss": pb.FAILURE_KIND_NODE_LOST,
    }
    for kind in detection.KINDS:
        fault = parse_fault(detection.fault_text(kind, 0), rank=1)
        assert fault.rank == 1
        if kind == "exception":
            assert detection.expected_kind(fault) == pb.FAILURE_KIND_ECC_ERROR
        else:
            assert detection.expected_kind(fault) == expected[kind]


def test_exception_faults_rotate_through_failure_kinds() -> None:
    texts = [detection.fault_text("exception", i) for i in range(4)]
    assert texts == [
        "exception:ecc_error",
        "exception:illegal_memory_access",
        "exception:connection_reset",
        "exception:ecc_error",
    ]
    kinds = {detection.expected_kind(parse_fault(t)) for t in texts}
    assert kinds == {
        pb.FAILURE_KIND_ECC_ERROR,
        pb.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS,
        pb.FAILURE_KIND_CONNECTION_RESET,
    }
    assert detection.fault_text("slow", 3) == f"slow:{detection.SLOW_DELAY_S:g}"


def test_targets_follow_the_issue() -> None:
    for kind in detection.PROCESS_DEATH:
        assert detection.target_for(kind, None, 3.0) == 0.5
    assert detection.target_for("hang", 0.1, 3.0) == pytest.approx(1.3)
    assert detection.target_for("stuck-collective", 2.0, 3.0) == pytest.approx(7.0)
    assert detection.target_for("hang", None, 3.0) is None  # no mean, no target
    assert detection.target_for("agent-loss", None, 3.0) == pytest.approx(3.5)
    assert detection.target_for("slow", 0.1, 3.0) is None


def _sample(kind: str, latency: float | None, *, poll: float | None = None, correct: bool = True) -> Sample:
    return Sample(
        kind=kind,
        fault=kind,
        rank=0,
        injected=True,
        expected="FAILURE_KIND_PROCESS_EXIT",
        root_kind="FAILURE_KIND_PROCESS_EXIT" if latency is not None else "",
        correct=correct,
        latency_s=latency,
        detected_s=latency,
        poll_s=poll,
    )


def test_baselines_measured_for_process_deaths_and_modeled_otherwise() -> None:
    settings = BaselineSettings(poll_period_s=5.0, collective_timeout_s=600.0, node_grace_s=40.0)
    polled = detection.baseline_for("crash", [_sample("crash", 0.1, poll=p) for p in (1.0, 3.0, 4.0)], settings)
    assert polled["baseline_measured"] is True and polled["baseline_s"] == 3.0
    unseen = detection.baseline_for("exit", [_sample("exit", 0.1)], settings)
    assert unseen["baseline_measured"] is False and unseen["baseline_s"] == 600.0
    hang = detection.baseline_for("hang", [_sample("hang", 2.0, poll=4.0)], settings)
    assert hang["baseline_s"] == 600.0 and hang["baseline_measured"] is False  # a live process is never "gone"
    assert detection.baseline_for("agent-loss", [], settings)["baseline_s"] == 40.0
    assert detection.baseline_for("agent-loss", [], BaselineSettings(5.0, 30.0, 40.0))["baseline_s"] == 30.0
    assert detection.baseline_for("slow", [], settings)["baseline_s"] is None


def test_report_has_the_issue_shape_and_is_strict_json() -> None:
    samples = [_sample("crash", 0.05 + i / 100, poll=2.0 + i) for i in range(10)]
    hang = [_sample("hang", 2.2, correct=True) for _ in range(3)]
    for s in hang:
        s.mean_iteration_s = 0.5  # target 3 x 0.5 + 1 = 2.5
    slow = [_sample("slow", 6.0)]
    report = detection.build_report(
        samples + hang + slow,
        heartbeat_timeout_s=3.0,
        baselines=BaselineSettings(),
        false_positives=0,
        overhead_ratio=1.004,
    )
    text = json.dumps(report, allow_nan=False)  # NaN would make the file unreadable to strict parsers
    assert json.loads(text) == report
    assert [row["kind"] for row in report["faults"]] == ["crash", "hang", "slow"]
    crash = report["faults"][0]
    for key in ("kind", "n", "p50_s", "p95_s", "max_s", "target_s", "baseline_s", "baseline_measured"):
        assert key in crash
    assert crash["n"] == 10 and crash["target_s"] == 0.5 and crash["met"] is True
    assert crash["max_s"] == pytest.approx(0.14)
    assert crash["baseline_measured"] is True
    assert report["faults"][1]["target_s"] == pytest.approx(2.5) and report["faults"][1]["met"] is True
    assert report["faults"][2]["target_s"] is None and report["faults"][2]["met"] is None
    assert report["false_positives"] == 0 and report["monitoring_overhead_ratio"] == 1.004
    assert report["mean_iteration_s"] == 0.5
    assert report["targets_met"] is True


def _report(
    samples: list[Sample],
    false_positives: int = 0,
    overhead: float | None = 1.0,
    ci95: list[float] | None = None,
    wall: float | None = None,
) -> dict:
    return detection.build_report(
        samples,
        heartbeat_timeout_s=3.0,
        baselines=BaselineSettings(),
        false_positives=false_positives,
        overhead_ratio=overhead,
        overhead_ci95=ci95,
        overhead_wall_ratio=wall,
    )


def test_misses_misclassifications_and_overhead_fail_the_targets() -> None:
    assert _report([_sample("crash", 0.9)])["targets_met"] is False
    wrong = _report([_sample("crash", 0.1, correct=False)])
    assert wrong["misclassified"] == 1 and wrong["targets_met"] is False
    missed = _report([_sample("crash", 0.1), _sample("crash", None)])
    assert missed["undetected"] == 1 and missed["faults"][0]["met"] is False
    never_started = Sample(kind="crash", fault="crash", rank=0, error="job never trained")
    row = _report([_sample("crash", 0.1), never_started])["faults"][0]
    assert row["not_injected"] == 1 and row["undetected"] == 0 and row["n"] == 1 and row["met"] is True
    fine = [_sample("crash", 0.1)]
    assert _report(fine)["targets_met"] is True
    assert _report(fine, false_positives=1)["targets_met"] is False
    assert _report(fine, overhead=1.02)["targets_met"] is False
    assert _report(fine, overhead=None)["targets_met"] is False  # not measured is not met
    assert _report(fine, overhead=1.0, ci95=[0.995, 1.005])["targets_met"] is True
    noisy = _report(fine, overhead=1.0, ci95=[0.8, 1.2])
    assert noisy["monitoring_overhead_verdict"] == "INCONCLUSIVE" and noisy["targets_met"] is False
    # CPU accounting decides when the wall-time interval is too wide to...
    accounted = _report(fine, overhead=1.002, ci95=[0.8, 1.2], wall=1.0)
    assert accounted["monitoring_overhead_verdict"] == "PASS" and accounted["targets_met"] is True
    # ...but a wall-time slowdown beyond doubt still fails it.
    assert _report(fine, overhead=1.002, ci95=[1.03, 1.2], wall=1.1)["targets_met"] is False


def test_overhead_verdict_respects_the_noise() -> None:
    assert detection.overhead_verdict(None, None) == "NOT MEASURED"
    assert detection.overhead_verdict(1.005, None) == "PASS"
    assert detection.overhead_verdict(1.02, None) == "FAIL"
    assert detection.overhead_verdict(1.0, [0.99, 1.009]) == "PASS"
    assert detection.overhead_verdict(1.05, [1.02, 1.08]) == "FAIL"
    assert detection.overhead_verdict(0.9, [0.5, 1.3]) == "INCONCLUSIVE"
    assert detection.overhead_verdict(1.004, [0.5, 1.3], wall_ratio=0.9) == "PASS"
    assert detection.overhead_verdict(1.02, [0.5, 1.3], wall_ratio=0.9) == "FAIL"


def test_cpu_overhead_is_the_agents_extra_cpu_over_one_ranks() -> None:
    # Two ranks use 0.2 CPU s per iteration in all (0.1 each); monitoring adds 0.5 ms.
    ratio = detection.cpu_overhead_ratio({True: 0.0015, False: 0.001}, {True: 0.2, False: 0.2}, ranks=2)
    assert ratio == pytest.approx(1.005)
    assert detection.cpu_overhead_ratio({True: 0.0, False: 0.0}, {True: 0.0, False: 0.2}, ranks=2) is None


def test_cpu_seconds_counts_live_processes_and_skips_gone_ones() -> None:
    child = subprocess.Popen(["sleep", "30"])
    handle = psutil.Process(child.pid)
    child.kill()
    child.wait()
    me = psutil.Process()
    assert detection.cpu_seconds([me, handle]) > 0  # the reaped child is skipped, not an error


def test_hang_samples_are_also_judged_by_their_own_mean() -> None:
    loaded, idle = _sample("hang", 2.5), _sample("hang", 2.3)
    loaded.mean_iteration_s, idle.mean_iteration_s = 0.7, 0.1  # own targets 3.1 and 1.3
    row = _report([loaded, idle])["faults"][0]
    assert row["target_s"] == pytest.approx(2.2) and row["met"] is False
    assert row["samples_over_own_target"] == 1


def test_table_lists_every_kind_with_its_verdict() -> None:
    samples = [_sample("crash", 0.1, poll=2.0), _sample("agent-loss", 4.0)]
    table = detection.format_table(_report(samples, overhead=None))
    lines = table.splitlines()
    assert lines[0].split()[:2] == ["kind", "n"]
    crash = next(line for line in lines if line.startswith("crash"))
    assert crash.endswith("PASS") and "2.000" in crash
    agent = next(line for line in lines if line.startswith("agent-loss"))
    assert agent.endswith("FAIL") and "40.000*" in agent  # modeled baselines are marked
    assert "monitoring overhead: not measured" in table


def test_polling_supervisor_sees_a_dead_process_at_its_next_tick() -> None:
    proc = subprocess.Popen(["sleep", "30"])
    poller = detection.PollingSupervisor(period_s=0.05).start()
    try:
        poller.watch("job-x", [psutil.Process(proc.pid)])
        time.sleep(0.15)
        assert poller.seen_gone("job-x", timeout_s=0.0) is None  # alive: nothing seen
        poller.watch("job-x", [psutil.Process(proc.pid)])
        killed = time.time()
        proc.kill()
        proc.wait()
        seen = poller.seen_gone("job-x", timeout_s=2.0)
        assert seen is not None and killed <= seen <= killed + 1.0
    finally:
        poller.stop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_overhead_interval_brackets_the_ratio() -> None:
    assert detection.ratio_ci95([1.0], [1.0]) is None
    low, high = detection.ratio_ci95([1.0, 1.1, 0.9, 1.0], [1.0, 1.05, 0.95, 1.0]) or [0.0, 0.0]
    assert low < 1.0 < high
    tight = detection.ratio_ci95([1.02] * 50 + [1.021] * 50, [1.0] * 50 + [1.001] * 50)
    assert tight is not None and 1.01 < tight[0] < tight[1] < 1.03
