"""Jobs across namespace hosts, and what a real network does to them. Each fault's expected
outcome is in its test's docstring: how fast it is detected, what it is classified as, the
remedy, and that the job ends SUCCEEDED exactly once."""

from __future__ import annotations

import json
import socket
import struct
import time
from pathlib import Path
from typing import Any

import pytest

from services.agent.supervisor import REGISTRY_FILE
from tests.cluster.conftest import assert_exact, elastic, nodes_of, record, succeeded_once
from tests.e2e.conftest import wait_for
from unicron.v1 import common_pb2
from unicron_dev.localcluster import tiny_gpt
from unicron_dev.netcluster import NetCluster

pytestmark = pytest.mark.cluster


def test_a_job_trains_across_four_hosts_over_their_links(cluster: NetCluster) -> None:
    """Four ranks, one per host: rendezvous at rank 0's host address, gloo over each host's
    eth0 (the agents name it to their trainers), and the job ends SUCCEEDED."""
    with cluster.client() as client:
        job = client.submit(tiny_gpt("across", data=4, iterations=30))
        running = wait_for(client, "across", lambda j: j.progress.iteration >= 2, "never trained")
        nodes = {w.node_id for w in running.assignment.workers}
        assert len(nodes) == 4
        rank0 = next(w.node_id for w in running.assignment.workers if 0 in w.ranks)
        assert running.assignment.master_addr == cluster.host(cluster.node_host(rank0)).address
        trainers = cluster.trainer_processes(job.job_id)
        assert len(trainers) == 4
        for trainer in trainers:
            env = trainer.environ()
            assert env.get("GLOO_SOCKET_IFNAME") == "eth0", env.get("GLOO_SOCKET_IFNAME")
            assert env.get("MASTER_ADDR", running.assignment.master_addr) == running.assignment.master_addr
        # The ranks' connections to each other go over the bridge, between host addresses.
        hosts = {cluster.host(cluster.node_host(n)).address for n in nodes}
        for trainer in trainers:
            here = cluster.host(cluster.node_host(next(n for n in nodes if trainer.pid in pids_on(cluster, n))))
            assert established_peers(trainer.pid) & (hosts - {here.address}), trainer.pid
        succeeded_once(client, "across")


def pids_on(cluster: NetCluster, node_id: str) -> set[int]:
    registry = cluster.run_dir / "agents" / node_id / REGISTRY_FILE
    return {entry["pid"] for entry in json.loads(registry.read_text())}


def established_peers(pid: int) -> set[str]:
    """Remote IPv4 addresses of the established TCP connections in the process's network
    namespace (its /proc/<pid>/net/tcp: the root namespace's tables do not show them)."""
    found = set()
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "01":  # ESTABLISHED
            remote = fields[2].split(":")[0]
            found.add(socket.inet_ntoa(struct.pack("<I", int(remote, 16))))
    return found


def test_a_pulled_cable_is_a_lost_node_and_the_job_goes_on_without_it(
    cluster: NetCluster, reference: dict[str, Any]
) -> None:
    """The cable of a host with a rank is pulled for at least 8 s, then plugged back in.
    Expected: the survivors' agents see the job hang first (under a second) and that hang
    waits for the silent host's heartbeat verdict; no heartbeat for 3 s -> NODE_LOST (within
    5 s of the pull), the incident's root cause, and one remedy, reconfigure: the job resizes
    onto the hosts it has left (its peers keep their state) and trains on; the host comes
    back READY; the job ends SUCCEEDED exactly once."""
    assert cluster.network is not None
    with cluster.client() as client:
        client.submit(elastic("cable"))
        before = wait_for(client, "cable", lambda j: j.progress.iteration >= 5, "never trained")
        victim = next(w.node_id for w in before.assignment.workers if 0 not in w.ranks)
        host = cluster.node_host(victim)
        pulled = time.time()
        cluster.network.link_down(host)
        try:
            lost = wait_for(
                client,
                "cable",
                lambda j: any(i.kind == common_pb2.FAILURE_KIND_NODE_LOST for i in client.incidents(j.job_id)),
                "the lost node was never noticed",
                timeout_s=30,
            )
            incident = next(i for i in client.incidents(lost.job_id) if i.kind == common_pb2.FAILURE_KIND_NODE_LOST)
            assert incident.detected.ToNanoseconds() / 1e9 - pulled < 5.0
            moved = wait_for(
                client,
                "cable",
                lambda j: j.state == common_pb2.JOB_STATE_RUNNING and victim not in nodes_of(j),
                "the job did not go on without the host",
                timeout_s=30,
            )
            record(
                "cable pulled",
                detected_s=incident.detected.ToNanoseconds() / 1e9 - pulled,
                running_again_s=time.time() - pulled,
                ranks=f"4 -> {moved.assignment.world_size}",
            )
            wait_for(client, "cable", lambda j: j.progress.iteration > moved.progress.iteration + 3, "no progress")
            time.sleep(max(0.0, 8.0 - (time.time() - pulled)))
        finally:
            cluster.network.link_up(host)
        job = succeeded_once(client, "cable")
        assert_exact(cluster, job, reference)
        assert victim not in {w.node_id for w in job.assignment.workers} or job.assignment.generation > 1
        # One remedy: the survivors' hang (they stopped when the host did) waited for the
        # heartbeat verdict instead of restarting the job onto the silent host.
        assert [r.remedy for r in job.remedies] == [common_pb2.REMEDY_RECONFIGURE], job.remedies
        wait_for(
            client,
            "cable",
            lambda _: any(n.node_id == victim and n.state == common_pb2.NODE_STATE_READY for n in client.nodes()),
            "the host did not come back",
            timeout_s=30,
        )


def test_a_host_cut_off_from_the_control_plane_only_is_fenced_and_the_job_goes_on(
    cluster: NetCluster, reference: dict[str, Any]
) -> None:
    """A host with a rank loses the coordinators and the control host (its agent cannot
    heartbeat) while its trainers still reach their peers. Expected: NODE_LOST within 5 s,
    remedy reconfigure: the job goes on without that host; its old rank trains no further
    generation and nothing it or its agent reports later changes the job; once the cut heals
    the agent registers again and the node is READY; the job ends SUCCEEDED exactly once."""
    assert cluster.network is not None
    control = ["ctl", *(f"c{i}" for i in range(cluster.coordinators))]
    with cluster.client() as client:
        client.submit(elastic("fenced"))
        before = wait_for(client, "fenced", lambda j: j.progress.iteration >= 5, "never trained")
        victim = next(w.node_id for w in before.assignment.workers if 0 not in w.ranks)
        host = cluster.node_host(victim)
        cut_at = time.time()
        cluster.network.cut([host], control)
        try:
            moved = wait_for(
                client,
                "fenced",
                lambda j: j.assignment.generation > before.assignment.generation and victim not in nodes_of(j),
                "the job never moved off the cut-off host",
                timeout_s=60,
            )
            lost = next(i for i in client.incidents(moved.job_id) if i.kind == common_pb2.FAILURE_KIND_NODE_LOST)
            assert lost.detected.ToNanoseconds() / 1e9 - cut_at < 5.0
            record(
                "cut off from the control plane",
                detected_s=lost.detected.ToNanoseconds() / 1e9 - cut_at,
                moved_s=time.time() - cut_at,
                ranks=f"4 -> {moved.assignment.world_size}",
            )
            wait_for(client, "fenced", lambda j: j.progress.iteration > moved.progress.iteration + 3, "no progress")
        finally:
            cluster.network.heal(host)
        job = succeeded_once(client, "fenced")
        assert_exact(cluster, job, reference)
        # Reports of the old generation from the cut-off host opened nothing after the cut.
        late = [
            i
            for i in client.incidents(job.job_id)
            if i.generation == before.assignment.generation
            and i.kind != common_pb2.FAILURE_KIND_NODE_LOST
            and i.detected.ToNanoseconds() / 1e9 > cut_at + 1.0
            and i.node_id == victim
        ]
        assert late == [], late
        wait_for(
            client,
            "fenced",
            lambda _: any(n.node_id == victim and n.state == common_pb2.NODE_STATE_READY for n in client.nodes()),
            "the host did not come back",
            timeout_s=30,
        )


def test_two_hosts_lost_within_a_second_are_one_re_plan_and_the_job_goes_on(
    cluster: NetCluster, reference: dict[str, Any]
) -> None:
    """The cables of two hosts with ranks are pulled 0.5 s apart. Expected: both NODE_LOST
    within 5 s, the job (four ranks) resizes onto the two hosts it has left, its surviving
    ranks keeping their state, and ends SUCCEEDED exactly once."""
    assert cluster.network is not None
    with cluster.client() as client:
        client.submit(elastic("pair"))
        before = wait_for(client, "pair", lambda j: j.progress.iteration >= 5, "never trained")
        victims = [w.node_id for w in before.assignment.workers if 0 not in w.ranks][:2]
        hosts = [cluster.node_host(v) for v in victims]
        pulled = time.time()
        try:
            cluster.network.link_down(hosts[0])
            time.sleep(0.5)
            cluster.network.link_down(hosts[1])
            moved = wait_for(
                client,
                "pair",
                lambda j: j.state == common_pb2.JOB_STATE_RUNNING and not set(victims) & nodes_of(j),
                "the job never moved off the lost hosts",
                timeout_s=60,
            )
            lost = [i for i in client.incidents() if i.kind == common_pb2.FAILURE_KIND_NODE_LOST and not i.job_id]
            lost_nodes = {i.node_id for i in lost if i.detected.ToNanoseconds() / 1e9 > pulled}
            assert set(victims) <= lost_nodes, lost_nodes
            assert moved.assignment.world_size >= 2
            record(
                "two hosts lost 0.5 s apart",
                running_again_s=time.time() - pulled,
                ranks=f"4 -> {moved.assignment.world_size}",
            )
        finally:
            for host in hosts:
                cluster.network.link_up(host)
        assert_exact(cluster, succeeded_once(client, "pair"), reference)


def test_the_active_coordinator_cut_off_from_redis_is_replaced_and_writes_nothing(
    cluster: NetCluster, reference: dict[str, Any]
) -> None:
    """The active coordinator's host loses the control host (Redis, the planners) while a job
    trains. Expected: its lease lapses within the lease TTL (3 s) and it stops itself (exit
    75, EXIT_LEASE_LOST) without a write after that (its log shows no decision once it
    said it lost the lease); the standby takes over; the agents follow it; the job ends
    SUCCEEDED exactly once. Runs last: the cluster keeps one coordinator after it."""
    assert cluster.network is not None
    active = cluster.wait_active_coordinator()
    service = cluster.service(active)
    host = cluster._host(active)
    assert host is not None
    with cluster.client() as client:
        client.submit(elastic("takeover"))
        wait_for(client, "takeover", lambda j: j.progress.iteration >= 5, "never trained")
    cut_at = time.monotonic()
    cluster.network.cut([host.name], ["ctl"])
    try:
        assert service.proc.wait(timeout=15) == 75
        stopped_after = time.monotonic() - cut_at
        successor = cluster.wait_active_coordinator(timeout_s=30, not_this=active)
        assert successor != active
        record("coordinator cut off from Redis", stopped_s=stopped_after, standby_serving_s=time.monotonic() - cut_at)
    finally:
        cluster.network.heal(host.name)
    assert stopped_after < 10.0
    log = service.log_path.read_text()
    assert "lost the coordinator lease" in log
    after_loss = log[log.index("lost the coordinator lease") :]
    assert "remedy chosen" not in after_loss and "plan carried out" not in after_loss
    with cluster.client() as client:
        assert_exact(cluster, succeeded_once(client, "takeover"), reference)
