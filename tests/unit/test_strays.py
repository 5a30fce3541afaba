"""Ranks a node still runs after the coordinator wrote them off: found at registration."""

from __future__ import annotations

import pytest

from services.coordinator import decide, state
from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.memory_store import MemoryStore
from tests.unit.test_coordinator_core import Clock, InProcessPlanner, fall_silent, iterate, submit_and_place
from unicron import errors
from unicron.v1 import common_pb2 as pb
from unicron.v1 import node_service_pb2

NOW = 1_700_000_000.0


def job_with(generation: int, *workers: tuple[str, int, int], job_state: int = state.RUNNING) -> pb.Job:
    job = pb.Job(job_id="j")
    job.state = job_state  # type: ignore[assignment]
    job.assignment.generation = generation
    for node_id, worker_generation, worker_state in workers:
        job.workers.add(node_id=node_id, generation=worker_generation, state=worker_state)
    return job


@pytest.mark.parametrize(
    ("job", "generation", "stray"),
    [
        (None, 1, True),  # the job is gone
        (job_with(1, ("a", 1, state.WORKER_RUNNING), job_state=state.CANCELLED), 1, True),
        (job_with(1, ("a", 1, state.WORKER_RUNNING)), 1, False),  # what should run
        (job_with(1, ("a", 1, state.WORKER_LAUNCHED)), 1, False),
        (job_with(1, ("a", 1, state.WORKER_STARTING)), 1, False),
        (job_with(1, ("a", 1, state.WORKER_STOPPING)), 1, False),  # a stop command is on its way
        (job_with(1, ("a", 1, state.WORKER_STOPPED)), 1, True),  # written off: node was LOST
        (job_with(2, ("a", 1, state.WORKER_STOPPED), ("b", 2, state.WORKER_STARTING)), 1, True),  # moved away
        (job_with(2, ("a", 1, state.WORKER_STOPPED), ("a", 2, state.WORKER_STARTING)), 1, False),  # a reform takes it
        (job_with(2, ("a", 1, state.WORKER_STOPPED), ("a", 2, state.WORKER_RUNNING)), 1, True),  # reform done
        (job_with(1, ("a", 1, state.WORKER_RUNNING)), 2, True),  # a generation never acknowledged
        (job_with(1, ("b", 1, state.WORKER_RUNNING)), 1, True),  # the generation, not on this node
    ],
)
def test_what_is_stray(job: pb.Job | None, generation: int, stray: bool) -> None:
    assert decide.is_stray("a", job, generation) is stray


def running(job: pb.Job, generation: int) -> list[node_service_pb2.JobGeneration]:
    return [node_service_pb2.JobGeneration(job_id=job.job_id, generation=generation)]


def test_a_node_back_from_lost_is_told_to_kill_what_was_written_off() -> None:
    store, clock = MemoryStore(), Clock()
    coordinator = Coordinator(store, InProcessPlanner(), Settings(), clock=clock)
    for node_id in ("n1", "n2", "n3"):
        coordinator.register_node(node_id, f"10.9.0.{node_id[-1]}:7000", 1, "rack-a")
    job = submit_and_place(coordinator)
    iterate(coordinator, job, 1, range(2))
    lost = job.assignment.workers[0].node_id
    kept = job.assignment.workers[1].node_id
    assert coordinator.strays(lost, running(job, 1)) == []  # while it is alive, its ranks are the job's
    fall_silent(coordinator, clock, lost, ("n1", "n2", "n3"))
    moved = coordinator.get(job.job_id)
    assert lost not in decide.nodes_of(moved) and moved.assignment.generation > 1
    # The node comes back with its rank of generation 1 alive: nobody will stop it but itself.
    coordinator.register_node(lost, f"10.9.0.{lost[-1]}:7000", 1, "rack-a")
    assert coordinator.strays(lost, running(job, 1)) == running(job, 1)
    # The survivor is being reformed into the new generation: its ranks are not stray.
    assert coordinator.strays(kept, running(job, 1)) == []
    gone = node_service_pb2.JobGeneration(job_id="job-that-never-was", generation=3)
    assert coordinator.strays(kept, [gone]) == [gone]


def test_a_registration_naming_no_job_is_refused() -> None:
    coordinator = Coordinator(MemoryStore(), InProcessPlanner(), Settings(), clock=Clock())
    with pytest.raises(errors.InvalidArgument, match=r"running\[0\].job_id"):
        coordinator.strays("n1", [node_service_pb2.JobGeneration(generation=1)])
