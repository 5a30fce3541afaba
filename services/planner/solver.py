"""The planner's CP-SAT model: the size and placement of every job that maximize the objective
of ``domain`` (DESIGN.md section 3).

Data, model and solve are kept apart, as in OR-Tools' examples/python/line_balancing_sat.py:
``_build_data`` turns a request into scaled integer coefficients, ``_build_model`` states the
problem, ``_greedy`` computes a hint, and ``plan`` solves and explains.

Variables, per job t:
  size[t, x]    bool per allowed size x; at most one (exactly one unless preemptible; none is
                paused);
  groups[t, n]  int per healthy node: TP groups on n (slots = groups * TP, so no TP group spans
                nodes; unhealthy nodes have no variable and get nothing);
  kept[t]       bool, only for a job that can keep its current placement: forces size and groups
                to equal the current ones; "changed" is its negation.

Objective scaling. The objective is in weighted FLOPs (FLOP/s * s, easily 1e20), CP-SAT needs
integers. Each job's terms are F(t, x) * (D_run - D_trans) on size[t, x] and F(t, cur) * D_trans
on kept[t] (so a kept job earns F * D_run and a changed one F * (D_run - D_trans)). Every term is
multiplied by one factor, OBJECTIVE_RESOLUTION / (largest |term|), and rounded: the largest term
becomes 1e9 and each is exact to 1 part in 2e9 of it. A positive kept bonus is rounded up to at
least 1 so that keeping stays strictly better than an equal-valued move even when D_trans is tiny
next to D_run. ``PlanResult.objective`` is the exact ``domain.score`` of the plan found, not the
scaled value; ``bound`` is the solver's bound divided by the same factor.

Cap on changed jobs (``max_changed_jobs``). It counts the jobs that change by the planner's
choice: a running job that moves, resizes or is paused, and a stopped job that is started. Jobs
that must change whatever the plan does are exempt (``domain.forced_change``): those hit by the
failure and those whose current placement cannot be kept (lost node, node shrank, ...). Counting
them would make every failure that touches more jobs than the cap infeasible.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from services.planner import domain
from services.planner.domain import Job, JobPlan, Node, PlanRequest, PlanResult

# The largest objective term maps to this many integer units (see the module docstring).
OBJECTIVE_RESOLUTION = 1e9


@dataclass(frozen=True)
class _JobData:
    job: Job
    sizes: list[int]
    size_coef: dict[int, int]  # scaled F(t, x) * (D_run - D_trans)
    keep_coef: int  # scaled F(t, current size) * D_trans; meaningful only if keepable
    keepable: bool
    forced: bool


@dataclass(frozen=True)
class _Data:
    request: PlanRequest
    nodes: dict[str, Node]  # every node, in request order
    healthy: list[Node]
    horizon_s: float
    scale: float  # integer objective units per weighted FLOP
    jobs: list[_JobData]


@dataclass
class _Model:
    model: cp_model.CpModel
    size: dict[str, dict[int, cp_model.IntVar]]
    groups: dict[str, dict[str, cp_model.IntVar]]
    kept: dict[str, cp_model.IntVar]


def _build_data(request: PlanRequest) -> _Data:
    nodes = {node.node_id: node for node in request.nodes}
    horizon = domain.horizon_seconds(request)
    raw: list[tuple[Job, list[int], dict[int, float], float, bool]] = []
    for job in request.jobs:
        sizes = domain.allowed_sizes(job)
        run = {x: domain.weighted_throughput(job, x) for x in sizes}
        per_size = {x: f * (horizon - job.transition_seconds) for x, f in run.items()}
        keepable = domain.keep_blocker(job, nodes) is None
        keep = run[job.current_size] * job.transition_seconds if keepable else 0.0
        raw.append((job, sizes, per_size, keep, keepable))
    largest = max(
        (abs(v) for _, _, per_size, keep, _ in raw for v in (*per_size.values(), keep)),
        default=0.0,
    )
    scale = OBJECTIVE_RESOLUTION / largest if largest > 0 else 1.0
    jobs = [
        _JobData(
            job=job,
            sizes=sizes,
            size_coef={x: round(v * scale) for x, v in per_size.items()},
            keep_coef=max(1, round(keep * scale)) if keep > 0 else 0,
            keepable=keepable,
            forced=domain.forced_change(job, nodes),
        )
        for job, sizes, per_size, keep, keepable in raw
    ]
    healthy = [node for node in request.nodes if node.healthy]
    return _Data(request, nodes, healthy, horizon, scale, jobs)


def _pinned_blocker(job: Job, nodes: Mapping[str, Node]) -> str | None:
    # A pinned job hit by the failure restarts in place; only the placement itself must hold.
    return domain.keep_blocker(dataclasses.replace(job, hit_by_failure=False), nodes)


def _infeasible_reason(data: _Data) -> str | None:
    """A specific reason when the instance is infeasible for an obvious reason, else None."""
    for jd in data.jobs:
        job = jd.job
        if job.pinned and job.current:
            blocker = _pinned_blocker(job, data.nodes)
            if blocker is not None:
                return f"job {job.job_id} is pinned but cannot keep its placement: {blocker}"
        if job.pinned and not job.current and not job.preemptible:
            return f"job {job.job_id} is pinned while not running but is not preemptible"
        if not job.preemptible:
            tp = job.tensor_parallel
            room = sum(node.slots // tp * tp for node in data.healthy)
            if jd.sizes[0] > room:
                return (
                    f"job {job.job_id} is not preemptible and needs at least {jd.sizes[0]} slots;"
                    f" healthy nodes hold {room} in whole TP groups of {tp}"
                )
    return None


def _build_model(data: _Data) -> _Model:
    model = cp_model.CpModel()
    m = _Model(model, {}, {}, {})
    changed_terms: list[cp_model.LinearExprT] = []
    objective: list[cp_model.LinearExprT] = []
    for jd in data.jobs:
        job, tp, jid = jd.job, jd.job.tensor_parallel, jd.job.job_id
        size = {x: model.new_bool_var(f"size[{jid},{x}]") for x in jd.sizes}
        groups = {
            node.node_id: model.new_int_var(0, node.slots // tp, f"groups[{jid},{node.node_id}]")
            for node in data.healthy
        }
        m.size[jid], m.groups[jid] = size, groups
        if job.preemptible:
            model.add_at_most_one(size.values())
        else:
            model.add_exactly_one(size.values())
        model.add(
            cp_model.LinearExpr.weighted_sum(list(groups.values()), [tp] * len(groups))
            == cp_model.LinearExpr.weighted_sum(list(size.values()), list(size))
        )
        objective.append(cp_model.LinearExpr.weighted_sum(list(size.values()), list(jd.size_coef.values())))
        if job.pinned:
            # _infeasible_reason has checked that the current placement is valid here.
            for x, var in size.items():
                model.add(var == int(x == job.current_size))
            for node_id, var in groups.items():
                model.add(var == job.current.get(node_id, 0) // tp)
        if jd.keepable:
            kept = model.new_bool_var(f"kept[{jid}]")
            m.kept[jid] = kept
            model.add(size[job.current_size] == 1).only_enforce_if(kept)
            # Equal size plus equal groups on the current nodes leaves nothing for other nodes.
            for node_id, slots in job.current.items():
                model.add(groups[node_id] == slots // tp).only_enforce_if(kept)
            objective.append(jd.keep_coef * kept)
            if not jd.forced:
                changed_terms.append(1 - kept)
        elif not job.current:
            changed_terms.append(sum(size.values()))
    for node in data.healthy:
        used = [m.groups[jd.job.job_id][node.node_id] for jd in data.jobs]
        tps = [jd.job.tensor_parallel for jd in data.jobs]
        model.add(cp_model.LinearExpr.weighted_sum(used, tps) <= node.slots)
    cap = data.request.max_changed_jobs
    if cap is not None and changed_terms:
        model.add(sum(changed_terms) <= cap)
    model.maximize(sum(objective))
    return m


def _allocate(job: Job, placed: Mapping[str, int], extra_groups: int, free: Mapping[str, int]) -> dict[str, int] | None:
    """``placed`` grown by ``extra_groups`` TP groups, or None if they do not fit.

    Nodes the job uses now come first, then its old nodes, then the emptiest: fewer nodes per
    job and more jobs landing where they were."""
    tp = job.tensor_parallel
    order = sorted(free, key=lambda n: (n not in placed, n not in job.current, -(free[n] // tp)))
    result = dict(placed)
    for node_id in order:
        if extra_groups == 0:
            break
        take = min(free[node_id] // tp, extra_groups)
        if take:
            result[node_id] = result.get(node_id, 0) + take * tp
            extra_groups -= take
    return result if extra_groups == 0 else None


def _greedy(data: _Data) -> dict[str, dict[str, int]]:
    """A quick valid-when-possible plan to hint the solver with: keep what can be kept, start
    non-preemptible jobs at their minimum size, then repeatedly give free slots to the job and
    size with the best objective gain per added slot."""
    free = {node.node_id: node.slots for node in data.healthy}
    placed: dict[str, dict[str, int]] = {jd.job.job_id: {} for jd in data.jobs}
    cap = data.request.max_changed_jobs
    changes = 0

    def take(job: Job, slots: dict[str, int]) -> None:
        nonlocal changes
        was = domain.is_changed(job, placed[job.job_id])
        for node_id, count in slots.items():
            free[node_id] -= count - placed[job.job_id].get(node_id, 0)
        placed[job.job_id] = slots
        if not was and domain.is_changed(job, slots) and not domain.forced_change(job, data.nodes):
            changes += 1

    # Pinned jobs first, then the ones earning most per slot, so a shrunken node keeps those.
    # Jobs hit in place restart there: their own slots are still the cheapest to refill.
    keepers = [jd for jd in data.jobs if jd.job.current and _pinned_blocker(jd.job, data.nodes) is None]
    keepers.sort(key=lambda jd: (not jd.job.pinned, -_per_slot(jd.job, jd.job.current_size)))
    for jd in keepers:
        if all(node_id in free and free[node_id] >= s for node_id, s in jd.job.current.items()):
            take(jd.job, dict(jd.job.current))
    for jd in data.jobs:
        job = jd.job
        if not job.preemptible and not placed[job.job_id]:
            slots = _allocate(job, {}, jd.sizes[0] // job.tensor_parallel, free)
            if slots is not None:
                take(job, slots)
    while True:
        best: tuple[float, Job, int] | None = None
        for jd in data.jobs:
            job, tp = jd.job, jd.job.tensor_parallel
            if job.pinned:
                continue
            now = placed[job.job_id]
            size = sum(now.values())
            unchanged = not jd.forced and not domain.is_changed(job, now)
            if cap is not None and changes >= cap and unchanged:
                continue
            base = domain.job_value(job, now, data.horizon_s)
            room = sum(f // tp for f in free.values()) * tp
            for x in jd.sizes:
                if x <= size:
                    continue
                if x - size > room:
                    break
                # Any other size is a change; only regrowing to the current size may not be.
                changed = x != job.current_size or job.hit_by_failure
                if not changed:
                    grown = _allocate(job, now, (x - size) // tp, free)
                    changed = grown is None or domain.is_changed(job, grown)
                f = domain.weighted_throughput(job, x)
                value = f * data.horizon_s - (f * job.transition_seconds if changed else 0.0)
                gain = (value - base) / (x - size)
                if gain > 0 and (best is None or gain > best[0]):
                    best = (gain, job, x)
        if best is None:
            return placed
        _, job, x = best
        now = placed[job.job_id]
        grown = _allocate(job, now, (x - sum(now.values())) // job.tensor_parallel, free)
        assert grown is not None  # the room check above counted whole TP groups
        take(job, grown)


def _per_slot(job: Job, size: int) -> float:
    return domain.weighted_throughput(job, size) / size if size else 0.0


def _add_hint(m: _Model, data: _Data, hint: Mapping[str, Mapping[str, int]]) -> None:
    for jd in data.jobs:
        jid = jd.job.job_id
        slots = hint[jid]
        size = sum(slots.values())
        for x, var in m.size[jid].items():
            m.model.add_hint(var, x == size)
        for node_id, var in m.groups[jid].items():
            m.model.add_hint(var, slots.get(node_id, 0) // jd.job.tensor_parallel)
        if jid in m.kept:
            m.model.add_hint(m.kept[jid], dict(slots) == dict(jd.job.current))


def _slots_text(count: int) -> str:
    return f"{count} slot" if count == 1 else f"{count} slots"


def _plural_nodes(node_ids: list[str]) -> str:
    return f"{'node' if len(node_ids) == 1 else 'nodes'} {', '.join(node_ids)}"


def _reasons(data: _Data, result: Mapping[str, dict[str, int]]) -> dict[str, str]:
    """A reason per job, from comparing its current and new placement."""
    used = dict.fromkeys(data.nodes, 0)
    released = dict.fromkeys(data.nodes, 0)  # slots jobs give up on each node
    for jd in data.jobs:
        for node_id in data.nodes:
            now = result[jd.job.job_id].get(node_id, 0)
            used[node_id] += now
            released[node_id] += max(0, jd.job.current.get(node_id, 0) - now)
    cap = data.request.max_changed_jobs
    voluntary = sum(1 for jd in data.jobs if domain.is_changed(jd.job, result[jd.job.job_id]) and not jd.forced)
    reasons: dict[str, str] = {}
    for jd in data.jobs:
        job, new = jd.job, result[jd.job.job_id]
        cur, tp = dict(job.current), job.tensor_parallel
        cur_size, new_size = job.current_size, sum(new.values())
        lost = sorted(n for n in cur if not data.nodes[n].healthy)
        shrank = sorted(n for n in cur if data.nodes[n].healthy and cur[n] > data.nodes[n].slots)
        if lost:
            cause = f"{_plural_nodes(lost)} lost"
        elif shrank:
            cause = f"{_plural_nodes(shrank)} lost slots"
        elif job.hit_by_failure:
            cause = "hit by failure"
        else:
            cause = ""
        if new_size == 0:
            left = sum((n.slots - used[n.node_id]) // tp * tp for n in data.healthy)
            if job.pinned:
                why = "pinned while not running"
            elif left < jd.sizes[0]:
                why = f"needs at least {_slots_text(jd.sizes[0])}, only {left} left free"
            elif cap is not None and voluntary >= cap and not jd.forced:
                why = f"changed-jobs cap of {cap} reached"
            else:
                why = "not worth its transition time before the next expected failure"
            if not cur:
                reasons[job.job_id] = f"not started: {why}"
            else:
                reasons[job.job_id] = f"paused: {cause + '; ' if cause else ''}{why}"
        elif not cur:
            reasons[job.job_id] = f"started on {_slots_text(new_size)}"
        elif new == cur:
            reasons[job.job_id] = (
                f"restarted in place on {_slots_text(new_size)} after failure" if job.hit_by_failure else "kept"
            )
        elif new_size < cur_size:
            why = cause or "slots given to other jobs"
            reasons[job.job_id] = f"shrunk from {cur_size} to {_slots_text(new_size)}: {why}"
        elif new_size > cur_size:
            gained = [n for n, s in new.items() if s > cur.get(n, 0)]
            others = [released[n] - max(0, cur.get(n, 0) - new.get(n, 0)) for n in gained]
            kind = "freed" if any(o > 0 for o in others) else "idle"
            tail = f" ({cause})" if cause else ""
            reasons[job.job_id] = f"grown from {cur_size} to {_slots_text(new_size)} into {kind} slots{tail}"
        else:
            reasons[job.job_id] = f"moved: {cause}" if cause else "moved"
    return reasons


def _result(
    data: _Data,
    status: str,
    reason: str,
    seconds: float,
    placement: Mapping[str, dict[str, int]] | None = None,
    bound: float = 0.0,
    gap: float = 0.0,
) -> PlanResult:
    if placement is None:
        return PlanResult(status, 0.0, bound, gap, seconds, data.horizon_s, (), reason)
    reasons = _reasons(data, placement)
    jobs = tuple(
        JobPlan(
            job_id=jd.job.job_id,
            slots_by_node={n: placement[jd.job.job_id][n] for n in data.nodes if placement[jd.job.job_id].get(n)},
            size=sum(placement[jd.job.job_id].values()),
            changed=domain.is_changed(jd.job, placement[jd.job.job_id]),
            reason=reasons[jd.job.job_id],
        )
        for jd in data.jobs
    )
    objective = sum(domain.job_value(jd.job, placement[jd.job.job_id], data.horizon_s) for jd in data.jobs)
    if status == "OPTIMAL":
        bound = objective
    return PlanResult(status, objective, max(bound, objective), gap, seconds, data.horizon_s, jobs, reason)


def plan(request: PlanRequest) -> PlanResult:
    """The best size and placement of every job. ValueError for a malformed request;
    RuntimeError if CP-SAT rejects the model (MODEL_INVALID: a bug here, not bad input)."""
    domain.validate(request)
    data = _build_data(request)
    blocker = _infeasible_reason(data)
    if blocker is not None:
        return _result(data, "INFEASIBLE", blocker, 0.0)
    m = _build_model(data)
    greedy = _greedy(data)
    _add_hint(m, data, greedy)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = request.time_limit_s
    solver.parameters.random_seed = request.seed
    solver.parameters.num_workers = request.workers
    status = solver.solve(m.model)
    seconds = solver.wall_time
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"planner built an invalid CP-SAT model: {m.model.validate()}")
    if status == cp_model.INFEASIBLE:
        cap = ""
        if request.max_changed_jobs is not None:
            cap = f" with at most {request.max_changed_jobs} changed jobs"
        return _result(
            data,
            "INFEASIBLE",
            f"pinned and non-preemptible jobs do not fit on the healthy nodes{cap}",
            seconds,
        )
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # Presolve alone can outlast a short limit on a big cluster. A valid greedy plan beats
        # no plan when jobs are down; it is FEASIBLE, with no bound known.
        limit = f"no solver answer within {request.time_limit_s:g} s"
        if not domain.plan_problems(request, greedy):
            return _result(data, "FEASIBLE", f"{limit}; greedy plan", seconds, greedy, math.inf, math.inf)
        return _result(data, "UNKNOWN", limit, seconds, bound=math.inf, gap=math.inf)
    placement = {
        jd.job.job_id: {
            node_id: solver.value(var) * jd.job.tensor_parallel
            for node_id, var in m.groups[jd.job.job_id].items()
            if solver.value(var)
        }
        for jd in data.jobs
    }
    best, found = solver.best_objective_bound, solver.objective_value
    gap = max(0.0, best - found) / max(1.0, abs(best))
    if status == cp_model.OPTIMAL:
        return _result(data, "OPTIMAL", "optimal", seconds, placement)
    return _result(
        data,
        "FEASIBLE",
        f"time limit of {request.time_limit_s:g} s reached; gap {gap:.2%}",
        seconds,
        placement,
        bound=best / data.scale,
        gap=gap,
    )
