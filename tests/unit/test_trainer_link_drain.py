"""A clean exit is judged by the rank's last iteration, so the agent waits until the trainer's
stream has been handled to its end before it reads it (TrainerLink.wait_drained): the last
reports can still be queued when the supervisor sees the process end."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from services.agent.supervisor import WorkerKey
from services.agent.trainer_link import LinkHandlers, TrainerLink, _Stream
from unicron.v1 import node_service_pb2
from unicron.v1 import trainer_service_pb2 as pb

KEY = WorkerKey("job-1", 1, 0)


def link_and_stream(handled: list[int]) -> tuple[TrainerLink, _Stream]:
    def on_iteration(key: WorkerKey, report: node_service_pb2.IterationReport) -> None:
        time.sleep(0.02)  # a loaded agent: each report takes a while
        handled.append(report.iteration)

    link = TrainerLink(
        "n1", LinkHandlers(lambda key: True, on_iteration, lambda key, error: None, lambda key, fault: None)
    )
    stream = _Stream(KEY, queue.Queue())
    link._streams[KEY] = stream
    return link, stream


def reports(last: int, release: threading.Event | None = None) -> Iterator[pb.ConnectRequest]:
    for i in range(1, last + 1):
        yield pb.ConnectRequest(
            iteration=node_service_pb2.IterationReport(job_id=KEY.job_id, generation=1, rank=0, iteration=i)
        )
    if release is not None:
        release.wait()


def test_the_exit_waits_for_the_last_reports() -> None:
    handled: list[int] = []
    link, stream = link_and_stream(handled)
    threading.Thread(target=link._read, args=(stream, reports(10)), daemon=True).start()
    assert link.wait_drained(KEY, 5.0)
    assert handled == list(range(1, 11))
    assert link.wait_drained(WorkerKey("job-1", 1, 1), 0.0)  # no stream: nothing to wait for


def test_a_stream_that_does_not_end_is_waited_for_only_so_long() -> None:
    release = threading.Event()
    link, stream = link_and_stream([])
    threading.Thread(target=link._read, args=(stream, reports(1, release)), daemon=True).start()
    started = time.monotonic()
    assert not link.wait_drained(KEY, 0.2)
    assert 0.2 <= time.monotonic() - started < 2.0
    release.set()
    assert link.wait_drained(KEY, 5.0)
