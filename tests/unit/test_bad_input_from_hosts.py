"""What many hosts can get wrong, refused with the right error and nothing changed: a host
that comes back with another node's address, one node id registered from two hosts, and a
report of a generation the coordinator never made. The whole coordinator on the in-memory
store (as in test_coordinator_core)."""

from __future__ import annotations

import pytest

from services.coordinator.coordinator import Coordinator
from services.coordinator.memory_store import MemoryStore
from services.coordinator.registry import registration_conflict
from tests.unit.test_coordinator_core import Clock, cluster, iterate, submit_and_place
from unicron.errors import AlreadyExists, InvalidArgument
from unicron.v1 import common_pb2 as pb
from unicron.v1 import node_service_pb2

__all__ = ["cluster"]  # the fixture, shared


def node(node_id: str, address: str, beat: float, state: int = pb.NODE_STATE_READY) -> pb.Node:
    out = pb.Node(node_id=node_id, address=address, state=state)  # type: ignore[arg-type]
    out.last_heartbeat.FromNanoseconds(int(beat * 1e9))
    return out


LIVE = [node("n1", "10.0.0.1:7000", 99.0), node("n2", "10.0.0.2:7000", 99.0)]


@pytest.mark.parametrize(
    ("node_id", "address", "nodes", "refused"),
    [
        ("n1", "10.0.0.1:7555", LIVE, False),  # its agent restarted on its host: a new port
        ("n1", "10.0.0.9:7000", LIVE, True),  # n1 from a second host while the first beats
        ("n3", "10.0.0.1:7001", LIVE, True),  # a new node on n1's host: n1's address taken
        ("n3", "10.0.0.3:7000", LIVE, False),
        # n1 is silent past the heartbeat timeout, or LOST: its host and id are free again.
        ("n3", "10.0.0.1:7000", [node("n1", "10.0.0.1:7000", 90.0)], False),
        ("n1", "10.0.0.9:7000", [node("n1", "10.0.0.1:7000", 99.0, pb.NODE_STATE_LOST)], False),
        # One machine: every agent is on loopback, told apart by its port.
        ("n3", "127.0.0.1:7000", [node("n1", "127.0.0.1:7000", 99.0)], False),
        ("n3", "agent-1:7000", [node("n1", "agent-1:7000", 99.0)], True),  # a hostname is a host
    ],
)
def test_one_node_per_host(node_id: str, address: str, nodes: list[pb.Node], refused: bool) -> None:
    assert (registration_conflict(node_id, address, nodes, 100.0, 3.0) is not None) is refused


def test_a_refused_registration_changes_nothing(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, _, _ = cluster
    before = {n.node_id: n.address for n in coordinator.nodes()}
    with pytest.raises(AlreadyExists, match="n1"):
        coordinator.register_node("n3", "10.9.0.1:7001", 1, "rack-a")  # n1's host
    with pytest.raises(AlreadyExists, match="one agent per node id"):
        coordinator.register_node("n1", "10.9.0.8:7000", 1, "rack-a")
    assert {n.node_id: n.address for n in coordinator.nodes()} == before


def test_reports_of_a_generation_never_made_are_refused(cluster: tuple[Coordinator, MemoryStore, Clock]) -> None:
    coordinator, _, _ = cluster
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    before = coordinator.get(job.job_id)
    node_id = job.assignment.workers[0].node_id
    future = job.assignment.generation + 5
    crash = pb.FailureReport(
        job_id=job.job_id, generation=future, node_id=node_id, kind=pb.FAILURE_KIND_SOFTWARE_ERROR, rank=0
    )
    crash.source = pb.DETECTION_SOURCE_EXCEPTION
    crash.first_seen.FromNanoseconds(int(coordinator.get(job.job_id).created.ToNanoseconds()))
    with pytest.raises(InvalidArgument, match=r"report\.generation"):
        coordinator.report_failure(node_id, crash)
    good = node_service_pb2.IterationReport(
        job_id=job.job_id, generation=job.assignment.generation, rank=0, iteration=2, seconds=0.1
    )
    bad = node_service_pb2.IterationReport(job_id=job.job_id, generation=future, rank=0, iteration=3, seconds=0.1)
    with pytest.raises(InvalidArgument, match=r"reports\[1\].generation"):
        coordinator.report_progress(node_id, [good, bad])
    exit_request = node_service_pb2.ReportWorkerExitRequest(
        node_id=node_id, job_id=job.job_id, generation=future, rank=0, exit_code=1
    )
    exit_request.exited.CopyFrom(crash.first_seen)
    with pytest.raises(InvalidArgument, match="generation"):
        coordinator.report_worker_exit(exit_request)
    assert coordinator.get(job.job_id) == before  # not even the good report of the batch
    assert coordinator.list_incidents(job.job_id) == []


def test_a_loopback_registration_lists_no_node(
    cluster: tuple[Coordinator, MemoryStore, Clock], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every agent on one machine shares loopback, which is exempt: listing every node per
    # registration made 1,000 registrations a storm (bench-load-steps).
    coordinator, store, _ = cluster

    def listed() -> list[pb.Node]:
        raise AssertionError("a loopback registration listed the nodes")

    monkeypatch.setattr(store, "list_nodes", listed)
    node, _ = coordinator.register_node("n9", "127.0.0.1:7009", 1, "rack-a")
    assert node.state == pb.NODE_STATE_READY
