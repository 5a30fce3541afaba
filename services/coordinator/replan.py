"""Re-planning: when to ask the planner (`Schedule`, with its backoff), how a plan's change
for one job becomes that job's write (`change_write`, pure), and the part that asks and
carries the plan out (`Replanner`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.coordinator import decide, incidents, state, transitions
from services.coordinator.context import Context
from services.coordinator.events import EventType, event
from services.coordinator.planner_client import Planner
from services.coordinator.registry import NodeRegistry
from services.coordinator.store import JobMutation, JobWrite
from unicron import incident_trace as trace
from unicron import redisutil
from unicron.errors import Conflict, ResourceExhausted, Unavailable, UnicronError
from unicron.retry import Backoff
from unicron.v1 import common_pb2, planner_service_pb2

log = logging.getLogger(__name__)

# A READY node whose last heartbeat is older than this many intervals takes no new ranks
# (half an interval later than any healthy node's beat can be).
QUIET_AFTER_INTERVALS = 1.5

# Jobs per compare-and-set when a re-plan moves many: few enough that a concurrent write to
# one of them (an acknowledgement, a first iteration) seldom makes the whole batch retry.
CARRY_OUT_BATCH = 16
_SOLVED = (planner_service_pb2.SOLVE_STATUS_OPTIMAL, planner_service_pb2.SOLVE_STATUS_FEASIBLE)


class Schedule:
    """Why the next reconcile step should ask the planner for a new plan ("" = no need),
    and not before when: a backoff after a planner outage or an INFEASIBLE answer. The
    clock is passed in."""

    def __init__(self, backoff_max_s: float) -> None:
        self.reason = ""
        self.not_before = 0.0
        self._backoff_max_s = backoff_max_s
        self._delays: Iterator[float] | None = None

    def want(self, reason: str) -> None:
        """A re-plan at the next step; the first reason given is the one it reports."""
        self.reason = self.reason or reason
        self.not_before = 0.0

    def wanted(self, jobs: list[common_pb2.Job], nodes: list[common_pb2.Node]) -> str:
        """Why to re-plan now, if at all: asked for, or jobs wait or sit on lost nodes."""
        return (
            self.reason
            or ("pending jobs" if any(job.state == state.PENDING for job in jobs) else "")
            or ("jobs on unavailable nodes" if decide.hit_jobs(jobs, nodes) else "")
        )

    def due(self, now: float) -> bool:
        return now >= self.not_before

    def failed(self, why: str, now: float) -> float:
        """The planner gave no plan: ask again later, each time a little later. Returns the delay."""
        if self._delays is None:
            self._delays = Backoff(1.0, self._backoff_max_s, jitter=False).delays()
        delay = next(self._delays)
        self.reason = why
        self.not_before = now + delay
        return delay

    def done(self) -> None:
        self.reason = ""
        self._delays = None


@dataclass(frozen=True)
class StepInputs:
    """What carrying out one job's change needs, resolved before its compare-and-set."""

    now: float
    why: str  # why the re-plan ran
    ack_timeout_s: float
    unreachable: frozenset[str]
    # The job's next assignment (None for a pause), with its rendezvous port.
    assignment: common_pb2.Assignment | None = None
    # Which ranks of a move keep running in place (old rank -> new rank); None: stop and
    # start every rank.
    rank_map: dict[int, int] | None = None


def change_write(job: common_pb2.Job, change: decide.Change, given: StepInputs) -> JobWrite | None:
    """Edits `job` as the plan's change says; None when there is nothing to do (a start
    for a job no longer pending, a move or pause of one no longer running)."""
    now = given.now
    placed = ", ".join(f"{n}:{c}" for n, c in sorted(change.slots.items()))
    if change.kind == "start":
        if job.state != state.PENDING or given.assignment is None:
            return None
        commands = transitions.start(job, given.assignment, now, f"placed on {placed}", given.ack_timeout_s)
        pending = decide.pending_remedy(job)
        if pending is not None and pending.generation == 0:
            pending.generation = given.assignment.generation
        # The planner's reason says why this size: the FLOP/s it judged at each size.
        copies = _copies_lacking(given.assignment)
        state.transition(job, state.SCHEDULED, now, f"placed on {placed}: {change.reason}{copies}")
        return JobWrite(
            [event(job, EventType.JOB_EVENT_TYPE_ASSIGNED, now, f"placed on {placed} ({change.reason}){copies}")],
            commands,
        )
    if job.state not in state.ACTIVE:
        return None
    if change.kind == "pause":
        reason = f"paused by re-plan ({given.why}): {change.reason}"
        commands = transitions.stop(job, now, reason, given.ack_timeout_s, given.unreachable)
        state.transition(job, state.PENDING, now, reason)
        job.replans += 1
        return JobWrite([event(job, EventType.JOB_EVENT_TYPE_REMEDY, now, reason)], commands)
    if given.assignment is None:
        return None
    return _move(job, change, placed, given.assignment, given)


def _copies_lacking(assignment: common_pb2.Assignment) -> str:
    """What the placement cannot give the job's buddy copies, to add to its reason ("" when
    every shard has one, or the job keeps none)."""
    has_gap = any(by < 0 for by in assignment.copy_kept_by)
    return f"; training.replication 2: {assignment.copies}" if has_gap else ""


def _move(
    job: common_pb2.Job, change: decide.Change, placed: str, assignment: common_pb2.Assignment, given: StepInputs
) -> JobWrite:
    now, timeout, unreachable = given.now, given.ack_timeout_s, given.unreachable
    before = sum(decide.slots_by_node(job).values())
    reason = f"{change.transition or 'move'} to {assignment.world_size} ranks ({placed}) by re-plan ({given.why})"
    pending = decide.pending_remedy(job)
    if given.rank_map is not None:
        # The ranks on nodes the job keeps go on in place with their state; only the new
        # assignment's other ranks start, and take the state from a live peer.
        reason += f", keeping ranks {sorted(given.rank_map)} in place"
        incident_id = pending.incident_id if pending is not None else ""
        commands = transitions.reform(job, assignment, given.rank_map, now, reason, timeout, incident_id, unreachable)
    else:
        commands = transitions.stop(job, now, reason, timeout, unreachable)
        commands += transitions.start(job, assignment, now, reason, timeout)
    if pending is not None and pending.generation == 0:
        pending.generation = assignment.generation
        for _, command in commands:
            command.traceparent = pending.traceparent
    else:
        job.replans += 1
    state.transition(job, state.RECOVERING, now, f"{reason}; {change.reason}")
    message = f"{reason}: {before} -> {assignment.world_size} slots; {change.reason}"
    return JobWrite(
        [
            event(job, EventType.JOB_EVENT_TYPE_REMEDY, now, message),
            event(job, EventType.JOB_EVENT_TYPE_ASSIGNED, now, f"placed on {placed}{_copies_lacking(assignment)}"),
        ],
        commands,
    )


class Replanner:
    def __init__(self, ctx: Context, planner: Planner, registry: NodeRegistry) -> None:
        self._ctx = ctx
        self.planner = planner
        self._registry = registry
        self.schedule = Schedule(ctx.settings.replan_backoff_max_s)
        self._oversubscribed: str | None = None  # what was last said of the quotas

    def want(self, reason: str) -> None:
        self.schedule.want(reason)
        self._ctx.wake.set()

    def step(self, jobs: list[common_pb2.Job], nodes: list[common_pb2.Node], now: float) -> None:
        """A reconcile step's re-plan, when one is wanted and due."""
        wanted = self.schedule.wanted(jobs, nodes)
        if wanted and self.schedule.due(now):
            self.replan(wanted, jobs, nodes, now)

    def replan(self, why: str, jobs: list[common_pb2.Job], nodes: list[common_pb2.Node], now: float) -> None:
        """Asks the planner for every job's size and placement and moves the jobs whose
        plan changed. A planner that is down or finds no plan leaves everything as it is
        and is asked again after a backoff."""
        settings = self._ctx.settings
        hit = decide.hit_jobs(jobs, nodes)
        quiet = decide.lost_nodes(
            now, nodes, QUIET_AFTER_INTERVALS * settings.heartbeat_interval_s, self._ctx.started_at
        )
        request = decide.plan_request(
            jobs,
            nodes,
            settings.failure_rate_per_node_per_s,
            settings.plan_time_limit_s,
            hit,
            quiet,
            settings.quotas.limits(),
            settings.quotas.guarantees(),
        )
        self._say_oversubscribed(sum(node.slots for node in request.nodes if node.healthy))
        if not request.jobs or not any(node.healthy for node in request.nodes):
            self.schedule.done()
            return
        asked = time.perf_counter()
        try:
            reply, problem = self._ask(request, why, jobs, hit)
        except Unavailable as exc:
            self._later(why, f"planner unavailable: {exc}", now)
            return
        if reply.status not in _SOLVED:
            status = planner_service_pb2.SolveStatus.Name(reply.status)
            self._later(why, f"planner found no plan ({status}): {reply.reason}", now)
            return
        self.schedule.done()
        if problem:
            why = f"{why}; {problem}"
        by_id = {node.node_id: node for node in nodes}
        read = {job.job_id: job for job in jobs}
        answered = time.perf_counter()
        changes = decide.plan_changes(jobs, reply, hit)
        self._carry_out(changes, by_id, why, now, read)
        self._explain_waiting(jobs, nodes, reply, {change.job_id for change in changes})
        # What a re-plan took, by part: under a burst of lost nodes the time to re-plan is
        # the planner's answer plus one compare-and-set per job changed.
        log.info(
            "re-planned",
            extra={
                "why": why,
                "jobs": len(request.jobs),
                "changes": len(changes),
                "planner_s": round(answered - asked, 3),
                "solve_s": round(reply.solve_seconds, 3),
                "carry_out_s": round(time.perf_counter() - answered, 3),
            },
        )

    def _explain_waiting(
        self,
        jobs: list[common_pb2.Job],
        nodes: list[common_pb2.Node],
        reply: planner_service_pb2.PlanResponse,
        placed: set[str],
    ) -> None:
        """Each job the plan leaves waiting says what it waits for (written only when that
        changed: a re-plan runs on every event, most of which change nothing here)."""
        reasons = {plan.job_id: plan.reason for plan in reply.jobs}
        # The slots the plan gives; a job left waiting holds none of them.
        used: dict[str, int] = {}
        for plan in reply.jobs:
            for node_id, count in plan.slots_by_node.items():
                used[node_id] = used.get(node_id, 0) + count
        for job in jobs:
            if job.state != state.PENDING or job.job_id in placed:
                continue
            reason = decide.waiting_reason(job, nodes, used, reasons.get(job.job_id, ""))
            if reason == job.reason:
                continue

            def mutate(current: common_pb2.Job, reason: str = reason) -> JobWrite | None:
                if current.state != state.PENDING or current.reason == reason:
                    return None
                current.reason = reason
                return JobWrite()

            try:
                self._ctx.store.update_job(job.job_id, mutate)
            except UnicronError as exc:  # the next re-plan says it again
                log.warning("could not record why a job waits", extra={"job_id": job.job_id, "error": str(exc)})

    def _ask(
        self, request: planner_service_pb2.PlanRequest, why: str, jobs: list[common_pb2.Job], hit: set[str]
    ) -> tuple[planner_service_pb2.PlanResponse, str]:
        """The planner's plan, and why the interrupted jobs may pause ("" unless they may)."""
        traceparents = [
            pending.traceparent
            for job in jobs
            if job.job_id in hit and (pending := decide.pending_remedy(job)) is not None and pending.traceparent
        ]
        with trace.child_span(traceparents[0] if traceparents else "", trace.PLAN) as span:
            reply = self.planner.plan(request)
            span.set_attributes(
                {
                    trace.ATTR_SOLVER_STATUS: planner_service_pb2.SolveStatus.Name(reply.status),
                    trace.ATTR_OBJECTIVE: reply.objective,
                    trace.ATTR_SOLVE_SECONDS: reply.solve_seconds,
                    "unicron.plan.jobs": len(request.jobs),
                    "unicron.plan.why": why,
                }
            )
        if reply.status == planner_service_pb2.SOLVE_STATUS_INFEASIBLE and (
            relaxed := decide.hit_jobs_may_pause(request)
        ):
            log.warning("no plan keeps the interrupted jobs running; they may pause", extra={"problem": reply.reason})
            return self.planner.plan(relaxed), reply.reason
        return reply, ""

    def _say_oversubscribed(self, slots: int) -> None:
        """Once per size of the cluster: the teams' guarantees add up to more than it."""
        said = self._ctx.settings.quotas.oversubscribed(slots)
        if said is not None and said != self._oversubscribed:
            log.warning("quotas: %s", said)
        self._oversubscribed = said

    def _later(self, why: str, problem: str, now: float) -> None:
        delay = self.schedule.failed(why, now)
        log.warning("keeping the current plan", extra={"why": why, "problem": problem, "retry_in_s": delay})

    def _carry_out(
        self,
        changes: list[decide.Change],
        nodes: dict[str, common_pb2.Node],
        why: str,
        now: float,
        read: dict[str, common_pb2.Job],
    ) -> None:
        """The plan's changes, CARRY_OUT_BATCH jobs per compare-and-set: under load each
        round trip waits for the interpreter lock, and a burst moves dozens of jobs. A job
        whose step cannot be prepared, or that changed generation or remedy since the
        re-plan read it, is left for the next re-plan."""
        prepared: dict[str, tuple[decide.Change, JobMutation]] = {}
        outcome = _Outcome()
        for change in changes:
            try:
                prepared[change.job_id] = (
                    change,
                    self._prepare(change, nodes, why, now, read.get(change.job_id), outcome),
                )
            except UnicronError as exc:
                self._failed([change.job_id], exc)
        ids = list(prepared)
        for start in range(0, len(ids), CARRY_OUT_BATCH):
            batch = ids[start : start + CARRY_OUT_BATCH]
            try:
                self._ctx.store.update_jobs({job_id: prepared[job_id][1] for job_id in batch})
            except UnicronError as exc:
                self._failed(batch, exc)
                continue
            for job_id in batch:
                change = prepared[job_id][0]
                if job_id in outcome.stale:
                    self._failed([job_id], Conflict(f"job {job_id} changed while its plan step was prepared"))
                elif job_id in outcome.wrote:
                    log.info(
                        "plan carried out",
                        extra={
                            "job_id": job_id,
                            "change": change.kind,
                            "slots": change.slots,
                            "why": why,
                            "reason": change.reason,
                        },
                    )

    def _failed(self, job_ids: list[str], exc: UnicronError) -> None:
        log.warning("plan step failed", extra={"job_id": ",".join(job_ids), "error": str(exc)})
        self.want(f"retry after: {exc}")

    def _prepare(
        self,
        change: decide.Change,
        nodes: dict[str, common_pb2.Node],
        why: str,
        now: float,
        job: common_pb2.Job | None,
        outcome: _Outcome,
    ) -> JobMutation:
        """One job's change as a compare-and-set mutation. Ports and the ranks kept are
        resolved first, from `job` as the re-plan read it (else as read now); the mutation
        writes nothing, and counts the job in `outcome.stale`, if the job changed since."""
        settings = self._ctx.settings
        # From the replan's own view of the nodes: listing a thousand nodes again for each
        # job placed made placing a hundred jobs take seconds of CPU.
        unreachable = frozenset(node_id for node_id, node in nodes.items() if node.state == common_pb2.NODE_STATE_LOST)
        if job is None:
            job = self._ctx.store.get_job(change.job_id)
        assignment = rank_map = None
        if change.kind != "pause":
            assignment = self.new_assignment(job, change.slots, nodes)
            if change.kind == "move" and settings.reform_restarts:
                rank_map = self._reform_map(job, assignment, nodes, unreachable)
        given = StepInputs(now, why, settings.ack_timeout_s, unreachable, assignment, rank_map)
        basis = _basis(job)

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            # A retried compare-and-set judges again.
            outcome.stale.discard(current.job_id)
            outcome.wrote.discard(current.job_id)
            if _basis(current) != basis:
                outcome.stale.add(current.job_id)
                return None
            out = change_write(current, change, given)
            if out is not None:
                outcome.wrote.add(current.job_id)
            return out

        return mutate

    def _reform_map(
        self,
        job: common_pb2.Job,
        assignment: common_pb2.Assignment,
        nodes: dict[str, common_pb2.Node],
        unreachable: frozenset[str],
    ) -> dict[int, int] | None:
        """Which ranks a re-plan's move keeps in place (see decide.survivor_map and
        decide.live_map); None to restart the job the classic way."""
        if decide.pending_remedy(job) is None:
            return decide.live_map(job, assignment)
        # The job's ranks may have reported into more than one incident (a node's own, the
        # network errors of its peers): any open one of this generation tells who waits and
        # who is gone.
        waiting: set[int] = set()
        gone: set[int] = set()
        lost: set[str] = set()
        for incident in self._ctx.store.list_incidents(job.job_id, limit=20):
            if incident.generation == job.assignment.generation and not incident.HasField("resumed"):
                more_waiting, more_gone = incidents.waiting_and_gone(incident)
                waiting |= more_waiting
                gone |= more_gone
                lost |= incidents.lost_nodes(incident)
        # Ranks on a node taken out of service are gone (stopped, if not dead already), and
        # so are those on a node lost meanwhile, even if its agent is back.
        for worker in job.assignment.workers:
            node = nodes.get(worker.node_id)
            if node is None or node.state != common_pb2.NODE_STATE_READY or worker.node_id in lost:
                gone.update(worker.ranks)
        return decide.survivor_map(job, assignment, waiting - gone, gone, unreachable)

    def new_assignment(
        self,
        job: common_pb2.Job,
        slots: dict[str, int],
        nodes: dict[str, common_pb2.Node] | None = None,
    ) -> common_pb2.Assignment:
        """The job's next assignment on these slots, with a rendezvous port of its own."""
        if nodes is None:
            nodes = {node.node_id: node for node in self._registry.nodes()}
        assignment = decide.assignment_for(job.spec, slots, nodes, job.assignment.generation + 1, job.assignment)
        assignment.assigned.FromNanoseconds(int(self._ctx.clock() * 1e9))
        assignment.master_port = self.rendezvous_port(assignment.master_addr, job.assignment.master_port)
        return assignment

    def rendezvous_port(self, master_addr: str, leaving: int) -> int:
        """A free port where the coordinator can bind the rank-0 address itself (one machine);
        otherwise one of decide.RENDEZVOUS_PORTS that no other job uses on that host."""
        try:
            return redisutil.free_port(master_addr or "127.0.0.1")
        except OSError:
            pass  # not an address of this host
        port = decide.unused_rendezvous_port(master_addr, self._ctx.store.list_jobs(), exclude=leaving)
        if port is None:
            raise ResourceExhausted(f"no free rendezvous port left on {master_addr}")
        return port


@dataclass
class _Outcome:
    """What a re-plan's compare-and-sets did, per job id."""

    wrote: set[str] = field(default_factory=set)
    stale: set[str] = field(default_factory=set)


def _basis(job: common_pb2.Job) -> tuple[int, int]:
    """What a plan step's prepared inputs depend on: the job's generation and its remedies."""
    return job.assignment.generation, len(job.remedies)
