"""The job state machine: a transition table, illegal moves raise, every move recorded
with its time and reason in the job's history."""

from __future__ import annotations

from unicron.v1 import common_pb2

JobState = common_pb2.JobState
PENDING = common_pb2.JOB_STATE_PENDING
SCHEDULED = common_pb2.JOB_STATE_SCHEDULED
RUNNING = common_pb2.JOB_STATE_RUNNING
SUCCEEDED = common_pb2.JOB_STATE_SUCCEEDED
FAILED = common_pb2.JOB_STATE_FAILED
CANCELLED = common_pb2.JOB_STATE_CANCELLED

TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELLED})
ACTIVE = frozenset({SCHEDULED, RUNNING})

VALID_TRANSITIONS: dict[int, frozenset[int]] = {
    PENDING: frozenset({SCHEDULED, FAILED, CANCELLED}),
    # A job can finish before its first progress report reaches us, hence SCHEDULED -> SUCCEEDED.
    SCHEDULED: frozenset({RUNNING, PENDING, SUCCEEDED, FAILED, CANCELLED}),
    RUNNING: frozenset({PENDING, SUCCEEDED, FAILED, CANCELLED}),
    SUCCEEDED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
}


class IllegalTransition(Exception):
    def __init__(self, job_id: str, current: int, target: int) -> None:
        super().__init__(f"job {job_id}: illegal transition {state_name(current)} -> {state_name(target)}")


def state_name(state: int) -> str:
    return common_pb2.JobState.Name(state).removeprefix("JOB_STATE_")


def transition(job: common_pb2.Job, target: int, now: float, reason: str) -> None:
    """Moves job to target in place, appending to its history; raises IllegalTransition."""
    if target not in VALID_TRANSITIONS[job.state]:
        raise IllegalTransition(job.job_id, job.state, target)
    job.state = target  # type: ignore[assignment]
    job.reason = reason
    change = job.history.add(state=target, reason=reason)
    change.time.FromNanoseconds(int(now * 1e9))


def is_terminal(state: int) -> bool:
    return state in TERMINAL
