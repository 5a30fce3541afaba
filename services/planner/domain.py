"""The planner's data model and cost model (DESIGN.md section 3), free of any solver or RPC code.

A plan gives every job a size x (GPU slots) and a placement (slots per node). Its value is

    sum_t F(t, x_t) * D_run - [changed_t] * F(t, x_t) * D_trans(t),    F(t, x) = w(t) * T(t, x)

in weighted FLOPs: what the cluster achieves until the next expected failure, less the work lost
while changed jobs transition. ``score`` computes it for any plan; the solver maximizes it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# Horizon used when no failures are expected (rate 0) or no node is healthy: one day. Any long
# horizon makes transition costs small next to running time, which is what a zero rate means.
DEFAULT_HORIZON_S = 86_400.0

# Throughput assumed per slot when a job has no measured profile: 100 TFLOP/s, a rough achieved
# bf16 rate on A100/H100-class GPUs. Only its ratio to measured profiles matters, and only when
# estimated and measured jobs compete for the same slots.
ESTIMATED_FLOPS_PER_SLOT = 1.0e14

STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN")

PlanSlots = Mapping[str, Mapping[str, int]]
"""A plan as plain data: job_id -> node_id -> slots. A missing job or an empty map is paused."""


def _fail(where: str, name: str, message: str) -> None:
    raise ValueError(f"{where}.{name}: {message}")


def _check_id(where: str, name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        _fail(where, name, f"must be a non-empty string, got {value!r}")


def _check_int(where: str, name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; True as a slot count is always a caller bug.
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(where, name, f"must be an int >= {minimum}, got {value!r}")


def _check_float(where: str, name: str, value: object, *, positive: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and (value > 0 if positive else value >= 0):  # type: ignore[operator]
        return
    _fail(where, name, f"must be a finite number {'>' if positive else '>='} 0, got {value!r}")


def _check_bool(where: str, name: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(where, name, f"must be a bool, got {value!r}")


@dataclass(frozen=True)
class Node:
    """A node as the planner sees it. ``failure_domain`` is carried but not used yet."""

    node_id: str
    slots: int
    healthy: bool = True
    failure_domain: str = ""

    def __post_init__(self) -> None:
        where = f"Node({self.node_id!r})"
        _check_id(where, "node_id", self.node_id)
        _check_int(where, "slots", self.slots, 0)
        _check_bool(where, "healthy", self.healthy)
        if not isinstance(self.failure_domain, str):
            _fail(where, "failure_domain", f"must be a string, got {self.failure_domain!r}")


@dataclass(frozen=True)
class Job:
    """A job as the planner sees it.

    ``throughput`` maps size (slots) to achieved FLOP/s and also lists the sizes the job may run
    at: a size the parallelism allows but the profile omits (say a DP degree that does not divide
    the global batch) is not allowed. ``None`` means every size the parallelism allows, at
    ``ESTIMATED_FLOPS_PER_SLOT`` per slot. ``current`` is node_id -> slots held now; empty when
    the job is not running. It may name unhealthy nodes: that is how a lost node shows up.
    """

    job_id: str
    weight: float
    tensor_parallel: int
    pipeline_parallel: int
    min_dp: int
    max_dp: int
    throughput: Mapping[int, float] | None = None
    current: Mapping[str, int] = field(default_factory=dict)
    hit_by_failure: bool = False
    preemptible: bool = True
    pinned: bool = False
    transition_seconds: float = 30.0

    def __post_init__(self) -> None:
        where = f"Job({self.job_id!r})"
        _check_id(where, "job_id", self.job_id)
        _check_float(where, "weight", self.weight, positive=True)
        for name in ("tensor_parallel", "pipeline_parallel", "min_dp", "max_dp"):
            _check_int(where, name, getattr(self, name), 1)
        if self.min_dp > self.max_dp:
            _fail(where, "min_dp", f"{self.min_dp} exceeds max_dp {self.max_dp}")
        for name in ("hit_by_failure", "preemptible", "pinned"):
            _check_bool(where, name, getattr(self, name))
        _check_float(where, "transition_seconds", self.transition_seconds)
        if self.throughput is not None:
            if not isinstance(self.throughput, Mapping) or not self.throughput:
                _fail(where, "throughput", "must be None or a non-empty mapping size -> FLOP/s")
            sizes = set(_parallel_sizes(self))
            for size, flops in self.throughput.items():
                _check_int(where, f"throughput[{size!r}] (key)", size, 1)
                if size not in sizes:
                    _fail(where, f"throughput[{size}]", "size is not TP*PP*DP, DP in [min, max]")
                _check_float(where, f"throughput[{size}]", flops)
            # A private copy: the caller's dict must not change a frozen job behind our back.
            object.__setattr__(self, "throughput", dict(self.throughput))
        if not isinstance(self.current, Mapping):
            _fail(where, "current", f"must be a mapping node_id -> slots, got {self.current!r}")
        for node_id, slots in self.current.items():
            _check_id(where, "current (key)", node_id)
            _check_int(where, f"current[{node_id!r}]", slots, 1)
        object.__setattr__(self, "current", dict(self.current))

    @property
    def current_size(self) -> int:
        return sum(self.current.values())


@dataclass(frozen=True)
class PlanRequest:
    """Everything one plan depends on. Field-level checks run here; cross-object checks (ids,
    node references) in ``validate``, which ``solver.plan`` calls.

    ``max_changed_jobs`` caps the jobs changed by choice; jobs that must change anyway (hit by
    the failure, or with a current placement that no longer fits) are exempt (``forced_change``).
    ``seed`` and ``workers`` go to CP-SAT; one worker and a fixed seed give repeatable plans
    unless the time limit cuts the search short."""

    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    failure_rate_per_node_per_s: float
    time_limit_s: float = 2.0
    max_changed_jobs: int | None = None
    seed: int = 0
    workers: int = 1

    def __post_init__(self) -> None:
        where = "PlanRequest"
        for name, kind in (("nodes", Node), ("jobs", Job)):
            items = getattr(self, name)
            if not isinstance(items, Sequence) or isinstance(items, str):
                _fail(where, name, f"must be a sequence of {kind.__name__}")
            for i, item in enumerate(items):
                if not isinstance(item, kind):
                    _fail(where, f"{name}[{i}]", f"must be a {kind.__name__}, got {item!r}")
            object.__setattr__(self, name, tuple(items))
        _check_float(where, "failure_rate_per_node_per_s", self.failure_rate_per_node_per_s)
        _check_float(where, "time_limit_s", self.time_limit_s, positive=True)
        if self.max_changed_jobs is not None:
            _check_int(where, "max_changed_jobs", self.max_changed_jobs, 0)
        _check_int(where, "seed", self.seed, 0)
        _check_int(where, "workers", self.workers, 1)


@dataclass(frozen=True)
class JobPlan:
    """One job's outcome. ``slots_by_node`` holds only nodes with slots; empty when paused."""

    job_id: str
    slots_by_node: dict[str, int]
    size: int
    changed: bool
    reason: str

    def __post_init__(self) -> None:
        where = f"JobPlan({self.job_id!r})"
        _check_id(where, "job_id", self.job_id)
        if sum(self.slots_by_node.values()) != self.size:
            _fail(where, "size", f"{self.size} differs from the sum of slots_by_node")


@dataclass(frozen=True)
class PlanResult:
    """The solver's answer. ``objective`` is ``score`` of the returned plan (exact, unscaled);
    ``bound`` (an upper bound on the objective) and ``gap`` ((bound - objective) / |bound|) come
    from the solver and are +inf when no bound is known. ``jobs`` holds one plan per request job,
    in request order, when a plan was found (OPTIMAL, FEASIBLE) and is empty otherwise; then
    ``objective`` is 0 and ``reason`` says why."""

    status: str
    objective: float
    bound: float
    gap: float
    solve_seconds: float
    horizon_s: float
    jobs: tuple[JobPlan, ...]
    reason: str

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            _fail("PlanResult", "status", f"must be one of {STATUSES}, got {self.status!r}")
        object.__setattr__(self, "jobs", tuple(self.jobs))


def _parallel_sizes(job: Job) -> list[int]:
    unit = job.tensor_parallel * job.pipeline_parallel
    return [unit * dp for dp in range(job.min_dp, job.max_dp + 1)]


def allowed_sizes(job: Job) -> list[int]:
    """The sizes (slots) the job may run at, ascending; 0 (paused) is not among them."""
    if job.throughput is None:
        return _parallel_sizes(job)
    return sorted(job.throughput)


def throughput(job: Job, x: int) -> float:
    """T(t, x) in FLOP/s; 0 when paused (x = 0). Raises ValueError for a size not allowed."""
    if x == 0:
        return 0.0
    if job.throughput is not None:
        if x in job.throughput:
            return float(job.throughput[x])
    elif x in _parallel_sizes(job):
        return ESTIMATED_FLOPS_PER_SLOT * x
    raise ValueError(f"Job({job.job_id!r}): size {x} is not allowed {allowed_sizes(job)}")


def weighted_throughput(job: Job, x: int) -> float:
    """F(t, x) = w(t) * T(t, x)."""
    return job.weight * throughput(job, x)


def horizon_seconds(request: PlanRequest) -> float:
    """D_run = 1 / (rate * healthy nodes); ``DEFAULT_HORIZON_S`` when that is not finite."""
    healthy = sum(1 for node in request.nodes if node.healthy)
    if request.failure_rate_per_node_per_s == 0 or healthy == 0:
        return DEFAULT_HORIZON_S
    return 1.0 / (request.failure_rate_per_node_per_s * healthy)


def validate(request: PlanRequest) -> None:
    """Cross-object checks, each ValueError naming the field path (``jobs[2].current['n9']``)."""
    node_ids: set[str] = set()
    for i, node in enumerate(request.nodes):
        if node.node_id in node_ids:
            _fail("request", f"nodes[{i}].node_id", f"duplicate node id {node.node_id!r}")
        node_ids.add(node.node_id)
    job_ids: set[str] = set()
    for i, job in enumerate(request.jobs):
        if job.job_id in job_ids:
            _fail("request", f"jobs[{i}].job_id", f"duplicate job id {job.job_id!r}")
        job_ids.add(job.job_id)
        for node_id in job.current:
            if node_id not in node_ids:
                _fail("request", f"jobs[{i}].current[{node_id!r}]", f"unknown node {node_id!r}")


def keep_blocker(job: Job, nodes: Mapping[str, Node]) -> str | None:
    """Why the job cannot keep its current placement unchanged (None when it can).

    A job that is not running, or that was hit by the failure, cannot keep it: the first has
    nothing to keep, the second restarts (and pays its transition) even if it lands in place.
    """
    if not job.current:
        return "not running"
    if job.hit_by_failure:
        return "hit by failure"
    lost = sorted(n for n in job.current if not nodes[n].healthy)
    if lost:
        return f"{'node' if len(lost) == 1 else 'nodes'} {', '.join(lost)} lost"
    for node_id, slots in sorted(job.current.items()):
        if slots > nodes[node_id].slots:
            return f"node {node_id} has {nodes[node_id].slots} slots, job holds {slots}"
        if slots % job.tensor_parallel:
            return f"{slots} slots on node {node_id} split a TP group of {job.tensor_parallel}"
    if job.current_size not in allowed_sizes(job):
        return f"size {job.current_size} is not allowed"
    return None


def forced_change(job: Job, nodes: Mapping[str, Node]) -> bool:
    """A running job that must change whatever the plan does; it is exempt from the cap."""
    return bool(job.current) and keep_blocker(job, nodes) is not None


def is_changed(job: Job, slots: Mapping[str, int]) -> bool:
    """Whether the job transitions under this placement (and so pays D_trans)."""
    new = {n: s for n, s in slots.items() if s}
    if job.hit_by_failure and new:
        return True
    return new != dict(job.current)


def job_value(job: Job, slots: Mapping[str, int], horizon_s: float) -> float:
    """One job's term of the objective, in weighted FLOPs."""
    f = weighted_throughput(job, sum(slots.values()))
    return f * horizon_s - (f * job.transition_seconds if is_changed(job, slots) else 0.0)


def plan_problems(request: PlanRequest, plan_slots: PlanSlots) -> list[str]:
    """Every way the plan breaks the request's constraints; empty for a valid plan."""
    nodes = {node.node_id: node for node in request.nodes}
    jobs = {job.job_id: job for job in request.jobs}
    problems = [f"unknown job {job_id!r}" for job_id in plan_slots if job_id not in jobs]
    used = dict.fromkeys(nodes, 0)
    changed = 0
    for job in request.jobs:
        slots = {n: s for n, s in plan_slots.get(job.job_id, {}).items() if s}
        size = sum(slots.values())
        name = f"job {job.job_id!r}"
        for node_id, count in slots.items():
            if node_id not in nodes:
                problems.append(f"{name}: unknown node {node_id!r}")
                continue
            if count < 0 or count % job.tensor_parallel:
                problems.append(f"{name}: {count} slots on {node_id} are not whole TP groups")
            if not nodes[node_id].healthy:
                problems.append(f"{name}: placed on unhealthy node {node_id}")
            used[node_id] += count
        if size == 0 and not job.preemptible:
            problems.append(f"{name}: not preemptible but paused")
        if size and size not in allowed_sizes(job):
            problems.append(f"{name}: size {size} not in {allowed_sizes(job)}")
        if job.pinned and slots != dict(job.current):
            problems.append(f"{name}: pinned but moved")
        if is_changed(job, slots) and not forced_change(job, nodes):
            changed += 1
    for node_id, count in used.items():
        if count > nodes[node_id].slots:
            problems.append(f"node {node_id}: {count} slots used of {nodes[node_id].slots}")
    if request.max_changed_jobs is not None and changed > request.max_changed_jobs:
        problems.append(f"{changed} jobs changed, cap is {request.max_changed_jobs}")
    return problems


def score(request: PlanRequest, plan_slots: PlanSlots) -> float:
    """The objective of a given plan (jobs absent from it are paused); ValueError if invalid."""
    validate(request)
    problems = plan_problems(request, plan_slots)
    if problems:
        raise ValueError("invalid plan: " + "; ".join(problems))
    horizon = horizon_seconds(request)
    return sum(job_value(job, plan_slots.get(job.job_id, {}), horizon) for job in request.jobs)
