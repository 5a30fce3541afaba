"""The coordinator's domain logic, free of gRPC: the job API, the node registry, the
reports from agents and the reconcile loop (observe -> decide -> act)."""

from __future__ import annotations

import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from google.protobuf.timestamp_pb2 import Timestamp

from services.coordinator import cost, decide, incidents, ladder, state, transitions
from services.coordinator.command_feed import CommandFeed, CommandStream
from services.coordinator.ladder import LadderPolicy
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.planner_client import PlannerClient
from services.coordinator.store import JobWrite, Store, new_incident_id, new_job_id, valid_stream_id
from unicron import failures, jobspec, redisutil
from unicron import incident_trace as trace
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
from unicron.retry import Backoff
from unicron.v1 import common_pb2, job_service_pb2, node_service_pb2, planner_service_pb2

log = logging.getLogger(__name__)

EventType = common_pb2.JobEventType

# How often incidents are charged for their jobs' sub-healthy running.
SUB_HEALTHY_PERIOD_S = 5.0
# A READY node whose last heartbeat is older than this many intervals takes no new ranks
# (half an interval later than any healthy node's beat can be).
QUIET_AFTER_INTERVALS = 1.5

# An agent batches its trainers' reports every 0.2 s; this leaves room for bursts.
REPORTS_PER_NODE_PER_S = 100.0

# Node names as hosts and Kubernetes nodes have them; never ':' (the store's key separator)
# nor '/'.
NODE_ID_PATTERN = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,251}[A-Za-z0-9])?$")


@dataclass(frozen=True)
class Settings:
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    reconcile_interval_s: float = 0.5
    failure_rate_per_node_per_s: float = 1.0 / (30 * 24 * 3600)
    plan_time_limit_s: float = 2.0
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    ladder: LadderPolicy = field(default_factory=LadderPolicy)
    # An agent acknowledges start and stop commands within this; a missed start is a failure.
    ack_timeout_s: float = 15.0
    # A remedy that brings back no iteration within this is a failed remedy (escalated).
    recovery_timeout_s: float = 180.0
    # A planner that is down or finds no plan is asked again after a backoff up to this.
    replan_backoff_max_s: float = 30.0
    # Restart only the dead ranks, and resize keeping the ranks on the nodes a job keeps, the
    # others keeping their state in place, when they can (off: stop and start every rank).
    reform_restarts: bool = True


def event(job: common_pb2.Job, kind: int, now: float, message: str, **fields: object) -> common_pb2.JobEvent:
    out = common_pb2.JobEvent(job_id=job.job_id, type=kind, state=job.state, message=message, **fields)  # type: ignore[arg-type]
    out.time.FromNanoseconds(int(now * 1e9))
    return out


class _NoOpenIncident(Exception):
    pass


_NOT_YET_RUNNING = (common_pb2.WORKER_STATE_STARTING, common_pb2.WORKER_STATE_LAUNCHED)


def _resumes(job: common_pb2.Job, report: node_service_pb2.IterationReport) -> bool:
    """Whether rank 0's report is the job's first iteration after a remedy or a move. A
    reattempt keeps the generation: only an iteration beyond the last one counts. Any
    other remedy started a new generation, which may restart from an older iteration."""
    if job.state != state.RECOVERING:
        return False
    pending = _pending_remedy(job)
    if pending is None:
        return True
    if pending.remedy == common_pb2.REMEDY_REATTEMPT:
        return report.iteration > job.progress.iteration
    return pending.generation == report.generation


def _check_time(stamp: Timestamp, field: str) -> None:
    """A time an agent sent must be one a Timestamp can hold (years 1 to 9999): one out of
    range would fail every later read of what stores it."""
    try:
        stamp.ToNanoseconds()
    except ValueError:
        raise InvalidArgument(field, f"is not a valid time (seconds {stamp.seconds}, nanos {stamp.nanos})") from None


def _check_report(index: int, report: node_service_pb2.IterationReport) -> None:
    for name in ("seconds", "flops", "compute_seconds"):
        value = getattr(report, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"reports[{index}].{name}", f"must be a finite non-negative number, got {value}")
    if report.iteration == 0:
        raise InvalidArgument(f"reports[{index}].iteration", "iterations count from 1")


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
        metrics: CoordinatorMetrics | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.planner = planner
        self.settings = settings
        self.clock = clock
        self._started_at = clock()
        # Why the next reconcile step should ask the planner for a new plan ("" = no need),
        # and not before when (a backoff after a planner outage or an INFEASIBLE answer).
        self._replan_reason = ""
        self._replan_not_before = 0.0
        self._replan_delays: Iterator[float] | None = None
        self._last_accrual = 0.0
        self._monitors: dict[tuple[str, int], JobMonitor] = {}
        self._monitors_lock = threading.Lock()
        # Reentrant: a remedy that isolates a node records the incidents of its other jobs.
        self._incidents_lock = threading.RLock()
        self._report_limiter = KeyedLimiter(REPORTS_PER_NODE_PER_S, REPORTS_PER_NODE_PER_S * 2)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._loop: threading.Thread | None = None
        # Heartbeats are soft state, kept here and saved in one write per reconcile step
        # (Store.save_heartbeats): the newest of memory and Redis counts.
        self._beats: dict[str, float] = {}
        self._unsaved_beats: dict[str, float] = {}
        self._beats_lock = threading.Lock()
        # Nodes stored LOST (as the last reconcile step saw them): a heartbeat from one is
        # answered "unknown", so its agent registers again and the node is READY again (its
        # trainers were re-planned away; a LOST node its agent still heartbeats for would stay
        # out of every plan otherwise).
        self._lost: set[str] = set()
        self._feed = CommandFeed(store)

    # ---- job API ----------------------------------------------------------------------
    # `owner` is the submitting user; `scope` is whose jobs a caller may see and change
    # (unicron.security.owner_scope: None for an admin, or when no one is authenticated).
    # Someone else's job is NOT_FOUND, as a job that does not exist: its name tells nothing.

    def submit(self, spec: common_pb2.JobSpec, owner: str = "") -> common_pb2.Job:
        spec = jobspec.normalized(spec)
        nodes = self._list_nodes()
        if spec.program.image:
            # Agents start trainers in their own image: only nodes running this one can host it.
            images = ", ".join(sorted({repr(n.image) for n in nodes if n.image})) or "none named"
            nodes = [n for n in nodes if n.image == spec.program.image]
            if not nodes:
                raise FailedPrecondition(
                    f"program.image: no node runs {spec.program.image!r} (the agents' --image: {images})"
                )
        capacity = decide.total_slots(nodes)
        needed = jobspec.world_size(spec, spec.parallelism.min_data)
        if needed > capacity:
            raise FailedPrecondition(
                f"job needs at least {needed} slots (tensor x pipeline x min_data) but the "
                f"cluster has {capacity} across {len(nodes)} nodes"
            )
        now = self.clock()
        job = common_pb2.Job(job_id=new_job_id(), spec=spec, owner=owner)
        job.created.FromNanoseconds(int(now * 1e9))
        job.state = state.PENDING
        job.reason = "waiting for slots"
        change = job.history.add(state=state.PENDING, reason="submitted")
        change.time.CopyFrom(job.created)
        stored = self.store.create_job(job, event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, "submitted"))
        log.info("job submitted", extra={"job_id": job.job_id, "job_name": spec.name, "owner": owner})
        self._wake.set()
        return stored

    def get(self, job_id: str, scope: str | None = None) -> common_pb2.Job:
        if not job_id:
            raise InvalidArgument("job_id", "is required")
        job = self.store.get_job(job_id)
        if not visible(job, scope):
            raise NotFound(f"no job with id or name {job_id!r}")
        return job

    def list_jobs(self, states: set[int] | None = None, scope: str | None = None) -> list[common_pb2.Job]:
        jobs = self.store.list_jobs()
        return [job for job in jobs if (not states or job.state in states) and visible(job, scope)]

    def cancel(self, job_id: str, reason: str, scope: str | None = None) -> common_pb2.Job:
        job_id = self.get(job_id, scope).job_id
        now = self.clock()
        why = f"cancelled: {reason}" if reason else "cancelled by user"

        def mutate(job: common_pb2.Job) -> JobWrite:
            if state.is_terminal(job.state):
                raise FailedPrecondition(f"job {job.job_id} already ended ({state.state_name(job.state)})")
            commands = transitions.stop(job, now, why, self.settings.ack_timeout_s, self._unreachable())
            state.transition(job, state.CANCELLED, now, why)
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, why)], commands)

        job = self.store.update_job(job_id, mutate)
        log.info("job cancelled", extra={"job_id": job_id})
        self._want_replan("a job was cancelled")
        return job

    def watch(
        self, job_id: str, after_event_id: str, is_active: Callable[[], bool], scope: str | None = None
    ) -> Iterator[common_pb2.JobEvent]:
        """A snapshot first (unless resuming), then every event until a final state."""
        if after_event_id and not valid_stream_id(after_event_id):
            raise InvalidArgument("after_event_id", f"{after_event_id!r} is not an event id (such as 1700000000000-0)")
        job = self.get(job_id, scope)
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
        self,
        node_id: str,
        address: str,
        slots: int,
        failure_domain: str,
        fault_injection: bool = False,
        image: str = "",
    ) -> tuple[common_pb2.Node, str]:
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if not NODE_ID_PATTERN.match(node_id):
            raise InvalidArgument(
                "node_id", f"{node_id!r} must be letters, digits, '.', '_' and '-', at most 253 characters"
            )
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
            image=image,
        )
        if previous is not None:
            node.registered.CopyFrom(previous.registered)
        else:
            node.registered.FromNanoseconds(int(now * 1e9))
        if previous is not None and previous.state == common_pb2.NODE_STATE_READY:
            node.state_since.CopyFrom(previous.state_since)
        else:
            node.state_since.FromNanoseconds(int(now * 1e9))
        node.last_heartbeat.FromNanoseconds(int(now * 1e9))
        last_command = self.store.put_node(node, now)
        with self._beats_lock:  # registering is a heartbeat: an older one heard before must not count
            self._beats[node_id] = now
            self._lost.discard(node_id)
        log.info("node registered", extra={"node_id": node_id, "address": address, "slots": slots})
        if previous is None or previous.state != common_pb2.NODE_STATE_READY or previous.slots != slots:
            self._want_replan(f"node {node_id} joined")
        return node, last_command

    def heartbeat(self, node_id: str) -> bool:
        """Records a heartbeat; False when the node is unknown or LOST (it must register again)."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        # Only a node this coordinator has not heard yet is looked up.
        if self.heartbeat_if_seen(node_id):
            return True
        stored = self.store.get_node(node_id)
        if stored is None or stored.state == common_pb2.NODE_STATE_LOST:
            return False
        now = self.clock()
        with self._beats_lock:
            self._beats[node_id] = self._unsaved_beats[node_id] = now
        return True

    def heartbeat_if_seen(self, node_id: str) -> bool:
        """Records a heartbeat of a node this coordinator has heard before, touching no
        store (so it may run on the server's event loop); False: call `heartbeat`."""
        with self._beats_lock:
            if node_id not in self._beats or node_id in self._lost:
                return False
            self._beats[node_id] = self._unsaved_beats[node_id] = self.clock()
        return True

    def _list_nodes(self) -> list[common_pb2.Node]:
        """The stored nodes with their last heartbeats: the ones this coordinator heard
        (newer than any it saved), else the stored ones (nodes silent since it started)."""
        nodes = self.store.list_nodes()
        with self._beats_lock:
            beats = dict(self._beats)
        unheard = [node.node_id for node in nodes if node.node_id not in beats]
        beats.update(self.store.heartbeats(unheard))
        for node in nodes:
            beat = beats.get(node.node_id)
            if beat is not None:
                node.last_heartbeat.FromNanoseconds(int(beat * 1e9))
        return nodes

    def _save_heartbeats(self) -> None:
        with self._beats_lock:
            beats, self._unsaved_beats = self._unsaved_beats, {}
        self.store.save_heartbeats(beats)

    def nodes(self) -> list[common_pb2.Node]:
        nodes = self._list_nodes()
        used = decide.used_slots(self.store.list_jobs())
        for node in nodes:
            node.used_slots = used.get(node.node_id, 0)
        return nodes

    def open_commands(self, node_id: str, after_id: str) -> CommandStream:
        """A stream of the node's commands after `after_id` (default: from now on); the
        caller closes it."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if after_id and not valid_stream_id(after_id):
            raise InvalidArgument("after_command_id", f"{after_id!r} is not a command id (such as 1700000000000-0)")
        if self.store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        return CommandStream(self._feed, self.store, node_id, after_id or self.store.last_command_id(node_id))

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
            _check_report(i, report)
            if report.job_id not in jobs:
                jobs[report.job_id] = self.store.get_job(report.job_id)
        now = self.clock()
        for report in reports:
            job = jobs[report.job_id]
            if job.assignment.generation != report.generation:
                # A remedy can overtake the last reports of the generation it replaced: they
                # are still the job's true progress (what a restart will have to recompute).
                if (
                    report.rank == 0
                    and report.generation < job.assignment.generation
                    and job.state == state.RECOVERING
                    and report.iteration > job.progress.iteration
                ):
                    self._set_progress(job, report, now)
                continue
            if state.is_terminal(job.state):
                # Reports held back by an outage can arrive after the exits that ended the
                # job: they are still its true last iterations, but change nothing else.
                if report.rank == 0 and report.iteration > job.progress.iteration:
                    self._set_progress(job, report, now)
                continue
            self._observe(job, report, now)
            if any(w.node_id == node_id and w.state in _NOT_YET_RUNNING for w in job.workers):
                job = self.store.update_job(
                    job.job_id,
                    lambda current: JobWrite() if transitions.mark_running(current, node_id, now) else None,
                )
            # Every rank reports; the loss is already averaged over data-parallel ranks, so
            # rank 0 speaks for the job.
            if report.rank != 0:
                continue
            resuming = _resumes(job, report)
            if report.iteration <= job.progress.iteration and not resuming:
                continue  # a duplicate from a retried batch, or out of order: progress never goes back
            if resuming:
                job = self._resume(job, report, now) or job
            elif job.state == state.SCHEDULED:
                job = self._move(job.job_id, state.RUNNING, "training", only_from={state.SCHEDULED}) or job
            self._set_progress(job, report, now)
            jobs[job.job_id] = job
        self._check_stragglers(jobs, now)

    def _set_progress(self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float) -> None:
        """Stores rank 0's report as the job's progress (and updates `job` to match)."""
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

    def _resume(
        self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float
    ) -> common_pb2.Job | None:
        """The first iteration after a remedy or a re-plan: the job runs again."""
        previous = job.progress.iteration
        pending_now = _pending_remedy(job)
        source, restored = report.state_source, report.restored_iteration
        if not source and pending_now is not None and pending_now.remedy == common_pb2.REMEDY_REATTEMPT:
            # Only the rank that failed says so; its peers waited with their state intact.
            source, restored = "live", report.iteration - 1
        source = source or "unknown"
        recomputed = max(0, previous - restored) if source != "live" else 0
        resumed: common_pb2.RemedyAttempt | None = None

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            nonlocal resumed
            if current.state != state.RECOVERING or current.assignment.generation != report.generation:
                return None
            pending = _pending_remedy(current)
            if pending is not None:
                pending.resumed.FromNanoseconds(int(now * 1e9))
                resumed = pending
            what = ladder.remedy_name(pending.remedy) if pending is not None else "re-plan"
            reason = (
                f"training resumed after {what} at iteration {report.iteration} "
                f"(state: {source} at iteration {restored}, {recomputed} iterations recomputed)"
            )
            state.transition(current, state.RUNNING, now, reason)
            out = event(current, EventType.JOB_EVENT_TYPE_RESUMED, now, reason)
            out.incident_id = pending.incident_id if pending is not None else ""
            out.progress.iteration = max(0, restored)
            return JobWrite([out])

        updated = self.store.update_job(job.job_id, mutate)
        if updated.version == job.version:
            return None
        log.info("job resumed", extra={"job_id": job.job_id, "iteration": report.iteration, "source": source})
        if resumed is not None:
            self._close_incident(updated, resumed, report, now)
        return updated

    def _close_incident(
        self,
        job: common_pb2.Job,
        attempt: common_pb2.RemedyAttempt,
        report: node_service_pb2.IterationReport,
        now: float,
    ) -> None:
        incident = self.store.get_incident(attempt.incident_id)
        if incident is None:
            return
        resumed_waf = job.spec.weight * (report.flops / report.seconds if report.seconds > 0 else 0.0)

        def edit(current: common_pb2.Incident) -> None:
            current.resumed.FromNanoseconds(int(now * 1e9))
            current.cost.resumed_waf = resumed_waf
            current.cost.resumed_slots = job.assignment.world_size
            current.cost.CopyFrom(cost.resumed_cost(current))

        stored = self._update_incident(incident, edit)
        trace.record_span(
            attempt.traceparent,
            trace.RESUMED,
            attempt.started,
            now,
            {
                trace.ATTR_JOB: job.job_id,
                trace.ATTR_ITERATION: report.iteration,
                trace.ATTR_STATE_SOURCE: report.state_source
                or ("live" if attempt.remedy == common_pb2.REMEDY_REATTEMPT else "unknown"),
                trace.ATTR_GENERATION: report.generation,
            },
        )
        trace.finish_incident(
            attempt.traceparent,
            incident.first_seen,
            now,
            {
                trace.ATTR_INCIDENT_ID: incident.incident_id,
                trace.ATTR_JOB: job.job_id,
                trace.ATTR_REMEDY: ladder.remedy_name(attempt.remedy),
                trace.ATTR_FAILURE_KIND: failures.kind_name(incident.kind),
                "unicron.outcome": "resumed",
            },
        )
        if self.metrics is not None:
            self.metrics.record_incident(stored)

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
        if report.source not in common_pb2.DetectionSource.values():
            raise InvalidArgument("report.source", f"unknown detection source {report.source}")
        if not node_id or (report.node_id and report.node_id != node_id):
            raise InvalidArgument("report.node_id", "must name the reporting node")
        _check_time(report.first_seen, "report.first_seen")
        if self.store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        stamped = common_pb2.FailureReport()
        stamped.CopyFrom(report)
        stamped.node_id = node_id
        return self._record(stamped)  # NOT_FOUND for an unknown job, from _record's read

    def report_worker_exit(self, request: node_service_pb2.ReportWorkerExitRequest) -> None:
        _check_time(request.exited, "exited")
        try:
            job = self.store.get_job(request.job_id)
        except NotFound:
            return
        if job.assignment.generation != request.generation or job.state not in state.ACTIVE:
            return
        if request.rank >= job.assignment.world_size:
            # Counted, it would stand in for a live rank: the job would end while one still runs.
            raise InvalidArgument(
                "rank", f"{request.rank} is not a rank of job {job.job_id} (world size {job.assignment.world_size})"
            )
        code = -request.signal if request.signal else request.exit_code
        iterations = job.spec.training.iterations
        if code != 0 and iterations and request.last_iteration >= iterations:
            # It had done its last iteration: dying while it tore down loses no training, and a
            # restart would only wait on peers that are finishing (or gone) for good.
            how = f"signal {request.signal}" if request.signal else f"exit code {request.exit_code}"
            message = f"rank {request.rank} ended with {how} after its last iteration {request.last_iteration}"
            log.warning("rank failed after its last iteration", extra={"job_id": job.job_id, "rank": request.rank})
            note = event(job, EventType.JOB_EVENT_TYPE_FAILURE, self.clock(), message)
            self.store.append_event(job.job_id, note)
            code = 0
        exits = self.store.record_exit(job.job_id, request.generation, request.rank, code)
        stopping = any(
            w.node_id == request.node_id and w.generation == request.generation and w.state == state.WORKER_STOPPING
            for w in job.workers
        )
        exited = request.exited.ToNanoseconds() / 1e9 if request.HasField("exited") else self.clock()
        if (
            code == 0
            and not stopping
            and iterations
            and max(request.last_iteration, job.progress.iteration) < iterations
        ):
            # A clean exit before the last iteration is the program's doing (it returned early):
            # restarting it would end the same way.
            done = max(request.last_iteration, job.progress.iteration)
            report = incidents.worker_exit_report(
                request.node_id, job.job_id, request.generation, request.rank, 0, 0, "", exited
            )
            report.kind = common_pb2.FAILURE_KIND_PROGRAM_ERROR
            report.message = f"the program exited 0 after iteration {done} of {iterations}, before its last"
            self._record(report)
        elif code != 0 and not stopping:
            self._record(
                incidents.worker_exit_report(
                    request.node_id,
                    job.job_id,
                    request.generation,
                    request.rank,
                    request.exit_code,
                    request.signal,
                    # A signal's victim left no explanation; an exit's last stderr line often is one.
                    request.error or ("" if request.signal else _last_line(request.stderr_tail)),
                    exited,
                )
            )
        elif len(exits) == job.assignment.world_size and all(c == 0 for c in exits.values()):
            self._move(job.job_id, state.SUCCEEDED, f"all {len(exits)} ranks finished", only_from=state.ACTIVE)

    def report_fault_injected(self, request: node_service_pb2.ReportFaultInjectedRequest) -> None:
        fault = request.fault
        if fault.kind == common_pb2.FAULT_KIND_UNSPECIFIED or fault.kind not in common_pb2.FaultKind.values():
            raise InvalidArgument("fault.kind", f"unknown fault kind {fault.kind}")
        _check_time(request.injected, "injected")
        try:
            job = self.store.get_job(request.job_id)
        except NotFound:
            return
        at = request.injected.ToNanoseconds() / 1e9 if request.HasField("injected") else self.clock()
        name = common_pb2.FaultKind.Name(fault.kind).removeprefix("FAULT_KIND_").lower()
        message = f"fault {name} injected on rank {fault.rank} ({request.node_id})"
        self.store.append_event(job.job_id, event(job, EventType.JOB_EVENT_TYPE_FAULT_INJECTED, at, message))

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

    def ack_command(self, request: node_service_pb2.AckCommandRequest) -> None:
        """An agent confirms a start or stop; late and duplicate acks change nothing, an ack
        for a job that does not exist is NOT_FOUND."""
        if not request.node_id:
            raise InvalidArgument("node_id", "is required")
        if not request.job_id:
            raise InvalidArgument("job_id", "is required")
        now = self.clock()
        self.store.update_job(
            self.get(request.job_id).job_id,
            lambda job: JobWrite()
            if transitions.acknowledge(job, request.node_id, request.generation, request.ok, request.error, now)
            else None,
        )
        if not request.ok:
            log.warning(
                "agent could not carry out a command",
                extra={"node_id": request.node_id, "job_id": request.job_id, "error": request.error},
            )

    def cluster(self, scope: str | None = None) -> job_service_pb2.GetClusterResponse:
        """The whole cluster's totals; the per-job lines only of the jobs in scope."""
        jobs = self.store.list_jobs()
        summary = cost.cluster_summary(jobs, self._list_nodes(), self.store.list_incidents(), self.clock())
        if scope is not None:
            mine = {job.job_id for job in jobs if visible(job, scope)}
            kept = [line for line in summary.jobs if line.job_id in mine]
            del summary.jobs[:]
            summary.jobs.extend(kept)
        return summary

    def list_incidents(self, job_id: str = "", scope: str | None = None) -> list[common_pb2.Incident]:
        """A job's incidents, or every incident in scope: those of the caller's jobs and the
        nodes' own (a lost node is cluster news, as the node list is)."""
        if job_id:
            return self.store.list_incidents(self.get(job_id, scope).job_id)
        incidents = self.store.list_incidents("")
        if scope is None:
            return incidents
        mine = {job.job_id for job in self.store.list_jobs() if visible(job, scope)}
        return [incident for incident in incidents if not incident.job_id or incident.job_id in mine]

    def _record(self, report: common_pb2.FailureReport, create: bool = True) -> common_pb2.Incident | None:
        """Adds a report to its incident; a new incident of a job is announced on the job's
        event log and gets its remedy. With create=False a report only joins an open
        incident (None when there is none).

        One report at a time: the ranks of a job report one failure within milliseconds of
        each other, and each must see the remedy the one before it chose (a rank's exit
        that arrives just after its peers' connection resets turns their reattempt into a
        restart, instead of racing it)."""
        with self._incidents_lock:
            job = None
            if create and report.job_id:
                # Read under the lock: a remedy decided meanwhile may have replaced the
                # report's generation. Late evidence about a generation that is over, or a
                # job that ended, still joins its open incident; it never opens a new one.
                job = self.store.get_job(report.job_id)
                create = job.assignment.generation == report.generation and not state.is_terminal(job.state)
            return self._record_one(report, create, job)

    def _record_one(
        self, report: common_pb2.FailureReport, create: bool, job: common_pb2.Job | None
    ) -> common_pb2.Incident | None:
        """`job`: the report's job as read under the incidents lock, if it was (remedies
        change only under that lock; a write racing this one is refused by its own CAS)."""
        now = self.clock()
        try:
            incident, created = self.store.upsert_incident(
                incidents.incident_key(report), self._merge_report(report, now, create)
            )
        except _NoOpenIncident:
            return None
        self._announce(incident, created, report)
        if created and incident.job_id:
            job = job or self.store.get_job(incident.job_id)
            failure = event(job, EventType.JOB_EVENT_TYPE_FAILURE, now, incident.summary, failure_kind=incident.kind)
            failure.incident_id = incident.incident_id
            self.store.append_event(job.job_id, failure)
        if incident.kind == common_pb2.FAILURE_KIND_STRAGGLER:
            return incident  # a performance report: the planner may route around it, nothing to heal
        if (
            incident.job_id
            and incident.remedy == common_pb2.REMEDY_UNSPECIFIED
            and incidents.holds(incident.kind)
            and not incidents.accounts_for_all(
                incident, (job or self.store.get_job(incident.job_id)).assignment.world_size
            )
        ):
            # A network error is often how a peer's death looks from outside, and a death
            # is best answered once the peers said they wait (then only the dead rank
            # restarts): until every rank is accounted for, decide after a short hold
            # (the reconcile loop).
            if created:
                threading.Timer(incidents.DECISION_HOLD_S, self._wake.set).start()
            return incident
        if created or (incident.job_id and incident.remedy == common_pb2.REMEDY_UNSPECIFIED):
            self._respond(incident, job)
        elif incident.remedy == common_pb2.REMEDY_REATTEMPT and incidents.needs_heavier_remedy(incident):
            # Later evidence (a rank's exit) shows the reattempt cannot work: decide again.
            self._respond(incident, job)
        return incident

    def _merge_report(
        self, report: common_pb2.FailureReport, now: float, create: bool = True
    ) -> Callable[[common_pb2.Incident | None], common_pb2.Incident]:
        """The store's update of the incident open under the report's key: the report joins
        it, or opens a new one (unless not `create`: _NoOpenIncident)."""

        def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
            open_incident = current if current is not None and incidents.is_open(current, now, report) else None
            if open_incident is None and not create:
                raise _NoOpenIncident
            merged = incidents.merge(open_incident, report, now, new_incident_id())
            if open_incident is None:
                merged.traceparent = trace.new_incident_context()
            return merged

        return update

    def _announce(self, incident: common_pb2.Incident, created: bool, report: common_pb2.FailureReport) -> None:
        """The log line of a report, and a new incident's detection span."""
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
        if created and incident.kind != common_pb2.FAILURE_KIND_STRAGGLER:
            trace.record_span(
                incident.traceparent,
                trace.DETECT,
                incident.first_seen,
                incident.detected,
                {
                    trace.ATTR_INCIDENT_ID: incident.incident_id,
                    trace.ATTR_JOB: incident.job_id,
                    trace.ATTR_NODE: incident.node_id,
                    trace.ATTR_DETECTION_SOURCE: common_pb2.DetectionSource.Name(report.source),
                },
            )

    def _record_node_losses(self, nodes: list[common_pb2.Node]) -> None:
        """The nodes' own incidents of their loss, in one write (a rack is a hundred nodes).
        No remedy waits for them: their jobs' incidents were recorded and answered already."""
        if not nodes:
            return
        now = self.clock()
        reports = [self._node_lost_report(node, "", 0) for node in nodes]
        updates = {incidents.incident_key(report): self._merge_report(report, now) for report in reports}
        with self._incidents_lock:
            recorded = self.store.upsert_incidents(updates)
        for (incident, created), report in zip(recorded, reports, strict=True):
            self._announce(incident, created, report)

    def _decide_held(self, now: float) -> None:
        """Responds to the network-error incidents whose hold is over (also after a restart
        of the coordinator, which finds them undecided in the store)."""
        for incident in self.store.list_incidents(limit=50):
            if (
                incident.job_id
                and incident.remedy == common_pb2.REMEDY_UNSPECIFIED
                and incidents.holds(incident.kind)
                and now - incident.detected.ToNanoseconds() / 1e9 >= incidents.DECISION_HOLD_S
                and incidents.is_open(incident, now)
            ):
                with self._incidents_lock:
                    current = self.store.get_incident(incident.incident_id)
                    if current is not None and current.remedy == common_pb2.REMEDY_UNSPECIFIED:
                        self._respond(current)

    # ---- the self-healing ladder ------------------------------------------------------

    def _respond(self, incident: common_pb2.Incident, job: common_pb2.Job | None = None) -> None:
        """Picks the incident's remedy by the ladder and starts it (`job`: as `_record_one`
        read it, else read here)."""
        if not incident.job_id:
            if incident.severity == common_pb2.SEVERITY_SEV1 and incident.kind != common_pb2.FAILURE_KIND_NODE_LOST:
                self._isolate(incident)
            return
        job = job or self.store.get_job(incident.job_id)
        if job.state not in state.ACTIVE or job.assignment.generation != incident.generation:
            return
        ready = {node_id for node_id, st in self.store.node_states().items() if st == common_pb2.NODE_STATE_READY}
        decision = ladder.choose(
            incident.kind,
            job.remedies,
            self.clock(),
            self.settings.ladder,
            ranks_alive=incidents.ranks_alive(incident),
            placement_ready=all(node_id in ready for node_id in decide.nodes_of(job)),
        )
        self._apply(incident, decision, healthy_waf=cost.job_waf(job), healthy_slots=job.assignment.world_size)

    def _apply(
        self, incident: common_pb2.Incident, decision: ladder.Decision, healthy_waf: float, healthy_slots: int
    ) -> None:
        now = self.clock()
        settings = self.settings
        remedy = decision.remedy
        unreachable = self._unreachable()
        applied = False

        def mutate(job: common_pb2.Job) -> JobWrite | None:
            nonlocal applied
            if job.state not in state.ACTIVE or job.assignment.generation != incident.generation:
                return None
            if remedy is None:
                reason = f"{incident.summary}; {decision.reason}"
                if incident.kind == common_pb2.FAILURE_KIND_PROGRAM_ERROR:
                    job.failure_detail = incidents.program_traceback(incident)
                commands = transitions.stop(job, now, reason, settings.ack_timeout_s, unreachable)
                state.transition(job, state.FAILED, now, reason)
                applied = True
                return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, reason)], commands)
            attempt = job.remedies.add(
                incident_id=incident.incident_id,
                remedy=remedy,
                reason=decision.reason,
                traceparent=incident.traceparent,
            )
            attempt.started.FromNanoseconds(int(now * 1e9))
            name = ladder.remedy_name(remedy)
            if remedy == common_pb2.REMEDY_REATTEMPT:
                # The same ranks in the same places abort their group and form a new one (a
                # collective error can leave the old one unusable), then redo the interrupted
                # iteration: a new generation and rendezvous, nothing else changes.
                assignment = common_pb2.Assignment()
                assignment.CopyFrom(job.assignment)
                assignment.generation += 1
                assignment.assigned.FromNanoseconds(int(now * 1e9))
                assignment.master_port = self._rendezvous_port(assignment.master_addr, job.assignment.master_port)
                attempt.generation = assignment.generation
                same = {r: r for w in job.assignment.workers for r in w.ranks}
                commands = transitions.reform(
                    job,
                    assignment,
                    same,
                    now,
                    "reattempt in a new process group",
                    settings.ack_timeout_s,
                    incident.incident_id,
                    unreachable,
                )
            elif remedy == common_pb2.REMEDY_RESTART:
                assignment = self._new_assignment(job, decide.slots_by_node(job))
                attempt.generation = assignment.generation
                rank_map = (
                    decide.survivor_map(job, assignment, *incidents.waiting_and_gone(incident), unreachable)
                    if settings.reform_restarts
                    else None
                )
                if rank_map is not None:
                    # Only the dead ranks start again; they take the state from a live peer.
                    why = f"restart of ranks {sorted(set(range(job.assignment.world_size)) - set(rank_map))}"
                    commands = transitions.reform(
                        job, assignment, rank_map, now, why, settings.ack_timeout_s, incident.incident_id, unreachable
                    )
                else:
                    commands = transitions.stop(
                        job, now, f"restart: {incident.summary}", settings.ack_timeout_s, unreachable
                    )
                    commands += transitions.start(
                        job, assignment, now, f"restart after {incident.incident_id}", settings.ack_timeout_s
                    )
            else:
                # The re-plan moves the job off the isolated node; generation set then.
                commands = []
            state.transition(job, state.RECOVERING, now, f"{name}: {incident.summary}")
            applied = True
            message = f"{name} for incident {incident.incident_id}: {decision.reason}"
            remedy_event = event(job, EventType.JOB_EVENT_TYPE_REMEDY, now, message)
            remedy_event.incident_id = incident.incident_id
            for _, command in commands:
                command.traceparent = incident.traceparent
            return JobWrite([remedy_event], commands)

        job = self.store.update_job(incident.job_id, mutate)
        if not applied:
            return
        log.warning(
            "remedy chosen",
            extra={
                "incident": incident.incident_id,
                "job_id": job.job_id,
                "remedy": ladder.remedy_name(remedy) if remedy else "fail",
                "reason": decision.reason,
            },
        )

        def note(current: common_pb2.Incident) -> None:
            current.action_taken = (
                f"{ladder.remedy_name(remedy)}: {decision.reason}" if remedy else f"job failed: {decision.reason}"
            )
            if remedy:
                current.remedy = remedy  # type: ignore[assignment]
                current.remedy_started.FromNanoseconds(int(now * 1e9))
                current.cost.healthy_waf = healthy_waf
                current.cost.healthy_slots = healthy_slots
                if current.HasField("resumed"):
                    current.cost.CopyFrom(cost.resumed_cost(current))

        self._update_incident(incident, note)
        trace.record_span(
            incident.traceparent,
            trace.CLASSIFY,
            incident.detected,
            now,
            {
                trace.ATTR_FAILURE_KIND: failures.kind_name(incident.kind),
                trace.ATTR_SEVERITY: failures.severity_name(incident.severity),
                trace.ATTR_REMEDY: ladder.remedy_name(remedy) if remedy else "fail",
                "unicron.remedy.reason": decision.reason,
            },
        )
        if remedy is None:
            trace.finish_incident(
                incident.traceparent,
                incident.first_seen,
                now,
                {trace.ATTR_INCIDENT_ID: incident.incident_id, trace.ATTR_JOB: job.job_id, "unicron.outcome": "failed"},
            )
            self._forget_monitors(job.job_id)
            self._want_replan(f"job {job.job_id} failed")
        elif remedy == common_pb2.REMEDY_RECONFIGURE:
            self._isolate(incident)
            self._want_replan(f"incident {incident.incident_id} needs a new plan")

    def _isolate(self, incident: common_pb2.Incident) -> None:
        """Takes the incident's node out of the plan (SEV1) and opens an incident for every
        job with ranks there, unless it is already lost."""
        node_id = incident.node_id
        if not node_id or not self.store.set_node_state(
            node_id, common_pb2.NODE_STATE_ISOLATED, expected=common_pb2.NODE_STATE_READY, now=self.clock()
        ):
            return
        log.warning("node isolated", extra={"node_id": node_id, "incident": incident.incident_id})
        root = next(r for r in incident.reports if r.kind == incident.kind)
        for job in self.store.list_jobs():
            if job.job_id != incident.job_id and job.state in state.ACTIVE and node_id in decide.nodes_of(job):
                report = common_pb2.FailureReport()
                report.CopyFrom(root)
                report.job_id, report.generation = job.job_id, job.assignment.generation
                report.ClearField("rank")
                report.message = f"node {node_id} isolated: {incident.summary}"
                self._record(report)
        self._want_replan(f"node {node_id} isolated")

    def _update_incident(
        self, incident: common_pb2.Incident, edit: Callable[[common_pb2.Incident], None]
    ) -> common_pb2.Incident:
        """Compare-and-set edit of an incident, applied to what is stored now (other threads
        close incidents and add reports concurrently). Returns what was stored."""
        stored = self.store.update_incident(incident.incident_id, edit)
        if stored is None:
            raise NotFound(f"incident {incident.incident_id}")
        return stored

    # ---- reconcile loop ---------------------------------------------------------------

    def start(self) -> None:
        self._loop = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._loop.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._feed.stop()
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
            # A full interval after each step, however long it took: under a thousand nodes a
            # step takes a good part of the interval, and steps back to back would take the
            # CPU the heartbeats need.
            self._wake.wait(self.settings.reconcile_interval_s)
            self._wake.clear()

    def reconcile_once(self) -> None:
        """Observe (nodes, jobs), decide (pure functions in decide.py), act."""
        self._save_heartbeats()
        now = self.clock()
        nodes = self._list_nodes()
        by_id = {node.node_id: node for node in nodes}
        lost = decide.lost_nodes(now, nodes, self.settings.heartbeat_timeout_s, self._started_at)
        # A rack that vanishes is a hundred nodes: all are marked LOST in one write, their
        # jobs' incidents follow (from one read of the jobs), and the nodes' own incidents,
        # which no remedy waits for, come after this step's re-plan.
        newly_lost = [
            by_id[node_id]
            for node_id in self.store.set_node_states(
                lost, common_pb2.NODE_STATE_LOST, expected=common_pb2.NODE_STATE_READY, now=now
            )
        ]
        with self._beats_lock:
            self._lost = {n.node_id for n in nodes if n.state == common_pb2.NODE_STATE_LOST} | {
                n.node_id for n in newly_lost
            }
        if newly_lost:
            placed = self.store.list_jobs()
            for node in newly_lost:
                self._jobs_lost_node(node, placed)
        try:
            self._reconcile_jobs(now)
        finally:
            self._record_node_losses(newly_lost)

    def _reconcile_jobs(self, now: float) -> None:
        self._decide_held(now)
        jobs = self.store.list_jobs()
        for job_id, node_id in decide.overdue_workers(now, jobs):
            self._missed_ack(job_id, node_id, now)
        for job_id in decide.stalled_recoveries(now, jobs, self.settings.recovery_timeout_s):
            self._stalled(job_id, now)
        if now - self._last_accrual >= SUB_HEALTHY_PERIOD_S:
            self._accrue_sub_healthy(jobs, now - self._last_accrual if self._last_accrual else 0.0)
            self._last_accrual = now
        nodes = self._list_nodes()  # as the steps above left them (lost, isolated)
        wanted = (
            self._replan_reason
            or ("pending jobs" if any(job.state == state.PENDING for job in jobs) else "")
            or ("jobs on unavailable nodes" if decide.hit_jobs(jobs, nodes) else "")
        )
        if wanted and now >= self._replan_not_before:
            self._replan(wanted, jobs, nodes, now)

    def _accrue_sub_healthy(self, jobs: list[common_pb2.Job], seconds: float) -> None:
        """Charges each resumed incident for the time its job still runs smaller than it did
        before the failure."""
        for job in jobs:
            if job.state != state.RUNNING or not job.remedies or not seconds:
                continue
            for incident in self.store.list_incidents(job.job_id):
                if not incident.HasField("resumed") or not incident.cost.sub_healthy_waf:
                    continue
                before = incident.cost.sub_healthy_waf_seconds

                def edit(current: common_pb2.Incident, size: int = job.assignment.world_size) -> None:
                    current.cost.CopyFrom(cost.accrue_sub_healthy(current.cost, seconds, slots_now=size))

                updated = self._update_incident(incident, edit)
                if self.metrics is not None:
                    self.metrics.record_sub_healthy(updated, updated.cost.sub_healthy_waf_seconds - before)

    def _want_replan(self, reason: str) -> None:
        self._replan_reason = self._replan_reason or reason
        self._replan_not_before = 0.0
        self._wake.set()

    def _unreachable(self) -> frozenset[str]:
        return frozenset(
            node_id for node_id, st in self.store.node_states().items() if st == common_pb2.NODE_STATE_LOST
        )

    def _jobs_lost_node(self, node: common_pb2.Node, jobs: list[common_pb2.Job]) -> None:
        """The incidents of the jobs of a node just marked LOST. `jobs` says where its
        workers were (assignments change only when a replan commits, after this); `_record`
        reads each job's own state again."""
        for job in jobs:
            if node.node_id in decide.nodes_of(job):
                # A job that other ranks' errors already ended gets the node loss as the
                # root cause of its incident; a running one gets a new incident.
                report = self._node_lost_report(node, job.job_id, job.assignment.generation)
                self._record(report, create=job.state in state.ACTIVE)
        self._want_replan(f"node {node.node_id} lost")

    def _node_lost_report(self, node: common_pb2.Node, job_id: str, generation: int) -> common_pb2.FailureReport:
        last = max(node.last_heartbeat.ToNanoseconds() / 1e9, self._started_at)
        return incidents.node_lost_report(node.node_id, job_id, generation, last, self.settings.heartbeat_timeout_s)

    def _missed_ack(self, job_id: str, node_id: str, now: float) -> None:
        job = self.store.get_job(job_id)
        worker = next((w for w in job.workers if w.node_id == node_id), None)
        if worker is None:
            return
        what = "start" if worker.state == state.WORKER_STARTING else "stop"
        limit = self.settings.ack_timeout_s

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            for w in current.workers:
                if w.node_id == node_id and w.generation == worker.generation and w.HasField("deadline"):
                    state.move_worker(w, state.WORKER_FAILED, now, f"no acknowledgement of {what} within {limit:g}s")
                    return JobWrite()
            return None

        self.store.update_job(job_id, mutate)
        if what == "start":
            report = common_pb2.FailureReport(
                job_id=job_id,
                generation=worker.generation,
                node_id=node_id,
                kind=common_pb2.FAILURE_KIND_TRANSITION_TIMEOUT,
                source=common_pb2.DETECTION_SOURCE_HEARTBEAT,
                message=f"agent did not acknowledge the start command within {limit:g}s",
            )
            report.first_seen.FromNanoseconds(int(now * 1e9))
            self._record(report)

    def _stalled(self, job_id: str, now: float) -> None:
        """A remedy that brought no iteration back in time failed: a new incident, so the
        ladder escalates."""
        job = self.store.get_job(job_id)
        attempt = job.remedies[-1]
        report = common_pb2.FailureReport(
            job_id=job_id,
            generation=job.assignment.generation,
            node_id=next(iter(decide.nodes_of(job)), ""),
            kind=common_pb2.FAILURE_KIND_TRANSITION_TIMEOUT,
            source=common_pb2.DETECTION_SOURCE_STATISTICAL,
            message=(
                f"{ladder.remedy_name(attempt.remedy)} for {attempt.incident_id} brought no iteration back "
                f"within {self.settings.recovery_timeout_s:g}s"
            ),
        )
        report.first_seen.FromNanoseconds(int(now * 1e9))
        if attempt.generation == 0:
            # A reconfigure still waiting for its plan: the job is where it was.
            report.generation = job.assignment.generation
        self._record(report)

    # ---- re-planning ------------------------------------------------------------------

    def _replan(self, why: str, jobs: list[common_pb2.Job], nodes: list[common_pb2.Node], now: float) -> None:
        """Asks the planner for every job's size and placement and moves the jobs whose
        plan changed. A planner that is down or finds no plan leaves everything as it is
        and is asked again after a backoff."""
        hit = decide.hit_jobs(jobs, nodes)
        quiet = decide.lost_nodes(
            now, nodes, QUIET_AFTER_INTERVALS * self.settings.heartbeat_interval_s, self._started_at
        )
        request = decide.plan_request(
            jobs, nodes, self.settings.failure_rate_per_node_per_s, self.settings.plan_time_limit_s, hit, quiet
        )
        if not request.jobs or not any(node.healthy for node in request.nodes):
            self._replan_reason = ""
            return
        traceparents = [
            pending.traceparent
            for job in jobs
            if job.job_id in hit and (pending := _pending_remedy(job)) is not None and pending.traceparent
        ]
        problem = ""  # why the interrupted jobs may pause, if they may
        try:
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
                problem = reply.reason
                log.warning("no plan keeps the interrupted jobs running; they may pause", extra={"problem": problem})
                reply = self.planner.plan(relaxed)
        except Unavailable as exc:
            self._replan_later(why, f"planner unavailable: {exc}", now)
            return
        if reply.status not in (planner_service_pb2.SOLVE_STATUS_OPTIMAL, planner_service_pb2.SOLVE_STATUS_FEASIBLE):
            status = planner_service_pb2.SolveStatus.Name(reply.status)
            self._replan_later(why, f"planner found no plan ({status}): {reply.reason}", now)
            return
        self._replan_reason = ""
        self._replan_delays = None
        if problem:
            why = f"{why}; {problem}"
        by_id = {node.node_id: node for node in nodes}
        for change in decide.plan_changes(jobs, reply, hit):
            try:
                self._carry_out(change, by_id, why, now)
            except UnicronError as exc:
                log.warning("plan step failed", extra={"job_id": change.job_id, "error": str(exc)})
                self._want_replan(f"retry after: {exc}")

    def _replan_later(self, why: str, problem: str, now: float) -> None:
        if self._replan_delays is None:
            self._replan_delays = Backoff(1.0, self.settings.replan_backoff_max_s, jitter=False).delays()
        delay = next(self._replan_delays)
        self._replan_reason = why
        self._replan_not_before = now + delay
        log.warning("keeping the current plan", extra={"why": why, "problem": problem, "retry_in_s": delay})

    def _carry_out(self, change: decide.Change, nodes: dict[str, common_pb2.Node], why: str, now: float) -> None:
        settings = self.settings
        # From the replan's own view of the nodes: listing a thousand nodes again for each
        # job placed made placing a hundred jobs take seconds of CPU.
        unreachable = frozenset(node_id for node_id, node in nodes.items() if node.state == common_pb2.NODE_STATE_LOST)
        moved = False

        def mutate(job: common_pb2.Job) -> JobWrite | None:
            nonlocal moved
            placed = ", ".join(f"{n}:{c}" for n, c in sorted(change.slots.items()))
            if change.kind == "start":
                if job.state != state.PENDING:
                    return None
                assignment = self._new_assignment(job, change.slots, nodes)
                commands = transitions.start(job, assignment, now, f"placed on {placed}", settings.ack_timeout_s)
                pending = _pending_remedy(job)
                if pending is not None and pending.generation == 0:
                    pending.generation = assignment.generation
                state.transition(job, state.SCHEDULED, now, f"placed on {placed}")
                events = [event(job, EventType.JOB_EVENT_TYPE_ASSIGNED, now, f"placed on {placed} ({change.reason})")]
                moved = True
                return JobWrite(events, commands)
            if job.state not in state.ACTIVE:
                return None
            if change.kind == "pause":
                reason = f"paused by re-plan ({why}): {change.reason}"
                commands = transitions.stop(job, now, reason, settings.ack_timeout_s, unreachable)
                state.transition(job, state.PENDING, now, reason)
                job.replans += 1
                moved = True
                return JobWrite([event(job, EventType.JOB_EVENT_TYPE_REMEDY, now, reason)], commands)
            before = sum(decide.slots_by_node(job).values())
            assignment = self._new_assignment(job, change.slots, nodes)
            how = change.transition or "move"
            reason = f"{how} to {assignment.world_size} ranks ({placed}) by re-plan ({why})"
            pending = _pending_remedy(job)
            rank_map = (
                self._reform_map(job, assignment, pending, nodes, unreachable) if settings.reform_restarts else None
            )
            if rank_map is not None:
                # The ranks on nodes the job keeps go on in place with their state; only the
                # new assignment's other ranks start, and take the state from a live peer.
                reason += f", keeping ranks {sorted(rank_map)} in place"
                incident_id = pending.incident_id if pending is not None else ""
                commands = transitions.reform(
                    job, assignment, rank_map, now, reason, settings.ack_timeout_s, incident_id, unreachable
                )
            else:
                commands = transitions.stop(job, now, reason, settings.ack_timeout_s, unreachable)
                commands += transitions.start(job, assignment, now, reason, settings.ack_timeout_s)
            if pending is not None and pending.generation == 0:
                pending.generation = assignment.generation
                for _, command in commands:
                    command.traceparent = pending.traceparent
            else:
                job.replans += 1
            state.transition(job, state.RECOVERING, now, reason)
            moved = True
            message = f"{reason}: {before} -> {assignment.world_size} slots; {change.reason}"
            return JobWrite(
                [
                    event(job, EventType.JOB_EVENT_TYPE_REMEDY, now, message),
                    event(job, EventType.JOB_EVENT_TYPE_ASSIGNED, now, f"placed on {placed}"),
                ],
                commands,
            )

        job = self.store.update_job(change.job_id, mutate)
        if moved:
            log.info(
                "plan carried out",
                extra={"job_id": job.job_id, "change": change.kind, "slots": change.slots, "why": why},
            )

    def _reform_map(
        self,
        job: common_pb2.Job,
        assignment: common_pb2.Assignment,
        pending: common_pb2.RemedyAttempt | None,
        nodes: dict[str, common_pb2.Node],
        unreachable: frozenset[str],
    ) -> dict[int, int] | None:
        """Which ranks a re-plan's move keeps in place (see decide.survivor_map and
        decide.live_map); None to restart the job the classic way."""
        if pending is None:
            return decide.live_map(job, assignment)
        # The job's ranks may have reported into more than one incident (a node's own, the
        # network errors of its peers): any open one of this generation tells who waits and
        # who is gone.
        waiting: set[int] = set()
        gone: set[int] = set()
        lost: set[str] = set()
        for incident in self.store.list_incidents(job.job_id, limit=20):
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

    def _new_assignment(
        self,
        job: common_pb2.Job,
        slots: dict[str, int],
        nodes: dict[str, common_pb2.Node] | None = None,
    ) -> common_pb2.Assignment:
        if nodes is None:
            nodes = {node.node_id: node for node in self._list_nodes()}
        assignment = decide.assignment_for(job.spec, slots, nodes, job.assignment.generation + 1)
        assignment.assigned.FromNanoseconds(int(self.clock() * 1e9))
        assignment.master_port = self._rendezvous_port(assignment.master_addr, job.assignment.master_port)
        return assignment

    def _rendezvous_port(self, master_addr: str, leaving: int) -> int:
        """A free port where the coordinator can bind the rank-0 address itself (one machine);
        otherwise one of decide.RENDEZVOUS_PORTS that no other job uses on that host."""
        try:
            return redisutil.free_port(master_addr or "127.0.0.1")
        except OSError:
            pass  # not an address of this host
        port = decide.unused_rendezvous_port(master_addr, self.store.list_jobs(), exclude=leaving)
        if port is None:
            raise ResourceExhausted(f"no free rendezvous port left on {master_addr}")
        return port

    def _forget_monitors(self, job_id: str) -> None:
        with self._monitors_lock:
            for key in [k for k in self._monitors if k[0] == job_id]:
                del self._monitors[key]

    def _move(
        self,
        job_id: str,
        target: int,
        reason: str,
        only_from: set[int] | frozenset[int],
    ) -> common_pb2.Job | None:
        now = self.clock()
        moved = False

        def mutate(job: common_pb2.Job) -> JobWrite | None:
            nonlocal moved
            if job.state not in only_from:
                return None
            state.transition(job, target, now, reason)
            moved = True
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, reason)])

        job = self.store.update_job(job_id, mutate)
        if moved and state.is_terminal(target):
            self._forget_monitors(job_id)
            self._want_replan(f"job {job_id} ended")
        if moved:
            log.info("job %s", state.state_name(target).lower(), extra={"job_id": job_id, "reason": reason})
            self._wake.set()
        return job if moved else None


def _pending_remedy(job: common_pb2.Job) -> common_pb2.RemedyAttempt | None:
    """The job's last remedy while it has not brought training back."""
    if job.remedies and not job.remedies[-1].HasField("resumed"):
        return job.remedies[-1]
    return None


def visible(job: common_pb2.Job, scope: str | None) -> bool:
    """Whether a caller whose scope is `scope` (None: everything) sees the job."""
    return scope is None or job.owner == scope
