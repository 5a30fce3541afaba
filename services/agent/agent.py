"""The node agent: wires its parts and runs the node's detectors. Its parts:

- `coordinator_client.CoordinatorClient`: registration, heartbeats, the command stream and
  the reports to the coordinator, each on its own thread;
- `executor.CommandExecutor`: what the coordinator's commands do here;
- `supervisor.Supervisor`: the trainer processes (process supervision);
- `trainer_link.TrainerLink`: the trainers' streams (exception propagation);
- `watch.JobWatch` and `verdicts.HangJudge`: statistical monitoring of iteration times,
  and the hang verdicts, fed by `procstat`;
- `health.py`: node health checks; `health_watch.HealthWatch`: which findings to report,
  and when the node has recovered from them."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from services.agent import peers, procstat
from services.agent.coordinator_client import CoordinatorClient
from services.agent.executor import CommandExecutor, Parts
from services.agent.health import HealthCheck, HealthFinding, run_checks
from services.agent.health_watch import HealthWatch
from services.agent.log_service import LogService
from services.agent.settings import AgentSettings
from services.agent.spares import SparePool
from services.agent.supervisor import Supervisor, WorkerExit, WorkerKey, without_node_secrets
from services.agent.trainer_link import LinkHandlers, Rejected, TrainerLink
from services.agent.verdicts import HangJudge
from services.agent.watch import JobWatch
from unicron import rpc
from unicron.monitor import Finding, ReportRejected
from unicron.security import ClientSecurity, WorkerTokens
from unicron.v1 import agent_service_pb2_grpc, common_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from unicron.v1 import node_service_pb2 as pb

log = logging.getLogger(__name__)

MONITOR_PERIOD_S = 0.1
MIN_MONITOR_WAIT_S = 0.005
# A check of a job's peers (peers.py) is reused for this long.
PEER_CHECK_REUSE_S = 1.0
STACK_WAIT_S = 0.1
STACK_BYTES = 16 * 1024
# How long a clean exit's report waits for the rank's last messages to be handled.
DRAIN_S = 2.0


def trainer_base_env(home: Path | None = None) -> dict[str, str]:
    """The environment every trainer of this node starts from (its rank's settings added).
    ``home``: the HOME of trainers that run as a user of their own, who may not write the
    agent's (caches: torch's, Triton's, the user's program's)."""
    env = dict(os.environ)
    if home is not None:
        env["HOME"] = str(home)
    # One rank per slot: a CPU rank with a thread per core would oversubscribe the node
    # many times over and starve the agent's own heartbeat.
    env.setdefault("OMP_NUM_THREADS", "1")
    return without_node_secrets(env)


def _stamp(message: common_pb2.FailureReport, at: float) -> common_pb2.FailureReport:
    message.first_seen.FromNanoseconds(int(at * 1e9))
    return message


# A job's directory as the agent names it: the job's id (services/coordinator/store.py
# new_job_id). Nothing else in a snapshot directory an operator named is Unicron's to delete.
_JOB_DIR = re.compile(r"^job-\d{8}-[0-9a-f]{8}$")


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
        # Each trainer gets a token for its job, generation and rank, which its link to this
        # agent must show (TrainerLink): a trainer speaks only for itself.
        self.worker_tokens = worker_tokens if worker_tokens is not None else WorkerTokens()
        self._stop = threading.Event()
        self._errors: dict[WorkerKey, str] = {}  # a trainer's error, for its exit report
        self._health_checks = health_checks or []
        home = None
        if settings.trainer_user is not None:
            home = settings.work_dir / "trainer-home"
            settings.trainer_user.give(home)
        base_env = functools.partial(trainer_base_env, home)
        spares = SparePool(
            settings.warm_spares,
            settings.spare_command,
            settings.trainer_command,
            base_env(),
            settings.work_dir,
            settings.trainer_user,
        )
        self.supervisor = Supervisor(
            settings.work_dir, self._worker_exited, spares, settings.gpus, settings.trainer_user
        )
        self._spares = spares
        self.link = TrainerLink(
            settings.node_id,
            LinkHandlers(
                is_known=lambda key: key in self.supervisor.running(key.job_id),
                on_iteration=self._trainer_iteration,
                on_error=self._trainer_error,
                on_fault_fired=self._fault_fired,
                on_left_iteration=self._left_iteration,
            ),
        )
        self.watch = JobWatch(settings.monitor)
        self._peer_checks: dict[tuple[str, int], tuple[float, tuple[list[str], list[str]]]] = {}
        self.hangs = HangJudge(
            procstat.ProcessProbe(),
            lambda job_id: self.supervisor.pids(job_id).values(),
            reaches_peers=lambda key: not self._check_peers(key)[0],
        )
        self.client = CoordinatorClient(
            settings.node_id,
            coordinator_address,
            security,
            self._registration,
            lambda c: self.executor.execute(c),
            lambda strays: self.executor.kill_strays(strays),
        )
        self.executor = CommandExecutor(
            Parts(
                settings,
                self.supervisor,
                self.link,
                self.watch,
                self.client,
                self.worker_tokens,
                base_env,
                lambda: self.address,
            )
        )
        self._threads: list[threading.Thread] = []

    # ---- lifecycle --------------------------------------------------------------------

    def start(self, address: str) -> None:
        self.address = address
        self._free_unowned_snapshots()
        loops: list[tuple[Callable[[], None], str]] = [(self._register_when_warm, "register")]
        if self.settings.monitoring:
            loops.append((self._monitor_loop, "monitor"))
        if self._health_checks:
            loops.append((self._health_loop, "health"))
        self._start_threads(loops)

    def _free_unowned_snapshots(self) -> None:
        """Snapshots a previous run of this agent left (killed with SIGKILL, it freed nothing)
        are tmpfs memory the node never gets back: at start every job's is freed but those of
        jobs whose trainers from that run still live. The coordinator places jobs again from
        scratch: a restarted rank here finds its peers' state, or the checkpoint."""
        freed = self._free_snapshots(keep=self.supervisor.previous_jobs())
        if freed:
            log.info("freed snapshots a previous run left", extra={"jobs": ",".join(sorted(freed))})

    def _free_snapshots(self, keep: set[str]) -> list[str]:
        """Deletes the job directories under the snapshot directory but ``keep``'s; returns
        the jobs freed."""
        root = self.settings.snapshot_dir
        if root is None or not root.is_dir():
            return []
        freed = [d.name for d in root.iterdir() if d.is_dir() and _JOB_DIR.match(d.name) and d.name not in keep]
        for name in freed:
            shutil.rmtree(root / name, ignore_errors=True)
        return freed

    def _start_threads(self, loops: list[tuple[Callable[[], None], str]]) -> None:
        for target, name in loops:
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)

    def _register_when_warm(self) -> None:
        """Fills the spare pool, waits (bounded) until it is warm, then starts talking to the
        coordinator: the node offers its slots once a rank placed there starts warm."""
        self._spares.fill()
        if self.settings.warm_spares > 0 and self.settings.spare_warmup_s > 0:
            started = time.monotonic()
            ready = self._spares.wait_warm(self.settings.spare_warmup_s)
            log.info(
                "spares warm, registering" if ready else "no spare warm in time, registering anyway",
                extra={"ready": ready, "waited_s": round(time.monotonic() - started, 1)},
            )
        if not self._stop.is_set():
            self._start_threads(self.client.loops())

    def stop(self) -> None:
        self._stop.set()
        self.client.stop()
        self.supervisor.close()
        self.supervisor.stop(grace_s=self.settings.stop_grace_s)
        # The node goes out of service: its trainers' snapshots are memory to give back.
        self._free_snapshots(keep=set())
        for thread in list(self._threads):
            thread.join(timeout=2)

    def _registration(self) -> pb.RegisterNodeRequest:
        return pb.RegisterNodeRequest(
            node_id=self.settings.node_id,
            address=self.address,
            slots=self.settings.slots,
            failure_domain=self.settings.failure_domain,
            fault_injection=self.settings.fault_injection,
            image=self.settings.image,
            running=[
                pb.JobGeneration(job_id=job_id, generation=generation)
                for job_id, generation in sorted({(k.job_id, k.generation) for k in self.supervisor.running()})
            ],
        )

    # ---- detectors --------------------------------------------------------------------

    def _monitor_loop(self) -> None:
        wait_s = MONITOR_PERIOD_S
        while not self._stop.wait(wait_s):
            now = time.time()
            findings, progress, due = self.watch.check(now)
            # Wake when the next hang verdict falls due rather than on the next tick: the
            # tick would add up to a whole period to every hang's detection.
            wait_s = min([MONITOR_PERIOD_S, *(max(MIN_MONITOR_WAIT_S, at - now) for at in due)])
            self.hangs.sample(list(progress), now)
            for finding in findings:
                if finding.kind == common_pb2.FAILURE_KIND_TASK_HANG:
                    self.hangs.suspect(finding)
                else:
                    self._report_finding(finding)
            for hang in self.hangs.verdicts(progress, self.watch.quiet_expected, now):
                self._report_finding(hang)

    def _health_loop(self) -> None:
        watch = HealthWatch(self.settings.health_return_s)
        while not self._stop.wait(self.settings.health_period_s):
            verdict = watch.observe(run_checks(self._health_checks), time.monotonic())
            for finding in verdict.report:
                self._report_health(finding)
            if verdict.register_again:
                log.warning(
                    "health checks pass again: registering, which returns the node",
                    extra={"node_id": self.settings.node_id},
                )
                self.client.register_again()

    # ---- what trainers and detectors report -------------------------------------------
    # These run on the trainer link's reader threads: they hand reports to the client's
    # queues and never wait for the coordinator.

    def _trainer_iteration(self, key: WorkerKey, report: pb.IterationReport) -> None:
        try:
            flush = self.watch.observe((key.job_id, key.generation), report, time.time())
        except ReportRejected as exc:
            raise Rejected("INVALID_ARGUMENT", str(exc)) from None
        if flush is None:
            raise Rejected("FAILED_PRECONDITION", f"job {key.job_id} generation {key.generation} is not running here")
        self.client.queue_progress(report, flush=flush)

    def _left_iteration(self, key: WorkerKey, report: pb.IterationReport) -> None:
        """Rank 0's last iteration in the generation a reform moved it from: its generation is
        no longer watched here, and the coordinator takes it as progress only, at once."""
        if key.rank == 0 and report.iteration > 0:
            self.client.queue_progress(report, flush=True)

    def _trainer_error(self, key: WorkerKey, error: trainer_service_pb2.TrainerError) -> None:
        self._errors[key] = error.message
        # A reform may have moved the trainer on (rekeyed it) after the error happened in its
        # old group: reported under the old generation, the coordinator sees it is stale.
        generation = error.generation or key.generation
        self.watch.awaiting_decision((key.job_id, generation))
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
        self.client.report_fault(request)

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
            # Which of the job's nodes this one still reaches tells a host cut off from its
            # peers from a hang of the program.
            unreachable, reachable = self._check_peers((finding.job_id, finding.generation))
            report.unreachable_peers.extend(unreachable)
            report.reachable_peers.extend(reachable)
            report.stack_trace = self._capture_stacks(finding.job_id)
        self._report(report)

    def _check_peers(self, key: tuple[str, int]) -> tuple[list[str], list[str]]:
        """The job generation's unreachable and reachable peers (peers.check), reusing a
        check of the last PEER_CHECK_REUSE_S: the hang verdict that just checked them and
        the report it leads to ask the same question."""
        now = time.monotonic()
        recent = self._peer_checks.get(key)
        if recent is not None and now - recent[0] < PEER_CHECK_REUSE_S:
            return recent[1]
        result = peers.check(self.watch.peers_of(key))
        self._peer_checks = {k: v for k, v in self._peer_checks.items() if now - v[0] < PEER_CHECK_REUSE_S}
        self._peer_checks[key] = (now, result)
        return result

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
        self.client.report_failure(report)

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
                if procstat.status(pid) != psutil.STATUS_STOPPED and procstat.catches(pid, signal.SIGUSR1):
                    os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        time.sleep(STACK_WAIT_S)
        parts = []
        for key, pid in pids.items():
            status = procstat.status(pid)
            text = ""
            try:
                with open(self.supervisor.stderr_path(key), "rb") as err:
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
        if exit.exit_code == 0 and exit.signal == 0:
            # A clean exit is judged by the last iteration: the rank's final reports must be
            # counted first, or a finished rank reads as one that returned early.
            self.link.wait_drained(exit.key, DRAIN_S)
        request.last_iteration = self.watch.last_iteration_of((exit.key.job_id, exit.key.generation), exit.key.rank)
        self.link.forget(exit.key)
        if not self.supervisor.running(exit.key.job_id):
            self.watch.forget(exit.key.job_id)
            if exit.exit_code == 0 and exit.signal == 0 and self.settings.snapshot_dir is not None:
                # Finished: its snapshots are memory no restart will need.
                shutil.rmtree(self.settings.snapshot_dir / exit.key.job_id, ignore_errors=True)
        if exit.exit_code == 0 and exit.signal == 0:
            self.client.queue_exit(request)  # after the rank's last iteration reports
        else:
            self.client.send_exit(request)  # a failure: at once, detection latency counts


def serve(server: rpc.Server, agent: Agent) -> None:
    """Puts the agent's services on `server`: the trainers' link, and their output for the
    coordinator (log_service.py). Stopping the server stops the agent (and its trainers)
    first."""
    server.add(
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server, agent.link, "unicron.v1.TrainerAgentService"
    )
    logs = LogService(agent.supervisor, agent.settings.node_id, agent.settings.work_dir)
    server.add(agent_service_pb2_grpc.add_AgentLogServiceServicer_to_server, logs, "unicron.v1.AgentLogService")
    server.on_stop(agent.stop)
