"""The load bench's report and verdict (bench/load.py): what one step measured, judged against
the targets only where the load generator kept to its own schedule.

The simulated agents share the machine's cores with the coordinator they load. When their
processes fall behind (starved of CPU, or their event loops busy with other agents), their
heartbeats go out late and their answers are read late: the latencies they measure grow, and
the coordinator declares lost nodes whose beats were never sent. None of that is the
coordinator's doing, so such a step is reported but not judged. Pure functions of the
measurements, tested in tests/unit/test_load_verdict.py.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench.common import percentile

# What the coordinator asks of agents (its default) and the timeout the bench gives it.
HEARTBEAT_INTERVAL_S = 1.0
HEARTBEAT_TIMEOUT_S = 3.0
# Targets of the issue, on a 2-core machine.
P99_TARGET_MS = 50.0
BURST_SLACK_S = 2.0
# "No memory growth": the coordinator's resident memory at the end of the steady run may exceed
# its level after warm-up by at most this much (allocator noise and caches that fill once).
RSS_GROWTH_LIMIT = 0.10
# The generator fell behind when its event loops' lag p99 exceeds half the heartbeat p99
# target, 25 ms (2.5% of the heartbeat interval). A lagging loop reads every answer late, and
# sends every beat late, by its lag: a generator this slow can by itself turn a coordinator
# within the 50 ms target into one that misses it. The interval and the timeout tolerate far
# more (a node is lost only after 2 s of silence past its interval), so the latency target is
# the binding one.
LAG_LIMIT_MS = P99_TARGET_MS / 2
# A false node loss is put down to the generator when the process holding that agent lagged
# this much in the timeout before the loss: a lag delays both a beat and the reading of the
# answer the next beat waits for, so at a quarter of the 2 s slack between interval and timeout
# the generator alone used up half of it.
LOSS_LAG_MS = (HEARTBEAT_TIMEOUT_S - HEARTBEAT_INTERVAL_S) * 1000 / 4
# The window before a loss in which the generator's lag counts: the coordinator last heard of
# the node at least a timeout before it declared the loss, the beat before that an interval
# earlier.
LOSS_WINDOW_S = HEARTBEAT_TIMEOUT_S + HEARTBEAT_INTERVAL_S

PHASES = ("registration", "jobs_starting", "steady", "burst")
EMPTY = (math.inf, math.inf)


@dataclass
class Marks:
    """When (Unix seconds) each phase of a step began; None: the step never got there."""

    registration: float | None = None
    jobs_starting: float | None = None
    steady: float | None = None
    burst: float | None = None

    def spans(self) -> dict[str, tuple[float, float]]:
        """Each reached phase's [start, end): until the next one began, the last one open."""
        starts = [(name, start) for name in PHASES if (start := getattr(self, name)) is not None]
        ends = [start for _, start in starts[1:]] + [math.inf]
        return {name: (start, end) for (name, start), end in zip(starts, ends, strict=False)}

    def reached(self) -> str:
        """The phase the step was in last ('setup' before its agents started)."""
        return next((name for name in reversed(PHASES) if getattr(self, name) is not None), "setup")


@dataclass
class Measured:
    """What the bench observed of the coordinator in one step, as far as the step got."""

    registration_s: float | None = None
    jobs_running: int | None = None
    # (seconds into the steady run, MiB) every few seconds
    rss: list[tuple[float, float]] = field(default_factory=list)
    cpu_cores: float | None = None
    redis_cpu_cores: float | None = None
    # node id -> when the coordinator declared it lost (the record's state_since), for nodes
    # that never went away
    false_losses: dict[str, float] = field(default_factory=dict)
    vanished: list[str] = field(default_factory=list)
    hit: set[str] = field(default_factory=set)
    unreplanned: set[str] = field(default_factory=set)
    detected_s: float | None = None
    replanned_s: float | None = None


@dataclass(frozen=True)
class Verdict:
    judged: bool
    # None when not judged
    targets_met: bool | None
    text: str


def latency_row(
    calls: Iterable[Sequence[float]], start: float = 0.0, end: float = math.inf, column: int = 1
) -> dict[str, Any]:
    """p50, p99 and max of one column (default: milliseconds taken) of the rows whose first
    column (the time sent) is within [start, end)."""
    samples = [row[column] for row in calls if start <= row[0] < end]
    return {
        "n": len(samples),
        "p50_ms": round(percentile(samples, 0.5), 3) if samples else None,
        "p99_ms": round(percentile(samples, 0.99), 3) if samples else None,
        "max_ms": round(max(samples), 3) if samples else None,
    }


def rss_growth(samples: Sequence[tuple[float, float]]) -> float | None:
    """Relative growth of resident memory from the first third of the steady run to the last
    third (means, so one sample's allocator noise does not decide)."""
    if len(samples) < 6:
        return None
    third = len(samples) // 3
    early = statistics.fmean(rss for _, rss in samples[:third])
    late = statistics.fmean(rss for _, rss in samples[-third:])
    return (late - early) / early


def node_index(node_id: str) -> int | None:
    """sim-00042 -> 42 (None for a name of another form)."""
    digits = node_id.rpartition("-")[2]
    return int(digits) if digits.isdigit() else None


def losses_while_generator_late(
    losses: Mapping[str, float],
    lags: Sequence[tuple[range, Sequence[Sequence[float]] | None]],
    limit_ms: float = LOSS_LAG_MS,
    window_s: float = LOSS_WINDOW_S,
) -> list[str]:
    """The false losses (node id -> when declared) that coincide with the generator's lateness:
    the process holding that agent (`lags`: its agents' indices, and its probe's (time woken,
    ms late) samples, None when the process died) stalled at least `limit_ms` at some time
    within `window_s` before the loss. A stall ends when its sample was taken and began its
    lateness earlier."""
    late = []
    for node_id, lost_at in sorted(losses.items()):
        index = node_index(node_id)
        samples = next((s for held, s in lags if index is not None and index in held), [])
        if samples is None or any(
            ms >= limit_ms and t >= lost_at - window_s and t - ms / 1000 <= lost_at for t, ms in samples
        ):
            late.append(node_id)
    return late


def generator_trouble(lag_p99_ms: float | None, processes_died: int, limit_ms: float = LAG_LIMIT_MS) -> str:
    """Why the generator's step cannot be judged; empty when it kept up."""
    if processes_died:
        return f"the load generator failed ({processes_died} agent process(es) died)"
    if lag_p99_ms is not None and lag_p99_ms > limit_ms:
        return f"the load generator fell behind (lag p99 {lag_p99_ms:.1f} ms)"
    return ""


def judge(
    met: Mapping[str, bool],
    failure: str | None,
    lag_p99_ms: float | None,
    processes_died: int = 0,
    limit_ms: float = LAG_LIMIT_MS,
) -> Verdict:
    """A step's verdict. A generator that fell behind (or died) leaves the step unjudged,
    failure or not: the coordinator is not blamed for the generator's lateness. A step with no
    lag measured is unjudged too, unless it failed before its agents were under way (a cluster
    that would not start, agents stopped as they began): then it failed."""
    trouble = generator_trouble(lag_p99_ms, processes_died, limit_ms)
    if trouble:
        return Verdict(False, None, f"not judged: {trouble}" + (f"; the step failed: {failure}" if failure else ""))
    if failure is not None:
        return Verdict(True, False, f"failed: {failure}")
    if lag_p99_ms is None:
        return Verdict(False, None, "not judged: the load generator's lag was not measured")
    missed = [name for name, ok in met.items() if not ok]
    if missed:
        return Verdict(True, False, "missed: " + ", ".join(missed))
    return Verdict(True, True, "met")


def exit_code(rows: Iterable[Mapping[str, Any]]) -> int:
    """0: every judged step met its targets; 1: a judged step missed them or failed; 2: no step
    could be judged (nothing says the coordinator met anything)."""
    judged = [row for row in rows if row.get("judged")]
    if any(row.get("targets_met") is not True for row in judged):
        return 1
    return 0 if judged else 2


def _phase_rows(stats: Mapping[str, Any], spans: Mapping[str, tuple[float, float]]) -> dict[str, Any]:
    lag = [sample for _, samples in stats["loop_lag"] for sample in samples or ()]
    return {
        name: {
            "heartbeat": latency_row(stats["heartbeats"], start, end),
            "progress": latency_row(stats["progress"], start, end),
            "generator_lag": latency_row(lag, start, end),
            "heartbeat_send_late": latency_row(stats["heartbeats"], start, end, column=2),
            "progress_send_late": latency_row(stats["progress"], start, end, column=2),
        }
        for name, (start, end) in spans.items()
    }


def _generator(stats: Mapping[str, Any], marks: Marks, failure: str | None) -> dict[str, Any]:
    """The generator's own lateness. Judged over what the targets are judged on, from the jobs'
    start to the end; for a step that failed, over all it did, registration included."""
    start = marks.registration if failure else marks.jobs_starting
    lag = [sample for _, samples in stats["loop_lag"] for sample in samples or ()]
    steady = marks.spans().get("steady", EMPTY)
    return {
        "lag": latency_row(lag, start) if start is not None else latency_row([]),
        "lag_from": "registration" if failure else "jobs_starting",
        "lag_limit_ms": LAG_LIMIT_MS,
        "loss_lag_ms": LOSS_LAG_MS,
        "heartbeat_send_late": latency_row(stats["heartbeats"], *steady, column=2),
        "progress_send_late": latency_row(stats["progress"], *steady, column=2),
        "processes_died": stats["processes_died"],
    }


def _burst(measured: Measured) -> dict[str, Any]:
    return {
        "burst_agents": len(measured.vanished),
        "burst_jobs_hit": len(measured.hit),
        "burst_detection_s": None if measured.detected_s is None else round(measured.detected_s, 3),
        "burst_replan_s": None if measured.replanned_s is None else round(measured.replanned_s, 3),
        "burst_unreplanned_jobs": sorted(measured.unreplanned),
    }


def _met(report: Mapping[str, Any], measured: Measured, coordinator_losses: int) -> dict[str, bool]:
    burst_target = HEARTBEAT_TIMEOUT_S + BURST_SLACK_S
    p99 = report["rpc_p99_ms"]
    growth = report["coordinator_rss_growth"]
    detected, replanned = measured.detected_s, measured.replanned_s
    return {
        "rpc_p99": p99 is not None and p99 <= P99_TARGET_MS,
        "errors": report["errors"] == 0,
        # Losses that coincide with the generator's lateness are not the coordinator's.
        "false_node_losses": coordinator_losses == 0,
        "burst": detected is not None and replanned is not None and max(detected, replanned) <= burst_target,
        "memory": growth is not None and growth <= RSS_GROWTH_LIMIT,
    }


EMPTY_STATS: dict[str, Any] = {
    "heartbeats": [],
    "progress": [],
    "errors": {},
    "unknown_heartbeats": 0,
    "commands": {},
    "vanished": {},
    "loop_lag": [],
    "processes_died": 0,
}


def step_report(
    stats: Mapping[str, Any] | None,
    marks: Marks,
    measured: Measured,
    failure: str | None,
    baseline: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """One step's report from the agents' merged statistics (None: no agent ran), the phases'
    marks, what the bench observed and why the step failed (None: it did not)."""
    stats = stats or EMPTY_STATS
    phases = _phase_rows(stats, marks.spans())
    steady = phases.get("steady") or _phase_rows(stats, {"steady": EMPTY})["steady"]
    heartbeat = steady["heartbeat"]
    # A registration tried again (its deadline passed while the coordinator was busy with the
    # others) is the agents' backoff doing its work, not a failed call: counted apart.
    retries = sum(n for kind, n in stats["errors"].items() if kind.startswith("register:"))
    late_losses = losses_while_generator_late(measured.false_losses, stats["loop_lag"])
    growth = rss_growth(measured.rss)
    base_p99 = baseline["heartbeat"]["p99_ms"] if baseline else None
    report: dict[str, Any] = {
        "failure": failure,
        "rpc_p50_ms": heartbeat["p50_ms"],
        "rpc_p99_ms": heartbeat["p99_ms"],
        "heartbeat": heartbeat,
        "progress": steady["progress"],
        "phases": phases,
        "generator": _generator(stats, marks, failure),
        "registration_s": None if measured.registration_s is None else round(measured.registration_s, 1),
        "registration_retries": retries,
        "jobs_running": measured.jobs_running,
        "errors": sum(stats["errors"].values()) - retries,
        "errors_by_kind": stats["errors"],
        "unknown_heartbeats": stats["unknown_heartbeats"],
        "commands": stats["commands"],
        "false_node_losses": len(measured.false_losses),
        "false_node_losses_while_generator_late": len(late_losses),
        **_burst(measured),
        "coordinator_rss_mb": round(measured.rss[-1][1], 1) if measured.rss else None,
        "coordinator_rss_growth": None if growth is None else round(growth, 4),
        "coordinator_rss_samples_mb": [round(m, 1) for _, m in measured.rss],
        "coordinator_cpu": None if measured.cpu_cores is None else round(measured.cpu_cores, 3),
        "redis_cpu": None if measured.redis_cpu_cores is None else round(measured.redis_cpu_cores, 3),
        "p99_ratio_to_baseline": round(heartbeat["p99_ms"] / base_p99, 2) if heartbeat["p99_ms"] and base_p99 else None,
        "targets": {
            "rpc_p99_ms": P99_TARGET_MS,
            "burst_s": HEARTBEAT_TIMEOUT_S + BURST_SLACK_S,
            "rss_growth": RSS_GROWTH_LIMIT,
            "generator_lag_p99_ms": LAG_LIMIT_MS,
        },
    }
    report["met"] = {} if failure else _met(report, measured, len(measured.false_losses) - len(late_losses))
    verdict = judge(report["met"], failure, report["generator"]["lag"]["p99_ms"], stats["processes_died"])
    report.update({"judged": verdict.judged, "targets_met": verdict.targets_met, "verdict": verdict.text})
    return report


# What a step's row of the scaling table takes from its report as it is.
STEP_KEYS = (
    "agents",
    "jobs",
    "redis",
    "redis_replicas",
    "verdict",
    "judged",
    "targets_met",
    "failure",
    "met",
    "coordinator_cpu",
    "redis_cpu",
    "rpc_p50_ms",
    "rpc_p99_ms",
    "registration_s",
    "registration_retries",
    "errors",
    "false_node_losses",
    "false_node_losses_while_generator_late",
    "burst_detection_s",
    "burst_replan_s",
    "coordinator_rss_mb",
)


def step_row(report: Mapping[str, Any]) -> dict[str, Any]:
    """One step's line of the scaling table."""
    baseline = report.get("baseline")
    generator = report["generator"]
    return {
        **{key: report.get(key) for key in STEP_KEYS},
        "baseline_p99_ms": baseline["heartbeat"]["p99_ms"] if baseline else None,
        "progress_p99_ms": report["progress"]["p99_ms"],
        "generator_lag_p99_ms": generator["lag"]["p99_ms"],
        "generator_lag_max_ms": generator["lag"]["max_ms"],
        "heartbeat_send_late_p99_ms": generator["heartbeat_send_late"]["p99_ms"],
    }


def skipped_row(agents: int, jobs: int, reason: str) -> dict[str, Any]:
    return {
        "agents": agents,
        "jobs": jobs,
        "skipped": reason,
        "judged": False,
        "targets_met": None,
        "verdict": f"skipped: {reason}",
    }


def format_table(report: Mapping[str, Any]) -> str:
    met = report["met"]

    def verdict(key: str) -> str:
        if key not in met:
            return ""
        return ("PASS" if met[key] else "FAIL") if report["judged"] else "(not judged)"

    def line(name: str, value: object, target: object = "-", key: str = "") -> str:
        return f"{name:<38} {value!s:>12} {target!s:>10}  {verdict(key)}".rstrip()

    base = report["baseline"]["heartbeat"] if report.get("baseline") else {}
    phases = report["phases"]
    generator = report["generator"]
    lag = generator["lag"]
    # Whether the generator kept to its schedule: the condition of every other verdict here.
    kept_up = "" if lag["p99_ms"] is None else "BEHIND" if lag["p99_ms"] > LAG_LIMIT_MS else "kept up"
    lines = [
        f"{'measure':<38} {'value':>12} {'target':>10}  result",
        "-" * 70,
        f"redis: {report['redis']}" + (f", {report['redis_replicas']} replicas" if report["redis_replicas"] else ""),
        line("steady: heartbeat p50 (ms)", report["rpc_p50_ms"]),
        line("steady: heartbeat p99 (ms)", report["rpc_p99_ms"], f"{P99_TARGET_MS:g}", "rpc_p99"),
        line("  10-agent baseline p99 (ms)", base.get("p99_ms")),
        line("steady: progress report p99 (ms)", report["progress"]["p99_ms"]),
        line("  while jobs start: heartbeat p99", phases.get("jobs_starting", {}).get("heartbeat", {}).get("p99_ms")),
        line("  during the burst: heartbeat p99", phases.get("burst", {}).get("heartbeat", {}).get("p99_ms")),
        line("generator: loop lag p50 (ms)", lag["p50_ms"]),
        f"{'generator: loop lag p99 (ms)':<38} {lag['p99_ms']!s:>12} {LAG_LIMIT_MS:>10g}  {kept_up}",
        line("generator: loop lag max (ms)", lag["max_ms"]),
        line("generator: beats sent late p99 (ms)", generator["heartbeat_send_late"]["p99_ms"]),
        line("generator: progress sent late p99", generator["progress_send_late"]["p99_ms"]),
        line("registration (s)", report["registration_s"]),
        line("  registrations tried again", report["registration_retries"]),
        line("errors", report["errors"], 0, "errors"),
        line("false node losses", report["false_node_losses"], 0, "false_node_losses"),
        line("  of them while the generator was late", report["false_node_losses_while_generator_late"]),
        line("burst: all lost (s)", report["burst_detection_s"], f"{report['targets']['burst_s']:g}", "burst"),
        line("burst: all re-planned (s)", report["burst_replan_s"], f"{report['targets']['burst_s']:g}"),
        line("coordinator RSS (MB)", report["coordinator_rss_mb"]),
        line("coordinator RSS growth", report["coordinator_rss_growth"], f"{RSS_GROWTH_LIMIT:g}", "memory"),
        line("coordinator CPU (cores)", report["coordinator_cpu"]),
        line("redis CPU (cores, servers)", report["redis_cpu"]),
        f"verdict: {report['verdict']}",
    ]
    return "\n".join(lines)


def format_steps(rows: Sequence[Mapping[str, Any]]) -> str:
    head = f"{'agents':>7} {'jobs':>5} {'reg s':>6} {'coord CPU':>9} {'hb p50 ms':>9} {'hb p99 ms':>9} "
    head += f"{'gen lag p99':>11} {'errors':>6} {'false loss':>10} {'lost s':>7} {'replan s':>8} {'RSS MB':>7}  verdict"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['agents']:>7} {r['jobs']:>5}  {r['verdict']}")
            continue
        losses = f"{r['false_node_losses']}"
        if r["false_node_losses_while_generator_late"]:
            losses += f" ({r['false_node_losses_while_generator_late']} gen)"
        lines.append(
            f"{r['agents']:>7} {r['jobs']:>5} {r['registration_s']!s:>6} {r['coordinator_cpu']!s:>9} "
            f"{r['rpc_p50_ms']!s:>9} {r['rpc_p99_ms']!s:>9} {r['generator_lag_p99_ms']!s:>11} {r['errors']!s:>6} "
            f"{losses:>10} {r['burst_detection_s']!s:>7} {r['burst_replan_s']!s:>8} {r['coordinator_rss_mb']!s:>7}  "
            f"{r['verdict']}"
        )
    return "\n".join(lines)
