"""The planner's CP-SAT model: the size and placement of every job that maximize the objective
of ``domain`` (docs/architecture.md: The cost model), and ``plan_sizes``, the same for the size-only problem.

Data, model and solve are kept apart, as in OR-Tools' examples/python/line_balancing_sat.py:
``problem.build_problem`` turns a request into scaled integer coefficients, ``_build_model``
here states the model, ``greedy.greedy_plan`` computes a hint (and a fallback plan),
``greedy.pack`` turns pooled counts into node names, ``plan`` solves and checks, and
``explain`` says why each job got what it got.

Nodes. A job's *own* nodes are the healthy nodes it holds now. Every other healthy node is
interchangeable for it: what the objective sees is only whether the job gains some node (it
then pays a migration) or not. So the model keeps per-node variables only where a job is now,
and pools everything else:

  stay[t, x]     bool per allowed size x up to what its own nodes can hold: every slot is on
                 its own nodes, it pays a resize;
  move[t, x]     bool per allowed size x: at least one TP group is elsewhere, it pays a
                 migration (a start, for a job that is not running). At most one stay or move
                 per job (exactly one unless preemptible; none is paused);
  own[t, n]      int per own node: TP groups on n (slots = groups * TP, so no TP group spans
                 nodes);
  pool[t]        int: TP groups on healthy nodes other than its own, zero under "stay", at
                 least one under "move";
  kept[t]        bool, for a job whose current placement can be reused as is: forces "stay" at
                 the current size with the current groups; pays nothing (restart if hit).

The pooled groups must fit in what the own groups leave free: on nodes that hold a job now
(residual capacity) and on nodes that hold none (whole). When the TP degrees of the jobs form a
divisibility chain (each divides the next, e.g. 1, 2, 4, 8), that is exact with one constraint
per TP level s: the pooled groups of TP >= s, counted in units of s, fit in sum over nodes of
floor(free slots / s). (Packing the largest groups first into any node with room keeps every
level's inequality true, since placing a group of TP t >= s removes exactly t / s units of s
wherever it goes; so the conditions are sufficient as well as necessary.) ``pack`` does that
packing to name the nodes, best fit first so jobs span few nodes, and ``plan_problems`` checks
the result. TP degrees that do not form a chain (say 2 and 3) use "typed" capacity instead,
exact for any degrees since groups of one size are interchangeable between jobs: per TP degree,
the pooled groups fit in per-node counts on the nodes that hold a job now, plus, for the free
nodes of each slot count, a count of nodes per way of filling one ("pattern"). A third mode,
"explicit" (a variable per job and node), is kept as the reference the tests check both against.

A pooled group may land on one of the job's own nodes; the job then pays at most what the model
charged (kinds nest, ``domain.Transition.seconds``), so the plan's exact score is at least the
model's value, and the model's optimum (which every real plan maps into at its own value) is
the real optimum. Pooling also removes the symmetry between interchangeable nodes that a
per-node model would have to break: a free node has no variable at all.

Offered sizes. For each kind, a size that earns no more than a smaller one (or, for a
preemptible job, than pausing) is left out: the smaller one fits wherever it does and changes
the job just as much, so no optimum needs it. Estimated profiles past their best DP degree and
sizes whose transition does not pay back before the next failure drop out this way.

Objective scaling. The objective is in weighted FLOPs (easily 1e20); CP-SAT needs integers.
Each term is multiplied by one factor, OBJECTIVE_RESOLUTION / (largest |term|), and rounded:
the largest becomes 1e9, each is exact to 1 part in 2e9 of it. ``kept`` carries the difference
between a resize and keeping (F * resize seconds, or F * (resize - restart) when hit), rounded up
to at least 1 so that keeping stays strictly better than an equal-valued move: jobs stay where
they are unless moving pays. ``PlanResult.objective`` is the exact ``domain.score`` of the plan
returned; ``bound`` is the solver's bound divided by the same factor.

Search. The hint (and the answer if CP-SAT finds nothing in time) is the better of two greedy
plans (``greedy_plan``), one aimed at the size-only optimum of the paper's DP (``dp.plan_sizes_dp``)
when that is cheap. CP-SAT runs with the request's seed, workers, time limit and
``relative_gap`` (the search stops once the plan is proven that close to the best: status
OPTIMAL, with the residual ``gap`` reported), the full linear relaxation, branching on the LP,
and no separate search around the hint (tuned on ``bench/planner.py``). A search cut by the
time limit answers FEASIBLE with its real gap. The plan found is then polished (a changed job
goes back to its current placement if that fits and earns at least as much: a search stopped
within a gap may have moved a small job for nothing), checked by ``domain.plan_problems`` and
only then returned; a plan failing the check is a bug and falls back to the greedy plan if
that passes.

Cap on changed jobs (``max_changed_jobs``). It counts the jobs that change by the planner's
choice: a running job that moves, resizes or is paused, and a stopped job that is started. Jobs
that must change whatever the plan does are exempt (``domain.forced_change``): those hit by the
failure and those whose current placement cannot be reused (lost node, ...). Counting them would
make every failure that touches more jobs than the cap infeasible.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from ortools.sat.python import cp_model

from services.planner import domain, teams
from services.planner.domain import PlanRequest, PlanResult
from services.planner.explain import plan_result
from services.planner.greedy import greedy_plan, pack, polish, size_only_targets
from services.planner.problem import (
    OBJECTIVE_RESOLUTION,
    Placement,
    Problem,
    build_problem,
    holders_of,
    infeasible_reason,
    plan_value,
    split,
)


@dataclass
class Model:
    model: cp_model.CpModel
    stay: dict[str, dict[int, cp_model.IntVar]]
    move: dict[str, dict[int, cp_model.IntVar]]
    own: dict[str, dict[str, cp_model.IntVar]]
    pool: dict[str, cp_model.IntVar]
    kept: dict[str, cp_model.IntVar]
    spare: dict[tuple[str, int], cp_model.IntVar]  # pool mode: (touched node, level) -> floor(free / level)
    explicit: dict[str, dict[str, cp_model.IntVar]]  # explicit mode: job -> foreign node -> groups
    typed: dict[tuple[str, int], cp_model.IntVar]  # typed mode: (node, TP) -> pooled groups there
    patterns: dict[int, list[tuple[dict[int, int], cp_model.IntVar]]]  # typed: slots -> (pattern, nodes)
    size: dict[str, cp_model.LinearExprT] = field(default_factory=dict)  # job -> its size in slots


def _scaled(data: Problem, value: float) -> int:
    return round(value * data.scale)


def _build_model(data: Problem, *, with_cap: bool = True) -> Model:
    model = cp_model.CpModel()
    m = Model(model, {}, {}, {}, {}, {}, {}, {}, {}, {})
    changed_terms: list[cp_model.LinearExprT] = []
    objective_vars: list[cp_model.IntVar] = []
    objective_coefs: list[int] = []
    total = sum(node.slots for node in data.healthy)
    for jd in data.jobs:
        job, tp, jid = jd.job, jd.tp, jd.job.job_id
        stay = {x: model.new_bool_var(f"stay[{jid},{x}]") for x in jd.stay_value}
        move = {x: model.new_bool_var(f"move[{jid},{x}]") for x in jd.move_value}
        own = {n: model.new_int_var(0, data.nodes[n].slots // tp, f"own[{jid},{n}]") for n in jd.own}
        pool_max = 0 if job.pinned else min(jd.sizes[-1], total) // tp
        pool = model.new_int_var(0, pool_max, f"pool[{jid}]")
        m.stay[jid], m.move[jid], m.own[jid], m.pool[jid] = stay, move, own, pool
        choices = [*stay.values(), *move.values()]
        if job.preemptible:
            model.add_at_most_one(choices)
        else:
            model.add_exactly_one(choices)
        sizes = [*stay, *move]
        model.add(tp * (sum(own.values()) + pool) == cp_model.LinearExpr.weighted_sum(choices, sizes))
        m.size[jid] = cp_model.LinearExpr.weighted_sum(choices, sizes)
        # Pooled groups only under "move", at least one and at most the size's groups. (Tighter
        # in the LP relaxation than a big-M "stay => pool == 0".)
        move_groups = cp_model.LinearExpr.weighted_sum(list(move.values()), [min(x // tp, pool_max) for x in move])
        model.add(pool <= move_groups)
        if move:
            model.add(pool >= sum(move.values()))
        for x, var in stay.items():
            objective_vars.append(var)
            objective_coefs.append(_scaled(data, jd.stay_value[x]))
        for x, var in move.items():
            objective_vars.append(var)
            objective_coefs.append(_scaled(data, jd.move_value[x]))
        if jd.in_place:
            kept = model.new_bool_var(f"kept[{jid}]")
            m.kept[jid] = kept
            model.add_implication(kept, stay[job.current_size])
            for n in jd.own:
                model.add(own[n] == job.current[n] // tp).only_enforce_if(kept)
                model.add(own[n] >= job.current[n] // tp * kept)  # the same, as the LP sees it
            objective_vars.append(kept)
            objective_coefs.append(max(1, _scaled(data, jd.keep_bonus)))
            if not jd.forced:
                changed_terms.append(1 - kept)
            if job.pinned:
                model.add(kept == 1)
        elif not job.current:
            changed_terms.append(sum(move.values()))
            if job.pinned:
                for var in choices:
                    model.add(var == 0)
    _CAPACITY_MODELS.get(data.capacity, _add_explicit_capacity)(data, m)
    _add_team_limits(data, m)
    cap = data.request.max_changed_jobs
    if with_cap and cap is not None and changed_terms:
        model.add(sum(changed_terms) <= cap)
    model.maximize(cp_model.LinearExpr.weighted_sum(objective_vars, objective_coefs))
    return m


def _add_team_limits(data: Problem, m: Model) -> None:
    """Each limited team's jobs hold at most its limit together, and the teams' reserves
    fit (teams.py)."""
    for team, jobs in teams.limited(data.request).items():
        if jobs:
            m.model.add(sum(m.size[job.job_id] for job in jobs) <= data.request.team_limits[team])
    _add_team_reserves(m.model, data.request, {job.job_id: m.size[job.job_id] for job in data.request.jobs})


def _add_team_reserves(model: cp_model.CpModel, request: PlanRequest, size: Mapping[str, cp_model.LinearExprT]) -> None:
    """Every guaranteed team takes max(its slots, its reserve) of the healthy slots, every
    other job its size: together at most the healthy slots (teams.py: borrowed slots are the
    first given back)."""
    if not request.team_guarantees:
        return
    pool = domain.healthy_slots(request)
    reserved = teams.reserves(request, pool)
    taken: list[cp_model.LinearExprT] = []
    for team, reserve in reserved.items():
        held = model.new_int_var(reserve, max(reserve, pool), f"reserved[{team}]")
        model.add(held >= sum((size[job.job_id] for job in request.jobs if job.team == team), 0))
        taken.append(held)
    taken += [size[job.job_id] for job in request.jobs if job.team not in reserved]
    model.add(sum(taken) <= pool)


def _add_pooled_capacity(data: Problem, m: Model) -> None:
    """Own groups fit each node; pooled groups fit what is left, one inequality per TP level."""
    model = m.model
    holders = holders_of(data)
    for n in data.touched:
        slots = data.nodes[n].slots
        used = cp_model.LinearExpr.weighted_sum(
            [m.own[jd.job.job_id][n] for jd in holders[n]], [jd.tp for jd in holders[n]]
        )
        model.add(used <= slots)
    for s in data.levels:
        lhs_vars: list[cp_model.IntVar] = []
        lhs_coefs: list[int] = []
        rhs = sum(data.nodes[n].slots // s for n in data.free)
        for jd in data.jobs:
            if jd.tp >= s and not jd.job.pinned:
                lhs_vars.append(m.pool[jd.job.job_id])
                lhs_coefs.append(jd.tp // s)
        if not lhs_vars:
            continue
        for n in data.touched:
            slots = data.nodes[n].slots
            if slots < s:
                continue
            if slots % s == 0 and all(jd.tp % s == 0 for jd in holders[n]):
                # floor((slots - used) / s) is linear here: slots / s - sum (tp / s) * own.
                rhs += slots // s
                for jd in holders[n]:
                    lhs_vars.append(m.own[jd.job.job_id][n])
                    lhs_coefs.append(jd.tp // s)
            else:
                spare = model.new_int_var(0, slots // s, f"spare[{n},{s}]")
                m.spare[n, s] = spare
                used = cp_model.LinearExpr.weighted_sum(
                    [m.own[jd.job.job_id][n] for jd in holders[n]], [jd.tp for jd in holders[n]]
                )
                model.add(s * spare + used <= slots)
                lhs_vars.append(spare)
                lhs_coefs.append(-1)
        model.add(cp_model.LinearExpr.weighted_sum(lhs_vars, lhs_coefs) <= rhs)


# Free nodes of one slot count share a pattern variable per way of filling one of them (when
# there are at most this many ways), instead of a variable per node and TP degree.
MAX_PATTERNS = 256


def _patterns(slots: int, tps: list[int]) -> list[dict[int, int]] | None:
    """Every maximal way to fill ``slots`` with groups of the given sizes (TP -> groups); None
    when there are more than MAX_PATTERNS."""
    out: list[dict[int, int]] = []

    def extend(i: int, left: int, counts: dict[int, int]) -> bool:
        if i == len(tps):
            if all(left < tp for tp in tps):  # maximal: no group fits any more
                out.append(dict(counts))
            return len(out) <= MAX_PATTERNS
        tp = tps[i]
        for k in range(left // tp, -1, -1):
            counts[tp] = k
            if not extend(i + 1, left - k * tp, counts):
                return False
        del counts[tp]
        return True

    return out if extend(0, slots, {}) else None


def _add_typed_capacity(data: Problem, m: Model) -> None:
    """Exact for any TP degrees: groups of one size are interchangeable between jobs, so what
    must fit is, per TP degree, a count of groups: per node that holds a job now (beside its own
    groups), and per way of filling a free node times the free nodes filled that way."""
    model = m.model
    holders = holders_of(data)
    tps = data.levels
    supply: dict[int, list[tuple[cp_model.IntVar, int]]] = {tp: [] for tp in tps}
    per_node = list(data.touched)
    by_slots: dict[int, list[str]] = {}
    for n in data.free:
        by_slots.setdefault(data.nodes[n].slots, []).append(n)
    for slots, names in sorted(by_slots.items()):
        patterns = _patterns(slots, tps)
        if patterns is None:
            per_node.extend(names)
            continue
        m.patterns[slots] = []
        nodes_used = []
        for k, pattern in enumerate(patterns):
            var = model.new_int_var(0, len(names), f"pattern[{slots},{k}]")
            m.patterns[slots].append((pattern, var))
            nodes_used.append(var)
            for tp, groups in pattern.items():
                if groups:
                    supply[tp].append((var, groups))
        model.add(sum(nodes_used) <= len(names))
    for n in per_node:
        slots = data.nodes[n].slots
        terms = [(m.own[jd.job.job_id][n], jd.tp) for jd in holders.get(n, [])]
        for tp in tps:
            if tp <= slots:
                var = model.new_int_var(0, slots // tp, f"typed[{n},{tp}]")
                m.typed[n, tp] = var
                terms.append((var, tp))
                supply[tp].append((var, 1))
        if terms:
            model.add(cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [c for _, c in terms]) <= slots)
    for tp in tps:
        demand = [m.pool[jd.job.job_id] for jd in data.jobs if jd.tp == tp and not jd.job.pinned]
        if demand:
            have = cp_model.LinearExpr.weighted_sum([v for v, _ in supply[tp]], [c for _, c in supply[tp]])
            model.add(sum(demand) <= have)


def _expand_typed(
    data: Problem, m: Model, solver: cp_model.CpSolver, own: Placement, pool: Mapping[str, int]
) -> Placement | None:
    """Node names for a typed-mode solution: free nodes take the chosen patterns in request
    order; each TP degree's groups go to the jobs of that degree, fullest nodes first."""
    spots: dict[int, list[tuple[str, int]]] = {tp: [] for tp in data.levels}  # TP -> (node, groups)
    for (n, tp), var in m.typed.items():
        if solver.value(var):
            spots[tp].append((n, int(solver.value(var))))
    by_slots: dict[int, list[str]] = {}
    for n in data.free:
        by_slots.setdefault(data.nodes[n].slots, []).append(n)
    for slots, chosen in m.patterns.items():
        names = iter(by_slots[slots])
        for pattern, var in chosen:
            for _ in range(int(solver.value(var))):
                n = next(names)
                for tp, groups in pattern.items():
                    if groups:
                        spots[tp].append((n, groups))
    placement = {jid: dict(job_slots) for jid, job_slots in own.items()}
    for tp, where in spots.items():
        where.sort(key=lambda item: -item[1])  # stable: request order among equals
        k, left = 0, where[0][1] if where else 0
        for jd in sorted((jd for jd in data.jobs if jd.tp == tp), key=lambda jd: -pool[jd.job.job_id]):
            need = pool[jd.job.job_id]
            job_slots = placement[jd.job.job_id]
            while need:
                if left == 0:
                    return None  # the counts do not add up: a bug, caught by the caller
                n = where[k][0]
                take = min(need, left)
                job_slots[n] = job_slots.get(n, 0) + take * tp
                need -= take
                left -= take
                if left == 0 and k + 1 < len(where):
                    k += 1
                    left = where[k][1]
    return placement


def _add_explicit_capacity(data: Problem, m: Model) -> None:
    """One variable per job and foreign node; node capacity per node. Exact for any TP set."""
    model = m.model
    used: dict[str, tuple[list[cp_model.IntVar], list[int]]] = {n.node_id: ([], []) for n in data.healthy}
    for jd in data.jobs:
        jid = jd.job.job_id
        for n, var in m.own[jid].items():
            used[n][0].append(var)
            used[n][1].append(jd.tp)
        if jd.job.pinned:
            m.explicit[jid] = {}
            continue
        foreign = {
            node.node_id: model.new_int_var(0, node.slots // jd.tp, f"at[{jid},{node.node_id}]")
            for node in data.healthy
            if node.node_id not in m.own[jid] and node.slots >= jd.tp
        }
        m.explicit[jid] = foreign
        model.add(m.pool[jid] == sum(foreign.values()))
        for n, var in foreign.items():
            used[n][0].append(var)
            used[n][1].append(jd.tp)
    for node in data.healthy:
        variables, coefs = used[node.node_id]
        if variables:
            model.add(cp_model.LinearExpr.weighted_sum(variables, coefs) <= node.slots)


# How node capacity is modeled, by Problem.capacity ("explicit" otherwise).
_CAPACITY_MODELS: dict[str, Callable[[Problem, Model], None]] = {
    "pool": _add_pooled_capacity,
    "typed": _add_typed_capacity,
}


def _add_hint(m: Model, data: Problem, placement: Placement) -> None:
    for jd in data.jobs:
        jid, tp = jd.job.job_id, jd.tp
        own, pool = split(jd, placement[jid])
        size = sum(placement[jid].values())
        for x, var in m.stay[jid].items():
            m.model.add_hint(var, x == size and pool == 0)
        for x, var in m.move[jid].items():
            m.model.add_hint(var, x == size and pool > 0)
        for n, var in m.own[jid].items():
            m.model.add_hint(var, own.get(n, 0) // tp)
        m.model.add_hint(m.pool[jid], pool)
        if jid in m.kept:
            m.model.add_hint(m.kept[jid], placement[jid] == jd.job.current)
        for n, var in m.explicit.get(jid, {}).items():  # foreign nodes only
            m.model.add_hint(var, placement[jid].get(n, 0) // tp)
    used = dict.fromkeys(data.nodes, 0)
    foreign: dict[tuple[str, int], int] = {}
    for jd in data.jobs:
        for n, s in placement[jd.job.job_id].items():
            if n in jd.job.current:
                used[n] += s
            else:
                foreign[n, jd.tp] = foreign.get((n, jd.tp), 0) + s // jd.tp
    for (n, s), var in m.spare.items():
        m.model.add_hint(var, (data.nodes[n].slots - used[n]) // s)
    for key, var in m.typed.items():
        m.model.add_hint(var, foreign.get(key, 0))


def _placement_from_solution(data: Problem, m: Model, solver: cp_model.CpSolver) -> Placement | None:
    own = {
        jd.job.job_id: {n: solver.value(var) * jd.tp for n, var in m.own[jd.job.job_id].items() if solver.value(var)}
        for jd in data.jobs
    }
    pool = {jd.job.job_id: int(solver.value(m.pool[jd.job.job_id])) for jd in data.jobs}
    if data.capacity == "pool":
        return pack(data, own, pool)
    if data.capacity == "typed":
        return _expand_typed(data, m, solver, own, pool)
    placement: Placement = {}
    for jd in data.jobs:
        jid = jd.job.job_id
        slots = dict(own[jid])
        for n, var in m.explicit.get(jid, {}).items():
            if solver.value(var):
                slots[n] = slots.get(n, 0) + solver.value(var) * jd.tp
        placement[jid] = slots
    return placement


def _parameters(solver: cp_model.CpSolver, request: PlanRequest, time_limit_s: float | None = None) -> None:
    solver.parameters.max_time_in_seconds = request.time_limit_s if time_limit_s is None else time_limit_s
    solver.parameters.random_seed = request.seed
    solver.parameters.num_workers = request.workers
    solver.parameters.relative_gap_limit = request.relative_gap
    # Measured on bench/planner.py instances: the full linear relaxation (level 2, which also
    # linearizes the encodings presolve extracts), all of it from the start rather than added
    # lazily, closes the gap several times faster; skipping the dedicated search around the
    # hint (it is still the first solution) saves seconds the main search puts to better use;
    # probing in presolve costs more than it finds on this model; branching on the LP solution
    # halves the slowest solves. More workers were slower on 2 cores (the portfolio's LP
    # worker is weaker than the single worker's), so keep ``workers`` at 1 unless measured.
    solver.parameters.linearization_level = 2
    solver.parameters.add_lp_constraints_lazily = False
    solver.parameters.hint_conflict_limit = 0
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.search_branching = cp_model.LP_SEARCH


def _infeasible_after_solve(data: Problem, deadline: float) -> str:
    """Why CP-SAT found no plan: the cap if the instance is feasible without it, else capacity."""
    if data.request.max_changed_jobs is not None:
        m = _build_model(data, with_cap=False)
        solver = cp_model.CpSolver()
        _parameters(solver, data.request, max(0.05, deadline - time.perf_counter()))
        status = solver.solve(m.model)
        if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
            return (
                f"max_changed_jobs: pinned and non-preemptible jobs fit only if more than"
                f" {data.request.max_changed_jobs} jobs change"
            )
    return "capacity: pinned and non-preemptible jobs do not fit on the healthy nodes in whole TP groups"


def plan(request: PlanRequest, *, _mode: str = "auto") -> PlanResult:
    """The best size and placement of every job. ValueError (``domain.FieldError``) for a
    malformed request; RuntimeError if CP-SAT rejects the model (MODEL_INVALID: a bug here, not
    bad input). ``_mode`` ("auto", "pool", "explicit") forces a capacity model, for tests."""
    start = time.perf_counter()
    domain.validate(request)
    data = build_problem(request, _mode)
    blocker = infeasible_reason(data)
    if blocker is not None:
        return plan_result(data, "INFEASIBLE", blocker, time.perf_counter() - start)
    greedy = greedy_plan(data)
    targets = size_only_targets(data)
    if targets is not None:
        other = greedy_plan(data, targets)
        if not domain.plan_problems(request, other) and plan_value(data, other) > plan_value(data, greedy):
            greedy = other
    m = _build_model(data)
    _add_hint(m, data, greedy)
    solver = cp_model.CpSolver()
    _parameters(solver, request, max(1e-6, request.time_limit_s - (time.perf_counter() - start)))
    status = solver.solve(m.model)
    if status == cp_model.MODEL_INVALID:
        raise RuntimeError(f"planner built an invalid CP-SAT model: {m.model.validate()}")
    if status == cp_model.INFEASIBLE:
        reason = _infeasible_after_solve(data, start + 2 * request.time_limit_s)
        return plan_result(data, "INFEASIBLE", reason, time.perf_counter() - start)
    fallback = not domain.plan_problems(request, greedy)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # Presolve alone can outlast a short limit on a big cluster. A valid greedy plan beats
        # no plan when jobs are down; it is FEASIBLE, with no bound known.
        limit = f"no solver answer within {request.time_limit_s:g} s"
        if fallback:
            return plan_result(data, "FEASIBLE", f"{limit}; greedy plan", time.perf_counter() - start, greedy, math.inf)
        return plan_result(data, "UNKNOWN", limit, time.perf_counter() - start, bound=math.inf)
    placement = _placement_from_solution(data, m, solver)
    if placement is not None:
        placement = polish(data, placement)
    problems = ["pooled groups did not pack"] if placement is None else domain.plan_problems(request, placement)
    if problems:  # a bug; never hand out an invalid plan
        why = f"solver plan failed its check ({'; '.join(problems[:3])})"
        if fallback:
            return plan_result(data, "FEASIBLE", f"{why}; greedy plan", time.perf_counter() - start, greedy, math.inf)
        return plan_result(data, "UNKNOWN", why, time.perf_counter() - start, bound=math.inf)
    assert placement is not None
    seconds = time.perf_counter() - start
    best, found = solver.best_objective_bound, solver.objective_value
    # The solver's bound in exact units; when it meets the solution, the plan is proven best
    # (the exact objective can differ from the scaled one by rounding).
    bound = 0.0 if best <= found else best / data.scale
    gap = max(0.0, best - found) / max(1.0, abs(best))
    if status == cp_model.OPTIMAL:
        why = "optimal" if gap == 0 else f"optimal within the requested gap of {request.relative_gap:.2%}"
        return plan_result(data, "OPTIMAL", why, seconds, placement, bound=bound)
    return plan_result(
        data,
        "FEASIBLE",
        f"time limit of {request.time_limit_s:g} s reached; gap {gap:.3%}",
        seconds,
        placement,
        bound=bound,
    )


@dataclass(frozen=True)
class SizePlan:
    """``plan_sizes``'s answer: the size of every job (0 paused) and the exact size-only objective
    (``domain.size_only_score``). ``sizes`` is empty unless status is OPTIMAL or FEASIBLE."""

    status: str
    objective: float
    bound: float
    gap: float
    solve_seconds: float
    sizes: dict[str, int]
    reason: str


def plan_sizes(request: PlanRequest) -> SizePlan:
    """The size-only problem (``domain`` docstring) solved by CP-SAT: the same objective that
    ``dp.plan_sizes_dp`` optimizes by dynamic programming."""
    start = time.perf_counter()
    domain.validate(request)
    nodes = {node.node_id: node for node in request.nodes}
    horizon = domain.horizon_of(request)
    options = {job.job_id: domain.size_options(job, nodes, horizon) for job in request.jobs}
    for job_id, opts in options.items():
        if not opts:
            return SizePlan("INFEASIBLE", 0.0, 0.0, 0.0, time.perf_counter() - start, {}, f"job {job_id} has no size")
    largest = max((abs(v) for opts in options.values() for v in opts.values()), default=0.0)
    scale = OBJECTIVE_RESOLUTION / largest if largest > 0 else 1.0
    model = cp_model.CpModel()
    choose = {
        job_id: {x: model.new_bool_var(f"size[{job_id},{x}]") for x in sorted(opts)} for job_id, opts in options.items()
    }
    for by_size in choose.values():
        model.add_exactly_one(by_size.values())
    pairs = [(var, x) for by_size in choose.values() for x, var in by_size.items() if x]
    if pairs:
        used = cp_model.LinearExpr.weighted_sum([v for v, _ in pairs], [x for _, x in pairs])
        model.add(used <= domain.healthy_slots(request))
    size_of = {j: cp_model.LinearExpr.weighted_sum(list(by.values()), list(by)) for j, by in choose.items()}
    for team, jobs in teams.limited(request).items():
        if jobs:
            model.add(sum(size_of[job.job_id] for job in jobs) <= request.team_limits[team])
    _add_team_reserves(model, request, size_of)
    terms = [(var, round(options[j][x] * scale)) for j, by_size in choose.items() for x, var in by_size.items()]
    model.maximize(cp_model.LinearExpr.weighted_sum([v for v, _ in terms], [c for _, c in terms]))
    solver = cp_model.CpSolver()
    _parameters(solver, request)
    status = solver.solve(model)
    seconds = time.perf_counter() - start
    if status == cp_model.INFEASIBLE:
        return SizePlan("INFEASIBLE", 0.0, 0.0, 0.0, seconds, {}, "the jobs' smallest sizes exceed the healthy slots")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return SizePlan("UNKNOWN", 0.0, math.inf, math.inf, seconds, {}, "no solver answer within the time limit")
    sizes = {j: next(x for x, var in by_size.items() if solver.value(var)) for j, by_size in choose.items()}
    objective = sum(options[j][x] for j, x in sizes.items())
    if status == cp_model.OPTIMAL:
        return SizePlan("OPTIMAL", objective, objective, 0.0, seconds, sizes, "optimal")
    bound = max(objective, solver.best_objective_bound / scale)
    gap = (bound - objective) / abs(bound) if bound else 0.0
    return SizePlan("FEASIBLE", objective, bound, gap, seconds, sizes, "time limit reached")
