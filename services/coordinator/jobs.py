"""The job API: submit, read, cancel and watch jobs, inject faults, the cluster's totals.

`owner` is the submitting user; `scope` is whose jobs a caller may see and change
(unicron.security.owner_scope: None for an admin, or when no one is authenticated).
Someone else's job is NOT_FOUND, as a job that does not exist: its name tells nothing."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from services.coordinator import cost, priority, queue, quotas, state, transitions
from services.coordinator.context import Context
from services.coordinator.events import EventType, event
from services.coordinator.registry import NodeRegistry
from services.coordinator.replan import Replanner
from services.coordinator.store import JobWrite, new_job_id, valid_stream_id
from unicron import jobspec
from unicron.errors import FailedPrecondition, InvalidArgument, NotFound
from unicron.v1 import common_pb2, job_service_pb2, node_service_pb2

log = logging.getLogger(__name__)


def visible(job: common_pb2.Job, scope: str | None) -> bool:
    """Whether a caller whose scope is `scope` (None: everything) sees the job."""
    return scope is None or job.owner == scope


class Jobs:
    def __init__(self, ctx: Context, registry: NodeRegistry, replanner: Replanner) -> None:
        self._ctx = ctx
        self._registry = registry
        self._replanner = replanner

    def submit(self, spec: common_pb2.JobSpec, owner: str = "", admin: bool = True, team: str = "") -> common_pb2.Job:
        """``admin``: the caller may set a raw weight (priority.apply); ``team``: the owner's,
        whose quota the job counts against (quotas.py)."""
        spec = priority.apply(jobspec.normalized(spec), self._ctx.settings.priority_classes, admin)
        nodes = self._registry.nodes()
        if spec.program.image:
            # Agents start trainers in their own image: only nodes running this one can host it.
            images = ", ".join(sorted({repr(n.image) for n in nodes if n.image})) or "none named"
            nodes = [n for n in nodes if n.image == spec.program.image]
            if not nodes:
                raise FailedPrecondition(
                    f"program.image: no node runs {spec.program.image!r} (the agents' --image: {images})"
                )
        tensor = spec.parallelism.tensor
        largest = max((n.slots for n in nodes), default=0)
        if nodes and tensor > largest:
            # The planner never splits a tensor-parallel group across nodes (its all-reduces
            # run every layer): such a job would wait forever.
            raise FailedPrecondition(
                f"parallelism.tensor: a tensor-parallel group of {tensor} ranks must fit on one node, "
                f"and the largest node has {largest} slots"
            )
        # What the nodes hold in whole tensor-parallel groups.
        capacity = sum(n.slots // tensor * tensor for n in nodes)
        needed = jobspec.world_size(spec, spec.parallelism.min_data)
        if needed > capacity:
            raise FailedPrecondition(
                f"job needs at least {needed} slots (tensor x pipeline x min_data) but the "
                f"cluster has {capacity} across {len(nodes)} nodes"
                + (f" in whole tensor-parallel groups of {tensor}" if tensor > 1 else "")
            )
        self._ctx.settings.quotas.check_submit(team, admin, needed)
        now = self._ctx.clock()
        job = common_pb2.Job(job_id=new_job_id(), spec=spec, owner=owner, team=team)
        job.created.FromNanoseconds(int(now * 1e9))
        job.state = state.PENDING
        job.reason = "waiting for slots"
        change = job.history.add(state=state.PENDING, reason="submitted")
        change.time.CopyFrom(job.created)
        stored = self._ctx.store.create_job(job, event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, "submitted"))
        log.info("job submitted", extra={"job_id": job.job_id, "job_name": spec.name, "owner": owner})
        self._ctx.wake.set()
        return stored

    def get(self, job_id: str, scope: str | None = None) -> common_pb2.Job:
        if not job_id:
            raise InvalidArgument("job_id", "is required")
        job = self._ctx.store.get_job(job_id)
        if not visible(job, scope):
            raise NotFound(f"no job with id or name {job_id!r}")
        return job

    def list_jobs(self, states: set[int] | None = None, scope: str | None = None) -> list[common_pb2.Job]:
        jobs = self._ctx.store.list_jobs()
        return [job for job in jobs if (not states or job.state in states) and visible(job, scope)]

    def queue(self, scope: str | None = None) -> list[job_service_pb2.QueueEntry]:
        """The waiting jobs in the order the planner prefers them (queue.py)."""
        return queue.entries(self._ctx.store.list_jobs(), self._ctx.clock(), scope, self._ctx.settings.quotas)

    def quotas(self) -> job_service_pb2.ListQuotasResponse:
        """Each team's quota and use (quotas.py); the cluster's healthy slots beside them."""
        healthy = sum(n.slots for n in self._registry.nodes() if n.state == common_pb2.NODE_STATE_READY)
        return quotas.report(self._ctx.settings.quotas, self._ctx.store.list_jobs(), healthy)

    def cancel(self, job_id: str, reason: str, scope: str | None = None) -> common_pb2.Job:
        job_id = self.get(job_id, scope).job_id
        now = self._ctx.clock()
        why = f"cancelled: {reason}" if reason else "cancelled by user"
        unreachable, ack_timeout_s = self._ctx.unreachable(), self._ctx.settings.ack_timeout_s

        def mutate(job: common_pb2.Job) -> JobWrite:
            if state.is_terminal(job.state):
                raise FailedPrecondition(f"job {job.job_id} already ended ({state.state_name(job.state)})")
            commands = transitions.stop(job, now, why, ack_timeout_s, unreachable, job_ended=True)
            state.transition(job, state.CANCELLED, now, why)
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, why)], commands)

        job = self._ctx.store.update_job(job_id, mutate)
        log.info("job cancelled", extra={"job_id": job_id})
        self._replanner.want("a job was cancelled")
        return job

    def watch(
        self, job_id: str, after_event_id: str, is_active: Callable[[], bool], scope: str | None = None
    ) -> Iterator[common_pb2.JobEvent]:
        """A snapshot first (unless resuming), then every event until a final state."""
        if after_event_id and not valid_stream_id(after_event_id):
            raise InvalidArgument("after_event_id", f"{after_event_id!r} is not an event id (such as 1700000000000-0)")
        store = self._ctx.store
        job = self.get(job_id, scope)
        cursor = after_event_id
        if not cursor:
            cursor = store.last_event_id(job.job_id)
            job = store.get_job(job.job_id)
            snapshot = event(job, EventType.JOB_EVENT_TYPE_SNAPSHOT, self._ctx.clock(), job.reason)
            snapshot.job.CopyFrom(job)
            snapshot.progress.CopyFrom(job.progress)
            snapshot.event_id = cursor
            yield snapshot
            if state.is_terminal(job.state):
                return
        while is_active() and not self._ctx.stopping.is_set():
            for event_id, item in store.read_events(job.job_id, cursor, block_ms=1000):
                cursor = event_id
                item.event_id = event_id
                yield item
                if item.type == EventType.JOB_EVENT_TYPE_STATE_CHANGED and state.is_terminal(item.state):
                    return

    def inject_fault(self, job_id: str, fault: common_pb2.Fault, scope: str | None = None) -> str:
        """Sends a fault to the agent of the rank it targets; returns that node's id."""
        if fault.kind == common_pb2.FAULT_KIND_UNSPECIFIED or fault.kind not in common_pb2.FaultKind.values():
            raise InvalidArgument("fault.kind", "is required")
        if (
            fault.kind == common_pb2.FAULT_KIND_EXCEPTION
            and fault.exception_kind == common_pb2.FAILURE_KIND_UNSPECIFIED
        ):
            raise InvalidArgument("fault.exception_kind", "is required for an exception fault")
        if fault.kind == common_pb2.FAULT_KIND_SLOW and not (0 < fault.delay_seconds <= 3600):
            raise InvalidArgument("fault.delay_seconds", "must be in (0, 3600] for a slow fault")
        job = self.get(job_id, scope)
        if job.state not in state.ACTIVE:
            raise FailedPrecondition(f"job {job.job_id} is {state.state_name(job.state).lower()}, not running")
        if fault.rank >= job.assignment.world_size:
            raise InvalidArgument("fault.rank", f"must be below the job's world size {job.assignment.world_size}")
        node_id = next(w.node_id for w in job.assignment.workers if fault.rank in w.ranks)
        node = self._ctx.store.get_node(node_id)
        if node is None or not node.fault_injection:
            raise FailedPrecondition(
                f"fault injection is disabled on node {node_id} (start its agent with --fault-injection)"
            )
        command = node_service_pb2.NodeCommand(
            inject_fault=node_service_pb2.InjectFault(
                job_id=job.job_id, generation=job.assignment.generation, fault=fault
            )
        )
        self._ctx.store.append_command(node_id, command)
        log.info("fault sent", extra={"job_id": job.job_id, "node_id": node_id, "fault": str(fault).replace("\n", " ")})
        return node_id

    def cluster(self, scope: str | None = None) -> job_service_pb2.GetClusterResponse:
        """The whole cluster's totals; the per-job lines only of the jobs in scope."""
        store = self._ctx.store
        jobs = store.list_jobs()
        summary = cost.cluster_summary(jobs, self._registry.nodes(), store.list_incidents(), self._ctx.clock())
        if scope is not None:
            mine = {job.job_id for job in jobs if visible(job, scope)}
            kept = [line for line in summary.jobs if line.job_id in mine]
            del summary.jobs[:]
            summary.jobs.extend(kept)
        return summary

    def incidents(self, job_id: str = "", scope: str | None = None) -> list[common_pb2.Incident]:
        """A job's incidents, or every incident in scope: those of the caller's jobs and the
        nodes' own (a lost node is cluster news, as the node list is)."""
        store = self._ctx.store
        if job_id:
            return store.list_incidents(self.get(job_id, scope).job_id)
        found = store.list_incidents("")
        if scope is None:
            return found
        mine = {job.job_id for job in store.list_jobs() if visible(job, scope)}
        return [incident for incident in found if not incident.job_id or incident.job_id in mine]
