"""The agent's side of NodeService: registration, the heartbeat stream, the command stream,
and the reports, each on a thread of its own so that none waits for another:

- iteration reports and clean exits go in batches, in order (`queue_progress`,
  `queue_exit`): a job's last iterations reach the coordinator before the exits that
  finish it, even when an outage held both back;
- failure and fault reports go at once, in order, retried on their own thread
  (`send_soon`): the threads that find them (a trainer link's reader above all) must not
  wait out a coordinator outage;
- a failed rank's exit is sent by the thread that saw it (`send`), retried there.

Every call is retried while the coordinator is unreachable (it may be restarting)."""

from __future__ import annotations

import contextlib
import functools
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from unicron import rpc
from unicron.retry import Backoff, retry
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, node_service_pb2_grpc
from unicron.v1 import node_service_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")
RPC_TIMEOUT_S = 5.0
# How long a failure report is retried: through any control-plane failover (a Sentinel
# partition kept every coordinator from acting for up to 16 s, and the default 30 s left too
# little margin behind a coordinator that hangs each call to its 5 s timeout). The
# coordinator drops a report about a generation that is over, so a late one is harmless.
URGENT_DEADLINE_S = 300.0
REPORT_BATCH_S = 0.2
RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class Retryable(Exception):
    pass


class CoordinatorClient:
    def __init__(
        self,
        node_id: str,
        coordinator_address: str,
        security: ClientSecurity | None,
        registration: Callable[[], pb.RegisterNodeRequest],
        on_command: Callable[[pb.NodeCommand], None],
        on_strays: Callable[[list[pb.JobGeneration]], None] | None = None,
    ) -> None:
        """`registration()`: what to register with (asked each time, as the agent's address
        is known only once it serves); `on_command` runs each command, in order;
        `on_strays` kills what the coordinator says, at a registration, it no longer runs."""
        self.node_id = node_id
        self.stub = node_service_pb2_grpc.NodeServiceStub(rpc.channel(coordinator_address, security))
        # Heartbeats on a connection of their own: behind reports and commands, a segment
        # lost on a lossy link can hold them back past the heartbeat timeout (seen in CI at
        # 25% loss: a false NODE_LOST).
        self._beat_stub = node_service_pb2_grpc.NodeServiceStub(
            rpc.channel(coordinator_address, security, own_connection=True)
        )
        self._registration = registration
        self._on_command = on_command
        self._on_strays = on_strays
        self._stop = threading.Event()
        self.registered = threading.Event()
        self._heartbeat_s = 1.0
        self._command_cursor = ""
        self._reports: queue.Queue[pb.IterationReport | pb.ReportWorkerExitRequest] = queue.Queue()
        self._flush_now = threading.Event()
        self._urgent: queue.Queue[tuple[str, Callable[[], object]]] = queue.Queue()
        # The open streams to the coordinator, cancelled on stop: a stream waiting for the
        # next command would otherwise hold its thread, and the agent's exit, for seconds.
        self._open_calls: set[grpc.Call] = set()
        self._open_calls_lock = threading.Lock()

    def loops(self) -> list[tuple[Callable[[], None], str]]:
        """The client's threads, with their names, for the agent to start."""
        return [
            (self._heartbeat_loop, "heartbeat"),
            (self._command_loop, "commands"),
            (self._report_loop, "reports"),
            (self._urgent_loop, "urgent-reports"),
        ]

    def stop(self) -> None:
        self._stop.set()
        with self._open_calls_lock:
            calls = list(self._open_calls)
        for call in calls:
            call.cancel()

    # ---- calls ------------------------------------------------------------------------

    def call(self, fn: Callable[[], T], deadline_s: float | None = 30.0) -> T:
        """Calls the coordinator, retrying while it is unreachable (it may be restarting)."""

        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as exc:
                # RESOURCE_EXHAUSTED: the coordinator's rate limit; backing off is the answer.
                if exc.code() in RETRYABLE:
                    raise Retryable(str(exc.code())) from exc
                raise

        return retry(
            attempt,
            retry_on=(Retryable,),
            attempts=None,
            deadline_s=deadline_s,
            backoff=Backoff(0.1, 2.0),
            should_stop=self._stop.is_set,
        )

    def send(self, what: str, fn: Callable[[], object], deadline_s: float | None = 30.0) -> None:
        """A report to the coordinator that must not take the calling thread down."""
        try:
            self.call(fn, deadline_s)
        except (grpc.RpcError, Retryable) as exc:
            log.error("could not send %s", what, extra={"error": str(exc)[:300]})

    def send_soon(self, what: str, fn: Callable[[], object]) -> None:
        """Queues a report for the urgent-reports thread (at once, in order, retried there)."""
        self._urgent.put((what, fn))

    def report_failure(self, report: common_pb2.FailureReport) -> None:
        # Only the kind: the coordinator alone turns a kind into severity and remedy.
        request = pb.ReportFailureRequest(node_id=self.node_id, report=report)
        self.send_soon("failure report", lambda: self.stub.ReportFailure(request, timeout=RPC_TIMEOUT_S))

    def report_fault(self, request: pb.ReportFaultInjectedRequest, at_once: bool = False) -> None:
        """A fault injected; at_once: sent by this thread, within 5 s (the agent is about to die)."""
        call = functools.partial(self.stub.ReportFaultInjected, request, timeout=RPC_TIMEOUT_S)
        if at_once:
            self.send("fault report", call, 5.0)
        else:
            self.send_soon("fault report", call)

    def ack(self, request: pb.AckCommandRequest) -> None:
        self.send("command ack", functools.partial(self.stub.AckCommand, request, timeout=RPC_TIMEOUT_S))

    def send_exit(self, request: pb.ReportWorkerExitRequest) -> None:
        self.send("trainer exit", lambda: self.stub.ReportWorkerExit(request, timeout=RPC_TIMEOUT_S), deadline_s=60.0)

    def queue_progress(self, report: pb.IterationReport, flush: bool = False) -> None:
        """An iteration report for the next batch; flush: send the batch now (it ends a recovery)."""
        self._reports.put(report)
        if flush:
            self._flush_now.set()

    def queue_exit(self, request: pb.ReportWorkerExitRequest) -> None:
        """A clean exit, sent after the iteration reports queued before it."""
        self._reports.put(request)

    # ---- registration and heartbeats ----------------------------------------------------

    def _register(self) -> None:
        request = self._registration()
        reply = self.call(lambda: self.stub.RegisterNode(request, timeout=RPC_TIMEOUT_S), deadline_s=None)
        self._heartbeat_s = reply.heartbeat_interval_seconds or 1.0
        if not self._command_cursor:
            self._command_cursor = reply.last_command_id
        if reply.strays and self._on_strays is not None:
            # Before `registered` lets the command stream go on: a newer generation's start
            # must not find the written-off ranks still alive.
            self._on_strays(list(reply.strays))
        self.registered.set()
        log.info("registered with coordinator", extra={"node_id": self.node_id, "slots": request.slots})

    def register_again(self) -> None:
        """Registers at once, as a restarted agent would (the coordinator's word for a node
        repaired); on failure the next heartbeat's answer decides, as ever."""
        try:
            self._register()
        except (grpc.RpcError, Retryable) as exc:
            log.warning("registering again failed", extra={"error": str(exc)[:200]})

    def _heartbeat_loop(self) -> None:
        delays = Backoff(0.1, 2.0).delays()
        while not self._stop.is_set():
            try:
                if not self.registered.is_set():
                    self._register()
                if self._heartbeat_stream():
                    delays = Backoff(0.1, 2.0).delays()
                if not self.registered.is_set():
                    continue  # the coordinator asked for a new registration: at once
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    # Another live agent holds this node id or this host: this one waits
                    # until that one is lost, asking again.
                    log.error("registration refused", extra={"node_id": self.node_id, "why": exc.details()})
                elif not self._stop.is_set():
                    log.warning("heartbeats interrupted, reconnecting", extra={"error": str(exc)[:200]})
            except Retryable as exc:
                if not self._stop.is_set():
                    log.warning("heartbeats interrupted, reconnecting", extra={"error": str(exc)[:200]})
            self._stop.wait(next(delays))

    def _heartbeat_stream(self) -> bool:
        """Heartbeats on one stream (StreamHeartbeats) until the coordinator asks the node to
        register again or the agent stops; raises when the stream breaks. Whether any beat
        was answered. The beats go out on time whatever the answers take."""
        done = threading.Event()

        def beats() -> Iterator[pb.StreamHeartbeatsRequest]:
            while not (self._stop.is_set() or done.is_set()):
                yield pb.StreamHeartbeatsRequest(node_id=self.node_id)
                done.wait(self._heartbeat_s)

        replies = self._beat_stub.StreamHeartbeats(beats())
        answered = False
        try:
            with self._open(replies):
                for reply in replies:
                    answered = True
                    if not reply.known:
                        self.registered.clear()
                        break
        finally:
            done.set()
            replies.cancel()
        return answered

    @contextlib.contextmanager
    def _open(self, call: Any) -> Iterator[None]:
        """Keeps `call` (a stream to the coordinator) on the list that stop() cancels."""
        with self._open_calls_lock:
            self._open_calls.add(call)
        if self._stop.is_set():
            call.cancel()  # stop() ran before the call was on the list
        try:
            yield
        finally:
            with self._open_calls_lock:
                self._open_calls.discard(call)

    # ---- commands and reports -----------------------------------------------------------

    def _command_loop(self) -> None:
        delays = Backoff(0.1, 2.0).delays()
        while not self._stop.is_set():
            if not self.registered.wait(timeout=0.5):
                continue
            request = pb.StreamCommandsRequest(node_id=self.node_id, after_command_id=self._command_cursor)
            try:
                commands = self.stub.StreamCommands(request)
                with self._open(commands):
                    for reply in commands:
                        self._on_command(reply.command)
                        self._command_cursor = reply.command.command_id
                        delays = Backoff(0.1, 2.0).delays()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self.registered.clear()
                elif not self._stop.is_set():
                    log.warning("command stream broken, reconnecting", extra={"code": exc.code().name})
            self._stop.wait(next(delays))

    def _urgent_loop(self) -> None:
        while not self._stop.is_set():
            try:
                what, fn = self._urgent.get(timeout=0.5)
            except queue.Empty:
                continue
            self.send(what, fn, URGENT_DEADLINE_S)

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            items: list[pb.IterationReport | pb.ReportWorkerExitRequest] = []
            try:
                items.append(self._reports.get(timeout=0.5))
            except queue.Empty:
                continue
            # Batch, unless an iteration that ends a recovery is waiting: the coordinator
            # counts the recovery's cost until it hears of it.
            if not self._flush_now.is_set():
                self._flush_now.wait(REPORT_BATCH_S)
            self._flush_now.clear()
            while not self._reports.empty():
                items.append(self._reports.get_nowait())
            batch: list[pb.IterationReport] = []
            for item in [*items, None]:
                if isinstance(item, pb.IterationReport):
                    batch.append(item)
                    continue
                if batch:
                    request = pb.ReportProgressRequest(node_id=self.node_id, reports=batch)
                    self.send(
                        "progress reports", functools.partial(self.stub.ReportProgress, request, timeout=RPC_TIMEOUT_S)
                    )
                    batch = []
                if item is not None:
                    self.send_exit(item)

    def urgent_backlog(self) -> list[str]:
        """What waits for the urgent-reports thread, by name (for tests and diagnostics)."""
        with self._urgent.mutex:
            return [what for what, _ in self._urgent.queue]
