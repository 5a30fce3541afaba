"""Fake agents: the agent's trainer-facing gRPC service on 127.0.0.1, without a coordinator.
Real trainer processes connect to them as to their node's agent; the trainer tests and the
benches read what each rank reported. ``RecordingAgent`` is the shared part (welcome, record,
answer through a per-process outbox); ``FakeAgent`` answers an error with a stop at most, and
``unicron_dev.trainer_procs.ReformAgent`` moves the processes to a new group."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Hashable, Iterator
from concurrent import futures
from typing import Any, Generic, TypeVar

import grpc

from unicron import rpc
from unicron.v1 import trainer_service_pb2 as pb
from unicron.v1 import trainer_service_pb2_grpc

Key = TypeVar("Key", bound=Hashable)
Outbox = queue.Queue[pb.ConnectResponse | None]


class RecordingAgent(trainer_service_pb2_grpc.TrainerAgentServiceServicer, Generic[Key]):
    """Welcomes every trainer and records what each sends (``messages``, and beside them
    ``arrival_times``: time.monotonic() of each), keyed by ``key_of(hello)``. Subclasses answer
    through the outbox they get in ``on_hello`` and ``on_message``."""

    def __init__(self) -> None:
        self.messages: dict[Key, list[pb.ConnectRequest]] = defaultdict(list)
        self.arrival_times: dict[Key, list[float]] = defaultdict(list)
        self._lock = threading.RLock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=rpc.SERVER_OPTIONS)
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0.5).wait()

    def key_of(self, hello: pb.TrainerHello) -> Key:
        raise NotImplementedError

    def on_hello(self, key: Key, hello: pb.TrainerHello, outbox: Outbox) -> None:
        """After the welcome is queued; under no lock."""

    def on_message(self, key: Key, request: pb.ConnectRequest, outbox: Outbox) -> None:
        """After ``request`` is recorded; under no lock."""

    def Connect(self, request_iterator: Iterator[pb.ConnectRequest], context: grpc.ServicerContext) -> Any:
        first = next(request_iterator)
        key = self.key_of(first.hello)
        outbox: Outbox = queue.Queue()
        outbox.put(pb.ConnectResponse(welcome=pb.AgentWelcome(node_id="fake")))
        self.on_hello(key, first.hello, outbox)

        def read() -> None:
            try:
                for request in request_iterator:
                    with self._lock:
                        self.messages[key].append(request)
                        self.arrival_times[key].append(time.monotonic())
                    self.on_message(key, request, outbox)
            except grpc.RpcError:
                pass
            outbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            message = outbox.get()
            if message is None:
                return
            yield message

    def arrived(self, key: Key, kind: str) -> list[float]:
        """When each of ``key``'s messages of ``kind`` arrived."""
        with self._lock:
            return [
                t
                for m, t in zip(self.messages[key], self.arrival_times[key], strict=True)
                if m.WhichOneof("message") == kind
            ]

    def of(self, key: Key, kind: str) -> list[Any]:
        with self._lock:
            return [getattr(m, kind) for m in self.messages[key] if m.WhichOneof("message") == kind]


class FakeAgent(RecordingAgent[int]):
    """Records what each rank sends, and answers an error report with a stop when
    ``stop_on_error`` is set (else not at all: the rank gives up after its wait)."""

    def __init__(self, stop_on_error: bool = False) -> None:
        self.stop_on_error = stop_on_error
        super().__init__()

    def key_of(self, hello: pb.TrainerHello) -> int:
        return int(hello.rank)

    def on_message(self, key: int, request: pb.ConnectRequest, outbox: Outbox) -> None:
        if request.HasField("error") and self.stop_on_error:
            outbox.put(pb.ConnectResponse(stop=pb.AgentStop(reason="test")))
