"""The worker transitions as edits of the job record plus the commands they imply
(services/coordinator/transitions.py), on in-memory jobs: pure, no store, no clock."""

from __future__ import annotations

import pytest

from services.coordinator import state, transitions
from unicron.v1 import common_pb2

NOW, ACK = 100.0, 15.0


def assignment(generation: int, **ranks_by_node: list[int]) -> common_pb2.Assignment:
    out = common_pb2.Assignment(generation=generation, world_size=sum(len(r) for r in ranks_by_node.values()))
    for node_id, ranks in ranks_by_node.items():
        out.workers.add(node_id=node_id, ranks=ranks)
    return out


def running_job(**ranks_by_node: list[int]) -> common_pb2.Job:
    job = common_pb2.Job(job_id="job-1", state=state.RUNNING)
    transitions.start(job, assignment(1, **ranks_by_node), NOW - 10, "start", ACK)
    for worker in job.workers:
        state.move_worker(worker, state.WORKER_LAUNCHED, NOW - 9, "started")
        state.move_worker(worker, state.WORKER_RUNNING, NOW - 8, "training")
    return job


def states(job: common_pb2.Job) -> list[tuple[str, int, str]]:
    return sorted((w.node_id, w.generation, state.worker_state_name(w.state).lower()) for w in job.workers)


def test_start_gives_every_node_a_starting_worker_and_one_command() -> None:
    job = common_pb2.Job(job_id="job-1")
    commands = transitions.start(job, assignment(1, a=[0, 1], b=[2]), NOW, "first start", ACK)
    assert [node for node, _ in commands] == ["a", "b"]
    assert all(c.WhichOneof("command") == "start_workers" for _, c in commands)
    assert states(job) == [("a", 1, "starting"), ("b", 1, "starting")]
    assert all(w.deadline.ToNanoseconds() / 1e9 == NOW + ACK for w in job.workers)


@pytest.mark.parametrize(
    ("unreachable", "commanded", "after"),
    [
        (frozenset(), ["a", "b"], [("a", 1, "stopping"), ("b", 1, "stopping")]),
        # No agent to ask on an unreachable node: its worker is stopped at once.
        (frozenset({"b"}), ["a"], [("a", 1, "stopping"), ("b", 1, "stopped")]),
    ],
)
def test_stop_asks_the_reachable_nodes(
    unreachable: frozenset[str], commanded: list[str], after: list[tuple[str, int, str]]
) -> None:
    job = running_job(a=[0], b=[1])
    commands = transitions.stop(job, NOW, "cancelled", ACK, unreachable)
    assert [node for node, _ in commands] == commanded
    assert all(c.stop_workers.generation == 1 and not c.stop_workers.job_ended for _, c in commands)
    assert states(job) == after
    # Stopping twice asks nothing more of a worker already stopping.
    transitions.stop(job, NOW + 1, "again", ACK, unreachable)
    assert states(job) == after


def test_reform_commands_old_and_new_nodes_once_and_forgets_the_old_generation() -> None:
    job = running_job(a=[0], b=[1])
    new = assignment(2, b=[0], c=[1])
    commands = transitions.reform(job, new, {1: 0}, NOW, "restart of rank 0", ACK, "inc-1")
    assert [node for node, _ in commands] == ["a", "b", "c"]
    assert len({c.reform.SerializeToString() for _, c in commands}) == 1  # one command, to each node
    command = commands[0][1].reform
    assert (command.from_generation, dict(command.rank_map), command.incident_id) == (1, {1: 0}, "inc-1")
    assert job.assignment.generation == 2
    # The old generation's workers are stopped and pruned; the new one's are starting.
    assert states(job) == [("b", 2, "starting"), ("c", 2, "starting")]


def test_reform_skips_unreachable_nodes() -> None:
    job = running_job(a=[0], b=[1])
    commands = transitions.reform(job, assignment(2, a=[0]), {0: 0}, NOW, "shrink", ACK, "", frozenset({"b"}))
    assert [node for node, _ in commands] == ["a"]


@pytest.mark.parametrize(
    ("ok", "expected"),
    [(True, "launched"), (False, "failed")],
)
def test_an_ack_moves_the_starting_worker(ok: bool, expected: str) -> None:
    job = common_pb2.Job(job_id="job-1")
    transitions.start(job, assignment(1, a=[0]), NOW, "start", ACK)
    assert transitions.acknowledge(job, "a", 1, ok, "" if ok else "no image", NOW + 1)
    assert states(job) == [("a", 1, expected)]
    # Late and duplicate acks, or acks of another generation or node, match nothing.
    assert not transitions.acknowledge(job, "a", 1, ok, "", NOW + 2)
    assert not transitions.acknowledge(job, "a", 7, True, "", NOW + 2)
    assert not transitions.acknowledge(job, "z", 1, True, "", NOW + 2)


def test_a_stop_ack_prunes_the_older_generation() -> None:
    job = running_job(a=[0])
    transitions.stop(job, NOW, "move", ACK)
    transitions.start(job, assignment(2, b=[0]), NOW, "restart", ACK)
    assert states(job) == [("a", 1, "stopping"), ("b", 2, "starting")]
    assert transitions.acknowledge(job, "a", 1, True, "", NOW + 1)
    assert states(job) == [("b", 2, "starting")]


def test_the_first_iteration_marks_the_nodes_workers_running() -> None:
    job = common_pb2.Job(job_id="job-1")
    transitions.start(job, assignment(1, a=[0], b=[1]), NOW, "start", ACK)
    assert transitions.mark_running(job, "a", NOW + 1)
    assert not transitions.mark_running(job, "a", NOW + 2)  # already running
    assert states(job) == [("a", 1, "running"), ("b", 1, "starting")]


def test_a_stop_that_ends_the_job_says_so_to_the_nodes() -> None:
    job = running_job(a=[0], b=[1])
    commands = transitions.stop(job, NOW, "cancelled", ACK, job_ended=True)
    assert [(node, c.stop_workers.job_ended) for node, c in commands] == [("a", True), ("b", True)]
