"""The control plane's state replicated under Sentinel: a primary, two replicas and three
sentinels (real redis-server processes), two coordinators reaching them by a
redis+sentinel:// URL over mutual TLS. The primary is killed while a job trains and a client
keeps submitting and cancelling: no acknowledged write is lost, the job ends SUCCEEDED once
and bit-identical to a failure-free run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import assert_exact, final_params, running, wait_for
from unicron.v1 import common_pb2
from unicron_dev.acked_writes import WriteProbe
from unicron_dev.localcluster import LocalCluster, tiny_gpt

pytestmark = pytest.mark.e2e

ITERATIONS = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path_factory.mktemp("replicated"), agents=2, slots_per_agent=2, coordinators=2, redis_replicas=2
    )
    yield from running(local)


def succeeded_once(client: Any, name: str) -> common_pb2.Job:
    job = wait_for(client, name, lambda j: j.state == common_pb2.JOB_STATE_SUCCEEDED, "did not succeed", 240)
    assert sum(h.state == common_pb2.JOB_STATE_SUCCEEDED for h in job.history) == 1, job.history
    return job


def probe_spec(name: str) -> common_pb2.JobSpec:
    # Needs every slot and may not preempt: it waits in the queue while the training job runs,
    # and each cancel ends one.
    spec = tiny_gpt(name, data=4, iterations=10)
    spec.priority_class = "best-effort"
    return spec


def test_the_cluster_reaches_redis_through_sentinel(cluster: LocalCluster) -> None:
    assert cluster.redis_url is not None and cluster.redis_url.startswith("rediss+sentinel://")
    assert cluster.redis_group is not None
    primary = cluster.redis_group.primary()
    info: dict[str, Any] = cluster.redis_group._client(primary.host, primary.port).info("replication")  # type: ignore[assignment]
    assert info["role"] == "master" and int(info["connected_slaves"]) == 2


def test_a_killed_primary_loses_no_acknowledged_write_and_the_job_ends_exact(cluster: LocalCluster) -> None:
    group = cluster.redis_group
    assert group is not None
    with cluster.client() as client:
        client.submit(tiny_gpt("reference", iterations=ITERATIONS))
        reference = final_params(cluster, succeeded_once(client, "reference"))

        client.submit(tiny_gpt("through-failover", iterations=ITERATIONS))
        wait_for(client, "through-failover", lambda j: j.progress.iteration >= 10, "never trained")
        probe = WriteProbe(client, probe_spec).start()
        try:
            time.sleep(2.0)  # acknowledged writes before the fault too
            killed_at = time.monotonic()
            old = group.kill_primary()
            group.wait_healthy(30, not_primary=old)
            old.start()  # it comes back, and the sentinels make it a replica of the new one
            time.sleep(3.0)
        finally:
            probe.stop()
        assert probe.submitted and probe.first_success_after(killed_at) is not None, probe.last_error
        assert probe.lost(client) == []
        job = succeeded_once(client, "through-failover")
        print(
            f"failover: {len(probe.submitted)} submissions and {len(probe.cancelled)} cancels acknowledged, "
            f"{probe.failures} refused; no write for {probe.longest_gap_s(killed_at):.2f}s"
        )
    assert_exact(cluster, job, reference)
