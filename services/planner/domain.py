"""The planner's data model and cost model (docs/architecture.md: The cost model), free of any solver or RPC code.

A plan gives every job a size x (GPU slots) and a placement (slots per node). Its value is

    sum_t F(t, x_t) * (D_run - s(x_t) * D_trans(t, kind_t)),    F(t, x) = w(t) * T(t, x)

in weighted FLOPs: what the cluster achieves until the next expected failure (the horizon
D_run), less the work lost while jobs transition. ``score`` computes it for any plan; the solver
maximizes it.

The transition's share s(x) (``Horizon.share``). A transition is paid once, and what it buys
lasts until the job itself is next disrupted, not until the cluster's next failure: another
job's failure re-plans the cluster but leaves this job as it is unless a change pays. A job on
x of the S healthy slots is hit at x/S of the cluster's rate, so its own horizon is
D_run * S / x, and charging its transition over D_run is charging s(x) = x / S of it (at most
1, at least D_run / DEFAULT_HORIZON_S: no job's horizon is taken past a day). Without the
share (the paper's D_run - D_trans) a job on a tenth of a 12,500-node cluster, whose D_run is
30 minutes, prefers shrinking by a replica to a 5-minute move onto a spare, and never grows
back once the node is repaired: every re-plan weighs the move against 30 minutes again.

Transition kinds (``transition_kind``). What a job pays follows from its current and new
placement alone:

  paused        the new placement is empty: F = 0, nothing is earned or paid;
  none          kept exactly as it is and not hit by the failure;
  "restart"     kept exactly as it is but hit: the job restarts in place;
  "resize"      changed, but every node it will use already holds it (a shrink onto the nodes
                it has left, a regrowth there, a reshuffle among its own nodes);
  "migrate"     it gains a node it did not use: a move, a growth onto new nodes, or a start
                (a stopped job has no nodes, so every node is new).

``Transition.seconds(kind)`` gives D_trans. The kinds nest (a resize can always be done the
migrate way, a restart the resize way), so each costs at most what a more general kind costs:
seconds("restart") = min(restart, resize, migrate), seconds("resize") = min(resize, migrate).
The solver relies on that order; it makes "keep" never worse than "resize", nor "resize" than
"migrate", for the same size.

Size-only objective (the paper's problem, no placement; ``size_only_value``). The cluster is a
pool of the healthy nodes' slots; a job picks a size x from ``allowed_sizes`` or 0 (pause, if
preemptible), a pinned job keeps its current size, and the sizes must fit in the pool. A job's
value at x is F(t, x) * (D_run - s(x) * D_trans) with the kind taken from sizes alone: paused at 0;
none (kept) or restart (kept but hit) when x is the current size and the placement can be
reused in place (``placement_blocker`` is None); resize when 0 < x <= the slots it holds on its
healthy nodes in whole TP groups (it can shrink there); migrate otherwise. The changed-jobs cap
does not apply. ``dp.plan_sizes_dp`` (the paper's dynamic program) and ``solver.plan_sizes``
(CP-SAT) both optimize exactly this, so their optima must agree.

Errors. Every check raises ``FieldError`` (a ValueError) naming the field. Objects check their
own fields when built, naming them relative to themselves (``Job('a').weight``); wrap the
construction in ``field_scope('request.jobs[2]')`` to name it ``request.jobs[2].weight``.
``validate`` checks the request as a whole and names full paths (``request.jobs[3].current['n7']``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from services.planner import teams
from services.planner.estimate import DEFAULT_MFU as DEFAULT_MFU
from services.planner.estimate import ESTIMATED_FLOPS_PER_SLOT as ESTIMATED_FLOPS_PER_SLOT
from services.planner.estimate import GPU_PEAK_FLOPS as GPU_PEAK_FLOPS
from services.planner.estimate import ThroughputEstimate as ThroughputEstimate
from services.planner.estimate import modelled_flops
from services.planner.fields import FieldError as FieldError  # the planner's error, as callers name it
from services.planner.fields import check_bool, check_float, check_id, check_int, fail
from services.planner.fields import field_scope as field_scope
from unicron import hsdp

# Horizon used when no failures are expected (rate 0) or no node is healthy: one day. Any long
# horizon makes transition costs small next to running time, which is what a zero rate means.
DEFAULT_HORIZON_S = 86_400.0

STATUSES = ("OPTIMAL", "FEASIBLE", "INFEASIBLE", "UNKNOWN")

TransitionKind = Literal["restart", "resize", "migrate"]
TRANSITION_KINDS: tuple[TransitionKind, ...] = ("restart", "resize", "migrate")

PlanSlots = Mapping[str, Mapping[str, int]]
"""A plan as plain data: job_id -> node_id -> slots. A missing job or an empty map is paused."""


@dataclass(frozen=True)
class Node:
    """A node as the planner sees it. ``failure_domain`` is carried but not used yet. A
    ``drained`` node (taken out by an operator) is not healthy either; it only changes the
    words of a reason."""

    node_id: str
    slots: int
    healthy: bool = True
    failure_domain: str = ""
    drained: bool = False

    def __post_init__(self) -> None:
        where = f"Node({self.node_id!r})"
        check_id(where, "node_id", self.node_id)
        check_int(where, "slots", self.slots, 0)
        check_bool(where, "healthy", self.healthy)
        check_bool(where, "drained", self.drained)
        if not isinstance(self.failure_domain, str):
            fail(where, "failure_domain", f"must be a string, got {self.failure_domain!r}")


@dataclass(frozen=True)
class Transition:
    """Seconds a job loses when its placement changes, by kind (see the module docstring).

    ``restart_s``: restart in place (same nodes, same size), what a job hit by the failure pays
    if it keeps its placement. ``resize_s``: the size or placement changes but every node it will
    use already holds it. ``migrate_s`` + ``state_bytes`` / ``bandwidth_bytes_per_s``: it gains a
    node it did not use (or starts), which must fetch the parameter and optimizer state."""

    restart_s: float = 30.0
    resize_s: float = 45.0
    migrate_s: float = 60.0
    state_bytes: float = 0.0
    bandwidth_bytes_per_s: float = 1.25e9

    def __post_init__(self) -> None:
        for name in ("restart_s", "resize_s", "migrate_s", "state_bytes"):
            check_float("Transition", name, getattr(self, name))
        check_float("Transition", "bandwidth_bytes_per_s", self.bandwidth_bytes_per_s, positive=True)

    def seconds(self, kind: str) -> float:
        """D_trans for ``kind`` ("restart", "resize", "migrate"): the cheapest of that kind and
        the more general ones, since a general mechanism can do a special change."""
        migrate = self.migrate_s + self.state_bytes / self.bandwidth_bytes_per_s
        if kind == "migrate":
            return migrate
        if kind == "resize":
            return min(self.resize_s, migrate)
        if kind == "restart":
            return min(self.restart_s, self.resize_s, migrate)
        raise ValueError(f"unknown transition kind {kind!r}; expected one of {TRANSITION_KINDS}")


@dataclass(frozen=True)
class Job:
    """A job as the planner sees it.

    ``throughput`` maps size (slots) to achieved FLOP/s and also lists the sizes the job may run
    at: a size the parallelism allows but the profile omits (say a DP degree that does not divide
    the global batch) is not allowed. Without a profile every size the parallelism allows is, at
    ``estimate``'s FLOP/s when given, else at ``ESTIMATED_FLOPS_PER_SLOT`` per slot; a profile
    wins over an estimate. ``measured`` (size -> FLOP/s the job achieved there) calibrates an
    estimate (``estimate.modelled_flops``); a profile wins over it too. ``current`` is node_id
    -> slots held now; empty when the job is not running. It may name unhealthy nodes: that
    is how a lost node shows up."""

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
    transition: Transition = field(default_factory=Transition)
    estimate: ThroughputEstimate | None = None
    measured: Mapping[int, float] = field(default_factory=dict)
    # HSDP's shard degree: a DP degree above it is a multiple of it (unicron/hsdp.py); 0: any.
    shard_degree: int = 0
    # The team whose slot limit the job counts against (PlanRequest.team_limits); "": none.
    team: str = ""

    def __post_init__(self) -> None:
        where = f"Job({self.job_id!r})"
        check_id(where, "job_id", self.job_id)
        check_float(where, "weight", self.weight, positive=True)
        for name in ("tensor_parallel", "pipeline_parallel", "min_dp", "max_dp"):
            check_int(where, name, getattr(self, name), 1)
        if self.min_dp > self.max_dp:
            fail(where, "min_dp", f"{self.min_dp} exceeds max_dp {self.max_dp}")
        check_int(where, "shard_degree", self.shard_degree, 0)
        if not isinstance(self.team, str):
            fail(where, "team", f"must be a string, got {self.team!r}")
        if not _parallel_sizes(self):
            fail(where, "shard_degree", f"{self.shard_degree} leaves no DP degree in {self.min_dp}..{self.max_dp}")
        for name in ("hit_by_failure", "preemptible", "pinned"):
            check_bool(where, name, getattr(self, name))
        if not isinstance(self.transition, Transition):
            fail(where, "transition", f"must be a Transition, got {self.transition!r}")
        if self.estimate is not None and not isinstance(self.estimate, ThroughputEstimate):
            fail(where, "estimate", f"must be None or a ThroughputEstimate, got {self.estimate!r}")
        if self.throughput is not None:
            if not isinstance(self.throughput, Mapping) or not self.throughput:
                fail(where, "throughput", "must be None or a non-empty mapping size -> FLOP/s")
            sizes = set(_parallel_sizes(self))
            for size, flops in self.throughput.items():
                check_int(where, f"throughput[{size!r}] (key)", size, 1)
                if size not in sizes:
                    fail(where, f"throughput[{size}]", "size is not TP*PP*DP with DP in [min_dp, max_dp] (HSDP-fit)")
                check_float(where, f"throughput[{size}]", flops, positive=True)
            # A private copy: the caller's dict must not change a frozen job behind our back.
            object.__setattr__(self, "throughput", dict(self.throughput))
        for size, flops in self.measured.items():
            check_int(where, f"measured[{size!r}] (key)", size, 1)
            check_float(where, f"measured[{size}]", flops, positive=True)
        object.__setattr__(self, "measured", dict(self.measured))
        if not isinstance(self.current, Mapping):
            fail(where, "current", f"must be a mapping node_id -> slots, got {self.current!r}")
        for node_id, slots in self.current.items():
            check_id(where, "current (key)", node_id)
            check_int(where, f"current[{node_id!r}]", slots, 1)
        object.__setattr__(self, "current", dict(self.current))

    @property
    def current_size(self) -> int:
        return sum(self.current.values())


@dataclass(frozen=True)
class PlanRequest:
    """Everything one plan depends on. Field-level checks run here; cross-object checks (ids,
    node references, capacities) in ``validate``, which ``solver.plan`` calls.

    ``max_changed_jobs`` caps the jobs changed by choice; jobs that must change anyway (hit by
    the failure, or with a current placement that cannot be reused) are exempt
    (``forced_change``). ``relative_gap`` ends the search once the plan is proven within that
    fraction of the best possible objective (status OPTIMAL; ``PlanResult.gap`` says how close it
    really is). The default, 0.1%, is far below the error of the throughput and transition
    estimates behind the objective; 0 asks for a proof of optimality, which on a large cluster
    can take seconds more for the last hundredths of a percent. ``seed`` and
    ``workers`` go to CP-SAT; one worker and a fixed seed give repeatable plans unless the time
    limit cuts the search short."""

    nodes: tuple[Node, ...]
    jobs: tuple[Job, ...]
    failure_rate_per_node_per_s: float
    time_limit_s: float = 2.0
    max_changed_jobs: int | None = None
    seed: int = 0
    workers: int = 1
    relative_gap: float = 1e-3
    team_limits: Mapping[str, int] = field(default_factory=dict)
    team_guarantees: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        where = "request"
        for name, kind in (("nodes", Node), ("jobs", Job)):
            items = getattr(self, name)
            if not isinstance(items, Sequence) or isinstance(items, str):
                fail(where, name, f"must be a sequence of {kind.__name__}")
            for i, item in enumerate(items):
                if not isinstance(item, kind):
                    fail(where, f"{name}[{i}]", f"must be a {kind.__name__}, got {item!r}")
            object.__setattr__(self, name, tuple(items))
        check_float(where, "failure_rate_per_node_per_s", self.failure_rate_per_node_per_s)
        check_float(where, "time_limit_s", self.time_limit_s, positive=True)
        if self.max_changed_jobs is not None:
            check_int(where, "max_changed_jobs", self.max_changed_jobs, 0)
        check_int(where, "seed", self.seed, 0)
        if self.seed >= 2**31:
            fail(where, "seed", f"must be below 2**31 (CP-SAT's seed is a 32-bit int), got {self.seed}")
        check_int(where, "workers", self.workers, 1)
        check_float(where, "relative_gap", self.relative_gap)
        if self.relative_gap >= 1:
            fail(where, "relative_gap", f"must be below 1, got {self.relative_gap!r}")
        for name in ("team_limits", "team_guarantees"):
            object.__setattr__(self, name, teams.checked(where, name, getattr(self, name)))


@dataclass(frozen=True)
class JobPlan:
    """One job's outcome. ``slots_by_node`` holds only nodes with slots; empty when paused.
    ``transition`` is the kind paid ("restart", "resize", "migrate"; "" when none: kept, or
    paused) and ``transition_s`` its seconds."""

    job_id: str
    slots_by_node: dict[str, int]
    size: int
    changed: bool
    reason: str
    transition: str = ""
    transition_s: float = 0.0

    def __post_init__(self) -> None:
        where = f"JobPlan({self.job_id!r})"
        check_id(where, "job_id", self.job_id)
        if sum(self.slots_by_node.values()) != self.size:
            fail(where, "size", f"{self.size} differs from the sum of slots_by_node")


@dataclass(frozen=True)
class PlanResult:
    """The solver's answer. ``status`` is OPTIMAL when the plan is proven within the request's
    ``relative_gap`` of the best (``gap`` 0 when proven best), FEASIBLE when the time limit cut
    the search first. ``objective`` is ``score`` of the returned plan (exact, unscaled);
    ``bound`` (an upper bound on the objective) and ``gap`` ((bound - objective) / |bound|) come
    from the solver and are +inf when no bound is known. ``jobs`` holds one plan per request job,
    in request order, when a plan was found (OPTIMAL, FEASIBLE) and is empty otherwise; then
    ``objective`` is 0 and ``reason`` says why (for INFEASIBLE: which constraint)."""

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
            fail("PlanResult", "status", f"must be one of {STATUSES}, got {self.status!r}")
        object.__setattr__(self, "jobs", tuple(self.jobs))


def _parallel_sizes(job: Job) -> list[int]:
    unit = job.tensor_parallel * job.pipeline_parallel
    return [unit * dp for dp in range(job.min_dp, job.max_dp + 1) if hsdp.fits(dp, job.shard_degree)]


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
    elif (
        x % (job.tensor_parallel * job.pipeline_parallel) == 0
        and job.min_dp <= x // (job.tensor_parallel * job.pipeline_parallel) <= job.max_dp
    ):
        return modelled_flops(job.estimate, job.tensor_parallel, job.pipeline_parallel, x, job.measured)
    raise ValueError(f"Job({job.job_id!r}): size {x} is not allowed {allowed_sizes(job)}")


def weighted_throughput(job: Job, x: int) -> float:
    """F(t, x) = w(t) * T(t, x)."""
    return job.weight * throughput(job, x)


@dataclass(frozen=True)
class Horizon:
    """D_run in seconds and the healthy slots S that a job's transition share is of (module
    docstring): what every value of a plan is computed over."""

    seconds: float
    healthy_slots: int

    def share(self, x: int) -> float:
        """s(x): the part of its transition a job at size ``x`` is charged over D_run."""
        if self.healthy_slots <= 0:
            return 1.0
        return min(1.0, max(x / self.healthy_slots, self.seconds / DEFAULT_HORIZON_S))

    def value(self, f: float, x: int, transition_s: float) -> float:
        """F * (D_run - s(x) * D_trans): one job's term at weighted throughput ``f``."""
        return f * (self.seconds - self.share(x) * transition_s)


def horizon_of(request: PlanRequest) -> Horizon:
    return Horizon(horizon_seconds(request), healthy_slots(request))


def horizon_seconds(request: PlanRequest) -> float:
    """D_run = 1 / (rate * healthy nodes); ``DEFAULT_HORIZON_S`` when that is not finite."""
    healthy = sum(1 for node in request.nodes if node.healthy)
    if request.failure_rate_per_node_per_s == 0 or healthy == 0:
        return DEFAULT_HORIZON_S
    return 1.0 / (request.failure_rate_per_node_per_s * healthy)


def validate(request: PlanRequest) -> None:
    """Cross-object checks, each a FieldError naming the path (``request.jobs[2].current['n9']``).

    Current placements must fit the healthy nodes they name, one job and all jobs together. An
    unhealthy node's slot count is not checked: a lost node may report 0 slots while the
    placement still names it."""
    nodes: dict[str, Node] = {}
    for i, node in enumerate(request.nodes):
        if node.node_id in nodes:
            fail("request", f"nodes[{i}].node_id", f"duplicate node id {node.node_id!r}")
        nodes[node.node_id] = node
    job_ids: set[str] = set()
    used = dict.fromkeys(nodes, 0)
    for i, job in enumerate(request.jobs):
        if job.job_id in job_ids:
            fail("request", f"jobs[{i}].job_id", f"duplicate job id {job.job_id!r}")
        job_ids.add(job.job_id)
        for node_id, slots in job.current.items():
            where = f"jobs[{i}].current[{node_id!r}]"
            if node_id not in nodes:
                fail("request", where, f"unknown node {node_id!r}")
            node = nodes[node_id]
            if node.healthy and slots > node.slots:
                fail("request", where, f"{slots} slots on node {node_id!r}, which has {node.slots}")
            used[node_id] += slots
            if node.healthy and used[node_id] > node.slots:
                fail("request", where, f"jobs hold {used[node_id]} slots on node {node_id!r}, which has {node.slots}")
    _check_finite_values(request)


def _check_finite_values(request: PlanRequest) -> None:
    """Every term of the objective must be a finite number: each input may be finite while
    their product (weight x throughput x horizon) or a transition (state bytes / bandwidth)
    is not, and the solver cannot scale an infinite or NaN coefficient."""
    horizon = horizon_seconds(request)
    for i, job in enumerate(request.jobs):
        longest = horizon
        for kind in ("restart", "resize", "migrate"):
            seconds = job.transition.seconds(kind)
            if not math.isfinite(seconds):
                fail("request", f"jobs[{i}].transition", f"a {kind} takes {seconds} seconds, not a finite number")
            longest = max(longest, seconds)
        for x in allowed_sizes(job):
            value = weighted_throughput(job, x)
            if not math.isfinite(value * longest):
                fail(
                    "request",
                    f"jobs[{i}]",
                    f"weight x throughput at {x} slots ({value}) over {longest:g} s is not a finite number",
                )


def placement_blocker(job: Job, nodes: Mapping[str, Node]) -> str | None:
    """Why the job's current placement cannot be reused as it is (None when it can): not
    running, a lost node, a TP group split across nodes, or a size no longer allowed."""
    if not job.current:
        return "not running"
    lost = sorted(n for n in job.current if not nodes[n].healthy)
    if lost:
        return f"{'node' if len(lost) == 1 else 'nodes'} {', '.join(lost)} lost"
    for node_id, slots in sorted(job.current.items()):
        if slots > nodes[node_id].slots:  # only reachable without ``validate``
            return f"node {node_id} has {nodes[node_id].slots} slots, job holds {slots}"
        if slots % job.tensor_parallel:
            return f"{slots} slots on node {node_id} split a TP group of {job.tensor_parallel}"
    if job.current_size not in allowed_sizes(job):
        return f"size {job.current_size} is not allowed"
    return None


def keep_blocker(job: Job, nodes: Mapping[str, Node]) -> str | None:
    """Why the job cannot keep its current placement unchanged (None when it can): as
    ``placement_blocker``, and a job hit by the failure restarts even if it lands in place."""
    if job.hit_by_failure and job.current:
        return "hit by failure"
    return placement_blocker(job, nodes)


def forced_change(job: Job, nodes: Mapping[str, Node]) -> bool:
    """A running job that must change whatever the plan does; it is exempt from the cap."""
    return bool(job.current) and keep_blocker(job, nodes) is not None


def is_changed(job: Job, slots: Mapping[str, int]) -> bool:
    """Whether the job's placement changes (or it restarts); what the changed-jobs cap counts.
    Pausing a running job is a change; a paused job that stays paused is not."""
    new = {n: s for n, s in slots.items() if s}
    if job.hit_by_failure and new:
        return True
    return new != dict(job.current)


def transition_kind(job: Job, slots: Mapping[str, int]) -> TransitionKind | None:
    """The kind of transition the job pays under this placement; None when it pays nothing
    (kept and not hit, or paused). See the module docstring."""
    new = {n: s for n, s in slots.items() if s}
    if not new:
        return None
    if new == dict(job.current):
        return "restart" if job.hit_by_failure else None
    if all(n in job.current for n in new):
        return "resize"
    return "migrate"


def transition_seconds(job: Job, kind: str | None) -> float:
    return 0.0 if kind is None else job.transition.seconds(kind)


def job_value(job: Job, slots: Mapping[str, int], horizon: Horizon) -> float:
    """One job's term of the objective, in weighted FLOPs: F * (D_run - s(x) * D_trans)."""
    x = sum(slots.values())
    return horizon.value(weighted_throughput(job, x), x, transition_seconds(job, transition_kind(job, slots)))


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
    sizes = {job.job_id: sum(plan_slots.get(job.job_id, {}).values()) for job in request.jobs}
    problems += teams.over_limits(request, sizes)
    problems += teams.over_guarantees(request, sizes, healthy_slots(request))
    return problems


def score(request: PlanRequest, plan_slots: PlanSlots) -> float:
    """The objective of a given plan (jobs absent from it are paused); ValueError if invalid."""
    validate(request)
    problems = plan_problems(request, plan_slots)
    if problems:
        raise ValueError("invalid plan: " + "; ".join(problems))
    horizon = horizon_of(request)
    return sum(job_value(job, plan_slots.get(job.job_id, {}), horizon) for job in request.jobs)


# --- the size-only problem (no placement) ------------------------------------------------------


def healthy_slots(request: PlanRequest) -> int:
    """The size-only pool: every slot of every healthy node."""
    return sum(node.slots for node in request.nodes if node.healthy)


def _held_in_place(job: Job, nodes: Mapping[str, Node]) -> int:
    """Slots the job holds on its healthy nodes, in whole TP groups: what it can shrink onto."""
    tp = job.tensor_parallel
    return sum(min(s, nodes[n].slots) // tp * tp for n, s in job.current.items() if nodes[n].healthy)


def size_only_kind(job: Job, x: int, nodes: Mapping[str, Node]) -> TransitionKind | None:
    """The transition a job pays at size ``x`` in the size-only problem (module docstring)."""
    if x == 0:
        return None
    if x == job.current_size and placement_blocker(job, nodes) is None:
        return "restart" if job.hit_by_failure else None
    if x <= _held_in_place(job, nodes):
        return "resize"
    return "migrate"


def size_only_value(job: Job, x: int, nodes: Mapping[str, Node], horizon: Horizon) -> float:
    return horizon.value(weighted_throughput(job, x), x, transition_seconds(job, size_only_kind(job, x, nodes)))


def size_options(job: Job, nodes: Mapping[str, Node], horizon: Horizon) -> dict[int, float]:
    """The sizes the job may take in the size-only problem, each with its value; 0 is pausing.
    Empty when none is possible (pinned at a size it may not run at and may not leave)."""
    if job.pinned:
        x = job.current_size
        if x and x not in allowed_sizes(job):
            return {}
        if x == 0 and not job.preemptible:
            return {}
        return {x: size_only_value(job, x, nodes, horizon)}
    options = {0: 0.0} if job.preemptible else {}
    options.update({x: size_only_value(job, x, nodes, horizon) for x in allowed_sizes(job)})
    return options


def size_only_score(request: PlanRequest, sizes: Mapping[str, int]) -> float:
    """The size-only objective of the given sizes (absent jobs paused); ValueError if invalid."""
    validate(request)
    nodes = {node.node_id: node for node in request.nodes}
    horizon = horizon_of(request)
    total, used = 0.0, 0
    for job in request.jobs:
        x = sizes.get(job.job_id, 0)
        options = size_options(job, nodes, horizon)
        if x not in options:
            raise ValueError(f"job {job.job_id!r}: size {x} is not among {sorted(options)}")
        total += options[x]
        used += x
    if used > healthy_slots(request):
        raise ValueError(f"sizes use {used} slots, healthy nodes hold {healthy_slots(request)}")
    over = teams.over_limits(request, sizes) + teams.over_guarantees(request, sizes, healthy_slots(request))
    if over:
        raise ValueError(over[0])
    return total
