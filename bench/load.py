"""Load benchmark: the real coordinator (with its real Redis and planners, on 127.0.0.1) held
under 1,000 simulated agents heartbeating every second and 100 jobs reporting progress, then a
burst in which 10% of the agents vanish at once.

    python -m bench.load [--quick] [--agents N] [--jobs N] [--minutes M]

The agents (bench/load_agents.py) speak the real agent protocol from a few separate processes;
only trainers are missing. Measured: heartbeat and progress-report latency at the agents
(client side, so queueing in the coordinator counts), every error status, nodes the coordinator
declared lost that never went away (false losses), how long the burst takes to be noticed (all
vanished nodes LOST) and re-planned (every job that lost a node has a new assignment without
it), and the coordinator's memory and CPU over the run. The burst's times come from the
coordinator's own records (each node's `state_since`, each assignment's `assigned`), read once
the burst is over: a client polling a busy coordinator would add its own delays, and its polls
would load what they measure. Latency targets hold for the steady
load; the jobs' start and the burst are reported apart. Before the load, the same latencies
with 10 agents give the unloaded baseline of this machine, in the same run. Results go to
bench/results/load.json and a table to stdout; the exit status is 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.common import log, percentile, write_results
from unicron.client import UnicronClient
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import ROOT, LocalCluster, tiny_gpt

RESULTS = Path(__file__).resolve().parent / "results" / "load.json"
HEARTBEAT_TIMEOUT_S = 3.0
# Targets of the issue, on a 2-core machine.
P99_TARGET_MS = 50.0
BURST_SLACK_S = 2.0
# "No memory growth": the coordinator's resident memory at the end of the steady run may exceed
# its level after warm-up by at most this much (allocator noise and caches that fill once).
RSS_GROWTH_LIMIT = 0.10
AGENTS_PER_PROCESS = 500
SAMPLE_S = 5.0


@dataclass(frozen=True)
class Settings:
    agents: int
    jobs: int
    ranks_per_job: int
    slots: int
    steady_s: float
    burst_fraction: float
    baseline_s: float


class AgentProcesses:
    """The simulated agents' processes, driven through their stdin."""

    def __init__(self, cluster: LocalCluster, prefix: str, count: int, slots: int, run_dir: Path) -> None:
        pki = cluster.pki
        if pki is None:
            raise RuntimeError("the load bench runs the cluster secure (mutual TLS, join token)")
        leaf = pki.clients["admin"]
        tls = ["--ca", str(pki.ca), "--cert", str(leaf.cert), "--key", str(leaf.key)]
        self.procs: list[tuple[subprocess.Popen[str], Path, range]] = []
        for first in range(0, count, AGENTS_PER_PROCESS):
            n = min(AGENTS_PER_PROCESS, count - first)
            out = run_dir / f"{prefix}-{first}.json"
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.load_agents", "--coordinator", cluster.coordinator, "--prefix", prefix,
                 "--first", str(first), "--count", str(n), "--slots", str(slots), "--out", str(out),
                 *tls, "--join-token-file", str(pki.join_token_file)],
                cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            self.procs.append((proc, out, range(first, first + n)))
        self.prefix = prefix

    def wait_registered(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc, _, _ in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != "registered" or time.monotonic() > deadline:
                raise RuntimeError(f"simulated agents did not register (said {line!r}, exit {proc.poll()})")

    def vanish(self, node_ids: list[str]) -> None:
        for proc, _, _ in self.procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("vanish " + ",".join(node_ids) + "\n")
            proc.stdin.flush()
        for proc, _, _ in self.procs:
            assert proc.stdout is not None
            proc.stdout.readline()

    def stop(self) -> dict[str, Any]:
        merged: dict[str, Any] = {"heartbeats": [], "progress": [], "errors": {}, "unknown_heartbeats": 0,
                                  "commands": {}, "vanished": {}}  # fmt: skip
        for proc, out, _ in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write("stop\n")
                    proc.stdin.flush()
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                proc.kill()
                proc.wait()
            if not out.exists():
                merged["errors"]["agents_process_died"] = merged["errors"].get("agents_process_died", 0) + 1
                continue
            part = json.loads(out.read_text())
            merged["heartbeats"] += part["heartbeats"]
            merged["progress"] += part["progress"]
            merged["unknown_heartbeats"] += part["unknown_heartbeats"]
            merged["vanished"].update(part["vanished"])
            for table in ("errors", "commands"):
                for key, value in part[table].items():
                    merged[table][key] = merged[table].get(key, 0) + value
        return merged


def node_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:05d}"


def latency_row(calls: list[tuple[float, float]], start: float = 0.0, end: float = float("inf")) -> dict[str, Any]:
    """Latency of the calls sent within [start, end), from (time sent, milliseconds) pairs."""
    samples = [ms for sent, ms in calls if start <= sent < end]
    return {
        "n": len(samples),
        "p50_ms": round(percentile(samples, 0.5), 3) if samples else None,
        "p99_ms": round(percentile(samples, 0.99), 3) if samples else None,
        "max_ms": round(max(samples), 3) if samples else None,
    }


def rss_growth(samples: list[tuple[float, float]]) -> float | None:
    """Relative growth of resident memory from the first third of the steady run to the last
    third (means, so one sample's allocator noise does not decide)."""
    if len(samples) < 6:
        return None
    third = len(samples) // 3
    early = statistics.fmean(rss for _, rss in samples[:third])
    late = statistics.fmean(rss for _, rss in samples[-third:])
    return (late - early) / early


def measure_baseline(cluster: LocalCluster, settings: Settings, run_dir: Path) -> dict[str, Any]:
    """Heartbeat latency with 10 agents: this machine's floor, measured in the same run."""
    agents = AgentProcesses(cluster, "base", 10, settings.slots, run_dir)
    agents.wait_registered(60)
    time.sleep(settings.baseline_s)
    stats = agents.stop()
    return {"agents": 10, "heartbeat": latency_row(stats["heartbeats"]), "errors": stats["errors"]}


def lost_nodes(client: UnicronClient, prefix: str) -> set[str]:
    return {n.node_id for n in client.nodes() if n.node_id.startswith(prefix) and n.state == pb.NODE_STATE_LOST}


def seconds(timestamp: Any) -> float:
    return float(timestamp.ToNanoseconds()) / 1e9


def job_nodes(job: pb.Job) -> set[str]:
    return {w.node_id for w in job.assignment.workers}


def run(settings: Settings, run_dir: Path) -> dict[str, Any]:
    report: dict[str, Any] = {"agents": settings.agents, "jobs": settings.jobs}
    cluster = LocalCluster(
        run_dir / "cluster",
        agents=0,
        planners=2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    with cluster, cluster.client(timeout_s=30.0) as client:
        coordinator = psutil.Process(cluster.service("coordinator").proc.pid)
        log("baseline: 10 agents")
        report["baseline"] = measure_baseline(cluster, settings, run_dir)
        log(f"baseline heartbeat p99 {report['baseline']['heartbeat']['p99_ms']} ms")
        # The baseline's agents are gone; jobs must not be placed on them before that is known.
        deadline = time.monotonic() + 30
        while len(lost_nodes(client, "base-")) < 10 and time.monotonic() < deadline:
            time.sleep(0.5)

        log(f"starting {settings.agents} simulated agents")
        agents = AgentProcesses(cluster, "sim", settings.agents, settings.slots, run_dir)
        try:
            registering_at = time.monotonic()
            agents.wait_registered(300)
            registration_s = time.monotonic() - registering_at
            log(f"agents registered in {registration_s:.1f}s; submitting jobs")
            starting_at = time.time()
            for i in range(settings.jobs):
                client.submit(tiny_gpt(f"load-{i:03d}", data=settings.ranks_per_job))
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                jobs = client.list_jobs()
                placed = [j for j in jobs if j.state == pb.JOB_STATE_RUNNING]
                if len(placed) == settings.jobs:
                    break
                time.sleep(1.0)
            report["jobs_running"] = len(placed)
            log(f"{len(placed)} jobs running; steady load for {settings.steady_s:.0f}s")

            steady_at = time.time()
            coordinator.cpu_percent(None)
            cpu_start = sum(coordinator.cpu_times()[:2])
            wall_start = time.monotonic()
            rss: list[tuple[float, float]] = []
            false_losses: set[str] = set()
            while time.monotonic() - wall_start < settings.steady_s:
                time.sleep(SAMPLE_S)
                rss.append((time.monotonic() - wall_start, coordinator.memory_info().rss / 2**20))
                false_losses |= lost_nodes(client, "sim-")
            cpu_cores = (sum(coordinator.cpu_times()[:2]) - cpu_start) / (time.monotonic() - wall_start)

            # The burst: 10% of the agents vanish at once, the nodes of some jobs among them.
            before = {j.job_id: j for j in client.list_jobs()}
            vanish = random.Random(7).sample(
                [node_name("sim", i) for i in range(settings.agents)], int(settings.agents * settings.burst_fraction)
            )
            hit = {job_id for job_id, job in before.items() if job_nodes(job) & set(vanish)}
            log(f"burst: {len(vanish)} agents vanish, {len(hit)} jobs lose a node")
            burst_at = time.time()
            agents.vanish(vanish)
            detected_s = replanned_s = None
            pending = set(hit)
            while time.time() - burst_at < 60:
                time.sleep(0.5)
                lost = {n.node_id: n for n in client.nodes() if n.state == pb.NODE_STATE_LOST}
                if not set(vanish) <= set(lost):
                    continue
                hit_jobs = {j.job_id: j for j in client.list_jobs() if j.job_id in hit}
                pending = {
                    job_id
                    for job_id, job in hit_jobs.items()
                    if job.assignment.generation <= before[job_id].assignment.generation or job_nodes(job) & set(vanish)
                }
                if not pending:
                    detected_s = max(seconds(lost[n].state_since) for n in vanish) - burst_at
                    replanned_s = max(seconds(job.assignment.assigned) for job in hit_jobs.values()) - burst_at
                    break
            false_losses |= lost_nodes(client, "sim-") - set(vanish)
        finally:
            stats = agents.stop()

    # The targets hold for the steady load; the jobs' start (a hundred submitted at once) and
    # the burst are reported apart.
    heartbeat = latency_row(stats["heartbeats"], steady_at, burst_at)
    phases = {
        name: {
            "heartbeat": latency_row(stats["heartbeats"], start, end),
            "progress": latency_row(stats["progress"], start, end),
        }
        for name, start, end in (
            ("jobs_starting", starting_at, steady_at),
            ("steady", steady_at, burst_at),
            ("burst", burst_at, float("inf")),
        )
    }
    growth = rss_growth(rss)
    # A registration tried again (its deadline passed while the coordinator was busy with the
    # others) is the agents' backoff doing its work, not a failed call: counted apart.
    retries = {kind: n for kind, n in stats["errors"].items() if kind.startswith("register:")}
    errors = sum(stats["errors"].values()) - sum(retries.values())
    report.update(
        {
            "duration_s": round(settings.steady_s, 1),
            "rpc_p50_ms": heartbeat["p50_ms"],
            "rpc_p99_ms": heartbeat["p99_ms"],
            "heartbeat": heartbeat,
            "progress": phases["steady"]["progress"],
            "phases": phases,
            "registration_s": round(registration_s, 1),
            "registration_retries": sum(retries.values()),
            "errors": errors,
            "errors_by_kind": stats["errors"],
            "unknown_heartbeats": stats["unknown_heartbeats"],
            "commands": stats["commands"],
            "false_node_losses": len(false_losses),
            "burst_agents": len(vanish),
            "burst_jobs_hit": len(hit),
            "burst_detection_s": None if detected_s is None else round(detected_s, 3),
            "burst_replan_s": None if replanned_s is None else round(replanned_s, 3),
            "burst_unreplanned_jobs": sorted(pending),
            "coordinator_rss_mb": round(rss[-1][1], 1) if rss else None,
            "coordinator_rss_growth": None if growth is None else round(growth, 4),
            "coordinator_rss_samples_mb": [round(m, 1) for _, m in rss],
            "coordinator_cpu": round(cpu_cores, 3),
            "p99_ratio_to_baseline": (
                round(heartbeat["p99_ms"] / report["baseline"]["heartbeat"]["p99_ms"], 2)
                if heartbeat["p99_ms"] and report["baseline"]["heartbeat"]["p99_ms"]
                else None
            ),
        }
    )
    burst_target = HEARTBEAT_TIMEOUT_S + BURST_SLACK_S
    report["targets"] = {
        "rpc_p99_ms": P99_TARGET_MS,
        "burst_s": burst_target,
        "rss_growth": RSS_GROWTH_LIMIT,
    }
    report["met"] = {
        "rpc_p99": heartbeat["p99_ms"] is not None and heartbeat["p99_ms"] <= P99_TARGET_MS,
        "errors": errors == 0,
        "false_node_losses": not false_losses,
        "burst": detected_s is not None and replanned_s is not None and max(detected_s, replanned_s) <= burst_target,
        "memory": growth is not None and growth <= RSS_GROWTH_LIMIT,
    }
    report["targets_met"] = all(report["met"].values())
    return report


def format_table(report: dict[str, Any]) -> str:
    met = report["met"]

    def verdict(key: str) -> str:
        return "PASS" if met[key] else "FAIL"

    base = report["baseline"]["heartbeat"]
    lines = [
        f"{'measure':<34} {'value':>12} {'target':>10}  result",
        "-" * 66,
        f"{'steady: heartbeat p50 (ms)':<34} {report['rpc_p50_ms']!s:>12} {'-':>10}",
        f"{'steady: heartbeat p99 (ms)':<34} {report['rpc_p99_ms']!s:>12} {P99_TARGET_MS:>10g}  {verdict('rpc_p99')}",
        f"{'  10-agent baseline p99 (ms)':<34} {base['p99_ms']!s:>12} {'-':>10}",
        f"{'steady: progress report p99 (ms)':<34} {report['progress']['p99_ms']!s:>12} {'-':>10}",
        f"{'  while jobs start: heartbeat p99':<34} {report['phases']['jobs_starting']['heartbeat']['p99_ms']!s:>12} "
        f"{'-':>10}",
        f"{'  during the burst: heartbeat p99':<34} {report['phases']['burst']['heartbeat']['p99_ms']!s:>12} {'-':>10}",
        f"{'registration (s)':<34} {report['registration_s']!s:>12} {'-':>10}",
        f"{'  registrations tried again':<34} {report['registration_retries']!s:>12} {'-':>10}",
        f"{'errors':<34} {report['errors']:>12} {0:>10}  {verdict('errors')}",
        f"{'false node losses':<34} {report['false_node_losses']:>12} {0:>10}  {verdict('false_node_losses')}",
        f"{'burst: all lost (s)':<34} {report['burst_detection_s']!s:>12} "
        f"{report['targets']['burst_s']:>10g}  {verdict('burst')}",
        f"{'burst: all re-planned (s)':<34} {report['burst_replan_s']!s:>12} {report['targets']['burst_s']:>10g}",
        f"{'coordinator RSS (MB)':<34} {report['coordinator_rss_mb']!s:>12} {'-':>10}",
        f"{'coordinator RSS growth':<34} {report['coordinator_rss_growth']!s:>12} "
        f"{RSS_GROWTH_LIMIT:>10g}  {verdict('memory')}",
        f"{'coordinator CPU (cores)':<34} {report['coordinator_cpu']!s:>12} {'-':>10}",
        f"all targets met: {report['targets_met']}",
    ]
    return "\n".join(lines)


STEPS_RESULTS = RESULTS.with_name("load_steps.json")
# Minutes of steady load per step when --steps is given without --minutes.
STEP_MINUTES = 1.5


def step_row(report: dict[str, Any]) -> dict[str, Any]:
    """One step's line of the scaling table."""
    return {
        "agents": report["agents"],
        "jobs": report["jobs"],
        "coordinator_cpu": report["coordinator_cpu"],
        "rpc_p50_ms": report["rpc_p50_ms"],
        "rpc_p99_ms": report["rpc_p99_ms"],
        "baseline_p99_ms": report["baseline"]["heartbeat"]["p99_ms"],
        "progress_p99_ms": report["progress"]["p99_ms"],
        "registration_s": report.get("registration_s"),
        "registration_retries": report.get("registration_retries"),
        "errors": report["errors"],
        "false_node_losses": report["false_node_losses"],
        "burst_detection_s": report["burst_detection_s"],
        "burst_replan_s": report["burst_replan_s"],
        "coordinator_rss_mb": report["coordinator_rss_mb"],
        "targets_met": report["targets_met"],
        "met": report["met"],
    }


def format_steps(rows: list[dict[str, Any]]) -> str:
    head = f"{'agents':>7} {'jobs':>5} {'reg s':>6} {'coord CPU':>9} {'hb p50 ms':>9} {'hb p99 ms':>9} {'errors':>6} "
    head += f"{'false loss':>10} {'lost s':>7} {'replan s':>8} {'RSS MB':>7}  targets"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['agents']:>7} {r['jobs']:>5}  skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['agents']:>7} {r['jobs']:>5} {r.get('registration_s')!s:>6} {r['coordinator_cpu']!s:>9} "
            f"{r['rpc_p50_ms']!s:>9} "
            f"{r['rpc_p99_ms']!s:>9} {r['errors']:>6} {r['false_node_losses']:>10} {r['burst_detection_s']!s:>7} "
            f"{r['burst_replan_s']!s:>8} {r['coordinator_rss_mb']!s:>7}  {'met' if r['targets_met'] else 'missed'}"
        )
    return "\n".join(lines)


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100 agents, 10 jobs, 1 minute")
    parser.add_argument("--agents", type=int, default=None, help="simulated agents (default 1000)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs reporting progress (default 100)")
    parser.add_argument("--minutes", type=float, default=None, help="steady load before the burst (default 5)")
    parser.add_argument(
        "--steps",
        default="",
        help="agent counts, e.g. 250,500,1000,2000: a run of each (jobs a tenth of the agents, "
        f"{STEP_MINUTES:g} minutes each unless --minutes), the table of steps to {STEPS_RESULTS.name}",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)
    if args.steps:
        return run_steps(args)
    return run_one(args, args.out or RESULTS)


def parse_steps(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--steps: {text!r} is not a comma-separated list of agent counts") from None
    if not counts or any(n < 10 for n in counts):
        raise SystemExit(f"--steps: {text!r}: each step needs at least 10 agents")
    return counts


def run_steps(args: argparse.Namespace) -> int:
    """The control plane at growing sizes: the same run per step, a row each."""
    rows = []
    minutes = args.minutes if args.minutes is not None else STEP_MINUTES
    for agents in parse_steps(args.steps):
        log(f"step: {agents} agents")
        step_args = argparse.Namespace(**{**vars(args), "agents": agents, "jobs": max(1, agents // 10)})
        step_args.minutes = minutes
        out = (args.out or STEPS_RESULTS).with_name(f"load_{agents}.json")
        try:
            run_one(step_args, out)
        except RuntimeError as exc:
            # A size the control plane cannot take is a result too: the row says why.
            log(f"step {agents} skipped: {exc}")
            rows.append({"agents": agents, "jobs": step_args.jobs, "skipped": str(exc)})
            continue
        rows.append(step_row(json.loads(out.read_text())))
    target = args.out or STEPS_RESULTS
    write_results(target, {"steps": rows, "steady_minutes_per_step": minutes, "cpus": psutil.cpu_count()})
    print(format_steps(rows))
    print(f"\nwrote {target}")
    return 0


def run_one(args: argparse.Namespace, out: Path) -> int:
    quick = args.quick
    settings = Settings(
        agents=args.agents or (100 if quick else 1000),
        jobs=args.jobs or (10 if quick else 100),
        # Jobs of 4 ranks over nodes of 2 slots: each job spans 2 nodes, 200 of the 1,000.
        ranks_per_job=4,
        slots=2,
        steady_s=60.0 * (args.minutes if args.minutes is not None else (1.0 if quick else 5.0)),
        burst_fraction=0.10,
        baseline_s=10.0 if quick else 20.0,
    )
    run_dir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    log(f"run directory {run_dir}")
    try:
        report = run(settings, run_dir)
    finally:
        if not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
    report["settings"] = {
        "agents": settings.agents,
        "jobs": settings.jobs,
        "ranks_per_job": settings.ranks_per_job,
        "slots_per_agent": settings.slots,
        "steady_s": settings.steady_s,
        "burst_fraction": settings.burst_fraction,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "cpus": psutil.cpu_count(),
    }
    write_results(out, report)
    print(format_table(report))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
