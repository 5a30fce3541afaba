"""After an error a rank reports it first, then waits for the decision (a reform into a new
group, a stop, or nothing: it gives up), at most ``max_reattempts`` times per iteration. The
rank does not judge the error's severity: the coordinator does, from the reported kind.
Tested against a fake link (no torch); the real thing, ranks reforming and redoing the
iteration, is in test_reform.py (test_reattempt_by_reform).
"""

from __future__ import annotations

import threading
import time
from typing import Any, cast

import pytest

from unicron.faults import EXCEPTION_TEXTS
from unicron.trainer.agent_link import AgentLink
from unicron.trainer.faults import FaultInjector, InjectedFailure
from unicron.trainer.runtime import Decision, Run, TrainerConfig, after_failure, enter_generation
from unicron.v1 import common_pb2
from unicron.v1 import trainer_service_pb2 as pb

TIMEOUT_TEXT = EXCEPTION_TEXTS[common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT]


class FakeLink:
    def __init__(self) -> None:
        self.sent: list[pb.ConnectRequest] = []

    def send(self, message: pb.ConnectRequest) -> None:
        self.sent.append(message)


def _run(wait_s: float = 5.0, max_reattempts: int = 3, iteration: int = 1) -> tuple[Run, FakeLink]:
    config = TrainerConfig(
        job_id="job-1", agent="127.0.0.1:1", spec="{}", reattempt_wait_s=wait_s, max_reattempts=max_reattempts
    )
    link = FakeLink()
    stop = threading.Event()
    injector = FaultInjector(False, lambda fault, at: None, stop)
    run = Run(config, common_pb2.JobSpec(), cast(AgentLink, link), stop, injector, iteration=iteration)
    return run, link


def _reform(generation: int = 2) -> pb.AgentReform:
    return pb.AgentReform(incident_id="inc", generation=generation, rank=0, world_size=1, master_port=29500)


def _later(action: Any, delay_s: float = 0.05) -> None:
    timer = threading.Timer(delay_s, action)
    timer.daemon = True
    timer.start()


def test_sev3_error_is_reported_first_then_reformed_on_the_agents_word() -> None:
    run, link = _run()
    _later(lambda: run.reforms.put(_reform()))
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.REFORM
    [message] = link.sent
    assert message.error.kind == common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT
    assert message.error.iteration == 2


@pytest.mark.parametrize(
    "text",
    [
        "[gloo/transport/tcp/pair.cc:534] Connection reset by peer",
        "DistNetworkError: Connection refused (peer 10.0.0.7:29500)",
        "NCCL WARN NET/IB : link is down (port 1), link flapping",
    ],
)
def test_every_sev3_kind_waits_for_the_agent(text: str) -> None:
    run, _ = _run()
    run.generation = 3
    run.reforms.put(_reform(3))  # an answer to an earlier incident (not newer) is not this one's
    _later(lambda: run.reforms.put(_reform(4)))
    assert after_failure(run, RuntimeError(text)) is Decision.REFORM


def test_no_answer_within_the_wait_gives_up() -> None:
    run, link = _run(wait_s=0.3)
    run.reforms.put(_reform(0))  # stale
    start = time.monotonic()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.GIVE_UP
    assert 0.25 <= time.monotonic() - start < 3.0
    assert len(link.sent) == 1


def test_a_stop_while_waiting_stops() -> None:
    run, _ = _run()
    _later(run.stop.set)
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.STOP


def test_losing_the_agent_while_waiting_gives_up() -> None:
    run, _ = _run()

    def lose() -> None:
        run.lost.set()
        run.stop.set()

    _later(lose)
    start = time.monotonic()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.GIVE_UP
    assert time.monotonic() - start < 3.0


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (
            RuntimeError("CUDA error: an illegal memory access was encountered"),
            common_pb2.FAILURE_KIND_ILLEGAL_MEMORY_ACCESS,
        ),
        (ValueError("shapes do not align"), common_pb2.FAILURE_KIND_SOFTWARE_ERROR),
    ],
)
def test_every_error_waits_for_the_decision_which_may_replace_the_rank(error: Exception, kind: int) -> None:
    # The coordinator restarts a rank whose own error it was by stopping it (a reform that
    # leaves it out): the waiting rank is told to stop.
    run, link = _run()
    _later(run.stop.set)
    assert after_failure(run, error) is Decision.STOP
    assert [m.error.kind for m in link.sent] == [kind]


def test_without_an_agent_nobody_decides_and_the_error_ends_the_rank() -> None:
    run, link = _run()
    run.supervised = False  # plain torchrun: no agent to wait for
    start = time.monotonic()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.GIVE_UP
    assert time.monotonic() - start < 1.0
    assert len(link.sent) == 1


def test_a_step_that_already_updated_parameters_is_not_redone() -> None:
    run, link = _run()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT), redoable=False) is Decision.GIVE_UP
    assert len(link.sent) == 1


def test_at_most_max_reattempts_per_iteration() -> None:
    run, link = _run(max_reattempts=2, iteration=4)
    for generation in (2, 3):
        _later(lambda g=generation: run.reforms.put(_reform(g)))
        assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.REFORM
        enter_generation(run, run.pending_reform)  # type: ignore[arg-type]
    start = time.monotonic()
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.GIVE_UP
    assert time.monotonic() - start < 1.0, "the third failure must not wait"
    assert [m.error.iteration for m in link.sent] == [5, 5, 5]
    # The next iteration has its own budget.
    run.iteration = 5
    _later(lambda: run.reforms.put(_reform(4)))
    assert after_failure(run, InjectedFailure(TIMEOUT_TEXT)) is Decision.REFORM


def test_config_reads_the_new_settings_from_the_environment() -> None:
    from unicron.config import load_config

    env = {
        "UNICRON_TRAINER_JOB_ID": "j",
        "UNICRON_TRAINER_AGENT": "a:1",
        "UNICRON_TRAINER_SPEC": "{}",
        "UNICRON_TRAINER_CHECKPOINT_DIR": "/ckpt/j",
        "UNICRON_TRAINER_REATTEMPT_WAIT_S": "2.5",
        "UNICRON_TRAINER_MAX_REATTEMPTS": "5",
    }
    config = load_config(TrainerConfig, env_prefix="UNICRON_TRAINER", argv=[], env=env)
    assert (config.checkpoint_dir, config.reattempt_wait_s, config.max_reattempts) == ("/ckpt/j", 2.5, 5)
    defaults = TrainerConfig(job_id="j", agent="a:1", spec="{}")
    assert (defaults.checkpoint_dir, defaults.reattempt_wait_s, defaults.max_reattempts) == ("", 60.0, 3)
