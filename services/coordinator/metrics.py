"""The coordinator's OpenTelemetry metrics (docs/architecture.md: Observability): cluster and per-job WAF
as observable gauges read from a snapshot of the cluster, and what each incident cost.

Like tracing (unicron/telemetry.py), metrics are exported over OTLP when
OTEL_EXPORTER_OTLP_ENDPOINT is set and kept nowhere otherwise, so a first run needs no
collector."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation
from opentelemetry.sdk.metrics import MeterProvider as SdkMeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from unicron import failures
from unicron.v1 import common_pb2 as pb
from unicron.v1 import job_service_pb2

METER = "unicron.coordinator"
# The gauges of one collection share one snapshot; a snapshot reads every job, node and
# incident, so it is not taken once per instrument.
SNAPSHOT_TTL_S = 1.0

_provider: SdkMeterProvider | None = None


def setup_metrics(service: str, export_interval_s: float = 15.0) -> SdkMeterProvider:
    """The process's meter provider, made global; once per process."""
    global _provider
    if _provider is not None:
        return _provider
    readers: list[MetricReader] = []
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


class CoordinatorMetrics:
    """Instruments of one coordinator. snapshot() is called from the metric reader's thread
    at each collection; record_incident() once per incident, when its job resumes."""

    def __init__(
        self,
        snapshot: Callable[[], job_service_pb2.GetClusterResponse],
        meter_provider: MeterProvider | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._lock = threading.Lock()
        self._cached: job_service_pb2.GetClusterResponse | None = None
        self._cached_at = 0.0
        meter = (meter_provider or metrics.get_meter_provider()).get_meter(METER)
        meter.create_observable_gauge(
            "unicron.cluster.waf",
            callbacks=[self._observe_cluster],
            unit="FLOP/s",
            description="Weighted achieved FLOP/s of the whole cluster (sum over running jobs)",
        )
        meter.create_observable_gauge(
            "unicron.job.waf",
            callbacks=[self._observe_jobs],
            unit="FLOP/s",
            description="Weighted achieved FLOP/s of one job (weight x FLOP/s of its last iteration)",
        )
        self._detection = meter.create_histogram(
            "unicron.incident.detection_seconds",
            unit="s",
            description="From a failure's first sign to the coordinator holding a classified report",
        )
        self._transition = meter.create_histogram(
            "unicron.incident.transition_seconds",
            unit="s",
            description="From detection to the job's first good iteration after the remedy",
        )
        self._waf_seconds = meter.create_counter(
            "unicron.incident.waf_seconds",
            unit="FLOP",
            description="Weighted FLOP lost to failures (WAF x seconds), by phase",
        )

    def _current(self) -> job_service_pb2.GetClusterResponse:
        with self._lock:
            now = self._clock()
            if self._cached is None or now - self._cached_at > SNAPSHOT_TTL_S:
                self._cached = self._snapshot()
                self._cached_at = now
            return self._cached

    def _observe_cluster(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(self._current().waf)]

    def _observe_jobs(self, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(job.waf, {"job": job.name, "job_id": job.job_id}) for job in self._current().jobs]

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
        for phase, value in (
            ("detection", c.detection_waf_seconds),
            ("transition", c.transition_waf_seconds),
            ("sub_healthy", c.sub_healthy_waf_seconds),
        ):
            if value > 0:
                self._waf_seconds.add(value, {**attributes, "phase": phase})

    def record_sub_healthy(self, incident: pb.Incident, waf_seconds: float) -> None:
        """Counts waf_seconds more lost to running smaller after incident (the difference
        accrue_sub_healthy added to its cost)."""
        if waf_seconds > 0:
            self._waf_seconds.add(waf_seconds, {**self._attributes(incident), "phase": "sub_healthy"})
