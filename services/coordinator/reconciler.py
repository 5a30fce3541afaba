"""The reconcile loop: every step observes the nodes and jobs, decides with the pure
functions in decide.py, and acts through the parts (healing, re-planning)."""

from __future__ import annotations

import logging
import threading
import time

from services.coordinator import decide, ladder, state
from services.coordinator.context import Context
from services.coordinator.healing import Healer
from services.coordinator.registry import NodeRegistry
from services.coordinator.replan import Replanner
from services.coordinator.store import JobWrite
from unicron.errors import UnicronError
from unicron.v1 import common_pb2

log = logging.getLogger(__name__)

# How often incidents are charged for their jobs' sub-healthy running.
SUB_HEALTHY_PERIOD_S = 5.0
# A step slower than this is logged with the time of each of its parts: a slow step delays
# every loss detection and re-plan behind it (bench-load's burst at 2,000 nodes).
SLOW_STEP_S = 1.0


class Reconciler:
    def __init__(self, ctx: Context, registry: NodeRegistry, healer: Healer, replanner: Replanner) -> None:
        self._ctx = ctx
        self._registry = registry
        self._healer = healer
        self._replanner = replanner
        self._last_accrual = 0.0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def join(self, timeout_s: float) -> None:
        if self._thread:
            self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        ctx = self._ctx
        while not ctx.stopping.is_set():
            try:
                self.step()
            except UnicronError as exc:
                log.warning("reconcile step failed", extra={"error": str(exc)})
            except Exception:
                log.exception("reconcile step crashed")
            # A full interval after each step, however long it took: under a thousand nodes a
            # step takes a good part of the interval, and steps back to back would take the
            # CPU the heartbeats need.
            ctx.wake.wait(ctx.settings.reconcile_interval_s)
            ctx.wake.clear()

    def step(self) -> None:
        """Observe (nodes, jobs), decide (pure functions in decide.py), act."""
        store = self._ctx.store
        parts = _Stopwatch()
        self._registry.save_heartbeats()
        parts.lap("save_heartbeats")
        now = self._ctx.clock()
        # A rack that vanishes is a hundred nodes: all are marked LOST in one write, their
        # jobs' incidents follow (from one read of the jobs), and the nodes' own incidents,
        # which no remedy waits for, come after this step's re-plan.
        newly_lost = self._registry.mark_lost(self._registry.nodes(), now)
        parts.lap("mark_lost")
        if newly_lost:
            self._healer.jobs_lost_nodes(newly_lost, store.list_jobs())
            parts.lap("lost_node_incidents")
        try:
            self._jobs(now, parts)
        finally:
            self._healer.record_node_losses(newly_lost)
            parts.lap("node_incidents")
            if parts.total() > SLOW_STEP_S:
                log.warning(
                    "reconcile step slow",
                    extra={"seconds": round(parts.total(), 3), "parts": parts.laps, "lost": len(newly_lost)},
                )

    def _jobs(self, now: float, parts: _Stopwatch) -> None:
        self._healer.decide_held(now)
        parts.lap("held_incidents")
        jobs = self._ctx.store.list_jobs()
        parts.lap("list_jobs")
        for job_id, node_id in decide.overdue_workers(now, jobs):
            self._missed_ack(job_id, node_id, now)
        for job_id in decide.stalled_recoveries(now, jobs, self._ctx.settings.recovery_timeout_s):
            self._stalled(job_id, now)
        if now - self._last_accrual >= SUB_HEALTHY_PERIOD_S:
            self._healer.accrue_sub_healthy(jobs, now - self._last_accrual if self._last_accrual else 0.0)
            self._last_accrual = now
        parts.lap("overdue_and_accrual")
        nodes = self._registry.nodes()  # as the steps above left them (lost, isolated)
        self._replanner.step(jobs, nodes, now)
        parts.lap("replan")

    def _missed_ack(self, job_id: str, node_id: str, now: float) -> None:
        store = self._ctx.store
        job = store.get_job(job_id)
        worker = next((w for w in job.workers if w.node_id == node_id), None)
        if worker is None:
            return
        what = "start" if worker.state == state.WORKER_STARTING else "stop"
        limit = self._ctx.settings.ack_timeout_s

        def mutate(current: common_pb2.Job) -> JobWrite | None:
            for w in current.workers:
                if w.node_id == node_id and w.generation == worker.generation and w.HasField("deadline"):
                    state.move_worker(w, state.WORKER_FAILED, now, f"no acknowledgement of {what} within {limit:g}s")
                    return JobWrite()
            return None

        store.update_job(job_id, mutate)
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
            self._healer.record(report)

    def _stalled(self, job_id: str, now: float) -> None:
        """A remedy that brought no iteration back in time failed: a new incident, so the
        ladder escalates."""
        job = self._ctx.store.get_job(job_id)
        attempt = job.remedies[-1]
        report = common_pb2.FailureReport(
            job_id=job_id,
            generation=job.assignment.generation,
            node_id=next(iter(decide.nodes_of(job)), ""),
            kind=common_pb2.FAILURE_KIND_TRANSITION_TIMEOUT,
            source=common_pb2.DETECTION_SOURCE_STATISTICAL,
            message=(
                f"{ladder.remedy_name(attempt.remedy)} for {attempt.incident_id} brought no iteration back "
                f"within {self._ctx.settings.recovery_timeout_s:g}s"
            ),
        )
        report.first_seen.FromNanoseconds(int(now * 1e9))
        self._healer.record(report)


class _Stopwatch:
    """Seconds spent in each named part of a step, for the slow-step log line."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(self.laps.get(name, 0.0) + now - self._last, 3)
        self._last = now

    def total(self) -> float:
        return self._last - self._start
