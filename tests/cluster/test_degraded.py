"""A network that is bad rather than gone: a flapping link, lost packets, a slow link, and a
host parted from its peers while the control plane still sees it. Each test's docstring
says the expected outcome; every job must end SUCCEEDED exactly once with the parameters of
a failure-free run."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.cluster.conftest import assert_exact, elastic, nodes_of, record, succeeded_once
from tests.e2e.conftest import wait_for
from unicron.client import UnicronClient
from unicron.v1 import common_pb2
from unicron_dev.netcluster import NetCluster

pytestmark = pytest.mark.cluster


def start(client: UnicronClient, name: str) -> tuple[common_pb2.Job, str]:
    """Submits an elastic job; returns it once it trains, and a node of it without rank 0."""
    client.submit(elastic(name))
    job = wait_for(client, name, lambda j: j.progress.iteration >= 5, "never trained")
    return job, next(w.node_id for w in job.assignment.workers if w.ranks and 0 not in w.ranks)


def node_losses(client: UnicronClient, node_id: str, since: float) -> list[common_pb2.Incident]:
    return [
        i
        for i in client.incidents()
        if i.kind == common_pb2.FAILURE_KIND_NODE_LOST and i.node_id == node_id and seconds(i.detected) > since
    ]


def seconds(stamp: Any) -> float:
    return float(stamp.ToNanoseconds()) / 1e9


def summary(client: UnicronClient, job: common_pb2.Job) -> str:
    kinds = [common_pb2.FailureKind.Name(i.kind) for i in client.incidents(job.job_id)]
    return f"incidents {kinds}, remedies {[common_pb2.Remedy.Name(r.remedy) for r in job.remedies]}"


def test_a_flapping_link_is_healed_and_loses_no_node(cluster: NetCluster, reference: dict[str, Any]) -> None:
    """A host's link goes down and up every 1.5 s for 10 s. Expected: each outage (0.75 s)
    is shorter than the heartbeat timeout (3 s), so no NODE_LOST; the survivors'
    collectives stall with it: a TASK_HANG, healed by at most two remedies (a restart in
    place, or, when the agents' accounts show the host's links failing, a reconfigure
    without it); the job ends SUCCEEDED exactly once."""
    assert cluster.network is not None
    with cluster.client() as client:
        _, victim = start(client, "flap")
        host = cluster.node_host(victim)
        began = time.time()
        flapping = cluster.network.flap(host, period_s=1.5, duration_s=10.0)
        try:
            flapping.join(timeout=15)
        finally:
            cluster.network.heal(host)
        job = succeeded_once(client, "flap")
        record("flapping link", remedies=remedy_names(job), ranks_at_end=job.assignment.world_size)
        assert node_losses(client, victim, began) == [], summary(client, job)
        assert 1 <= len(job.remedies) <= 2, summary(client, job)
        assert_exact(cluster, job, reference)
        unisolate(cluster, client, victim)


def remedy_names(job: common_pb2.Job) -> str:
    return "+".join(common_pb2.Remedy.Name(r.remedy).removeprefix("REMEDY_").lower() for r in job.remedies) or "none"


def unisolate(cluster: NetCluster, client: UnicronClient, node_id: str) -> None:
    """A node isolated for its links comes back at an admin's uncordon (its links repaired),
    its agent left running: the next test gets four hosts."""
    if any(n.node_id == node_id and n.state == common_pb2.NODE_STATE_ISOLATED for n in client.nodes()):
        assert client.uncordon(node_id).state == common_pb2.NODE_STATE_READY
        wait_for_ready(client, node_id)


def wait_for_ready(client: UnicronClient, node_id: str) -> None:
    deadline = time.monotonic() + 30
    while not any(n.node_id == node_id and n.state == common_pb2.NODE_STATE_READY for n in client.nodes()):
        assert time.monotonic() < deadline, f"{node_id} never came back READY"
        time.sleep(0.2)


@pytest.mark.parametrize(("share", "most_remedies"), [(0.05, 1), (0.25, 2)])
def test_lost_packets_on_one_host_lose_no_node(
    cluster: NetCluster, reference: dict[str, Any], share: float, most_remedies: int
) -> None:
    """A share of a rank's host's packets is dropped, both ways, for 15 s (iptables
    statistic in its namespace). Expected, at 5%: TCP retransmits what is lost and the job
    goes on, slower; the hang verdict waits while the host retransmits and every peer
    answers, but a host of the ring that did not retransmit itself may still call a stall
    a hang: at most one remedy (measured: none in 3 runs, one restart in 3). At 25%: TCP
    spends most of its time in retransmission timeouts and the all-reduce all but stops; the
    stall is a TASK_HANG with at most two remedies (a
    restart in place, or a reconfigure without the host when the accounts show its links
    failing). Either way no NODE_LOST (heartbeats get through, late), and the job ends
    SUCCEEDED exactly once."""
    assert cluster.network is not None
    name = f"lossy-{int(share * 100)}"
    with cluster.client() as client:
        before, victim = start(client, name)
        host = cluster.node_host(victim)
        began = time.time()
        cluster.network.loss(host, share)
        try:
            time.sleep(15)
            during = client.get(name)
        finally:
            cluster.network.heal(host)
        job = succeeded_once(client, name)
        record(
            f"{share:.0%} packet loss",
            iterations_in_15s=during.progress.iteration - before.progress.iteration,
            remedies=remedy_names(job),
        )
        assert node_losses(client, victim, began) == [], summary(client, job)
        assert len(job.remedies) <= most_remedies, summary(client, job)
        assert_exact(cluster, job, reference)
        unisolate(cluster, client, victim)


def test_a_slow_link_is_a_slow_job_not_a_lost_node(cluster: NetCluster, reference: dict[str, Any]) -> None:
    """A rank's host's egress is held to 8 Mbit/s (tc tbf) for 15 s. Expected: every
    iteration waits for that host's share of the all-reduce, so the whole job slows down
    (a slow job; no rank of it computes slower, so no straggler); no NODE_LOST, no hang, no
    remedy; the job ends SUCCEEDED exactly once."""
    assert cluster.network is not None
    with cluster.client() as client:
        before, victim = start(client, "slow")
        host = cluster.node_host(victim)
        began = time.time()
        cluster.network.rate_limit(host, "8mbit")
        try:
            time.sleep(15)
            during = client.get("slow")
        finally:
            cluster.network.heal(host)
        job = succeeded_once(client, "slow")
        record(
            "slow link (8 Mbit/s)",
            iteration_s_before=before.progress.iteration_seconds,
            iteration_s_during=during.progress.iteration_seconds,
            remedies=remedy_names(job),
        )
        assert during.progress.iteration_seconds > 2 * before.progress.iteration_seconds
        assert node_losses(client, victim, began) == [], summary(client, job)
        assert list(job.remedies) == [], summary(client, job)
        assert_exact(cluster, job, reference)


def test_a_host_cut_off_from_its_peers_only_is_left_out(cluster: NetCluster, reference: dict[str, Any]) -> None:
    """A rank's host loses every other agent host while the control plane still hears its
    heartbeats. Expected: the job's collectives stall: a TASK_HANG on every node (within
    5 s), held until every node gave its account of which peers its agent reaches; the
    node that reaches none of them, and that none of them reaches, is isolated (not lost:
    it beats) and the job reconfigures without it. A kept rank blocked in a collective
    with the parted host cannot be interrupted on gloo (no reset comes through the cut): it
    leaves after the reform waited 20 s for it and restarts, its state from a peer or its
    snapshot; no remedy puts a rank back on the parted host; the job ends SUCCEEDED exactly
    once with the failure-free run's parameters."""
    assert cluster.network is not None
    with cluster.client() as client:
        before, victim = start(client, "parted")
        host = cluster.node_host(victim)
        peers = [cluster.node_host(n) for n in nodes_of(before) if n != victim]
        began = time.time()
        cluster.network.cut([host], peers)

        try:
            moved = wait_for(
                client,
                "parted",
                lambda j: j.state == common_pb2.JOB_STATE_RUNNING and victim not in nodes_of(j),
                "the job never went on without the parted host",
                timeout_s=90,
            )
            found = client.incidents(moved.job_id)
            incident = min(found, key=lambda i: seconds(i.detected))
            record(
                "cut off from its peers",
                detected_s=seconds(incident.detected) - began,
                moved_s=time.time() - began,
                ranks=f"4 -> {moved.assignment.world_size}",
            )
            assert incident.kind == common_pb2.FAILURE_KIND_TASK_HANG and incident.node_id == victim, summary(
                client, moved
            )
            assert seconds(incident.detected) - began < 5.0
            assert node_losses(client, victim, began) == []
            assert any(n.node_id == victim and n.state == common_pb2.NODE_STATE_ISOLATED for n in client.nodes())
        finally:
            cluster.network.heal(host)
        job = succeeded_once(client, "parted")
        assert job.remedies[0].remedy == common_pb2.REMEDY_RECONFIGURE, summary(client, job)
        assert victim not in nodes_of(job)  # isolated, it took no rank again
        assert_exact(cluster, job, reference)
        unisolate(cluster, client, victim)
