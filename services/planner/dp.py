"""The paper's dynamic program (He et al. 2023, "Unicron") over (jobs, GPU count), kept as
the reference that checks the CP-SAT solver.

It solves the size-only problem defined in ``domain``: the cluster is one pool of the healthy
nodes' slots, each job takes a size from ``domain.size_options`` (0 = paused when preemptible;
a pinned job keeps its current size) and earns ``domain.size_only_value``. There is no
placement, so no node capacity, no whole TP groups per node and no changed-jobs cap: the
constraints the DP cannot express and CP-SAT can.

    best[0][g] = 0                                           for g = 0..G
    best[t][g] = max over options x of job t with x <= g of best[t-1][g - x] + value(t, x)

``best[t][g]`` is the most the first t jobs can earn on at most g slots (-inf when they cannot
all get a size), G the pool's size; the answer is best[J][G], and the sizes are read back from
the recorded choices. Time O(J * G * sizes per job), vectorized over g with numpy: 256 jobs
on 16384 GPUs take well under a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.planner import domain, teams
from services.planner.domain import Job, PlanRequest


@dataclass(frozen=True)
class DPResult:
    """The DP's optimum: ``objective`` (size-only, exact up to float sums; -inf when no choice of
    sizes is feasible), ``sizes`` job_id -> slots (0 paused; empty when infeasible) and
    ``status`` ("OPTIMAL" or "INFEASIBLE")."""

    objective: float
    sizes: dict[str, int]
    status: str = "OPTIMAL"


def plan_sizes_dp(request: PlanRequest) -> DPResult:
    """The size-only optimum by dynamic programming; ValueError for a malformed request.

    With teams (``teams``) the jobs go in groups: a team's jobs first, over at most its limit,
    then the groups together over the pool, each holding a total from its own table and taking
    max(that total, its reserve) of the pool (a max-plus convolution). Without teams every job
    is its own group, and that is the paper's recurrence."""
    domain.validate(request)
    nodes = {node.node_id: node for node in request.nodes}
    horizon = domain.horizon_of(request)
    pool = domain.healthy_slots(request)
    grouped = teams.grouped(request)
    reserved = teams.reserves(request, pool)
    # (jobs, the most slots they may hold together, the pool they take at least)
    groups = [(jobs, min(pool, request.team_limits.get(t, pool)), reserved.get(t, 0)) for t, jobs in grouped.items()]
    groups += [([job], pool, 0) for job in request.jobs if job.team not in grouped]
    best = np.zeros(pool + 1)
    tables: list[tuple[list[Job], list[tuple[list[int], np.ndarray]], np.ndarray, int]] = []
    for jobs, cap, reserve in groups:
        table, choices = _jobs_table(jobs, nodes, horizon, cap)
        # best over the groups so far, on at most g slots, with this group holding exactly total
        # (and taking max(total, reserve) of the pool).
        new = np.full(pool + 1, -np.inf)
        total = np.full(pool + 1, -1, dtype=np.int32)
        for used in range(cap + 1):
            taken = max(used, reserve)
            if not np.isfinite(table[used]) or taken > pool:
                continue
            candidate = np.full(pool + 1, -np.inf)
            candidate[taken:] = best[: pool + 1 - taken] + table[used]
            better = candidate > new
            new[better] = candidate[better]
            total[better] = used
        best = new
        tables.append((jobs, choices, total, reserve))
    if not np.isfinite(best[pool]):
        return DPResult(-np.inf, {}, "INFEASIBLE")
    sizes_by_job: dict[str, int] = {}
    g = pool
    for jobs, choices, total, reserve in reversed(tables):
        used = int(total[g])
        g -= max(used, reserve)
        sizes_by_job.update(_read_back(jobs, choices, used))
    ordered = {job.job_id: sizes_by_job[job.job_id] for job in request.jobs}
    # Sum in request order so the objective matches domain.size_only_score to the last bit.
    objective = sum(domain.size_only_value(job, ordered[job.job_id], nodes, horizon) for job in request.jobs)
    return DPResult(float(objective), ordered)


def _jobs_table(
    jobs: list[Job], nodes: dict[str, domain.Node], horizon: domain.Horizon, cap: int
) -> tuple[np.ndarray, list[tuple[list[int], np.ndarray]]]:
    """The paper's recurrence over ``jobs`` alone: the most they earn on exactly g slots, g =
    0..cap (-inf where no choice of sizes sums to g), and each job's recorded choices."""
    best = np.full(cap + 1, -np.inf)
    best[0] = 0.0
    choices: list[tuple[list[int], np.ndarray]] = []
    for job in jobs:
        options = domain.size_options(job, nodes, horizon)
        sizes = sorted(options)
        new = np.full(cap + 1, -np.inf)
        choice = np.full(cap + 1, -1, dtype=np.int32)
        for i, x in enumerate(sizes):
            if x > cap:
                break
            candidate = np.full(cap + 1, -np.inf)
            candidate[x:] = best[: cap + 1 - x] + options[x]
            better = candidate > new  # ties keep the smaller size
            new[better] = candidate[better]
            choice[better] = i
        best = new
        choices.append((sizes, choice))
    return best, choices


def _read_back(jobs: list[Job], choices: list[tuple[list[int], np.ndarray]], used: int) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for job, (options, choice) in zip(reversed(jobs), reversed(choices), strict=True):
        x = options[int(choice[used])]
        sizes[job.job_id] = x
        used -= x
    return sizes
