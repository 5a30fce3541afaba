"""The agent's side of the agent protocol: each trainer holds one Connect stream, over
which it reports iterations and errors and receives stop requests."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator

import grpc

from services.agent.supervisor import WorkerKey
from unicron.v1 import node_service_pb2, trainer_service_pb2, trainer_service_pb2_grpc

log = logging.getLogger(__name__)


class TrainerLink(trainer_service_pb2_grpc.TrainerAgentServiceServicer):
    def __init__(
        self,
        node_id: str,
        on_iteration: Callable[[node_service_pb2.IterationReport], None],
        on_error: Callable[[WorkerKey, trainer_service_pb2.TrainerError], None],
    ) -> None:
        self._node_id = node_id
        self._on_iteration = on_iteration
        self._on_error = on_error
        self._lock = threading.Lock()
        self._outboxes: dict[WorkerKey, queue.Queue[trainer_service_pb2.ConnectResponse | None]] = {}

    def Connect(
        self, request_iterator: Iterator[trainer_service_pb2.ConnectRequest], context: grpc.ServicerContext
    ) -> Iterator[trainer_service_pb2.ConnectResponse]:
        first = next(request_iterator, None)
        if first is None or not first.HasField("hello"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: the first message must be a hello")
            return
        hello = first.hello
        key = WorkerKey(hello.job_id, hello.generation, hello.rank)
        outbox: queue.Queue[trainer_service_pb2.ConnectResponse | None] = queue.Queue()
        with self._lock:
            self._outboxes[key] = outbox
        outbox.put(trainer_service_pb2.ConnectResponse(welcome=trainer_service_pb2.AgentWelcome(node_id=self._node_id)))
        reader = threading.Thread(
            target=self._read, args=(key, request_iterator, outbox), daemon=True, name=f"link-{hello.rank}"
        )
        reader.start()
        try:
            while context.is_active():
                try:
                    message = outbox.get(timeout=1.0)
                except queue.Empty:
                    continue
                if message is None:
                    return
                yield message
        finally:
            with self._lock:
                if self._outboxes.get(key) is outbox:
                    del self._outboxes[key]

    def _read(
        self,
        key: WorkerKey,
        request_iterator: Iterator[trainer_service_pb2.ConnectRequest],
        outbox: queue.Queue[trainer_service_pb2.ConnectResponse | None],
    ) -> None:
        try:
            for message in request_iterator:
                kind = message.WhichOneof("message")
                if kind == "iteration":
                    self._on_iteration(message.iteration)
                elif kind == "error":
                    self._on_error(key, message.error)
                elif kind == "finished":
                    log.info("trainer finished", extra={"job_id": key.job_id, "rank": key.rank})
        except grpc.RpcError:
            pass  # the trainer went away; its exit status is reported by the supervisor
        finally:
            outbox.put(None)

    def request_stop(self, job_id: str, reason: str) -> None:
        with self._lock:
            targets = [box for key, box in self._outboxes.items() if key.job_id == job_id]
        for box in targets:
            box.put(trainer_service_pb2.ConnectResponse(stop=trainer_service_pb2.AgentStop(reason=reason)))

    def connected(self) -> list[WorkerKey]:
        with self._lock:
            return list(self._outboxes)
