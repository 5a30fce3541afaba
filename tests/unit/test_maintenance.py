"""Node maintenance on the in-memory store with the real solver: a drain moves a node's jobs
off by a re-plan and opens no incident; one that would strand a job is refused and changes
nothing; an uncordoned node takes ranks again."""

from __future__ import annotations

import pytest

from services.coordinator import state
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.maintenance import stranded
from services.coordinator.memory_store import MemoryStore
from tests.unit.test_coordinator_core import Clock, InProcessPlanner, iterate
from unicron import jobspec
from unicron.errors import FailedPrecondition, NotFound
from unicron.v1 import common_pb2 as pb
from unicron.v1 import planner_service_pb2


def plan_of(status: int, **slots: dict[str, int]) -> planner_service_pb2.PlanResponse:
    reply = planner_service_pb2.PlanResponse(status=status)  # type: ignore[arg-type]
    for job_id, by_node in slots.items():
        reply.jobs.add(job_id=job_id, slots_by_node=by_node)
    return reply


@pytest.mark.parametrize(
    ("on_node", "reply", "left"),
    [
        (["a"], plan_of(planner_service_pb2.SOLVE_STATUS_OPTIMAL, a={"n2": 1}), []),
        (["a"], plan_of(planner_service_pb2.SOLVE_STATUS_OPTIMAL, a={}), ["a"]),
        (["a", "b"], plan_of(planner_service_pb2.SOLVE_STATUS_FEASIBLE, a={"n2": 2}, b={"n3": 0}), ["b"]),
        (["a", "b"], plan_of(planner_service_pb2.SOLVE_STATUS_INFEASIBLE), ["a", "b"]),
        ([], plan_of(planner_service_pb2.SOLVE_STATUS_INFEASIBLE), []),
    ],
)
def test_stranded(on_node: list[str], reply: planner_service_pb2.PlanResponse, left: list[str]) -> None:
    assert stranded(on_node, reply) == left


def make(nodes: int, slots: int) -> tuple[Coordinator, MemoryStore, Clock]:
    store, clock = MemoryStore(), Clock()
    coordinator = Coordinator(store, InProcessPlanner(), Settings(), clock=clock)
    for i in range(1, nodes + 1):
        coordinator.register_node(f"n{i}", f"10.9.0.{i}:7000", slots, "rack-a")
    return coordinator, store, clock


def running(coordinator: Coordinator, clock: Clock, data: int, min_data: int) -> pb.Job:
    spec = jobspec.spec_from_dict(
        {
            "name": "tiny",
            "program": {"entry_point": "examples.gpt.train:main"},
            "parallelism": {"data": data, "min_data": min_data},
            "training": {"iterations": 50, "global_batch_size": 12},
        }
    )
    job = coordinator.submit(spec)
    coordinator.reconcile_once()
    job = coordinator.get(job.job_id)
    clock.now += 1
    iterate(coordinator, job, 1, range(job.assignment.world_size))
    return coordinator.get(job.job_id)


def test_a_drained_nodes_job_moves_off_without_an_incident_and_comes_back() -> None:
    coordinator, _store, clock = make(nodes=3, slots=1)
    job = running(coordinator, clock, data=2, min_data=1)
    (first, *_) = sorted(w.node_id for w in job.assignment.workers)
    node, jobs = coordinator.drain(first)
    assert node.cordoned and jobs == [job.job_id]
    coordinator.reconcile_once()
    moved = coordinator.get(job.job_id)
    assert first not in {w.node_id for w in moved.assignment.workers}
    assert moved.assignment.generation > job.assignment.generation
    assert "drained" in moved.reason and not moved.remedies
    assert coordinator.list_incidents() == []
    # Drained twice: nothing more. The agent registering again (restarted for the work)
    # keeps the drain.
    assert coordinator.drain(first)[0].cordoned
    coordinator.register_node(first, f"10.9.0.{first[-1]}:7000", 1, "rack-a")
    assert next(n for n in coordinator.nodes() if n.node_id == first).cordoned
    # A new job is not placed there.
    clock.now += 1
    iterate(coordinator, moved, 2, range(moved.assignment.world_size))
    assert first not in {w.node_id for w in coordinator.get(job.job_id).assignment.workers}
    back = coordinator.uncordon(first)
    assert not back.cordoned


def test_a_drain_that_would_strand_a_job_is_refused_and_changes_nothing() -> None:
    coordinator, store, clock = make(nodes=2, slots=1)
    job = running(coordinator, clock, data=2, min_data=2)
    before = store.get_job(job.job_id).version
    with pytest.raises(FailedPrecondition, match=job.job_id):
        coordinator.drain("n1")
    assert not any(n.cordoned for n in coordinator.nodes())
    coordinator.reconcile_once()
    after = coordinator.get(job.job_id)
    assert after.version == before and after.state == state.RUNNING


def test_draining_an_unknown_node_is_not_found() -> None:
    coordinator, _store, _clock = make(nodes=1, slots=1)
    with pytest.raises(NotFound):
        coordinator.drain("nope")
    with pytest.raises(NotFound):
        coordinator.uncordon("nope")


def test_an_isolated_node_is_returned_by_uncordon_without_its_agent_registering() -> None:
    """A SEV1 fault isolates the node; repaired outside the agent (a false alarm, a volume
    cleaned), the operator's uncordon returns it and the job grows back onto it."""
    coordinator, store, clock = make(nodes=2, slots=1)
    job = running(coordinator, clock, data=2, min_data=1)
    coordinator.report_failure(
        "n1",
        pb.FailureReport(
            node_id="n1",
            kind=pb.FAILURE_KIND_DISK_FULL,
            source=pb.DETECTION_SOURCE_NODE_HEALTH,
            message="disk:/var: under 1.00 GiB",
        ),
    )
    coordinator.reconcile_once()
    assert store.get_node("n1").state == pb.NODE_STATE_ISOLATED  # type: ignore[union-attr]
    shrunk = coordinator.get(job.job_id)
    assert {w.node_id for w in shrunk.assignment.workers} == {"n2"}
    back = coordinator.uncordon("n1")
    assert back.state == pb.NODE_STATE_READY and not back.cordoned
    for step in range(2, 6):
        clock.now += 1
        for node_id in ("n1", "n2"):
            coordinator.heartbeat(node_id)
        current = coordinator.get(job.job_id)
        iterate(coordinator, current, step, range(current.assignment.world_size))
        coordinator.reconcile_once()
    assert store.get_node("n1").state == pb.NODE_STATE_READY  # type: ignore[union-attr]
    assert {w.node_id for w in coordinator.get(job.job_id).assignment.workers} == {"n1", "n2"}
    # A READY node is left as it is: uncordon twice changes nothing more.
    assert coordinator.uncordon("n1").state == pb.NODE_STATE_READY
