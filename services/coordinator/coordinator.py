"""The coordinator's domain logic, free of gRPC: the job API, the node registry, the
reports from agents and the reconcile loop (observe -> decide -> act)."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from services.coordinator import decide, incidents, state
from services.coordinator.planner_client import PlannerClient
from services.coordinator.store import JobWrite, Store, new_incident_id, new_job_id
from unicron import failures, jobspec, redisutil
from unicron.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    UnicronError,
)
from unicron.monitor import JobMonitor, MonitorSettings, ReportRejected
from unicron.ratelimit import KeyedLimiter
from unicron.v1 import common_pb2, node_service_pb2, planner_service_pb2

log = logging.getLogger(__name__)

EventType = common_pb2.JobEventType

# An agent batches its trainers' reports every 0.2 s; this leaves room for bursts.
REPORTS_PER_NODE_PER_S = 100.0


@dataclass(frozen=True)
class Settings:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    reconcile_interval_s: float = 0.5
    failure_rate_per_node_per_s: float = 1.0 / (30 * 24 * 3600)
    plan_time_limit_s: float = 2.0
    monitor: MonitorSettings = field(default_factory=MonitorSettings)


def event(job: common_pb2.Job, kind: int, now: float, message: str, **fields: object) -> common_pb2.JobEvent:
    out = common_pb2.JobEvent(job_id=job.job_id, type=kind, state=job.state, message=message, **fields)  # type: ignore[arg-type]
    out.time.FromNanoseconds(int(now * 1e9))
    return out


def _stop_commands(job: common_pb2.Job, reason: str, skip: str = "") -> list[tuple[str, node_service_pb2.NodeCommand]]:
    return [
        (
            node_id,
            node_service_pb2.NodeCommand(stop_workers=node_service_pb2.StopWorkers(job_id=job.job_id, reason=reason)),
        )
        for node_id in decide.nodes_of(job)
        if node_id != skip
    ]


class _NoOpenIncident(Exception):
    pass


def _last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


class Coordinator:
    def __init__(
        self,
        store: Store,
        planner: PlannerClient,
        settings: Settings = Settings(),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.planner = planner
        self.settings = settings
        self.clock = clock
        self._started_at = clock()
        self._monitors: dict[tuple[str, int], JobMonitor] = {}
        self._monitors_lock = threading.Lock()
        self._report_limiter = KeyedLimiter(REPORTS_PER_NODE_PER_S, REPORTS_PER_NODE_PER_S * 2)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None

    # ---- job API ----------------------------------------------------------------------

    def submit(self, spec: common_pb2.JobSpec) -> common_pb2.Job:
        spec = jobspec.normalized(spec)
        nodes = self.store.list_nodes()
        capacity = decide.total_slots(nodes)
        needed = jobspec.world_size(spec, spec.parallelism.min_data)
        if needed > capacity:
            raise FailedPrecondition(
                f"job needs at least {needed} slots (tensor x pipeline x min_data) but the "
                f"cluster has {capacity} across {len(nodes)} nodes"
            )
        now = self.clock()
        job = common_pb2.Job(job_id=new_job_id(), spec=spec)
        job.created.FromNanoseconds(int(now * 1e9))
        job.state = state.PENDING
        job.reason = "waiting for slots"
        change = job.history.add(state=state.PENDING, reason="submitted")
        change.time.CopyFrom(job.created)
        stored = self.store.create_job(job, event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, "submitted"))
        log.info("job submitted", extra={"job_id": job.job_id, "job_name": spec.name})
        self._wake.set()
        return stored

    def get(self, job_id: str) -> common_pb2.Job:
        if not job_id:
            raise InvalidArgument("job_id", "is required")
        return self.store.get_job(job_id)

    def list_jobs(self, states: set[int] | None = None) -> list[common_pb2.Job]:
        jobs = self.store.list_jobs()
        return [job for job in jobs if not states or job.state in states]

    def cancel(self, job_id: str, reason: str) -> common_pb2.Job:
        job_id = self.get(job_id).job_id
        now = self.clock()
        why = f"cancelled: {reason}" if reason else "cancelled by user"

        def mutate(job: common_pb2.Job) -> JobWrite:
            if state.is_terminal(job.state):
                raise FailedPrecondition(f"job {job.job_id} already ended ({state.state_name(job.state)})")
            commands = _stop_commands(job, why)
            state.transition(job, state.CANCELLED, now, why)
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, why)], commands)

        job = self.store.update_job(job_id, mutate)
        log.info("job cancelled", extra={"job_id": job_id})
        return job

    def watch(self, job_id: str, after_event_id: str, is_active: Callable[[], bool]) -> Iterator[common_pb2.JobEvent]:
        """A snapshot first (unless resuming), then every event until a final state."""
        job = self.get(job_id)
        cursor = after_event_id
        if not cursor:
            cursor = self.store.last_event_id(job.job_id)
            job = self.store.get_job(job.job_id)
            snapshot = event(job, EventType.JOB_EVENT_TYPE_SNAPSHOT, self.clock(), job.reason)
            snapshot.job.CopyFrom(job)
            snapshot.progress.CopyFrom(job.progress)
            snapshot.event_id = cursor
            yield snapshot
            if state.is_terminal(job.state):
                return
        while is_active() and not self._stop.is_set():
            for event_id, item in self.store.read_events(job.job_id, cursor, block_ms=1000):
                cursor = event_id
                item.event_id = event_id
                yield item
                if item.type == EventType.JOB_EVENT_TYPE_STATE_CHANGED and state.is_terminal(item.state):
                    return

    # ---- nodes ------------------------------------------------------------------------

    def register_node(
        self, node_id: str, address: str, slots: int, failure_domain: str, fault_injection: bool = False
    ) -> tuple[common_pb2.Node, str]:
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if not address or ":" not in address:
            raise InvalidArgument("address", f"must be host:port, got {address!r}")
        if slots <= 0:
            raise InvalidArgument("slots", "must be positive")
        now = self.clock()
        previous = self.store.get_node(node_id)
        node = common_pb2.Node(
            node_id=node_id,
            address=address,
            slots=slots,
            state=common_pb2.NODE_STATE_READY,
            failure_domain=failure_domain,
            fault_injection=fault_injection,
        )
        if previous is not None:
            node.registered.CopyFrom(previous.registered)
        else:
            node.registered.FromNanoseconds(int(now * 1e9))
        node.last_heartbeat.FromNanoseconds(int(now * 1e9))
        last_command = self.store.put_node(node, now)
        log.info("node registered", extra={"node_id": node_id, "address": address, "slots": slots})
        self._wake.set()
        return node, last_command

    def heartbeat(self, node_id: str) -> bool:
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        return self.store.heartbeat(node_id, self.clock())

    def nodes(self) -> list[common_pb2.Node]:
        nodes = self.store.list_nodes()
        used = decide.used_slots(self.store.list_jobs())
        for node in nodes:
            node.used_slots = used.get(node.node_id, 0)
        return nodes

    def commands(
        self, node_id: str, after_id: str, is_active: Callable[[], bool]
    ) -> Iterator[node_service_pb2.NodeCommand]:
        if self.store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        cursor = after_id or self.store.last_command_id(node_id)
        while is_active() and not self._stop.is_set():
            for command_id, command in self.store.read_commands(node_id, cursor, block_ms=1000):
                cursor = command_id
                yield command

    # ---- reports from agents ----------------------------------------------------------

    def admit_report(self, node_id: str) -> None:
        """Rate limit per node, so one misbehaving agent cannot starve the others."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if not self._report_limiter.allow(node_id):
            raise ResourceExhausted(f"node {node_id} sends reports faster than {REPORTS_PER_NODE_PER_S:g}/s")

    def report_progress(self, node_id: str, reports: list[node_service_pb2.IterationReport]) -> None:
        """Validates the whole batch first, so a bad report changes nothing."""
        self.admit_report(node_id)
        jobs: dict[str, common_pb2.Job] = {}
        for i, report in enumerate(reports):
            for name in ("seconds", "flops", "compute_seconds"):
                value = getattr(report, name)
                if not math.isfinite(value) or value < 0:
                    raise InvalidArgument(f"reports[{i}].{name}", f"must be a finite non-negative number, got {value}")
            if report.iteration == 0:
                raise InvalidArgument(f"reports[{i}].iteration", "iterations count from 1")
            if report.job_id not in jobs:
                jobs[report.job_id] = self.store.get_job(report.job_id)
        now = self.clock()
        for report in reports:
            job = jobs[report.job_id]
            if job.assignment.generation != report.generation or state.is_terminal(job.state):
                continue
            self._observe(job, report, now)
            # Every rank reports; the loss is already averaged over data-parallel ranks, so
            # rank 0 speaks for the job.
            if report.rank != 0:
                continue
            if report.iteration <= job.progress.iteration:
                continue  # a duplicate from a retried batch, or out of order: progress never goes back
            if job.state == state.SCHEDULED:
                job = self._move(job.job_id, state.RUNNING, "training", only_from={state.SCHEDULED}) or job
            progress = common_pb2.JobProgress(
                iteration=report.iteration,
                loss=report.loss,
                iteration_seconds=report.seconds,
                tokens=job.progress.tokens + report.tokens,
                flops_per_second=report.flops / report.seconds if report.seconds > 0 else 0.0,
            )
            progress.updated.FromNanoseconds(int(now * 1e9))
            message = f"iteration {report.iteration}/{job.spec.training.iterations} loss {report.loss:.4f}"
            self.store.set_progress(
                job.job_id,
                progress,
                event(job, EventType.JOB_EVENT_TYPE_PROGRESS, now, message, progress=progress),
            )
            job.progress.CopyFrom(progress)
            jobs[job.job_id] = job
        self._check_stragglers(jobs, now)

    def _observe(self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float) -> None:
        """Feeds the job's cross-node monitor. An agent compares only its own node's ranks;
        here every rank of the job is compared with every other, so a slow node shows too."""
        key = (job.job_id, job.assignment.generation)
        with self._monitors_lock:
            monitor = self._monitors.get(key)
            if monitor is None:
                for stale in [k for k in self._monitors if k[0] == job.job_id]:
                    del self._monitors[stale]
                monitor = self._monitors[key] = JobMonitor(
                    job.job_id, key[1], range(job.assignment.world_size), self.settings.monitor, now
                )
            try:
                monitor.observe(report.rank, report.iteration, report.seconds, report.compute_seconds, now)
            except ReportRejected:
                pass  # a retried batch repeats iterations; the agent already vetted each report

    def _check_stragglers(self, jobs: dict[str, common_pb2.Job], now: float) -> None:
        with self._monitors_lock:
            findings = [
                finding
                for key, monitor in self._monitors.items()
                if key[0] in jobs
                for finding in monitor.check(now)
                if finding.kind == common_pb2.FAILURE_KIND_STRAGGLER
            ]
        for finding in findings:
            job = jobs[finding.job_id]
            node_id = next((w.node_id for w in job.assignment.workers if finding.rank in w.ranks), "")
            report = common_pb2.FailureReport(
                job_id=finding.job_id,
                generation=finding.generation,
                rank=finding.rank,
                node_id=node_id,
                kind=finding.kind,
                source=common_pb2.DETECTION_SOURCE_STATISTICAL,
                message=finding.message,
                statistics=finding.evidence,
            )
            report.first_seen.FromNanoseconds(int(finding.first_seen * 1e9))
            self._record(report)

    def report_failure(self, node_id: str, report: common_pb2.FailureReport) -> common_pb2.Incident | None:
        """Records a classified report from an agent; returns its incident, or None for a
        report about a job generation that is already over (stale, not an error)."""
        self.admit_report(node_id)
        if report.kind == common_pb2.FAILURE_KIND_UNSPECIFIED:
            raise InvalidArgument("report.kind", "is required")
        if report.kind not in common_pb2.FailureKind.values():
            raise InvalidArgument("report.kind", f"unknown failure kind {report.kind}")
        if not node_id or (report.node_id and report.node_id != node_id):
            raise InvalidArgument("report.node_id", "must name the reporting node")
        if self.store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        stamped = common_pb2.FailureReport()
        stamped.CopyFrom(report)
        stamped.node_id = node_id
        if report.job_id:
            job = self.store.get_job(report.job_id)
            if job.assignment.generation != report.generation or state.is_terminal(job.state):
                # Late evidence of an incident that already ended the job still joins it;
                # it never opens a new one.
                return self._record(stamped, create=False)
        return self._record(stamped)

    def report_worker_exit(self, request: node_service_pb2.ReportWorkerExitRequest) -> None:
        try:
            job = self.store.get_job(request.job_id)
        except NotFound:
            return
        if job.assignment.generation != request.generation or state.is_terminal(job.state):
            return
        code = -request.signal if request.signal else request.exit_code
        exits = self.store.record_exit(job.job_id, request.generation, request.rank, code)
        if code != 0:
            exited = request.exited.ToNanoseconds() / 1e9 if request.HasField("exited") else self.clock()
            self._record(
                incidents.worker_exit_report(
                    request.node_id,
                    job.job_id,
                    request.generation,
                    request.rank,
                    request.exit_code,
                    request.signal,
                    request.error or _last_line(request.stderr_tail),
                    exited,
                )
            )
        elif len(exits) == job.assignment.world_size and all(c == 0 for c in exits.values()):
            self._move(job.job_id, state.SUCCEEDED, f"all {len(exits)} ranks finished", only_from=state.ACTIVE)

    def report_fault_injected(self, request: node_service_pb2.ReportFaultInjectedRequest) -> None:
        try:
            job = self.store.get_job(request.job_id)
        except NotFound:
            return
        fault = request.fault
        at = request.injected.ToNanoseconds() / 1e9 if request.HasField("injected") else self.clock()
        name = common_pb2.FaultKind.Name(fault.kind).removeprefix("FAULT_KIND_").lower()
        message = f"fault {name} injected on rank {fault.rank} ({request.node_id})"
        self.store.append_event(job.job_id, event(job, EventType.JOB_EVENT_TYPE_FAULT_INJECTED, at, message))

    def inject_fault(self, job_id: str, fault: common_pb2.Fault) -> str:
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
        job = self.get(job_id)
        if job.state not in state.ACTIVE:
            raise FailedPrecondition(f"job {job.job_id} is {state.state_name(job.state).lower()}, not running")
        if fault.rank >= job.assignment.world_size:
            raise InvalidArgument("fault.rank", f"must be below the job's world size {job.assignment.world_size}")
        node_id = next(w.node_id for w in job.assignment.workers if fault.rank in w.ranks)
        node = self.store.get_node(node_id)
        if node is None or not node.fault_injection:
            raise FailedPrecondition(
                f"fault injection is disabled on node {node_id} (start its agent with --fault-injection)"
            )
        command = node_service_pb2.NodeCommand(
            inject_fault=node_service_pb2.InjectFault(
                job_id=job.job_id, generation=job.assignment.generation, fault=fault
            )
        )
        self.store.append_command(node_id, command)
        log.info("fault sent", extra={"job_id": job.job_id, "node_id": node_id, "fault": str(fault).replace("\n", " ")})
        return node_id

    def list_incidents(self, job_id: str = "") -> list[common_pb2.Incident]:
        return self.store.list_incidents(self.get(job_id).job_id if job_id else "")

    def _record(self, report: common_pb2.FailureReport, create: bool = True) -> common_pb2.Incident | None:
        """Adds a report to its incident; a new incident of a job is announced on the job's
        event log and, until the self-healing loop exists, ends the job. With create=False
        a report only joins an open incident (None when there is none)."""
        now = self.clock()
        key = incidents.incident_key(report)

        def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
            open_incident = current if current is not None and incidents.is_open(current, now) else None
            if open_incident is None and not create:
                raise _NoOpenIncident
            return incidents.merge(open_incident, report, now, new_incident_id())

        try:
            incident, created = self.store.upsert_incident(key, update)
        except _NoOpenIncident:
            return None
        log.warning(
            "failure reported",
            extra={
                "incident": incident.incident_id,
                "new": created,
                "kind": failures.kind_name(report.kind),
                "job_id": report.job_id,
                "node_id": report.node_id,
            },
        )
        if not created or not incident.job_id:
            return incident
        job = self.store.get_job(incident.job_id)
        failure = event(job, EventType.JOB_EVENT_TYPE_FAILURE, now, incident.summary, failure_kind=incident.kind)
        failure.incident_id = incident.incident_id
        self.store.append_event(job.job_id, failure)
        if incidents.ends_the_job(incident):
            skip = report.node_id if report.kind == common_pb2.FAILURE_KIND_NODE_LOST else ""
            if self._move(
                job.job_id, state.FAILED, incident.summary, only_from=state.ACTIVE, stop_workers=True, skip_node=skip
            ):
                self._set_action(key, incident.incident_id, "job failed")
        return incident

    def _set_action(self, key: str, incident_id: str, action: str) -> None:
        def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
            assert current is not None and current.incident_id == incident_id
            out = common_pb2.Incident()
            out.CopyFrom(current)
            out.action_taken = action
            return out

        self.store.upsert_incident(key, update)

    # ---- reconcile loop ---------------------------------------------------------------

    def start(self) -> None:
        self._loop = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._loop:
            self._loop.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.reconcile_once()
            except UnicronError as exc:
                log.warning("reconcile step failed", extra={"error": str(exc)})
            except Exception:
                log.exception("reconcile step crashed")
            self._wake.wait(self.settings.reconcile_interval_s)
            self._wake.clear()

    def reconcile_once(self) -> None:
        now = self.clock()
        nodes = self.store.list_nodes()
        by_id = {node.node_id: node for node in nodes}
        for node_id in decide.lost_nodes(now, nodes, self.settings.heartbeat_timeout_s, self._started_at):
            self._lose_node(by_id[node_id])
        jobs = self.store.list_jobs()
        if any(job.state == state.PENDING for job in jobs):
            self._schedule(jobs, self.store.list_nodes())

    def _lose_node(self, node: common_pb2.Node) -> None:
        if not self.store.set_node_state(
            node.node_id, common_pb2.NODE_STATE_LOST, expected=common_pb2.NODE_STATE_READY
        ):
            return
        timeout = self.settings.heartbeat_timeout_s
        last = max(node.last_heartbeat.ToNanoseconds() / 1e9, self._started_at)
        self._record(incidents.node_lost_report(node.node_id, "", 0, last, timeout))
        for job in self.store.list_jobs():
            if node.node_id in decide.nodes_of(job):
                # A job that other ranks' errors already ended gets the node loss as the
                # root cause of its incident; a running one gets a new incident.
                report = incidents.node_lost_report(node.node_id, job.job_id, job.assignment.generation, last, timeout)
                self._record(report, create=job.state in state.ACTIVE)

    def _schedule(self, jobs: list[common_pb2.Job], nodes: list[common_pb2.Node]) -> None:
        request = decide.plan_request(
            jobs, nodes, self.settings.failure_rate_per_node_per_s, self.settings.plan_time_limit_s
        )
        if not any(node.healthy for node in request.nodes):
            return
        try:
            reply = self.planner.plan(request)
        except Unavailable as exc:
            log.warning("cannot schedule: %s", exc)
            return
        if reply.status not in (planner_service_pb2.SOLVE_STATUS_OPTIMAL, planner_service_pb2.SOLVE_STATUS_FEASIBLE):
            log.warning("planner found no plan", extra={"status": reply.status, "reason": reply.reason})
            return
        by_id = {node.node_id: node for node in nodes}
        pending = {job.job_id: job for job in jobs if job.state == state.PENDING}
        for plan in reply.jobs:
            if plan.job_id in pending and plan.size > 0:
                self._assign(pending[plan.job_id], dict(plan.slots_by_node), by_id, plan.reason)

    def _assign(
        self, job: common_pb2.Job, slots: dict[str, int], nodes: dict[str, common_pb2.Node], reason: str
    ) -> None:
        now = self.clock()

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            if current.state != state.PENDING:
                return None
            assignment = decide.assignment_for(current.spec, slots, nodes, current.assignment.generation + 1)
            # Ports are picked where the coordinator can bind them (one machine, host
            # networking); a multi-host deployment sets master ports per job instead.
            assignment.master_port = redisutil.free_port(assignment.master_addr or "127.0.0.1")
            current.assignment.CopyFrom(assignment)
            placed = ", ".join(f"{w.node_id}:{len(w.ranks)}" for w in assignment.workers)
            state.transition(current, state.SCHEDULED, now, f"placed on {placed}")
            commands = [
                (
                    w.node_id,
                    node_service_pb2.NodeCommand(
                        start_workers=node_service_pb2.StartWorkers(
                            job_id=current.job_id, spec=current.spec, assignment=assignment
                        )
                    ),
                )
                for w in assignment.workers
            ]
            events = [event(current, EventType.JOB_EVENT_TYPE_ASSIGNED, now, f"placed on {placed} ({reason})")]
            return JobWrite(events, commands)

        self.store.update_job(job.job_id, mutate)
        log.info("job scheduled", extra={"job_id": job.job_id, "slots": slots})

    def _move(
        self,
        job_id: str,
        target: int,
        reason: str,
        only_from: set[int] | frozenset[int],
        stop_workers: bool = False,
        skip_node: str = "",
    ) -> common_pb2.Job | None:
        now = self.clock()
        moved = False

        def mutate(job: common_pb2.Job) -> JobWrite | None:
            nonlocal moved
            if job.state not in only_from:
                return None
            commands = _stop_commands(job, reason, skip=skip_node) if stop_workers else []
            state.transition(job, target, now, reason)
            moved = True
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, reason)], commands)

        job = self.store.update_job(job_id, mutate)
        if moved and state.is_terminal(target):
            with self._monitors_lock:
                for key in [k for k in self._monitors if k[0] == job_id]:
                    del self._monitors[key]
        if moved:
            log.info("job %s", state.state_name(target).lower(), extra={"job_id": job_id, "reason": reason})
            self._wake.set()
        return job if moved else None
