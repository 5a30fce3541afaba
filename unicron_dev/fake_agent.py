"""A fake agent: the agent's trainer-facing gRPC service on 127.0.0.1, without a coordinator.
Real trainer processes connect to it as to their node's agent; the trainer tests and
bench-transition read what each rank reported."""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from unicron import rpc
from unicron.v1 import trainer_service_pb2 as pb
from unicron.v1 import trainer_service_pb2_grpc


class FakeAgent(trainer_service_pb2_grpc.TrainerAgentServiceServicer):
    """Welcomes every trainer, records what each rank sends, and answers an error report with
    a stop when ``stop_on_error`` is set (else not at all: the rank gives up after its wait)."""

    def __init__(self, stop_on_error: bool = False) -> None:
        self.stop_on_error = stop_on_error
        self.messages: dict[int, list[pb.ConnectRequest]] = defaultdict(list)
        # When each message arrived (time.monotonic()), beside it: wall time per iteration.
        self.arrival_times: dict[int, list[float]] = defaultdict(list)
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=rpc.SERVER_OPTIONS)
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0.5).wait()

    def Connect(self, request_iterator: Iterator[pb.ConnectRequest], context: grpc.ServicerContext) -> Any:
        first = next(request_iterator)
        rank = first.hello.rank
        outbox: queue.Queue[pb.ConnectResponse | None] = queue.Queue()
        outbox.put(pb.ConnectResponse(welcome=pb.AgentWelcome(node_id="fake")))

        def read() -> None:
            try:
                for request in request_iterator:
                    with self._lock:
                        self.messages[rank].append(request)
                        self.arrival_times[rank].append(time.monotonic())
                    if request.HasField("error") and self.stop_on_error:
                        outbox.put(pb.ConnectResponse(stop=pb.AgentStop(reason="test")))
            except grpc.RpcError:
                pass
            outbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            message = outbox.get()
            if message is None:
                return
            yield message

    def arrived(self, rank: int, kind: str) -> list[float]:
        """When each of ``rank``'s messages of ``kind`` arrived."""
        with self._lock:
            return [
                t
                for m, t in zip(self.messages[rank], self.arrival_times[rank], strict=True)
                if m.WhichOneof("message") == kind
            ]

    def of(self, rank: int, kind: str) -> list[Any]:
        with self._lock:
            return [getattr(m, kind) for m in self.messages[rank] if m.WhichOneof("message") == kind]
