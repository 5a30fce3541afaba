"""The control plane's state under faults of its own machines: Redis replicated under Sentinel
on network-namespace hosts (`r0`..`r2` its servers, `s0`..`s2` its sentinels, `c0` and `c1`
the coordinators), while a job trains and a client keeps submitting and cancelling jobs.

Each fault: the primary killed; the primary and the active coordinator cut off from everything
else (a partition with a coordinator on each side); the primary paused (SIGSTOP) past the
sentinels' timeout and resumed; a sentinel killed; the primary's link flapping. A trainer is
killed half a second into each, so that a failure arrives while the control plane fails over.
Each must lose no acknowledged write, and the job must end SUCCEEDED once, bit-identical to the
failure-free run."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.cluster.conftest import namespace_hosts, record
from tests.e2e.conftest import assert_exact, final_params, running, wait_for
from unicron.client import UnicronClient
from unicron.v1 import common_pb2
from unicron_dev.acked_writes import WriteProbe
from unicron_dev.localcluster import tiny_gpt
from unicron_dev.netcluster import NetCluster
from unicron_dev.redis_faults import FAULTS, RankWatch, kill_a_trainer, restart_exited_coordinators

pytestmark = pytest.mark.cluster

ITERATIONS = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    namespace_hosts()
    local = NetCluster(
        tmp_path_factory.mktemp("replicated"),
        agents=2,
        slots_per_agent=2,
        coordinators=2,
        redis_replicas=2,
        fault_injection=True,
    )
    yield from running(local)


def succeeded_once(client: UnicronClient, name: str) -> common_pb2.Job:
    job = wait_for(client, name, lambda j: j.state == common_pb2.JOB_STATE_SUCCEEDED, "did not succeed", 300)
    assert sum(h.state == common_pb2.JOB_STATE_SUCCEEDED for h in job.history) == 1, job.history
    return job


@pytest.fixture(scope="module")
def reference(cluster: NetCluster) -> dict[str, Any]:
    with cluster.client() as client:
        client.submit(tiny_gpt("reference", iterations=ITERATIONS))
        return final_params(cluster, succeeded_once(client, "reference"))


def probe_spec(name: str) -> common_pb2.JobSpec:
    # Needs every slot and may not preempt: it waits while the training job runs.
    spec = tiny_gpt(name, data=4, iterations=10)
    spec.priority_class = "best-effort"
    return spec


@pytest.mark.parametrize("fault", list(FAULTS))
def test_no_acknowledged_write_is_lost_and_the_job_ends_exact(
    cluster: NetCluster, reference: dict[str, Any], fault: str
) -> None:
    group = cluster.redis_group
    assert group is not None
    name = "job-" + "-".join(word.removesuffix("'s") for word in fault.split()[:2])
    with cluster.client() as client:
        job = client.submit(tiny_gpt(name, iterations=ITERATIONS))
        wait_for(client, name, lambda j: j.progress.iteration >= 10, "never trained")
        probe = WriteProbe(client, probe_spec, prefix=f"acked-{name}").start()
        try:
            time.sleep(1.0)
            started = time.monotonic()
            before = client.get(name)
            watch = RankWatch(cluster, job.job_id).start()
            faulty = FAULTS[fault](cluster)
            next(faulty)
            time.sleep(0.5)
            kill_a_trainer(cluster, job.job_id)  # a failure to heal while the control plane fails over
            killed_at = time.monotonic()
            for _ in faulty:
                pass
            group.wait_healthy(60)
            restarted = restart_exited_coordinators(cluster)
            cluster.wait_active_coordinator(timeout_s=60)
            healed = wait_for(
                client,
                name,
                lambda j: j.assignment.generation > before.assignment.generation
                and j.progress.iteration > before.progress.iteration + 2,
                "never healed",
                120,
            )
            heal_s = time.monotonic() - killed_at
            time.sleep(2.0)
        finally:
            probe.stop()
            watch.stop()
        for coordinator in restarted:
            # A coordinator that lost its lease decided nothing after it said so.
            log = cluster.service(coordinator).log_path.read_text()
            after = log[log.rindex("lost the coordinator lease") :]
            after = after[: after.find("standby: waiting") if "standby: waiting" in after else None]
            assert "remedy chosen" not in after and "plan carried out" not in after, coordinator
        lost = probe.lost(client)
        assert lost == [], lost
        assert probe.first_success_after(started) is not None, probe.last_error
        assert_exact(cluster, succeeded_once(client, name), reference)
    record(
        f"redis: {fault}",
        acknowledged=len(probe.submitted) + len(probe.cancelled),
        refused=probe.failures,
        lost=len(lost),
        no_write_s=probe.longest_gap_s(started),
        heal_s=heal_s,
        generation=healed.assignment.generation,
        restarted=",".join(restarted) or "-",
    )
    print(f"{fault}: refused because {probe.refusals}")
    # Found by this check once (a partition: the standby declared a node LOST while the cut-off
    # coordinator still answered its heartbeats; the node came back with the old generation's
    # rank alive). Agents now kill what the coordinator wrote off when they register again.
    assert not watch.doubled, f"a rank alive under two generations ({len(watch.doubled)} samples): {watch.doubled[0]}"
