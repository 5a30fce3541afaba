"""Healing: failure reports into incidents (`intake`), incidents into remedies (`ladder`,
`remedies`), and what follows from both: isolating a node, closing an incident when its job
resumes, charging incidents for the time their jobs run smaller. The decisions are the pure
modules'; this part reads, writes, and acts after each write commits."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from services.coordinator import cost, decide, incidents, intake, ladder, links, remedies, state
from services.coordinator.context import Context, unreachable
from services.coordinator.events import EventType, event
from services.coordinator.replan import Replanner
from services.coordinator.store import JobWrite
from unicron import failures
from unicron import incident_trace as trace
from unicron.errors import NotFound
from unicron.v1 import common_pb2, node_service_pb2

log = logging.getLogger(__name__)

# Up to this many jobs are read one by one; more, in one listing of every job.
FEW_JOBS = 3


class Healer:
    def __init__(
        self,
        ctx: Context,
        replanner: Replanner,
        forget_job: Callable[[str], None],
        nodes: Callable[[], list[common_pb2.Node]],
    ) -> None:
        """`forget_job(job_id)` drops what is kept in memory about a job that ended; `nodes()`
        lists the nodes with their last heartbeats (registry.NodeRegistry.nodes)."""
        self._ctx = ctx
        self._nodes = nodes
        self._replanner = replanner
        self._forget_job = forget_job
        # One report at a time (see record); reentrant: a remedy that isolates a node records
        # the incidents of its other jobs.
        self._lock = threading.RLock()

    # ---- intake -----------------------------------------------------------------------

    def record(self, report: common_pb2.FailureReport, create: bool = True) -> common_pb2.Incident | None:
        """Adds a report to its incident; a new incident of a job is announced on the job's
        event log and gets its remedy. With create=False a report only joins an open
        incident (None when there is none).

        One report at a time: the ranks of a job report one failure within milliseconds of
        each other, and each must see the remedy the one before it chose (a rank's exit
        that arrives just after its peers' connection resets turns their reattempt into a
        restart, instead of racing it)."""
        with self._lock:
            job = None
            if create and report.job_id:
                # Read under the lock: a remedy decided meanwhile may have replaced the
                # report's generation.
                job = self._ctx.store.get_job(report.job_id)
                create = intake.may_open(job, report)
            return self._record_one(report, create, job)

    def _record_one(
        self, report: common_pb2.FailureReport, create: bool, job: common_pb2.Job | None
    ) -> common_pb2.Incident | None:
        """`job`: the report's job as read under the lock, if it was (remedies change only
        under that lock; a write racing this one is refused by its own compare-and-set)."""
        store, now = self._ctx.store, self._ctx.clock()
        try:
            incident, created = store.upsert_incident(
                incidents.incident_key(report), intake.merge_update(report, now, create)
            )
        except intake.NoOpenIncident:
            return None
        self._announce(incident, created, report)
        self._answer(incident, created, job)
        return incident

    def _answer(self, incident: common_pb2.Incident, created: bool, job: common_pb2.Job | None) -> None:
        """A recorded incident: a new one is announced on its job's event log; then it is
        held (decided by a later reconcile step), answered by its remedy, or left alone."""
        store, now = self._ctx.store, self._ctx.clock()
        if incident.job_id and (created or incident.kind != common_pb2.FAILURE_KIND_STRAGGLER):
            job = job or store.get_job(incident.job_id)
        if created and job is not None:
            failure = event(job, EventType.JOB_EVENT_TYPE_FAILURE, now, incident.summary, failure_kind=incident.kind)
            failure.incident_id = incident.incident_id
            store.append_event(job.job_id, failure)
        world_size = job.assignment.world_size if job is not None else 0
        silent: frozenset[str] = frozenset()
        pending = False
        if incident.kind == common_pb2.FAILURE_KIND_TASK_HANG and job is not None:
            silent = self._silent_nodes(job, incident.first_seen.ToNanoseconds() / 1e9)
            pending = links.accounts_pending(incident, set(decide.nodes_of(job)))
        verdict = intake.route(incident, created, world_size, silent, pending)
        if verdict.route == intake.Route.HOLD and (created or pending):
            # Decided by the reconcile step after the hold (decide_held).
            hold_s = links.LINK_HOLD_S if pending else incidents.DECISION_HOLD_S
            threading.Timer(hold_s, self._ctx.wake.set).start()
        elif verdict.route == intake.Route.RESPOND:
            self._respond(incident, job)

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
        if created and self._ctx.metrics is not None:
            self._ctx.metrics.record_opened(incident)
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

    def record_node_losses(self, nodes: list[common_pb2.Node]) -> None:
        """The nodes' own incidents of their loss, in one write (a rack is a hundred nodes).
        No remedy waits for them: their jobs' incidents were recorded and answered already."""
        if not nodes:
            return
        now = self._ctx.clock()
        reports = [self.node_lost_report(node, "", 0) for node in nodes]
        updates = {incidents.incident_key(report): intake.merge_update(report, now) for report in reports}
        with self._lock:
            recorded = self._ctx.store.upsert_incidents(updates)
        for (incident, created), report in zip(recorded, reports, strict=True):
            self._announce(incident, created, report)

    def node_lost_report(self, node: common_pb2.Node, job_id: str, generation: int) -> common_pb2.FailureReport:
        last = max(node.last_heartbeat.ToNanoseconds() / 1e9, self._ctx.started_at)
        return incidents.node_lost_report(
            node.node_id, job_id, generation, last, self._ctx.settings.heartbeat_timeout_s
        )

    def jobs_lost_nodes(self, nodes: list[common_pb2.Node], jobs: list[common_pb2.Job]) -> None:
        """The incidents of the jobs of nodes just marked LOST. `jobs` says where their
        workers were (assignments change only when a replan commits, after this). A rack
        that vanishes hits dozens of jobs at once: their incidents open in one write (one
        per job, with a report per node it lost), then each is answered."""
        lost = {node.node_id: node for node in nodes}
        opening: dict[str, list[common_pb2.FailureReport]] = {}
        for job in jobs:
            reports = [
                self.node_lost_report(lost[node_id], job.job_id, job.assignment.generation)
                for node_id in decide.nodes_of(job)
                if node_id in lost
            ]
            if reports and job.state in state.ACTIVE:
                opening[job.job_id] = reports
            else:
                # A job that other ranks' errors already ended gets the node loss as the
                # root cause of its open incident; it opens no new one.
                for report in reports:
                    self.record(report, create=False)
        if opening:
            self._open_many(opening)
        for node in nodes:
            self._replanner.want(f"node {node.node_id} lost")

    def _open_many(self, reports_by_job: dict[str, list[common_pb2.FailureReport]]) -> None:
        """`record` for the reports of many jobs, their incidents written in one transaction.
        Each job is read again under the lock, as `record` does: a job that moved on to
        another generation meanwhile only has its reports join an open incident."""
        store, now = self._ctx.store, self._ctx.clock()
        with self._lock:
            if len(reports_by_job) <= FEW_JOBS:
                current = {job_id: store.get_job(job_id) for job_id in reports_by_job}
            else:  # one listing costs a few round trips, a read per job one each
                current = {job.job_id: job for job in store.list_jobs() if job.job_id in reports_by_job}
                reports_by_job = {job_id: reports for job_id, reports in reports_by_job.items() if job_id in current}
            opening = {
                job_id: reports
                for job_id, reports in reports_by_job.items()
                if intake.may_open(current[job_id], reports[0])
            }
            for job_id in reports_by_job.keys() - opening.keys():
                for report in reports_by_job[job_id]:
                    self._record_one(report, False, None)
            updates = {
                incidents.incident_key(reports[0]): _chained([intake.merge_update(r, now) for r in reports])
                for reports in opening.values()
            }
            recorded = store.upsert_incidents(updates)
            for (incident, created), (job_id, reports) in zip(recorded, opening.items(), strict=True):
                for i, report in enumerate(reports):
                    self._announce(incident, created and i == 0, report)
                self._answer(incident, created, current[job_id])

    def decide_held(self, now: float) -> None:
        """Responds to the incidents whose hold is over (also after a restart of the
        coordinator, which finds them undecided in the store)."""
        store, timeout_s = self._ctx.store, self._ctx.settings.heartbeat_timeout_s
        for incident in store.list_incidents(limit=50):
            silent: frozenset[str] = frozenset()
            pending = False
            hang = incident.kind == common_pb2.FAILURE_KIND_TASK_HANG and incident.job_id
            if hang and incident.remedy == common_pb2.REMEDY_UNSPECIFIED:
                job = store.get_job(incident.job_id)
                silent = self._silent_nodes(job, incident.first_seen.ToNanoseconds() / 1e9)
                pending = links.accounts_pending(incident, set(decide.nodes_of(job)))
            if intake.hold_is_over(incident, now, silent, timeout_s, pending):
                with self._lock:
                    current = store.get_incident(incident.incident_id)
                    if current is not None and current.remedy == common_pb2.REMEDY_UNSPECIFIED:
                        self._respond(current)

    def _silent_nodes(self, job: common_pb2.Job, since: float) -> frozenset[str]:
        """The job's READY nodes not heard from since `since` (when its hang began): a hang
        of a job whose every node still beats is its own; one of a job with a node gone
        quiet is more likely that node's loss, which its heartbeat timeout will tell."""
        mine = set(decide.nodes_of(job))
        return frozenset(
            n.node_id
            for n in self._nodes()
            if n.node_id in mine
            and n.state == common_pb2.NODE_STATE_READY
            and n.last_heartbeat.ToNanoseconds() / 1e9 < since
        )

    # ---- remedies ---------------------------------------------------------------------

    def _respond(self, incident: common_pb2.Incident, job: common_pb2.Job | None = None) -> None:
        """Picks the incident's remedy by the ladder and starts it (`job`: as `_record_one`
        read it, else read here)."""
        if not incident.job_id:
            if incident.severity == common_pb2.SEVERITY_SEV1 and incident.kind != common_pb2.FAILURE_KIND_NODE_LOST:
                self._isolate(incident)
            return
        store = self._ctx.store
        job = job or store.get_job(incident.job_id)
        if not remedies.applies(job, incident):
            return
        incident = self._part(incident, job)
        # One view of the nodes for the whole decision: each read is a round trip, and a
        # burst of lost nodes answers dozens of incidents in one reconcile step.
        states = store.node_states()
        decision = ladder.choose(
            incident.kind,
            job.remedies,
            self._ctx.clock(),
            self._ctx.settings.ladder,
            ranks_alive=incidents.ranks_alive(incident),
            placement_ready=all(states.get(n) == common_pb2.NODE_STATE_READY for n in decide.nodes_of(job)),
        )
        self._apply(incident, decision, job, states)

    def _apply(
        self,
        incident: common_pb2.Incident,
        decision: ladder.Decision,
        job: common_pb2.Job,
        states: Mapping[str, int],
    ) -> None:
        """Writes the decision (remedies.write), then acts on it. The new assignment and its
        rendezvous port are resolved from `job` first: the write applies only to the
        generation they were made for. `states`: every node's state, as read for the decision."""
        settings, now, remedy = self._ctx.settings, self._ctx.clock(), decision.remedy
        assignment = None
        if remedy == common_pb2.REMEDY_REATTEMPT:
            port = self._replanner.rendezvous_port(job.assignment.master_addr, job.assignment.master_port)
            assignment = remedies.reattempt_assignment(job, now, port)
        elif remedy == common_pb2.REMEDY_RESTART:
            assignment = self._replanner.new_assignment(job, decide.slots_by_node(job))
        given = remedies.Inputs(now, settings.ack_timeout_s, unreachable(states), settings.reform_restarts, assignment)
        healthy_waf, healthy_slots = cost.job_waf(job), job.assignment.world_size
        wrote = False

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            nonlocal wrote
            out = remedies.write(current, incident, decision, given)
            wrote = out is not None
            return out

        updated = self._ctx.store.update_job(incident.job_id, mutate)
        if not wrote:
            return  # the job moved on since the incident: nothing written
        log.warning(
            "remedy chosen",
            extra={
                "incident": incident.incident_id,
                "job_id": updated.job_id,
                "remedy": ladder.remedy_name(remedy) if remedy else "fail",
                "reason": decision.reason,
            },
        )
        self.update_incident(
            incident, lambda current: remedies.note(current, decision, now, healthy_waf, healthy_slots)
        )
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
            self._forget_job(job.job_id)
            self._replanner.want(f"job {job.job_id} failed")
        elif remedy == common_pb2.REMEDY_RECONFIGURE:
            if states.get(incident.node_id) == common_pb2.NODE_STATE_READY:
                self._isolate(incident)  # a node already lost or isolated is out of every plan
            self._replanner.want(f"incident {incident.incident_id} needs a new plan")

    def _isolate(self, incident: common_pb2.Incident) -> None:
        """Takes the incident's node out of the plan (SEV1) and opens an incident for every
        job with ranks there, unless it is already lost."""
        store, node_id = self._ctx.store, incident.node_id
        if not node_id or not store.set_node_state(
            node_id, common_pb2.NODE_STATE_ISOLATED, expected=common_pb2.NODE_STATE_READY, now=self._ctx.clock()
        ):
            return
        log.warning("node isolated", extra={"node_id": node_id, "incident": incident.incident_id})
        root = next(r for r in incident.reports if r.kind == incident.kind)
        for job in store.list_jobs():
            if job.job_id != incident.job_id and job.state in state.ACTIVE and node_id in decide.nodes_of(job):
                report = common_pb2.FailureReport()
                report.CopyFrom(root)
                report.job_id, report.generation = job.job_id, job.assignment.generation
                report.ClearField("rank")
                report.message = f"node {node_id} isolated: {incident.summary}"
                self.record(report)
        self._replanner.want(f"node {node_id} isolated")

    def _part(self, incident: common_pb2.Incident, job: common_pb2.Job) -> common_pb2.Incident:
        """Isolates the nodes a stalled job's reports find cut off from its peers (links.py),
        so that its remedy re-plans it without them rather than restarting it in place, onto
        the same broken links; the incident is then theirs (a reconfigure isolates the
        incident's node, which was only the first to report). Their agents still beat: they
        come back READY when they register again."""
        if incident.kind != common_pb2.FAILURE_KIND_TASK_HANG:
            return incident
        store = self._ctx.store
        parted = sorted(links.parted_nodes(incident, set(decide.nodes_of(job))))
        if not parted:
            return incident

        def blame(current: common_pb2.Incident) -> None:
            current.node_id = parted[0]

        incident = self.update_incident(incident, blame)
        for node_id in parted:
            if store.set_node_state(
                node_id, common_pb2.NODE_STATE_ISOLATED, expected=common_pb2.NODE_STATE_READY, now=self._ctx.clock()
            ):
                log.warning(
                    "node isolated: its links to the job's peers fail",
                    extra={"node_id": node_id, "incident": incident.incident_id, "job_id": job.job_id},
                )
                self._replanner.want(f"node {node_id} parted from its peers")
        return incident

    def update_incident(
        self, incident: common_pb2.Incident, edit: Callable[[common_pb2.Incident], None]
    ) -> common_pb2.Incident:
        """Compare-and-set edit of an incident, applied to what is stored now (other threads
        close incidents and add reports concurrently). Returns what was stored."""
        stored = self._ctx.store.update_incident(incident.incident_id, edit)
        if stored is None:
            raise NotFound(f"incident {incident.incident_id}")
        return stored

    # ---- after a remedy ---------------------------------------------------------------

    def close(
        self,
        job: common_pb2.Job,
        attempt: common_pb2.RemedyAttempt,
        report: node_service_pb2.IterationReport,
        now: float,
    ) -> None:
        """The remedy's incident ends with the job's first iteration after it."""
        incident = self._ctx.store.get_incident(attempt.incident_id)
        if incident is None:
            return
        resumed_waf = job.spec.weight * (report.flops / report.seconds if report.seconds > 0 else 0.0)

        def edit(current: common_pb2.Incident) -> None:
            current.resumed.FromNanoseconds(int(now * 1e9))
            current.cost.resumed_waf = resumed_waf
            current.cost.resumed_slots = job.assignment.world_size
            current.cost.CopyFrom(cost.resumed_cost(current))

        stored = self.update_incident(incident, edit)
        source = report.state_source or ("live" if attempt.remedy == common_pb2.REMEDY_REATTEMPT else "unknown")
        trace.record_span(
            attempt.traceparent,
            trace.RESUMED,
            attempt.started,
            now,
            {
                trace.ATTR_JOB: job.job_id,
                trace.ATTR_ITERATION: report.iteration,
                trace.ATTR_STATE_SOURCE: source,
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
        if self._ctx.metrics is not None:
            self._ctx.metrics.record_incident(stored)

    def accrue_sub_healthy(self, jobs: list[common_pb2.Job], seconds: float) -> None:
        """Charges each resumed incident for the time its job still runs smaller than it did
        before the failure."""
        for job in jobs:
            if job.state != state.RUNNING or not job.remedies or not seconds:
                continue
            for incident in self._ctx.store.list_incidents(job.job_id):
                if not incident.HasField("resumed") or not incident.cost.sub_healthy_waf:
                    continue
                before = incident.cost.sub_healthy_waf_seconds

                def edit(current: common_pb2.Incident, size: int = job.assignment.world_size) -> None:
                    current.cost.CopyFrom(cost.accrue_sub_healthy(current.cost, seconds, slots_now=size))

                updated = self.update_incident(incident, edit)
                if self._ctx.metrics is not None:
                    self._ctx.metrics.record_sub_healthy(updated, updated.cost.sub_healthy_waf_seconds - before)


def _chained(
    updates: list[Callable[[common_pb2.Incident | None], common_pb2.Incident]],
) -> Callable[[common_pb2.Incident | None], common_pb2.Incident]:
    """One incident update that applies `updates` in order (a job's reports of one step)."""

    def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
        for one in updates:
            current = one(current)
        assert current is not None
        return current

    return update
