"""The planner's problem data: a request turned into what the model and the greedy plan
work on (each job's own nodes, offered sizes and their scaled values, the capacity mode),
and the checks that need no solver. The model is in solver.py."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass

from services.planner import domain, teams
from services.planner.domain import Job, Node, PlanRequest

# The largest objective term maps to this many integer units (see the module docstring).
OBJECTIVE_RESOLUTION = 1e9


Placement = dict[str, dict[str, int]]  # job_id -> node_id -> slots


@dataclass(frozen=True)
class JobData:
    job: Job
    tp: int
    sizes: list[int]
    own: list[str]  # healthy nodes it holds now, in request order
    stay_cap: int  # the most slots its own nodes can hold in whole TP groups
    in_place: bool  # its current placement can be reused (placement_blocker is None)
    forced: bool  # exempt from the cap
    stay_value: dict[int, float]  # x -> F(x) * (D_run - resize), for x <= stay_cap
    move_value: dict[int, float]  # x -> F(x) * (D_run - migrate)
    keep_bonus: float  # F(cur) * (resize - restart or 0), when in_place


@dataclass(frozen=True)
class Problem:
    request: PlanRequest
    nodes: dict[str, Node]  # every node, in request order
    healthy: list[Node]
    touched: list[str]  # healthy nodes some job holds now, in request order
    free: list[str]  # the other healthy nodes with slots, in request order
    horizon: domain.Horizon
    jobs: list[JobData]
    levels: list[int]  # distinct TP degrees of the jobs that may use pooled nodes, ascending
    capacity: str  # "pool" (levels: TP degrees form a chain), "typed" or "explicit"
    scale: float  # integer objective units per weighted FLOP


def is_chain(values: list[int]) -> bool:
    return all(b % a == 0 for a, b in itertools.pairwise(values))


def undominated(job: Job, values: dict[int, float], keep_current: bool) -> dict[int, float]:
    """The sizes worth offering for one kind: a size earning no more than a smaller one (or, for
    a preemptible job, than pausing) is never needed, since the smaller one fits wherever it does
    and changes the job just as much. A pinned job is offered its current size only, and only
    when it can stay in place; ``keep_current`` keeps the current size for ``kept``."""
    if job.pinned:
        x = job.current_size
        return {x: values[x]} if keep_current and x in values else {}
    best = 0.0 if job.preemptible else -math.inf
    out = {}
    for x in sorted(values):
        if values[x] > best or (keep_current and x == job.current_size):
            out[x] = values[x]
            best = max(best, values[x])
    return out


def build_problem(request: PlanRequest, mode: str = "auto") -> Problem:
    nodes = {node.node_id: node for node in request.nodes}
    horizon = domain.horizon_of(request)
    healthy = [node for node in request.nodes if node.healthy]
    held = {n for job in request.jobs for n in job.current if nodes[n].healthy}
    touched = [node.node_id for node in healthy if node.node_id in held]
    free = [node.node_id for node in healthy if node.node_id not in held and node.slots > 0]
    jobs: list[JobData] = []
    for job in request.jobs:
        tp, tr = job.tensor_parallel, job.transition
        own = [n.node_id for n in healthy if n.node_id in job.current]
        stay_cap = sum(nodes[n].slots // tp * tp for n in own)
        in_place = domain.placement_blocker(job, nodes) is None
        sizes = domain.allowed_sizes(job)
        f = {x: domain.weighted_throughput(job, x) for x in sizes}
        resize, migrate = tr.seconds("resize"), tr.seconds("migrate")
        keep_cost = tr.seconds("restart") if job.hit_by_failure else 0.0
        jobs.append(
            JobData(
                job=job,
                tp=tp,
                sizes=sizes,
                own=own,
                stay_cap=stay_cap,
                in_place=in_place,
                forced=domain.forced_change(job, nodes),
                stay_value=undominated(
                    job, {x: horizon.value(v, x, resize) for x, v in f.items() if x <= stay_cap}, in_place
                ),
                move_value=undominated(job, {x: horizon.value(v, x, migrate) for x, v in f.items()}, False),
                keep_bonus=(
                    f[job.current_size] * horizon.share(job.current_size) * (resize - keep_cost) if in_place else 0.0
                ),
            )
        )
    largest = max(
        (abs(v) for jd in jobs for v in (*jd.stay_value.values(), *jd.move_value.values(), jd.keep_bonus)),
        default=0.0,
    )
    levels = sorted({jd.tp for jd in jobs if not jd.job.pinned})
    if mode == "auto":
        mode = "pool" if is_chain(levels) else "typed"
    return Problem(
        request=request,
        nodes=nodes,
        healthy=healthy,
        touched=touched,
        free=free,
        horizon=horizon,
        jobs=jobs,
        levels=levels,
        capacity=mode,
        scale=OBJECTIVE_RESOLUTION / largest if largest > 0 else 1.0,
    )


def infeasible_reason(data: Problem) -> str | None:
    """Which constraint makes the instance infeasible when that is plain to see, else None."""
    room_by_tp: dict[int, int] = {}
    must = 0  # slots the pinned and non-preemptible jobs need at least
    must_start = []
    for jd in data.jobs:
        job = jd.job
        if job.pinned and job.current:
            # A pinned job hit by the failure restarts in place; only the placement must hold.
            blocker = domain.placement_blocker(job, data.nodes)
            if blocker is not None:
                return f"pinned: job {job.job_id} is pinned but cannot keep its placement: {blocker}"
            must += job.current_size
            continue
        if job.pinned and not job.preemptible:
            return f"pinned: job {job.job_id} is pinned while not running but is not preemptible"
        if not job.preemptible:
            tp = job.tensor_parallel
            if tp not in room_by_tp:
                room_by_tp[tp] = sum(node.slots // tp * tp for node in data.healthy)
            if jd.sizes[0] > room_by_tp[tp]:
                return (
                    f"non-preemptible: job {job.job_id} is not preemptible and needs at least {jd.sizes[0]} slots;"
                    f" healthy nodes hold {room_by_tp[tp]} in whole TP groups of {tp}"
                )
            must += jd.sizes[0]
            if not job.current:
                must_start.append(job.job_id)
    room = sum(node.slots for node in data.healthy)
    if must > room:
        return f"non-preemptible: pinned and non-preemptible jobs need {must} slots, healthy nodes hold {room}"
    over_limit = _team_over_limit(data)
    if over_limit is not None:
        return over_limit
    cap = data.request.max_changed_jobs
    if cap is not None and len(must_start) > cap:
        return (
            f"max_changed_jobs: {len(must_start)} non-preemptible jobs must start"
            f" ({', '.join(must_start[:5])}{', ...' if len(must_start) > 5 else ''}), cap is {cap}"
        )
    return None


def _team_over_limit(data: Problem) -> str | None:
    """A team whose pinned and non-preemptible jobs alone need more than its limit."""
    sizes = {jd.job.job_id: jd.job.current_size if jd.job.pinned else jd.sizes[0] for jd in data.jobs}
    for team, jobs in teams.limited(data.request).items():
        need = sum(sizes[job.job_id] for job in jobs if job.pinned or not job.preemptible)
        if need > data.request.team_limits[team]:
            return (
                f"team_limits: team {team!r}'s pinned and non-preemptible jobs need {need} slots,"
                f" its limit is {data.request.team_limits[team]}"
            )
    return None


def holders_of(data: Problem) -> dict[str, list[JobData]]:
    holders: dict[str, list[JobData]] = {n: [] for n in data.touched}
    for jd in data.jobs:
        for n in jd.own:
            holders[n].append(jd)
    return holders


def plan_value(data: Problem, placement: Placement) -> float:
    return sum(domain.job_value(jd.job, placement[jd.job.job_id], data.horizon) for jd in data.jobs)


def per_slot(job: Job, size: int) -> float:
    return domain.weighted_throughput(job, size) / size if size else 0.0


def split(jd: JobData, slots: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """A job's placement as the model sees it: slots on its own nodes, and pooled groups."""
    own = {n: s for n, s in slots.items() if n in jd.job.current and s}
    return own, (sum(slots.values()) - sum(own.values())) // jd.tp
