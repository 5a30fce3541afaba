"""The Unicron strategy's re-plan: the coordinator's request code and the real planner, in
process, over the simulated cluster.

What runs is the production path minus the RPC hops: the simulated jobs and nodes become
protobuf ``Job`` and ``Node`` messages (each job's spec is ``JobModel.spec``, validated as a
submitted one), ``decide.hit_jobs`` and ``decide.plan_request`` build the request (with each
job's restart, resize and migrate estimates replaced by what the simulator will charge for
them, ``transitions``, unless ``Estimates`` is left out),
``services.planner.server.request_from_proto`` turns it into the planner's domain request,
``solver.plan`` solves it (CP-SAT), ``server.result_to_proto`` and ``decide.plan_changes`` turn
the answer into per-job changes. Nothing of the policy is reimplemented here; this module only
maps nodes.

Node groups (``group_nodes``, on by default). Every simulated job holds whole nodes (TP 8 fills
a node; ``model``), so the planner's answer depends on a node only through which job holds it
and whether it is healthy. The request therefore names one *group* node per set of
interchangeable nodes: each job's healthy nodes (``<job>@own``), the free healthy nodes
(``free``), each unhealthy node a job still holds (by itself, so the job is seen hit), and the
other unhealthy nodes (``down``). A group of k nodes has 8k slots. This is exact, not an
approximation: whole TP groups of 8 fit in a group exactly as in its k nodes; a job placed only
on its own group keeps a subset of its nodes (the planner's "resize"), one placed on any other
group gains nodes it did not hold ("migrate"); and the failure rate handed to the planner is
scaled by (healthy nodes / healthy groups) so that its horizon D_run = 1 / (rate x healthy
nodes) is the cluster's. ``tests/unit/test_sim_strategies.py`` checks that grouped and per-node
requests give the same plans. It is what makes a re-plan of a 12,500-node cluster
cost milliseconds instead of about a second (the planner builds variables per node a job holds).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from services.coordinator import decide
from services.coordinator import state as job_state
from services.planner import server as planner_server
from services.planner import solver
from unicron.v1 import common_pb2 as pb
from unicron.v1 import planner_service_pb2
from unicron_sim.engine import JobRun, Sim
from unicron_sim.model import GPUS_PER_NODE, JobModel

SOLVED = (planner_service_pb2.SOLVE_STATUS_OPTIMAL, planner_service_pb2.SOLVE_STATUS_FEASIBLE)


@dataclass(frozen=True)
class Move:
    """One job's change: its nodes from now, the seconds its transition takes, and what the
    planner calls it (``start``, ``move``, ``pause``; transition ``resize``, ``migrate``...)."""

    job: JobRun
    nodes: list[int]
    transition_s: float
    kind: str
    transition: str
    reason: str = ""


@dataclass
class PlanStats:
    calls: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0
    statuses: dict[str, int] = field(default_factory=dict)
    request_nodes_max: int = 0
    times: list[float] = field(default_factory=list)  # simulated time of every call


@dataclass(frozen=True)
class Estimates:
    """A job's transition estimates for the planner, in seconds: restart in place, resize onto
    nodes it holds, migrate (gain a node)."""

    restart_s: float
    resize_s: float
    migrate_s: float


class Planner:
    """Builds requests from a ``Sim``, solves them with the real planner, maps answers back."""

    def __init__(
        self,
        jobs: Sequence[JobModel],
        failure_rate_per_node_per_s: float,
        estimates: Mapping[str, Estimates] | None = None,
        time_limit_s: float = 1.0,
        group_nodes: bool = True,
        dp_hint: bool = True,
    ) -> None:
        """``estimates`` by job id; None leaves the coordinator's own in the request."""
        self.specs = {m.job_id: m.spec() for m in jobs}
        self.estimates = dict(estimates) if estimates is not None else None
        self.dp_hint = dp_hint
        self.rate = failure_rate_per_node_per_s
        self.time_limit_s = time_limit_s
        self.group_nodes = group_nodes
        self.stats = PlanStats()

    def _groups(self, sim: Sim) -> tuple[dict[str, list[int]], dict[str, int], dict[str, bool]]:
        """Request node id -> physical nodes, its holder (job index or -1), healthy."""
        members: dict[str, list[int]] = {}
        holder: dict[str, int] = {}
        healthy: dict[str, bool] = {}

        for job in sim.jobs:
            own = [n for n in job.nodes if not sim.down[n]]
            if self.group_nodes and own:
                members[f"{job.job_id}@own"] = own
                holder[f"{job.job_id}@own"], healthy[f"{job.job_id}@own"] = job.index, True
            for n in job.nodes if not self.group_nodes else [n for n in job.nodes if sim.down[n]]:
                members[f"n{n}"], holder[f"n{n}"], healthy[f"n{n}"] = [n], job.index, not sim.down[n]
        for ok, name in ((True, "free"), (False, "down")):
            rest = [n for n in range(sim.cluster.nodes) if sim.owner[n] < 0 and sim.down[n] != ok]
            if self.group_nodes and rest:
                members[name], holder[name], healthy[name] = rest, -1, ok
            elif rest:
                for n in rest:
                    members[f"n{n}"], holder[f"n{n}"], healthy[f"n{n}"] = [n], -1, ok
        return members, holder, healthy

    def plan(self, sim: Sim) -> list[Move] | None:
        """Every job's change by a new plan; None when the planner found none (the
        coordinator then keeps the current plan and asks again later)."""
        members, holder, healthy = self._groups(sim)
        nodes = [
            pb.Node(
                node_id=name,
                slots=GPUS_PER_NODE * len(group),
                state=pb.NODE_STATE_READY if healthy[name] else pb.NODE_STATE_ISOLATED,
            )
            for name, group in members.items()
        ]
        held: dict[int, list[str]] = {}
        for name, index in holder.items():
            if index >= 0:
                held.setdefault(index, []).append(name)
        jobs: list[pb.Job] = []
        for run in sim.jobs:
            job = pb.Job(job_id=run.job_id, state=job_state.RUNNING if run.nodes else job_state.PENDING)
            job.spec.CopyFrom(self.specs[run.job_id])
            rank = 0
            for name in held.get(run.index, []):
                slots = GPUS_PER_NODE * len(members[name])
                job.assignment.workers.add(node_id=name, ranks=range(rank, rank + slots))
                rank += slots
            jobs.append(job)
        healthy_nodes = sum(len(g) for name, g in members.items() if healthy[name])
        healthy_groups = sum(1 for name in members if healthy[name])
        # The planner's horizon is 1 / (rate x healthy request nodes): scale the rate so that
        # it is the cluster's, 1 / (rate x healthy physical nodes).
        rate = self.rate * healthy_nodes / healthy_groups if healthy_groups else self.rate
        hit = decide.hit_jobs(jobs, nodes)
        request = decide.plan_request(jobs, nodes, rate, self.time_limit_s, hit)
        estimates = self.estimates or {}
        for plan_job in request.jobs if estimates else ():
            estimate = estimates[plan_job.job_id]
            plan_job.transition.restart_seconds = estimate.restart_s
            plan_job.transition.resize_seconds = estimate.resize_s
            # The whole migration in migrate_seconds: the estimate already holds the bytes.
            plan_job.transition.migrate_seconds = estimate.migrate_s
            plan_job.transition.state_bytes = 0.0
        if not self.dp_hint:
            # A cap no plan can reach (every job changing is allowed); the planner skips its
            # size-only DP hint when a cap is set (greedy.size_only_targets).
            request.max_changed_jobs = len(request.jobs)
        started = time.perf_counter()
        result = solver.plan(planner_server.request_from_proto(request, planner_server.Limits()))
        reply = planner_server.result_to_proto(result)
        elapsed = time.perf_counter() - started
        stats = self.stats
        stats.calls += 1
        stats.times.append(sim.now)
        stats.seconds += elapsed
        stats.max_seconds = max(stats.max_seconds, elapsed)
        stats.statuses[result.status] = stats.statuses.get(result.status, 0) + 1
        stats.request_nodes_max = max(stats.request_nodes_max, len(nodes))
        if reply.status not in SOLVED:
            return None
        seconds = {p.job_id: p.transition_seconds for p in reply.jobs}
        kinds = {p.job_id: p.transition for p in reply.jobs}
        changes = decide.plan_changes(jobs, reply, hit)
        return self._moves(sim, changes, members, holder, seconds, kinds)

    def _moves(
        self,
        sim: Sim,
        changes: list[decide.Change],
        members: dict[str, list[int]],
        holder: dict[str, int],
        seconds: dict[str, float],
        kinds: dict[str, str],
    ) -> list[Move]:
        by_id = {run.job_id: run for run in sim.jobs}
        changed = {c.job_id: c for c in changes}
        pools: dict[str, list[int]] = {}
        kept: dict[str, list[int]] = {c.job_id: [] for c in changes}
        for name, group in members.items():
            job = holder[name]
            owner = sim.jobs[job].job_id if job >= 0 else ""
            if owner and owner not in changed:
                pools[name] = []  # an unchanged job keeps every node it holds
                continue
            keep = changed[owner].slots.get(name, 0) // GPUS_PER_NODE if owner else 0
            ordered = sorted(group)
            if owner:
                kept[owner].extend(ordered[:keep])
            pools[name] = ordered[keep:]
        moves = []
        for change in changes:
            run = by_id[change.job_id]
            nodes = list(kept[change.job_id])
            for name, slots in change.slots.items():
                if holder[name] == run.index:
                    continue
                count = slots // GPUS_PER_NODE
                nodes.extend(pools[name][:count])
                pools[name] = pools[name][count:]
            moves.append(
                Move(
                    run,
                    sorted(nodes),
                    seconds.get(change.job_id, 0.0),
                    change.kind,
                    kinds.get(change.job_id, ""),
                    change.reason,
                )
            )
        return moves
