"""What agents report: iterations (progress, the cross-node straggler monitor, a job that
resumes or finishes), failures, rank exits, injected faults and command acknowledgements.
Each batch is validated whole before anything is written."""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping

from google.protobuf.timestamp_pb2 import Timestamp

from services.coordinator import conditions, decide, incidents, ladder, state, transitions
from services.coordinator.context import Context
from services.coordinator.events import EventType, event
from services.coordinator.healing import Healer
from services.coordinator.replan import Replanner
from services.coordinator.reporters import check_reporter
from services.coordinator.store import JobWrite
from unicron.errors import InvalidArgument, NotFound, ResourceExhausted
from unicron.monitor import JobMonitor, ReportRejected
from unicron.ratelimit import KeyedLimiter
from unicron.v1 import common_pb2, node_service_pb2

log = logging.getLogger(__name__)

# An agent batches its trainers' reports every 0.2 s; this leaves room for bursts.
REPORTS_PER_NODE_PER_S = 100.0

# How much one iteration moves a size's measured FLOP/s (learned_throughput).
LEARNING_WEIGHT = 0.2

_NOT_YET_RUNNING = (common_pb2.WORKER_STATE_STARTING, common_pb2.WORKER_STATE_LAUNCHED)


def resumes(job: common_pb2.Job, report: node_service_pb2.IterationReport) -> bool:
    """Whether rank 0's report is the job's first iteration after a remedy or a move. A
    reattempt keeps the generation: only an iteration beyond the last one counts. Any
    other remedy started a new generation, which may restart from an older iteration."""
    if job.state != state.RECOVERING:
        return False
    pending = decide.pending_remedy(job)
    if pending is None:
        return True
    if pending.remedy == common_pb2.REMEDY_REATTEMPT:
        return report.iteration > job.progress.iteration
    return pending.generation == report.generation


def learned_throughput(
    measured: Mapping[int, float], size: int, flops_per_second: float, weight: float = LEARNING_WEIGHT
) -> dict[int, float]:
    """The job's measured FLOP/s per size after one more iteration at `size`: a running mean
    (exponentially weighted), so that one slow iteration moves it a little and a job that
    really got slower is believed within a few dozen."""
    out = dict(measured)
    if size < 1 or not flops_per_second > 0 or not math.isfinite(flops_per_second):
        return out
    before = out.get(size)
    out[size] = flops_per_second if before is None else before + weight * (flops_per_second - before)
    return out


def check_time(stamp: Timestamp, field: str) -> None:
    """A time an agent sent must be one a Timestamp can hold (years 1 to 9999): one out of
    range would fail every later read of what stores it."""
    try:
        stamp.ToNanoseconds()
    except ValueError:
        raise InvalidArgument(field, f"is not a valid time (seconds {stamp.seconds}, nanos {stamp.nanos})") from None


# What one iteration report may carry of the loss function's report dict (the trainer sends
# no more: unicron/trainer/step_report.py).
MAX_METRICS = 32
MAX_METRIC_NAME = 64


def _check_report(index: int, report: node_service_pb2.IterationReport) -> None:
    for name in ("seconds", "flops", "compute_seconds"):
        value = getattr(report, name)
        if not math.isfinite(value) or value < 0:
            raise InvalidArgument(f"reports[{index}].{name}", f"must be a finite non-negative number, got {value}")
    if report.iteration == 0:
        raise InvalidArgument(f"reports[{index}].iteration", "iterations count from 1")
    if len(report.metrics) > MAX_METRICS or any(len(name) > MAX_METRIC_NAME for name in report.metrics):
        raise InvalidArgument(
            f"reports[{index}].metrics", f"at most {MAX_METRICS} names of at most {MAX_METRIC_NAME} characters"
        )


def _last_line(text: str, limit: int = 300) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:limit] if lines else ""


def tokens_through(last_iteration: int, last_tokens: int, iteration: int, tokens: int) -> int:
    """The tokens the job's state has trained on once ``iteration`` (of ``tokens``) is done,
    each iteration counted once: a report lost (rank 0 stopped before its report left, a
    hang's restart) counts as the next one's, and iterations redone after a roll-back to
    a snapshot or checkpoint replace what they counted before. Exact when every iteration
    has the same tokens, as a fixed global batch of fixed-length samples has."""
    if last_iteration <= 0:
        return tokens
    if iteration > last_iteration:
        return last_tokens + tokens * (iteration - last_iteration)
    return round(last_tokens / last_iteration * (iteration - 1)) + tokens


class Monitors:
    """The cross-node straggler monitor of each running job generation. An agent compares
    only its own node's ranks; here every rank of the job is compared with every other, so
    a slow node shows too."""

    def __init__(self, ctx: Context) -> None:
        self._ctx = ctx
        self._by_job: dict[tuple[str, int], JobMonitor] = {}
        self._lock = threading.Lock()

    def observe(self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float) -> None:
        key = (job.job_id, job.assignment.generation)
        with self._lock:
            monitor = self._by_job.get(key)
            if monitor is None:
                for stale in [k for k in self._by_job if k[0] == job.job_id]:
                    del self._by_job[stale]
                monitor = self._by_job[key] = JobMonitor(
                    job.job_id, key[1], range(job.assignment.world_size), self._ctx.settings.monitor, now
                )
            try:
                monitor.observe(report.rank, report.iteration, report.seconds, report.compute_seconds, now)
            except ReportRejected:
                pass  # a retried batch repeats iterations; the agent already vetted each report

    def stragglers(self, job_ids: set[str], now: float) -> list[common_pb2.FailureReport]:
        with self._lock:
            findings = [
                finding
                for key, monitor in self._by_job.items()
                if key[0] in job_ids
                for finding in monitor.check(now)
                if finding.kind == common_pb2.FAILURE_KIND_STRAGGLER
            ]
        return [
            common_pb2.FailureReport(
                job_id=finding.job_id,
                generation=finding.generation,
                rank=finding.rank,
                kind=finding.kind,
                source=common_pb2.DETECTION_SOURCE_STATISTICAL,
                message=finding.message,
                statistics=finding.evidence,
                first_seen=_stamp(finding.first_seen),
            )
            for finding in findings
        ]

    def forget(self, job_id: str) -> None:
        with self._lock:
            for key in [k for k in self._by_job if k[0] == job_id]:
                del self._by_job[key]


def _stamp(seconds: float) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def check_generation(job: common_pb2.Job, generation: int, field: str) -> None:
    """A report of a generation older than the job's is stale, and changes nothing; one of
    a generation the coordinator never made is invalid: no agent can have started it."""
    if generation > job.assignment.generation:
        raise InvalidArgument(
            field,
            f"job {job.job_id} has no generation {generation} (its newest is {job.assignment.generation})",
        )


class Reports:
    def __init__(self, ctx: Context, healer: Healer, replanner: Replanner, monitors: Monitors) -> None:
        self._ctx = ctx
        self._healer = healer
        self._replanner = replanner
        self._monitors = monitors
        self._limiter = KeyedLimiter(REPORTS_PER_NODE_PER_S, REPORTS_PER_NODE_PER_S * 2)

    def admit(self, node_id: str) -> None:
        """Rate limit per node, so one misbehaving agent cannot starve the others."""
        if not node_id:
            raise InvalidArgument("node_id", "is required")
        if not self._limiter.allow(node_id):
            raise ResourceExhausted(f"node {node_id} sends reports faster than {REPORTS_PER_NODE_PER_S:g}/s")

    # ---- progress ---------------------------------------------------------------------

    def progress(self, node_id: str, reports: list[node_service_pb2.IterationReport]) -> None:
        """Validates the whole batch first, so a bad report changes nothing."""
        self.admit(node_id)
        store = self._ctx.store
        jobs: dict[str, common_pb2.Job] = {}
        for i, report in enumerate(reports):
            _check_report(i, report)
            if report.job_id not in jobs:
                jobs[report.job_id] = store.get_job(report.job_id)
            check_generation(jobs[report.job_id], report.generation, f"reports[{i}].generation")
            check_reporter(jobs[report.job_id], node_id, report.generation, report.rank, f"reports[{i}].rank")
        now = self._ctx.clock()
        for report in reports:
            jobs[report.job_id] = self._one(jobs[report.job_id], node_id, report, now)
        for straggler in self._monitors.stragglers(set(jobs), now):
            job = jobs[straggler.job_id]
            straggler.node_id = next((w.node_id for w in job.assignment.workers if straggler.rank in w.ranks), "")
            self._healer.record(straggler)

    def _one(
        self, job: common_pb2.Job, node_id: str, report: node_service_pb2.IterationReport, now: float
    ) -> common_pb2.Job:
        """One report of the batch; returns the job as it stands after it."""
        if job.assignment.generation != report.generation:
            # A remedy can overtake the last reports of the generation it replaced: they are
            # still the job's true progress (what a restart will have to recompute).
            if (
                report.rank == 0
                and report.generation < job.assignment.generation
                and job.state == state.RECOVERING
                and report.iteration > job.progress.iteration
            ):
                self._set_progress(job, report, now)
            return job
        if state.is_terminal(job.state):
            # Reports held back by an outage can arrive after the exits that ended the job:
            # they are still its true last iterations, but change nothing else.
            if report.rank == 0 and report.iteration > job.progress.iteration:
                self._set_progress(job, report, now)
            return job
        self._monitors.observe(job, report, now)
        job = self._conditions(job, report, now)
        if any(w.node_id == node_id and w.state in _NOT_YET_RUNNING for w in job.workers):
            job = self._ctx.store.update_job(
                job.job_id,
                lambda current: JobWrite() if transitions.mark_running(current, node_id, now) else None,
            )
        # Every rank reports; the loss is already averaged over data-parallel ranks, so
        # rank 0 speaks for the job.
        if report.rank != 0:
            return job
        resuming = resumes(job, report)
        if report.iteration <= job.progress.iteration and not resuming:
            return job  # a duplicate from a retried batch, or out of order: progress never goes back
        if resuming:
            job = self._resume(job, report, now) or job
        elif job.state == state.SCHEDULED:
            job = self.move(job.job_id, state.RUNNING, "training", only_from={state.SCHEDULED}) or job
        self._set_progress(job, report, now)
        return job

    def _conditions(self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float) -> common_pb2.Job:
        """Checkpoints or snapshots failing (or saved again): the job's conditions and an
        event, written only when one begins or clears."""
        if conditions.update(job.conditions, report, now) is None:
            return job

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            change = conditions.update(current.conditions, report, now)
            if change is None:
                return None
            del current.conditions[:]
            current.conditions.extend(change.conditions)
            for line in change.changes:
                log.warning("job condition", extra={"job_id": current.job_id, "condition": line})
            return JobWrite([event(current, EventType.JOB_EVENT_TYPE_CONDITION, now, line) for line in change.changes])

        return self._ctx.store.update_job(job.job_id, mutate)

    def _set_progress(self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float) -> None:
        """Stores rank 0's report as the job's progress (and updates `job` to match)."""
        flops_per_second = report.flops / report.seconds if report.seconds > 0 else 0.0
        measured: Mapping[int, float] = job.progress.measured_flops_per_second
        # The first iteration after a (re)start (it names where its state came from) pays
        # for warm-up, and a report of an older generation ran at another size.
        size = job.assignment.world_size
        replan = ""
        if report.generation == job.assignment.generation and not report.state_source:
            measured = learned_throughput(measured, size, flops_per_second)
            if size in measured and size not in job.progress.measured_flops_per_second and not job.spec.throughput:
                # The plan that sized the job had only an estimate here: plan again with the
                # measurement (once per size, so a job is not re-planned every iteration),
                # once it is written, so that the re-plan reads it.
                replan = f"throughput of {job.job_id} measured at {size} ranks"
        # An iteration redone after a remedy is counted once.
        skipped = report.skipped and report.iteration > job.progress.iteration
        progress = common_pb2.JobProgress(
            iteration=report.iteration,
            loss=report.loss,
            iteration_seconds=report.seconds,
            tokens=tokens_through(job.progress.iteration, job.progress.tokens, report.iteration, report.tokens),
            flops_per_second=flops_per_second,
            measured_flops_per_second=measured,
            metrics=report.metrics,
            learning_rate=report.learning_rate,
            skipped_steps=job.progress.skipped_steps + int(skipped),
            validation_loss=job.progress.validation_loss,
            validation_iteration=job.progress.validation_iteration,
        )
        if report.HasField("grad_norm"):
            progress.grad_norm = report.grad_norm
        if report.HasField("validation_loss"):
            progress.validation_loss, progress.validation_iteration = report.validation_loss, report.iteration
        progress.updated.FromNanoseconds(int(now * 1e9))
        message = f"iteration {report.iteration}/{job.spec.training.iterations} loss {report.loss:.4f}"
        if report.HasField("validation_loss"):
            message += f" validation loss {report.validation_loss:.4f}"
        self._ctx.store.set_progress(
            job.job_id,
            progress,
            event(job, EventType.JOB_EVENT_TYPE_PROGRESS, now, message, progress=progress),
        )
        job.progress.CopyFrom(progress)
        if replan:
            self._replanner.want(replan)

    def _resume(
        self, job: common_pb2.Job, report: node_service_pb2.IterationReport, now: float
    ) -> common_pb2.Job | None:
        """The first iteration after a remedy or a re-plan: the job runs again."""
        previous = job.progress.iteration
        pending_now = decide.pending_remedy(job)
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
            pending = decide.pending_remedy(current)
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

        updated = self._ctx.store.update_job(job.job_id, mutate)
        if updated.version == job.version:
            return None
        log.info("job resumed", extra={"job_id": job.job_id, "iteration": report.iteration, "source": source})
        if resumed is not None:
            self._healer.close(updated, resumed, report, now)
        return updated

    def move(
        self, job_id: str, target: int, reason: str, only_from: set[int] | frozenset[int]
    ) -> common_pb2.Job | None:
        """Moves the job to `target` if it is in one of `only_from`; the job, or None if not."""
        now = self._ctx.clock()
        moved = False

        def mutate(job: common_pb2.Job) -> JobWrite | None:
            nonlocal moved
            moved = job.state in only_from
            if not moved:
                return None
            state.transition(job, target, now, reason)
            if target == state.SUCCEEDED:
                transitions.finished(job, now)
            return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, now, reason)])

        job = self._ctx.store.update_job(job_id, mutate)
        if not moved:
            return None
        if state.is_terminal(target):
            self._monitors.forget(job_id)
            self._replanner.want(f"job {job_id} ended")
        log.info("job %s", state.state_name(target).lower(), extra={"job_id": job_id, "reason": reason})
        self._ctx.wake.set()
        return job

    # ---- failures, exits, faults, acknowledgements --------------------------------------

    def failure(self, node_id: str, report: common_pb2.FailureReport) -> common_pb2.Incident | None:
        """Records a report from an agent; returns its incident, or None for a report about
        a job generation that is already over (stale, not an error)."""
        self.admit(node_id)
        if report.kind == common_pb2.FAILURE_KIND_UNSPECIFIED:
            raise InvalidArgument("report.kind", "is required")
        if report.kind not in common_pb2.FailureKind.values():
            raise InvalidArgument("report.kind", f"unknown failure kind {report.kind}")
        if report.source not in common_pb2.DetectionSource.values():
            raise InvalidArgument("report.source", f"unknown detection source {report.source}")
        if not node_id or (report.node_id and report.node_id != node_id):
            raise InvalidArgument("report.node_id", "must name the reporting node")
        check_time(report.first_seen, "report.first_seen")
        if self._ctx.store.get_node(node_id) is None:
            raise NotFound(f"node {node_id!r} is not registered")
        if report.job_id:
            job = self._ctx.store.get_job(report.job_id)
            check_generation(job, report.generation, "report.generation")
            check_reporter(
                job, node_id, report.generation, report.rank if report.HasField("rank") else None, "report.rank"
            )
        stamped = common_pb2.FailureReport()
        stamped.CopyFrom(report)
        stamped.node_id = node_id
        return self._healer.record(stamped)  # NOT_FOUND for an unknown job, from record's read

    def worker_exit(self, request: node_service_pb2.ReportWorkerExitRequest) -> None:
        check_time(request.exited, "exited")
        store = self._ctx.store
        try:
            job = store.get_job(request.job_id)
        except NotFound:
            return
        check_generation(job, request.generation, "generation")
        # A rank the generation does not have is refused here too: counted, it would stand in
        # for a live rank, and the job would end while one still runs.
        check_reporter(job, request.node_id, request.generation, request.rank, "rank")
        if job.assignment.generation != request.generation or job.state not in state.ACTIVE:
            return
        code = -request.signal if request.signal else request.exit_code
        iterations = job.spec.training.iterations
        if code != 0 and iterations and request.last_iteration >= iterations:
            # It had done its last iteration: dying while it tore down loses no training, and a
            # restart would only wait on peers that are finishing (or gone) for good.
            how = f"signal {request.signal}" if request.signal else f"exit code {request.exit_code}"
            message = f"rank {request.rank} ended with {how} after its last iteration {request.last_iteration}"
            log.warning("rank failed after its last iteration", extra={"job_id": job.job_id, "rank": request.rank})
            store.append_event(job.job_id, event(job, EventType.JOB_EVENT_TYPE_FAILURE, self._ctx.clock(), message))
            code = 0
        exits = store.record_exit(job.job_id, request.generation, request.rank, code)
        stopping = any(
            w.node_id == request.node_id and w.generation == request.generation and w.state == state.WORKER_STOPPING
            for w in job.workers
        )
        exited = request.exited.ToNanoseconds() / 1e9 if request.HasField("exited") else self._ctx.clock()
        done = max(request.last_iteration, job.progress.iteration)
        if code == 0 and not stopping and iterations and done < iterations:
            # A clean exit before the last iteration is the program's doing (it returned early):
            # restarting it would end the same way.
            report = incidents.worker_exit_report(
                request.node_id, job.job_id, request.generation, request.rank, 0, 0, "", exited
            )
            report.kind = common_pb2.FAILURE_KIND_PROGRAM_ERROR
            report.message = f"the program exited 0 after iteration {done} of {iterations}, before its last"
            self._healer.record(report)
        elif code != 0 and not stopping:
            # A signal's victim left no explanation; an exit's last stderr line often is one.
            error = request.error or ("" if request.signal else _last_line(request.stderr_tail))
            self._healer.record(
                incidents.worker_exit_report(
                    request.node_id,
                    job.job_id,
                    request.generation,
                    request.rank,
                    request.exit_code,
                    request.signal,
                    error,
                    exited,
                )
            )
        elif len(exits) == job.assignment.world_size and all(c == 0 for c in exits.values()):
            self.move(job.job_id, state.SUCCEEDED, f"all {len(exits)} ranks finished", only_from=state.ACTIVE)

    def fault_injected(self, request: node_service_pb2.ReportFaultInjectedRequest) -> None:
        fault = request.fault
        if fault.kind == common_pb2.FAULT_KIND_UNSPECIFIED or fault.kind not in common_pb2.FaultKind.values():
            raise InvalidArgument("fault.kind", f"unknown fault kind {fault.kind}")
        check_time(request.injected, "injected")
        try:
            job = self._ctx.store.get_job(request.job_id)
        except NotFound:
            return
        at = request.injected.ToNanoseconds() / 1e9 if request.HasField("injected") else self._ctx.clock()
        name = common_pb2.FaultKind.Name(fault.kind).removeprefix("FAULT_KIND_").lower()
        message = f"fault {name} injected on rank {fault.rank} ({request.node_id})"
        self._ctx.store.append_event(job.job_id, event(job, EventType.JOB_EVENT_TYPE_FAULT_INJECTED, at, message))

    def ack(self, request: node_service_pb2.AckCommandRequest) -> None:
        """An agent confirms a start or stop; late and duplicate acks change nothing, an ack
        for a job that does not exist is NOT_FOUND."""
        if not request.node_id:
            raise InvalidArgument("node_id", "is required")
        if not request.job_id:
            raise InvalidArgument("job_id", "is required")
        now = self._ctx.clock()
        self._ctx.store.update_job(
            self._ctx.store.get_job(request.job_id).job_id,  # by id, also when named by name
            lambda job: JobWrite()
            if transitions.acknowledge(job, request.node_id, request.generation, request.ok, request.error, now)
            else None,
        )
        if not request.ok:
            log.warning(
                "agent could not carry out a command",
                extra={"node_id": request.node_id, "job_id": request.job_id, "error": request.error},
            )
