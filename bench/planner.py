"""Planner benchmark: CP-SAT solve time, status, gap and peak memory at cluster scale, and the
paper's dynamic program on the size-only version of the same instances.

    python -m bench.planner [--quick] [--instances N] [--workers W] [--time-limit S] [--out PATH]

Each case (jobs, nodes of 8 GPUs) runs in a fresh subprocess, so its peak RSS is its own. The
instances are random but reproducible (seeded by case and index): a cluster right after a
failure took out a few percent of its nodes. Results go to bench/results/planner.json; a table
and PASS/FAIL per target go to stdout. The exit status is 0 whatever the numbers: this is a
measurement, not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import percentile, write_results
from services.planner import domain, dp, solver
from services.planner.domain import Job, Node, PlanRequest, ThroughputEstimate, Transition

GPUS_PER_NODE = 8
CASES = [(8, 16), (32, 128), (64, 512), (128, 1024), (256, 2048)]
QUICK_CASES = [(8, 16), (32, 128)]
RESULTS = Path(__file__).resolve().parent / "results" / "planner.json"

# (jobs, nodes, what is measured, limit); see ``_targets``.
TARGETS = [
    (64, 512, "solve_s_p95", 1.0),
    (256, 2048, "solve_s_p95", 5.0),
    (256, 2048, "gap_max", 0.005),
]
PEAK_RSS_LIMIT_MB = 2048.0


def make_instance(
    jobs: int,
    nodes: int,
    seed: int,
    *,
    gpus_per_node: int = GPUS_PER_NODE,
    time_limit_s: float = 10.0,
    workers: int = 1,
) -> PlanRequest:
    """A random cluster just after a failure.

    Nodes of ``gpus_per_node`` slots in racks of 32 (the failure domain); 1-4% of them (at
    least one) just failed. Jobs: TP in {1, 2, 4, 8}, PP in {1, 2, 4}, a DP range sized so the
    jobs together want about 1.3x the cluster, weights 0.5-4; half with a measured profile
    (sublinear, some DP degrees missing), half with a model-size estimate (1B-200B parameters).
    60-90% of the jobs are running, packed onto the nodes in whole TP groups; the ones on the
    failed nodes are hit. A few running jobs are pinned, some are not preemptible. The failure
    rate gives a horizon of tens of minutes at 2048 nodes, so transition costs matter."""
    rng = random.Random(f"planner-bench/{jobs}/{nodes}/{seed}")
    capacity = nodes * gpus_per_node
    share = capacity / jobs
    job_specs: list[dict[str, Any]] = []
    for j in range(jobs):
        target = share * math.exp(rng.gauss(0.0, 0.5))
        tp = rng.choice([t for t in (1, 2, 4, 8) if t <= max(1, target / 2)] or [1])
        pp = rng.choice([p for p in (1, 2, 4) if tp * p <= max(1, target / 2)] or [1])
        unit = tp * pp
        max_dp = max(1, min(32, round(1.3 * target / unit)))
        min_dp = max(1, max_dp // rng.choice([2, 4, 8]))
        params = 10 ** rng.uniform(9.0, 11.3)
        profile: dict[int, float] | None = None
        estimate: ThroughputEstimate | None = None
        if rng.random() < 0.5:
            per_gpu, alpha = rng.uniform(1e14, 4e14), rng.uniform(0.85, 1.0)
            dps = [d for d in range(min_dp, max_dp + 1) if d in (min_dp, max_dp) or rng.random() < 0.7]
            profile = {unit * d: per_gpu * unit * d**alpha for d in dps}
        else:
            estimate = ThroughputEstimate(parameters=params, tokens_per_step=rng.choice([1, 2, 4]) * 2.0**20)
        job_specs.append(
            {
                "job_id": f"job{j:04d}",
                "weight": rng.choice([0.5, 1.0, 1.0, 2.0, 4.0]),
                "tensor_parallel": tp,
                "pipeline_parallel": pp,
                "min_dp": min_dp,
                "max_dp": max_dp,
                "throughput": profile,
                "estimate": estimate,
                "transition": Transition(
                    restart_s=rng.uniform(30, 90),
                    resize_s=rng.uniform(60, 120),
                    migrate_s=rng.uniform(90, 180),
                    state_bytes=16.0 * params,  # bf16 weights + fp32 master weights + Adam moments
                ),
            }
        )
    # Current placement: 60-90% of the jobs, packed in order onto the nodes in whole TP groups,
    # up to 90% of the cluster.
    node_ids = [f"n{i:05d}" for i in range(nodes)]
    index = {n: i for i, n in enumerate(node_ids)}
    free = [gpus_per_node] * nodes
    running = rng.uniform(0.6, 0.9)
    cursor = 0
    budget = int(0.9 * capacity)
    for spec in rng.sample(job_specs, len(job_specs)):
        if rng.random() > running:
            continue
        sizes = sorted(spec["throughput"]) if spec["throughput"] else [
            spec["tensor_parallel"] * spec["pipeline_parallel"] * d for d in range(spec["min_dp"], spec["max_dp"] + 1)
        ]  # fmt: skip
        size = rng.choice(sizes)
        if size > budget:
            continue
        tp, groups, current = spec["tensor_parallel"], size // spec["tensor_parallel"], {}
        i = cursor
        while groups and i < nodes:
            take = min(free[i] // tp, groups)
            if take:
                current[node_ids[i]] = take * tp
                free[i] -= take * tp
                groups -= take
            i += 1
        if groups:  # did not fit: give the slots back
            for n, s in current.items():
                free[index[n]] += s
            continue
        while cursor < nodes and free[cursor] == 0:
            cursor += 1
        budget -= size
        spec["current"] = current
    used_nodes = [i for i in range(nodes) if free[i] < gpus_per_node]
    failed_count = max(1, round(nodes * rng.uniform(0.01, 0.04)))
    failed = set(rng.sample(used_nodes or list(range(nodes)), min(failed_count, len(used_nodes) or nodes)))
    node_list = [
        Node(node_ids[i], gpus_per_node, healthy=i not in failed, failure_domain=f"rack{i // 32}") for i in range(nodes)
    ]
    jobs_list = []
    for spec in job_specs:
        current = spec.get("current", {})
        hit = any(index[n] in failed for n in current)
        pinned = bool(current) and not hit and rng.random() < 0.03
        preemptible = not (current and rng.random() < 0.1)
        jobs_list.append(
            Job(**spec | {"current": current, "hit_by_failure": hit, "pinned": pinned, "preemptible": preemptible})
        )
    rate = 1.0 / (rng.uniform(20, 60) * 86_400.0)  # per node: one failure every 20-60 days
    teams_rng = random.Random(f"planner-bench-teams/{jobs}/{nodes}/{seed}")
    jobs_list, limits, guarantees = with_teams(jobs_list, capacity, teams_rng)
    return PlanRequest(
        tuple(node_list),
        tuple(jobs_list),
        rate,
        time_limit_s=time_limit_s,
        workers=workers,
        team_limits=limits,
        team_guarantees=guarantees,
    )


TEAMS = ("vision", "nlp", "speech", "research")


def with_teams(jobs: list[Job], capacity: int, rng: random.Random) -> tuple[list[Job], dict[str, int], dict[str, int]]:
    """The jobs spread over TEAMS; each team's guarantee (0.15-0.25 of the cluster, so together
    about 0.8 of it) and slot limit (the guarantee plus 0.1-0.35 of the cluster to borrow),
    raised where the team's pinned and non-preemptible jobs need more (an admin's quotas that
    the running jobs already break would be infeasible, not a bench). The teams' own stream:
    the instances' jobs and nodes are those they were before teams."""
    teamed = [dataclasses.replace(job, team=rng.choice(TEAMS)) for job in jobs]
    guarantees, limits = {}, {}
    for team in TEAMS:
        must = sum(
            job.current_size if job.pinned else job.tensor_parallel * job.pipeline_parallel * job.min_dp
            for job in teamed
            if job.team == team and (job.pinned or not job.preemptible)
        )
        guarantees[team] = round(capacity * rng.uniform(0.15, 0.25))
        limits[team] = max(must, guarantees[team] + round(capacity * rng.uniform(0.1, 0.35)))
    return teamed, limits, guarantees


def run_case(jobs: int, nodes: int, instances: int, *, workers: int = 1, time_limit_s: float = 10.0) -> dict[str, Any]:
    """Measures one case in this process (peak RSS is this process's)."""
    solve_s, cpu_s, dp_s, gaps, statuses, objectives, dp_objectives = [], [], [], [], [], [], []
    for k in range(instances):
        request = make_instance(jobs, nodes, k, time_limit_s=time_limit_s, workers=workers)
        start, cpu = time.perf_counter(), time.process_time()
        result = solver.plan(request)
        solve_s.append(time.perf_counter() - start)
        cpu_s.append(time.process_time() - cpu)
        statuses.append(result.status)
        gaps.append(result.gap)
        objectives.append(result.objective)
        if result.jobs:
            problems = domain.plan_problems(request, {j.job_id: j.slots_by_node for j in result.jobs})
            assert not problems, problems
        start = time.perf_counter()
        reference = dp.plan_sizes_dp(request)
        dp_s.append(time.perf_counter() - start)
        dp_objectives.append(reference.objective)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "jobs": jobs,
        "nodes": nodes,
        "gpus_per_node": GPUS_PER_NODE,
        "instances": instances,
        "workers": workers,
        "time_limit_s": time_limit_s,
        "solve_s_p50": round(percentile(solve_s, 0.5), 4),
        "solve_s_p95": round(percentile(solve_s, 0.95), 4),
        "solve_s_max": round(max(solve_s), 4),
        # CPU time of the process: with one worker about the wall time on an idle machine, and
        # much less sensitive to a busy one.
        "solve_cpu_s_p50": round(percentile(cpu_s, 0.5), 4),
        "solve_cpu_s_p95": round(percentile(cpu_s, 0.95), 4),
        "gap_max": max(gaps),
        "status": statuses,
        "dp_s_p50": round(percentile(dp_s, 0.5), 4),
        "peak_rss_mb": round(peak_kb / 1024.0, 1),  # Linux reports KiB
        "objective": objectives,
        "dp_size_only_objective": dp_objectives,
    }


def _targets(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for jobs, nodes, metric, limit in TARGETS:
        case = next((c for c in cases if (c["jobs"], c["nodes"]) == (jobs, nodes)), None)
        if case is not None:
            value = case[metric]
            out.append(
                {"case": f"{jobs}x{nodes}", "metric": metric, "limit": limit, "value": value, "met": value <= limit}
            )
    if cases:
        peak = max(c["peak_rss_mb"] for c in cases)
        out.append(
            {
                "case": "all",
                "metric": "peak_rss_mb",
                "limit": PEAK_RSS_LIMIT_MB,
                "value": peak,
                "met": peak <= PEAK_RSS_LIMIT_MB,
            }
        )
    return out


def _table(cases: list[dict[str, Any]]) -> str:
    head = (
        f"{'jobs':>5} {'nodes':>6} {'GPUs':>6} {'p50 s':>7} {'p95 s':>7} {'cpu p95':>7} {'gap max':>8}"
        f" {'DP p50 s':>8} {'RSS MB':>7}  status"
    )
    lines = [head, "-" * len(head)]
    for c in cases:
        counts: dict[str, int] = {}
        for s in c["status"]:
            counts[s] = counts.get(s, 0) + 1
        status = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
        lines.append(
            f"{c['jobs']:>5} {c['nodes']:>6} {c['nodes'] * c['gpus_per_node']:>6} {c['solve_s_p50']:>7.3f}"
            f" {c['solve_s_p95']:>7.3f} {c['solve_cpu_s_p95']:>7.3f} {c['gap_max']:>8.2e} {c['dp_s_p50']:>8.3f}"
            f" {c['peak_rss_mb']:>7.0f}  {status}"
        )
    return "\n".join(lines)


def _run_in_subprocess(jobs: int, nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "bench.planner", "--case", str(jobs), str(nodes),
        "--instances", str(args.instances), "--workers", str(args.workers), "--time-limit", str(args.time_limit),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=Path(__file__).resolve().parents[1])
    if done.returncode != 0:
        raise RuntimeError(f"case {jobs}x{nodes} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 instances of the two smallest cases (smoke test)")
    parser.add_argument("--instances", type=int, default=5, help="random instances per case (default 5)")
    parser.add_argument("--workers", type=int, default=1, help="CP-SAT workers (default 1: reproducible)")
    parser.add_argument("--time-limit", type=float, default=10.0, help="CP-SAT time limit per solve, seconds")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--case", type=int, nargs=2, metavar=("JOBS", "NODES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:  # the subprocess side: one case, JSON on stdout
        jobs, nodes = args.case
        print(json.dumps(run_case(jobs, nodes, args.instances, workers=args.workers, time_limit_s=args.time_limit)))
        return 0
    if args.quick:
        args.instances = min(args.instances, 2)
    cases = []
    for jobs, nodes in QUICK_CASES if args.quick else CASES:
        print(f"case {jobs} jobs x {nodes} nodes ...", file=sys.stderr, flush=True)
        cases.append(_run_in_subprocess(jobs, nodes, args))
    targets = _targets(cases)
    write_results(args.out, {"cases": cases, "targets": targets, "targets_met": all(t["met"] for t in targets)})
    print(_table(cases))
    print()
    for t in targets:
        print(f"{'PASS' if t['met'] else 'FAIL'}  {t['case']:>9} {t['metric']:<12} {t['value']:.4g} <= {t['limit']:g}")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
