"""Detection end to end: faults injected into real trainers (CLI -> coordinator -> agent ->
trainer), detected by the agent's detectors, classified, merged into one incident, and
answered by the ladder's first remedy. Each test cancels its job, so the next one starts on
an idle cluster."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import running
from unicron.client import UnicronClient
from unicron.monitor import MonitorSettings
from unicron.v1 import common_pb2
from unicron_dev.localcluster import ROOT, LocalCluster, tiny_gpt

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(Path(tmp_path_factory.mktemp("detect")), fault_injection=True)
    yield from running(local)


@pytest.fixture(autouse=True)
def cancel_leftovers(cluster: LocalCluster) -> Iterator[None]:
    """A test that fails before it cancels its job would leave the slots taken for the next."""
    yield
    with cluster.client() as client:
        for job in client.list_jobs():
            if job.state in ACTIVE_OR_PENDING:
                client.cancel(job.job_id)


ACTIVE_OR_PENDING = (
    common_pb2.JOB_STATE_PENDING,
    common_pb2.JOB_STATE_SCHEDULED,
    common_pb2.JOB_STATE_RUNNING,
    common_pb2.JOB_STATE_RECOVERING,
)


def start_job(client: UnicronClient, name: str, data: int = 2) -> common_pb2.Job:
    job = client.submit(tiny_gpt(name, data))
    deadline = time.monotonic() + 120
    while client.get(job.job_id).progress.iteration < 5:  # past the detectors' warm-up
        assert time.monotonic() < deadline, "job never trained"
        time.sleep(0.2)
    return client.get(job.job_id)


def inject(cluster: LocalCluster, job: common_pb2.Job, fault: str, rank: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "unicron.cli", "--coordinator", cluster.coordinator, "inject", job.job_id, fault,
         "--rank", str(rank)],
        check=True, cwd=ROOT, capture_output=True, timeout=30, env={**os.environ, **cluster.client_env()},
    )  # fmt: skip


def incident_and_fault_time(
    client: UnicronClient, job: common_pb2.Job, timeout_s: float = 30
) -> tuple[common_pb2.Incident, float]:
    deadline = time.monotonic() + timeout_s
    while not client.incidents(job.job_id):
        assert time.monotonic() < deadline, "no incident"
        time.sleep(0.1)
    time.sleep(1.0)  # let late reports from other ranks join
    fired = []
    # The job keeps training after its remedy, so the watch never ends by itself: stop at
    # the fault's announcement.
    for e in client.watch(job.job_id, after_event_id="0"):
        if e.type == common_pb2.JOB_EVENT_TYPE_FAULT_INJECTED:
            fired.append(e.time.ToNanoseconds() / 1e9)
            break
        assert time.monotonic() < deadline + 30, "the fault never announced itself"
    assert fired, "the fault never announced itself"
    found = client.incidents(job.job_id)
    assert len(found) == 1, [(i.summary, [r.message for r in i.reports]) for i in found]
    return found[0], fired[0]


def latency(incident: common_pb2.Incident, fired: float) -> float:
    return incident.detected.ToNanoseconds() / 1e9 - fired


def test_an_exception_is_classified_and_peers_join_its_incident(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = start_job(client, "det-exception")
        inject(cluster, job, "exception:ecc_error", rank=1)
        incident, fired = incident_and_fault_time(client, job)
        after = client.get(job.job_id)
        nodes = {n.node_id: n.state for n in client.nodes()}
        client.cancel(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_ECC_ERROR
    assert incident.severity == common_pb2.SEVERITY_SEV1 and incident.recommended_action == "reconfigure"
    root = next(r for r in incident.reports if r.source == common_pb2.DETECTION_SOURCE_EXCEPTION and r.rank == 1)
    assert "uncorrectable ECC" in root.message
    assert latency(incident, fired) < 2.0
    # SEV1: the node is isolated and the job re-planned around it.
    assert incident.remedy == common_pb2.REMEDY_RECONFIGURE
    assert [a.remedy for a in after.remedies] == [common_pb2.REMEDY_RECONFIGURE]
    assert nodes[incident.node_id] == common_pb2.NODE_STATE_ISOLATED
    # Repaired: its agent registers again and the node is back in the plan.
    cluster.kill(incident.node_id, signal.SIGTERM)
    cluster.service(incident.node_id).proc.wait(timeout=30)
    cluster.restart(incident.node_id)
    with cluster.client() as client:
        cluster.wait_nodes(client.nodes, 2)


def test_a_crash_is_seen_by_process_supervision(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = start_job(client, "det-crash")
        inject(cluster, job, "crash", rank=0)
        incident, fired = incident_and_fault_time(client, job)
        client.cancel(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_PROCESS_EXIT
    assert incident.remedy == common_pb2.REMEDY_RESTART
    root = next(r for r in incident.reports if r.source == common_pb2.DETECTION_SOURCE_PROCESS_SUPERVISION)
    assert root.signal == 9 and root.rank == 0
    assert latency(incident, fired) < 2.0


def test_a_stopped_trainer_is_a_hang_with_evidence(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = start_job(client, "det-hang")
        inject(cluster, job, "hang", rank=1)
        incident, fired = incident_and_fault_time(client, job, timeout_s=60)
        # A hang's remedy waits until every node of the job beat since the hang began (a
        # silent node would be a lost one): at most a heartbeat interval, plus a step.
        deadline = time.monotonic() + 10
        while incident.remedy == common_pb2.REMEDY_UNSPECIFIED and time.monotonic() < deadline:
            time.sleep(0.2)
            incident = next(i for i in client.incidents(job.job_id) if i.incident_id == incident.incident_id)
        client.cancel(job.job_id)
    assert incident.kind == common_pb2.FAILURE_KIND_TASK_HANG
    assert incident.remedy == common_pb2.REMEDY_RESTART
    hang = next(r for r in incident.reports if r.kind == common_pb2.FAILURE_KIND_TASK_HANG)
    stats = dict(hang.statistics)
    assert stats["silent_s"] > stats["threshold_s"] >= MonitorSettings().floor_s
    assert "rank" in hang.stack_trace  # per-rank stacks or process states, taken before acting
    # Detected within k x mean iteration time (+ the monitor's period and the stack capture).
    assert latency(incident, fired) < stats["threshold_s"] + 1.5


def test_a_lost_agent_is_a_lost_node(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = start_job(client, "det-agent")
        victim = next(w.node_id for w in job.assignment.workers if 1 in w.ranks)
        inject(cluster, job, "agent-loss", rank=1)
        deadline = time.monotonic() + 30
        # An incident is on record (detected) a moment before its remedy is (decided).
        while not [
            i
            for i in client.incidents(job.job_id)
            if i.kind == common_pb2.FAILURE_KIND_NODE_LOST and i.remedy != common_pb2.REMEDY_UNSPECIFIED
        ]:
            assert time.monotonic() < deadline, f"node loss not detected and answered: {client.incidents(job.job_id)}"
            time.sleep(0.2)
        (incident,) = client.incidents(job.job_id)
        nodes = {n.node_id: n.state for n in client.nodes()}
        client.cancel(job.job_id)
    assert incident.node_id == victim
    assert incident.remedy == common_pb2.REMEDY_RECONFIGURE
    assert nodes[victim] == common_pb2.NODE_STATE_LOST
    cluster.restart(victim)  # the agent comes back and registers again
    with cluster.client() as client:
        cluster.wait_nodes(client.nodes, 2)
