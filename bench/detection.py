"""Detection benchmark: every fault kind injected into real running jobs (real trainer processes,
real agents and coordinator on 127.0.0.1), timed from the moment the fault took effect to the
moment the coordinator held the report with the right classification.

    python -m bench.detection [--quick] [--repeats N] [--quiet-minutes M] [--kinds crash,hang,...]

Side by side in the same run it measures what prior practice would have seen: a plain polling
supervisor (a thread that checks the job's trainer processes every --poll-period-s seconds) and
the collective library's own timeout (modeled: nobody waits ten minutes per sample). It also
runs a failure-free job for --quiet-minutes while a busy loop loads one CPU core (any incident is
a false positive) and compares training speed with the agents' statistical monitoring on and
off. Results go to bench/results/detection.json; a table with PASS/FAIL per target goes to
stdout. The exit status is 0 whatever the numbers: this is a measurement, not a test.
See bench/README.md for what is measured and what is modeled.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bench.common import log, percentile, stamp_seconds, write_results
from unicron.client import UnicronClient
from unicron.faults import parse_fault
from unicron.monitor import MonitorSettings
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import LocalCluster, tiny_gpt

RESULTS = Path(__file__).resolve().parent / "results" / "detection.json"

KINDS = ["crash", "exit", "exception", "vanish-in-allreduce", "hang", "stuck-collective", "slow", "agent-loss"]
# Faults whose victim process ends by itself: the only ones a process-polling supervisor can see.
PROCESS_DEATH = frozenset({"crash", "exit", "exception", "vanish-in-allreduce"})
# Process-level detection target (the issue: crash and exception at most 0.5 s p95).
PROCESS_TARGET_S = 0.5
# Faults where no iteration completes any more: the target scales with the iteration time.
HANG_KINDS = frozenset({"hang", "stuck-collective"})
HANG_SLACK_S = 1.0
NODE_SLACK_S = 0.5
# Failure kinds the exception fault rotates through: a SEV1 hardware error, a SEV2 CUDA
# error and a SEV3 network error, so every severity's path is timed.
EXCEPTION_ROTATION = ["ecc_error", "illegal_memory_access", "connection_reset"]
# A straggler fault slows its rank by this much per iteration. The tiny job's iterations take
# ~0.05-0.3 s, so this is a clear 1.7-5x slowdown that still ends each iteration within the
# hang threshold (3 x mean, floor 0.75 s): a rank slowed beyond that stops the job's progress
# for longer than the threshold, and is a hang by the detector's definition.
SLOW_DELAY_S = 0.2
# Monitoring may cost at most 1% of training throughput (on/off mean iteration time).
OVERHEAD_LIMIT = 1.01
_TERMINAL = (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED)
# Jobs submitted per injection before giving up when each fails before its fault is injected.
START_ATTEMPTS = 3

# Defaults of the modeled baselines; each is a flag.
# PyTorch's ProcessGroupNCCL default timeout, kProcessGroupNCCLDefaultTimeout = 10 min
# (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp; torch.distributed.constants.default_pg_nccl_timeout
# on a CUDA build). Other backends (gloo) default to torch.distributed.constants.default_pg_timeout,
# 30 min. GPU training is the case that matters, so NCCL's is the default.
NCCL_DEFAULT_TIMEOUT_S = 600.0
# Kubernetes' node lifecycle controller marks a silent node NotReady after
# --node-monitor-grace-period: 40 s by default (50 s from Kubernetes 1.32).
NODE_GRACE_S = 40.0
# A typical liveness-probe / supervisor period (Kubernetes' probe periodSeconds defaults to 10 s;
# 5 s is a tighter, commonly configured value, in the baseline's favour).
POLL_PERIOD_S = 5.0
# The coordinator's heartbeat timeout in the bench's cluster (LocalCluster's default).
HEARTBEAT_TIMEOUT_S = 3.0


# ---- pure parts (unit-tested) -----------------------------------------------------------


def fault_text(kind: str, index: int) -> str:
    """The fault to inject for the index-th repeat of `kind` (parse_fault syntax)."""
    if kind == "exception":
        return f"exception:{EXCEPTION_ROTATION[index % len(EXCEPTION_ROTATION)]}"
    if kind == "slow":
        return f"slow:{SLOW_DELAY_S:g}"
    return kind


def expected_kind(fault: pb.Fault) -> int:
    """The root-cause classification a correct detector gives the fault."""
    kind = fault.kind
    if kind in (pb.FAULT_KIND_CRASH, pb.FAULT_KIND_EXIT, pb.FAULT_KIND_VANISH_IN_ALLREDUCE):
        return pb.FAILURE_KIND_PROCESS_EXIT
    if kind == pb.FAULT_KIND_EXCEPTION:
        return int(fault.exception_kind)
    if kind in (pb.FAULT_KIND_HANG, pb.FAULT_KIND_STUCK_COLLECTIVE):
        return pb.FAILURE_KIND_TASK_HANG
    if kind == pb.FAULT_KIND_SLOW:
        return pb.FAILURE_KIND_STRAGGLER
    if kind == pb.FAULT_KIND_AGENT_LOSS:
        return pb.FAILURE_KIND_NODE_LOST
    raise ValueError(f"no expected classification for fault {kind}")


def target_for(kind: str, mean_iteration_s: float | None, heartbeat_timeout_s: float, k: float = 3.0) -> float | None:
    """The issue's target for the p95 latency of `kind`; None where it sets none (stragglers)
    or where the iteration time it depends on is unknown."""
    if kind in PROCESS_DEATH:
        return PROCESS_TARGET_S
    if kind in HANG_KINDS:
        return None if mean_iteration_s is None else k * mean_iteration_s + HANG_SLACK_S
    if kind == "agent-loss":
        return heartbeat_timeout_s + NODE_SLACK_S
    return None


@dataclass(frozen=True)
class BaselineSettings:
    poll_period_s: float = POLL_PERIOD_S
    collective_timeout_s: float = NCCL_DEFAULT_TIMEOUT_S
    node_grace_s: float = NODE_GRACE_S


@dataclass
class Sample:
    """One injection. Times are seconds after the fault took effect (its FAULT_INJECTED time)."""

    kind: str
    fault: str
    rank: int
    job_id: str = ""
    injected: bool = False  # False: no job trained long enough to receive the fault
    placement: str = ""  # node: ranks, e.g. "node-a:0,1"
    expected: str = ""
    root_kind: str = ""  # the incident's root-cause classification; "" when nothing was detected
    correct: bool = False
    latency_s: float | None = None  # coordinator held the first report of the expected kind
    detected_s: float | None = None  # coordinator held the incident's first report (any kind)
    mean_iteration_s: float | None = None  # the hang report's robust mean iteration time
    poll_s: float | None = None  # the polling supervisor first saw a trainer of the job gone
    other_incidents: list[str] = field(default_factory=list)
    error: str = ""


def baseline_for(kind: str, samples: list[Sample], settings: BaselineSettings) -> dict[str, Any]:
    """When prior practice would have noticed: per sample the earlier of the polling supervisor
    (measured, for faults that end a process) and the modeled collective timeout; the node
    controller's grace period for a lost node; never for a straggler."""
    timeout = settings.collective_timeout_s
    if kind in PROCESS_DEATH:
        seen = [min(s.poll_s, timeout) for s in samples if s.poll_s is not None]
        if seen:
            return {
                "baseline_s": round(percentile(seen, 0.5), 3),
                "baseline_p95_s": round(percentile(seen, 0.95), 3),
                "baseline_measured": True,
                "baseline_how": f"polling supervisor every {settings.poll_period_s:g}s (measured, p50)",
            }
        return {
            "baseline_s": timeout,
            "baseline_p95_s": timeout,
            "baseline_measured": False,
            "baseline_how": "collective timeout (modeled; the poller saw nothing)",
        }
    if kind in HANG_KINDS:
        return {
            "baseline_s": timeout,
            "baseline_p95_s": timeout,
            "baseline_measured": False,
            "baseline_how": "collective timeout (modeled); a process poller never notices a live process",
        }
    if kind == "agent-loss":
        value = min(settings.node_grace_s, timeout)
        return {
            "baseline_s": value,
            "baseline_p95_s": value,
            "baseline_measured": False,
            "baseline_how": "node controller grace period (modeled), else the collective timeout",
        }
    return {
        "baseline_s": None,
        "baseline_p95_s": None,
        "baseline_measured": False,
        "baseline_how": "never: a slow rank still completes every collective and stays alive",
    }


def summarize(
    kind: str, samples: list[Sample], heartbeat_timeout_s: float, baselines: BaselineSettings, k: float = 3.0
) -> dict[str, Any]:
    """One kind's row of the report."""
    latencies = [s.latency_s for s in samples if s.latency_s is not None]
    firsts = [s.detected_s for s in samples if s.detected_s is not None]
    means = [s.mean_iteration_s for s in samples if s.mean_iteration_s is not None]
    mean_iteration = statistics.fmean(means) if means else None
    target = target_for(kind, mean_iteration, heartbeat_timeout_s, k)
    undetected = sum(s.injected and s.latency_s is None for s in samples)
    misclassified = sum(not s.correct for s in samples if s.root_kind)
    # Under varying load each sample has its own mean iteration time, hence its own hang target
    # (3 x its mean + 1 s): the target is met when the p95 of latency minus own target is <= 0.
    own_targets = [
        (s.latency_s, target_for(kind, s.mean_iteration_s, heartbeat_timeout_s, k))
        for s in samples
        if s.latency_s is not None
    ]
    over_own_target = sum(t is not None and latency > t for latency, t in own_targets)
    margins = [latency - t for latency, t in own_targets if t is not None]
    p95_over_target = percentile(margins, 0.95) if margins and len(margins) == len(own_targets) else math.nan
    p95 = percentile(latencies, 0.95)
    if math.isnan(p95_over_target) and target is not None and latencies:
        p95_over_target = p95 - target
    row: dict[str, Any] = {
        "kind": kind,
        "n": len(latencies),
        "p50_s": _round(percentile(latencies, 0.5)),
        "p95_s": _round(p95),
        "max_s": _round(max(latencies) if latencies else math.nan),
        "target_s": _round(target) if target is not None else None,
        **baseline_for(kind, samples, baselines),
        "met": None if target is None else bool(latencies) and undetected == 0 and p95_over_target <= 0,
        "p95_over_own_target_s": _round(p95_over_target),
        "injections": sum(s.injected for s in samples),
        "not_injected": sum(not s.injected for s in samples),
        "undetected": undetected,
        "misclassified": misclassified,
        "samples_over_own_target": over_own_target,
        "expected_kind": samples[0].expected if samples else "",
        "root_kinds": dict(Counter(s.root_kind or "none" for s in samples)),
        "first_report_p95_s": _round(percentile(firsts, 0.95)),
        "polling_p50_s": _round(percentile([s.poll_s for s in samples if s.poll_s is not None], 0.5)),
        "collective_timeout_s": baselines.collective_timeout_s,
        "mean_iteration_s": _round(mean_iteration) if mean_iteration is not None else None,
        "samples": [asdict(s) for s in samples],
    }
    return row


def _round(value: float, digits: int = 4) -> float | None:
    """JSON has no NaN: an empty statistic is null."""
    return None if math.isnan(value) else round(value, digits)


def build_report(
    samples: list[Sample],
    *,
    heartbeat_timeout_s: float,
    baselines: BaselineSettings,
    false_positives: int,
    overhead_ratio: float | None,
    overhead_ci95: list[float] | None = None,
    overhead_wall_ratio: float | None = None,
    extra: dict[str, Any] | None = None,
    k: float = 3.0,
) -> dict[str, Any]:
    by_kind: dict[str, list[Sample]] = {}
    for sample in samples:
        by_kind.setdefault(sample.kind, []).append(sample)
    order = [kind for kind in KINDS if kind in by_kind] + sorted(set(by_kind) - set(KINDS))
    faults = [summarize(kind, by_kind[kind], heartbeat_timeout_s, baselines, k) for kind in order]
    hang_means = [s.mean_iteration_s for s in samples if s.mean_iteration_s is not None]
    verdict = overhead_verdict(overhead_ratio, overhead_ci95, overhead_wall_ratio)
    report: dict[str, Any] = {
        "faults": faults,
        "false_positives": false_positives,
        "monitoring_overhead_ratio": None if overhead_ratio is None else round(overhead_ratio, 4),
        "monitoring_overhead_wall_ratio": None if overhead_wall_ratio is None else round(overhead_wall_ratio, 4),
        "monitoring_overhead_ci95": overhead_ci95,
        "monitoring_overhead_verdict": verdict,
        "misclassified": sum(row["misclassified"] for row in faults),
        "undetected": sum(row["undetected"] for row in faults),
        "stray_incidents": dict(Counter(kind for s in samples for kind in s.other_incidents)),
        "mean_iteration_s": _round(statistics.fmean(hang_means)) if hang_means else None,
        "targets_met": (
            all(row["met"] is not False for row in faults)
            and all(row["misclassified"] == 0 and row["undetected"] == 0 for row in faults)
            and false_positives == 0
            and verdict == "PASS"
        ),
    }
    report.update(extra or {})
    return report


def overhead_verdict(ratio: float | None, ci95: list[float] | None, wall_ratio: float | None = None) -> str:
    """PASS when monitoring costs at most 1%, FAIL when it costs more.

    With a CPU-accounted ratio (`wall_ratio` given as well) that ratio decides, unless the
    wall-time interval `ci95` shows a slowdown above 1% outright. With only a wall-time ratio,
    INCONCLUSIVE when the run's noise (its 95% interval) cannot tell, as on a busy 2-core
    machine."""
    if ratio is None:
        return "NOT MEASURED"
    if wall_ratio is not None:
        if ratio > OVERHEAD_LIMIT or (ci95 is not None and ci95[0] > OVERHEAD_LIMIT):
            return "FAIL"
        return "PASS"
    if ci95 is None:
        return "PASS" if ratio <= OVERHEAD_LIMIT else "FAIL"
    if ci95[1] <= OVERHEAD_LIMIT:
        return "PASS"
    if ci95[0] > OVERHEAD_LIMIT:
        return "FAIL"
    return "INCONCLUSIVE"


def format_table(report: dict[str, Any]) -> str:
    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    columns = ("n", "p50_s", "p95_s", "max_s", "target", "baseline", "wrong")
    widths = (3, 7, 7, 7, 7, 9, 5)
    header = f"{'kind':<20} " + " ".join(f"{c:>{w}}" for c, w in zip(columns, widths, strict=True)) + "  result"
    lines = [header, "-" * len(header)]
    for row in report["faults"]:
        result = "n/a" if row["met"] is None else ("PASS" if row["met"] else "FAIL")
        baseline = num(row["baseline_s"]) + ("" if row["baseline_measured"] else "*")
        if row["baseline_s"] is None:
            baseline = "never"
        lines.append(
            f"{row['kind']:<20} {row['n']:>3} {num(row['p50_s']):>7} {num(row['p95_s']):>7} {num(row['max_s']):>7} "
            f"{num(row['target_s']):>7} {baseline:>9} {row['misclassified']:>5}  {result}"
        )
    lines.append("(* modeled baseline, not measured; wrong = misclassified root cause)")
    false_positives = report["false_positives"]
    if false_positives is None:
        lines.append("false positives: not measured")
    else:
        lines.append(f"false positives: {false_positives} ({'PASS' if false_positives == 0 else 'FAIL'})")
    ratio = report["monitoring_overhead_ratio"]
    if ratio is None:
        lines.append("monitoring overhead: not measured")
    else:
        verdict = report["monitoring_overhead_verdict"]
        ci = report["monitoring_overhead_ci95"]
        spread = f", 95% CI {ci[0]:.3f}-{ci[1]:.3f}" if ci else ""
        wall = report.get("monitoring_overhead_wall_ratio")
        if wall is None:
            lines.append(f"monitoring overhead (on/off mean iteration time): {ratio:.4f}{spread} ({verdict})")
        else:
            lines.append(
                f"monitoring overhead: {ratio:.4f} by CPU accounting ({verdict}); "
                f"on/off mean iteration time {wall:.4f}{spread}"
            )
    if report.get("stray_incidents"):
        lines.append(f"stray incidents during injections (not the injected fault): {report['stray_incidents']}")
    lines.append(f"all targets met: {report['targets_met']}")
    return "\n".join(lines)


# ---- the measurement -----------------------------------------------------------------


def small_spec(name: str, iterations: int = 100_000) -> pb.JobSpec:
    """The e2e tests' tiny GPT: two data-parallel ranks, iterations of ~0.05-0.1 s on CPU."""
    return tiny_gpt(name, data=2, iterations=iterations)


def job_trainers(cluster: LocalCluster, job_id: str) -> list[psutil.Process]:
    """The job's trainer processes, as the agents' registries list them."""
    return cluster.trainer_processes(job_id)


def _gone(proc: psutil.Process) -> bool:
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class JobEndedEarly(RuntimeError):
    """A job failed before it trained far enough to receive its fault."""

    def __init__(self, message: str, job_id: str, kinds: list[str]) -> None:
        super().__init__(message)
        self.job_id = job_id
        self.kinds = kinds


class PollingSupervisor:
    """The baseline: a supervisor that checks the watched jobs' trainer processes every
    `period_s` on a fixed schedule (independent of when faults fire, like a liveness probe),
    and records the first tick at which a trainer is gone."""

    def __init__(self, period_s: float) -> None:
        self.period_s = period_s
        self._lock = threading.Lock()
        self._watched: dict[str, list[psutil.Process]] = {}
        self._seen: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="polling-supervisor", daemon=True)

    def start(self) -> PollingSupervisor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def watch(self, job_id: str, procs: list[psutil.Process]) -> None:
        with self._lock:
            self._watched[job_id] = list(procs)

    def seen_gone(self, job_id: str, timeout_s: float) -> float | None:
        """The tick (epoch seconds) at which a trainer of the job was first seen gone; waits for it
        up to timeout_s, then stops watching the job."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if job_id in self._seen:
                    self._watched.pop(job_id, None)
                    return self._seen[job_id]
            time.sleep(0.1)
        with self._lock:
            self._watched.pop(job_id, None)
            return self._seen.get(job_id)

    def _run(self) -> None:
        next_tick = time.monotonic() + self.period_s
        while not self._stop.wait(max(0.0, next_tick - time.monotonic())):
            next_tick += self.period_s
            with self._lock:
                watched = [(job, procs) for job, procs in self._watched.items() if job not in self._seen]
            for job_id, procs in watched:
                if any(_gone(p) for p in procs):
                    with self._lock:
                        self._seen[job_id] = time.time()  # when the supervisor knows, after the check


@dataclass
class Settings:
    repeats: int
    kinds: list[str]
    quiet_minutes: float
    overhead_iterations: int
    overhead_rounds: int
    baselines: BaselineSettings
    hang_k: float
    hang_floor_s: float
    agent_args: list[str]
    incident_timeout_s: float = 60.0
    start_timeout_s: float = 120.0


class DetectionBench:
    def __init__(
        self, cluster: LocalCluster, client: UnicronClient, settings: Settings, poller: PollingSupervisor
    ) -> None:
        self.cluster = cluster
        self.client = client
        self.settings = settings
        self.poller = poller
        self._fired: dict[str, float] = {}  # job id -> when its fault took effect

    # -- jobs --

    def start_job(self, prefix: str, min_iteration: int) -> pb.Job:
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        job = self.client.submit(small_spec(name))
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            current = self.client.get(job.job_id)
            if current.progress.iteration >= min_iteration:
                return current
            if current.state in _TERMINAL:
                kinds = [pb.FailureKind.Name(i.kind) for i in self.client.incidents(job.job_id)]
                self.finish_job(job.job_id, job_trainers(self.cluster, job.job_id))
                raise JobEndedEarly(f"job {name} ended before training: {current.reason}", job.job_id, kinds)
            if time.monotonic() > deadline:
                self.client.cancel(job.job_id, "bench: never trained")
                raise RuntimeError(f"job {name} did not reach iteration {min_iteration}")
            time.sleep(0.1)

    def finish_job(self, job_id: str, procs: list[psutil.Process]) -> None:
        """Ends the job (a straggler does not fail it) and waits for its trainers, so the next
        measurement runs on a quiet machine."""
        job = self.client.get(job_id)
        if job.state not in _TERMINAL:
            self.client.cancel(job_id, "bench: measured")
        _, alive = psutil.wait_procs(procs, timeout=20)
        for proc in alive:  # a trainer orphaned by a killed agent that did not stop: ours to end
            log(f"killing leftover trainer {proc.pid} of {job_id}")
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def fired_at(self, job_id: str, timeout_s: float = 15.0) -> float | None:
        """When the fault took effect: the FAULT_INJECTED event's time (stamped by the trainer
        or agent that fired it)."""
        deadline = time.monotonic() + timeout_s
        for event in self.client.watch(job_id, after_event_id="0"):
            if event.type == pb.JOB_EVENT_TYPE_FAULT_INJECTED:
                return stamp_seconds(event.time)
            if time.monotonic() > deadline:  # a running job streams progress, so this is reached
                break
        return None

    # -- one injection --

    def measure(self, kind: str, index: int) -> Sample:
        rank = index % 2
        text = fault_text(kind, index)
        fault = parse_fault(text, rank)
        expected = expected_kind(fault)
        sample = Sample(kind=kind, fault=text, rank=rank, expected=pb.FailureKind.Name(expected))
        for attempt in range(START_ATTEMPTS):
            try:
                # A straggler is scored on a window of 20 iterations: start from a full, steady window.
                job = self.start_job(f"bd-{kind}", 25 if kind == "slow" else 6)
                break
            except JobEndedEarly as exc:
                # A failure found before any fault was injected (under load: a hang during warm-up)
                # is a stray incident; the measurement needs a job that trains, so try again.
                sample.other_incidents += [f"before injection: {k}" for k in exc.kinds]
                if attempt == START_ATTEMPTS - 1:
                    sample.error = str(exc)
                    return sample
        sample.job_id = job.job_id
        sample.placement = " ".join(f"{w.node_id}:{','.join(map(str, w.ranks))}" for w in job.assignment.workers)
        procs = job_trainers(self.cluster, job.job_id)
        if kind in PROCESS_DEATH:
            self.poller.watch(job.job_id, procs)
        node = ""
        try:
            injected_at = time.time()
            node = self.client.inject(job.job_id, fault)
            sample.injected = True
            self._collect(sample, fault, expected, injected_at)
        except Exception as exc:  # noqa: BLE001 -- one failed injection must not end the bench
            sample.error = f"{type(exc).__name__}: {exc}"
        finally:
            if kind == "agent-loss" and node:
                self._revive(node)
            self.finish_job(job.job_id, procs)
            self._repair_isolated()
        if kind in PROCESS_DEATH:
            fired = self._fired.get(job.job_id)
            seen = self.poller.seen_gone(job.job_id, self.settings.baselines.poll_period_s + 2.0)
            if seen is not None and fired is not None:
                sample.poll_s = round(seen - fired, 4)
        return sample

    def _collect(self, sample: Sample, fault: pb.Fault, expected: int, injected_at: float) -> None:
        job_id = sample.job_id
        want_straggler = expected == pb.FAILURE_KIND_STRAGGLER

        def relevant(incidents: list[pb.Incident]) -> list[pb.Incident]:
            # An incident from before the injection (a straggler flagged under load during
            # warm-up) is not this fault's; it is kept as a stray incident. Straggler incidents
            # are their own kind of finding: only the slow fault is measured to one.
            return [
                i
                for i in incidents
                if stamp_seconds(i.detected) >= injected_at and (i.kind == pb.FAILURE_KIND_STRAGGLER) == want_straggler
            ]

        # A lost node is classified when its heartbeat times out; a peer's connection reset may
        # open the incident earlier, so wait that long for the classified report to join.
        grace = self.cluster.heartbeat_timeout_s + 2.0 if expected == pb.FAILURE_KIND_NODE_LOST else 1.0
        deadline = time.monotonic() + self.settings.incident_timeout_s
        first_relevant: float | None = None
        while True:
            found = relevant(self.client.incidents(job_id))
            if found:
                first_relevant = first_relevant or time.monotonic()
                if _matching(found, expected, fault) or time.monotonic() - first_relevant > grace:
                    break
            if time.monotonic() > deadline:
                sample.error = "not detected within the timeout"
                # What was found instead (e.g. a straggler flagged before the injection, which
                # the monitor does not report again) explains the miss.
                sample.other_incidents += [
                    ("before injection: " if stamp_seconds(i.detected) < injected_at else "")
                    + pb.FailureKind.Name(i.kind)
                    for i in self.client.incidents(job_id)
                ]
                return
            time.sleep(0.1)
        time.sleep(1.0)  # late reports from the other ranks join the incident
        fired = self.fired_at(job_id)
        if fired is None:
            sample.error = "the fault never announced itself"
            return
        self._fired[job_id] = fired
        incidents = self.client.incidents(job_id)
        found = relevant(incidents)
        matching = _matching(found, expected, fault)
        chosen = matching[0][0] if matching else min(found, key=lambda i: stamp_seconds(i.detected))
        sample.root_kind = pb.FailureKind.Name(chosen.kind)
        sample.correct = chosen.kind == expected and (not want_straggler or chosen.reports[0].rank == fault.rank)
        sample.detected_s = round(stamp_seconds(chosen.detected) - fired, 4)
        if matching:
            sample.latency_s = round(stamp_seconds(matching[0][1].received) - fired, 4)
        else:  # misclassified: the coordinator held a report, with the wrong root cause
            root = next(r for r in chosen.reports if r.kind == chosen.kind)
            sample.latency_s = round(stamp_seconds(root.received) - fired, 4)
        means = [r.statistics["mean_s"] for r in chosen.reports if "mean_s" in r.statistics]
        sample.mean_iteration_s = round(means[0], 4) if means else None
        others = [i for i in incidents if i.incident_id != chosen.incident_id]
        sample.other_incidents += [pb.FailureKind.Name(i.kind) for i in others]

    def _revive(self, node: str) -> None:
        """An agent-loss fault SIGKILLs the agent: start it again and wait until it is back."""
        service = self.cluster.service(node)
        deadline = time.monotonic() + 10
        while service.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if service.proc.poll() is None:
            raise RuntimeError(f"agent {node} did not die")
        # The coordinator must first notice the loss, or the new registration races it.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            states = {n.node_id: n.state for n in self.client.nodes()}
            if states.get(node) == pb.NODE_STATE_LOST:
                break
            time.sleep(0.2)
        self.cluster.restart(node)
        self.cluster.wait_nodes(self.client.nodes, self.cluster.agents, timeout_s=60)

    def _repair_isolated(self) -> None:
        """A SEV1 fault (an ECC error) isolates its node until someone repairs it. The bench
        plays that operator, restarting the node's agent (which registers it as ready again),
        so that every sample runs on the same two nodes."""
        isolated = [n.node_id for n in self.client.nodes() if n.state == pb.NODE_STATE_ISOLATED]
        for node in isolated:
            self.cluster.kill(node, signal.SIGTERM)
            self.cluster.service(node).proc.wait(timeout=30)
            self.cluster.restart(node)
        if isolated:
            self.cluster.wait_nodes(self.client.nodes, self.cluster.agents, timeout_s=60)

    # -- false positives --

    def quiet_run(self, minutes: float) -> dict[str, Any]:
        """Failure-free training while a busy loop loads one core: every incident is a false
        positive. A (false) failure ends its job, so a new job takes over for the rest of the
        window: the whole window is spent training, and every false alarm is counted."""
        hog = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
        started = time.time()
        deadline = time.monotonic() + minutes * 60
        jobs: list[str] = []
        iterations = 0
        ended = 0
        try:
            log(f"quiet run: {minutes:g} min, CPU hog pid {hog.pid}")
            # A job's warm-up takes ~5-30 s here: no new job in the window's last 15 s.
            while not jobs or deadline - time.monotonic() > 15:
                try:
                    job = self.start_job("bd-quiet", 6)
                except JobEndedEarly as exc:  # a false alarm during warm-up: counted below
                    jobs.append(exc.job_id)
                    ended += 1
                    continue
                jobs.append(job.job_id)
                procs = job_trainers(self.cluster, job.job_id)
                current = job
                while time.monotonic() < deadline and current.state not in _TERMINAL:
                    time.sleep(1.0)
                    current = self.client.get(job.job_id)
                iterations += current.progress.iteration - job.progress.iteration
                ended += current.state in _TERMINAL
                self.finish_job(job.job_id, procs)
        finally:
            hog.kill()
            hog.wait()
        # Node-level incidents (health checks) during the window count as well.
        found = [
            i
            for i in self.client.incidents("")
            if i.job_id in jobs or (not i.job_id and stamp_seconds(i.detected) >= started)
        ]
        # A straggler report is a performance observation, and under the hog it is a true one:
        # the rank that shares its core really computes slower. It is counted apart; every
        # failure incident is a false positive.
        false = [i for i in found if i.kind != pb.FAILURE_KIND_STRAGGLER]
        slow = [i for i in found if i.kind == pb.FAILURE_KIND_STRAGGLER]
        return {
            "minutes": minutes,
            "cpu_hog": "one busy-loop python process (one core)",
            "jobs": len(jobs),
            "jobs_ended_by_an_incident": ended,
            "iterations": iterations,
            "false_positives": len(false),
            "false_positive_kinds": dict(Counter(pb.FailureKind.Name(i.kind) for i in false)),
            "false_positive_summaries": [i.summary[:200] for i in false],
            "straggler_reports": len(slow),
            "straggler_summaries": [i.summary[:200] for i in slow],
        }


def _matching(
    incidents: list[pb.Incident], expected: int, fault: pb.Fault
) -> list[tuple[pb.Incident, pb.FailureReport]]:
    """(incident, report) pairs whose report has the expected classification, earliest first."""
    pairs = [
        (incident, report)
        for incident in incidents
        for report in incident.reports
        if report.kind == expected and (expected != pb.FAILURE_KIND_STRAGGLER or report.rank == fault.rank)
    ]
    return sorted(pairs, key=lambda pair: stamp_seconds(pair[1].received))


def iteration_times(client: UnicronClient, job_id: str, skip: int, count: int) -> tuple[list[float], float | None]:
    """Rank 0's own iteration seconds for `count` iterations after the first `skip`, and the
    wall seconds per iteration between the first and last of them (coordinator clock)."""
    seconds: list[float] = []
    first: tuple[float, int] | None = None
    last: tuple[float, int] | None = None
    events = client.watch(job_id, after_event_id="0")
    try:
        for event in events:
            if event.type != pb.JOB_EVENT_TYPE_PROGRESS or event.progress.iteration <= skip:
                continue
            seconds.append(event.progress.iteration_seconds)
            point = (stamp_seconds(event.time), int(event.progress.iteration))
            first = first or point
            last = point
            if len(seconds) >= count:
                break
    finally:
        close = getattr(events, "close", None)  # ends the server stream now, not at garbage collection
        if close is not None:
            close()
    wall = None
    if first and last and last[1] > first[1]:
        wall = (last[0] - first[0]) / (last[1] - first[1])
    return seconds, wall


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU seconds the processes have used so far (the gone ones are skipped)."""
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def agent_processes(cluster: LocalCluster) -> list[psutil.Process]:
    return [psutil.Process(s.proc.pid) for s in cluster.services if s.name.startswith("node-")]


def cpu_overhead_ratio(agent_cpu: dict[bool, float], trainer_cpu: dict[bool, float], ranks: int) -> float | None:
    """1 + the CPU seconds monitoring adds per iteration (agents on minus off), over one rank's
    CPU seconds per iteration.

    Monitoring adds no collective and no GPU work, and the trainers do the same in both
    conditions, so the only way it can slow training is by taking CPU from a rank. Dividing by
    one rank's CPU rather than all ranks' bounds the worst case, where every stolen CPU second
    delays the rank that the synchronous job waits for. CPU seconds are counted by the kernel,
    so this holds still on a busy machine where the wall-time ratio swings by tens of percent."""
    if not all(trainer_cpu.values()) or ranks < 1:
        return None
    per_rank = (trainer_cpu[True] + trainer_cpu[False]) / 2 / ranks
    return 1.0 + (agent_cpu[True] - agent_cpu[False]) / per_rank


def measure_overhead(benches: dict[bool, DetectionBench], iterations: int, rounds: int) -> dict[str, Any]:
    """Mean iteration time with monitoring on and off, alternating ABBA between two clusters that
    both stay up, so background load and drift hit both conditions alike; and the CPU seconds
    per iteration of the agents and the trainers in each condition."""
    times: dict[bool, list[float]] = {True: [], False: []}
    walls: dict[bool, list[float]] = {True: [], False: []}
    agent_cpu: dict[bool, list[float]] = {True: [], False: []}
    trainer_cpu: dict[bool, list[float]] = {True: [], False: []}
    order: list[bool] = []
    ranks = 0
    for r in range(rounds):
        order += [True, False] if r % 2 == 0 else [False, True]
    for monitoring in order:
        bench = benches[monitoring]
        job = bench.start_job("bd-overhead-on" if monitoring else "bd-overhead-off", 6)
        procs = job_trainers(bench.cluster, job.job_id)
        agents = agent_processes(bench.cluster)
        ranks = len(procs)
        try:
            cpu_before = (cpu_seconds(agents), cpu_seconds(procs))
            seconds, wall = iteration_times(bench.client, job.job_id, skip=10, count=iterations)
            cpu_after = (cpu_seconds(agents), cpu_seconds(procs))
        finally:
            bench.finish_job(job.job_id, procs)
        log(f"overhead: monitoring {'on' if monitoring else 'off'}: {len(seconds)} iterations, "
             f"mean {statistics.fmean(seconds) if seconds else math.nan:.4f}s")  # fmt: skip
        times[monitoring] += seconds
        if wall is not None:
            walls[monitoring].append(wall)
        if seconds:
            agent_cpu[monitoring].append((cpu_after[0] - cpu_before[0]) / len(seconds))
            trainer_cpu[monitoring].append((cpu_after[1] - cpu_before[1]) / len(seconds))
    on, off = times[True], times[False]
    ratio = statistics.fmean(on) / statistics.fmean(off) if on and off else None
    agent_per_iteration = {m: statistics.fmean(v) if v else 0.0 for m, v in agent_cpu.items()}
    trainer_per_iteration = {m: statistics.fmean(v) if v else 0.0 for m, v in trainer_cpu.items()}
    return {
        "ratio": ratio,
        "ratio_ci95": ratio_ci95(on, off),
        "cpu_ratio": cpu_overhead_ratio(agent_per_iteration, trainer_per_iteration, ranks),
        "agent_cpu_s_per_iteration": {
            "on": _round(agent_per_iteration[True], 6),
            "off": _round(agent_per_iteration[False], 6),
        },
        "trainer_cpu_s_per_iteration": {
            "on": _round(trainer_per_iteration[True]),
            "off": _round(trainer_per_iteration[False]),
        },
        "ranks": ranks,
        "iterations_per_condition": {"on": len(on), "off": len(off)},
        "mean_iteration_s": {
            "on": _round(statistics.fmean(on)) if on else None,
            "off": _round(statistics.fmean(off)) if off else None,
        },
        "median_ratio": _round(statistics.median(on) / statistics.median(off)) if on and off else None,
        "wall_s_per_iteration": {
            "on": _round(statistics.fmean(walls[True])) if walls[True] else None,
            "off": _round(statistics.fmean(walls[False])) if walls[False] else None,
        },
        "order": ["on" if m else "off" for m in order],
    }


def ratio_ci95(on: list[float], off: list[float]) -> list[float] | None:
    """An approximate 95% interval of mean(on) / mean(off) (delta method, independent samples):
    says whether the run could resolve a 1% difference at all."""
    if len(on) < 2 or len(off) < 2:
        return None
    mean_on, mean_off = statistics.fmean(on), statistics.fmean(off)
    rel = math.sqrt(
        statistics.variance(on) / (len(on) * mean_on**2) + statistics.variance(off) / (len(off) * mean_off**2)
    )
    ratio = mean_on / mean_off
    return [round(ratio * (1 - 1.96 * rel), 4), round(ratio * (1 + 1.96 * rel), 4)]


def _torch_timeouts() -> dict[str, Any]:
    """The collective library's defaults as this venv's torch states them (the NCCL one is
    only readable on a CUDA build)."""
    try:
        from torch.distributed import constants

        nccl = constants.default_pg_nccl_timeout
        return {
            "torch_default_pg_timeout_s": constants.default_pg_timeout.total_seconds(),
            "torch_default_pg_nccl_timeout_s": nccl.total_seconds() if nccl is not None else None,
        }
    except Exception as exc:  # noqa: BLE001 -- informational only
        return {"torch_timeouts_error": str(exc)}


NOTES = [
    "latency = coordinator received the first report of the expected classification - the fault's FAULT_INJECTED "
    "time (when it took effect); first_report_p95_s is the same from the incident's first report of any kind",
    "target_s: 0.5 s for process-level faults; 3 x mean iteration time (the hang report's mean_s) + 1 s for hang "
    "and stuck-collective; heartbeat timeout + 0.5 s for agent-loss; none for slow (straggler)",
    "each hang sample has its own target (3 x its own mean iteration time + 1 s: load changes the mean between "
    "samples); a hang row is met when the p95 of latency minus own target (p95_over_own_target_s) is <= 0",
    "the agent never calls a hang before its floor (hang_floor_s) after the last iteration",
    "monitoring_overhead_ratio: 1 + the agents' extra CPU seconds per iteration with monitoring on, over one rank's "
    "CPU seconds per iteration (monitoring adds no collective or GPU work, so CPU taken from a rank is the only "
    "way it can slow training); monitoring_overhead_wall_ratio is on/off mean iteration time, with its 95% "
    "interval, which fails the verdict only when the interval lies wholly above 1.01",
    "baseline_s: the polling supervisor is measured in this run (p50, fixed schedule independent of the "
    "injections); collective timeout and node grace period are modeled (nobody waits 10 minutes per sample)",
    "the machine is shared and small: latencies, false positives and the overhead ratio include other load",
]


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def _pick(given: Any, quick: bool, quick_default: Any, default: Any) -> Any:
    """A flag's value when given (0 included: skip that part), else the mode's default."""
    if given is not None:
        return given
    return quick_default if quick else default


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.detection", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats per kind, a 30 s quiet run, short overhead run")
    parser.add_argument("--repeats", type=int, default=None, help="injections per fault kind (default 10, quick 2)")
    parser.add_argument("--quiet-minutes", type=float, default=None, help="failure-free run (default 10, quick 0.5)")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated subset of {','.join(KINDS)}")
    parser.add_argument("--poll-period-s", type=float, default=POLL_PERIOD_S, help="polling supervisor period")
    parser.add_argument(
        "--collective-timeout-s", type=float, default=NCCL_DEFAULT_TIMEOUT_S, help="modeled collective timeout"
    )
    parser.add_argument("--node-grace-s", type=float, default=NODE_GRACE_S, help="modeled node controller grace")
    parser.add_argument("--hang-floor-s", type=float, default=None, help="agents' hang floor (default: theirs)")
    parser.add_argument("--overhead-iterations", type=int, default=None, help="per job (default 300, quick 20)")
    parser.add_argument("--overhead-rounds", type=int, default=None, help="on/off job pairs (default 2, quick 1)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--keep-logs", action="store_true", help="keep the clusters' run directory")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = set(kinds) - set(KINDS)
    if unknown:
        parser.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    defaults = MonitorSettings()
    agent_args = [] if args.hang_floor_s is None else ["--hang-floor-s", str(args.hang_floor_s)]
    settings = Settings(
        repeats=_pick(args.repeats, args.quick, 2, 10),
        kinds=kinds,
        quiet_minutes=_pick(args.quiet_minutes, args.quick, 0.5, 10.0),
        # Enough iterations that the agents' CPU seconds (counted in 10 ms ticks) resolve 1%.
        overhead_iterations=_pick(args.overhead_iterations, args.quick, 20, 300),
        overhead_rounds=_pick(args.overhead_rounds, args.quick, 1, 2),
        baselines=BaselineSettings(args.poll_period_s, args.collective_timeout_s, args.node_grace_s),
        hang_k=defaults.k,
        hang_floor_s=args.hang_floor_s if args.hang_floor_s is not None else defaults.floor_s,
        agent_args=agent_args,
    )
    # SIGTERM (e.g. from `timeout`) unwinds like Ctrl-C, so the clusters are stopped and what was
    # measured so far is still written.
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-detect-"))
    environment = {
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
        **_torch_timeouts(),
    }
    log(f"run directory {run_dir}")
    samples: list[Sample] = []
    quiet: dict[str, Any] = {}
    overhead: dict[str, Any] = {}
    clusters: list[LocalCluster] = []
    poller = PollingSupervisor(settings.baselines.poll_period_s).start()
    try:
        main_cluster = LocalCluster(
            run_dir / "on", fault_injection=True, agent_args=agent_args, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S
        )
        clusters.append(main_cluster)
        main_cluster.start()
        with main_cluster.client() as client:
            main_cluster.wait_nodes(client.nodes, main_cluster.agents)
            bench = DetectionBench(main_cluster, client, settings, poller)
            failures_in_a_row = 0
            for index in range(settings.repeats):
                for kind in kinds:
                    try:
                        sample = bench.measure(kind, index)
                    except Exception as exc:  # noqa: BLE001 -- e.g. a job that never started
                        sample = Sample(kind=kind, fault=fault_text(kind, index), rank=index % 2)
                        sample.error = f"{type(exc).__name__}: {exc}"
                    samples.append(sample)
                    failures_in_a_row = failures_in_a_row + 1 if sample.error else 0
                    log(
                        f"{kind:<20} #{index + 1}: latency {sample.latency_s}s root {sample.root_kind or '-'} "
                        f"poll {sample.poll_s} {sample.error}"
                    )
                    if failures_in_a_row >= 4:
                        raise RuntimeError("4 injections in a row failed; see the logs in the run directory")
            if settings.quiet_minutes > 0:
                quiet = bench.quiet_run(settings.quiet_minutes)
                log(f"quiet run: {quiet['false_positives']} false positive(s)")
            if settings.overhead_iterations > 0:
                off_cluster = LocalCluster(
                    run_dir / "off",
                    fault_injection=True,
                    agent_args=[*agent_args, "--no-monitor"],
                    heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
                )
                clusters.append(off_cluster)
                off_cluster.start()
                with off_cluster.client() as off_client:
                    off_cluster.wait_nodes(off_client.nodes, off_cluster.agents)
                    off_bench = DetectionBench(off_cluster, off_client, settings, poller)
                    overhead = measure_overhead(
                        {True: bench, False: off_bench}, settings.overhead_iterations, settings.overhead_rounds
                    )
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- report what was measured before it broke
        log(f"bench aborted: {type(exc).__name__}: {exc}")
        environment["aborted"] = f"{type(exc).__name__}: {exc}"
    finally:
        poller.stop()
        for cluster in reversed(clusters):
            leftovers = cluster.stop()
            if leftovers:
                log(f"processes outlived their cluster and were killed: {leftovers}")
    if args.keep_logs:
        log(f"logs kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    report = build_report(
        samples,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        baselines=settings.baselines,
        false_positives=int(quiet.get("false_positives", 0)),
        overhead_ratio=overhead.get("cpu_ratio"),
        overhead_ci95=overhead.get("ratio_ci95"),
        overhead_wall_ratio=overhead.get("ratio"),
        k=settings.hang_k,
        extra={
            "quiet_run": quiet,
            "overhead": overhead,
            "settings": {
                "repeats": settings.repeats,
                "kinds": kinds,
                "poll_period_s": settings.baselines.poll_period_s,
                "collective_timeout_s": settings.baselines.collective_timeout_s,
                "node_grace_s": settings.baselines.node_grace_s,
                "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
                "hang_k": settings.hang_k,
                "hang_floor_s": settings.hang_floor_s,
                "exception_rotation": EXCEPTION_ROTATION,
                "slow_delay_s": SLOW_DELAY_S,
                "quiet_minutes": settings.quiet_minutes,
                "overhead_iterations": settings.overhead_iterations,
                "overhead_rounds": settings.overhead_rounds,
            },
            "environment": environment,
            "notes": NOTES,
        },
    )
    if not quiet:
        report["false_positives"] = None
        report["targets_met"] = False
    write_results(args.out, report)
    print(format_table(report))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
