"""The agent's side of the agent protocol: each trainer holds one Connect stream, over
which it reports iterations, errors and fired faults, and receives stop requests and
faults to inject. Reports are checked and rate-limited here: a misbehaving trainer gets a
`rejected` message and changes nothing, and cannot starve the agent."""

from __future__ import annotations

import logging
import math
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from services.agent.supervisor import WorkerKey
from unicron.ratelimit import KeyedLimiter
from unicron.security import caller, worker_name
from unicron.v1 import common_pb2, node_service_pb2, trainer_service_pb2_grpc
from unicron.v1 import trainer_service_pb2 as pb

log = logging.getLogger(__name__)

# A trainer reports once per iteration; a few hundred a second is already a flood.
REPORTS_PER_S = 200.0
REPORT_BURST = 400.0


def _check_time(stamp: Timestamp, field: str) -> None:
    """A time the coordinator would refuse (out of a Timestamp's range) is refused here."""
    try:
        stamp.ToNanoseconds()
    except ValueError:
        raise Rejected("INVALID_ARGUMENT", f"{field}: not a valid time (seconds {stamp.seconds})") from None


class Rejected(Exception):
    """A trainer message the agent refuses; code is a gRPC status code name."""

    def __init__(self, code: str, reason: str) -> None:
        super().__init__(reason)
        self.code = code


@dataclass(frozen=True)
class LinkHandlers:
    is_known: Callable[[WorkerKey], bool]
    on_iteration: Callable[[WorkerKey, node_service_pb2.IterationReport], None]  # may raise Rejected
    on_error: Callable[[WorkerKey, pb.TrainerError], None]
    on_fault_fired: Callable[[WorkerKey, pb.FaultFired], None]
    # The last iteration a re-keyed trainer ran under the key it left (its generation and
    # rank there): progress made, which the coordinator records while the job recovers.
    on_left_iteration: Callable[[WorkerKey, node_service_pb2.IterationReport], None] = lambda key, report: None


@dataclass
class _Stream:
    """One trainer's stream; its key changes when the trainer joins a new generation."""

    key: WorkerKey
    outbox: queue.Queue[pb.ConnectResponse | None]
    # Set once every message the trainer sent has been handled (its stream ended).
    drained: threading.Event = field(default_factory=threading.Event)


class TrainerLink(trainer_service_pb2_grpc.TrainerAgentServiceServicer):
    def __init__(self, node_id: str, handlers: LinkHandlers) -> None:
        self._node_id = node_id
        self._handlers = handlers
        self._limiter = KeyedLimiter(REPORTS_PER_S, REPORT_BURST)
        self._lock = threading.Lock()
        self._streams: dict[WorkerKey, _Stream] = {}
        # A trainer re-keyed (by a reform) before it connected says hello under the key it
        # was started with: that key -> its key now. And what it is to be told once there.
        self._moved: dict[WorkerKey, WorkerKey] = {}
        self._held: dict[WorkerKey, list[pb.ConnectResponse]] = {}
        # A connected trainer re-keyed by a reform: its key now -> the key it left.
        self._left: dict[WorkerKey, WorkerKey] = {}

    def Connect(
        self, request_iterator: Iterator[pb.ConnectRequest], context: grpc.ServicerContext
    ) -> Iterator[pb.ConnectResponse]:
        first = next(request_iterator, None)
        if first is None or not first.HasField("hello"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "hello: the first message must be a hello")
            return
        hello = first.hello
        key = WorkerKey(hello.job_id, hello.generation, hello.rank)
        principal, claimed = caller(), worker_name(key.job_id, key.generation, key.rank)
        if not principal.admin and principal.name != claimed:
            # The token was issued to another worker: it may not speak for this one.
            log.warning("trainer hello refused", extra={"hello": claimed, "token_for": principal.name})
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"the token is for {principal.name}, not job {key.job_id} generation {key.generation} rank {key.rank}",
            )
            return
        # One critical section with rekey: a reform between the lookup and the registration
        # would leave the hello under a key the supervisor no longer knows, or the stream
        # under one the reform already moved on from.
        with self._lock:
            key = self._moved.get(key, key)
            known = self._handlers.is_known(key)
            if known:
                stream = _Stream(key, queue.Queue())
                self._streams[key] = stream
                held = self._settle(key)
        if not known:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"no trainer of job {hello.job_id} generation {hello.generation} rank {hello.rank} runs here",
            )
            return
        stream.outbox.put(pb.ConnectResponse(welcome=pb.AgentWelcome(node_id=self._node_id)))
        for waiting in held:
            stream.outbox.put(waiting)
        threading.Thread(
            target=self._read, args=(stream, request_iterator), daemon=True, name=f"link-{hello.rank}"
        ).start()
        try:
            while context.is_active():
                try:
                    message = stream.outbox.get(timeout=1.0)
                except queue.Empty:
                    continue
                if message is None:
                    return
                yield message
        finally:
            with self._lock:
                if self._streams.get(stream.key) is stream:
                    del self._streams[stream.key]
                    self._left.pop(stream.key, None)
            self._limiter.forget(str(stream.key))

    def rekey(self, old: WorkerKey, new: WorkerKey, move_worker: Callable[[], object] = lambda: None) -> bool:
        """The trainer behind `old` moved to a new generation and rank (a reform): its
        stream now speaks for `new`. False when no such trainer is connected: then its hello,
        when it comes, is taken as `new`'s (what was held for `old` is out of date).
        `move_worker` renames the worker where `is_known` looks, in the same critical section
        as the hello's lookup: a hello sees the worker and its stream both before or both after."""
        with self._lock:
            move_worker()
            stream = self._streams.pop(old, None)
            if stream is None:
                start = next((first for first, now in self._moved.items() if now == old), old)
                self._moved[start] = new
                self._held.pop(old, None)
                return False
            stream.key = new
            self._streams[new] = stream
            self._left[new] = old
        return True

    def wait_drained(self, key: WorkerKey, timeout_s: float) -> bool:
        """Waits until the trainer of `key` (whose process ended) has had every message it
        sent handled: its last iteration reports can still be queued in its stream when the
        supervisor sees the exit. False when that took longer than `timeout_s`."""
        with self._lock:
            stream = self._streams.get(key)
        return stream is None or stream.drained.wait(timeout_s)

    def forget(self, key: WorkerKey) -> None:
        """The trainer of `key` is gone: nothing is held for it any more."""
        with self._lock:
            self._settle(key)

    def _settle(self, key: WorkerKey) -> list[pb.ConnectResponse]:
        """Drops the move to `key` and returns what was held for it (caller holds the lock)."""
        self._moved = {start: now for start, now in self._moved.items() if now != key}
        return self._held.pop(key, [])

    def _read(self, stream: _Stream, request_iterator: Iterator[pb.ConnectRequest]) -> None:
        last_refusal = ""
        try:
            for message in request_iterator:
                try:
                    self._handle(stream.key, message)
                    last_refusal = ""
                except Rejected as exc:
                    # Say it once per run of refusals, not once per flooded message.
                    if exc.code != last_refusal:
                        stream.outbox.put(pb.ConnectResponse(rejected=pb.Rejected(code=exc.code, reason=str(exc))))
                        log.warning(
                            "trainer message rejected",
                            extra={"job_id": stream.key.job_id, "rank": stream.key.rank, "reason": str(exc)},
                        )
                    last_refusal = exc.code
        except grpc.RpcError:
            pass  # the trainer went away; its exit status is reported by the supervisor
        finally:
            stream.drained.set()
            stream.outbox.put(None)

    def _handle(self, key: WorkerKey, message: pb.ConnectRequest) -> None:
        if not self._limiter.allow(str(key)):
            raise Rejected("RESOURCE_EXHAUSTED", f"more than {REPORTS_PER_S:g} messages per second")
        kind = message.WhichOneof("message")
        if kind == "iteration":
            report = message.iteration
            if report.job_id == key.job_id and report.generation < key.generation:
                # The iteration in flight when a reform re-keyed this trainer ends under the
                # generation it left: no fault of the trainer's. Under the very key it left, it
                # is progress made (the coordinator keeps rank 0's while the job recovers);
                # older, it is dropped.
                with self._lock:
                    left = self._left.get(key)
                if left is not None and (report.generation, report.rank) == (left.generation, left.rank):
                    self._handlers.on_left_iteration(left, report)
                else:
                    log.debug("report of a generation left behind dropped", extra={"job_id": key.job_id})
                return
            if (report.job_id, report.generation, report.rank) != (key.job_id, key.generation, key.rank):
                raise Rejected("INVALID_ARGUMENT", "iteration: reports may only be about the sending trainer")
            # The coordinator refuses a whole batch of reports for one of these, so one bad
            # trainer would lose its peers' reports too: refuse it here (the rest of a
            # report is checked by the agent's monitor).
            if report.iteration == 0:
                raise Rejected("INVALID_ARGUMENT", "iteration.iteration: iterations count from 1")
            if not math.isfinite(report.flops) or report.flops < 0:
                raise Rejected("INVALID_ARGUMENT", f"iteration.flops: must be a finite number >= 0, got {report.flops}")
            self._handlers.on_iteration(key, report)
        elif kind == "error":
            error = message.error
            if error.kind == common_pb2.FAILURE_KIND_UNSPECIFIED or error.kind not in common_pb2.FailureKind.values():
                raise Rejected("INVALID_ARGUMENT", f"error.kind: unknown failure kind {error.kind}")
            _check_time(error.first_seen, "error.first_seen")
            self._handlers.on_error(key, error)
        elif kind == "fault_fired":
            fault = message.fault_fired.fault
            if fault.kind == common_pb2.FAULT_KIND_UNSPECIFIED or fault.kind not in common_pb2.FaultKind.values():
                raise Rejected("INVALID_ARGUMENT", f"fault_fired.fault.kind: unknown fault kind {fault.kind}")
            _check_time(message.fault_fired.injected, "fault_fired.injected")
            self._handlers.on_fault_fired(key, message.fault_fired)
        elif kind == "finished":
            log.info("trainer finished", extra={"job_id": key.job_id, "rank": key.rank})
        else:
            raise Rejected("INVALID_ARGUMENT", "message: a hello may only be sent first")

    def send(self, key: WorkerKey, message: pb.ConnectResponse, hold: bool = False) -> bool:
        """Sends `message` to the trainer of `key`; False when it is not connected. With
        `hold`, a trainer still starting gets it once it connects."""
        with self._lock:
            stream = self._streams.get(key)
            if stream is None and hold:
                self._held.setdefault(key, []).append(message)
        if stream is not None:
            stream.outbox.put(message)
        return stream is not None

    def request_stop(self, job_id: str, reason: str, max_generation: int = 0) -> None:
        self.broadcast(job_id, pb.ConnectResponse(stop=pb.AgentStop(reason=reason)), max_generation)

    def broadcast(self, job_id: str, message: pb.ConnectResponse, max_generation: int = 0, generation: int = 0) -> int:
        """Sends message to the job's connected trainers (of one generation, or up to
        max_generation); returns how many."""
        with self._lock:
            targets = [
                stream.outbox
                for key, stream in self._streams.items()
                if key.job_id == job_id
                and (not max_generation or key.generation <= max_generation)
                and (not generation or key.generation == generation)
            ]
        for box in targets:
            box.put(message)
        return len(targets)

    def connected(self) -> list[WorkerKey]:
        with self._lock:
            return list(self._streams)
