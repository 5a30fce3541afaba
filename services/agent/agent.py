"""The node agent: registers with the coordinator, heartbeats, executes commands
(start/stop trainers, inject faults), and runs the node's detectors: process supervision
(supervisor.py), exception propagation (trainers' reports over trainer_link.py),
statistical monitoring of iteration times (monitor.py) and node health (health.py)."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import psutil
from google.protobuf import json_format

from services.agent.health import HealthCheck, HealthFinding, run_checks
from services.agent.spares import SparePool
from services.agent.supervisor import Supervisor, WorkerExit, WorkerKey
from services.agent.trainer_link import LinkHandlers, Rejected, TrainerLink
from unicron import incident_trace as trace
from unicron import rpc
from unicron.monitor import Finding, JobMonitor, MonitorSettings, ReportRejected
from unicron.retry import Backoff, retry
from unicron.security import ClientSecurity, WorkerTokens
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2, node_service_pb2_grpc, trainer_service_pb2, trainer_service_pb2_grpc
from unicron.v1 import node_service_pb2 as pb

log = logging.getLogger(__name__)

T = TypeVar("T")
RPC_TIMEOUT_S = 5.0
REPORT_BATCH_S = 0.2
MONITOR_PERIOD_S = 0.1
MIN_MONITOR_WAIT_S = 0.005
STACK_WAIT_S = 0.1
# A trainer that keeps burning CPU while no iteration finishes is more likely starved or
# slow than hung (a hung collective sleeps, a stopped process does not run): its hang
# verdict waits, but never longer than this many thresholds, since a GPU that hangs in
# NCCL can spin the CPU too.
HANG_HOLD_THRESHOLDS = 3.0
BUSY_CORES = 0.25
# A suspected hang whose trainers' threads together waited in the CPU run queue this many
# seconds per second is held: a starved compute thread waits nearly all the time, while a
# hung job's threads sleep and only its background threads queue now and then.
STARVED_WAIT = 0.25
STACK_BYTES = 16 * 1024


RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED}


class _Retryable(Exception):
    pass


@dataclass(frozen=True)
class AgentSettings:
    node_id: str
    slots: int
    failure_domain: str
    work_dir: Path
    checkpoint_dir: Path | None = None
    # Where this node's trainers keep in-memory snapshots of their state (a directory per
    # job; a tmpfs such as /dev/shm). None: no snapshots.
    snapshot_dir: Path | None = None
    stop_grace_s: float = 5.0
    fault_injection: bool = False
    monitoring: bool = True
    health_period_s: float = 5.0
    monitor: MonitorSettings = field(default_factory=MonitorSettings)
    trainer_command: tuple[str, ...] = (sys.executable, "-m", "services.trainer")
    # Trainer processes kept ready (torch and Megatron imported) for ranks that start: a
    # restart then skips seconds of imports. Each costs the memory of an idle trainer.
    warm_spares: int = 0
    spare_command: tuple[str, ...] = (sys.executable, "-m", "services.trainer.spare")
    # How trainers reach this agent (unicron.trainer.settings.trainer_env of tls_* with the
    # agent's own certificate, as a trainer is the agent's child on its node, or plaintext).
    trainer_env: Mapping[str, str] = field(default_factory=dict)
    # The node's GPU ids, one per slot (empty: no GPUs); a trainer sees its slot's alone.
    gpus: tuple[str, ...] = ()
    # The container image this agent and its trainers run in ("" when none is named).
    image: str = ""


def trainer_base_env() -> dict[str, str]:
    """The environment every trainer of this node starts from (its rank's settings added)."""
    env = dict(os.environ)
    # One rank per slot: a CPU rank with a thread per core would oversubscribe the node
    # many times over and starve the agent's own heartbeat.
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _catches(pid: int, sig: signal.Signals) -> bool:
    """Whether a process has a handler installed for sig (Linux: SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def _run_queue(pid: int) -> tuple[float, bool]:
    """Seconds the process's threads have waited for a CPU (/proc/<pid>/task/*/schedstat,
    second field, in ns), and whether one of them is runnable now (state R in its stat);
    (0, False) for a process that is gone."""
    waited, runnable = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                waited += int(stat.read().split()[1])
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                # The state follows the command name, which is in parentheses and may hold spaces.
                runnable = runnable or stat.read().rpartition(")")[2].split()[0] == "R"
        except (OSError, IndexError, ValueError):
            continue
    return waited / 1e9, runnable


def _stamp(message: common_pb2.FailureReport, at: float) -> common_pb2.FailureReport:
    message.first_seen.FromNanoseconds(int(at * 1e9))
    return message


class Agent:
    def __init__(
        self,
        settings: AgentSettings,
        coordinator_address: str,
        health_checks: list[HealthCheck] | None = None,
        security: ClientSecurity | None = None,
        worker_tokens: WorkerTokens | None = None,
    ) -> None:
        self.settings = settings
        self.address = ""
        self._stub = node_service_pb2_grpc.NodeServiceStub(rpc.channel(coordinator_address, security))
        # Each trainer gets a token for its job, generation and rank, which its link to this
        # agent must show (TrainerLink): a trainer speaks only for itself.
        self.worker_tokens = worker_tokens if worker_tokens is not None else WorkerTokens()
        self._stop = threading.Event()
        self._registered = threading.Event()
        self._heartbeat_s = 1.0
        self._command_cursor = ""
        self._reports: queue.Queue[pb.IterationReport | pb.ReportWorkerExitRequest] = queue.Queue()
        # Failure and fault reports, sent in order by their own thread: the threads that find
        # them (a trainer link's reader, above all) must not wait out a coordinator outage.
        self._urgent: queue.Queue[tuple[str, Callable[[], object]]] = queue.Queue()
        self._errors: dict[WorkerKey, str] = {}
        self._monitors: dict[tuple[str, int], JobMonitor] = {}
        self._monitors_lock = threading.Lock()
        self._health_checks = health_checks or []
        self._health_seen: set[tuple[common_pb2.FailureKind, str]] = set()
        self._suspected_hangs: dict[tuple[str, int], Finding] = {}
        # A job past its last iteration is tearing down, not hung: its silence means nothing.
        self._last_iteration: dict[str, int] = {}
        self._finishing: set[tuple[str, int]] = set()
        # Jobs with a trainer that reported an error and waits for the coordinator's remedy:
        # no hang verdicts for them until an iteration completes again.
        self._awaiting_decision: set[tuple[str, int]] = set()
        self._flush_now = threading.Event()
        # Job generations whose next iteration ends a transition (a start, a reattempt, a
        # reform): their first report skips the batching delay.
        self._flush_next: set[tuple[str, int]] = set()
        # Per job generation: the CPU rate of its local trainers over the last tick, in cores.
        self._cpu_rates: dict[tuple[str, int], float] = {}
        self._cpu_last: dict[tuple[str, int], tuple[float, float]] = {}
        # (when, run-queue seconds) of a suspected hang's trainers at the previous look.
        self._wait_marks: dict[tuple[str, int], tuple[float, float]] = {}
        spares = SparePool(
            settings.warm_spares,
            settings.spare_command,
            settings.trainer_command,
            trainer_base_env(),
            settings.work_dir,
        )
        self.supervisor = Supervisor(settings.work_dir, self._worker_exited, spares, settings.gpus)
        self._spares = spares
        self.link = TrainerLink(
            settings.node_id,
            LinkHandlers(
                is_known=lambda key: key in self.supervisor.running(key.job_id),
                on_iteration=self._trainer_iteration,
                on_error=self._trainer_error,
                on_fault_fired=self._fault_fired,
            ),
        )
        self._threads: list[threading.Thread] = []
        # The open streams to the coordinator, cancelled on stop: a stream waiting for the
        # next command would otherwise hold its thread, and the agent's exit, for seconds.
        self._open_calls: set[grpc.Call] = set()
        self._open_calls_lock = threading.Lock()

    # ---- lifecycle --------------------------------------------------------------------

    def start(self, address: str) -> None:
        self.address = address
        loops = [
            (self._heartbeat_loop, "heartbeat"),
            (self._command_loop, "commands"),
            (self._report_loop, "reports"),
            (self._urgent_loop, "urgent-reports"),
        ]
        if self.settings.monitoring:
            loops.append((self._monitor_loop, "monitor"))
        if self._health_checks:
            loops.append((self._health_loop, "health"))
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        threading.Thread(target=self._spares.fill, name="spares", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()
        with self._open_calls_lock:
            calls = list(self._open_calls)
        for call in calls:
            call.cancel()
        self.supervisor.close()
        self.supervisor.stop(grace_s=self.settings.stop_grace_s)
        if self.settings.snapshot_dir is not None:
            # The node goes out of service: its trainers' snapshots are memory to give back.
            shutil.rmtree(self.settings.snapshot_dir, ignore_errors=True)
        for thread in self._threads:
            thread.join(timeout=2)

    def _call(self, fn: Callable[[], T], deadline_s: float | None = 30.0) -> T:
        """Calls the coordinator, retrying while it is unreachable (it may be restarting)."""

        def attempt() -> T:
            try:
                return fn()
            except grpc.RpcError as exc:
                # RESOURCE_EXHAUSTED: the coordinator's rate limit; backing off is the answer.
                if exc.code() in RETRYABLE:
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

    def _send(self, what: str, fn: Callable[[], object], deadline_s: float | None = 30.0) -> None:
        """A report to the coordinator that must not take the calling thread down."""
        try:
            self._call(fn, deadline_s)
        except (grpc.RpcError, _Retryable) as exc:
            log.error("could not send %s", what, extra={"error": str(exc)[:300]})

    def _register(self) -> None:
        request = pb.RegisterNodeRequest(
            node_id=self.settings.node_id,
            address=self.address,
            slots=self.settings.slots,
            failure_domain=self.settings.failure_domain,
            fault_injection=self.settings.fault_injection,
            image=self.settings.image,
        )
        reply = self._call(lambda: self._stub.RegisterNode(request, timeout=RPC_TIMEOUT_S), deadline_s=None)
        self._heartbeat_s = reply.heartbeat_interval_seconds or 1.0
        if not self._command_cursor:
            self._command_cursor = reply.last_command_id
        self._registered.set()
        log.info("registered with coordinator", extra={"node_id": self.settings.node_id, "slots": self.settings.slots})

    # ---- loops ------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        delays = Backoff(0.1, 2.0).delays()
        while not self._stop.is_set():
            try:
                if not self._registered.is_set():
                    self._register()
                if self._heartbeat_stream():
                    delays = Backoff(0.1, 2.0).delays()
                if not self._registered.is_set():
                    continue  # the coordinator asked for a new registration: at once
            except (grpc.RpcError, _Retryable) as exc:
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
                yield pb.StreamHeartbeatsRequest(node_id=self.settings.node_id)
                done.wait(self._heartbeat_s)

        replies = self._stub.StreamHeartbeats(beats())
        answered = False
        try:
            with self._open(replies):
                for reply in replies:
                    answered = True
                    if not reply.known:
                        self._registered.clear()
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

    def _command_loop(self) -> None:
        delays = Backoff(0.1, 2.0).delays()
        while not self._stop.is_set():
            if not self._registered.wait(timeout=0.5):
                continue
            request = pb.StreamCommandsRequest(node_id=self.settings.node_id, after_command_id=self._command_cursor)
            try:
                commands = self._stub.StreamCommands(request)
                with self._open(commands):
                    for reply in commands:
                        self._execute(reply.command)
                        self._command_cursor = reply.command.command_id
                        delays = Backoff(0.1, 2.0).delays()
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.NOT_FOUND:
                    self._registered.clear()
                elif not self._stop.is_set():
                    log.warning("command stream broken, reconnecting", extra={"code": exc.code().name})
            self._stop.wait(next(delays))

    def _urgent_loop(self) -> None:
        while not self._stop.is_set():
            try:
                what, call = self._urgent.get(timeout=0.5)
            except queue.Empty:
                continue
            self._send(what, call)

    def _send_soon(self, what: str, call: Callable[[], object]) -> None:
        """Queues a report for the urgent-reports thread (at once, in order, retried there)."""
        self._urgent.put((what, call))

    def _report_loop(self) -> None:
        """Sends iteration reports in batches and clean exits in order with them: a job's
        last iterations reach the coordinator before the exits that finish it, even when
        an outage held both back."""
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
                    request = pb.ReportProgressRequest(node_id=self.settings.node_id, reports=batch)
                    self._send(
                        "progress reports", functools.partial(self._stub.ReportProgress, request, timeout=RPC_TIMEOUT_S)
                    )
                    batch = []
                if item is not None:
                    self._send_exit(item)

    def _monitor_loop(self) -> None:
        wait_s = MONITOR_PERIOD_S
        while not self._stop.wait(wait_s):
            now = time.time()
            with self._monitors_lock:
                watched = [
                    monitor
                    for key, monitor in self._monitors.items()
                    if key not in self._finishing and key not in self._awaiting_decision
                ]
                findings = [finding for monitor in watched for finding in monitor.check(now)]
                progress = {key: monitor.last_progress for key, monitor in self._monitors.items()}
                due = [at for monitor in watched if (at := monitor.hang_due_at()) is not None]
            # Wake when the next hang verdict falls due rather than on the next tick: the
            # tick would add up to a whole period to every hang's detection.
            wait_s = min([MONITOR_PERIOD_S, *(max(MIN_MONITOR_WAIT_S, at - now) for at in due)])
            self._sample_cpu(list(progress), now)
            for finding in findings:
                if finding.kind == common_pb2.FAILURE_KIND_TASK_HANG:
                    self._suspected_hangs[(finding.job_id, finding.generation)] = finding
                else:
                    self._report_finding(finding)
            for key, finding in list(self._suspected_hangs.items()):
                verdict = self._judge_hang(key, finding, progress.get(key), now)
                if verdict is not None:
                    del self._suspected_hangs[key]
                    self._wait_marks.pop(key, None)
                    if verdict:
                        self._report_finding(finding)

    def _judge_hang(
        self, key: tuple[str, int], finding: Finding, last_progress: float | None, now: float
    ) -> bool | None:
        """True: report the hang; False: it resolved itself; None: wait (busy, maybe starved)."""
        threshold = finding.evidence.get("threshold_s", 0.0)
        if (
            key in self._finishing
            or key in self._awaiting_decision
            or last_progress is None
            or last_progress > finding.first_seen - threshold
        ):
            return False  # the job was forgotten, or an iteration finished after all
        starved = self._starved(key, now)
        busy = starved or self._cpu_rates.get(key, 0.0) > BUSY_CORES or self._runnable(key[0])
        if busy and now < finding.first_seen + (HANG_HOLD_THRESHOLDS - 1) * threshold:
            return None
        finding.evidence["held_s"] = max(0.0, now - finding.first_seen)
        finding.evidence["cpu_cores"] = self._cpu_rates.get(key, 0.0)
        return True

    def _starved(self, key: tuple[str, int], now: float) -> bool:
        """Whether the job's trainers are waiting for a CPU: a job starved by other load is
        not hung, and a hung one does not queue for the CPU. At the first look, whether a
        thread is runnable (nothing to compare yet); later, whether their threads waited in
        the run queue (the kernel's schedstat run delay) more than STARVED_WAIT since then."""
        waited, runnable = 0.0, False
        for pid in self.supervisor.pids(key[0]).values():
            seconds, queued = _run_queue(pid)
            waited, runnable = waited + seconds, runnable or queued
        mark = self._wait_marks.get(key)
        self._wait_marks[key] = (now, waited)
        if mark is None:
            return runnable
        return now > mark[0] and (waited - mark[1]) / (now - mark[0]) > STARVED_WAIT

    def _runnable(self, job_id: str) -> bool:
        """Whether a trainer of the job is running or waiting for the CPU or a disk now. A
        trainer starved by other load is runnable with little CPU to show for it, and one
        writing a checkpoint waits on the disk; a hung one sleeps in its collective or is
        stopped."""
        for pid in self.supervisor.pids(job_id).values():
            try:
                if psutil.Process(pid).status() in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP):
                    return True
            except psutil.Error:
                pass
        return False

    def _sample_cpu(self, keys: list[tuple[str, int]], now: float) -> None:
        for key in keys:
            previous = self._cpu_last.get(key)
            if previous is not None and now - previous[0] < MONITOR_PERIOD_S / 2:
                continue  # an early wake-up: a rate over a few ms is clock-tick noise
            cpu = self._job_cpu_seconds(key[0])
            self._cpu_last[key] = (now, cpu)
            if previous is not None and now > previous[0]:
                self._cpu_rates[key] = (cpu - previous[1]) / (now - previous[0])
        for stale in set(self._cpu_last) - set(keys):
            self._cpu_last.pop(stale, None)
            self._cpu_rates.pop(stale, None)

    def _job_cpu_seconds(self, job_id: str) -> float:
        total = 0.0
        for pid in self.supervisor.pids(job_id).values():
            try:
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def _health_loop(self) -> None:
        while not self._stop.wait(self.settings.health_period_s):
            findings = run_checks(self._health_checks)
            current = {(f.kind, f.check) for f in findings}
            for finding in findings:
                if (finding.kind, finding.check) not in self._health_seen:
                    self._report_health(finding)
            # A condition that clears re-arms its report.
            self._health_seen = current

    # ---- commands ---------------------------------------------------------------------

    def _execute(self, command: pb.NodeCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start_workers":
            start = command.start_workers
            self._apply_and_ack(
                command, "start", start.job_id, start.assignment.generation, lambda: self._start_workers(start)
            )
        elif kind == "stop_workers":
            stop = command.stop_workers
            log.info(
                "stopping job", extra={"job_id": stop.job_id, "reason": stop.reason, "generation": stop.generation}
            )
            self.link.request_stop(stop.job_id, stop.reason, stop.generation)
            self._forget_job(stop.job_id, stop.generation)

            def stop_and_ack() -> None:
                with self._transition_span(command, "stop", stop.job_id, stop.generation):
                    self.supervisor.stop(stop.job_id, self.settings.stop_grace_s, stop.generation)
                self._ack(command, stop.job_id, stop.generation)

            threading.Thread(target=stop_and_ack, name="stop", daemon=True).start()
        elif kind == "reform":
            reform = command.reform
            self._apply_and_ack(
                command, "reform", reform.job_id, reform.assignment.generation, lambda: self._reform(reform)
            )
        elif kind == "inject_fault":
            self._inject(command.inject_fault)
        else:
            log.warning("ignoring unknown command", extra={"command_id": command.command_id})

    def _transition_span(
        self, command: pb.NodeCommand, action: str, job_id: str, generation: int
    ) -> AbstractContextManager[object]:
        """This node's part of an incident's transition, in the incident's trace."""
        return trace.child_span(
            command.traceparent,
            trace.TRANSITION,
            {
                trace.ATTR_ACTION: action,
                trace.ATTR_JOB: job_id,
                trace.ATTR_NODE: self.settings.node_id,
                trace.ATTR_GENERATION: generation,
            },
        )

    def _ack(self, command: pb.NodeCommand, job_id: str, generation: int, error: str = "") -> None:
        request = pb.AckCommandRequest(
            node_id=self.settings.node_id,
            command_id=command.command_id,
            job_id=job_id,
            generation=generation,
            ok=not error,
            error=error,
        )
        self._send("command ack", functools.partial(self._stub.AckCommand, request, timeout=RPC_TIMEOUT_S))

    def _apply_and_ack(
        self, command: pb.NodeCommand, action: str, job_id: str, generation: int, apply: Callable[[], None]
    ) -> None:
        """Runs a command that launches trainers, inside its transition span, and acknowledges
        it: with the error when a trainer cannot be started."""
        with self._transition_span(command, action, job_id, generation):
            try:
                apply()
            except OSError as exc:
                self._ack(command, job_id, generation, f"cannot {action} trainers: {exc}")
            else:
                self._ack(command, job_id, generation)

    def _start_workers(
        self, start: pb.StartWorkers, only: set[int] | None = None, extra_env: dict[str, str] | None = None
    ) -> None:
        """Starts this node's ranks of the assignment (only those in `only`, when given)."""
        assignment = start.assignment
        wanted = start.spec.program.image
        if wanted and wanted != self.settings.image:
            # Trainers run in this agent's own image: another image's code is not here.
            raise OSError(
                f"the job's program.image is {wanted!r}, but this node runs "
                + (f"{self.settings.image!r}" if self.settings.image else "no named image")
                + " and starts no containers"
            )
        ranks = [r for w in assignment.workers if w.node_id == self.settings.node_id for r in w.ranks]
        spec_json = json_format.MessageToJson(start.spec, indent=None)
        with self._monitors_lock:
            self._monitors[(start.job_id, assignment.generation)] = JobMonitor(
                start.job_id, assignment.generation, ranks, self.settings.monitor, time.time()
            )
            self._last_iteration[start.job_id] = start.spec.training.iterations
            self._flush_next.add((start.job_id, assignment.generation))
        for rank in ranks:
            key = WorkerKey(start.job_id, assignment.generation, rank)
            if key in self.supervisor.running(start.job_id) or (only is not None and rank not in only):
                continue  # a replayed command after a reconnect, or a rank kept alive
            env = trainer_base_env()
            env.update(self.settings.trainer_env)
            env.update(
                trainer_env(
                    job_id=start.job_id,
                    generation=assignment.generation,
                    rank=rank,
                    world_size=assignment.world_size,
                    master_addr=assignment.master_addr,
                    master_port=assignment.master_port,
                    agent=self.address,
                    spec=spec_json,
                    fault_injection=self.settings.fault_injection,
                    token=self.worker_tokens.issue(start.job_id, assignment.generation, rank),
                    checkpoint_dir=self._job_dir(self.settings.checkpoint_dir, start.job_id),
                    snapshot_dir=self._job_dir(self.settings.snapshot_dir, start.job_id),
                )
            )
            env.update(extra_env or {})
            # Spares are the recovery reserve: a job's first start goes cold, so that a
            # failure soon after it still finds one ready.
            self.supervisor.launch(key, self.settings.trainer_command, env, spare=assignment.generation > 1)

    @staticmethod
    def _job_dir(root: Path | None, job_id: str) -> str | None:
        return None if root is None else str(root / job_id)

    def _reform(self, reform: pb.Reform) -> None:
        """Moves this node's live ranks of the job to the new generation in place (they
        keep their state and join the new process group), stops the live ranks the new
        assignment leaves out, and starts its new ranks, which take the state from a live
        peer."""
        assignment = reform.assignment
        here = {r for w in assignment.workers if w.node_id == self.settings.node_id for r in w.ranks}
        kept: set[int] = set()
        for key in self.supervisor.running(reform.job_id):
            new_rank = reform.rank_map.get(key.rank)
            if key.generation != reform.from_generation or new_rank is None or new_rank not in here:
                continue
            new_key = WorkerKey(reform.job_id, assignment.generation, new_rank)
            self.supervisor.rekey(key, new_key)
            self.link.rekey(key, new_key)
            message = trainer_service_pb2.AgentReform(
                incident_id=reform.incident_id,
                generation=assignment.generation,
                rank=new_rank,
                world_size=assignment.world_size,
                master_addr=assignment.master_addr,
                master_port=assignment.master_port,
            )
            if not self.link.send(new_key, trainer_service_pb2.ConnectResponse(reform=message), hold=True):
                log.info("reform held for a trainer still starting", extra={"job_id": reform.job_id, "rank": key.rank})
            kept.add(new_rank)
        leaving = f"left out of generation {assignment.generation}"
        self.link.request_stop(reform.job_id, leaving, reform.from_generation)
        self._forget_job(reform.job_id, reform.from_generation)
        threading.Thread(
            target=self.supervisor.stop,
            args=(reform.job_id, self.settings.stop_grace_s, reform.from_generation),
            name="stop",
            daemon=True,
        ).start()
        start = pb.StartWorkers(job_id=reform.job_id, spec=reform.spec, assignment=assignment)
        self._start_workers(start, only=here - kept, extra_env=trainer_env(state_from_peer=True))
        log.info(
            "reformed job",
            extra={
                "job_id": reform.job_id,
                "generation": assignment.generation,
                "kept": sorted(kept),
                "started": sorted(here - kept),
            },
        )

    def _forget_job(self, job_id: str, max_generation: int = 0) -> None:
        with self._monitors_lock:
            for key in [k for k in self._monitors if k[0] == job_id and (not max_generation or k[1] <= max_generation)]:
                del self._monitors[key]
                self._finishing.discard(key)
                self._awaiting_decision.discard(key)
                self._flush_next.discard(key)
            if not any(k[0] == job_id for k in self._monitors):
                self._last_iteration.pop(job_id, None)

    def _inject(self, inject: pb.InjectFault) -> None:
        fault = inject.fault
        if not self.settings.fault_injection:
            log.warning("refusing fault injection: disabled on this agent", extra={"job_id": inject.job_id})
            return
        if fault.kind == common_pb2.FAULT_KIND_AGENT_LOSS:
            request = pb.ReportFaultInjectedRequest(node_id=self.settings.node_id, job_id=inject.job_id, fault=fault)
            request.injected.FromNanoseconds(time.time_ns())
            self._send("fault report", lambda: self._stub.ReportFaultInjected(request, timeout=RPC_TIMEOUT_S), 5.0)
            log.warning("injected fault: agent loss, dying now")
            # Like a node dying: the agent goes at once, its trainers lose their agent.
            os.kill(os.getpid(), signal.SIGKILL)
            return
        key = WorkerKey(inject.job_id, inject.generation, fault.rank)
        if not self.link.send(key, trainer_service_pb2.ConnectResponse(inject=fault)):
            log.warning("cannot inject: trainer not connected", extra={"job_id": inject.job_id, "rank": fault.rank})

    # ---- what trainers and detectors report -------------------------------------------

    def _trainer_iteration(self, key: WorkerKey, report: pb.IterationReport) -> None:
        with self._monitors_lock:
            monitor = self._monitors.get((key.job_id, key.generation))
            if monitor is None:
                raise Rejected(
                    "FAILED_PRECONDITION", f"job {key.job_id} generation {key.generation} is not running here"
                )
            try:
                monitor.observe(report.rank, report.iteration, report.seconds, report.compute_seconds, time.time())
            except ReportRejected as exc:
                raise Rejected("INVALID_ARGUMENT", str(exc)) from None
            if report.iteration >= self._last_iteration.get(key.job_id, 0) > 0:
                self._finishing.add((key.job_id, key.generation))
            self._awaiting_decision.discard((key.job_id, key.generation))
            flush = (key.job_id, key.generation) in self._flush_next
            self._flush_next.discard((key.job_id, key.generation))
        self._reports.put(report)
        if flush:
            self._flush_now.set()

    def _trainer_error(self, key: WorkerKey, error: trainer_service_pb2.TrainerError) -> None:
        self._errors[key] = error.message
        # A reform may have moved the trainer on (rekeyed it) after the error happened in its
        # old group: reported under the old generation, the coordinator sees it is stale.
        generation = error.generation or key.generation
        with self._monitors_lock:
            self._awaiting_decision.add((key.job_id, generation))
        report = common_pb2.FailureReport(
            job_id=key.job_id,
            generation=generation,
            rank=key.rank,
            node_id=self.settings.node_id,
            kind=error.kind,
            source=common_pb2.DETECTION_SOURCE_EXCEPTION,
            message=error.message,
            stack_trace=error.traceback,
        )
        if error.HasField("first_seen"):
            report.first_seen.CopyFrom(error.first_seen)
        else:
            _stamp(report, time.time())
        self._report(report)

    def _fault_fired(self, key: WorkerKey, fired: trainer_service_pb2.FaultFired) -> None:
        request = pb.ReportFaultInjectedRequest(
            node_id=self.settings.node_id, job_id=key.job_id, fault=fired.fault, injected=fired.injected
        )
        self._send_soon("fault report", lambda: self._stub.ReportFaultInjected(request, timeout=RPC_TIMEOUT_S))

    def _report_finding(self, finding: Finding) -> None:
        report = common_pb2.FailureReport(
            job_id=finding.job_id,
            generation=finding.generation,
            node_id=self.settings.node_id,
            kind=finding.kind,
            source=common_pb2.DETECTION_SOURCE_STATISTICAL,
            message=finding.message,
            statistics=finding.evidence,
        )
        if finding.rank is not None:
            report.rank = finding.rank
        _stamp(report, finding.first_seen)
        if finding.kind == common_pb2.FAILURE_KIND_TASK_HANG:
            report.stack_trace = self._capture_stacks(finding.job_id)
        self._report(report)

    def _report_health(self, finding: HealthFinding) -> None:
        report = common_pb2.FailureReport(
            node_id=self.settings.node_id,
            kind=finding.kind,
            source=common_pb2.DETECTION_SOURCE_NODE_HEALTH,
            message=f"{finding.check}: {finding.message}",
            statistics=finding.evidence,
        )
        self._report(_stamp(report, time.time()))

    def _report(self, report: common_pb2.FailureReport) -> None:
        # Only the kind: the coordinator alone turns a kind into severity and remedy.
        request = pb.ReportFailureRequest(node_id=self.settings.node_id, report=report)
        self._send_soon("failure report", lambda: self._stub.ReportFailure(request, timeout=RPC_TIMEOUT_S))

    def _capture_stacks(self, job_id: str) -> str:
        """Stack traces of a hung job's local trainers, taken before anyone acts on the hang
        (trainers dump them on SIGUSR1 through faulthandler). A stopped process cannot
        answer, so its state is reported instead."""
        pids = self.supervisor.pids(job_id)
        sizes = {}
        for key, pid in pids.items():
            try:
                sizes[key] = self.supervisor.stderr_path(key).stat().st_size
                # Only a process that handles SIGUSR1 (faulthandler) may get it: for any other
                # (not yet started, or shutting down) its default action is to terminate.
                if psutil.Process(pid).status() != psutil.STATUS_STOPPED and _catches(pid, signal.SIGUSR1):
                    os.kill(pid, signal.SIGUSR1)
            except (OSError, psutil.Error):
                pass
        time.sleep(STACK_WAIT_S)
        parts = []
        for key, pid in pids.items():
            try:
                status = psutil.Process(pid).status()
            except psutil.Error:
                status = "gone"
            text = ""
            path = self.supervisor.stderr_path(key)
            try:
                with open(path, "rb") as err:
                    err.seek(sizes.get(key, 0))
                    text = err.read(STACK_BYTES).decode(errors="replace")
            except OSError:
                pass
            parts.append(f"--- rank {key.rank} (pid {pid}, {status}) ---\n{text.strip() or '(no stack dumped)'}")
        return "\n".join(parts)

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
        request.exited.FromNanoseconds(int(exit.exited_at * 1e9))
        with self._monitors_lock:
            monitor = self._monitors.get((exit.key.job_id, exit.key.generation))
            request.last_iteration = monitor.last_iteration_of(exit.key.rank) if monitor is not None else 0
        self.link.forget(exit.key)
        if not self.supervisor.running(exit.key.job_id):
            self._forget_job(exit.key.job_id)
            if exit.exit_code == 0 and exit.signal == 0 and self.settings.snapshot_dir is not None:
                # Finished: its snapshots are memory no restart will need.
                shutil.rmtree(self.settings.snapshot_dir / exit.key.job_id, ignore_errors=True)
        if exit.exit_code == 0 and exit.signal == 0:
            self._reports.put(request)  # after the rank's last iteration reports
        else:
            self._send_exit(request)  # a failure: at once, detection latency counts

    def _send_exit(self, request: pb.ReportWorkerExitRequest) -> None:
        self._send("trainer exit", lambda: self._stub.ReportWorkerExit(request, timeout=RPC_TIMEOUT_S), deadline_s=60.0)


def serve(server: rpc.Server, agent: Agent) -> None:
    """Puts the agent's trainer-facing service on `server`; stopping the server stops the
    agent (and its trainers) first."""
    server.add(
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server, agent.link, "unicron.v1.TrainerAgentService"
    )
    server.on_stop(agent.stop)
