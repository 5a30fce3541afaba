"""The plain PyTorch level: the user keeps their loop; the session gives it the process group,
the state registration, step boundaries and reports (docs/trainer-library.md).

    session = Session(Training(iterations=200, global_batch_size=64))
    session.register(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in session.steps():
        with step:
            x, y = dataset[step.samples()]
            loss = loss_fn(model(x), y)
            loss.backward()
            session.all_reduce_gradients(model)
            optimizer.step()
            scheduler.step()
            step.report(loss.item(), tokens=len(x))

A step that raises is caught by ``with step``: reported (classified), and then, as the agent
decides, redone in a new process group (a reform: the same ranks, or a resized world; the
batch re-split over the new data-parallel degree) or ended. ``steps()`` yields the same
iteration again after a reform, so the loop body never sees the failure. At each boundary a
pending resize or stop is taken, and snapshots and checkpoints are written.

The registered state (model, optimizer, LR scheduler, RNG state, the iteration, which fixes the
data position) is what moves to a rank that joins from a peer, what snapshots and checkpoints
hold, and what a restarted rank resumes from. Exactness across a resize needs the loss to be
the mean over the rank's samples of ``step.samples()``: the gradient average over the
data-parallel ranks is then the global batch's mean. With dropout (or any random draw in the
forward pass), loop over ``step.micro_batches()``: each is seeded from its samples, so the
masks do not depend on the rank or the data-parallel degree."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer import buddy, runtime
from unicron.trainer.fsdp import FSDPTrainer
from unicron.trainer.plain_trainer import PlainLoopTrainer
from unicron.trainer.program import ProgramError, Training
from unicron.trainer.randomness import keyed_seed

log = logging.getLogger("trainer")


class TorchTrainer(PlainLoopTrainer):
    """The registered state of a plain PyTorch program, as the runtime's state machinery
    (reform, peer transfer, snapshots, checkpoints) takes a trainer: one shard, every rank a
    data-parallel replica. The user's objects stay the user's: a reform keeps them and only
    the process group changes."""

    @property
    def data_parallel_rank(self) -> int:
        return int(dist.get_rank())

    @property
    def data_parallel_size(self) -> int:
        return int(dist.get_world_size())

    def data_parallel_group(self) -> Any:
        return None  # the default group: every rank holds the whole model

    def layout(self) -> dict[str, Any]:
        """The model's parameter names and shapes, digested: a checkpoint of another model is
        never loaded."""
        shapes = [(name, list(p.shape)) for name, p in self.model.state_dict().items()]
        digest = hashlib.sha256(json.dumps(shapes).encode()).hexdigest()[:16]
        return {"model": {"parameters": digest}, "tensor_parallel": 1, "pipeline_parallel": 1}

    def state_dict(self) -> dict[str, Any]:
        state = {
            "iteration": self.iteration,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }
        return {**state, **self.replicated_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"], strict=True)
        self.optimizer.load_state_dict(state["optimizer"])
        self.load_replicated(state)

    def rebuild(self, timeout: timedelta | None = None) -> TorchTrainer:
        self._timeout = timeout or self._timeout
        return self

    def release(self) -> None:
        pass  # the user's objects hold no process group: all_reduce_gradients uses the current one


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model`` is sharded by FSDP2 (``fully_shard``) or otherwise holds DTensor
    parameters: each rank then holds only part of it, which Session's state model (a full
    replica per rank, its own gradient all-reduce) would silently get wrong."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    return any(isinstance(m, FSDPModule) for m in model.modules()) or any(
        isinstance(p, DTensor) for p in model.parameters()
    )


def _check_replica(model: Any, optimizer: Any, scheduler: Any) -> None:
    """That ``register(model=, optimizer=, scheduler=)`` got a whole replica and its optimizer."""
    if not isinstance(model, torch.nn.Module):
        raise ProgramError(f"register(model=...) takes a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ProgramError(
            "the state registration leaves the optimizer out: register(optimizer=...) takes a"
            f" torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if is_sharded(model):
        raise ProgramError(
            "register(model=...) got a model sharded with FSDP2 (fully_shard) or holding DTensor parameters:"
            " register(build=fn) instead, where fn(mesh) builds, shards and returns (model, optimizer[, scheduler]),"
            " so that the session can build it again on a new mesh after a reform"
        )
    owned = {id(p) for p in model.parameters()}
    if not all(id(p) in owned for group in optimizer.param_groups for p in group["params"]):
        raise ProgramError("the registered optimizer updates parameters that are not the registered model's")
    if scheduler is not None and not (hasattr(scheduler, "state_dict") and hasattr(scheduler, "load_state_dict")):
        raise ProgramError("register(scheduler=...) takes an LR scheduler with state_dict() and load_state_dict()")


class Session:
    """A plain PyTorch program's link to Unicron (or, without an agent, to torchrun's world)."""

    def __init__(self, training: Training | None = None, *, checkpoint_dir: str = "") -> None:
        from unicron.trainer import loop

        # What the imports created lives as long as the process: out of the garbage
        # collector's sight, the full collection of a reform (reform.teardown) is no longer
        # seconds on a loaded machine. Before the first group forms, as in loop.train, so no
        # process group is ever frozen. Collected first: frozen garbage would never be freed.
        gc.collect()
        gc.freeze()
        run = runtime.current()
        if run is None:
            run = runtime.attach_local(loop.local_spec(training or Training()), checkpoint_dir)
        self._run = run
        self.training = loop.training_of(run.spec) if run.supervised else (training or Training())
        if self.training.checkpoint_format == "megatron":
            raise ProgramError(
                "training.checkpoint_format megatron needs a Megatron-Core program (pretrain); a Session's state is"
                " checkpointed in Unicron's format, or torch's DCP (dcp)"
            )
        if self.training.tensor_parallel != 1 or self.training.pipeline_parallel != 1:
            raise ProgramError("the plain PyTorch level is data-parallel only (tensor and pipeline parallel 1)")
        self._device = "cuda" if torch.cuda.is_available() else "cpu"
        if self._device == "cuda":
            torch.cuda.set_device(loop.cuda_device(torch.cuda.device_count(), run.rank))
        self._from_peer = loop.join_first_group(run, "nccl" if self._device == "cuda" else "gloo")
        self._trainer: TorchTrainer | FSDPTrainer | None = None
        # Seconds of the current step spent recovering inside all_reduce_gradients: not the
        # step's compute, which its report says.
        self._paused_s = 0.0
        self._flops_per_token = 0.0
        self._writer: Any = None

    @property
    def rank(self) -> int:
        return int(dist.get_rank())

    @property
    def world_size(self) -> int:
        return int(dist.get_world_size())

    @property
    def device(self) -> torch.device:
        return torch.device(self._device)

    @property
    def iteration(self) -> int:
        """Iterations completed (the next step's number minus one)."""
        return self._run.iteration

    @property
    def model(self) -> Any:
        """The registered model; under ``register(build=...)`` the one built for the current
        process group, which a reform replaces: take it from here each step."""
        return None if self._trainer is None else self._trainer.model

    @property
    def optimizer(self) -> Any:
        return None if self._trainer is None else self._trainer.optimizer

    @property
    def scheduler(self) -> Any:
        return None if self._trainer is None else self._trainer.scheduler

    def register(
        self,
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        build: Any = None,
        shard_degree: int | None = None,
    ) -> None:
        """Registers what makes up the training state and restores it from the nearest source
        (a live peer, this node's snapshot, the checkpoint), or keeps it fresh.

        A replicated model: ``register(model=, optimizer=, scheduler=)``. A model sharded with
        FSDP2: ``register(build=fn)``, where ``fn(mesh)`` builds the model, shards it with
        ``fully_shard(..., mesh=mesh)`` and returns ``(model, optimizer[, scheduler])``; it is
        called again on the new mesh after every reform (unicron/trainer/fsdp.py). With
        ``shard_degree`` (fewer ranks than the world) the mesh is HSDP's, ``replicate`` x
        ``shard``: each group of that many ranks holds a whole copy of the state. None: the job
        spec's ``parallelism.shard_degree`` (0 under torchrun); a program that says another
        degree than its spec is refused in one line, since the planner sizes the job by the
        spec's."""
        if self._trainer is not None:
            raise ProgramError("register() was called twice")
        config = self._run.config
        timeout = timedelta(seconds=config.collective_timeout_s)
        trainer: TorchTrainer | FSDPTrainer
        if build is not None:
            if model is not None or optimizer is not None or scheduler is not None:
                raise ProgramError("register(build=...) takes no model, optimizer or scheduler: build returns them")
            if not callable(build):
                raise ProgramError(f"register(build=...) takes a function of the mesh, got {type(build).__name__}")
            trainer = FSDPTrainer(build, self._device, timeout, self.training, self._shard_degree(shard_degree))
            trainer.grad_sync_hook = self._in_sharded_grad_sync
            # Each rank's shard is in no peer's memory (under HSDP, shard_to_copy says, the
            # other replicas hold it): a buddy on another node keeps a copy unless told not to.
            self._run.buddies = buddy.BuddyCopies(
                config.node or config.agent or socket.gethostname(),
                enabled=(self.training.replication or 2) > 1,
                domain=config.domain,
            )
        else:
            if self.training.checkpoint_format == "dcp" or self.training.initial_checkpoint:
                raise ProgramError(
                    "training.checkpoint_format dcp and training.initial_checkpoint are for a model sharded with FSDP2"
                    " (register(build=...)); a replicated model's state is checkpointed in Unicron's format"
                )
            _check_replica(model, optimizer, scheduler)
            trainer = TorchTrainer(model, optimizer, scheduler, self._device, timeout)
            if self._run.injector.enabled:
                trainer.grad_sync_hook = self._run.injector.in_grad_sync
        self._restore(trainer)

    def _shard_degree(self, asked: int | None) -> int:
        """HSDP's shard degree: the spec's (``training.shard_degree``) unless the program says
        one, which must then agree with a spec that says one."""
        spec = self.training.shard_degree
        if asked is None:
            return spec
        if spec and asked != spec:
            raise ProgramError(
                f"register(shard_degree={asked}) disagrees with the job spec's parallelism.shard_degree {spec}"
            )
        return asked

    def _in_sharded_grad_sync(self) -> None:
        """Under FSDP the gradients are reduced inside backward, at whose start this is called:
        the faults of this iteration fire there."""
        self._run.injector.before_step(self._run.iteration + 1)
        self._run.injector.in_grad_sync()

    def _restore(self, trainer: TorchTrainer | FSDPTrainer) -> None:
        from unicron.trainer import reform as reforming
        from unicron.trainer import snapshot as snapshots

        config = self._run.config
        # A dense network's model FLOPs, 6 per parameter per token or sample (2 forward, 4
        # backward): what the coordinator learns the job's throughput per size from.
        self._flops_per_token = 6.0 * sum(p.numel() for p in trainer.model.parameters())
        if self._from_peer:
            restored = reforming.receive_state(trainer, config.checkpoint_dir, config.snapshot_dir)
        else:
            restored = snapshots.restore_nearest(trainer, config.checkpoint_dir, config.snapshot_dir)
        self._trainer = trainer
        self._run.iteration = trainer.iteration
        self._run.source = (restored.source, restored.iteration)
        every = config.snapshot_interval if config.snapshot_dir else 0
        self._writer = snapshots.SnapshotWriter(
            config.snapshot_dir, self._run.rank, every, self._run.durability.snapshotted
        )

    def samples(self, iteration: int) -> range:
        """This rank's global sample indices of ``iteration`` (1-based): its contiguous share of
        the global batch, which a resize re-splits."""
        t, dp = self.training, self.world_size
        if t.global_batch_size % dp:
            raise ProgramError(f"global_batch_size {t.global_batch_size} does not split over {dp} ranks")
        per_rank = t.global_batch_size // dp
        first = (iteration - 1) * t.global_batch_size + self.rank * per_rank
        return range(first, first + per_rank)

    def all_reduce_gradients(self, model: torch.nn.Module) -> None:
        """Averages the gradients of ``model`` over the data-parallel ranks of the current
        process group (after backward, before the optimizer's step).

        When the all-reduce fails and the agent's answer is a reform that keeps this rank's
        place (the same iteration, data-parallel size and rank: a reattempt), the reform is
        taken here and only the all-reduce is done again, in the new group, from the gradients
        this rank had computed; the loop body goes on as if nothing happened. Otherwise the
        step is redone whole (``with step``)."""
        if isinstance(self._trainer, FSDPTrainer):
            raise ProgramError("all_reduce_gradients: FSDP2 reduces the gradients itself in backward; drop this call")
        # Faults injected for this iteration fire here, inside the step: a plain loop's step
        # has no earlier point the library sees.
        self._run.injector.before_step(self._run.iteration + 1)
        while True:
            # References, not copies: a reform drops the parameters' gradients (the state is
            # loaded again), these tensors stay as backward left them.
            held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
            try:
                self._all_reduce([g for _, g in held])
                return
            except Exception as exc:
                if not self._finish_here(exc, held):
                    raise

    def _all_reduce(self, grads: list[torch.Tensor]) -> None:
        if self._trainer is not None and self._trainer.grad_sync_hook is not None:
            self._trainer.grad_sync_hook()
        if not grads or self.world_size == 1:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _finish_here(self, exc: Exception, held: list[tuple[torch.nn.Parameter, torch.Tensor]]) -> bool:
        """After a failed all-reduce: reports ``exc`` and takes the agent's decision. True: the
        rank reformed and keeps its place, its gradients are back, the all-reduce is to be done
        again. Raises StepRedone when the step must be redone whole (another place, or a stop),
        and returns False when the error ends the rank (reported already)."""
        place = (self._run.iteration + 1, self.world_size, self.rank)
        started = time.perf_counter()
        runtime.release_frames(exc)
        if not self._recover(exc):
            return False
        self._paused_s += time.perf_counter() - started
        assert self._trainer is not None
        if self._run.stop.is_set() or (self._trainer.iteration + 1, self.world_size, self.rank) != place:
            raise StepRedone
        for param, grad in held:
            param.grad = grad
        log.info(
            "finishing the interrupted iteration from its computed gradients",
            extra={"iteration": place[0], "world_size": place[1]},
        )
        return True

    def steps(self) -> Iterator[Step]:
        """The job's remaining iterations, one Step each; a step that failed and was reformed
        comes again. Ends at the last iteration (after telling the agent), or when stopped."""
        from unicron.trainer import loop, persistent

        if self._trainer is None:
            raise ProgramError("register(model=..., optimizer=...) must come before steps()")
        run, config = self._run, self._run.config
        interval = self.training.checkpoint_interval
        # And what the program built before its loop (its data, the libraries it imported for
        # them): the model and data live as long as the loop. The process group is not in a
        # reference cycle (it is freed when destroyed), so freezing it too keeps nothing alive.
        gc.collect()
        gc.freeze()
        # The buddy copies are refreshed at each group's first step and after each iteration.
        copy_due = True
        while run.iteration < self.training.iterations and not run.stop.is_set():
            reform = runtime.poll_reform(run)
            if reform is not None:  # at a boundary: nothing in flight
                self._trainer = loop.apply_reform(run, self._trainer, reform, keep_state=True)
                self._regroup()
                copy_due = True
                continue
            if copy_due and not self._copied():
                continue  # a peer was lost during the copy: the group reformed
            step = Step(self, run.iteration + 1)
            yield step
            copy_due = step.redo or step.iteration < self.training.iterations
            if step.redo:
                continue
            self._trainer.iteration = run.iteration = step.iteration
            run.stepped, run.step_seconds = True, step.seconds
            # The loss is this rank's; the tokens the whole job's (every rank saw as many).
            tokens = step.tokens * self.world_size
            runtime.report_iteration(
                run, step.iteration, step.loss, step.seconds, tokens, self._flops_per_token * tokens, step.seconds
            )
            self._trainer.update_started = False
            if config.checkpoint_dir and interval and run.iteration % interval == 0:
                run.durability.checkpointed(run.iteration, persistent.save(self._trainer, config.checkpoint_dir))
            self._writer.after_iteration(self._trainer)
        if run.stop.is_set() and run.iteration < self.training.iterations:
            raise SystemExit(runtime.EXIT_STOPPED)
        runtime.finish(run)

    def _copied(self) -> bool:
        """Refreshes the buddy copies (collective, at a step's start); False when a peer was
        lost doing so and the group reformed, True when done. Raises what ends the rank."""
        if self._run.buddies is None:
            return True
        try:
            self._run.buddies.refresh(self._trainer)
        except Exception as exc:
            runtime.release_frames(exc)
            if self._recover(exc):
                return False
            raise
        return True

    def _regroup(self) -> None:
        """After a reform: the buddy copies learn the new group at their next refresh (the
        copy held stays: a later reform may need it)."""
        if self._run.buddies is not None:
            self._run.buddies.regroup()

    def _failed(self, step: Step, exc: BaseException) -> bool:
        """What ``with step`` does with an error: True when the step is to be redone (after a
        reform), False to let the error end the rank."""
        if isinstance(exc, StepRedone):
            return True  # reformed already, inside all_reduce_gradients
        if exc is self._run.reported:
            return False  # reported and answered already, inside all_reduce_gradients
        return self._recover(exc)

    def _recover(self, exc: BaseException) -> bool:
        """Reports ``exc`` and takes the agent's decision: True when the rank reformed (or was
        stopped: ``run.stop`` is set), False when the error ends the rank."""
        from unicron.trainer import loop
        from unicron.trainer import reform as reforming

        run, trainer = self._run, self._trainer
        assert trainer is not None
        redoable = trainer.step_is_redoable
        parked: list[reforming.Parked] = []

        def leave_group() -> None:
            parked.append(reforming.park(trainer))

        decision = runtime.after_failure(run, exc, redoable, leave_group if redoable else None)
        if decision is runtime.Decision.STOP:
            run.stop.set()
            return True
        if decision is not runtime.Decision.REFORM:
            return False
        run.reported = None
        assert run.pending_reform is not None
        self._trainer = loop.apply_reform(
            run, trainer, run.pending_reform, keep_state=redoable, parked=parked[0] if parked else None
        )
        self._regroup()
        return True


class StepRedone(Exception):
    """Raised out of ``all_reduce_gradients`` when a reform taken there did not keep the rank's
    place: ``with step`` catches it and the step comes again, whole, in the new group."""


class Step:
    """One iteration of the user's loop. ``with step:`` catches what the body raises."""

    def __init__(self, session: Session, iteration: int) -> None:
        self.session = session
        self.iteration = iteration
        self.loss = float("nan")
        self.tokens = 0
        self.seconds = 0.0
        self.redo = False
        self._started = 0.0

    def samples(self) -> range:
        """This rank's global sample indices of this step."""
        return self.session.samples(self.iteration)

    @property
    def micro_batch_count(self) -> int:
        """How many micro-batches ``micro_batches()`` yields on this rank: divide each one's
        loss by it, so that the rank's gradient is its samples' mean."""
        return len(self.samples()) // self.session.training.micro_batch_size

    def micro_batches(self) -> Iterator[range]:
        """This rank's samples of the step in micro-batches of ``training.micro_batch_size``,
        torch's generators seeded before each from the job's seed, the iteration and the
        micro-batch's first global sample (``randomness.keyed_seed``): dropout's masks are then
        the samples' own, whichever rank computes them, and a reattempt, a restart and a resize
        stay exact with dropout on. ProgramError when the rank's share does not split."""
        samples, size = self.samples(), self.session.training.micro_batch_size
        if len(samples) % size:
            raise ProgramError(
                f"training.micro_batch_size {size} does not divide this rank's {len(samples)} samples"
                f" (global_batch_size {self.session.training.global_batch_size} over {self.session.world_size} ranks)"
            )
        for first in range(samples.start, samples.stop, size):
            torch.manual_seed(keyed_seed(self.session.training.seed, self.iteration, first))
            yield range(first, first + size)

    def report(self, loss: float, tokens: int = 0) -> None:
        """This rank's loss of the step (its samples' mean) and the tokens (or samples) it saw."""
        self.loss, self.tokens = float(loss), int(tokens)

    def __enter__(self) -> Step:
        self._started = time.perf_counter()
        self.session._paused_s = 0.0
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        self.seconds = time.perf_counter() - self._started - self.session._paused_s
        if exc is None:
            return False
        if not isinstance(exc, Exception):
            return False  # KeyboardInterrupt, SystemExit: not ours to handle
        runtime.release_frames(exc)
        self.redo = self.session._failed(self, exc)
        return self.redo
