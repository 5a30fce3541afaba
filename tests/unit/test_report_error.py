"""What a rank tells its agent of an error (unicron/trainer/runtime.report_error): one after
every iteration is trained (in the final checkpoint's save, in teardown) says so, as the
coordinator says it of a rank that exits then, so the job's log shows no failure that wanted a
remedy."""

from __future__ import annotations

import threading

from google.protobuf import json_format

from unicron.trainer import runtime
from unicron.trainer.faults import FaultInjector
from unicron.trainer.settings import TrainerConfig
from unicron.v1 import common_pb2, trainer_service_pb2


class Recorded:
    def __init__(self) -> None:
        self.sent: list[trainer_service_pb2.ConnectRequest] = []

    def send(self, message: trainer_service_pb2.ConnectRequest) -> None:
        self.sent.append(message)

    def close(self, timeout_s: float = 5.0) -> None:
        pass


def _run(iterations: int, done: int) -> tuple[runtime.Run, Recorded]:
    spec = common_pb2.JobSpec(name="t")
    spec.training.iterations = iterations
    config = TrainerConfig(
        job_id="t",
        rank=1,
        world_size=2,
        master_addr="127.0.0.1",
        master_port=1,
        agent="(none)",
        spec=json_format.MessageToJson(spec),
        plaintext=True,
    )
    link, stop = Recorded(), threading.Event()
    run = runtime.Run(config, spec, link, stop, FaultInjector(False, lambda fault, at: None, stop))
    run.iteration = done
    return run, link


def test_an_error_after_the_last_iteration_says_so() -> None:
    run, link = _run(iterations=250, done=250)
    runtime.report_error(run, RuntimeError("Connection reset by peer"), common_pb2.FAILURE_KIND_CONNECTION_RESET)
    (sent,) = link.sent
    assert sent.error.message == "after its last iteration 250: RuntimeError: Connection reset by peer"


def test_an_error_before_it_is_as_it_was() -> None:
    run, link = _run(iterations=250, done=249)
    runtime.report_error(run, RuntimeError("Connection reset by peer"), common_pb2.FAILURE_KIND_CONNECTION_RESET)
    assert link.sent[0].error.message == "RuntimeError: Connection reset by peer"
    assert link.sent[0].error.iteration == 250
