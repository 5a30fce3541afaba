"""The pure parts of bench.transition: the actions and their faults, the drawn failure
iterations, the samples, the job every sample runs, and the report (summary rows, verdicts,
the table). No cluster, no trainer: tests/unit/test_bench_transition.py runs them."""

from __future__ import annotations

import math
import random
import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.common import percentile
from unicron import jobspec
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import digits_mlp, llama_fsdp, llm_gpt, tiny_gpt

ACTIONS = ["reattempt", "restart", "restart_snapshot", "resize", "grow"]
# The fault that makes the coordinator choose each action today (the severity ladder): a SEV3
# collective timeout inside the gradient all-reduce is reattempted in a new process group, a SEV2
# process death restarts the dead rank (from a live peer; a job of one rank has none, so from
# its node's snapshot), a SEV1 hardware error isolates the node and the re-plan shrinks the job
# onto the nodes left. A grow has no fault: after a shrink, the isolated node comes back (its
# agent registers again) and the re-plan grows the job onto it.
FAULTS = {
    "reattempt": "exception:collective_timeout:allreduce",
    "restart": "crash",
    "restart_snapshot": "crash",
    "resize": "exception:ecc_error",
    "grow": "exception:ecc_error",
}
EXPECTED_KIND = {
    "reattempt": pb.FAILURE_KIND_COLLECTIVE_TIMEOUT,
    "restart": pb.FAILURE_KIND_PROCESS_EXIT,
    "restart_snapshot": pb.FAILURE_KIND_PROCESS_EXIT,
    "resize": pb.FAILURE_KIND_ECC_ERROR,
    "grow": pb.FAILURE_KIND_ECC_ERROR,
}
EXPECTED_REMEDY = {
    "reattempt": pb.REMEDY_REATTEMPT,
    "restart": pb.REMEDY_RESTART,
    "restart_snapshot": pb.REMEDY_RESTART,
    "resize": pb.REMEDY_RECONFIGURE,
    "grow": pb.REMEDY_RECONFIGURE,
}
# Targets: speedup over the baseline (baseline p50 / p50), and no iteration recomputed (a
# restart from a snapshot may recompute up to the snapshot interval less one).
TARGET_SPEEDUP = {"reattempt": 10.0, "restart": 3.0, "restart_snapshot": 3.0, "resize": 2.0, "grow": 2.0}
# Today's practice: a persistent checkpoint every 50 steps.
# A lost time under this is counted as this in the lost-time ratio: the event times it is
# read from carry the agent's 0.2 s report batching, so smaller differences are not measured.
LOST_FLOOR_S = 0.2
CHECKPOINT_INTERVAL = 50
STEP_RANGE = (55, 95)
# The job trains this far (past the monitor's warm-up) before the fault is sent; it fires later,
# at its drawn iteration.
WARM_ITERATIONS = 5
# Ranks of the job; one slot per agent, so a data-parallel 2 job spans both nodes and losing one
# of them shrinks it to 1.
DATA_PARALLEL = 2
# Ranks of the job where it is not DATA_PARALLEL: a restart from a snapshot needs a job without
# a live peer.
JOB_DATA = {"restart_snapshot": 1}
# How many ranks the baseline runs before and after its restart: a resize means a node is gone,
# so today's practice restarts the job on what is left (the size Unicron shrinks to); a grow
# restarts the shrunk job at the size it grows to; the other actions restart all.
BASELINE_WORLD_BEFORE = {"restart_snapshot": 1, "grow": DATA_PARALLEL - 1}
BASELINE_WORLD_AFTER = {"resize": DATA_PARALLEL - 1, "restart_snapshot": 1}
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


# Time lost is read over this many iterations past the failure, and the failure-free
# iteration time over spans of as many: the trainers snapshot every 2 iterations by default
# (TrainerConfig.snapshot_interval), and the write slows the iteration after it (at 100M,
# about 5 s against 2 s). One iteration past the failure, against the median of all, counted
# that cycle as lost whenever the failure came before a slow iteration.
LOST_SPAN = 2


def iteration_time(before: Mapping[int, float], failed_at: int, window: int = 10, span: int = 1) -> float | None:
    """A failure-free iteration's seconds before `failed_at`: the median, over the last `window`
    iterations, of the seconds per iteration between each batch of reports and the first one
    at least `span` iterations after it, so neither batching, nor one slow iteration (a
    checkpoint saved, the first one's warm-up), nor a cycle of `span` iterations (a snapshot
    every other one) moves it. `before`: iteration -> when it completed (reports may arrive in
    batches: several iterations at one time). None without two batches to time."""
    done = sorted(i for i in before if i <= failed_at)[-(window + 1) :]
    # One point per batch: its last iteration, at the batch's time.
    batches: dict[float, int] = {}
    for iteration in done:
        batches[before[iteration]] = max(iteration, batches.get(before[iteration], iteration))
    points = sorted((iteration, at) for at, iteration in batches.items())
    rates = []
    for index, (i0, t0) in enumerate(points):
        later = next(((i1, t1) for i1, t1 in points[index + 1 :] if i1 - i0 >= span), None)
        if later is not None and later[1] > t0:
            rates.append((later[1] - t0) / (later[0] - i0))
    return statistics.median(rates) if rates else None


def time_lost(
    before: Mapping[int, float],
    failed_at: int,
    next_done: float,
    window: int = 10,
    *,
    done_iteration: int | None = None,
    span: int = 1,
) -> float | None:
    """Seconds a failure cost against a failure-free run of the same job: iteration
    `done_iteration` (by default the first after `failed_at`) completed at `next_done`; without
    the failure it would have completed that many iteration times (`iteration_time`) after
    `failed_at` did. Recomputed iterations, restarts and reforms all count; the iterations' own
    compute, which the failure-free run pays too, does not. None without two batches to time."""
    if failed_at not in before:
        return None
    rate = iteration_time(before, failed_at, window, span)
    if rate is None:
        return None
    iterations = (done_iteration if done_iteration is not None else failed_at + 1) - failed_at
    return max(0.0, next_done - before[failed_at] - iterations * rate)


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
    progress = {e.iteration: e.time for e in events[:index] if e.kind == "progress"}
    done = next((e for e in events[index:] if e.kind == "progress" and e.iteration >= pre + LOST_SPAN), None)
    lost = None
    if done is not None:
        lost = time_lost(progress, pre, done.time, done_iteration=done.iteration, span=LOST_SPAN)
    # When a failure-free run would have reported the iteration that resumed the job: the
    # iteration's own compute, which no transition, however fast, takes out of "to training
    # again". Counted from the iteration a whole number of LOST_SPAN cycles before it, so
    # that a slow iteration (the one after a snapshot) is predicted slow.
    free_at = None
    rate = iteration_time(progress, pre, span=LOST_SPAN) if pre in progress else None
    if first is not None and first.iteration > pre and rate is not None:
        anchor = pre - (first.iteration - pre) % LOST_SPAN
        anchor = anchor if anchor in progress else pre
        free_at = progress[anchor] + (first.iteration - anchor) * rate
    return {
        "lost_s": lost,
        "free_resumed_at": free_at,
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
    # A grow sample's shrink, which the grow measured here follows (not a failed remedy).
    preceded_by: str = ""
    resumed_by: str = ""
    transition_s: float | None = None  # the job's first resume after the incident - incident.detected
    cost_transition_s: float | None = None  # incident.cost.transition_seconds (set when it resumed itself)
    regain_s: float | None = None  # progress back at the pre-failure iteration - detected
    lost_s: float | None = None  # training time the failure cost against a failure-free run (time_lost)
    # When a failure-free run would have reported the iteration that resumed the job - detected:
    # the least transition_s any remedy could show (None when the job resumed at an iteration
    # it had done before: it recomputed).
    free_s: float | None = None
    # A grow only: the re-plan's assignment -> the first iteration at the new size, while the
    # job trains on at the old one (transition_s is then only the pause training took).
    prepare_s: float | None = None
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
    lost_s: float | None = None  # training time the failure cost against a failure-free run (time_lost)
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
    lost_p50 = _p([s.lost_s for s in done if s.lost_s is not None], 0.5)
    base_lost_p50 = _p([b.lost_s for b in base if b.lost_s is not None], 0.5)
    regain_speedup = _round(base_regain_p50 / regain_p50, 2) if regain_p50 and base_regain_p50 else None
    free_p50 = _p([s.free_s for s in done if s.free_s is not None], 0.5)
    pairs = lost_ratios(done, base)
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
        # The training time each side lost against a failure-free run (time_lost), and its ratio:
        # what a failure costs, with the iteration that both runs compute taken out.
        "lost_s_p50": lost_p50,
        "baseline_lost_s_p50": base_lost_p50,
        "lost_time_speedup": _round(base_lost_p50 / max(lost_p50, LOST_FLOOR_S), 2)
        if lost_p50 is not None and base_lost_p50
        else None,
        # The same ratio for each pair of samples failing after the same drawn iteration, the
        # baseline's loss depending on how far its last checkpoint is: the smallest of them.
        "lost_time_speedup_pairs": pairs,
        "lost_time_speedup_min": min(pairs) if pairs else None,
        # A failure-free run's time from the detection to the iteration that resumed the job,
        # and the speedup a remedy costing nothing would show against the baseline: where the
        # iteration's own compute is most of "to training again", no remedy gets past it.
        "free_p50_s": free_p50,
        "speedup_ceiling": _round(base_p50 / free_p50, 2) if free_p50 and base_p50 else None,
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


def lost_ratios(samples: list[Sample], baseline: list[BaselineSample]) -> list[float]:
    """Baseline time lost / Unicron's (at least LOST_FLOOR_S), for each Unicron sample and the
    first unpaired baseline sample that failed after the same drawn iteration, both measured."""
    free = [b for b in baseline if b.lost_s is not None and not b.error]
    out = []
    for sample in samples:
        if sample.lost_s is None or sample.error:
            continue
        match = next((b for b in free if b.step == sample.step), None)
        if match is not None and match.lost_s is not None:
            free.remove(match)
            out.append(round(match.lost_s / max(sample.lost_s, LOST_FLOOR_S), 2))
    return out


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
        f"{'base_lost':>9} {'regain':>7} {'base_regain':>11} {'lost_s':>7} {'base_lost_s':>11} {'lost_x':>7} "
        f"{'state':<16} result"
    )
    lines = [header, "-" * len(header)]
    for row in report["actions"]:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        target = "-" if row["target_speedup"] is None else f"{row['target_speedup']:g}x"
        sources = ",".join(sorted(row["state_sources"])) or "-"
        lost_x = "-" if row["lost_time_speedup"] is None else f"{row['lost_time_speedup']:.1f}x"
        lines.append(
            f"{row['action']:<10} {row['n']:>2} {num(row['p50_s']):>7} {num(row['baseline_p50_s']):>8} "
            f"{speedup:>8} {target:>6} {count(row['lost_iterations']):>4} "
            f"{count(row['baseline_lost_iterations']):>9} {num(row['regain_p50_s']):>7} "
            f"{num(row['baseline_regain_p50_s']):>11} {num(row['lost_s_p50']):>7} "
            f"{num(row['baseline_lost_s_p50']):>11} {lost_x:>7} {sources:<16} {'PASS' if row['met'] else 'FAIL'}"
        )
    lines.append(
        "(p50_s: incident detected -> first iteration in the new configuration; base_p50: kill -> first iteration "
        "after restarting every rank from the last checkpoint; regain: back at the pre-failure iteration; lost: most "
        "iterations recomputed in any sample; lost_s: training time lost against a failure-free run, p50; lost_x: "
        "the baseline's lost_s over Unicron's)"
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


def bench_spec(name: str, checkpoint_interval: int, data: int = DATA_PARALLEL, model: str = "gpt") -> pb.JobSpec:
    """The job every sample runs, data-parallel 2, allowed to shrink to 1, with a measured-looking
    throughput profile (so the planner sizes it like a real job) and the given checkpoint interval.
    `model`: "gpt" (the e2e tests' tiny GPT), "digits:WIDTH" (the plain PyTorch MLP, whose
    width sets its size: the same program the peers run; "digits-fsdp:WIDTH" sharded with
    FSDP2), "llm:LAYERS:HIDDEN" (the GPT in
    bf16 with Megatron's distributed optimizer and dropout, as LLM teams train) or
    "llama:SIZE" (the FSDP2 example under Session in bf16 mixed precision: tiny, 10m, 100m)."""
    kind, _, width = model.partition(":")
    if kind == "gpt":
        spec = tiny_gpt(name, data=data)
    elif kind in ("digits", "digits-fsdp"):
        spec = digits_mlp(name, data=data, hidden=int(width or 1024), fsdp=kind == "digits-fsdp")
    elif kind == "llm":
        layers, _, hidden = width.partition(":")
        spec = llm_gpt(name, int(layers or 4), int(hidden or 448), data=data)
    elif kind == "llama":
        spec = llama_fsdp(name, width or "tiny", data=data, precision="bf16")
    else:
        raise ValueError(
            f"unknown model {model!r}: gpt, digits:WIDTH, digits-fsdp:WIDTH, llm:LAYERS:HIDDEN or llama:SIZE"
        )
    spec.parallelism.min_data = 1
    spec.throughput[1] = 1.0e9
    if data >= 2:
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
    model: str = "gpt"
