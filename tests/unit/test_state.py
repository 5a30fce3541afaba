from __future__ import annotations

import pytest

from services.coordinator import state
from unicron.v1 import common_pb2

ALL = [state.PENDING, state.SCHEDULED, state.RUNNING, state.SUCCEEDED, state.FAILED, state.CANCELLED]


def job_in(current: int) -> common_pb2.Job:
    return common_pb2.Job(job_id="j", state=current)  # type: ignore[arg-type]


@pytest.mark.parametrize("current", ALL)
@pytest.mark.parametrize("target", ALL)
def test_transition_table(current: int, target: int) -> None:
    job = job_in(current)
    if target in state.VALID_TRANSITIONS[current]:
        state.transition(job, target, 100.5, "why")
        assert job.state == target and job.reason == "why"
        assert job.history[-1].state == target
        assert job.history[-1].time.ToNanoseconds() == 100_500_000_000
    else:
        with pytest.raises(state.IllegalTransition):
            state.transition(job, target, 100.0, "why")
        assert job.state == current and not job.history


def test_final_states_are_final() -> None:
    for final in state.TERMINAL:
        assert not state.VALID_TRANSITIONS[final]
