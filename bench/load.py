"""Load benchmark: the real coordinator (with its real Redis and planners, on 127.0.0.1) held
under 1,000 simulated agents heartbeating every second and 100 jobs reporting progress, then a
burst in which 10% of the agents vanish at once.

    python -m bench.load [--quick] [--agents N] [--jobs N] [--minutes M] [--redis-replicas N]

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
with 10 agents give the unloaded baseline of this machine, in the same run.

The agents share the machine with the coordinator, so they also measure their own lateness;
a step whose generator fell behind is reported but not judged (bench/load_verdict.py). A step
that breaks (agents that cannot register in time, a call the coordinator does not answer) is a
result too: its report says why. Results go to bench/results/load.json and a table to stdout.
Exit status: 0 when every judged step met its targets, 1 when one missed them or failed, 2 when
no step could be judged, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import json
import random
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.common import log, write_results
from bench.load_verdict import (
    HEARTBEAT_TIMEOUT_S,
    Marks,
    Measured,
    exit_code,
    format_steps,
    format_table,
    latency_row,
    skipped_row,
    step_report,
    step_row,
)
from unicron.client import UnicronClient
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import ROOT, LocalCluster, tiny_gpt

RESULTS_DIR = Path(__file__).resolve().parent / "results"
AGENTS_PER_PROCESS = 500
SAMPLE_S = 5.0
# How long the simulated agents may take to register before the step fails (they retry with
# backoff meanwhile, as real agents do).
REGISTRATION_LIMIT_S = 300.0


@dataclass(frozen=True)
class Settings:
    agents: int
    jobs: int
    ranks_per_job: int
    slots: int
    steady_s: float
    burst_fraction: float
    baseline_s: float
    # 0: one Redis; more: a primary with this many replicas under Sentinel, every write
    # acknowledged once a replica holds it (unicron_dev.redis_group)
    redis_replicas: int = 0


def results_path(name: str, replicas: int) -> Path:
    """A results file of bench/results; runs against replicated Redis get their own, so that
    the two can be compared side by side."""
    return RESULTS_DIR / (f"{name}_replicas{replicas}.json" if replicas else f"{name}.json")


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
        """Until every process says its agents are registered; RuntimeError past `timeout_s`
        or when one cannot register them (its processes go on until `stop`)."""
        deadline = time.monotonic() + timeout_s
        for done, (proc, _, _) in enumerate(self.procs):
            assert proc.stdout is not None
            # Nothing else is written before this line, so the pipe holds no buffered text yet.
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                raise RuntimeError(
                    f"the simulated agents did not register within {timeout_s:g} s "
                    f"({done} of {len(self.procs)} agent processes done)"
                )
            line = proc.stdout.readline().strip()
            if line != "registered":
                raise RuntimeError(f"simulated agents did not register: {line or f'exit {proc.poll()}'}")

    def vanish(self, node_ids: list[str]) -> None:
        for proc, _, _ in self.procs:
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write("vanish " + ",".join(node_ids) + "\n")
            proc.stdin.flush()
        for proc, _, _ in self.procs:
            assert proc.stdout is not None
            proc.stdout.readline()

    def stop(self) -> dict[str, Any]:
        """Stops every process and merges their statistics. `loop_lag` keeps each process's
        probe apart, with the agents it held (None for a process that died), to tell whose
        losses coincide with whose lateness."""
        merged: dict[str, Any] = {"heartbeats": [], "progress": [], "errors": {}, "unknown_heartbeats": 0,
                                  "commands": {}, "vanished": {}, "loop_lag": [], "processes_died": 0}  # fmt: skip
        for proc, out, held in self.procs:
            try:
                if proc.poll() is None and proc.stdin is not None:
                    proc.stdin.write("stop\n")
                    proc.stdin.flush()
                proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, BrokenPipeError):
                proc.kill()
                proc.wait()
            try:
                part = json.loads(out.read_text())
            except (OSError, ValueError):
                merged["processes_died"] += 1
                merged["errors"]["agents_process_died"] = merged["errors"].get("agents_process_died", 0) + 1
                merged["loop_lag"].append((held, None))
                continue
            merged["heartbeats"] += part["heartbeats"]
            merged["progress"] += part["progress"]
            merged["unknown_heartbeats"] += part["unknown_heartbeats"]
            merged["vanished"].update(part["vanished"])
            merged["loop_lag"].append((held, part["loop_lag"]))
            for table in ("errors", "commands"):
                for key, value in part[table].items():
                    merged[table][key] = merged[table].get(key, 0) + value
        return merged


def node_name(prefix: str, index: int) -> str:
    return f"{prefix}-{index:05d}"


def measure_baseline(cluster: LocalCluster, settings: Settings, run_dir: Path) -> dict[str, Any]:
    """Heartbeat latency with 10 agents: this machine's floor, measured in the same run."""
    agents = AgentProcesses(cluster, "base", 10, settings.slots, run_dir)
    try:
        agents.wait_registered(60)
        time.sleep(settings.baseline_s)
    finally:
        stats = agents.stop()
    return {"agents": 10, "heartbeat": latency_row(stats["heartbeats"]), "errors": stats["errors"]}


def lost_nodes(client: UnicronClient, prefix: str) -> dict[str, float]:
    """The nodes of `prefix` the coordinator holds LOST, with when it declared them lost."""
    return {
        n.node_id: seconds(n.state_since)
        for n in client.nodes()
        if n.node_id.startswith(prefix) and n.state == pb.NODE_STATE_LOST
    }


def note_false_losses(client: UnicronClient, measured: Measured, vanished: set[str] | None = None) -> None:
    for node_id, lost_at in lost_nodes(client, "sim-").items():
        if node_id not in (vanished or set()):
            measured.false_losses.setdefault(node_id, lost_at)


def seconds(timestamp: Any) -> float:
    return float(timestamp.ToNanoseconds()) / 1e9


def job_nodes(job: pb.Job) -> set[str]:
    return {w.node_id for w in job.assignment.workers}


def redis_servers() -> list[psutil.Process]:
    """The Redis servers this bench started, replicas included, sentinels not (a server
    rewrites its command line to `redis-server HOST:PORT`, a sentinel's ends in [sentinel])."""
    found = []
    for proc in psutil.Process().children():
        try:
            title = " ".join(proc.cmdline())
        except psutil.Error:
            continue
        if "redis-server" in title and "sentinel" not in title:
            found.append(proc)
    return found


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            total += sum(proc.cpu_times()[:2])
        except psutil.Error:
            continue
    return total


def start_jobs(client: UnicronClient, settings: Settings, marks: Marks, measured: Measured) -> None:
    marks.jobs_starting = time.time()
    for i in range(settings.jobs):
        client.submit(tiny_gpt(f"load-{i:03d}", data=settings.ranks_per_job))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        measured.jobs_running = sum(j.state == pb.JOB_STATE_RUNNING for j in client.list_jobs())
        if measured.jobs_running == settings.jobs:
            break
        time.sleep(1.0)
    log(f"{measured.jobs_running} jobs running; steady load for {settings.steady_s:.0f}s")


def hold_steady(
    client: UnicronClient, coordinator: psutil.Process, settings: Settings, marks: Marks, measured: Measured
) -> None:
    marks.steady = time.time()
    servers = redis_servers()
    cpu_start, redis_start = cpu_seconds([coordinator]), cpu_seconds(servers)
    wall_start = time.monotonic()
    while time.monotonic() - wall_start < settings.steady_s:
        time.sleep(SAMPLE_S)
        measured.rss.append((time.monotonic() - wall_start, coordinator.memory_info().rss / 2**20))
        note_false_losses(client, measured)
    elapsed = time.monotonic() - wall_start
    measured.cpu_cores = (cpu_seconds([coordinator]) - cpu_start) / elapsed
    measured.redis_cpu_cores = (cpu_seconds(servers) - redis_start) / elapsed


def burst(client: UnicronClient, agents: AgentProcesses, settings: Settings, marks: Marks, measured: Measured) -> None:
    """10% of the agents vanish at once, the nodes of some jobs among them."""
    before = {j.job_id: j for j in client.list_jobs()}
    vanish = random.Random(7).sample(
        [node_name("sim", i) for i in range(settings.agents)], int(settings.agents * settings.burst_fraction)
    )
    vanished = set(vanish)
    measured.vanished = vanish
    measured.hit = {job_id for job_id, job in before.items() if job_nodes(job) & vanished}
    log(f"burst: {len(vanish)} agents vanish, {len(measured.hit)} jobs lose a node")
    burst_at = marks.burst = time.time()
    agents.vanish(vanish)
    measured.unreplanned = set(measured.hit)
    while time.time() - burst_at < 60:
        time.sleep(0.5)
        lost = {n.node_id: n for n in client.nodes() if n.state == pb.NODE_STATE_LOST}
        if not vanished <= set(lost):
            continue
        hit_jobs = {j.job_id: j for j in client.list_jobs() if j.job_id in measured.hit}
        measured.unreplanned = {
            job_id
            for job_id, job in hit_jobs.items()
            if job.assignment.generation <= before[job_id].assignment.generation or job_nodes(job) & vanished
        }
        if not measured.unreplanned:
            measured.detected_s = max(seconds(lost[n].state_since) for n in vanish) - burst_at
            measured.replanned_s = max(seconds(job.assignment.assigned) for job in hit_jobs.values()) - burst_at
            break
    note_false_losses(client, measured, vanished)


def drive(
    client: UnicronClient,
    coordinator: psutil.Process,
    agents: AgentProcesses,
    settings: Settings,
    marks: Marks,
    measured: Measured,
) -> None:
    """The step after its agents started: registration, the jobs' start, steady load, burst."""
    agents.wait_registered(REGISTRATION_LIMIT_S)
    assert marks.registration is not None
    measured.registration_s = time.time() - marks.registration
    log(f"agents registered in {measured.registration_s:.1f}s; submitting jobs")
    start_jobs(client, settings, marks, measured)
    hold_steady(client, coordinator, settings, marks, measured)
    burst(client, agents, settings, marks, measured)


def describe(exc: BaseException, marks: Marks) -> str:
    """Why a step broke, and in which phase."""
    return f"{marks.reached()}: {type(exc).__name__}: {exc}"


def header(settings: Settings) -> dict[str, Any]:
    return {
        "agents": settings.agents,
        "jobs": settings.jobs,
        "redis": "sentinel" if settings.redis_replicas else "single",
        "redis_replicas": settings.redis_replicas,
    }


def run(settings: Settings, run_dir: Path) -> dict[str, Any]:
    """One step; whatever breaks in it ends the step with a report that says why."""
    marks, measured = Marks(), Measured()
    stats: dict[str, Any] | None = None
    baseline: dict[str, Any] | None = None
    failure: str | None = None
    cluster = LocalCluster(
        run_dir / "cluster",
        agents=0,
        planners=2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
        redis_replicas=settings.redis_replicas,
    )
    try:
        with cluster, cluster.client(timeout_s=30.0) as client:
            coordinator = psutil.Process(cluster.service("coordinator").proc.pid)
            log("baseline: 10 agents")
            baseline = measure_baseline(cluster, settings, run_dir)
            log(f"baseline heartbeat p99 {baseline['heartbeat']['p99_ms']} ms")
            # The baseline's agents are gone; jobs must not be placed on them before that is known.
            deadline = time.monotonic() + 30
            while len(lost_nodes(client, "base-")) < 10 and time.monotonic() < deadline:
                time.sleep(0.5)
            log(f"starting {settings.agents} simulated agents")
            agents = AgentProcesses(cluster, "sim", settings.agents, settings.slots, run_dir)
            marks.registration = time.time()
            try:
                drive(client, coordinator, agents, settings, marks, measured)
            except Exception as exc:  # noqa: BLE001 -- a step that breaks is a result: its report says why
                failure = describe(exc, marks)
            finally:
                stats = agents.stop()
    except Exception as exc:  # noqa: BLE001 -- a cluster that would not start, a baseline that broke
        failure = failure or describe(exc, marks)
    if failure:
        log(f"step failed: {failure}")
    return {**header(settings), "baseline": baseline, **step_report(stats, marks, measured, failure, baseline)}


# Minutes of steady load per step when --steps is given without --minutes.
STEP_MINUTES = 1.5


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
        f"{STEP_MINUTES:g} minutes each unless --minutes), the table of steps to load_steps.json",
    )
    parser.add_argument(
        "--redis-replicas",
        type=int,
        default=0,
        help="0: one Redis (default); N: a primary with N replicas under Sentinel, each write "
        "acknowledged once a replica has it (results to *_replicasN.json)",
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args(argv)
    if args.redis_replicas < 0:
        parser.error("--redis-replicas: not negative")
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        if args.steps:
            return run_steps(args)
        return run_one(args, args.out or results_path("load", args.redis_replicas))
    except KeyboardInterrupt:
        log("interrupted")
        return 130


def parse_steps(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise SystemExit(f"--steps: {text!r} is not a comma-separated list of agent counts") from None
    if not counts or any(n < 10 for n in counts):
        raise SystemExit(f"--steps: {text!r}: each step needs at least 10 agents")
    return counts


def run_steps(args: argparse.Namespace) -> int:
    """The control plane at growing sizes: the same run per step, a row each. A step that
    failed skips the larger ones (they would fail the same way, at more cost); one whose
    generator fell behind does not (the machine's load changes from minute to minute)."""
    rows: list[dict[str, Any]] = []
    minutes = args.minutes if args.minutes is not None else STEP_MINUTES
    target = args.out or results_path("load_steps", args.redis_replicas)
    suffix = f"_replicas{args.redis_replicas}" if args.redis_replicas else ""
    failed: int | None = None
    interrupted = False
    for agents in parse_steps(args.steps):
        jobs = max(1, agents // 10)
        if interrupted:
            rows.append(skipped_row(agents, jobs, "the run was interrupted"))
            continue
        if failed is not None and agents >= failed:
            rows.append(skipped_row(agents, jobs, f"the {failed}-agent step failed"))
            continue
        log(f"step: {agents} agents")
        step_args = argparse.Namespace(**{**vars(args), "agents": agents, "jobs": jobs, "minutes": minutes})
        try:
            report = measure(step_args)
        except KeyboardInterrupt:
            interrupted = True
            rows.append(skipped_row(agents, jobs, "interrupted while it ran"))
            continue
        write_results(target.with_name(f"load_{agents}{suffix}.json"), report)
        rows.append(step_row(report))
        log(f"step {agents}: {report['verdict']}")
        if report["failure"]:
            failed = agents if failed is None else min(failed, agents)
    write_results(
        target,
        {
            "steps": rows,
            "steady_minutes_per_step": minutes,
            "cpus": psutil.cpu_count(),
            "redis": "sentinel" if args.redis_replicas else "single",
            "redis_replicas": args.redis_replicas,
            "exit_code": 130 if interrupted else exit_code(rows),
        },
    )
    print(format_steps(rows))
    print(f"\nwrote {target}")
    return 130 if interrupted else exit_code(rows)


def settings_of(args: argparse.Namespace) -> Settings:
    quick = args.quick
    return Settings(
        agents=args.agents or (100 if quick else 1000),
        jobs=args.jobs or (10 if quick else 100),
        # Jobs of 4 ranks over nodes of 2 slots: each job spans 2 nodes, 200 of the 1,000.
        ranks_per_job=4,
        slots=2,
        steady_s=60.0 * (args.minutes if args.minutes is not None else (1.0 if quick else 5.0)),
        burst_fraction=0.10,
        baseline_s=10.0 if quick else 20.0,
        redis_replicas=args.redis_replicas,
    )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One step's report; never raises but for an interruption."""
    settings = settings_of(args)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-load-"))
    log(f"run directory {run_dir}")
    try:
        report = run(settings, run_dir)
    except Exception as exc:  # noqa: BLE001 -- even a fault of the bench itself ends in a report
        failure = f"the bench broke: {type(exc).__name__}: {exc}"
        log(failure)
        report = {**header(settings), "baseline": None, **step_report(None, Marks(), Measured(), failure, None)}
    finally:
        if not args.keep_logs:
            shutil.rmtree(run_dir, ignore_errors=True)
    report["duration_s"] = round(settings.steady_s, 1)
    report["settings"] = {
        "agents": settings.agents,
        "jobs": settings.jobs,
        "ranks_per_job": settings.ranks_per_job,
        "slots_per_agent": settings.slots,
        "steady_s": settings.steady_s,
        "burst_fraction": settings.burst_fraction,
        "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "redis_replicas": settings.redis_replicas,
        "cpus": psutil.cpu_count(),
    }
    return report


def run_one(args: argparse.Namespace, out: Path) -> int:
    report = measure(args)
    write_results(out, report)
    print(format_table(report))
    print(f"\nwrote {out}")
    return exit_code([report])


if __name__ == "__main__":
    sys.exit(main())
