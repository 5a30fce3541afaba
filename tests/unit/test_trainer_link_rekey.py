"""A reform renames a trainer (rekey) in the supervisor and on the trainer link; a trainer
that says hello at that moment must find both under one name. Seen in CI: a restarted rank's
hello fell between the two renames, was refused as unknown (NOT_FOUND), and the rank exited."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from services.agent.supervisor import WorkerKey
from services.agent.trainer_link import LinkHandlers, TrainerLink
from unicron.security.identity import TRUSTED, acting_as
from unicron.v1 import trainer_service_pb2 as pb

OLD, NEW = WorkerKey("job-1", 2, 1), WorkerKey("job-1", 3, 1)


class Aborted(Exception):
    pass


class Context:
    def is_active(self) -> bool:
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


def hello(key: WorkerKey) -> Iterator[pb.ConnectRequest]:
    yield pb.ConnectRequest(hello=pb.TrainerHello(job_id=key.job_id, generation=key.generation, rank=key.rank))
    threading.Event().wait()  # the trainer stays connected


class Supervisor:
    """The workers by their current key; `is_known` can be held open to let a reform race it."""

    def __init__(self) -> None:
        self.running = {OLD}
        self.entered, self.proceed = threading.Event(), threading.Event()
        self.proceed.set()

    def is_known(self, key: WorkerKey) -> bool:
        self.entered.set()
        self.proceed.wait()
        return key in self.running

    def rekey(self, old: WorkerKey, new: WorkerKey) -> None:
        self.running = {new if k == old else k for k in self.running}


def link_of(supervisor: Supervisor) -> TrainerLink:
    return TrainerLink(
        "n1", LinkHandlers(supervisor.is_known, lambda key, r: None, lambda key, e: None, lambda key, f: None)
    )


OPEN: list[Any] = []  # the streams of these tests stay open: a closed one leaves the link


def connect(link: TrainerLink, key: WorkerKey) -> Any:
    with acting_as(TRUSTED):
        stream = link.Connect(hello(key), Context())
        OPEN.append(stream)
        return next(stream)


def test_a_hello_during_a_rekey_is_taken_and_its_stream_moved_with_the_worker() -> None:
    supervisor = Supervisor()
    link = link_of(supervisor)
    supervisor.proceed.clear()
    first: list[Any] = []
    hello_thread = threading.Thread(target=lambda: first.append(connect(link, OLD)), daemon=True)
    hello_thread.start()
    assert supervisor.entered.wait(5.0)  # the hello is looking its worker up
    reform = threading.Thread(
        target=link.rekey, args=(OLD, NEW), kwargs={"move_worker": lambda: supervisor.rekey(OLD, NEW)}, daemon=True
    )
    reform.start()
    reform.join(0.2)  # the reform waits for the lookup: it must not rename in between
    supervisor.proceed.set()
    hello_thread.join(5.0)
    reform.join(5.0)
    assert first and first[0].HasField("welcome")
    assert supervisor.running == {NEW}
    assert set(link._streams) == {NEW}


def test_a_hello_after_a_rekey_speaks_for_the_new_key() -> None:
    supervisor = Supervisor()
    link = link_of(supervisor)
    assert not link.rekey(OLD, NEW, move_worker=lambda: supervisor.rekey(OLD, NEW))
    assert connect(link, OLD).HasField("welcome")
    assert set(link._streams) == {NEW}


def test_a_hello_of_no_worker_is_refused() -> None:
    link = link_of(Supervisor())
    with pytest.raises(Aborted) as refused:
        connect(link, WorkerKey("job-1", 5, 0))
    assert refused.value.args[0] == grpc.StatusCode.NOT_FOUND


def test_the_iteration_in_flight_at_a_reform_is_passed_on_as_progress_and_a_foreign_one_refused() -> None:
    """Re-keyed by a reform, a trainer still ends the iteration it was in under the generation
    it left: progress made, passed on (no refusal) under the key it left. One of a generation
    older still is dropped; a report about another rank, or a generation the trainer is not
    in yet, is refused."""
    from services.agent.trainer_link import Rejected
    from unicron.v1 import node_service_pb2

    seen: list[node_service_pb2.IterationReport] = []
    left: list[tuple[WorkerKey, int]] = []
    handlers = LinkHandlers(
        lambda key: key in {OLD, NEW},
        lambda key, r: seen.append(r),
        print,
        print,
        on_left_iteration=lambda key, r: left.append((key, r.iteration)),
    )
    link = TrainerLink("n1", handlers)

    def iteration(generation: int, rank: int) -> pb.ConnectRequest:
        report = node_service_pb2.IterationReport(job_id="job-1", generation=generation, rank=rank, iteration=7)
        return pb.ConnectRequest(iteration=report)

    # Not connected when re-keyed: nothing is known of the key it left, and nothing passes.
    link._handle(NEW, iteration(OLD.generation, OLD.rank))
    assert seen == [] and left == []
    connect(link, OLD)
    assert link.rekey(OLD, NEW)
    link._handle(NEW, iteration(OLD.generation, OLD.rank))
    assert left == [(OLD, 7)] and seen == []
    link._handle(NEW, iteration(OLD.generation - 1, OLD.rank))
    link._handle(NEW, iteration(OLD.generation, OLD.rank + 1))
    assert len(left) == 1
    for generation, rank in ((NEW.generation, 0), (NEW.generation + 1, NEW.rank)):
        with pytest.raises(Rejected, match="only be about the sending trainer"):
            link._handle(NEW, iteration(generation, rank))
    link._handle(NEW, iteration(NEW.generation, NEW.rank))
    assert [r.generation for r in seen] == [NEW.generation]
