"""`python -m services.trainer`: one rank of a job, started by its node's agent.

Speaks the agent protocol: a hello, one report per iteration, an error report before an
abnormal exit, a finished message before a clean one. Exit codes: 0 done, 1 failed,
143 stopped by request (as after SIGTERM).

With a checkpoint directory it resumes from the newest good persistent checkpoint and saves
one every `checkpoint_interval` iterations (services/trainer/checkpoint.py). After a
reattemptable (SEV3) error it reports the error and waits for the agent's decision: on
`reattempt` it redoes the same iteration in place, on `reform` it moves to a new process group
(below) and redoes the iteration there, on `stop` it exits 143, and when the agent goes away or
does not answer within `reattempt_wait_s` it exits 1, as after any other error.

Reform (transitions without restarting the process, services/trainer/reform.py): the agent's
`AgentReform` names a new generation, this process's rank and world size in the new group and
its rendezvous. It is acted on

* at the next iteration boundary when it arrives while the rank trains (a resize: the step in
  flight completes first; a rank whose step fails because its peers already left finds the
  reform pending and takes it without reporting the failure as a new incident);
* as the decision after a reported SEV3 error (the broken iteration's partial gradients are
  dropped and the iteration is redone in the new group).

A reform whose generation is not newer than the current one is stale and ignored. The rank
keeps its training state in memory, tears down Megatron's parallel state and the process group,
joins the new group (same backend and collective timeout) and rebuilds the model for the new
data-parallel degree; ranks without state (`state_from_peer`: a process started for a grow)
receive it from a live peer, checksum-verified, with the persistent checkpoint and then a fresh
model as fallbacks. From then on reports carry the new generation and rank. A failure while
forming the new group (a peer that never arrives within the collective timeout) is an error
like any other: reported, exit 1. A rank blocked in a collective of the old group notices the
reform only when that collective fails: at once when a peer leaves the group or dies, at the
collective timeout (which bounds Megatron's groups too) when a peer hangs.

The first iteration report after a (re)start or a reform names where the state came from
(`state_source`: fresh, checkpoint, live, peer) and the iteration it was at."""

from __future__ import annotations

import faulthandler
import gc
import logging
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum
from typing import TYPE_CHECKING, Any

from google.protobuf import json_format

from services.trainer.agent_link import AgentLink, LinkCallbacks
from services.trainer.faults import FaultInjector
from unicron.config import load_config, require
from unicron.errors import UnicronError
from unicron.failures import classify, classify_exception, kind_name
from unicron.faults import parse_fault
from unicron.jobspec import DEFAULT_CHECKPOINT_INTERVAL
from unicron.logs import exit_flushed, setup_logging
from unicron.security import ClientSecurity, load_tls
from unicron.v1 import common_pb2, node_service_pb2, trainer_service_pb2

if TYPE_CHECKING:  # torch and Megatron take seconds to import; config errors come first
    from services.trainer import reform as reforming
    from services.trainer.gpt import GPTTrainer, ModelConfig, PartialStep, StepResult, TrainConfig

EXIT_STOPPED = 143
# IterationReport.state_source of the first report after a reattempt in place or a reform that
# kept this rank's own state; reform.SOURCE_PEER ("peer") when it came from a peer.
SOURCE_LIVE = "live"


@dataclass(frozen=True)
class TrainerConfig:
    job_id: str = ""
    generation: int = 0
    rank: int = 0
    world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    agent: str = ""
    spec: str = ""
    collective_timeout_s: float = 120.0
    fault_injection: bool = False
    faults: tuple[str, ...] = ()
    log_level: str = "info"
    # Per-job directory shared by the job's ranks; empty: no persistent checkpoints.
    checkpoint_dir: str = ""
    # Per-job directory on this node, in memory (tmpfs), where ranks keep snapshots of their
    # state every snapshot_interval iterations for a restart; empty: no snapshots.
    snapshot_dir: str = ""
    snapshot_interval: int = 2
    # After a reattemptable error: how long to wait for the agent's decision, and how many
    # times one iteration may be reattempted before the rank gives up.
    reattempt_wait_s: float = 60.0
    max_reattempts: int = 3
    # A process started to join a new group (a grow) without state: it receives the training
    # state from a live peer of its (tensor, pipeline) shard instead of the checkpoint.
    state_from_peer: bool = False
    # Testing, honoured only with fault_injection: as the source of a peer transfer, flip one
    # byte of the state after its checksum was taken (exercises the checkpoint fallback).
    corrupt_peer_state: bool = False
    # How to reach the agent, which always says (UNICRON_TRAINER_PLAINTEXT and _TLS_*): over TLS
    # with the agent's certificate, or plaintext. Unsaid and with no CA (a trainer started by
    # hand or by a test harness): plaintext, with a warning.
    tls_ca: str = ""
    tls_cert: str = ""
    tls_key: str = ""
    plaintext: bool | None = None
    # The per-worker token the agent issued for this job, generation and rank.
    token: str = ""

    def __post_init__(self) -> None:
        require(bool(self.job_id), "job_id", "is required")
        require(0 <= self.rank < self.world_size, "rank", f"must lie in [0, {self.world_size})")
        require(bool(self.agent), "agent", "is required (host:port of the node's agent)")
        require(bool(self.spec), "spec", "is required (the job spec as JSON)")
        require(0 < self.master_port < 65536, "master_port", "must be a TCP port")
        require(self.reattempt_wait_s >= 0, "reattempt_wait_s", "must not be negative")
        require(self.max_reattempts >= 0, "max_reattempts", "must not be negative")
        require(self.snapshot_interval >= 0, "snapshot_interval", "must not be negative (0: no snapshots)")
        require(self.plaintext is not False or bool(self.tls_ca), "tls_ca", "is required unless plaintext")

    def agent_security(self) -> ClientSecurity:
        if self.plaintext or not self.tls_ca:
            return ClientSecurity.plaintext(self.token)
        return ClientSecurity(load_tls(self.tls_ca, self.tls_cert, self.tls_key), self.token)


class Decision(Enum):
    """What a rank does after an error in its training step."""

    REATTEMPT = "reattempt"  # redo the same iteration in place
    REFORM = "reform"  # move to the new process group of Run.pending_reform, redo the iteration
    STOP = "stop"  # the agent asked to stop: exit 143
    GIVE_UP = "give up"  # exit 1, as after any error


@dataclass
class Run:
    """What the training thread shares with the agent link's thread."""

    config: TrainerConfig
    spec: common_pb2.JobSpec
    link: AgentLink
    stop: threading.Event
    injector: FaultInjector
    iteration: int = 0
    # Set (before `stop`) when the agent link is lost.
    lost: threading.Event = field(default_factory=threading.Event)
    # Incident ids of the agent's reattempt answers, filled by the link's thread.
    reattempts: queue.Queue[str] = field(default_factory=queue.Queue)
    # The iteration being reattempted and how often it has been.
    reattempt_step: int = 0
    reattempt_count: int = 0
    # (state_source, restored_iteration) for the next iteration report, then None.
    source: tuple[str, int] | None = None
    # The exception already reported to the agent, so it is not reported twice.
    reported: BaseException | None = None
    # The agent's reform answers, filled by the link's thread; the newest not yet acted on.
    reforms: queue.Queue[trainer_service_pb2.AgentReform] = field(default_factory=queue.Queue)
    pending_reform: trainer_service_pb2.AgentReform | None = None
    # How long the last training step took (the reform watchdog's measure of "long").
    step_seconds: float = 0.0
    # Where this process stands now: the config's values until a reform changes them.
    generation: int = -1
    rank: int = -1
    world_size: int = -1

    def __post_init__(self) -> None:
        if self.generation < 0:
            self.generation = self.config.generation
        if self.rank < 0:
            self.rank = self.config.rank
        if self.world_size < 0:
            self.world_size = self.config.world_size


def main(argv: list[str]) -> int:
    try:
        config = load_config(TrainerConfig, env_prefix="UNICRON_TRAINER", argv=argv, description="Unicron trainer rank")
        spec = json_format.Parse(config.spec, common_pb2.JobSpec())
        faults = [parse_fault(text, config.rank) for text in config.faults]
        agent_security = config.agent_security()
    except (UnicronError, json_format.ParseError) as exc:
        print(f"unicron-trainer: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("trainer", config.log_level)
    if config.plaintext is None and agent_security.tls is None:
        log.warning("no TLS settings: talking to the agent at %s in PLAINTEXT", config.agent)
    # The agent sends SIGUSR1 to take stack traces of a hung trainer before acting on it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    stop = threading.Event()

    def on_sigterm(_signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_sigterm)
    hello = trainer_service_pb2.TrainerHello(
        job_id=config.job_id, generation=config.generation, rank=config.rank, pid=os.getpid()
    )

    def announce(fault: common_pb2.Fault, at: float) -> None:
        fired = trainer_service_pb2.FaultFired(fault=fault)
        fired.fault.rank = config.rank
        fired.injected.FromNanoseconds(int(at * 1e9))
        link.send(trainer_service_pb2.ConnectRequest(fault_fired=fired))

    injector = FaultInjector(config.fault_injection, announce, stop)
    for fault in faults:
        injector.add(fault)

    def inject(fault: common_pb2.Fault) -> None:
        injector.add(fault)

    lost = threading.Event()
    reattempts: queue.Queue[str] = queue.Queue()
    reforms: queue.Queue[trainer_service_pb2.AgentReform] = queue.Queue()

    def on_lost(_reason: str) -> None:
        lost.set()
        stop.set()

    link = AgentLink(
        config.agent,
        hello,
        LinkCallbacks(
            on_stop=lambda reason: stop.set(),
            on_inject=inject,
            on_lost=on_lost,
            on_reattempt=reattempts.put,
            on_reform=reforms.put,
        ),
        security=agent_security,
    )
    run = Run(config, spec, link, stop, injector, lost=lost, reattempts=reattempts, reforms=reforms)
    link.open()
    threading.Thread(target=watch_reforms, args=(run,), name="reform-watchdog", daemon=True).start()
    try:
        train(run, log)
    except BaseException:
        log.exception("training failed")
        link.close()
        return 1
    if stop.is_set() and run.iteration < spec.training.iterations:
        log.info("stopped on request", extra={"iteration": run.iteration})
        link.close()
        return EXIT_STOPPED
    link.send(
        trainer_service_pb2.ConnectRequest(finished=trainer_service_pb2.TrainerFinished(iterations=run.iteration))
    )
    link.close()
    return 0


def report_error(run: Run, exc: BaseException) -> None:
    """Tells the agent what went wrong, before any cleanup: tearing down a process group
    whose peers still wait in a collective can block, and the report must not wait."""
    kind = classify_exception(exc)
    error = trainer_service_pb2.TrainerError(
        kind=kind,
        message=f"{type(exc).__name__}: {exc}"[:2000],
        iteration=run.iteration + 1,
        generation=max(0, run.generation),
    )
    error.first_seen.FromNanoseconds(time.time_ns())
    run.link.send(trainer_service_pb2.ConnectRequest(error=error))
    logging.getLogger("trainer").error("reported %s", kind_name(kind))


def poll_reform(run: Run) -> trainer_service_pb2.AgentReform | None:
    """The reform to act on, if any: the newest one received whose generation is newer than
    this process's (older ones are stale; malformed ones are logged and dropped). It stays
    pending in ``run.pending_reform`` until acted on."""
    log = logging.getLogger("trainer")
    while True:
        try:
            reform = run.reforms.get_nowait()
        except queue.Empty:
            break
        problem = ""
        if reform.world_size < 1 or reform.rank >= reform.world_size:
            problem = f"rank {reform.rank} outside world size {reform.world_size}"
        elif not 0 < reform.master_port < 65536:
            problem = f"master port {reform.master_port} is not a TCP port"
        elif reform.generation <= run.generation:
            problem = f"stale: generation {reform.generation}, this process is at {run.generation}"
        if problem:
            log.warning("ignoring a reform (%s)", problem, extra={"incident": reform.incident_id})
        elif run.pending_reform is None or reform.generation > run.pending_reform.generation:
            run.pending_reform = reform
    return run.pending_reform


# A reform left unread this long means the training thread is stuck in a collective of the
# old group (a peer that left it without closing its connections holds it there until the
# collective timeout): at least REFORM_OVERDUE_MIN_S, and REFORM_OVERDUE_STEPS steps.
REFORM_OVERDUE_MIN_S = 20.0
REFORM_OVERDUE_STEPS = 3.0


def reform_overdue(waited_s: float, step_seconds: float) -> bool:
    """Whether a reform unread for ``waited_s`` means the training thread is stuck, given
    that its last step took ``step_seconds``: it reads reforms between steps, and at once
    when a step fails."""
    return waited_s > max(REFORM_OVERDUE_MIN_S, REFORM_OVERDUE_STEPS * step_seconds)


def watch_reforms(run: Run, period_s: float = 1.0, exit_process: Callable[[int], object] = exit_flushed) -> None:
    """Ends the process when a reform stays unread too long (reform_overdue). Stuck, the rank
    would hold the new group up for the rest of the collective timeout; exited, it is
    restarted at once and takes its state from a peer."""
    waiting_since: float | None = None
    while not run.stop.wait(period_s):
        if run.reforms.empty():
            waiting_since = None
            continue
        now = time.monotonic()
        waiting_since = now if waiting_since is None else waiting_since
        if reform_overdue(now - waiting_since, run.step_seconds):
            logging.getLogger("trainer").error(
                "a reform waited %.0fs for this rank, which is stuck in its old process group; exiting so that it"
                " restarts and takes its state from a peer",
                now - waiting_since,
            )
            exit_process(1)
            return


def reform_waiting(run: Run) -> bool:
    """Whether a reform newer than this process's generation waits (see poll_reform)."""
    return poll_reform(run) is not None


def enter_generation(run: Run, reform: trainer_service_pb2.AgentReform) -> None:
    """From now on this rank belongs to ``reform``'s generation: its errors are reported as
    that generation's, and only a newer reform supersedes this one."""
    run.pending_reform = None
    run.generation, run.rank, run.world_size = reform.generation, reform.rank, reform.world_size


def wait_for_decision(run: Run, timeout_s: float, poll_s: float = 0.05) -> Decision:
    """The agent's answer to the error just reported: a reattempt or reform message, a stop
    request, the loss of the link, or nothing within ``timeout_s`` (GIVE_UP)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if run.stop.is_set():
            # A lost link sets `lost` before `stop`: read after `stop`, it is never missed.
            return Decision.GIVE_UP if run.lost.is_set() else Decision.STOP
        reform = poll_reform(run)
        if reform is not None:
            logging.getLogger("trainer").info(
                "reforming", extra={"incident": reform.incident_id, "generation": reform.generation}
            )
            return Decision.REFORM
        try:
            incident = run.reattempts.get(timeout=max(0.0, min(poll_s, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                return Decision.GIVE_UP
            continue
        logging.getLogger("trainer").info("reattempting in place", extra={"incident": incident})
        return Decision.REATTEMPT


def release_frames(exc: BaseException) -> None:
    """Drops the tracebacks of ``exc`` and the exceptions chained to it: the frames of a step
    that failed inside Megatron's schedule hold the model, and through it the process groups
    a rank must free to leave its group (see reform.teardown)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.__traceback__ = None
        current = current.__cause__ or current.__context__


def after_failure(
    run: Run, exc: BaseException, redoable: bool = True, leave_group: Callable[[], None] | None = None
) -> Decision:
    """Reports ``exc`` (first, before anything can block) and decides what the rank does next.
    Only a reattemptable (SEV3) error of a step that can be redone waits for the agent, and
    at most ``max_reattempts`` times for one iteration. ``leave_group`` (when given) runs
    before the wait: the rank leaves its process group at once (see reform.park), so that
    peers waiting on it in a collective fail and report now, not at the collective timeout.

    Exception: a SEV3 error while a reform is already pending is not reported; the agent has
    decided already, and the error is most likely the old group breaking as peers leave it for
    the new one. The rank takes the reform (with its state only if the step can be redone)."""
    log = logging.getLogger("trainer")
    while True:  # answers to an earlier incident must not decide this one
        try:
            run.reattempts.get_nowait()
        except queue.Empty:
            break
    failure = classify(classify_exception(exc))
    if failure.severity == common_pb2.SEVERITY_SEV3 and poll_reform(run) is not None:
        log.warning(
            "step %d failed while a reform is pending (%s: %s); joining the new group",
            run.iteration + 1,
            type(exc).__name__,
            str(exc)[:200],
        )
        return Decision.REFORM
    report_error(run, exc)
    run.reported = exc
    if failure.severity != common_pb2.SEVERITY_SEV3:
        return Decision.GIVE_UP
    step = run.iteration + 1
    if not redoable:
        log.error("the failed step %d already updated the parameters; it cannot be reattempted", step)
        return Decision.GIVE_UP
    if run.reattempt_step != step:
        run.reattempt_step, run.reattempt_count = step, 0
    if run.reattempt_count >= run.config.max_reattempts:
        log.error("iteration %d failed again after %d reattempts; giving up", step, run.reattempt_count)
        return Decision.GIVE_UP
    if leave_group is not None:
        release_frames(exc)
        leave_group()
    decision = wait_for_decision(run, run.config.reattempt_wait_s)
    if decision in (Decision.REATTEMPT, Decision.REFORM):
        run.reattempt_count += 1
    elif decision is Decision.GIVE_UP:
        reason = "the agent connection was lost" if run.lost.is_set() else "no decision from the agent"
        log.error("%s within %.0fs; exiting", reason, run.config.reattempt_wait_s)
    return decision


def trainer_configs(spec: common_pb2.JobSpec) -> tuple[ModelConfig, TrainConfig]:
    """The training core's configuration from a job spec."""
    from services.trainer.gpt import ModelConfig, TrainConfig

    m, t = spec.model, spec.training
    return (
        ModelConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            seq_length=m.seq_length,
            vocab_size=m.vocab_size,
        ),
        TrainConfig(
            global_batch_size=t.global_batch_size, micro_batch_size=t.micro_batch_size, lr=t.learning_rate, seed=t.seed
        ),
    )


def train(run: Run, log: logging.Logger) -> None:
    # Imported here: torch and Megatron take seconds to import, and config errors should
    # be reported before that.
    import torch
    import torch.distributed as dist

    from services.trainer import checkpoint
    from services.trainer import reform as reforming
    from services.trainer import snapshot as snapshots
    from services.trainer.gpt import GPTTrainer

    # What the imports created lives as long as the process: out of the garbage collector's
    # sight, a reform's full collection (which frees the old process groups, see
    # reform.teardown) takes a fraction of the time.
    gc.freeze()
    config, spec = run.config, run.spec
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(config.rank % torch.cuda.device_count())
    training = spec.training
    try:
        state_from_peer = join_first_group(run, "nccl" if use_cuda else "gloo")
        # GPTTrainer enters the Megatron CPU shim (megatron_cpu.cpu_mode) around its own calls.
        trainer = GPTTrainer(
            *trainer_configs(spec),
            tensor_parallel=spec.parallelism.tensor,
            pipeline_parallel=spec.parallelism.pipeline,
            device="cuda" if use_cuda else "cpu",
            timeout=timedelta(seconds=config.collective_timeout_s),
        )
        if run.injector.enabled:
            trainer.grad_sync_hook = run.injector.in_grad_sync
        log.info("model ready", extra={"rank": run.rank, "world_size": run.world_size})
        if state_from_peer:
            restored = reforming.receive_state(trainer, config.checkpoint_dir, config.snapshot_dir)
        else:
            restored = snapshots.restore_nearest(trainer, config.checkpoint_dir, config.snapshot_dir)
        run.iteration = trainer.iteration
        run.source = (restored.source, restored.iteration)
        interval = training.checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL
        every = config.snapshot_interval if config.snapshot_dir else 0
        writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every)
        # A rank leaves its group as soon as a step fails; the coordinator answers with a
        # reform into a new group, never with a reattempt in the old one.
        parked: reforming.Parked | None = None
        # The interrupted step's computed gradients, to finish it with after a reform.
        resume: PartialStep | None = None

        def leave_group() -> None:
            nonlocal parked
            parked = reforming.park(trainer)

        # The checkpoint of the iteration just reported, written at the start of the next pass:
        # the save is collective, and a peer dying during it is then handled as a failed step
        # (this rank's state is whole) rather than failing the rank.
        save_due = False
        while run.iteration < training.iterations and not run.stop.is_set():
            reform = poll_reform(run)
            if reform is not None:  # at an iteration boundary: nothing in flight
                trainer = apply_reform(run, trainer, reform, keep_state=True)
                writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every)
                # A rank new to the group owes no save: a collective not every rank joins hangs.
                save_due = False
                continue
            decision: Decision | None = None
            finishing, resume = resume, None
            try:
                if save_due:
                    checkpoint.save(trainer, config.checkpoint_dir)
                    save_due = False
                run.injector.before_step(run.iteration + 1)
                result = next_step(trainer, finishing, log)
            except Exception as exc:
                redoable = trainer.step_is_redoable
                decision = after_failure(run, exc, redoable, leave_group if redoable else None)
                if decision is Decision.GIVE_UP:
                    raise
                # Not raised again. Dropped here, outside this block its traceback is freed: its
                # frames hold the model and through it the process groups, and a reform must be
                # able to close those (see reform.teardown).
                run.reported = None
            if decision is Decision.STOP:
                break
            if decision is Decision.REATTEMPT:
                if parked is not None:
                    raise RuntimeError("asked to redo the step in a process group this rank has left")
                # Same iteration again: its data follows from the iteration number.
                trainer.discard_step()
                run.source = (SOURCE_LIVE, run.iteration)
                continue
            if decision is Decision.REFORM:
                assert run.pending_reform is not None
                # A step that failed before the update leaves the state as it was: the captured
                # state is that of the iteration's start, and the iteration is redone, from its
                # computed gradients where the new group keeps this rank's place in it.
                resume = parked.partial if parked is not None else trainer.partial_step()
                trainer = apply_reform(
                    run, trainer, run.pending_reform, keep_state=trainer.step_is_redoable, parked=parked
                )
                parked = None
                writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every)
                save_due = False
                continue
            run.iteration, run.step_seconds = result.iteration, result.seconds
            report = node_service_pb2.IterationReport(
                job_id=config.job_id,
                generation=run.generation,
                rank=run.rank,
                iteration=result.iteration,
                loss=result.loss,
                seconds=result.seconds,
                tokens=result.tokens,
                flops=result.flops,
                compute_seconds=result.compute_seconds,
            )
            if run.source is not None:
                report.state_source, report.restored_iteration = run.source
                run.source = None
            run.link.send(trainer_service_pb2.ConnectRequest(iteration=report))
            save_due = bool(config.checkpoint_dir) and run.iteration % interval == 0
            writer.after_iteration(trainer)
        if save_due:
            checkpoint.save(trainer, config.checkpoint_dir)
        trainer.close()
    except BaseException as exc:
        if exc is not run.reported:
            report_error(run, exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_first_group(run: Run, backend: str) -> bool:
    """Joins the process group this process was started for, or the newer one of a reform
    that arrives while it waits (a peer died before the group formed): then as a rank
    without state, which it takes from its peers. Returns whether the state comes from peers."""
    from services.trainer import reform as reforming

    config = run.config
    timeout = timedelta(seconds=config.collective_timeout_s)
    master_addr, master_port, from_peer = config.master_addr, config.master_port, config.state_from_peer
    while True:
        try:
            reforming.join(
                run.rank, run.world_size, master_addr, master_port, timeout, backend, lambda: reform_waiting(run)
            )
            return from_peer
        except reforming.Superseded:
            reform = poll_reform(run)
            assert reform is not None
            logging.getLogger("trainer").warning(
                "generation %d was replaced before its group formed; joining generation %d",
                run.generation,
                reform.generation,
                extra={"incident": reform.incident_id},
            )
            enter_generation(run, reform)
            master_addr, master_port, from_peer = reform.master_addr or master_addr, reform.master_port, True


def next_step(trainer: GPTTrainer, resume: PartialStep | None, log: logging.Logger) -> StepResult:
    """The next training step: the interrupted one finished from its computed gradients when
    ``resume`` fits this trainer (same iteration and data-parallel place), else a full step."""
    if resume is not None:
        try:
            result = trainer.finish_step(resume)
        except ValueError as exc:
            log.info("recomputing iteration %d: %s", resume.iteration, exc)
        else:
            log.info(
                "finished the interrupted iteration from its computed gradients",
                extra={"iteration": result.iteration, "micro_batches": len(resume.losses)},
            )
            return result
    return trainer.step()


def apply_reform(
    run: Run,
    trainer: GPTTrainer,
    reform: trainer_service_pb2.AgentReform,
    keep_state: bool,
    parked: reforming.Parked | None = None,
) -> GPTTrainer:
    """Moves this rank to the new process group of ``reform`` and returns its new trainer
    (``trainer`` is closed). When the group cannot be formed (a peer died meanwhile), the
    failure is handled as a failed step's: a newer reform, pending or the agent's answer to
    the report, is joined with the state the rank had; anything else raises, the rank fails
    as after any error, and the agent restarts it."""
    from services.trainer import reform as reforming

    log = logging.getLogger("trainer")
    while True:
        try:
            return _reform_once(run, trainer, reform, keep_state, parked)
        except reforming.ReformFailed as failed:
            newer = poll_reform(run)
            if newer is None:
                if after_failure(run, failed.error) is not Decision.REFORM:
                    raise failed.error from None
                newer = run.pending_reform
            assert newer is not None
            log.warning(
                "the process group of generation %d was not formed (%s); joining generation %d",
                reform.generation,
                failed,
                newer.generation,
                extra={"incident": newer.incident_id},
            )
            reform, parked, keep_state = newer, failed.parked, failed.parked.snapshot is not None


def _reform_once(
    run: Run,
    trainer: GPTTrainer,
    reform: trainer_service_pb2.AgentReform,
    keep_state: bool,
    parked: reforming.Parked | None,
) -> GPTTrainer:
    from services.trainer import reform as reforming

    log = logging.getLogger("trainer")
    config = run.config
    enter_generation(run, reform)
    log.info(
        "reforming into a new process group",
        extra={
            "incident": reform.incident_id,
            "iteration": trainer.iteration,
            "generation": reform.generation,
            "rank": reform.rank,
            "world_size": reform.world_size,
            "keep_state": keep_state,
        },
    )
    started = time.monotonic()
    new, restored = reforming.reform(
        trainer,
        reform.rank,
        reform.world_size,
        reform.master_addr or config.master_addr,
        reform.master_port,
        timedelta(seconds=config.collective_timeout_s),
        keep_state=keep_state,
        checkpoint_dir=config.checkpoint_dir,
        corrupt_transfer=config.corrupt_peer_state and run.injector.enabled,
        parked=parked,
        snapshot_dir=config.snapshot_dir,
        superseded=lambda: reform_waiting(run),
    )
    if run.injector.enabled:
        new.grad_sync_hook = run.injector.in_grad_sync
    run.iteration = new.iteration
    run.source = (restored.source, restored.iteration)
    log.info(
        "reformed",
        extra={
            "generation": run.generation,
            "rank": run.rank,
            "world_size": run.world_size,
            "data_parallel": new.data_parallel_size,
            "state_source": restored.source,
            "iteration": restored.iteration,
            "seconds": round(time.monotonic() - started, 3),
        },
    )
    return new


if __name__ == "__main__":
    exit_flushed(main(sys.argv[1:]))
