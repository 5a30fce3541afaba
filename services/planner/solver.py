"""The planner's CP-SAT model: the size and placement of every job that maximize the objective
of ``domain`` (docs/architecture.md: The cost model), and ``plan_sizes``, the same for the size-only problem.

Data, model and solve are kept apart, as in OR-Tools' examples/python/line_balancing_sat.py:
``_build_data`` turns a request into scaled integer coefficients, ``_build_model`` states the
problem, ``_greedy`` computes a hint (and a fallback plan), ``_pack`` turns pooled counts into
node names, and ``plan`` solves, checks and explains.

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
wherever it goes; so the conditions are sufficient as well as necessary.) ``_pack`` does that
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
plans (``_greedy``), one aimed at the size-only optimum of the paper's DP (``dp.plan_sizes_dp``)
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

import heapq
import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ortools.sat.python import cp_model

from services.planner import domain, dp
from services.planner.domain import Job, JobPlan, Node, PlanRequest, PlanResult

# The largest objective term maps to this many integer units (see the module docstring).
OBJECTIVE_RESOLUTION = 1e9

Placement = dict[str, dict[str, int]]  # job_id -> node_id -> slots


@dataclass(frozen=True)
class _JobData:
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
class _Data:
    request: PlanRequest
    nodes: dict[str, Node]  # every node, in request order
    healthy: list[Node]
    touched: list[str]  # healthy nodes some job holds now, in request order
    free: list[str]  # the other healthy nodes with slots, in request order
    horizon_s: float
    jobs: list[_JobData]
    levels: list[int]  # distinct TP degrees of the jobs that may use pooled nodes, ascending
    capacity: str  # "pool" (levels: TP degrees form a chain), "typed" or "explicit"
    scale: float  # integer objective units per weighted FLOP


@dataclass
class _Model:
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


def _is_chain(values: list[int]) -> bool:
    return all(b % a == 0 for a, b in itertools.pairwise(values))


def _undominated(job: Job, values: dict[int, float], keep_current: bool) -> dict[int, float]:
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


def _build_data(request: PlanRequest, mode: str = "auto") -> _Data:
    nodes = {node.node_id: node for node in request.nodes}
    horizon = domain.horizon_seconds(request)
    healthy = [node for node in request.nodes if node.healthy]
    held = {n for job in request.jobs for n in job.current if nodes[n].healthy}
    touched = [node.node_id for node in healthy if node.node_id in held]
    free = [node.node_id for node in healthy if node.node_id not in held and node.slots > 0]
    jobs: list[_JobData] = []
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
            _JobData(
                job=job,
                tp=tp,
                sizes=sizes,
                own=own,
                stay_cap=stay_cap,
                in_place=in_place,
                forced=domain.forced_change(job, nodes),
                stay_value=_undominated(
                    job, {x: v * (horizon - resize) for x, v in f.items() if x <= stay_cap}, in_place
                ),
                move_value=_undominated(job, {x: v * (horizon - migrate) for x, v in f.items()}, False),
                keep_bonus=f[job.current_size] * (resize - keep_cost) if in_place else 0.0,
            )
        )
    largest = max(
        (abs(v) for jd in jobs for v in (*jd.stay_value.values(), *jd.move_value.values(), jd.keep_bonus)),
        default=0.0,
    )
    levels = sorted({jd.tp for jd in jobs if not jd.job.pinned})
    if mode == "auto":
        mode = "pool" if _is_chain(levels) else "typed"
    return _Data(
        request=request,
        nodes=nodes,
        healthy=healthy,
        touched=touched,
        free=free,
        horizon_s=horizon,
        jobs=jobs,
        levels=levels,
        capacity=mode,
        scale=OBJECTIVE_RESOLUTION / largest if largest > 0 else 1.0,
    )


def _infeasible_reason(data: _Data) -> str | None:
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
    cap = data.request.max_changed_jobs
    if cap is not None and len(must_start) > cap:
        return (
            f"max_changed_jobs: {len(must_start)} non-preemptible jobs must start"
            f" ({', '.join(must_start[:5])}{', ...' if len(must_start) > 5 else ''}), cap is {cap}"
        )
    return None


def _scaled(data: _Data, value: float) -> int:
    return round(value * data.scale)


def _build_model(data: _Data, *, with_cap: bool = True) -> _Model:
    model = cp_model.CpModel()
    m = _Model(model, {}, {}, {}, {}, {}, {}, {}, {}, {})
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
    cap = data.request.max_changed_jobs
    if with_cap and cap is not None and changed_terms:
        model.add(sum(changed_terms) <= cap)
    model.maximize(cp_model.LinearExpr.weighted_sum(objective_vars, objective_coefs))
    return m


def _holders(data: _Data) -> dict[str, list[_JobData]]:
    holders: dict[str, list[_JobData]] = {n: [] for n in data.touched}
    for jd in data.jobs:
        for n in jd.own:
            holders[n].append(jd)
    return holders


def _add_pooled_capacity(data: _Data, m: _Model) -> None:
    """Own groups fit each node; pooled groups fit what is left, one inequality per TP level."""
    model = m.model
    holders = _holders(data)
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


def _add_typed_capacity(data: _Data, m: _Model) -> None:
    """Exact for any TP degrees: groups of one size are interchangeable between jobs, so what
    must fit is, per TP degree, a count of groups: per node that holds a job now (beside its own
    groups), and per way of filling a free node times the free nodes filled that way."""
    model = m.model
    holders = _holders(data)
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
    data: _Data, m: _Model, solver: cp_model.CpSolver, own: Placement, pool: Mapping[str, int]
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


def _add_explicit_capacity(data: _Data, m: _Model) -> None:
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


# --- free slots, packing pooled groups onto named nodes -------------------------------------------


class _Free:
    """Free slots per healthy node, bucketed by how many are free, for best-fit choices in time
    independent of the node count."""

    def __init__(self, data: _Data, placement: Mapping[str, Mapping[str, int]]) -> None:
        self.names = [n.node_id for n in data.healthy]
        self.index = {n: i for i, n in enumerate(self.names)}
        self.free = [n.slots for n in data.healthy]
        for slots in placement.values():
            for n, s in slots.items():
                self.free[self.index[n]] -= s
        self.count: dict[int, int] = {}
        self.buckets: dict[int, list[int]] = {}
        for i, c in enumerate(self.free):
            self._add(i, c)

    def _add(self, i: int, c: int) -> None:
        if c > 0:
            self.count[c] = self.count.get(c, 0) + 1
            heapq.heappush(self.buckets.setdefault(c, []), i)

    def overfull(self) -> bool:
        return any(c < 0 for c in self.free)

    def room(self, tp: int) -> int:
        """How many groups of ``tp`` slots still fit, over all nodes."""
        return sum(k * (c // tp) for c, k in self.count.items())

    def take(self, node_id: str, slots: int) -> None:
        i = self.index[node_id]
        c = self.free[i]
        if c > 0:
            self.count[c] -= 1  # its bucket entry goes stale; pick() skips it
        self.free[i] = c - slots
        self._add(i, c - slots)

    def pick(self, tp: int, groups: int) -> tuple[str, int] | None:
        """A node for up to ``groups`` groups of ``tp`` slots: the fullest that takes them all,
        else the emptiest; ties to the first in request order. Returns (node, groups it takes)."""
        sizes = sorted(c for c, k in self.count.items() if k > 0 and c >= tp)
        if not sizes:
            return None
        fits = [c for c in sizes if c // tp >= groups]
        c = fits[0] if fits else sizes[-1]
        heap = self.buckets[c]
        while self.free[heap[0]] != c:  # stale entries
            heapq.heappop(heap)
        return self.names[heap[0]], min(groups, c // tp)


def _place(free: _Free, slots: dict[str, int], tp: int, groups: int, first: list[str]) -> bool:
    """Adds ``groups`` TP groups to ``slots``: on the nodes in ``first`` while they have room, then
    best fit. False (and ``slots`` partly filled) when they do not all fit."""
    for n in first:
        take = min(groups, free.free[free.index[n]] // tp)
        if take:
            slots[n] = slots.get(n, 0) + take * tp
            free.take(n, take * tp)
            groups -= take
    while groups:
        chosen = free.pick(tp, groups)
        if chosen is None:
            return False
        n, take = chosen
        slots[n] = slots.get(n, 0) + take * tp
        free.take(n, take * tp)
        groups -= take
    return True


def _pack(data: _Data, own: Placement, pool: Mapping[str, int]) -> Placement | None:
    """Node names for the pooled groups beside the own ones: largest TP first (which always
    succeeds when the TP degrees form a chain and the level inequalities hold), each job best
    fit. None when they do not fit."""
    placement = {jid: dict(slots) for jid, slots in own.items()}
    free = _Free(data, placement)
    if free.overfull():
        return None
    order = sorted((jd for jd in data.jobs if pool[jd.job.job_id] > 0), key=lambda jd: (-jd.tp, -pool[jd.job.job_id]))
    for jd in order:
        if not _place(free, placement[jd.job.job_id], jd.tp, pool[jd.job.job_id], []):
            return None
    return placement


# How node capacity is modeled, by _Data.capacity ("explicit" otherwise).
_CAPACITY_MODELS: dict[str, Callable[[_Data, _Model], None]] = {
    "pool": _add_pooled_capacity,
    "typed": _add_typed_capacity,
}


# --- greedy hint ----------------------------------------------------------------------------------


def _greedy(data: _Data, targets: Mapping[str, int] | None = None) -> Placement:
    """A quick valid plan, to hint the solver with and to fall back on: keep what can be kept
    (pinned first, then the jobs earning most per slot); shrink jobs that lost a node onto the
    nodes they have left; start non-preemptible jobs at their minimum size; then, one step at a
    time, grow the job and size with the best gain per added slot (onto its own nodes first,
    then best fit), within the changed-jobs cap.

    With ``targets`` (job -> size, say the size-only optimum), a job is kept only at its target
    size, shrunk no further than it, and grown towards it (largest TP first) before the
    step-by-step growth fills what is left."""
    greedy = _Greedy(data, targets)
    greedy.keep()
    greedy.shrink_onto_own_nodes()
    greedy.start_non_preemptible()
    if targets is not None:
        greedy.grow_to_targets()
    greedy.grow_step_by_step()
    return greedy.placement


class _Greedy:
    """The greedy plan as it is built: the placement so far, the free slots, and how many
    jobs it has changed (against the cap)."""

    def __init__(self, data: _Data, targets: Mapping[str, int] | None) -> None:
        self.data, self.targets = data, targets
        self.horizon = data.horizon_s
        self.placement: Placement = {jd.job.job_id: {} for jd in data.jobs}
        self.free = _Free(data, self.placement)
        self.cap = data.request.max_changed_jobs
        self.changes = 0

    def target(self, jd: _JobData) -> int | None:
        return None if self.targets is None or jd.job.pinned else self.targets.get(jd.job.job_id)

    def unchanged(self, jd: _JobData) -> bool:
        return not jd.forced and not domain.is_changed(jd.job, self.placement[jd.job.job_id])

    def capped(self, jd: _JobData) -> bool:
        """Whether changing ``jd`` (not changed yet) would pass the changed-jobs cap."""
        return self.cap is not None and self.changes >= self.cap and self.unchanged(jd)

    def assign(self, jd: _JobData, slots: dict[str, int]) -> None:
        was = self.unchanged(jd)
        self.placement[jd.job.job_id] = slots
        if was and not self.unchanged(jd):
            self.changes += 1

    def keep(self) -> None:
        free = self.free
        keepers = [jd for jd in self.data.jobs if jd.in_place]
        keepers.sort(key=lambda jd: (not jd.job.pinned, -_per_slot(jd.job, jd.job.current_size)))
        for jd in keepers:
            job = jd.job
            if self.target(jd) not in (None, job.current_size):
                continue
            if job.pinned or not job.preemptible or domain.job_value(job, job.current, self.horizon) > 0:
                if all(free.free[free.index[n]] >= s for n, s in job.current.items()):
                    for n, s in job.current.items():
                        free.take(n, s)
                    self.assign(jd, dict(job.current))

    def shrink_onto_own_nodes(self) -> None:
        """A job that lost a node (or cannot keep for another reason) shrinks onto the nodes
        it has left."""
        free = self.free
        for jd in self.data.jobs:
            job, tp = jd.job, jd.tp
            if job.pinned or self.placement[job.job_id] or not jd.own:
                continue
            held = sum(min(job.current[n], free.free[free.index[n]]) // tp for n in jd.own)
            target = self.target(jd)
            limit = min(tp * held, target or 0) if target is not None else tp * held
            best = max((x for x, v in jd.stay_value.items() if x <= limit and v > 0), default=0)
            need, slots = best // tp, {}
            for n in jd.own:
                take = min(min(job.current[n], free.free[free.index[n]]) // tp, need)
                if take:
                    slots[n] = take * tp
                    free.take(n, take * tp)
                    need -= take
            if slots:
                self.assign(jd, slots)

    def start_non_preemptible(self) -> None:
        for jd in self.data.jobs:
            job = jd.job
            if job.preemptible or job.pinned or self.placement[job.job_id] or not jd.move_value:
                continue
            start = min(jd.move_value) // jd.tp
            if start <= self.free.room(jd.tp):
                slots: dict[str, int] = {}
                _place(self.free, slots, jd.tp, start, jd.own)
                self.assign(jd, slots)

    def grow_to_targets(self) -> None:
        for jd in sorted(self.data.jobs, key=lambda jd: (-jd.tp, -(self.target(jd) or 0))):
            want, now = self.target(jd), self.placement[jd.job.job_id]
            size = sum(now.values())
            if not want or want <= size or self.capped(jd):
                continue
            room = self.free.room(jd.tp)
            fits = [x for x in jd.sizes if size < x <= want and (x - size) // jd.tp <= room]
            if fits:
                slots = dict(now)
                _place(self.free, slots, jd.tp, (fits[-1] - size) // jd.tp, jd.own)
                self.assign(jd, slots)

    def _grown_value(self, jd: _JobData, now: dict[str, int], groups: int) -> float:
        """The value of ``jd`` grown by ``groups`` TP groups onto its own nodes, as _place
        puts them there."""
        grown = dict(now)
        for n in jd.own:
            take = min(groups, self.free.free[self.free.index[n]] // jd.tp)
            if take:
                grown[n] = grown.get(n, 0) + take * jd.tp
                groups -= take
        return domain.job_value(jd.job, grown, self.horizon)

    def best_step(self, jd: _JobData) -> tuple[float, int] | None:
        """The growth of ``jd`` with the best gain per added slot: (gain, new size)."""
        job, tp = jd.job, jd.tp
        if job.pinned or self.capped(jd):
            return None
        now = self.placement[job.job_id]
        size = sum(now.values())
        base = domain.job_value(job, now, self.horizon)
        room, own_room = self.free.room(tp), sum(self.free.free[self.free.index[n]] // tp for n in jd.own)
        stays = all(n in job.current for n in now)
        best: tuple[float, int] | None = None
        for x in jd.sizes:
            if x <= size:
                continue
            groups = (x - size) // tp
            if groups > room:
                break
            if stays and groups <= own_room:
                value = self._grown_value(jd, now, groups)
            else:
                value = domain.weighted_throughput(job, x) * (self.horizon - job.transition.seconds("migrate"))
            gain = (value - base) / (x - size)
            if gain > 0 and (best is None or gain > best[0]):
                best = (gain, x)
        return best

    def grow_step_by_step(self) -> None:
        """Grows, one step at a time, the job with the best gain per added slot (a heap of the
        jobs' best steps, each checked again when popped: another job's growth may have
        changed it)."""
        heap: list[tuple[float, int, int]] = []
        for i, jd in enumerate(self.data.jobs):
            step = self.best_step(jd)
            if step is not None:
                heap.append((-step[0], i, step[1]))
        heapq.heapify(heap)
        while heap:
            neg_gain, i, x = heapq.heappop(heap)
            jd = self.data.jobs[i]
            step = self.best_step(jd)
            if step is None:
                continue
            if step != (-neg_gain, x):
                heapq.heappush(heap, (-step[0], i, step[1]))
                continue
            slots = dict(self.placement[jd.job.job_id])
            placed = _place(self.free, slots, jd.tp, (x - sum(slots.values())) // jd.tp, jd.own)
            assert placed  # room() counted whole groups
            self.assign(jd, slots)
            step = self.best_step(jd)
            if step is not None:
                heapq.heappush(heap, (-step[0], i, step[1]))


# The size-only DP seeds a second greedy plan when its table (jobs x sizes x slots) is at most
# this big: about a quarter of a second.
DP_HINT_MAX_CELLS = 200_000_000


def _size_only_targets(data: _Data) -> dict[str, int] | None:
    """The size-only optimum (the paper's DP) as sizes to aim the greedy at, when it is cheap
    and the cap does not apply (the DP knows nothing of it)."""
    request = data.request
    cells = sum(len(jd.sizes) + 1 for jd in data.jobs) * (domain.healthy_slots(request) + 1)
    if request.max_changed_jobs is not None or cells > DP_HINT_MAX_CELLS:
        return None
    result = dp.plan_sizes_dp(request)
    return result.sizes if result.status == "OPTIMAL" else None


def _value(data: _Data, placement: Placement) -> float:
    return sum(domain.job_value(jd.job, placement[jd.job.job_id], data.horizon_s) for jd in data.jobs)


def _per_slot(job: Job, size: int) -> float:
    return domain.weighted_throughput(job, size) / size if size else 0.0


def _split(jd: _JobData, slots: Mapping[str, int]) -> tuple[dict[str, int], int]:
    """A job's placement as the model sees it: slots on its own nodes, and pooled groups."""
    own = {n: s for n, s in slots.items() if n in jd.job.current and s}
    return own, (sum(slots.values()) - sum(own.values())) // jd.tp


def _add_hint(m: _Model, data: _Data, placement: Placement) -> None:
    for jd in data.jobs:
        jid, tp = jd.job.job_id, jd.tp
        own, pool = _split(jd, placement[jid])
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


def _placement_from_solution(data: _Data, m: _Model, solver: cp_model.CpSolver) -> Placement | None:
    own = {
        jd.job.job_id: {n: solver.value(var) * jd.tp for n, var in m.own[jd.job.job_id].items() if solver.value(var)}
        for jd in data.jobs
    }
    pool = {jd.job.job_id: int(solver.value(m.pool[jd.job.job_id])) for jd in data.jobs}
    if data.capacity == "pool":
        return _pack(data, own, pool)
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


def _polish(data: _Data, placement: Placement) -> Placement:
    """Puts changed jobs back where they are now when that fits beside the rest of the plan and
    earns at least as much. A search stopped within a gap (or by the time limit) may move a small
    job for nothing; this keeps "jobs stay where they are unless moving them pays" exact."""
    used = dict.fromkeys(data.nodes, 0)
    for slots in placement.values():
        for n, s in slots.items():
            used[n] += s
    out = dict(placement)
    for jd in data.jobs:
        job = jd.job
        new, cur = out[job.job_id], job.current
        if not jd.in_place or job.pinned or new == cur:
            continue
        fits = all(used[n] - new.get(n, 0) + s <= data.nodes[n].slots for n, s in cur.items())
        if fits and domain.job_value(job, cur, data.horizon_s) >= domain.job_value(job, new, data.horizon_s):
            for n, s in new.items():
                used[n] -= s
            for n, s in cur.items():
                used[n] += s
            out[job.job_id] = dict(cur)
    return out


# --- reasons and results ------------------------------------------------------------------------


def _slots_text(count: int) -> str:
    return f"{count} slot" if count == 1 else f"{count} slots"


def _plural_nodes(node_ids: list[str]) -> str:
    return f"{'node' if len(node_ids) == 1 else 'nodes'} {', '.join(node_ids)}"


def _unplaced_reason(jd: _JobData, left: int, cap_reached: int | None) -> str:
    """Why a job got no slots, given the slots ``left`` free for its TP size (``cap_reached``:
    the changed-jobs cap when the plan used it up, else None)."""
    job = jd.job
    if job.pinned:
        return "pinned while not running"
    if left < jd.sizes[0]:
        return f"needs at least {_slots_text(jd.sizes[0])}, only {left} left free"
    if cap_reached is not None and not jd.forced:
        return f"changed-jobs cap of {cap_reached} reached"
    if not any(v > 0 for v in jd.move_value.values()):
        return "not worth its transition time before the next expected failure"
    return f"weight {job.weight:g} earns less per slot than the jobs given the slots"


def _reasons(data: _Data, result: Mapping[str, dict[str, int]]) -> dict[str, str]:
    """A reason per job, from comparing its current and new placement."""
    used = dict.fromkeys(data.nodes, 0)
    released = dict.fromkeys(data.nodes, 0)  # slots jobs give up on each node
    for jd in data.jobs:
        new, cur = result[jd.job.job_id], jd.job.current
        for node_id in set(new) | set(cur):
            used[node_id] += new.get(node_id, 0)
            released[node_id] += max(0, cur.get(node_id, 0) - new.get(node_id, 0))
    cap = data.request.max_changed_jobs
    voluntary = sum(1 for jd in data.jobs if domain.is_changed(jd.job, result[jd.job.job_id]) and not jd.forced)
    left_by_tp: dict[int, int] = {}
    reasons: dict[str, str] = {}
    for jd in data.jobs:
        job, new = jd.job, result[jd.job.job_id]
        cur, tp = dict(job.current), job.tensor_parallel
        cur_size, new_size = job.current_size, sum(new.values())
        lost = sorted(n for n in cur if not data.nodes[n].healthy)
        if lost:
            cause = f"{_plural_nodes(lost)} lost"
        elif job.hit_by_failure:
            cause = "hit by failure"
        else:
            cause = ""
        if new_size == 0:
            if tp not in left_by_tp:
                left_by_tp[tp] = sum((n.slots - used[n.node_id]) // tp * tp for n in data.healthy)
            why = _unplaced_reason(jd, left_by_tp[tp], cap if cap is not None and voluntary >= cap else None)
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
) -> PlanResult:
    if placement is None:
        return PlanResult(
            status, 0.0, bound, math.inf if bound == math.inf else 0.0, seconds, data.horizon_s, (), reason
        )
    reasons = _reasons(data, placement)
    jobs = []
    for jd in data.jobs:
        slots = placement[jd.job.job_id]
        kind = domain.transition_kind(jd.job, slots)
        jobs.append(
            JobPlan(
                job_id=jd.job.job_id,
                slots_by_node={n: slots[n] for n in data.nodes if slots.get(n)},
                size=sum(slots.values()),
                changed=domain.is_changed(jd.job, slots),
                reason=reasons[jd.job.job_id],
                transition=kind or "",
                transition_s=domain.transition_seconds(jd.job, kind),
            )
        )
    objective = sum(domain.job_value(jd.job, placement[jd.job.job_id], data.horizon_s) for jd in data.jobs)
    bound = max(bound, objective)
    if bound == math.inf:
        gap = math.inf
    else:
        gap = (bound - objective) / abs(bound) if bound else 0.0
    return PlanResult(status, objective, bound, gap, seconds, data.horizon_s, tuple(jobs), reason)


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


def _infeasible_after_solve(data: _Data, deadline: float) -> str:
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
    data = _build_data(request, _mode)
    blocker = _infeasible_reason(data)
    if blocker is not None:
        return _result(data, "INFEASIBLE", blocker, time.perf_counter() - start)
    greedy = _greedy(data)
    targets = _size_only_targets(data)
    if targets is not None:
        other = _greedy(data, targets)
        if not domain.plan_problems(request, other) and _value(data, other) > _value(data, greedy):
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
        return _result(data, "INFEASIBLE", reason, time.perf_counter() - start)
    fallback = not domain.plan_problems(request, greedy)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        # Presolve alone can outlast a short limit on a big cluster. A valid greedy plan beats
        # no plan when jobs are down; it is FEASIBLE, with no bound known.
        limit = f"no solver answer within {request.time_limit_s:g} s"
        if fallback:
            return _result(data, "FEASIBLE", f"{limit}; greedy plan", time.perf_counter() - start, greedy, math.inf)
        return _result(data, "UNKNOWN", limit, time.perf_counter() - start, bound=math.inf)
    placement = _placement_from_solution(data, m, solver)
    if placement is not None:
        placement = _polish(data, placement)
    problems = ["pooled groups did not pack"] if placement is None else domain.plan_problems(request, placement)
    if problems:  # a bug; never hand out an invalid plan
        why = f"solver plan failed its check ({'; '.join(problems[:3])})"
        if fallback:
            return _result(data, "FEASIBLE", f"{why}; greedy plan", time.perf_counter() - start, greedy, math.inf)
        return _result(data, "UNKNOWN", why, time.perf_counter() - start, bound=math.inf)
    assert placement is not None
    seconds = time.perf_counter() - start
    best, found = solver.best_objective_bound, solver.objective_value
    # The solver's bound in exact units; when it meets the solution, the plan is proven best
    # (the exact objective can differ from the scaled one by rounding).
    bound = 0.0 if best <= found else best / data.scale
    gap = max(0.0, best - found) / max(1.0, abs(best))
    if status == cp_model.OPTIMAL:
        why = "optimal" if gap == 0 else f"optimal within the requested gap of {request.relative_gap:.2%}"
        return _result(data, "OPTIMAL", why, seconds, placement, bound=bound)
    return _result(
        data,
        "FEASIBLE",
        f"time limit of {request.time_limit_s:g} s reached; gap {gap:.3%}",
        seconds,
        placement,
        bound=bound,
    )


# --- the size-only problem ------------------------------------------------------------------------


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
    horizon = domain.horizon_seconds(request)
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
