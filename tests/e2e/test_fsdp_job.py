"""An FSDP2 program healed through every service (coordinator, planners, agents, trainers as
separate processes on 127.0.0.1): the Llama-style example (examples/llama_fsdp, 1.07M
parameters sharded over two ranks, each on its own node) in bf16 mixed precision. A collective
timeout is reattempted in place, both ranks keeping their shards; a killed rank is restarted
and takes its shard from its buddy's copy on the other node (no snapshot, no checkpoint); the
job then trains to its last iteration. Exactness of the same remedies is measured beside the
failure-free run in tests/trainer/test_fsdp_exactness.py; here the services' side of them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import running, wait_for
from tests.e2e.healing import healed, incident_ids, inject, newest_incident
from unicron.client import UnicronClient
from unicron.v1 import common_pb2
from unicron_dev.localcluster import LocalCluster, llama_fsdp

pytestmark = pytest.mark.e2e

NAME = "fsdp-llama"
ITERATIONS = 250


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(Path(tmp_path_factory.mktemp("fsdp")), agents=2, slots_per_agent=1, fault_injection=True)
    cluster = running(local)
    yield next(cluster)
    next(cluster, None)


def _now(client: UnicronClient, incident: common_pb2.Incident) -> common_pb2.Incident:
    """The incident as it is now (its remedy is chosen after it is first seen)."""
    return next(i for i in client.incidents(incident.job_id) if i.incident_id == incident.incident_id)


def _resumed(job: common_pb2.Job) -> str:
    return next(c.reason for c in reversed(job.history) if "resumed" in c.reason)


def test_an_fsdp_job_is_reattempted_restarted_from_its_buddy_and_finishes(cluster: LocalCluster) -> None:
    spec = llama_fsdp(NAME, iterations=ITERATIONS, precision="bf16")
    spec.throughput[2] = 1.9e9  # measured-looking: the planner need not estimate a toy model
    with cluster.client() as client:
        client.submit(spec)
        before = wait_for(client, NAME, lambda j: j.progress.iteration >= 3, "never trained", timeout_s=240)
        assert before.assignment.world_size == 2
        assert list(before.assignment.copy_kept_by) == [1, 0]  # replication 2: the copies are mapped

        seen = incident_ids(client, NAME)
        inject(cluster, NAME, "exception:collective_timeout:allreduce", rank=1)
        reattempt = newest_incident(client, NAME, seen)
        after = healed(client, NAME, reattempt)
        assert _now(client, reattempt).remedy == common_pb2.REMEDY_REATTEMPT, _now(client, reattempt)
        assert "state: live" in _resumed(after) and "0 iterations recomputed" in _resumed(after), _resumed(after)

        # Killed (SIGKILL, by its own fault injector) at the start of its next backward: after
        # the step's buddy copy was refreshed. A kill while the copy is in flight leaves no
        # current copy, and the restart takes the nearest other source: the node's snapshot.
        seen = incident_ids(client, NAME)
        inject(cluster, NAME, f"crash@{after.progress.iteration + 5}", rank=1)
        restart = newest_incident(client, NAME, seen)
        after = healed(client, NAME, restart)
        assert _now(client, restart).remedy == common_pb2.REMEDY_RESTART, _now(client, restart)
        # Rank 1's shard of every parameter and moment was in no peer's own state: it came
        # from the copy rank 0 keeps on the other node.
        assert "state: buddy" in _resumed(after), _resumed(after)

        done = wait_for(
            client, NAME, lambda j: j.state == common_pb2.JOB_STATE_SUCCEEDED, "did not finish", timeout_s=300
        )
    assert done.progress.iteration == ITERATIONS
