"""The training loop of the Megatron-Core level: the runtime owns it. Each pass takes a pending
reform at the iteration boundary, saves the checkpoint the last iteration owed, runs one step
(the interrupted one finished from its computed gradients after a reform) and reports it; an
error goes through ``runtime.after_failure``, whose decision the loop carries out.

The state a rank starts from is the nearest there is: a live peer's (a rank started for a grow),
else its newest snapshot or persistent checkpoint (unicron/trainer/snapshot.py)."""

from __future__ import annotations

import gc
import logging
import os
import socket
import time
from datetime import timedelta
from typing import TYPE_CHECKING

from unicron.jobspec import DEFAULT_CHECKPOINT_INTERVAL, OPTIMIZER_DEFAULTS, OPTIONAL_OPTIMIZER_SETTINGS
from unicron.trainer import tensorboard_log
from unicron.trainer.program import MegatronProgram, ProgramError, Training
from unicron.trainer.protocol import T
from unicron.trainer.runtime import (
    Decision,
    Run,
    after_failure,
    enter_generation,
    poll_reform,
    reform_waiting,
    report_error,
    report_iteration,
)
from unicron.v1 import common_pb2, trainer_service_pb2

if TYPE_CHECKING:  # torch and Megatron take seconds to import
    from unicron.trainer import reform as reforming
    from unicron.trainer.engine import MegatronTrainer
    from unicron.trainer.step_result import PartialStep, StepResult


def training_of(spec: common_pb2.JobSpec) -> Training:
    """The runtime's training settings from a job spec (defaults filled)."""
    t, par = spec.training, spec.parallelism
    return Training(
        iterations=t.iterations,
        global_batch_size=t.global_batch_size,
        micro_batch_size=t.micro_batch_size or 1,
        learning_rate=t.learning_rate or 1e-3,
        seed=t.seed,
        tensor_parallel=par.tensor or 1,
        pipeline_parallel=par.pipeline or 1,
        checkpoint_interval=t.checkpoint_interval or DEFAULT_CHECKPOINT_INTERVAL,
        lr_warmup_iterations=t.lr_warmup_iterations,
        lr_decay_style=t.lr_decay_style or "constant",
        min_learning_rate=t.min_learning_rate,
        weight_decay=t.weight_decay,
        lr_decay_iterations=t.lr_decay_iterations,
        lr_wsd_decay_iterations=t.lr_wsd_decay_iterations,
        lr_wsd_decay_style=t.lr_wsd_decay_style or OPTIMIZER_DEFAULTS["lr_wsd_decay_style"],
        optimizer=t.optimizer or OPTIMIZER_DEFAULTS["optimizer"],
        overlap_grad_reduce=t.overlap_grad_reduce,
        precision=t.precision or OPTIMIZER_DEFAULTS["precision"],
        distributed_optimizer=t.distributed_optimizer,
        eval_interval=t.eval_interval,
        eval_iterations=t.eval_iterations or 1,
        tensorboard_dir=t.tensorboard_dir,
        checkpoint_format=t.checkpoint_format or OPTIMIZER_DEFAULTS["checkpoint_format"],
        initial_checkpoint=t.initial_checkpoint,
        initial_checkpoint_weights_only=t.initial_checkpoint_weights_only,
        replication=t.replication,
        shard_degree=par.shard_degree,
        **{name: getattr(t, name) for name in OPTIONAL_OPTIMIZER_SETTINGS if t.HasField(name)},
    )


def local_spec(training: Training) -> common_pb2.JobSpec:
    """The job spec of a run without Unicron, from its training settings."""
    spec = common_pb2.JobSpec(name="local")
    spec.parallelism.tensor = training.tensor_parallel
    spec.parallelism.pipeline = training.pipeline_parallel
    t = spec.training
    t.iterations = training.iterations
    t.global_batch_size = training.global_batch_size
    t.micro_batch_size = training.micro_batch_size
    t.learning_rate = training.learning_rate
    t.seed = training.seed
    t.checkpoint_interval = training.checkpoint_interval
    t.lr_warmup_iterations = training.lr_warmup_iterations
    t.lr_decay_style = training.lr_decay_style
    t.min_learning_rate = training.min_learning_rate
    t.weight_decay = training.weight_decay
    t.lr_decay_iterations = training.lr_decay_iterations
    t.lr_wsd_decay_iterations = training.lr_wsd_decay_iterations
    t.lr_wsd_decay_style = training.lr_wsd_decay_style
    t.optimizer = training.optimizer
    t.overlap_grad_reduce = training.overlap_grad_reduce
    t.precision = training.precision
    t.distributed_optimizer = training.distributed_optimizer
    t.eval_interval, t.eval_iterations = training.eval_interval, training.eval_iterations
    t.tensorboard_dir = training.tensorboard_dir
    t.checkpoint_format, t.initial_checkpoint = training.checkpoint_format, training.initial_checkpoint
    t.initial_checkpoint_weights_only = training.initial_checkpoint_weights_only
    t.replication = training.replication
    spec.parallelism.shard_degree = training.shard_degree
    for name in OPTIONAL_OPTIMIZER_SETTINGS:
        setattr(t, name, getattr(training, name))
    return spec


def cuda_device(visible: int, rank: int) -> int:
    """This rank's GPU among the ``visible`` ones: the only one when its agent gave it its
    slot's GPU alone (CUDA_VISIBLE_DEVICES); LOCAL_RANK under torchrun; else its rank's."""
    import os

    if visible <= 1:
        return 0
    if "LOCAL_RANK" in os.environ:
        return int(os.environ["LOCAL_RANK"]) % visible
    return rank % visible


def train(run: Run, program: MegatronProgram) -> None:
    """Trains ``program`` to the job's last iteration (or until stopped); raises after reporting
    an error the rank cannot get past."""
    log = logging.getLogger("trainer")
    # Imported here: torch and Megatron take seconds to import, and config errors should
    # be reported before that.
    import torch
    import torch.distributed as dist

    from unicron.trainer import buddy
    from unicron.trainer import reform as reforming
    from unicron.trainer import snapshot as snapshots

    # What the imports created lives as long as the process: out of the garbage collector's
    # sight, a reform's full collection (which frees the old process groups, see
    # reform.teardown) takes a fraction of the time.
    gc.freeze()
    config, spec = run.config, run.spec
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        torch.cuda.set_device(cuda_device(torch.cuda.device_count(), run.rank))
    training = training_of(spec)
    try:
        if training.checkpoint_format == "dcp":
            raise ProgramError(
                "training.checkpoint_format dcp is torch's DCP for an FSDP2 program under Session; a Megatron-Core"
                " program checkpoints in unicron or megatron format"
            )
        trainer = _first_trainer(run, program, training, use_cuda)
        interval = training.checkpoint_interval
        every = config.snapshot_interval if config.snapshot_dir else 0
        writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every, run.durability.snapshotted)
        scalars = tensorboard_log.ScalarLog(training.tensorboard_dir if run.rank == 0 else "")
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
        # Likewise the buddy copies (buddy.py), at each group's first pass and after each
        # iteration: every rank of a group takes part, new and old alike.
        run.buddies = buddy.BuddyCopies(
            config.node or config.agent or socket.gethostname(), enabled=training.copies > 1, domain=config.domain
        )
        copy_due = True
        while run.iteration < training.iterations and not run.stop.is_set():
            reform = poll_reform(run)
            if reform is not None:  # at an iteration boundary: nothing in flight
                trainer = apply_reform(run, trainer, reform, keep_state=True)
                writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every, run.durability.snapshotted)
                # A rank new to the group owes no save: a collective not every rank joins hangs.
                save_due, copy_due = False, True
                run.buddies.regroup()
                continue
            decision: Decision | None = None
            finishing, resume = resume, None
            try:
                _owed(run, trainer, save_due, copy_due)
                save_due = copy_due = False
                run.injector.before_step(run.iteration + 1)
                result = next_step(trainer, finishing, log)
                # In the step's try: a peer lost during the evaluation's collectives is a failed
                # step of a trainer whose update is done (its report is lost, not its state).
                evaluated = trainer.evaluate() if _evaluate_after(training, result.iteration) else None
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
                writer = snapshots.SnapshotWriter(config.snapshot_dir, run.rank, every, run.durability.snapshotted)
                save_due, copy_due = False, True
                run.buddies.regroup()
                continue
            run.iteration, run.step_seconds, run.stepped = result.iteration, result.seconds, True
            _report(run, result, evaluated, scalars)
            save_due = bool(config.checkpoint_dir) and run.iteration % interval == 0
            copy_due = run.iteration < training.iterations
            writer.after_iteration(trainer)
        if not run.stop.is_set():  # a stopped rank owes no collective
            _save_last(run, trainer, save_due, log)
        if run.buddies.refreshes:
            log.info("buddy copies", extra=run.buddies.summary())
        scalars.close()
        trainer.close()
    except BaseException as exc:
        if exc is not run.reported and not isinstance(exc, SystemExit):
            report_error(run, exc)
            run.reported = exc
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _owed(run: Run, trainer: MegatronTrainer, save: bool, copy: bool) -> None:
    """The collectives the last iteration left owing: its checkpoint and its buddy copies."""
    from unicron.trainer import persistent

    if save:
        run.durability.checkpointed(trainer.iteration, persistent.save(trainer, run.config.checkpoint_dir))
    if copy:
        run.buddies.refresh(trainer)


def _save_last(run: Run, trainer: MegatronTrainer, save_due: bool, log: logging.Logger) -> None:
    """The last iteration's checkpoint, when due, and the final checkpoint a plain Megatron-Core
    script loads (Megatron-LM's ``pretrain`` also saves at its end): the process group is gone
    once ``pretrain`` returns, so the program cannot save it itself. A final checkpoint that
    does not save is an error: a restart at the last iteration saves it again."""
    from unicron.trainer import megatron_checkpoint, persistent

    root = run.config.checkpoint_dir
    if not root:
        if run.rank == 0 and run.iteration >= trainer.training.iterations:
            log.warning("the trained model is not saved: pass pretrain(checkpoint_dir=...) to keep it")
        return
    saved = False
    if save_due:
        problem = persistent.save(trainer, root)
        run.durability.checkpointed(trainer.iteration, problem)
        saved = not problem
    if run.iteration < trainer.training.iterations:
        return
    problem = persistent.save_final(trainer, root, saved)
    if problem:
        raise RuntimeError(f"the final checkpoint was not saved: {problem}")
    if run.rank == 0:
        where = megatron_checkpoint.iteration_dir(persistent.final_root(trainer, root), trainer.iteration)
        log.info(
            "the trained model is saved as a Megatron-Core distributed checkpoint",
            extra={"iteration": trainer.iteration, "checkpoint": str(where)},
        )


def _report(run: Run, result: StepResult, evaluated: float | None, scalars: tensorboard_log.ScalarLog) -> None:
    """One finished iteration to the agent, and to TensorBoard where the job asks for it."""
    report_iteration(
        run,
        result.iteration,
        result.loss,
        result.seconds,
        result.tokens,
        result.flops,
        result.compute_seconds,
        metrics=result.metrics,
        learning_rate=result.learning_rate,
        grad_norm=result.grad_norm,
        skipped=result.skipped,
        validation_loss=evaluated,
    )
    scalars.write(result.iteration, tensorboard_log.scalars_of(result, evaluated))


def _evaluate_after(training: Training, iteration: int) -> bool:
    """Whether the job evaluates after ``iteration``: every eval_interval, and after the last."""
    every = training.eval_interval
    return every > 0 and (iteration % every == 0 or iteration == training.iterations)


def _first_trainer(run: Run, program: MegatronProgram, training: Training, use_cuda: bool) -> MegatronTrainer:
    """This process's trainer in its first group, with the state it starts from (a peer's, a
    snapshot, the checkpoint, or fresh) loaded and recorded in ``run``."""
    from unicron.trainer import reform as reforming
    from unicron.trainer import snapshot as snapshots
    from unicron.trainer.engine import MegatronTrainer

    config = run.config
    state_from_peer = join_first_group(run, "nccl" if use_cuda else "gloo")
    # MegatronTrainer enters the Megatron CPU shim (megatron_cpu.cpu_mode) around its own calls.
    trainer = MegatronTrainer(
        program,
        training,
        device="cuda" if use_cuda else "cpu",
        timeout=timedelta(seconds=config.collective_timeout_s),
    )
    if run.injector.enabled:
        trainer.grad_sync_hook = run.injector.in_grad_sync
    logging.getLogger("trainer").info("model ready", extra={"rank": run.rank, "world_size": run.world_size})
    if state_from_peer:
        restored = reforming.receive_state(trainer, config.checkpoint_dir, config.snapshot_dir)
    else:
        restored = snapshots.restore_nearest(trainer, config.checkpoint_dir, config.snapshot_dir)
    run.iteration = trainer.iteration
    run.source = (restored.source, restored.iteration)
    return trainer


def generation_namespace(generation: int) -> str:
    """Where a generation's group keeps its keys on its rank 0's store: the previous
    generation's store may still listen on the same port (its process slow to exit), and its
    keys must not count as this generation's."""
    return f"unicron/gen-{generation}/"


def join_first_group(run: Run, backend: str) -> bool:
    """Joins the process group this process was started for, or the newer one of a reform
    that arrives while it waits (a peer died before the group formed): then as a rank
    without state, which it takes from its peers. Returns whether the state comes from peers."""
    from unicron.trainer import reform as reforming

    config = run.config
    timeout = timedelta(seconds=config.collective_timeout_s)
    master_addr, master_port, from_peer = config.master_addr, config.master_port, config.state_from_peer
    # Without Unicron, under torchrun, the store at MASTER_PORT is the elastic agent's and
    # outlives a restart of the workers: every rank joins it as a client, and each attempt
    # forms its group under keys of its own.
    agent_store = not run.supervised and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    while True:
        if agent_store:
            namespace = f"unicron/torchelastic-attempt-{attempt}/"
        else:
            namespace = generation_namespace(run.generation) if run.supervised else ""
        try:
            reforming.join(
                run.rank,
                run.world_size,
                master_addr,
                master_port,
                timeout,
                backend,
                lambda: reform_waiting(run),
                namespace,
                agent_store,
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


def next_step(trainer: MegatronTrainer, resume: PartialStep | None, log: logging.Logger) -> StepResult:
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
    trainer: T,
    reform: trainer_service_pb2.AgentReform,
    keep_state: bool,
    parked: reforming.Parked | None = None,
) -> T:
    """Moves this rank to the new process group of ``reform`` and returns its new trainer
    (``trainer`` is closed). When the group cannot be formed (a peer died meanwhile), the
    failure is handled as a failed step's: a newer reform, pending or the agent's answer to
    the report, is joined with the state the rank had; anything else raises, the rank fails
    as after any error, and the agent restarts it."""
    from unicron.trainer import reform as reforming

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
            reform, parked, keep_state = newer, failed.parked, failed.parked.held is not None


def _reform_once(
    run: Run,
    trainer: T,
    reform: trainer_service_pb2.AgentReform,
    keep_state: bool,
    parked: reforming.Parked | None,
) -> T:
    from unicron.trainer import reform as reforming

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
        namespace=generation_namespace(reform.generation),
        copy=run.buddies.copy if run.buddies is not None else None,
    )
    if run.injector.enabled and new.grad_sync_hook is None:
        # A trainer whose rebuild keeps its own hook keeps it (FSDP's fires the iteration's
        # faults at the start of backward too: replaced, none fired after a reform).
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
