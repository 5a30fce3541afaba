"""The node agent: registers with the coordinator, heartbeats, executes commands
(start/stop trainers), and forwards what its trainers report."""

from __future__ import annotations

import functools
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc
from google.protobuf import json_format

from services.agent.supervisor import Supervisor, WorkerExit, WorkerKey
from services.agent.trainer_link import TrainerLink
from unicron import rpc
from unicron.retry import Backoff, retry
from unicron.v1 import node_service_pb2 as pb
from unicron.v1 import node_service_pb2_grpc, trainer_service_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")
RPC_TIMEOUT_S = 5.0
REPORT_BATCH_S = 0.2


class _Retryable(Exception):
    pass


@dataclass(frozen=True)
class AgentSettings:
    node_id: str
    slots: int
    failure_domain: str
    work_dir: Path
    stop_grace_s: float = 5.0
    trainer_command: tuple[str, ...] = (sys.executable, "-m", "services.trainer")


class Agent:
    def __init__(self, settings: AgentSettings, coordinator_address: str) -> None:
        self.settings = settings
        self.address = ""
        self._stub = node_service_pb2_grpc.NodeServiceStub(rpc.channel(coordinator_address))
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._heartbeat_s = 1.0
        self._command_cursor = ""
        self._reports: queue.Queue[pb.IterationReport] = queue.Queue()
        self._errors: dict[WorkerKey, str] = {}
        self.supervisor = Supervisor(settings.work_dir, self._worker_exited)
        self.link = TrainerLink(settings.node_id, self._reports.put, self._trainer_error)
        self._threads: list[threading.Thread] = []

    # ---- lifecycle --------------------------------------------------------------------

    def start(self, address: str) -> None:
        self.address = address
        for target, name in (
            (self._heartbeat_loop, "heartbeat"),
            (self._command_loop, "commands"),
            (self._report_loop, "reports"),
        ):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self.supervisor.stop(grace_s=self.settings.stop_grace_s)
        for thread in self._threads:
            thread.join(timeout=2)

    def _call(self, fn: Callable[[], T], deadline_s: float | None = 30.0) -> T:
        """Calls the coordinator, retrying while it is unreachable (it may be restarting)."""

        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as exc:
                if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise _Retryable(str(exc.code())) from exc
                raise

        return retry(
            attempt,
            retry_on=(_Retryable,),
            attempts=None,
            deadline_s=deadline_s,
            backoff=Backoff(0.1, 2.0),
            should_stop=self._stop.is_set,
        )

    def _register(self) -> None:
        request = pb.RegisterNodeRequest(
            node_id=self.settings.node_id,
            address=self.address,
            slots=self.settings.slots,
            failure_domain=self.settings.failure_domain,
        )
        reply = self._call(lambda: self._stub.RegisterNode(request, timeout=RPC_TIMEOUT_S), deadline_s=None)
        self._heartbeat_s = reply.heartbeat_interval_seconds or 1.0
        if not self._command_cursor:
            self._command_cursor = reply.last_command_id
        self._registered.set()
        log.info("registered with coordinator", extra={"node_id": self.settings.node_id, "slots": self.settings.slots})

    # ---- loops ------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._registered.is_set():
                    self._register()
                reply = self._stub.Heartbeat(pb.HeartbeatRequest(node_id=self.settings.node_id), timeout=RPC_TIMEOUT_S)
                if not reply.known:
                    self._registered.clear()
                    continue
            except (grpc.RpcError, _Retryable) as exc:
                log.warning("heartbeat failed", extra={"error": str(exc)[:200]})
            self._stop.wait(self._heartbeat_s)

    def _command_loop(self) -> None:
        delays = Backoff(0.1, 2.0).delays()
        while not self._stop.is_set():
            if not self._registered.wait(timeout=0.5):
                continue
            request = pb.StreamCommandsRequest(node_id=self.settings.node_id, after_command_id=self._command_cursor)
            try:
                for reply in self._stub.StreamCommands(request):
                    self._execute(reply.command)
                    self._command_cursor = reply.command.command_id
                    delays = Backoff(0.1, 2.0).delays()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self._registered.clear()
                elif not self._stop.is_set():
                    log.warning("command stream broken, reconnecting", extra={"code": exc.code().name})
            self._stop.wait(next(delays))

    def _report_loop(self) -> None:
        while not self._stop.is_set():
            batch: list[pb.IterationReport] = []
            try:
                batch.append(self._reports.get(timeout=0.5))
            except queue.Empty:
                continue
            self._stop.wait(REPORT_BATCH_S)
            while not self._reports.empty():
                batch.append(self._reports.get_nowait())
            request = pb.ReportProgressRequest(node_id=self.settings.node_id, reports=batch)
            try:
                self._call(functools.partial(self._stub.ReportProgress, request, timeout=RPC_TIMEOUT_S))
            except (grpc.RpcError, _Retryable) as exc:
                log.warning("dropping progress reports", extra={"count": len(batch), "error": str(exc)[:200]})

    # ---- commands ---------------------------------------------------------------------

    def _execute(self, command: pb.NodeCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start_workers":
            self._start_workers(command.start_workers)
        elif kind == "stop_workers":
            stop = command.stop_workers
            log.info("stopping job", extra={"job_id": stop.job_id, "reason": stop.reason})
            self.link.request_stop(stop.job_id, stop.reason)
            threading.Thread(
                target=self.supervisor.stop, args=(stop.job_id, self.settings.stop_grace_s), daemon=True
            ).start()
        else:
            log.warning("ignoring unknown command", extra={"command_id": command.command_id})

    def _start_workers(self, start: pb.StartWorkers) -> None:
        assignment = start.assignment
        ranks = [r for w in assignment.workers if w.node_id == self.settings.node_id for r in w.ranks]
        spec_json = json_format.MessageToJson(start.spec, indent=None)
        for rank in ranks:
            key = WorkerKey(start.job_id, assignment.generation, rank)
            if key in self.supervisor.running(start.job_id):
                continue  # a replayed command after a reconnect
            env = dict(os.environ)
            env.update(
                {
                    "UNICRON_TRAINER_JOB_ID": start.job_id,
                    "UNICRON_TRAINER_GENERATION": str(assignment.generation),
                    "UNICRON_TRAINER_RANK": str(rank),
                    "UNICRON_TRAINER_WORLD_SIZE": str(assignment.world_size),
                    "UNICRON_TRAINER_MASTER_ADDR": assignment.master_addr,
                    "UNICRON_TRAINER_MASTER_PORT": str(assignment.master_port),
                    "UNICRON_TRAINER_AGENT": self.address,
                    "UNICRON_TRAINER_SPEC": spec_json,
                }
            )
            self.supervisor.launch(key, self.settings.trainer_command, env)

    # ---- reports ----------------------------------------------------------------------

    def _worker_exited(self, exit: WorkerExit) -> None:
        request = pb.ReportWorkerExitRequest(
            node_id=self.settings.node_id,
            job_id=exit.key.job_id,
            generation=exit.key.generation,
            rank=exit.key.rank,
            error=self._errors.pop(exit.key, ""),
            exit_code=exit.exit_code,
            signal=exit.signal,
            stderr_tail=exit.stderr_tail,
        )
        try:
            self._call(lambda: self._stub.ReportWorkerExit(request, timeout=RPC_TIMEOUT_S), deadline_s=60.0)
        except (grpc.RpcError, _Retryable) as exc:
            log.error(
                "could not report trainer exit",
                extra={"job_id": exit.key.job_id, "rank": exit.key.rank, "error": str(exc)[:200]},
            )

    def _trainer_error(self, key: WorkerKey, error: trainer_service_pb2.TrainerError) -> None:
        self._errors[key] = error.message
        request = pb.ReportFailureRequest(
            node_id=self.settings.node_id,
            job_id=key.job_id,
            generation=key.generation,
            rank=key.rank,
            kind=error.kind,
            message=error.message,
        )
        try:
            self._call(lambda: self._stub.ReportFailure(request, timeout=RPC_TIMEOUT_S))
        except (grpc.RpcError, _Retryable) as exc:
            log.error("could not report failure", extra={"job_id": key.job_id, "error": str(exc)[:200]})
