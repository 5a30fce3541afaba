"""How a job's workers change, as edits of the job record plus the commands that carry
them out. Pure: the caller applies these inside one compare-and-set write, so the commands
commit with the state they follow from, or not at all."""

from __future__ import annotations

from services.coordinator import state
from unicron.v1 import common_pb2, node_service_pb2

Commands = list[tuple[str, node_service_pb2.NodeCommand]]


def start(
    job: common_pb2.Job, assignment: common_pb2.Assignment, now: float, reason: str, ack_timeout_s: float
) -> Commands:
    """Gives the job a new assignment (a new generation) and asks each node to start its ranks."""
    job.assignment.CopyFrom(assignment)
    keep = [w for w in job.workers if w.state == state.WORKER_STOPPING]
    del job.workers[:]
    job.workers.extend(keep)
    commands: Commands = []
    for placement in assignment.workers:
        job.workers.append(state.new_worker(placement.node_id, assignment.generation, now, now + ack_timeout_s, reason))
        commands.append(
            (
                placement.node_id,
                node_service_pb2.NodeCommand(
                    start_workers=node_service_pb2.StartWorkers(job_id=job.job_id, spec=job.spec, assignment=assignment)
                ),
            )
        )
    return commands


def stop(
    job: common_pb2.Job,
    now: float,
    reason: str,
    ack_timeout_s: float,
    unreachable: frozenset[str] = frozenset(),
    job_ended: bool = False,
) -> Commands:
    """Asks every node of the job's current generation to stop its ranks. Workers on
    unreachable nodes are marked stopped at once: there is no agent left to ask.
    ``job_ended``: the job is over, and the nodes free its snapshots too."""
    generation = job.assignment.generation
    commands: Commands = []
    for worker in job.workers:
        if worker.generation != generation or worker.state in (state.WORKER_STOPPED, state.WORKER_STOPPING):
            continue
        if worker.node_id in unreachable:
            state.move_worker(worker, state.WORKER_STOPPED, now, f"{reason} (node unreachable)")
            continue
        state.move_worker(worker, state.WORKER_STOPPING, now, reason, deadline=now + ack_timeout_s)
    nodes = [w.node_id for w in job.assignment.workers if w.ranks and w.node_id not in unreachable]
    for node_id in nodes:
        commands.append(
            (
                node_id,
                node_service_pb2.NodeCommand(
                    stop_workers=node_service_pb2.StopWorkers(
                        job_id=job.job_id, reason=reason, generation=generation, job_ended=job_ended
                    )
                ),
            )
        )
    return commands


def reform(
    job: common_pb2.Job,
    assignment: common_pb2.Assignment,
    rank_map: dict[int, int],
    now: float,
    reason: str,
    ack_timeout_s: float,
    incident_id: str,
    unreachable: frozenset[str] = frozenset(),
) -> Commands:
    """Moves the job to a new generation without restarting its live ranks: those in
    rank_map keep their state and join the new group under their new rank; the new
    assignment's other ranks start fresh and take the state from a live peer."""
    from_generation = job.assignment.generation
    old_nodes = [w.node_id for w in job.assignment.workers if w.ranks]
    for worker in job.workers:
        if worker.generation == from_generation and worker.state != state.WORKER_STOPPED:
            state.move_worker(worker, state.WORKER_STOPPED, now, f"reformed into generation {assignment.generation}")
    job.assignment.CopyFrom(assignment)
    prune_stopped(job)
    new_nodes = [w.node_id for w in assignment.workers if w.ranks]
    for node_id in new_nodes:
        job.workers.append(state.new_worker(node_id, assignment.generation, now, now + ack_timeout_s, reason))
    command = node_service_pb2.Reform(
        job_id=job.job_id,
        from_generation=from_generation,
        spec=job.spec,
        assignment=assignment,
        rank_map=rank_map,
        incident_id=incident_id,
    )
    return [
        (node_id, node_service_pb2.NodeCommand(reform=command))
        for node_id in dict.fromkeys([*old_nodes, *new_nodes])
        if node_id not in unreachable
    ]


def acknowledge(job: common_pb2.Job, node_id: str, generation: int, ok: bool, error: str, now: float) -> bool:
    """Applies an agent's acknowledgement to the matching worker; False when it matches
    nothing waiting for one (late or duplicate), which is not an error."""
    for worker in job.workers:
        if worker.node_id != node_id or worker.generation != generation:
            continue
        if worker.state == state.WORKER_STARTING:
            if ok:
                state.move_worker(worker, state.WORKER_LAUNCHED, now, "agent started the ranks")
            else:
                state.move_worker(worker, state.WORKER_FAILED, now, f"agent could not start the ranks: {error}")
            return True
        if worker.state == state.WORKER_STOPPING:
            state.move_worker(worker, state.WORKER_STOPPED, now, "agent stopped the ranks")
            prune_stopped(job)
            return True
    return False


def finished(job: common_pb2.Job, now: float) -> None:
    """Every rank of the job exited 0 after its last iteration: its workers are stopped (no
    command: nothing is left to stop), so an ended job never lists a worker as running."""
    for worker in job.workers:
        if worker.state not in (state.WORKER_STOPPED, state.WORKER_FAILED):
            state.move_worker(worker, state.WORKER_STOPPED, now, "the ranks finished")


def mark_running(job: common_pb2.Job, node_id: str, now: float) -> bool:
    """The node's ranks of the current generation reported an iteration."""
    for worker in job.workers:
        if (
            worker.node_id == node_id
            and worker.generation == job.assignment.generation
            and worker.state in (state.WORKER_STARTING, state.WORKER_LAUNCHED)
        ):
            state.move_worker(worker, state.WORKER_RUNNING, now, "training")
            return True
    return False


def prune_stopped(job: common_pb2.Job) -> None:
    """Older generations' workers are forgotten once stopped: the record stays bounded."""
    keep = [w for w in job.workers if w.generation == job.assignment.generation or w.state != state.WORKER_STOPPED]
    del job.workers[:]
    job.workers.extend(keep)
