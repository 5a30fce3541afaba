"""The trainer runtime: one rank of a job, connected to its node's agent, running the user's
program through the trainer library (unicron/trainer/api.py).

The rank speaks the agent protocol: a hello, one report per iteration, an error report
before an abnormal exit, a finished message before a clean one. Exit codes: 0 done, 1
failed, 143 stopped by request (as after SIGTERM).

This module holds the rank's session with the agent (``Run``: what the training thread
shares with the link's thread) and the rules of what a rank does after an error; the training
loop itself is in unicron/trainer/loop.py. Without an agent (plain ``torchrun``, or one
process) the same session runs over a local stand-in for the link that logs progress.

After a reattemptable (SEV3) error a rank reports the error and waits for the agent's decision:
on ``reform`` it moves to a new process group (unicron/trainer/reform.py) and redoes the
iteration there, on ``stop`` it exits 143, and when the agent goes away or does not answer
within ``reattempt_wait_s`` it exits 1, as after any other error. A reform that arrives while
the rank trains is taken at the next iteration boundary (a resize).

An error of the user's program (``ProgramError``, or a software error in the job's first
step) is reported as FAILURE_KIND_PROGRAM_ERROR with its traceback: the coordinator fails the
job once instead of restarting it into the same error."""

from __future__ import annotations

import faulthandler
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from google.protobuf import json_format

from unicron import signals, timeouts
from unicron.config import load_config
from unicron.failures import GROUP_SYMPTOMS, classify_exception, kind_name
from unicron.faults import parse_fault
from unicron.logs import exit_flushed, setup_logging
from unicron.ports import free_port
from unicron.trainer.agent_link import AgentLink, LinkCallbacks
from unicron.trainer.durability import Durability
from unicron.trainer.faults import FaultInjector, InjectedFailure
from unicron.trainer.program import ProgramError
from unicron.trainer.settings import ENV_PREFIX, TrainerConfig
from unicron.v1 import common_pb2, node_service_pb2, trainer_service_pb2

EXIT_STOPPED = 143
# IterationReport.state_source of the first report after a reform that kept this rank's own
# state; reform.SOURCE_PEER ("peer") when it came from a peer.
SOURCE_LIVE = "live"
# The environment variable that says a process runs under a Unicron agent.
AGENT_ENV = f"{ENV_PREFIX}_AGENT"
TRACEBACK_LIMIT = 16000


class Decision(Enum):
    """What a rank does after an error in its training step."""

    REFORM = "reform"  # move to the new process group of Run.pending_reform, redo the iteration
    STOP = "stop"  # the agent asked to stop: exit 143
    GIVE_UP = "give up"  # exit 1, as after any error


class Link(Protocol):
    """What a run sends its reports through: the agent link, or a local stand-in."""

    def send(self, message: trainer_service_pb2.ConnectRequest) -> None: ...

    def close(self, timeout_s: float = 5.0) -> None: ...


class LocalLink:
    """The link of a run without an agent (plain torchrun): progress goes to the log."""

    def __init__(self, rank: int) -> None:
        self._log = logging.getLogger("trainer")
        self._rank = rank

    def send(self, message: trainer_service_pb2.ConnectRequest) -> None:
        if message.HasField("iteration") and self._rank == 0:
            it = message.iteration
            extra: dict[str, object] = {"tokens": it.tokens, "learning_rate": it.learning_rate, **dict(it.metrics)}
            if it.HasField("grad_norm"):
                extra["grad_norm"] = it.grad_norm
            if it.HasField("validation_loss"):
                extra["validation_loss"] = it.validation_loss
            self._log.info("iteration %d: loss %.4f, %.3fs", it.iteration, it.loss, it.seconds, extra=extra)
        elif message.HasField("error"):
            self._log.error("failed: %s", message.error.message)

    def close(self, timeout_s: float = 5.0) -> None:
        del timeout_s


@dataclass
class Run:
    """What the training thread shares with the agent link's thread."""

    config: TrainerConfig
    spec: common_pb2.JobSpec
    link: Link
    stop: threading.Event
    injector: FaultInjector
    iteration: int = 0
    # Set (before `stop`) when the agent link is lost.
    lost: threading.Event = field(default_factory=threading.Event)
    # The iteration being redone (in a new group) and how often it has been.
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
    # Whether this process completed a step: an error before that, at iteration 0, is the
    # program's (see error_kind).
    stepped: bool = False
    # Set once the program trained its last iteration and told the agent.
    finished: bool = False
    # Whether an agent supervises this run (else: a local run under torchrun).
    supervised: bool = True
    # Set when interrupt_collectives aborted the old group's communicators for a pending reform.
    interrupted: bool = False
    # The last checkpoint's and snapshot's outcome, told on every report.
    durability: Durability = field(default_factory=Durability)
    # The buddy copy of a peer's optimizer shard this rank keeps (buddy.BuddyCopies; set by
    # the training loop under the distributed optimizer).
    buddies: Any = None

    def __post_init__(self) -> None:
        if self.generation < 0:
            self.generation = self.config.generation
        if self.rank < 0:
            self.rank = self.config.rank
        if self.world_size < 0:
            self.world_size = self.config.world_size


_active: Run | None = None


def under_agent() -> bool:
    """Whether a Unicron agent started this process (its settings are in the environment)."""
    return bool(os.environ.get(AGENT_ENV))


def current() -> Run | None:
    """This process's run: the one attached already, else, under an agent, attached now;
    None without an agent (a local run is made by the caller, with its own settings)."""
    if _active is None and under_agent():
        return attach()
    return _active


def active() -> Run | None:
    """The run of this process, once attached."""
    return _active


def attach(argv: list[str] | None = None) -> Run:
    """This process's run under its agent: the settings from the agent's environment (and
    ``argv``), the link opened. Raises UnicronError (or ParseError) on bad settings."""
    global _active
    if _active is not None:
        return _active
    config = load_config(TrainerConfig, env_prefix=ENV_PREFIX, argv=argv or [], description="Unicron trainer rank")
    spec = json_format.Parse(config.spec, common_pb2.JobSpec())
    faults = [parse_fault(text, config.rank) for text in config.faults]
    agent_security = config.agent_security()
    log = setup_logging("trainer", config.log_level)
    if config.plaintext is None and agent_security.tls is None:
        log.warning("no TLS settings: talking to the agent at %s in PLAINTEXT", config.agent)
    # The agent sends SIGUSR1 to take stack traces of a hung trainer before acting on it.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    stop = threading.Event()

    signal.signal(signal.SIGTERM, signals.handler(lambda _signum: stop.set()))
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
    reforms: queue.Queue[trainer_service_pb2.AgentReform] = queue.Queue()

    def on_reform(reform: trainer_service_pb2.AgentReform) -> None:
        reforms.put(reform)
        if reform.incident_id:
            interrupt_collectives(run, reform)

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
            on_reform=on_reform,
        ),
        security=agent_security,
    )
    run = Run(config, spec, link, stop, injector, lost=lost, reforms=reforms)
    link.open()
    threading.Thread(target=watch_reforms, args=(run,), name="reform-watchdog", daemon=True).start()
    _active = run
    return run


def attach_local(spec: common_pb2.JobSpec, checkpoint_dir: str = "") -> Run:
    """A run without an agent: the world from torchrun's environment (RANK, WORLD_SIZE,
    MASTER_ADDR, MASTER_PORT), or one process on a free local port."""
    global _active
    if _active is not None:
        return _active
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    port = int(os.environ.get("MASTER_PORT", "0")) or free_port()
    config = TrainerConfig(
        job_id=spec.name or "local",
        rank=rank,
        world_size=world,
        master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=port,
        agent="(none)",
        spec=json_format.MessageToJson(spec, indent=None),
        checkpoint_dir=checkpoint_dir,
        plaintext=True,
    )
    setup_logging("trainer", os.environ.get("UNICRON_TRAINER_LOG_LEVEL", "info"))
    stop = threading.Event()
    run = Run(config, spec, LocalLink(rank), stop, FaultInjector(False, lambda fault, at: None, stop))
    run.supervised = False
    _active = run
    return run


def finish(run: Run) -> None:
    """Tells the agent that this rank trained its last iteration."""
    run.finished = True
    run.link.send(
        trainer_service_pb2.ConnectRequest(finished=trainer_service_pb2.TrainerFinished(iterations=run.iteration))
    )


def report_iteration(
    run: Run,
    iteration: int,
    loss: float,
    seconds: float,
    tokens: int,
    flops: float = 0.0,
    compute_seconds: float = 0.0,
    *,
    metrics: dict[str, float] | None = None,
    learning_rate: float = 0.0,
    grad_norm: float | None = None,
    skipped: bool = False,
    validation_loss: float | None = None,
) -> None:
    """One iteration's report, naming where the state came from on the first after a
    (re)start or a reform."""
    report = node_service_pb2.IterationReport(
        job_id=run.config.job_id,
        generation=run.generation,
        rank=run.rank,
        iteration=iteration,
        loss=loss,
        seconds=seconds,
        tokens=tokens,
        flops=flops,
        compute_seconds=compute_seconds,
        metrics=metrics or {},
        learning_rate=learning_rate,
        skipped=skipped,
    )
    if grad_norm is not None:
        report.grad_norm = grad_norm
    if validation_loss is not None:
        report.validation_loss = validation_loss
    if run.source is not None:
        report.state_source, report.restored_iteration = run.source
        run.source = None
    run.durability.fill(report)
    run.link.send(trainer_service_pb2.ConnectRequest(iteration=report))


def error_kind(run: Run, exc: BaseException) -> common_pb2.FailureKind:
    """How ``exc`` is reported: the program's own errors (a ProgramError anywhere in its
    chain, or a plain software error before this process's first step of a job at iteration
    0, where nothing but the program can be at fault) as PROGRAM_ERROR, the rest by the
    taxonomy's patterns."""
    current: BaseException | None = exc
    while current is not None:
        if isinstance(current, ProgramError):
            return common_pb2.FAILURE_KIND_PROGRAM_ERROR
        current = current.__cause__
    kind = classify_exception(exc)
    first_step = not run.stepped and run.iteration == 0
    if kind == common_pb2.FAILURE_KIND_SOFTWARE_ERROR and first_step and not isinstance(exc, InjectedFailure):
        return common_pb2.FAILURE_KIND_PROGRAM_ERROR
    return kind


def report_error(run: Run, exc: BaseException, kind: common_pb2.FailureKind | None = None) -> None:
    """Tells the agent what went wrong (``kind``: error_kind's, when known already), before any
    cleanup: tearing down a process group whose peers still wait in a collective can block,
    and the report must not wait."""
    kind = error_kind(run, exc) if kind is None else kind
    # An error once every iteration is trained (in the final checkpoint's save, in teardown)
    # loses no training: said as the coordinator says it of a rank that exits then, so the
    # job's log does not show a failure that wanted a remedy.
    total = run.spec.training.iterations
    after = f"after its last iteration {run.iteration}: " if total and run.iteration >= total else ""
    error = trainer_service_pb2.TrainerError(
        kind=kind,
        message=f"{after}{type(exc).__name__}: {exc}"[:2000],
        iteration=run.iteration + 1,
        generation=max(0, run.generation),
        traceback="".join(traceback.format_exception(exc))[-TRACEBACK_LIMIT:],
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
REFORM_OVERDUE_MIN_S = timeouts.REFORM_OVERDUE_S
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


def interrupt_collectives(run: Run, reform: trainer_service_pb2.AgentReform) -> None:
    """On NCCL, aborts this process's communicators when a reform answers an incident: the
    old group is broken (a member died or left it), and a collective of the training thread
    blocked on it would otherwise wait for the watchdog or the collective timeout. Aborted, the
    collective fails at once and the training thread takes the reform (after_failure). Gloo's
    collectives cannot be interrupted this way (see reform.py); there the leaving peers'
    closed connections break them. Runs on the agent link's thread."""
    from unicron.trainer import reform as reforming

    if reforming.abort_communicators():
        run.interrupted = True
        logging.getLogger("trainer").warning(
            "aborted the NCCL communicators of the old process group",
            extra={"incident": reform.incident_id, "generation": reform.generation},
        )


def reform_waiting(run: Run) -> bool:
    """Whether a reform newer than this process's generation waits (see poll_reform)."""
    return poll_reform(run) is not None


def enter_generation(run: Run, reform: trainer_service_pb2.AgentReform) -> None:
    """From now on this rank belongs to ``reform``'s generation: its errors are reported as
    that generation's, and only a newer reform supersedes this one."""
    run.pending_reform = None
    run.interrupted = False
    run.generation, run.rank, run.world_size = reform.generation, reform.rank, reform.world_size


def wait_for_decision(run: Run, timeout_s: float, poll_s: float = 0.05) -> Decision:
    """The agent's answer to the error just reported: a reform, a stop request, the loss of
    the link, or nothing within ``timeout_s`` (GIVE_UP)."""
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
        if time.monotonic() >= deadline:
            return Decision.GIVE_UP
        run.stop.wait(max(0.0, min(poll_s, deadline - time.monotonic())))


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
    """Reports ``exc`` (first, before anything can block) and waits for the decision, which
    is the coordinator's alone (it classifies the reported kind): a reform (reattempt, or a
    restart of other ranks, with this rank's state), or a stop (this rank is replaced, or the
    job fails). The rank gives up at once only where nobody can decide or nothing can be
    redone: no agent (plain torchrun), an error of the program itself (the redo fails the
    same way), a step that already updated the parameters, or ``max_reattempts`` reforms for
    one iteration. ``leave_group`` (when given) runs before
    the wait: the rank leaves its process group at once (see reform.park), so that peers
    waiting on it in a collective fail and report now, not at the collective timeout.

    Exception: a network error while a reform is already pending is not reported; the agent
    has decided already, and the error is most likely the old group breaking as peers leave it
    for the new one (or, on NCCL, any error once interrupt_collectives aborted the group). The
    rank takes the reform (with its state only if the step can be redone)."""
    log = logging.getLogger("trainer")
    kind = error_kind(run, exc)
    if (kind in GROUP_SYMPTOMS or run.interrupted) and poll_reform(run) is not None:
        log.warning(
            "step %d failed while a reform is pending (%s: %s); joining the new group",
            run.iteration + 1,
            type(exc).__name__,
            str(exc)[:200],
        )
        return Decision.REFORM
    report_error(run, exc, kind)
    run.reported = exc
    if not run.supervised or kind == common_pb2.FAILURE_KIND_PROGRAM_ERROR:
        return Decision.GIVE_UP  # nobody to decide, or a redo that fails the same way
    step = run.iteration + 1
    if not redoable:
        log.error("the failed step %d already updated the parameters; it cannot be redone", step)
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
    if decision is Decision.REFORM:
        run.reattempt_count += 1
    elif decision is Decision.STOP:
        log.info("stopped after the error of step %d, by the coordinator's decision", step)
    else:
        reason = "the agent connection was lost" if run.lost.is_set() else "no decision from the agent"
        log.error("%s within %.0fs; exiting", reason, run.config.reattempt_wait_s)
    return decision
