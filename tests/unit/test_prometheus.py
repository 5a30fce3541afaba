"""The coordinator's Prometheus endpoint (services/coordinator/prometheus.py): the
instruments of services/coordinator/metrics.py scraped over HTTP in the text format."""

from __future__ import annotations

import logging
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from services.coordinator import cost, prometheus
from services.coordinator.__main__ import CoordinatorConfig
from services.coordinator.metrics import JOB_STATES, NODE_STATES, Census, CoordinatorMetrics, census
from services.coordinator.quotas import Quota, Quotas
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2 as pb
from unicron.v1 import job_service_pb2

GF = 1e9


def snapshot() -> job_service_pb2.GetClusterResponse:
    return job_service_pb2.GetClusterResponse(
        waf=5 * GF,
        jobs=[
            job_service_pb2.JobEfficiency(job_id="job-1", name="gpt", state=pb.JOB_STATE_RUNNING, waf=3 * GF),
            job_service_pb2.JobEfficiency(job_id="job-2", name="mlp", state=pb.JOB_STATE_RUNNING, waf=2 * GF),
        ],
    )


def fake_census() -> Census:
    waiting = pb.Job(state=pb.JOB_STATE_PENDING, spec=pb.JobSpec(priority_class="research"))
    waiting.created.FromSeconds(100)
    jobs = [pb.Job(state=pb.JOB_STATE_RUNNING)] * 2 + [waiting]
    nodes = [pb.Node(state=pb.NODE_STATE_READY)] * 3 + [pb.Node(state=pb.NODE_STATE_LOST)]
    return census(jobs, nodes, ("production", "research"), now=160.0, limits=QUOTAS)


QUOTAS = Quotas({"vision": Quota("vision", 2, 1), "nlp": Quota("nlp", 1, None)})


def costed_incident() -> pb.Incident:
    """A crash that took 2 s to detect and 8 s to heal on a job of 4 slots at 3 GFLOP/s,
    which came back on 3 slots."""
    incident = pb.Incident(kind=pb.FAILURE_KIND_PROCESS_EXIT, severity=pb.SEVERITY_SEV2, remedy=pb.REMEDY_RESTART)
    incident.first_seen.FromSeconds(100)
    incident.detected.FromSeconds(102)
    incident.resumed.FromSeconds(110)
    priced = cost.incident_cost(incident, 3 * GF, 3 * GF, 110)
    priced.healthy_slots, priced.resumed_slots = 4, 3
    priced.sub_healthy_waf = cost.size_loss(priced.healthy_waf, 4, 3)
    incident.cost.CopyFrom(priced)
    return incident


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=False)


@pytest.fixture
def coordinator_metrics(registry: CollectorRegistry) -> CoordinatorMetrics:
    return CoordinatorMetrics(
        snapshot,
        MeterProvider(metric_readers=[prometheus.new_reader(registry)]),
        census=fake_census,
    )


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[prometheus.MetricsServer]:
    served = prometheus.MetricsServer("127.0.0.1:0", registry).start()
    yield served
    served.stop()


def scrape(address: str) -> tuple[str, str]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as response:
        return response.headers["Content-Type"], response.read().decode()


def samples(text: str) -> dict[str, list[Sample]]:
    return {family.name: list(family.samples) for family in text_string_to_metric_families(text)}


def value(found: dict[str, list[Sample]], family: str, series: str, **labels: str) -> float:
    (match,) = [s.value for s in found[family] if s.name == series and s.labels == labels]
    return float(match)


def test_a_scrape_serves_every_metric_in_the_text_format(
    coordinator_metrics: CoordinatorMetrics, server: prometheus.MetricsServer
) -> None:
    incident = costed_incident()
    coordinator_metrics.record_opened(incident)
    coordinator_metrics.record_incident(incident)
    coordinator_metrics.record_sub_healthy(incident, 1.5 * GF)  # 2 s on 3 slots of 4: 0.75 GF/s lost
    assert server.address is not None
    content_type, text = scrape(server.address)
    assert content_type.startswith("text/plain; version=0.0.4")

    families = {family.name: family.type for family in text_string_to_metric_families(text)}
    assert families == prometheus.METRICS
    found = samples(text)
    assert value(found, "unicron_cluster_waf_flop_per_second", "unicron_cluster_waf_flop_per_second") == 5 * GF
    job = "unicron_job_waf_flop_per_second"
    assert value(found, job, job, job="gpt", job_id="job-1") == 3 * GF
    assert value(found, job, job, job="mlp", job_id="job-2") == 2 * GF
    jobs = {s.labels["state"]: s.value for s in found["unicron_jobs"]}
    assert set(jobs) == set(JOB_STATES) and jobs["running"] == 2 and jobs["pending"] == 1 and jobs["failed"] == 0
    nodes = {s.labels["state"]: s.value for s in found["unicron_nodes"]}
    assert nodes == {"ready": 3, "lost": 1, "isolated": 0} and set(nodes) == set(NODE_STATES)
    assert value(found, "unicron_incidents", "unicron_incidents_total", kind="process_exit", severity="SEV2") == 1

    cause = {"kind": "process_exit", "remedy": "restart"}
    detection = "unicron_incident_detection_seconds"
    assert value(found, detection, detection + "_count", **cause) == 1
    assert value(found, detection, detection + "_sum", **cause) == pytest.approx(2.0)
    assert value(found, detection, detection + "_bucket", **cause, le="1.0") == 0
    assert value(found, detection, detection + "_bucket", **cause, le="2.5") == 1
    transition = "unicron_incident_transition_seconds"
    assert value(found, transition, transition + "_sum", **cause) == pytest.approx(8.0)
    assert value(found, transition, transition + "_bucket", **cause, le="10.0") == 1

    waf = {s.labels["phase"]: s.value for s in found["unicron_incident_waf_seconds"]}
    assert waf == {"detection": pytest.approx(6 * GF), "transition": pytest.approx(24 * GF), "sub_healthy": 1.5 * GF}
    # Slots x seconds: 4 x 2 detecting, 4 x 8 transitioning, 1 missing x 2 s sub-healthy.
    slots = {s.labels["phase"]: s.value for s in found["unicron_incident_slot_seconds"]}
    assert slots == {"detection": pytest.approx(8.0), "transition": pytest.approx(32.0), "sub_healthy": 2.0}


def test_before_any_incident_the_gauges_and_the_incident_counts_at_zero_are_served(
    coordinator_metrics: CoordinatorMetrics, server: prometheus.MetricsServer
) -> None:
    """The incident counter is there from the start, 0 for every kind and severity: a series
    made by its first incident would be invisible to increase() over the range holding it."""
    assert server.address is not None
    gauges = {name for name, kind in prometheus.METRICS.items() if kind == "gauge"}
    families = {family.name: family for family in text_string_to_metric_families(scrape(server.address)[1])}
    assert set(families) == gauges | {"unicron_incidents"}
    counts = [s for s in families["unicron_incidents"].samples if s.name == "unicron_incidents_total"]
    assert len(counts) == (len(pb.FailureKind.keys()) - 1) * (len(pb.Severity.keys()) - 1)
    assert all(s.value == 0 for s in counts)
    assert {"kind": "ecc_error", "severity": "SEV1"} in [s.labels for s in counts]


def test_a_taken_port_is_tried_again_until_it_is_free(
    registry: CollectorRegistry, coordinator_metrics: CoordinatorMetrics, caplog: pytest.LogCaptureFixture
) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    served = prometheus.MetricsServer(f"127.0.0.1:{port}", registry, retry_s=0.05)
    with caplog.at_level(logging.WARNING, logger=prometheus.__name__):
        served.start()
    try:
        assert served.address is None and not served.wait_bound(0.2)
        assert f"cannot serve metrics on 127.0.0.1:{port}" in caplog.text
        holder.close()
        assert served.wait_bound(5.0)
        assert served.address == f"127.0.0.1:{port}"
        assert "unicron_cluster_waf_flop_per_second 5e+09" in scrape(f"127.0.0.1:{port}")[1]
    finally:
        served.stop()
        holder.close()
    with pytest.raises(urllib.error.URLError):
        scrape(f"127.0.0.1:{port}")


def test_stopping_ends_the_retries(registry: CollectorRegistry) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        served = prometheus.MetricsServer(f"127.0.0.1:{holder.getsockname()[1]}", registry, retry_s=0.05).start()
        served.stop()
    finally:
        holder.close()
    assert not served.wait_bound(0.3)


@pytest.mark.parametrize(
    ("bind", "want"),
    [("127.0.0.1:9464", ("127.0.0.1", 9464)), ("0.0.0.0:0", ("0.0.0.0", 0)), ("[::1]:9464", ("::1", 9464))],
)
def test_parse_bind(bind: str, want: tuple[str, int]) -> None:
    assert prometheus.parse_bind(bind) == want


@pytest.mark.parametrize("bind", ["9464", ":9464", "host:", "host:port", "host:70000"])
def test_a_bad_metrics_bind_is_refused_naming_the_setting(bind: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        CoordinatorConfig(plaintext=True, metrics_bind=bind)
    assert caught.value.field == "metrics_bind"
    assert CoordinatorConfig(plaintext=True, metrics_bind="").metrics_bind == ""


def test_family_of() -> None:
    assert prometheus.family_of("unicron_incidents_total") == "unicron_incidents"
    assert prometheus.family_of("unicron_incident_detection_seconds_bucket") == "unicron_incident_detection_seconds"
    assert prometheus.family_of("unicron_jobs") == "unicron_jobs"
    assert prometheus.family_of("unicron_jobs_total") is None  # a gauge has no _total
    assert prometheus.family_of("unicron_incidents") is None  # a counter's series is its _total
    assert prometheus.family_of("unicron_nothing") is None


def test_census_counts_every_state_and_names_them_all() -> None:
    counted = census(
        [pb.Job(state=pb.JOB_STATE_RECOVERING), pb.Job(state=pb.JOB_STATE_UNSPECIFIED)],
        [pb.Node(state=pb.NODE_STATE_ISOLATED)],
    )
    assert counted.jobs == {**dict.fromkeys(JOB_STATES, 0), "recovering": 1}
    assert counted.nodes == {"ready": 0, "lost": 0, "isolated": 1}


def test_census_gives_each_team_its_quota_and_use() -> None:
    running = pb.Job(state=pb.JOB_STATE_RUNNING, team="vision")
    running.assignment.workers.add(node_id="a", ranks=[0, 1, 2])
    counted = census([running], [], limits=QUOTAS)
    assert counted.teams == {
        "vision": {"guarantee": 2, "used": 3, "borrowed": 1, "borrow_limit": 1},
        "nlp": {"guarantee": 1, "used": 0, "borrowed": 0},  # may borrow any idle slot: no limit
    }


def test_census_counts_the_waiting_jobs_by_class_and_their_longest_wait() -> None:
    first, second, running = (pb.Job(spec=pb.JobSpec(priority_class="research")) for _ in range(3))
    first.state = second.state = pb.JOB_STATE_PENDING
    running.state = pb.JOB_STATE_RUNNING
    first.created.FromSeconds(100)
    second.created.FromSeconds(150)
    counted = census([first, second, running], [], ("production", "research"), now=200.0)
    assert counted.waiting == {"production": (0, 0.0), "research": (2, 100.0)}
