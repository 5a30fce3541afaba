"""The job and worker state machines: transition tables, illegal moves raise, every move
recorded with its time and reason in a history."""

from __future__ import annotations

from unicron.v1 import common_pb2

JobState = common_pb2.JobState
PENDING = common_pb2.JOB_STATE_PENDING
SCHEDULED = common_pb2.JOB_STATE_SCHEDULED
RUNNING = common_pb2.JOB_STATE_RUNNING
RECOVERING = common_pb2.JOB_STATE_RECOVERING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED

TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
# States in which a job holds slots and has (or is getting) workers.
ACTIVE = frozenset({SCHEDULED, RUNNING, RECOVERING})

VALID_TRANSITIONS: dict[int, frozenset[int]] = {
    PENDING: frozenset({SCHEDULED, FAILED, CANCELLED}),
    # A job can finish before its first progress report reaches us, hence SCHEDULED -> SUCCEEDED.
    SCHEDULED: frozenset({RUNNING, PENDING, RECOVERING, SUCCEEDED, FAILED, CANCELLED}),
    RUNNING: frozenset({PENDING, RECOVERING, SUCCEEDED, FAILED, CANCELLED}),
    # RECOVERING -> RECOVERING: a failure during a transition starts the next remedy.
    # RECOVERING -> PENDING: a re-plan paused the job while it recovered.
    RECOVERING: frozenset({RUNNING, RECOVERING, PENDING, SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


class IllegalTransition(Exception):
    def __init__(self, what: str, current: str, target: str) -> None:
        super().__init__(f"{what}: illegal transition {current} -> {target}")


def state_name(state: int) -> str:
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


def transition(job: common_pb2.Job, target: int, now: float, reason: str) -> None:
    """Moves job to target in place, appending to its history; raises IllegalTransition."""
    if target not in VALID_TRANSITIONS[job.state]:
        raise IllegalTransition(f"job {job.job_id}", state_name(job.state), state_name(target))
    job.state = target  # type: ignore[assignment]
    job.reason = reason
    change = job.history.add(state=target, reason=reason)
    change.time.FromNanoseconds(int(now * 1e9))


def is_terminal(state: int) -> bool:
    return state in TERMINAL


# ---- workers: one job's ranks on one node ------------------------------------------------

WORKER_STARTING = common_pb2.WORKER_STATE_STARTING
WORKER_LAUNCHED = common_pb2.WORKER_STATE_LAUNCHED
WORKER_RUNNING = common_pb2.WORKER_STATE_RUNNING
WORKER_STOPPING = common_pb2.WORKER_STATE_STOPPING
WORKER_STOPPED = common_pb2.WORKER_STATE_STOPPED
WORKER_FAILED = common_pb2.WORKER_STATE_FAILED

WORKER_TRANSITIONS: dict[int, frozenset[int]] = {
    # An iteration report can overtake the start acknowledgement, hence STARTING -> RUNNING.
    WORKER_STARTING: frozenset({WORKER_LAUNCHED, WORKER_RUNNING, WORKER_STOPPING, WORKER_STOPPED, WORKER_FAILED}),
    WORKER_LAUNCHED: frozenset({WORKER_RUNNING, WORKER_STOPPING, WORKER_STOPPED, WORKER_FAILED}),
    WORKER_RUNNING: frozenset({WORKER_STOPPING, WORKER_STOPPED, WORKER_FAILED}),
    WORKER_STOPPING: frozenset({WORKER_STOPPED, WORKER_FAILED}),
    WORKER_FAILED: frozenset({WORKER_STOPPING, WORKER_STOPPED}),
    WORKER_STOPPED: frozenset(),
}


def worker_state_name(state: int) -> str:
    return common_pb2.WorkerState.Name(state).removeprefix("WORKER_STATE_")


def new_worker(node_id: str, generation: int, now: float, deadline: float, reason: str) -> common_pb2.WorkerStatus:
    worker = common_pb2.WorkerStatus(node_id=node_id, generation=generation, state=WORKER_STARTING)
    worker.deadline.FromNanoseconds(int(deadline * 1e9))
    change = worker.history.add(state=WORKER_STARTING, reason=reason)
    change.time.FromNanoseconds(int(now * 1e9))
    return worker


def move_worker(
    worker: common_pb2.WorkerStatus, target: int, now: float, reason: str, deadline: float | None = None
) -> None:
    """Moves a worker in place; deadline is when the next acknowledgement is due (None: none)."""
    if target not in WORKER_TRANSITIONS[worker.state]:
        raise IllegalTransition(
            f"worker {worker.node_id} gen {worker.generation}",
            worker_state_name(worker.state),
            worker_state_name(target),
        )
    worker.state = target  # type: ignore[assignment]
    if deadline is None:
        worker.ClearField("deadline")
    else:
        worker.deadline.FromNanoseconds(int(deadline * 1e9))
    change = worker.history.add(state=target, reason=reason)
    change.time.FromNanoseconds(int(now * 1e9))
