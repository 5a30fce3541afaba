"""The coordinator's Prometheus endpoint from outside: real coordinator processes (two,
on one Redis and a real planner, as unicron_dev.localcluster starts them) with this test as
their only node, scraped over HTTP. The node reports iterations, so a job has a WAF; then a
rank dies, so an incident is counted (every kind and severity is served from the start, at
0); then the active coordinator dies and the standby serves the same address."""

from __future__ import annotations

import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from tests.integration.test_job_api import tiny_spec
from unicron import rpc
from unicron.v1 import common_pb2, node_service_pb2, node_service_pb2_grpc
from unicron_dev.localcluster import LocalCluster

pytestmark = pytest.mark.integration

NODE = "n1"
FLOPS = 2e9  # per rank and iteration
SECONDS = 0.5  # per iteration


class FakeNode:
    """This test as an agent: registered, heartbeating, acknowledging and reporting."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.stub = node_service_pb2_grpc.NodeServiceStub(rpc.channel(cluster.coordinator, cluster.client_security()))
        self._stop = threading.Event()
        self._beats = threading.Thread(target=self._beat, daemon=True)

    def start(self) -> FakeNode:
        request = node_service_pb2.RegisterNodeRequest(node_id=NODE, address="127.0.0.1:7002", slots=2)
        self.stub.RegisterNode(request, timeout=10)
        self._beats.start()
        return self

    def _beat(self) -> None:
        while not self._stop.wait(0.3):
            try:
                known = self.stub.Heartbeat(node_service_pb2.HeartbeatRequest(node_id=NODE), timeout=2).known
                if not known:  # declared lost while no coordinator was active: join again
                    self.stub.RegisterNode(
                        node_service_pb2.RegisterNodeRequest(node_id=NODE, address="127.0.0.1:7002", slots=2),
                        timeout=2,
                    )
            except grpc.RpcError:
                pass  # between coordinators

    def stop(self) -> None:
        self._stop.set()
        self._beats.join(timeout=5)

    def ack(self, job: common_pb2.Job) -> None:
        self.stub.AckCommand(
            node_service_pb2.AckCommandRequest(
                node_id=NODE, job_id=job.job_id, generation=job.assignment.generation, ok=True
            ),
            timeout=5,
        )

    def report(self, job: common_pb2.Job, iteration: int) -> None:
        reports = [
            node_service_pb2.IterationReport(
                job_id=job.job_id,
                generation=job.assignment.generation,
                rank=rank,
                iteration=iteration,
                loss=3.0,
                seconds=SECONDS,
                tokens=64,
                flops=FLOPS,
                metrics={"lm loss": 3.0, "z loss": 0.25},
                learning_rate=2e-4,
                grad_norm=0.75,
                validation_loss=3.5,
            )
            for worker in job.assignment.workers
            for rank in worker.ranks
        ]
        self.stub.ReportProgress(node_service_pb2.ReportProgressRequest(node_id=NODE, reports=reports), timeout=5)

    def exit(self, job: common_pb2.Job, rank: int) -> None:
        self.stub.ReportWorkerExit(
            node_service_pb2.ReportWorkerExitRequest(
                node_id=NODE,
                job_id=job.job_id,
                generation=job.assignment.generation,
                rank=rank,
                exit_code=1,
                stderr_tail="Traceback...\nRuntimeError: boom\n",
            ),
            timeout=5,
        )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(Path(tmp_path_factory.mktemp("metrics")), agents=0, planners=1, coordinators=2, secure=False)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.fixture(scope="module")
def node(cluster: LocalCluster) -> Iterator[FakeNode]:
    fake = FakeNode(cluster).start()
    yield fake
    fake.stop()


Scraped = dict[str, list[Sample]]


def scrape(cluster: LocalCluster) -> Scraped:
    with urllib.request.urlopen(f"http://{cluster.metrics_address}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {family.name: list(family.samples) for family in text_string_to_metric_families(text)}


def scrape_until(cluster: LocalCluster, ready: Callable[[Scraped], bool], timeout_s: float = 30.0) -> Scraped:
    """Scrapes until ready(samples); the last scrape (or error) in the failure message."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while time.monotonic() < deadline:
        try:
            last = found = scrape(cluster)
            if ready(found):
                return found
        except (urllib.error.URLError, ConnectionError) as exc:
            last = exc
        time.sleep(0.2)
    raise AssertionError(f"no scrape of http://{cluster.metrics_address}/metrics was ready: {last}")


def single(found: Scraped, family: str, **labels: str) -> float | None:
    matches = [s.value for s in found.get(family, []) if labels.items() <= s.labels.items()]
    assert len(matches) <= 1, matches
    return matches[0] if matches else None


def running_job(cluster: LocalCluster, node: FakeNode) -> common_pb2.Job:
    with cluster.client() as client:
        job_id = client.submit(tiny_spec("metrics-gpt", data=2)).job_id
        deadline = time.monotonic() + 30
        while not (job := client.get(job_id)).assignment.workers:
            assert time.monotonic() < deadline, f"never scheduled: {job.state} {job.reason}"
            time.sleep(0.1)
        node.ack(job)
        node.report(job, 1)
        while (job := client.get(job_id)).state != common_pb2.JOB_STATE_RUNNING:
            assert time.monotonic() < deadline, f"never running: {job.state} {job.reason}"
            time.sleep(0.1)
        return job


def test_the_active_coordinator_serves_cluster_and_job_waf(cluster: LocalCluster, node: FakeNode) -> None:
    assert cluster.metrics_address.startswith("127.0.0.1:")
    job = running_job(cluster, node)
    found = scrape_until(cluster, lambda f: bool(single(f, "unicron_job_waf_flop_per_second", job_id=job.job_id)))
    job_waf = single(found, "unicron_job_waf_flop_per_second", job="metrics-gpt", job_id=job.job_id)
    assert job_waf is not None and job_waf > 0
    assert single(found, "unicron_cluster_waf_flop_per_second") == pytest.approx(job_waf)
    assert single(found, "unicron_jobs", state="running") == 1
    assert single(found, "unicron_nodes", state="ready") == 1
    # What the run shows: its loss, the loss function's report, learning rate, gradient norm
    # and validation loss, per job.
    labels = {"job": "metrics-gpt", "job_id": job.job_id}
    losses = {
        s.labels.get("metric", ""): s.value for s in found["unicron_job_loss"] if labels.items() <= s.labels.items()
    }
    assert losses == {"": 3.0, "lm loss": 3.0, "z loss": 0.25}
    assert single(found, "unicron_job_learning_rate", **labels) == pytest.approx(2e-4)
    assert single(found, "unicron_job_grad_norm", **labels) == 0.75
    assert single(found, "unicron_job_validation_loss", **labels) == 3.5
    assert single(found, "unicron_job_skipped_steps", **labels) == 0

    # A rank dies: the incident is counted by its kind and severity.
    node.exit(job, rank=1)
    found = scrape_until(cluster, lambda f: any(s.value for s in f.get("unicron_incidents", [])))
    (opened,) = [s for s in found["unicron_incidents"] if s.value]
    assert opened.name == "unicron_incidents_total" and opened.value == 1
    assert opened.labels["kind"] and opened.labels["severity"].startswith("SEV")


def test_only_the_active_coordinator_serves_and_the_standby_takes_the_address_over(
    cluster: LocalCluster, node: FakeNode
) -> None:
    active = cluster.wait_active_coordinator()
    (standby,) = [s.name for s in cluster.coordinator_services() if s.name != active]
    scrape_until(cluster, lambda f: "unicron_cluster_waf_flop_per_second" in f)
    assert "serving metrics" in cluster.service(active).log_path.read_text()
    assert "serving metrics" not in cluster.service(standby).log_path.read_text()

    cluster.kill(active, signal.SIGKILL)
    cluster.service(active).proc.wait()
    assert cluster.wait_active_coordinator(timeout_s=30, not_this=active) == standby
    found = scrape_until(cluster, lambda f: single(f, "unicron_nodes", state="ready") == 1)
    assert "serving metrics" in cluster.service(standby).log_path.read_text()
    # The new active coordinator counts from its own start (every kind and severity at 0).
    assert found["unicron_incidents"] and not any(s.value for s in found["unicron_incidents"])
