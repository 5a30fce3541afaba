"""Transition benchmark: how fast a job is back in training after each remedy the system performs
today, and how many iterations it recomputes, on real jobs (real trainer processes, real agents,
coordinator and planners on 127.0.0.1), side by side with today's practice measured on the same
trainer code: stop every process of the job, start them all again from the last persistent
checkpoint, recompute the lost steps.

    python -m bench.transition [--quick] [--repeats N] [--actions reattempt,restart,resize]

For each action and repeat it submits a fresh tiny GPT job (data-parallel 2, one rank per node),
injects the action's fault at an iteration drawn in 55..95 (never a multiple of the checkpoint
interval, 50), and reads the incident: transition = its `resumed` minus its `detected` (the
classified report), iterations recomputed = the coordinator's own count in the job's history. The
baseline runs the same ranks (`python -m services.trainer`) against a minimal fake agent, kills
them all after the same iteration, starts them all again on the same checkpoint directory and
times the first iteration after the restart and the return to the killed iteration. Results go to
bench/results/transition.json; a table with PASS/FAIL per target goes to stdout. The exit status
is 0 whatever the numbers: this is a measurement, not a test. See bench/README.md.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
from google.protobuf import json_format

from bench.common import log, percentile, stamp_seconds, write_results
from bench.detection import job_trainers
from unicron import jobspec
from unicron.client import ClientError, UnicronClient
from unicron.faults import parse_fault
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import LocalCluster, tiny_gpt

RESULTS = Path(__file__).resolve().parent / "results" / "transition.json"

ACTIONS = ["reattempt", "restart", "resize"]
# The fault that makes the coordinator choose each action today (the severity ladder): a SEV3
# collective timeout inside the gradient all-reduce is reattempted in a new process group, a SEV2
# process death restarts the dead rank, a SEV1 hardware error isolates the node and the re-plan
# shrinks the job onto the nodes left.
FAULTS = {"reattempt": "exception:collective_timeout:allreduce", "restart": "crash", "resize": "exception:ecc_error"}
EXPECTED_KIND = {
    "reattempt": pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
    "restart": pb.FAILURE_KIND_PROCESS_EXIT,
    "resize": pb.FAILURE_KIND_ECC_ERROR,
}
EXPECTED_REMEDY = {"reattempt": pb.REMEDY_REATTEMPT, "restart": pb.REMEDY_RESTART, "resize": pb.REMEDY_RECONFIGURE}
# Targets: speedup over the baseline (baseline p50 / p50), and no iteration recomputed.
TARGET_SPEEDUP = {"reattempt": 10.0, "restart": 3.0, "resize": 2.0}
# Today's practice: a persistent checkpoint every 50 steps.
CHECKPOINT_INTERVAL = 50
STEP_RANGE = (55, 95)
# The job trains this far (past the monitor's warm-up) before the fault is sent; it fires later,
# at its drawn iteration.
WARM_ITERATIONS = 5
# Ranks of the job; one slot per agent, so a data-parallel 2 job spans both nodes and losing one
# of them shrinks it to 1.
DATA_PARALLEL = 2
# How many ranks the baseline starts again: a resize means a node is gone, so today's practice
# restarts the job on what is left (the size Unicron shrinks to); the other actions restart all.
BASELINE_WORLD_AFTER = {"resize": DATA_PARALLEL - 1}
START_ATTEMPTS = 3
_TERMINAL = (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED)

# The coordinator's history line of a resume (services/coordinator/coordinator.py, _resume).
_RESUMED_RE = re.compile(
    r"training resumed after (?P<remedy>[\w-]+) at iteration (?P<iteration>\d+) "
    r"\(state: (?P<source>[^)]*?) at iteration (?P<restored>\d+), (?P<recomputed>\d+) iterations recomputed\)"
)


# ---- pure parts (unit-tested) -----------------------------------------------------------


def draw_steps(
    actions: Iterable[str], repeats: int, seed: int, low: int = STEP_RANGE[0], high: int = STEP_RANGE[1],
    interval: int = CHECKPOINT_INTERVAL,
) -> dict[str, list[int]]:  # fmt: skip
    """The iteration after which each sample fails, per action: uniform in low..high, never a
    multiple of the checkpoint interval (where nothing would be lost), reproducible from seed."""
    allowed = [s for s in range(low, high + 1) if s % interval]
    if not allowed:
        raise ValueError(f"every step in {low}..{high} is a multiple of {interval}")
    out: dict[str, list[int]] = {}
    for action in actions:
        rng = random.Random(f"{seed}:{action}")
        out[action] = [rng.choice(allowed) for _ in range(repeats)]
    return out


def checkpoint_lost(step: int, interval: int = CHECKPOINT_INTERVAL) -> int:
    """Iterations a restart from the last persistent checkpoint recomputes after a failure at
    `step`: step - interval * floor(step / interval)."""
    return step - interval * (step // interval)


@dataclass(frozen=True)
class Resumed:
    """One parsed 'training resumed after ...' line of a job's history."""

    remedy: str
    iteration: int
    source: str
    restored: int
    recomputed: int


def parse_resumed(text: str) -> Resumed | None:
    match = _RESUMED_RE.search(text)
    if match is None:
        return None
    return Resumed(
        remedy=match["remedy"],
        iteration=int(match["iteration"]),
        source=match["source"],
        restored=int(match["restored"]),
        recomputed=int(match["recomputed"]),
    )


def lost_iterations(step: int, resumed: Resumed) -> int:
    """Iterations a sample recomputes: the coordinator's own count, or, when that is smaller,
    `step` (completed by every rank before the fault fired at step + 1) minus the restored
    iteration. The coordinator counts from the last progress report it holds, which misses the
    failing generation's last batch when the new generation starts first."""
    return max(resumed.recomputed, step - resumed.restored)


@dataclass(frozen=True)
class Event:
    """What the bench needs of one job event, in stream order."""

    kind: str  # "progress", "resumed", other event types in lower case
    time: float
    iteration: int = 0
    message: str = ""
    incident_id: str = ""


def recovery_from_events(events: list[Event], detected: float, at_least: int = 0) -> dict[str, Any] | None:
    """From a job's events (stream order), around its first resume at or after `detected` (the
    failure's incident; the resume may close a follow-up incident when the first remedy failed):
    the last iteration before it (rank 0's progress: the coordinator's `previous`), the resume's
    own line, and when progress first reached the pre-failure iteration (or `at_least`, when the
    job is known to have got further than its progress events show) again after it (the regain).
    None when the job never resumed."""
    index = next((i for i, e in enumerate(events) if e.kind == "resumed" and e.time >= detected), None)
    if index is None:
        return None
    before = [e.iteration for e in events[:index] if e.kind == "progress"]
    pre = max(before) if before else 0
    goal = max(pre, at_least)
    regain = next((e.time for e in events[index:] if e.kind == "progress" and e.iteration >= goal), None)
    first = next((e for e in events[index:] if e.kind == "progress"), None)
    return {
        "pre_failure_iteration": pre,
        "resumed": parse_resumed(events[index].message),
        "resumed_at": events[index].time,
        "incident_id": events[index].incident_id,
        "first_iteration": first.iteration if first else None,
        "regained_at": regain,
    }


@dataclass
class Sample:
    """One injection into a Unicron job. Seconds are measured from the incident's `detected`."""

    action: str
    fault: str
    rank: int
    step: int  # drawn: the fault fires at iteration step + 1, after `step` completed
    job_id: str = ""
    incident_id: str = ""  # the failure's incident: the first one after the injection
    kind: str = ""  # its root cause
    remedy: str = ""  # its remedy
    # Every incident from the failure to the resume, "KIND:remedy" (more than one: a remedy
    # failed and a follow-up incident got another), and the remedy that brought the job back.
    chain: list[str] = field(default_factory=list)
    resumed_by: str = ""
    transition_s: float | None = None  # the job's first resume after the incident - incident.detected
    cost_transition_s: float | None = None  # incident.cost.transition_seconds (set when it resumed itself)
    regain_s: float | None = None  # progress back at the pre-failure iteration - detected
    pre_failure_iteration: int | None = None  # the last progress event before the resume
    restored_iteration: int | None = None
    recomputed: int | None = None  # the coordinator's count (history line)
    recomputed_from_events: int | None = None  # pre-failure iteration - restored iteration
    # What the sample lost: the larger of the coordinator's count and `step` - restored
    # iteration (the fault fired at step + 1, so every rank had completed `step`; the
    # coordinator counts from the last progress it received, which can lag by a report batch).
    lost_iterations: int | None = None
    state_source: str = ""
    size_before: int = 0
    size_after: int = 0
    generation_before: int = 0
    generation_after: int = 0
    other_incidents: list[str] = field(default_factory=list)
    error: str = ""


@dataclass
class BaselineSample:
    """Today's practice, on the same trainer code: kill every rank after `step`, start them all
    again from the last persistent checkpoint. Seconds are measured from the kill."""

    action: str
    step: int  # drawn
    world_before: int
    world_after: int
    step_at_kill: int | None = None  # rank 0's last reported iteration before the kill
    restored_iteration: int | None = None  # the restarted ranks' restored iteration
    state_source: str = ""
    lost_iterations: int | None = None  # step_at_kill - restored_iteration
    restart_s: float | None = None  # kill -> first completed iteration after the restart
    regain_s: float | None = None  # kill -> rank 0 back at step_at_kill
    error: str = ""


def _round(value: float | None, digits: int = 4) -> float | None:
    """JSON has no NaN: an empty statistic is null."""
    if value is None or math.isnan(value):
        return None
    return round(value, digits)


def _p(values: list[float], q: float) -> float | None:
    return _round(percentile(values, q)) if values else None


def summarize(action: str, samples: list[Sample], baseline: list[BaselineSample]) -> dict[str, Any]:
    """One action's row of the report."""
    done = [s for s in samples if s.transition_s is not None]
    times = [s.transition_s for s in done if s.transition_s is not None]
    regains = [s.regain_s for s in done if s.regain_s is not None]
    lost = [s.lost_iterations for s in done if s.lost_iterations is not None]
    reported = [s.recomputed for s in done if s.recomputed is not None]
    base = [b for b in baseline if b.restart_s is not None]
    base_times = [b.restart_s for b in base if b.restart_s is not None]
    base_regains = [b.regain_s for b in base if b.regain_s is not None]
    base_lost = [b.lost_iterations for b in base if b.lost_iterations is not None]
    p50, base_p50 = _p(times, 0.5), _p(base_times, 0.5)
    regain_p50, base_regain_p50 = _p(regains, 0.5), _p(base_regains, 0.5)
    speedup = _round(base_p50 / p50, 2) if p50 and base_p50 else None
    regain_speedup = _round(base_regain_p50 / regain_p50, 2) if regain_p50 and base_regain_p50 else None
    target = TARGET_SPEEDUP.get(action)
    failed = [s for s in samples if s.error]
    speedup_met = speedup is not None and target is not None and speedup >= target and not failed
    lost_met = bool(lost) and len(lost) == len(done) and max(lost) == 0 and not failed
    expected_remedy = EXPECTED_REMEDY.get(action)
    return {
        "action": action,
        "fault": FAULTS.get(action, ""),
        "n": len(done),
        "p50_s": p50,
        "p95_s": _p(times, 0.95),
        "max_s": _round(max(times)) if times else None,
        "baseline_p50_s": base_p50,
        "baseline_p95_s": _p(base_times, 0.95),
        "baseline_n": len(base),
        "speedup": speedup,
        "target_speedup": target,
        "speedup_met": speedup_met,
        # The most any sample recomputed (0: none lost in any sample); the p50 beside it.
        "lost_iterations": max(lost) if lost else None,
        "lost_iterations_p50": _p([float(x) for x in lost], 0.5),
        "coordinator_recomputed": reported,
        "coordinator_undercounts": sum(
            1
            for s in done
            if s.recomputed is not None and s.lost_iterations is not None and s.recomputed < s.lost_iterations
        ),
        "baseline_lost_iterations": max(base_lost) if base_lost else None,
        "baseline_lost_iterations_p50": _p([float(x) for x in base_lost], 0.5),
        "lost_met": lost_met,
        "regain_p50_s": regain_p50,
        "baseline_regain_p50_s": base_regain_p50,
        "regain_speedup": regain_speedup,
        "met": speedup_met and lost_met,
        "cost_transition_p50_s": _p([s.cost_transition_s for s in done if s.cost_transition_s is not None], 0.5),
        "state_sources": dict(Counter(s.state_source or "unknown" for s in done)),
        "remedies": dict(Counter(s.remedy or "none" for s in samples)),
        "resumed_by": dict(Counter(s.resumed_by or "none" for s in done)),
        # Samples where the first remedy did not bring the job back and a follow-up incident did.
        "follow_ups": sum(1 for s in done if len(s.chain) > 1),
        "unexpected_remedy": sum(
            1 for s in done if expected_remedy is not None and s.remedy != _remedy_name(expected_remedy)
        ),
        "resized": sum(1 for s in done if s.size_after != s.size_before),
        "failed_samples": len(failed),
        "errors": [s.error for s in failed],
        "baseline_errors": [b.error for b in baseline if b.error],
        "samples": [asdict(s) for s in samples],
        "baseline_samples": [asdict(b) for b in baseline],
    }


def _remedy_name(remedy: int) -> str:
    return pb.Remedy.Name(remedy).removeprefix("REMEDY_").lower()


def build_report(
    samples: list[Sample], baseline: list[BaselineSample], extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    actions = [a for a in ACTIONS if any(s.action == a for s in samples) or any(b.action == a for b in baseline)]
    rows = [
        summarize(a, [s for s in samples if s.action == a], [b for b in baseline if b.action == a]) for a in actions
    ]
    report: dict[str, Any] = {"actions": rows, "targets_met": bool(rows) and all(r["met"] for r in rows)}
    report.update(extra or {})
    return report


def verdict_reasons(row: dict[str, Any]) -> list[str]:
    """Why a row missed its targets, in words (empty when it met them)."""
    reasons = []
    if row["n"] == 0:
        reasons.append("no sample resumed")
    if row["failed_samples"]:
        reasons.append(f"{row['failed_samples']} sample(s) failed")
    if row["speedup"] is None:
        if row["n"]:
            reasons.append("no baseline measured")
    elif not row["speedup_met"]:
        reasons.append(f"speedup {row['speedup']:g}x < {row['target_speedup']:g}x")
    if row["n"] and row["lost_iterations"]:
        sources = ", ".join(f"{k} x{v}" for k, v in sorted(row["state_sources"].items()))
        reasons.append(f"up to {row['lost_iterations']} iterations recomputed (state from: {sources})")
    return reasons


def format_table(report: dict[str, Any]) -> str:
    def num(value: float | None, suffix: str = "") -> str:
        return "-" if value is None else f"{value:.3f}{suffix}"

    def count(value: int | None) -> str:
        return "-" if value is None else str(value)

    header = (
        f"{'action':<10} {'n':>2} {'p50_s':>7} {'base_p50':>8} {'speedup':>8} {'target':>6} {'lost':>4} "
        f"{'base_lost':>9} {'regain':>7} {'base_regain':>11} {'state':<16} result"
    )
    lines = [header, "-" * len(header)]
    for row in report["actions"]:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        target = "-" if row["target_speedup"] is None else f"{row['target_speedup']:g}x"
        sources = ",".join(sorted(row["state_sources"])) or "-"
        lines.append(
            f"{row['action']:<10} {row['n']:>2} {num(row['p50_s']):>7} {num(row['baseline_p50_s']):>8} "
            f"{speedup:>8} {target:>6} {count(row['lost_iterations']):>4} "
            f"{count(row['baseline_lost_iterations']):>9} {num(row['regain_p50_s']):>7} "
            f"{num(row['baseline_regain_p50_s']):>11} {sources:<16} {'PASS' if row['met'] else 'FAIL'}"
        )
    lines.append(
        "(p50_s: incident detected -> first iteration in the new configuration; base_p50: kill -> first iteration "
        "after restarting every rank from the last checkpoint; regain: back at the pre-failure iteration; lost: most "
        "iterations recomputed in any sample)"
    )
    for row in report["actions"]:
        reasons = verdict_reasons(row)
        if reasons and not row["met"]:
            lines.append(f"{row['action']}: FAIL: " + "; ".join(reasons))
        if row["n"] and "checkpoint" in row["state_sources"]:
            lines.append(
                f"{row['action']}: {row['state_sources']['checkpoint']} of {row['n']} sample(s) restored the "
                "persistent checkpoint, not a live peer's state"
            )
        if row.get("coordinator_undercounts"):
            lines.append(
                f"{row['action']}: the coordinator's own count ({row['coordinator_recomputed']}) missed iterations in "
                f"{row['coordinator_undercounts']} sample(s): it counts from the last progress it received, which lags "
                "the ranks by a report batch; lost counts from the fault's iteration instead"
            )
        if row.get("follow_ups"):
            chains = "; ".join(" -> ".join(s["chain"]) for s in row["samples"] if len(s["chain"]) > 1)
            lines.append(
                f"{row['action']}: in {row['follow_ups']} sample(s) the first remedy failed and a follow-up incident "
                f"brought the job back (counted in full): {chains}"
            )
        if row.get("unexpected_remedy"):
            lines.append(f"{row['action']}: {row['unexpected_remedy']} sample(s) got another remedy: {row['remedies']}")
        if row["action"] == "resize" and row["n"] and row["resized"] < row["n"]:
            lines.append(f"resize: only {row['resized']} of {row['n']} sample(s) changed size")
    lines.append(f"all targets met: {report['targets_met']}")
    return "\n".join(lines)


# ---- the measurement -----------------------------------------------------------------


def bench_spec(name: str, checkpoint_interval: int, data: int = DATA_PARALLEL) -> pb.JobSpec:
    """The e2e tests' tiny GPT, data-parallel 2, allowed to shrink to 1, with a measured-looking
    throughput profile (so the planner sizes it like a real job) and the given checkpoint interval."""
    spec = tiny_gpt(name, data=data)
    spec.parallelism.min_data = 1
    spec.throughput[1] = 1.0e9
    spec.throughput[2] = 1.9e9
    spec.training.checkpoint_interval = checkpoint_interval
    return jobspec.normalized(spec)


class JobEndedEarly(RuntimeError):
    pass


@dataclass
class Settings:
    repeats: int
    actions: list[str]
    checkpoint_interval: int
    step_range: tuple[int, int]
    seed: int
    start_timeout_s: float = 180.0
    recovery_timeout_s: float = 240.0


class UnicronSide:
    """Faults injected into real jobs on a LocalCluster, measured from the incident record and
    the job's event log."""

    def __init__(self, cluster: LocalCluster, client: UnicronClient, settings: Settings) -> None:
        self.cluster = cluster
        self.client = client
        self.settings = settings

    def start_job(self, action: str) -> pb.Job:
        name = f"bt-{action}-{uuid.uuid4().hex[:8]}"
        job = self.client.submit(bench_spec(name, self.settings.checkpoint_interval))
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            current = self.client.get(job.job_id)
            if current.progress.iteration >= WARM_ITERATIONS and current.state == pb.JOB_STATE_RUNNING:
                return current
            if current.state in _TERMINAL or current.remedies:
                # A (false) failure before the fault, e.g. a hang flagged during warm-up under load.
                self.finish_job(job.job_id)
                raise JobEndedEarly(f"job {name} had an incident before the injection: {current.reason}")
            if time.monotonic() > deadline:
                self.finish_job(job.job_id)
                raise RuntimeError(f"job {name} did not reach iteration {WARM_ITERATIONS}")
            time.sleep(0.1)

    def finish_job(self, job_id: str) -> None:
        procs = job_trainers(self.cluster, job_id)
        try:
            if self.client.get(job_id).state not in _TERMINAL:
                self.client.cancel(job_id, "bench: measured")
        except ClientError as exc:
            log(f"cancel of {job_id}: {exc}")
        _, alive = psutil.wait_procs(procs, timeout=20)
        for proc in alive:
            log(f"killing leftover trainer {proc.pid} of {job_id}")
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def events(self, job_id: str, timeout_s: float = 20.0) -> list[Event]:
        """The job's whole event log (it must have ended, or the stream would not)."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout_s
        stream = self.client.watch(job_id, after_event_id="0")
        try:
            for item in stream:
                kind = pb.JobEventType.Name(item.type).removeprefix("JOB_EVENT_TYPE_").lower()
                out.append(
                    Event(kind, stamp_seconds(item.time), int(item.progress.iteration), item.message, item.incident_id)
                )
                if time.monotonic() > deadline:
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        return out

    def measure(self, action: str, index: int, step: int) -> Sample:
        rank = index % 2
        text = FAULTS[action]
        sample = Sample(action=action, fault=f"{text}@{step + 1}", rank=rank, step=step)
        job: pb.Job | None = None
        for attempt in range(START_ATTEMPTS):
            try:
                job = self.start_job(action)
                break
            except JobEndedEarly as exc:
                sample.other_incidents.append(f"before injection: {exc}")
                if attempt == START_ATTEMPTS - 1:
                    sample.error = str(exc)
                    return sample
        assert job is not None
        sample.job_id = job.job_id
        sample.size_before = job.assignment.world_size
        sample.generation_before = job.assignment.generation
        detected: float | None = None
        try:
            if job.progress.iteration >= step:
                raise RuntimeError(f"job already at iteration {job.progress.iteration} before the injection")
            injected_at = time.time()
            self.client.inject(job.job_id, parse_fault(sample.fault, rank))
            incident, resumed_at, resumed = self._await_recovery(sample, injected_at)
            detected = stamp_seconds(incident.detected)
            sample.transition_s = round(resumed_at - detected, 4)
            if incident.HasField("resumed"):
                sample.cost_transition_s = round(incident.cost.transition_seconds, 4)
            current = self.client.get(job.job_id)
            sample.size_after = current.assignment.world_size
            sample.generation_after = current.assignment.generation
            if resumed is None:
                raise RuntimeError("the job's resume line could not be read")
            sample.resumed_by = resumed.remedy
            sample.state_source = resumed.source
            sample.restored_iteration = resumed.restored
            sample.recomputed = resumed.recomputed
            sample.lost_iterations = lost_iterations(step, resumed)
            # Back where it was: at the iteration it had reached before the failure.
            self._await_iteration(job.job_id, max(step, resumed.restored + resumed.recomputed))
        except Exception as exc:  # noqa: BLE001 -- one failed injection must not end the bench
            sample.error = sample.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.finish_job(job.job_id)
        if detected is not None:
            try:
                self._from_events(sample, detected)
            except Exception as exc:  # noqa: BLE001
                sample.error = sample.error or f"events: {type(exc).__name__}: {exc}"
        return sample

    def _await_recovery(self, sample: Sample, injected_at: float) -> tuple[pb.Incident, float, Resumed | None]:
        """Waits for the failure's incident (the first after the injection) and for the job's
        first resume after it, whichever incident that resume closes: a remedy that fails
        leads to a follow-up incident, and the failure costs until the job trains again.
        Returns (incident, when the job resumed, the resume's history line)."""
        expected = EXPECTED_KIND[sample.action]
        deadline = time.monotonic() + self.settings.recovery_timeout_s
        first_id = ""
        while True:
            found = sorted(
                (
                    i
                    for i in self.client.incidents(sample.job_id)
                    if stamp_seconds(i.detected) >= injected_at - 0.5 and i.kind != pb.FAILURE_KIND_STRAGGLER
                ),
                key=lambda i: stamp_seconds(i.detected),
            )
            job = self.client.get(sample.job_id)
            if found:
                first = next((i for i in found if i.incident_id == first_id), found[0])
                first_id = first.incident_id
                detected = stamp_seconds(first.detected)
                lines = [c for c in job.history if "training resumed" in c.reason and stamp_seconds(c.time) >= detected]
                if lines:
                    sample.incident_id = first.incident_id
                    sample.kind = pb.FailureKind.Name(first.kind)
                    sample.remedy = _remedy_name(first.remedy) if first.remedy else ""
                    sample.chain = [
                        f"{pb.FailureKind.Name(i.kind).removeprefix('FAILURE_KIND_')}:"
                        f"{_remedy_name(i.remedy) if i.remedy else 'none'}"
                        for i in found
                        if stamp_seconds(i.detected) <= stamp_seconds(lines[0].time)
                    ]
                    if first.kind != expected:
                        sample.error = f"the first incident after the injection is {sample.kind}, not the fault's"
                    return first, stamp_seconds(lines[0].time), parse_resumed(lines[0].reason)
            if job.state in _TERMINAL:
                raise RuntimeError(f"job ended: {pb.JobState.Name(job.state)}: {job.reason}")
            if time.monotonic() > deadline:
                kinds = [pb.FailureKind.Name(i.kind) for i in found]
                raise RuntimeError(
                    f"the job did not resume within {self.settings.recovery_timeout_s:g}s (incidents {kinds})"
                )
            time.sleep(0.1)

    def _await_iteration(self, job_id: str, iteration: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.client.get(job_id).progress.iteration < iteration:
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not get back to iteration {iteration} within {timeout_s:g}s")
            time.sleep(0.1)

    def _from_events(self, sample: Sample, detected: float) -> None:
        recovery = recovery_from_events(self.events(sample.job_id), detected, at_least=sample.step)
        if recovery is None:
            return
        sample.pre_failure_iteration = recovery["pre_failure_iteration"]
        if sample.restored_iteration is not None:
            sample.recomputed_from_events = max(0, recovery["pre_failure_iteration"] - sample.restored_iteration)
        if recovery["regained_at"] is not None:
            sample.regain_s = round(recovery["regained_at"] - detected, 4)

    def ensure_nodes_ready(self) -> None:
        """A resize leaves its node ISOLATED: restart that agent (a repaired node registering
        again) and wait until every node is READY."""
        states = {n.node_id: n.state for n in self.client.nodes()}
        for node_id, node_state in sorted(states.items()):
            if node_state == pb.NODE_STATE_READY:
                continue
            service = self.cluster.service(node_id)
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
                try:
                    service.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    service.proc.kill()
                    service.proc.wait()
            self.cluster.restart(node_id)
        if any(s != pb.NODE_STATE_READY for s in states.values()):
            self.cluster.wait_nodes(self.client.nodes, self.cluster.agents, timeout_s=60)


# ---- the baseline: every rank restarted from the last checkpoint ---------------------------


@dataclass(frozen=True)
class Arrival:
    time: float
    generation: int
    rank: int
    iteration: int
    state_source: str
    restored_iteration: int


def _fake_agent_class() -> type:
    """unicron_dev/fake_agent.py's FakeAgent, timing every iteration report as it arrives
    (imported late: the pure parts and their tests do not need a gRPC server)."""
    from unicron.v1 import trainer_service_pb2 as tpb
    from unicron_dev.fake_agent import FakeAgent

    class TimedAgent(FakeAgent):
        def __init__(self) -> None:
            self.arrivals: list[Arrival] = []
            self._arrived = threading.Condition()
            super().__init__()

        def Connect(self, request_iterator: Iterator[tpb.ConnectRequest], context: Any) -> Any:
            return super().Connect(self._timed(request_iterator), context)

        def _timed(self, requests: Iterator[tpb.ConnectRequest]) -> Iterator[tpb.ConnectRequest]:
            for request in requests:
                if request.WhichOneof("message") == "iteration":
                    report = request.iteration
                    with self._arrived:
                        self.arrivals.append(
                            Arrival(
                                time.time(),
                                report.generation,
                                report.rank,
                                report.iteration,
                                report.state_source,
                                report.restored_iteration,
                            )
                        )
                        self._arrived.notify_all()
                yield request

        def wait(self, found: Callable[[list[Arrival]], Arrival | None], timeout_s: float) -> Arrival | None:
            deadline = time.monotonic() + timeout_s
            with self._arrived:
                while (hit := found(self.arrivals)) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._arrived.wait(min(left, 0.5))
                return hit

        def reports_of(self, generation: int, rank: int = 0) -> list[Arrival]:
            with self._arrived:
                return [a for a in self.arrivals if a.generation == generation and a.rank == rank]

    return TimedAgent


class BaselineSide:
    """The job's ranks run directly (`python -m services.trainer`, the same code the agents start)
    against a fake agent; today's recovery is: kill them all, start them all again."""

    def __init__(self, run_dir: Path, settings: Settings) -> None:
        self.run_dir = run_dir
        self.settings = settings
        self._count = 0

    def _spawn(
        self, agent: Any, spec: pb.JobSpec, world: int, generation: int, checkpoint_dir: Path, work: Path
    ) -> list[subprocess.Popen[bytes]]:
        from unicron.redisutil import free_port
        from unicron_dev.localcluster import ROOT as REPO_ROOT

        port = free_port()
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO_ROOT),
                **trainer_env(
                    job_id="baseline",
                    generation=generation,
                    rank=rank,
                    world_size=world,
                    master_addr="127.0.0.1",
                    master_port=port,
                    agent=agent.address,
                    spec=json_format.MessageToJson(spec, indent=None),
                    checkpoint_dir=checkpoint_dir,
                ),
                # As the agent starts its trainers: one thread per rank (one slot each).
                "OMP_NUM_THREADS": "1",
            }
            with open(work / f"gen{generation}-rank{rank}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "services.trainer"],
                        env=env,
                        cwd=REPO_ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        return procs

    @staticmethod
    def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    def measure(self, action: str, step: int) -> BaselineSample:
        world_after = BASELINE_WORLD_AFTER.get(action, DATA_PARALLEL)
        sample = BaselineSample(action=action, step=step, world_before=DATA_PARALLEL, world_after=world_after)
        self._count += 1
        work = self.run_dir / f"baseline-{self._count:02d}-{action}"
        checkpoints = work / "checkpoints"
        work.mkdir(parents=True, exist_ok=True)
        spec = bench_spec("baseline", self.settings.checkpoint_interval)
        agent = _fake_agent_class()()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = self._spawn(agent, spec, DATA_PARALLEL, 1, checkpoints, work)

            def reached(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 1 and a.rank == 0 and a.iteration >= step), None)

            deadline = self.settings.start_timeout_s
            if agent.wait(reached, deadline) is None:
                codes = [p.poll() for p in procs]
                raise RuntimeError(f"the ranks did not reach iteration {step} in {deadline:g}s (exit codes {codes})")
            killed = time.time()
            self._kill(procs)  # every process of the job, at once
            procs = self._spawn(agent, spec, world_after, 2, checkpoints, work)

            def first(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 2 and a.rank == 0), None)

            started = agent.wait(first, self.settings.start_timeout_s)
            if started is None:
                raise RuntimeError("the restarted ranks completed no iteration")
            sample.restart_s = round(started.time - killed, 4)
            sample.state_source = started.state_source
            sample.restored_iteration = started.restored_iteration
            # Reports still in flight at the kill were computed before it: every generation-1 report counts.
            sample.step_at_kill = max(a.iteration for a in agent.reports_of(1))
            target = sample.step_at_kill

            def regained(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 2 and a.rank == 0 and a.iteration >= target), None)

            back = agent.wait(regained, self.settings.start_timeout_s)
            if back is None:
                raise RuntimeError(f"the restarted ranks did not get back to iteration {target}")
            sample.regain_s = round(back.time - killed, 4)
            sample.lost_iterations = max(0, target - started.restored_iteration)
        except Exception as exc:  # noqa: BLE001 -- one failed sample must not end the bench
            sample.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._kill(procs)
            agent.stop()
        return sample


# ---- main ----------------------------------------------------------------------------------

NOTES = [
    "p50_s: the incident's resumed - detected (detected: the coordinator held its first classified report; "
    "resumed: it received rank 0's first iteration in the new configuration, through the agent's 0.2 s report "
    "batching); cost_transition_p50_s is the incident's own cost.transition_seconds",
    "lost_iterations: the coordinator's count in the job history ('K iterations recomputed': the iteration before "
    "the failure minus the restored one); the most over the samples, so 0 means no sample lost any",
    "baseline: the same trainer processes against a fake agent (tests/trainer/harness.py), every rank SIGKILLed "
    "after the drawn iteration and started again at once on the same checkpoint directory (checkpoint interval as "
    "in settings); baseline_p50_s is kill -> rank 0's first iteration after the restart, baseline_regain_p50_s "
    "kill -> rank 0 back at the killed iteration. It has no detection, no control plane and an instant kill: the "
    "most favourable case of today's practice",
    "resize: an ECC error on one rank (SEV1) isolates its node and the re-plan shrinks the job from 2 ranks to 1 on "
    "the node left; its baseline restarts 1 rank (the node is gone). The isolated node's agent is restarted "
    "afterwards (a repaired node registering again)",
    "both sides fail after the same drawn iteration (uniform in the step range, never a multiple of the checkpoint "
    "interval); Unicron's fault fires at that iteration + 1, so the iteration before the failure is the drawn one",
    "the machine is shared and small: process start-up (torch and Megatron imports) dominates both sides, and "
    "other load moves every number",
]


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transition", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat per action")
    parser.add_argument("--repeats", type=int, default=None, help="samples per action (default 3, quick 1)")
    parser.add_argument("--actions", default=",".join(ACTIONS), help=f"comma-separated subset of {','.join(ACTIONS)}")
    parser.add_argument(
        "--checkpoint-interval", type=int, default=CHECKPOINT_INTERVAL, help="both sides' persistent checkpoints"
    )
    parser.add_argument("--steps", default=f"{STEP_RANGE[0]}-{STEP_RANGE[1]}", help="range of failure iterations")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn failure iterations")
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline (development only)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    actions = [a for a in args.actions.split(",") if a]
    unknown = set(actions) - set(ACTIONS)
    if unknown:
        parser.error(f"unknown actions: {', '.join(sorted(unknown))}")
    low_text, _, high_text = args.steps.partition("-")
    try:
        step_range = (int(low_text), int(high_text))
    except ValueError:
        parser.error(f"--steps must be LOW-HIGH, got {args.steps!r}")
    if step_range[0] <= WARM_ITERATIONS + 5 or step_range[0] > step_range[1]:
        parser.error(f"--steps must lie above iteration {WARM_ITERATIONS + 5} and be ordered")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    settings = Settings(
        repeats=repeats,
        actions=actions,
        checkpoint_interval=args.checkpoint_interval,
        step_range=step_range,
        seed=args.seed,
    )
    steps = draw_steps(actions, repeats, args.seed, *step_range, interval=args.checkpoint_interval)
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-transition-"))
    began = time.monotonic()
    environment: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    log(f"run directory {run_dir}; failure iterations {steps}")
    samples: list[Sample] = []
    baseline: list[BaselineSample] = []
    cluster = LocalCluster(
        run_dir / "cluster", agents=DATA_PARALLEL, slots_per_agent=1, fault_injection=True, warm_spares=1
    )
    try:
        cluster.start()
        with cluster.client() as client:
            cluster.wait_nodes(client.nodes, cluster.agents)
            unicron_side = UnicronSide(cluster, client, settings)
            baseline_side = BaselineSide(run_dir, settings)
            # Interleaved (one Unicron sample, then its baseline at the same iteration), so both
            # sides meet the same background load.
            for index in range(repeats):
                for action in actions:
                    step = steps[action][index]
                    sample = unicron_side.measure(action, index, step)
                    samples.append(sample)
                    log(
                        f"{action:<9} #{index + 1} step {step}: transition {sample.transition_s}s regain "
                        f"{sample.regain_s}s source {sample.state_source or '-'} recomputed {sample.recomputed} "
                        f"size {sample.size_before}->{sample.size_after} remedy {sample.remedy or '-'} {sample.error}"
                    )
                    unicron_side.ensure_nodes_ready()
                    if not args.no_baseline:
                        base = baseline_side.measure(action, step)
                        baseline.append(base)
                        log(
                            f"{'baseline':<9} #{index + 1} step {base.step_at_kill}: restart {base.restart_s}s "
                            f"regain {base.regain_s}s lost {base.lost_iterations} {base.error}"
                        )
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- report what was measured before it broke
        log(f"bench aborted: {type(exc).__name__}: {exc}")
        environment["aborted"] = f"{type(exc).__name__}: {exc}"
    finally:
        leftovers = cluster.stop()
        if leftovers:
            log(f"processes outlived their cluster and were killed: {leftovers}")
    environment["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    environment["wall_s"] = round(time.monotonic() - began, 1)
    if args.keep_logs:
        log(f"logs kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    report = build_report(
        samples,
        baseline,
        extra={
            "settings": {
                "repeats": repeats,
                "actions": actions,
                "faults": {a: FAULTS[a] for a in actions},
                "checkpoint_interval": args.checkpoint_interval,
                "step_range": list(step_range),
                "seed": args.seed,
                "steps": steps,
                "data_parallel": DATA_PARALLEL,
                "baseline_world_after": {a: BASELINE_WORLD_AFTER.get(a, DATA_PARALLEL) for a in actions},
                "target_speedup": {a: TARGET_SPEEDUP[a] for a in actions},
            },
            "environment": environment,
            "notes": NOTES,
        },
    )
    write_results(args.out, report)
    print(format_table(report))
    print(f"\nwrote {args.out} ({environment['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
