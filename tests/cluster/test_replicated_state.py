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
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import pytest

from tests.cluster.conftest import record
from tests.e2e.conftest import assert_exact, final_params, running, wait_for
from unicron.client import UnicronClient
from unicron.redisutil import LocalRedis
from unicron.v1 import common_pb2
from unicron_dev import netns
from unicron_dev.acked_writes import WriteProbe
from unicron_dev.localcluster import tiny_gpt
from unicron_dev.netcluster import NetCluster

pytestmark = pytest.mark.cluster

ITERATIONS = 150


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    why = netns.available()
    if why is not None:
        pytest.skip(f"namespace hosts: {why}")
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


def server_host(cluster: NetCluster, server: LocalRedis) -> str:
    assert cluster.redis_group is not None
    return f"r{cluster.redis_group.servers.index(server)}"


# Each fault is a generator: it starts the fault and yields (a trainer is killed then), then
# holds the fault as long as it lasts, waits for the failover it must cause, and undoes it.
Fault = Iterator[None]


def kill_primary(cluster: NetCluster) -> Fault:
    group = cluster.redis_group
    assert group is not None
    old = group.kill_primary()
    yield
    group.wait_healthy(60, not_primary=old)
    old.start()  # back as a replica of the new primary


def partition(cluster: NetCluster) -> Fault:
    """The primary and the active coordinator on one side; the replicas, the sentinels and the
    standby on the other. The agents and the client reach both sides."""
    group, network = cluster.redis_group, cluster.network
    assert group is not None and network is not None
    active = cluster._host(cluster.wait_active_coordinator())
    assert active is not None
    old = group.primary()
    minority = [server_host(cluster, old), active.name]
    majority = [name for name in [*cluster.redis_hosts(), "c0", "c1"] if name not in minority]
    network.cut(minority, majority)
    try:
        yield
        group.wait_healthy(60, not_primary=old)
        time.sleep(2.0)  # the minority's coordinator on its own a while: it must write nothing
    finally:
        for name in minority:
            network.heal(name)


def pause_primary(cluster: NetCluster) -> Fault:
    group = cluster.redis_group
    assert group is not None
    old = group.primary()
    group.pause(old)
    try:
        yield
        group.wait_healthy(60, not_primary=old)
    finally:
        group.resume(old)


def kill_sentinel(cluster: NetCluster) -> Fault:
    group = cluster.redis_group
    assert group is not None
    group.kill_sentinel(0)
    yield
    time.sleep(3.0)
    group.restart_sentinel(0)


def flap_primary(cluster: NetCluster) -> Fault:
    group, network = cluster.redis_group, cluster.network
    assert group is not None and network is not None
    host = server_host(cluster, group.primary())
    flapping = network.flap(host, period_s=1.5, duration_s=8.0)
    yield
    flapping.join()
    network.heal(host)


FAULTS: dict[str, Callable[[NetCluster], Fault]] = {
    "primary killed": kill_primary,
    "primary partitioned with the active coordinator": partition,
    "primary paused past the sentinels' timeout": pause_primary,
    "a sentinel killed": kill_sentinel,
    "primary's link flapping": flap_primary,
}


def kill_a_trainer(cluster: NetCluster, job_id: str) -> None:
    for trainer in cluster.trainer_processes(job_id):
        try:
            trainer.kill()
            return
        except psutil.NoSuchProcess:
            continue
    raise AssertionError(f"no live trainer of {job_id} to kill")


def restart_exited(cluster: NetCluster) -> list[str]:
    """Coordinators that stopped themselves (their lease lapsed) start again, as a supervisor
    would start them: as standbys."""
    restarted = []
    for service in cluster.services:
        if service.name.startswith("coordinator") and service.proc.poll() is not None:
            assert service.proc.returncode == 75, f"{service.name} exited {service.proc.returncode}"
            cluster.restart(service.name)
            restarted.append(service.name)
    return restarted


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
            faulty = FAULTS[fault](cluster)
            next(faulty)
            time.sleep(0.5)
            kill_a_trainer(cluster, job.job_id)  # a failure to heal while the control plane fails over
            killed_at = time.monotonic()
            for _ in faulty:
                pass
            group.wait_healthy(60)
            restarted = restart_exited(cluster)
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
