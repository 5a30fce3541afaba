"""The coordinator's OpenTelemetry metrics (docs/architecture.md: Observability): cluster and per-job WAF,
jobs and nodes by state as observable gauges read from a snapshot of the cluster; incidents
by kind and what each incident cost.

Like tracing (unicron/telemetry.py), metrics are exported over OTLP when
OTEL_EXPORTER_OTLP_ENDPOINT is set; with `prometheus`, the same instruments are also read by
a Prometheus reader that services/coordinator/prometheus.py serves over HTTP. Instrument
names and units are chosen so that the Prometheus names come out conventional
(prometheus.METRICS lists them)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import cast

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from services.coordinator import queue, quotas
from unicron import failures
from unicron.v1 import common_pb2 as pb
from unicron.v1 import job_service_pb2

METER = "unicron.coordinator"
# The gauges of one collection share one snapshot; a snapshot reads every job, node and
# incident, so it is not taken once per instrument.
SNAPSHOT_TTL_S = 1.0

# Seconds; OpenTelemetry's default buckets are for milliseconds. Detection takes from well
# under a second (a crash) to the heartbeat timeout or a collective's (tens of seconds);
# a transition from a reattempt's second to a re-plan's restart of minutes.
DETECTION_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TRANSITION_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)

_provider: SdkMeterProvider | None = None


def setup_metrics(service: str, export_interval_s: float = 15.0, prometheus: bool = False) -> SdkMeterProvider:
    """The process's meter provider, made global; once per process. With `prometheus`, a
    pull reader too, which prometheus.serve_metrics serves (its registry is global)."""
    global _provider
    if _provider is not None:
        return _provider
    readers: list[MetricReader] = []
    if prometheus:
        from services.coordinator import prometheus as prom

        readers.append(prom.reader())
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        # Imported lazily, like the span exporter: it brings its own gRPC channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

        readers.append(
            PeriodicExportingMetricReader(OTLPMetricExporter(), export_interval_millis=export_interval_s * 1000)
        )
    provider = SdkMeterProvider(
        resource=Resource.create({"service.name": f"unicron-{service}"}), metric_readers=readers
    )
    metrics.set_meter_provider(provider)
    _provider = provider
    return provider


def shutdown_metrics() -> None:
    if _provider is not None:
        _provider.shutdown()


def remedy_name(remedy: int) -> str:
    return pb.Remedy.Name(remedy).removeprefix("REMEDY_").lower() if remedy else "none"


def _state_names(enum: type[pb.JobState] | type[pb.NodeState], prefix: str) -> tuple[str, ...]:
    return tuple(name.removeprefix(prefix).lower() for name in enum.keys() if not name.endswith("_UNSPECIFIED"))


JOB_STATES = _state_names(pb.JobState, "JOB_STATE_")
NODE_STATES = _state_names(pb.NodeState, "NODE_STATE_")


@dataclass(frozen=True)
class Census:
    """How many jobs and nodes are in each state (lower-case state names), per priority
    class how many jobs wait and the longest wait in seconds, and per team its quota's slots
    (guarantee, borrow_limit where it has one) and its jobs' (used, borrowed)."""

    jobs: Mapping[str, int] = field(default_factory=dict)
    nodes: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, tuple[int, float]] = field(default_factory=dict)
    teams: Mapping[str, Mapping[str, int]] = field(default_factory=dict)


def census(
    jobs: Iterable[pb.Job],
    nodes: Iterable[pb.Node],
    classes: Iterable[str] = (),
    now: float | None = None,
    limits: quotas.Quotas = quotas.NONE,
) -> Census:
    """Every stored job and node counted by state; every state present, 0 when none is in it,
    so that a dashboard's series do not vanish. With ``now``, the waiting jobs by priority
    class (every class in ``classes`` present). Every team of ``limits`` with its slots."""
    jobs = list(jobs)
    by_job = dict.fromkeys(JOB_STATES, 0)
    for job in jobs:
        name = pb.JobState.Name(job.state).removeprefix("JOB_STATE_").lower()
        if name in by_job:
            by_job[name] += 1
    by_node = dict.fromkeys(NODE_STATES, 0)
    for node in nodes:
        name = pb.NodeState.Name(node.state).removeprefix("NODE_STATE_").lower()
        if name in by_node:
            by_node[name] += 1
    waiting: dict[str, tuple[int, float]] = dict.fromkeys(classes, (0, 0.0))
    if now is not None:
        for job in jobs:
            if job.state == pb.JOB_STATE_PENDING:
                count, longest = waiting.get(job.spec.priority_class, (0, 0.0))
                waited = max(0.0, now - queue.waiting_since(job))
                waiting[job.spec.priority_class] = (count + 1, max(longest, waited))
    used = quotas.used_slots(jobs)
    teams = {}
    for name, quota in limits.teams.items():
        slots = {"guarantee": quota.guarantee, "used": used.get(name, 0)}
        slots["borrowed"] = max(0, slots["used"] - quota.guarantee)
        if quota.borrow_limit is not None:
            slots["borrow_limit"] = quota.borrow_limit
        teams[name] = slots
    return Census(by_job, by_node, waiting, teams)


class CoordinatorMetrics:
    """Instruments of one coordinator. snapshot() and census() are called from a metric
    reader's thread at each collection; record_opened() once per incident, when it is
    opened; record_incident() once per incident, when its job resumes.

    Units: "flop/s" and "s" become the Prometheus suffixes `_flop_per_second` and
    `_seconds`; a count's unit is an annotation ("{incident}"), which adds no suffix."""

    def __init__(
        self,
        snapshot: Callable[[], job_service_pb2.GetClusterResponse],
        meter_provider: MeterProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
        census: Callable[[], Census] | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._census = census or Census
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: tuple[job_service_pb2.GetClusterResponse, Census] | None = None
        self._cached_at = 0.0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(METER)
        self._observables(meter)
        self._incidents = meter.create_counter(
            "unicron.incidents",
            unit="{incident}",
            description="Incidents opened, by root-cause kind and severity",
        )
        # Every kind and severity at 0 from the start: a series made by its first incident
        # would be invisible to increase() over the range that holds it (Prometheus counts
        # growth from a series' first sample), and the dashboard's count by range with it.
        for kind in pb.FailureKind.values():
            for severity in pb.Severity.values():
                if kind and severity:
                    labels = {
                        "kind": failures.kind_name(cast(pb.FailureKind, kind)),
                        "severity": failures.severity_name(cast(pb.Severity, severity)),
                    }
                    self._incidents.add(0, labels)
        self._detection = meter.create_histogram(
            "unicron.incident.detection_seconds",
            unit="s",
            description="From a failure's first sign to the coordinator holding a classified report",
            explicit_bucket_boundaries_advisory=DETECTION_BUCKETS_S,
        )
        self._transition = meter.create_histogram(
            "unicron.incident.transition_seconds",
            unit="s",
            description="From detection to the job's first good iteration after the remedy",
            explicit_bucket_boundaries_advisory=TRANSITION_BUCKETS_S,
        )
        self._waf_seconds = meter.create_counter(
            "unicron.incident.waf_seconds",
            unit="{WAF-second}",
            description="Weighted FLOP lost to failures (WAF x seconds), by phase",
        )
        self._slot_seconds = meter.create_counter(
            "unicron.incident.slot_seconds",
            unit="{slot-second}",
            description="Slot-seconds (GPU-seconds where a slot is a GPU) lost to failures, by phase",
        )

    def _observables(self, meter: metrics.Meter) -> None:
        meter.create_observable_gauge(
            "unicron.cluster.waf",
            callbacks=[self._observe_cluster],
            unit="flop/s",
            description="Weighted achieved FLOP/s of the whole cluster (sum over running jobs)",
        )
        meter.create_observable_gauge(
            "unicron.job.waf",
            callbacks=[self._observe_jobs],
            unit="flop/s",
            description="Weighted achieved FLOP/s of one job (weight x FLOP/s of its last iteration)",
        )
        meter.create_observable_gauge(
            "unicron.job.loss",
            callbacks=[self._observe_losses],
            unit="",
            description="A job's last training loss; with a 'metric' label, its loss function's report (e.g. lm loss)",
        )
        meter.create_observable_gauge(
            "unicron.job.learning_rate",
            callbacks=[self._observe_learning_rates],
            unit="",
            description="The learning rate of a job's last update",
        )
        meter.create_observable_gauge(
            "unicron.job.grad_norm",
            callbacks=[self._observe_grad_norms],
            unit="",
            description="The gradient norm of a job's last update, before clipping (jobs that clip)",
        )
        meter.create_observable_gauge(
            "unicron.job.validation_loss",
            callbacks=[self._observe_validation],
            unit="",
            description="A job's newest validation loss (jobs that evaluate)",
        )
        meter.create_observable_gauge(
            "unicron.job.skipped_steps",
            callbacks=[self._observe_skipped],
            unit="{step}",
            description="fp16 updates a job skipped for overflowing gradients, over its run",
        )
        meter.create_observable_gauge(
            "unicron.jobs",
            callbacks=[self._observe_job_states],
            unit="{job}",
            description="Stored jobs by state",
        )
        meter.create_observable_gauge(
            "unicron.queue.jobs",
            callbacks=[self._observe_queue_jobs],
            unit="{job}",
            description="Jobs waiting for slots, by priority class",
        )
        meter.create_observable_gauge(
            "unicron.queue.wait",
            callbacks=[self._observe_queue_wait],
            unit="s",
            description="The longest a job of the priority class has waited so far (0: none waits)",
        )
        meter.create_observable_gauge(
            "unicron.team.slots",
            callbacks=[self._observe_team_slots],
            unit="{slot}",
            description="Each team's quota and use in slots, by kind: guarantee, borrow_limit, used, borrowed",
        )
        meter.create_observable_gauge(
            "unicron.nodes",
            callbacks=[self._observe_node_states],
            unit="{node}",
            description="Registered nodes by state",
        )

    def _current(self) -> tuple[job_service_pb2.GetClusterResponse, Census]:
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached_at > SNAPSHOT_TTL_S:
                self._cached = (self._snapshot(), self._census())
                self._cached_at = now
            return self._cached

    def _observe_cluster(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current()[0].waf)]

    def _observe_jobs(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(job.waf, {"job": job.name, "job_id": job.job_id}) for job in self._current()[0].jobs]

    def _training(self) -> list[tuple[dict[str, str], pb.JobProgress]]:
        """(labels, progress) of every shown job that has reported an iteration."""
        return [
            ({"job": job.name, "job_id": job.job_id}, job.progress)
            for job in self._current()[0].jobs
            if job.progress.iteration
        ]

    def _observe_losses(self, options: CallbackOptions) -> Iterable[Observation]:
        out = []
        for labels, progress in self._training():
            out.append(Observation(progress.loss, labels))
            out += [Observation(v, {**labels, "metric": name}) for name, v in sorted(progress.metrics.items())]
        return out

    def _observe_learning_rates(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(progress.learning_rate, labels) for labels, progress in self._training()]

    def _observe_grad_norms(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(p.grad_norm, labels) for labels, p in self._training() if p.HasField("grad_norm")]

    def _observe_validation(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(p.validation_loss, labels) for labels, p in self._training() if p.validation_iteration]

    def _observe_skipped(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(p.skipped_steps, labels) for labels, p in self._training()]

    def _observe_job_states(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"state": state}) for state, n in self._current()[1].jobs.items()]

    def _observe_queue_jobs(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"priority_class": c}) for c, (n, _) in self._current()[1].waiting.items()]

    def _observe_queue_wait(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s, {"priority_class": c}) for c, (_, s) in self._current()[1].waiting.items()]

    def _observe_team_slots(self, options: CallbackOptions) -> Iterable[Observation]:
        teams = self._current()[1].teams
        return [Observation(n, {"team": t, "kind": k}) for t, slots in teams.items() for k, n in slots.items()]

    def _observe_node_states(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(n, {"state": state}) for state, n in self._current()[1].nodes.items()]

    def record_opened(self, incident: pb.Incident) -> None:
        self._incidents.add(
            1, {"kind": failures.kind_name(incident.kind), "severity": failures.severity_name(incident.severity)}
        )

    @staticmethod
    def _attributes(incident: pb.Incident) -> dict[str, str]:
        return {"kind": failures.kind_name(incident.kind), "remedy": remedy_name(incident.remedy)}

    def record_incident(self, incident: pb.Incident) -> None:
        """Records an incident's detection and transition once its job resumed (its cost is
        set), with any sub-healthy cost accrued by then; later sub-healthy accrual goes
        through record_sub_healthy."""
        if not incident.HasField("cost"):
            return
        c = incident.cost
        attributes = self._attributes(incident)
        self._detection.record(c.detection_seconds, attributes)
        self._transition.record(c.transition_seconds, attributes)
        for phase, value, seconds in (
            ("detection", c.detection_waf_seconds, c.detection_seconds),
            ("transition", c.transition_waf_seconds, c.transition_seconds),
        ):
            self._lost(attributes, phase, value, c.healthy_slots * seconds)
        self._lost(
            attributes,
            "sub_healthy",
            c.sub_healthy_waf_seconds,
            _sub_healthy_slot_seconds(c, c.sub_healthy_waf_seconds),
        )

    def record_sub_healthy(self, incident: pb.Incident, waf_seconds: float) -> None:
        """Counts waf_seconds more lost to running smaller after incident (the difference
        accrue_sub_healthy added to its cost)."""
        self._lost(
            self._attributes(incident),
            "sub_healthy",
            waf_seconds,
            _sub_healthy_slot_seconds(incident.cost, waf_seconds),
        )

    def _lost(self, attributes: dict[str, str], phase: str, waf_seconds: float, slot_seconds: float) -> None:
        if waf_seconds > 0:
            self._waf_seconds.add(waf_seconds, {**attributes, "phase": phase})
        if slot_seconds > 0:
            self._slot_seconds.add(slot_seconds, {**attributes, "phase": phase})


def _sub_healthy_slot_seconds(c: pb.FailureCost, waf_seconds: float) -> float:
    """The slots missing x the seconds behind waf_seconds of sub-healthy cost: that cost
    accrues at healthy_waf x (missing slots / healthy_slots) per second (cost.size_loss)."""
    if c.healthy_waf <= 0 or c.healthy_slots <= 0:
        return 0.0
    return waf_seconds / c.healthy_waf * c.healthy_slots
