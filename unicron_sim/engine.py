"""The discrete-event loop: a heap of timed callbacks, the modeled cluster's state, and the
accounting of weighted achieved FLOP/s (WAF) over time.

Time is simulated seconds from 0. The trace's failures and the strategies' own events (a
failure noticed, a job back in training, a node repaired) are processed in time order; ties
in the order they were scheduled. Between events every job runs at a constant rate: its WAF
(weight x T(size) x the strategy's failure-free factor) while it trains, 0 while it is down.
``waf_seconds`` is the integral of the cluster's WAF.

Incidents. A failure that stops a job opens an incident (``Incident``) unless the job already
has one that has not resumed (the failure then joins it, as the coordinator merges reports
into an open incident). Its cost is the coordinator's own model (``services.coordinator.cost``):
detection (first sign -> noticed) and transition (noticed -> training again) at the job's WAF
before the failure, and sub-healthy running afterwards, at the WAF lost by running on fewer
GPUs than before (``cost.size_loss``), until the job is back at that size or its next incident.
A job changed by a re-plan without being hit gets a ``replan`` record, priced the same way.

Effective training time (``JobRun.up_s``): the seconds a job trains, at whatever size; the
strategies charge lost and recomputed work as time down, so it is productive time. ETTR is its
share of the wall time (``runner.RunResult.ettr``). A strategy whose jobs spend part of each
iteration on something else (Unicron's buddy copies: ``sharded``) says so by ``job_factor``: the
job's WAF and its training time are both charged at that share (``JobRun.effective``).

Strategies (``strategies``) act through the methods below; the loop itself knows no policy.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from services.coordinator import cost
from unicron.v1 import common_pb2 as pb
from unicron_sim.model import GPUS_PER_NODE, ClusterModel, JobModel
from unicron_sim.traces import FailureEvent

Callback = Callable[..., None]


@dataclass
class Incident:
    """One failure's cost to one job (or one re-plan's, ``kind == "replan"``)."""

    job_id: str
    kind: str
    first_seen: float
    detected: float | None = None
    resumed: float | None = None
    remedy: str = ""
    cost: pb.FailureCost = field(default_factory=pb.FailureCost)
    failures: int = 1  # failures merged into it

    @property
    def detection_ws(self) -> float:
        return self.cost.detection_waf_seconds

    @property
    def transition_ws(self) -> float:
        return self.cost.transition_waf_seconds

    @property
    def sub_healthy_ws(self) -> float:
        return self.cost.sub_healthy_waf_seconds


@dataclass
class JobRun:
    """A job's state in one simulation. ``nodes``: the nodes it trains on (or will, once its
    transition ends); ``up``: training now; ``epoch`` invalidates scheduled resumes."""

    model: JobModel
    index: int
    nodes: list[int]
    up: bool = True
    epoch: int = 0
    rate: float = 0.0
    remedies: list[pb.RemedyAttempt] = field(default_factory=list)
    incident: Incident | None = None  # open (not resumed) or accruing sub-healthy time
    sub_since: float = 0.0
    resume_t: float = 0.0  # when the scheduled resume is due
    up_s: float = 0.0  # seconds trained until up_since
    up_since: float = 0.0
    effective: float = 1.0  # the share of its up time that trains (Strategy.job_factor)
    extra: dict[str, Any] = field(default_factory=dict)  # a strategy's own per-job state

    @property
    def job_id(self) -> str:
        return self.model.job_id

    @property
    def gpus(self) -> int:
        return len(self.nodes) * GPUS_PER_NODE


class Strategy(Protocol):
    name: str
    factor: float  # failure-free throughput relative to Megatron at the same size

    def start(self, sim: Sim) -> None: ...

    def on_failure(self, sim: Sim, event: FailureEvent) -> None: ...

    def on_repair(self, sim: Sim, node: int) -> None: ...

    def job_factor(self, job: JobModel, gpus: int) -> float: ...


class Sim:
    def __init__(self, cluster: ClusterModel, strategy: Strategy, duration_s: float, samples: int = 200) -> None:
        self.cluster = cluster
        self.strategy = strategy
        self.duration_s = duration_s
        self.now = 0.0
        self._queue: list[tuple[float, int, Callback, tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.owner: list[int] = [-1] * cluster.nodes
        self.down: list[bool] = [False] * cluster.nodes
        self.jobs: list[JobRun] = []
        for i, (job, nodes) in enumerate(zip(cluster.jobs, cluster.initial_placement(), strict=True)):
            run = JobRun(job, i, list(nodes))
            run.effective = self._effective(run)
            run.rate = self._rate(run)
            for n in nodes:
                self.owner[n] = i
            self.jobs.append(run)
        self.total_rate = sum(j.rate for j in self.jobs)
        self.waf_seconds = 0.0
        self._last = 0.0
        self.incidents: list[Incident] = []
        self.timeline: list[tuple[float, float]] = [(0.0, 0.0)]
        self.failures_seen = 0
        self.failures_ignored = 0  # on a node already out
        self.taken_out: list[float] = []  # when each node went out (for the re-plan invariant)
        self.counters: dict[str, int] = {}
        for k in range(1, samples + 1):
            self.at(duration_s * k / samples, self._sample)

    # --- the loop ------------------------------------------------------------------------------

    def at(self, t: float, fn: Callback, *args: Any) -> None:
        heapq.heappush(self._queue, (max(t, self.now), next(self._seq), fn, args))

    def run(self, trace: Sequence[FailureEvent]) -> None:
        self.strategy.start(self)
        events = iter(trace)
        pending = next(events, None)
        while True:
            queued = self._queue[0][0] if self._queue else None
            if pending is not None and pending.time_s < self.duration_s and (queued is None or pending.time_s < queued):
                self._advance(pending.time_s)
                self.failures_seen += 1
                if self.down[pending.node]:
                    self.failures_ignored += 1
                else:
                    self.strategy.on_failure(self, pending)
                pending = next(events, None)
                continue
            if queued is None or queued > self.duration_s:
                break
            t, _, fn, args = heapq.heappop(self._queue)
            self._advance(t)
            fn(*args)
        self._advance(self.duration_s)
        for job in self.jobs:
            self._accrue(job)
            if job.up:
                job.up_s += (self.now - job.up_since) * job.effective
                job.up_since = self.now

    def _advance(self, t: float) -> None:
        if t > self._last:
            self.waf_seconds += self.total_rate * (t - self._last)
            self._last = t
        self.now = t

    def _sample(self) -> None:
        self.timeline.append((self.now, self.waf_seconds))

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # --- rates ---------------------------------------------------------------------------------

    def _effective(self, job: JobRun) -> float:
        return self.strategy.job_factor(job.model, job.gpus) if job.gpus else 1.0

    def _rate(self, job: JobRun) -> float:
        if not job.up:
            return 0.0
        scale = job.extra.get("rate_scale")
        if scale is not None:  # strategies that run on any node count (linear in nodes)
            return float(scale) * self.strategy.factor
        return job.model.waf(job.gpus) * self.strategy.factor * job.effective

    def _set_up(self, job: JobRun, up: bool) -> None:
        self._accrue(job)  # charged at the state it was in until now
        if job.up:
            job.up_s += (self.now - job.up_since) * job.effective
        job.up_since = self.now
        job.up = up
        job.effective = self._effective(job)  # its size may have changed while it was down
        self._set_rate(job)

    def _set_rate(self, job: JobRun) -> None:
        self._accrue(job)
        new = self._rate(job)
        self.total_rate += new - job.rate
        job.rate = new

    def _accrue(self, job: JobRun) -> None:
        """Charges the job's accruing incident for its sub-healthy running since sub_since."""
        incident = job.incident
        if incident is not None and incident.resumed is not None and job.up:
            seconds = self.now - job.sub_since
            if seconds > 0:
                incident.cost = cost.accrue_sub_healthy(incident.cost, seconds, slots_now=job.gpus)
        job.sub_since = self.now

    # --- what strategies do --------------------------------------------------------------------

    def job_on(self, node: int) -> JobRun | None:
        index = self.owner[node]
        return self.jobs[index] if index >= 0 else None

    def free_nodes(self) -> list[int]:
        return [n for n in range(self.cluster.nodes) if self.owner[n] < 0 and not self.down[n]]

    def take_out(self, node: int, repair_s: float) -> None:
        """The node leaves the cluster until repaired (its job, if any, is the strategy's)."""
        if self.down[node]:
            return
        self.down[node] = True
        self.taken_out.append(self.now)
        self.at(self.now + repair_s, self._repaired, node)

    def _repaired(self, node: int) -> None:
        self.down[node] = False
        self.strategy.on_repair(self, node)

    def hit(self, job: JobRun, kind: str) -> Incident:
        """The job stops training now because of a failure; its (possibly merged) incident."""
        open_incident = job.incident if job.incident is not None and job.incident.resumed is None else None
        if open_incident is not None:
            open_incident.failures += 1
            self._stop(job)
            return open_incident
        healthy_waf, healthy_slots = job.rate, job.gpus
        self._stop(job)
        incident = Incident(job.job_id, kind, first_seen=self.now)
        incident.cost.healthy_waf = healthy_waf
        incident.cost.healthy_slots = healthy_slots
        job.incident = incident
        self.incidents.append(incident)
        return incident

    def detected(self, incident: Incident) -> None:
        if incident.detected is None:
            incident.detected = self.now

    def _stop(self, job: JobRun) -> None:
        if job.up:
            self._set_up(job, False)

    def assign(self, job: JobRun, nodes: Sequence[int]) -> None:
        """The job's nodes from now (it keeps training on them only once resumed)."""
        for n in job.nodes:
            if self.owner[n] == job.index:
                self.owner[n] = -1
        job.nodes = list(nodes)
        for n in job.nodes:
            self.owner[n] = job.index

    def place(self, job: JobRun, nodes: Sequence[int]) -> None:
        """Before anything runs: the job starts on ``nodes`` instead (none: it waits), at no
        cost (it arrives there; the coordinator's first plan places it)."""
        self.assign(job, nodes)
        self._set_up(job, bool(nodes))

    def change(self, job: JobRun, nodes: Sequence[int], transition_s: float, why: str = "replan") -> None:
        """A job not hit by a failure moves to ``nodes`` and pays ``transition_s``: a ``replan``
        incident (or its open incident, when it is recovering anyway)."""
        if job.up:
            incident = self.hit(job, why)
            incident.failures = 0
            self.detected(incident)
        self.assign(job, nodes)
        self.resume_at(job, self.now + transition_s)

    def resume_at(self, job: JobRun, t: float) -> None:
        """The job trains again on its nodes at t, or when the transition it is already in
        ends if that is later (a remedy does not cut another one short)."""
        if not job.up and job.resume_t > self.now:
            t = max(t, job.resume_t)
        job.epoch += 1
        job.resume_t = t
        self._stop(job)
        if job.nodes or job.extra.get("rate_scale"):
            self.at(t, self._resume, job, job.epoch)

    def wait(self, job: JobRun) -> None:
        """The job stays down with no resume scheduled (a strategy resumes it later)."""
        job.epoch += 1
        job.resume_t = 0.0
        self._stop(job)

    def _resume(self, job: JobRun, epoch: int) -> None:
        if epoch != job.epoch or job.up:
            return
        self._set_up(job, True)
        incident = job.incident
        if incident is not None and incident.resumed is None:
            self.detected(incident)
            incident.resumed = self.now
            stamp = pb.Incident()
            stamp.first_seen.FromNanoseconds(int(incident.first_seen * 1e9))
            stamp.detected.FromNanoseconds(int((incident.detected or incident.first_seen) * 1e9))
            priced = cost.incident_cost(stamp, incident.cost.healthy_waf, job.rate, self.now)
            priced.healthy_slots = incident.cost.healthy_slots
            priced.resumed_slots = job.gpus
            priced.sub_healthy_waf = cost.size_loss(priced.healthy_waf, priced.healthy_slots, job.gpus)
            incident.cost = priced
            job.sub_since = self.now

    def set_rate_scale(self, job: JobRun, scale: float | None) -> None:
        """For strategies whose jobs run on any node count: the job's WAF (before the
        strategy's factor) is ``scale`` instead of F(size); None goes back to F(size)."""
        if scale is None:
            job.extra.pop("rate_scale", None)
        else:
            job.extra["rate_scale"] = scale
        if job.up:
            self._set_rate(job)
