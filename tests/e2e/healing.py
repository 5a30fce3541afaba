"""What the end-to-end tests of healing share: wait until a job trains on, find the incident a
fault made, wait until its remedy brought training back, inject a fault through the CLI."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from tests.e2e.conftest import wait_for
from unicron.client import UnicronClient
from unicron.v1 import common_pb2
from unicron_dev.localcluster import ROOT, LocalCluster


def trains_on(client: UnicronClient, name: str, timeout_s: float = 120) -> common_pb2.Job:
    """Waits until the job runs again and completes two more iterations; returns it."""
    job = wait_for(client, name, lambda j: j.state == common_pb2.JOB_STATE_RUNNING, "did not resume", timeout_s)
    start = job.progress.iteration
    return wait_for(client, name, lambda j: j.progress.iteration >= start + 2, "did not train on", timeout_s)


def newest_incident(client: UnicronClient, name: str, after: set[str]) -> common_pb2.Incident:
    """The newest incident not in `after`, other than a straggler finding: the cross-node
    monitor may flag a rank slowed by its node's warm spare starting (a finding recorded
    without a remedy), which is not the fault a test injected."""
    job_id = client.get(name).job_id
    deadline = time.monotonic() + 60
    while not (
        fresh := [
            i
            for i in client.incidents(job_id)
            if i.incident_id not in after and i.kind != common_pb2.FAILURE_KIND_STRAGGLER
        ]
    ):
        assert time.monotonic() < deadline, f"{name}: no new incident"
        time.sleep(0.2)
    return fresh[-1]


def healed(client: UnicronClient, name: str, incident: common_pb2.Incident, timeout_s: float = 120) -> common_pb2.Job:
    """Waits until ``incident``'s remedy brought training back (the incident is resumed), then
    for two more iterations; returns the job. Progress alone would not do: the agents batch
    iteration reports, so iterations from before the failure can still arrive after it."""
    job_id = client.get(name).job_id
    deadline = time.monotonic() + timeout_s
    while not next(i for i in client.incidents(job_id) if i.incident_id == incident.incident_id).HasField("resumed"):
        assert time.monotonic() < deadline, f"{name}: incident {incident.incident_id} never resumed"
        time.sleep(0.2)
    return trains_on(client, name, timeout_s)


def incident_ids(client: UnicronClient, name: str) -> set[str]:
    return {i.incident_id for i in client.incidents(client.get(name).job_id)}


def inject(cluster: LocalCluster, name: str, fault: str, rank: int) -> None:
    subprocess.run(
        [sys.executable, "-m", "unicron.cli", "--coordinator", cluster.coordinator, "inject", name, fault,
         "--rank", str(rank)],
        check=True, cwd=ROOT, capture_output=True, timeout=30, env={**os.environ, **cluster.client_env()},
    )  # fmt: skip
