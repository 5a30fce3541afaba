"""The coordinator's metrics where clusters look for them: a Prometheus text-format
endpoint (docs/architecture.md: Observability).

A Prometheus reader sits beside the OTLP one on the same meter provider
(metrics.setup_metrics), so the instruments of metrics.CoordinatorMetrics feed both; a scrape
collects them then and there. Only the active coordinator serves it: a standby holds no
Coordinator and measures nothing. The endpoint is plain HTTP with no authentication, as
Prometheus scrapes expect, hence the loopback default of `metrics_bind`.

A bind that fails (another process has the port: on one machine, the active coordinator
that was just replaced may not have exited yet) does not stop the coordinator: it says so
and tries again until it binds or the coordinator stops."""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CollectorRegistry, start_http_server

from unicron.errors import InvalidArgument

log = logging.getLogger(__name__)

DEFAULT_BIND = "127.0.0.1:9464"  # the port OpenTelemetry's Prometheus exporter uses by default
RETRY_S = 2.0

# Every metric family the coordinator exports: its Prometheus name and type (a histogram's
# series are its _bucket, _sum and _count, a counter's its _total). The dashboard
# (deploy/grafana/dashboards/unicron.json) may query these only; a test scrapes a
# coordinator and checks that this is what comes out.
METRICS = {
    "unicron_cluster_waf_flop_per_second": "gauge",
    "unicron_job_waf_flop_per_second": "gauge",  # {job, job_id}
    "unicron_jobs": "gauge",  # {state}
    "unicron_nodes": "gauge",  # {state}
    "unicron_queue_jobs": "gauge",  # {priority_class}
    "unicron_queue_wait_seconds": "gauge",  # {priority_class}
    "unicron_team_slots": "gauge",  # {team, kind}
    "unicron_incidents": "counter",  # {kind, severity}
    "unicron_incident_detection_seconds": "histogram",  # {kind, remedy}
    "unicron_incident_transition_seconds": "histogram",  # {kind, remedy}
    "unicron_incident_waf_seconds": "counter",  # {kind, remedy, phase}
    "unicron_incident_slot_seconds": "counter",  # {kind, remedy, phase}
}
SERIES_SUFFIXES = {"gauge": ("",), "counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}


def family_of(series: str) -> str | None:
    """The exported family a series name belongs to (unicron_incidents_total ->
    unicron_incidents); None when it belongs to none."""
    for family, kind in METRICS.items():
        if any(series == family + suffix for suffix in SERIES_SUFFIXES[kind]):
            return family
    return None


_registry: CollectorRegistry | None = None


def reader() -> PrometheusMetricReader:
    """The process's Prometheus reader, in a registry of its own (not prometheus_client's
    global one, which would add the Python process's own metrics); once per process."""
    global _registry
    if _registry is not None:
        raise RuntimeError("the Prometheus reader is made once per process")
    _registry = CollectorRegistry(auto_describe=False)
    return new_reader(_registry)


def new_reader(registry: CollectorRegistry) -> PrometheusMetricReader:
    # The scope labels (otel_scope_name...) would be on every series and say nothing: every
    # instrument is the coordinator's. target_info likewise: Prometheus labels the target.
    return PrometheusMetricReader(disable_target_info=True, scope_info_enabled=False, registry=registry)


def parse_bind(bind: str, field: str = "metrics_bind") -> tuple[str, int]:
    """host:port ([v6]:port) -> (host, port); port 0 binds any free one."""
    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise InvalidArgument(field, f"must be host:port or empty, not {bind!r}")
    return host.removeprefix("[").removesuffix("]"), int(port)


class MetricsServer:
    """The HTTP endpoint of one registry: GET /metrics (any path answers the same)."""

    def __init__(self, bind: str, registry: CollectorRegistry, retry_s: float = RETRY_S) -> None:
        self._host, self._port = parse_bind(bind)
        self._bind = bind
        self._registry = registry
        self._retry_s = retry_s
        self._httpd: WSGIServer | None = None
        self._stopping = threading.Event()
        self._bound = threading.Event()
        self._lock = threading.Lock()

    @property
    def address(self) -> str | None:
        """host:port it serves on (the port it got, for port 0); None until bound."""
        with self._lock:
            if self._httpd is None:
                return None
            port = self._httpd.server_port
        return f"[{self._host}]:{port}" if ":" in self._host else f"{self._host}:{port}"

    def start(self) -> MetricsServer:
        if not self._try_bind(first=True):
            threading.Thread(target=self._retry, name="metrics-bind", daemon=True).start()
        return self

    def wait_bound(self, timeout_s: float) -> bool:
        return self._bound.wait(timeout_s)

    def _try_bind(self, first: bool) -> bool:
        try:
            httpd, _thread = start_http_server(self._port, addr=self._host, registry=self._registry)
        except OSError as exc:
            if first:
                log.warning(
                    "cannot serve metrics on %s (%s); trying again every %gs",
                    self._bind,
                    exc.strerror or exc,
                    self._retry_s,
                    extra={"metrics_bind": self._bind},
                )
            return False
        with self._lock:
            if self._stopping.is_set():  # stopped while binding
                _close(httpd)
                return True
            self._httpd = httpd
        self._bound.set()
        log.info("serving metrics", extra={"address": f"http://{self.address}/metrics"})
        return True

    def _retry(self) -> None:
        while not self._stopping.wait(self._retry_s):
            if self._try_bind(first=False):
                return

    def stop(self) -> None:
        self._stopping.set()
        with self._lock:
            httpd, self._httpd = self._httpd, None
        if httpd is not None:
            _close(httpd)


def _close(httpd: WSGIServer) -> None:
    httpd.shutdown()
    httpd.server_close()


def serve_metrics(bind: str) -> MetricsServer:
    """Serves the process's Prometheus reader (metrics.setup_metrics(prometheus=True)) on bind."""
    if _registry is None:
        raise RuntimeError("setup_metrics(prometheus=True) first")
    return MetricsServer(bind, _registry).start()
