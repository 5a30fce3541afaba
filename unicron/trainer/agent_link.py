"""The trainer's side of the agent protocol: one bidirectional stream to the node's agent."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc

from unicron import rpc
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, trainer_service_pb2_grpc
from unicron.v1 import trainer_service_pb2 as pb

log = logging.getLogger(__name__)

_CLOSE = object()


def _ignore_reform(reform: pb.AgentReform) -> None:
    log.warning("agent asked to reform, but this trainer does not reform", extra={"incident": reform.incident_id})


@dataclass(frozen=True)
class LinkCallbacks:
    on_stop: Callable[[str], None]
    on_inject: Callable[[common_pb2.Fault], None]
    # The agent went away: a trainer without its agent cannot be supervised, so it stops.
    on_lost: Callable[[str], None]
    # Leave the process group for a new one, keeping the training state (at the next iteration
    # boundary, or as the answer to a reported error).
    on_reform: Callable[[pb.AgentReform], None] = _ignore_reform


class AgentLink:
    def __init__(
        self,
        address: str,
        hello: pb.TrainerHello,
        callbacks: LinkCallbacks,
        security: ClientSecurity | None = None,
    ) -> None:
        # The token in `security` is this worker's own: the agent admits the hello only for
        # the job, generation and rank it was issued for.
        self._stub = trainer_service_pb2_grpc.TrainerAgentServiceStub(rpc.channel(address, security))
        self._hello = hello
        self._callbacks = callbacks
        self._outbox: queue.Queue[object] = queue.Queue()
        self._welcomed = threading.Event()
        # Set with the welcome, or when the stream ended before one: open() need not wait
        # out its timeout for an agent that refused the hello.
        self._answered = threading.Event()
        self._ended_because = ""
        self._closing = threading.Event()
        self._reader: threading.Thread | None = None

    def open(self, timeout_s: float = 30.0) -> None:
        self._outbox.put(pb.ConnectRequest(hello=self._hello))
        # wait_for_ready: a first connection attempt that fails (an agent still starting, a
        # loaded machine) is retried instead of failing the stream; the welcome wait bounds it.
        responses = self._stub.Connect(self._messages(), wait_for_ready=True)
        self._reader = threading.Thread(target=self._read, args=(responses,), daemon=True, name="agent-link")
        self._reader.start()
        if not self._answered.wait(timeout_s):
            raise ConnectionError(f"the agent did not answer within {timeout_s}s")
        if not self._welcomed.is_set():
            raise ConnectionError(f"the agent did not take the connection: {self._ended_because}")

    def _messages(self) -> Iterator[pb.ConnectRequest]:
        while True:
            item = self._outbox.get()
            if item is _CLOSE:
                return
            assert isinstance(item, pb.ConnectRequest)
            yield item

    def _read(self, responses: Iterator[pb.ConnectResponse]) -> None:
        reason = "the agent closed the connection"
        try:
            for response in responses:
                kind = response.WhichOneof("message")
                if kind == "welcome":
                    self._welcomed.set()
                    self._answered.set()
                elif kind == "stop":
                    log.info("agent asked to stop", extra={"reason": response.stop.reason})
                    self._callbacks.on_stop(response.stop.reason)
                elif kind == "inject":
                    self._callbacks.on_inject(response.inject)
                elif kind == "reform":
                    reform = response.reform
                    log.info(
                        "agent asked to reform",
                        extra={
                            "incident": reform.incident_id,
                            "generation": reform.generation,
                            "rank": reform.rank,
                            "world_size": reform.world_size,
                        },
                    )
                    self._callbacks.on_reform(reform)
                elif kind == "rejected":
                    log.warning(
                        "agent rejected a message",
                        extra={"code": response.rejected.code, "reason": response.rejected.reason},
                    )
        except grpc.RpcError as exc:
            reason = f"agent connection lost ({exc.code().name}: {exc.details()})"
        self._ended_because = reason
        self._answered.set()
        if not self._closing.is_set():
            log.warning(reason)
            self._callbacks.on_lost(reason)

    def send(self, message: pb.ConnectRequest) -> None:
        self._outbox.put(message)

    def close(self, timeout_s: float = 5.0) -> None:
        """Ends the stream after the queued messages are sent."""
        self._closing.set()
        self._outbox.put(_CLOSE)
        if self._reader:
            self._reader.join(timeout_s)
