"""The Megatron-Core engine: a user's program (model, data, forward step) trained by Megatron's
DDP, optimizer and pipeline schedule, one optimizer iteration per ``step()``.

The caller owns the process: it initializes ``torch.distributed`` (gloo on CPU, NCCL on CUDA)
before building a ``MegatronTrainer`` and destroys the process group after ``close()``. To move
a rank to another process group in the same process, ``release()`` the trainer (not just
``close()``), destroy the group, join the new one and ``rebuild()``; unicron/trainer/reform.py
does that.

Data is addressed by global sample index. Iteration ``i`` consumes global samples
``[i*G, (i+1)*G)`` (``G`` = global batch size). Data-parallel rank ``r`` of ``D`` takes the
contiguous block ``[i*G + r*G/D, i*G + (r+1)*G/D)`` and cuts it, in order, into micro-batches.
The set of samples in a step therefore does not depend on ``D``, and with the loss averaged over
the whole global batch (the loss function returns a sum and a token count) the update is the
same, up to float rounding, for every DP degree: a job resized between steps learns what it
would have learnt.

The whole training state of a rank is then its (TP, PP) slice of the model, the optimizer state
of that slice, the LR scheduler, the RNG states and the iteration number (which fixes the data
position): ``state_dict()`` / ``load_state_dict()`` move exactly that, and a state saved under
one DP degree loads under any other (same TP/PP).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from unicron.trainer.megatron_cpu import cpu_mode, wants_cpu
from unicron.trainer.program import MegatronProgram, ProgramError, Training, collate, dataset_size, sample_length

# isort: split
# Megatron is imported after the shim so the shim's warning filters see its import-time warnings.
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import unwrap_model

from unicron.trainer import distributed_optimizer, step_report
from unicron.trainer.megatron_settings import (
    ddp_config,
    optimizer_config,
    param_scheduler,
    rng_states,
    set_rng_states,
)
from unicron.trainer.optimizer_shards import SHARD_KEY
from unicron.trainer.randomness import keyed_seed
from unicron.trainer.step_result import PartialStep, StepResult


class MegatronTrainer:
    """One replica slice (TP x PP) of a user's Megatron-Core model on this rank, trained with
    Megatron DDP, its optimizer and an LR scheduler."""

    def __init__(
        self,
        program: MegatronProgram,
        training: Training,
        device: str = "cpu",
        timeout: timedelta | None = None,
    ) -> None:
        """``timeout``: of the collectives in Megatron's model- and data-parallel groups (the
        gradient all-reduce runs in those); None keeps Megatron's default of 30 minutes. Pass
        the timeout the default process group was created with."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before MegatronTrainer")
        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError("Megatron parallel state is already initialized; close() first")
        self._cpu = wants_cpu(device)
        self._device = device
        self.program = program
        self.training = training
        self._tp = training.tensor_parallel
        self._pp = training.pipeline_parallel
        self._dp = _data_parallel(training)
        self._num_microbatches = training.global_batch_size // (training.micro_batch_size * self._dp)
        self._timeout = timeout
        self._iteration = 0
        # Set once the optimizer began updating parameters in the current step: from then on
        # the step cannot be redone without applying (part of) its update twice.
        self._update_started = False
        self._closed = False
        self._grad_sync_at: float | None = None
        # Called on this rank's entry into the gradient all-reduce (set by fault injection).
        self.grad_sync_hook: Callable[[], None] | None = None
        # This step's local gradients (copied as the all-reduce begins, which overwrites them
        # in place) and micro-batch (loss sum, tokens): what a failed all-reduce leaves to
        # reuse. The copy costs one more gradient buffer of memory.
        # Under overlap_grad_reduce the buckets are reduced in place while the backward pass
        # still runs, so no whole copy of the local gradients exists by the time this rank
        # reaches the all-reduce: a reattempt then recomputes the step's micro-batches.
        self.keep_local_grads = not training.overlap_grad_reduce
        self._local_grads: list[torch.Tensor] | None = None
        self._step_losses: list[torch.Tensor] = []
        self._step_reports: step_report.Totals = {}
        self._report_names: list[str] | None = None  # agreed by the ranks at the first step
        self._learning_rate = 0.0
        self._valid_dataset: Any = None
        self._forward_passes = 0  # of the step in progress
        self._skipped_steps = 0  # fp16 steps skipped for overflowing gradients, in this process
        self._last_update: tuple[bool, float | None] = (True, None)
        self._metrics: dict[str, float] = {}
        with cpu_mode(device):
            try:
                self._build()
            except BaseException:
                # A program's error (a model of another split or precision) leaves no Megatron
                # state behind: the process may build a trainer again.
                parallel_state.destroy_model_parallel()
                raise

    def _build(self) -> None:
        t = self.training
        timeouts = {} if self._timeout is None else {"distributed_timeout_minutes": self._timeout.total_seconds() / 60}
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=self._tp, pipeline_model_parallel_size=self._pp, **timeouts
        )
        # Seeded before the provider runs, so the initial model depends on the seed alone (not
        # on the DP degree or on which process builds it).
        torch.manual_seed(t.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(t.seed)
        module = self.program.build_model(
            parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
        )
        config = self.program.check_model(module, self._tp, self._pp, t.precision)
        if not self._cpu:
            module.cuda(torch.cuda.current_device())
        if t.precision != "fp32":
            # As Megatron-LM's get_model: the parameters in low precision, the first stage's
            # input and the last stage's output converted at the module's edges.
            module = Float16Module(config, module)
        self.model = DistributedDataParallel(config=config, ddp_config=ddp_config(t), module=module)
        self.optimizer = get_megatron_optimizer(optimizer_config(t, config.params_dtype), [self.model])
        self.scheduler = param_scheduler(self.optimizer, t)
        if t.distributed_optimizer:
            distributed_optimizer.allocate_state(self.optimizer)
        if t.precision == "fp16":
            # The schedule multiplies the loss by the optimizer's loss scale before the backward
            # pass (Megatron-LM sets the same); the optimizer divides the gradients by it.
            config.grad_scale_func = self.optimizer.scale_loss
        # Without these hooks the schedule never triggers DDP's grad all-reduce.
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = self._finalize_grads
        self._forward_backward = get_forward_backward_func()
        self.dataset = self.program.build_dataset(t.iterations * t.global_batch_size)
        if t.eval_interval:
            # At start: a job set to evaluate whose program has no validation data fails now.
            self._valid_dataset = self.program.build_valid_dataset(t.eval_iterations * t.global_batch_size)
        self._dataset_size = dataset_size(self.dataset)
        self._seq_length = self.program.seq_length or sample_length(self.dataset[0])
        self._parameters = sum(p.numel() for p in self.model.parameters())
        # One replica's parameters (every TP x PP slice), learnt from the first loss all-reduce.
        self._replica_parameters = 0.0

    @property
    def iteration(self) -> int:
        return self._iteration

    @property
    def timeout(self) -> timedelta | None:
        """The collective timeout of Megatron's groups given at construction (None: default)."""
        return self._timeout

    @property
    def device(self) -> str:
        """The device this trainer was built for ("cpu" or "cuda")."""
        return self._device

    @property
    def skipped_steps(self) -> int:
        """fp16 steps this process skipped because their gradients overflowed."""
        return self._skipped_steps

    @property
    def data_parallel_size(self) -> int:
        return self._dp

    @property
    def tensor_parallel(self) -> int:
        return self._tp

    @property
    def pipeline_parallel(self) -> int:
        return self._pp

    @property
    def data_parallel_rank(self) -> int:
        return int(parallel_state.get_data_parallel_rank())

    @property
    def shard(self) -> tuple[int, int]:
        """(tensor-parallel rank, pipeline-parallel rank): which slice of the model this rank holds."""
        return (
            int(parallel_state.get_tensor_model_parallel_rank()),
            int(parallel_state.get_pipeline_model_parallel_rank()),
        )

    def data_parallel_group(self) -> Any:
        """The ranks that hold this rank's shard (a peer transfer runs among them)."""
        return parallel_state.get_data_parallel_group()

    def layout(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded here: the program's description of its
        model and the TP x PP split."""
        return {"model": self.program.describe(), "tensor_parallel": self._tp, "pipeline_parallel": self._pp}

    def rebuild(self, timeout: timedelta | None = None) -> MegatronTrainer:
        """A fresh trainer of the same program and settings for the current process group (its
        DP degree follows from the new world size)."""
        return MegatronTrainer(self.program, self.training, self._device, timeout or self._timeout)

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state: its model slice, the optimizer state of that slice, the
        LR scheduler, the RNG states and the number of completed iterations, which also fixes
        the data position. References, not copies. Megatron's non-distributed optimizer keeps
        the whole optimizer state, identical on every DP rank, in "optimizer"; under the
        distributed optimizer "optimizer" holds its parameter groups only and this rank's
        shard of main parameters and moments is under SHARD_KEY, as named pieces."""
        state = {
            "iteration": self._iteration,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_states(),
        }
        shard = self.shard_to_copy()
        if shard is not None:
            state[SHARD_KEY] = shard
        return state

    def shard_to_copy(self) -> dict[str, Any] | None:
        """This rank's distributed optimizer shard, as pieces; None under a replicated one."""
        if not self.training.distributed_optimizer:
            return None
        return distributed_optimizer.shard(self.optimizer, self.model, self.data_parallel_rank, self._dp)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (as returned by ``state_dict()``, possibly under another DP
        degree). Parameters are copied in place, so Megatron's DDP buffers stay valid. Under the
        distributed optimizer this rank's shard is cut from the shards ``state`` carries (its
        own, or several ranks' gathered for a resize); ShardError, with nothing loaded, when
        they miss part of it."""
        if self._closed:
            raise RuntimeError("MegatronTrainer is closed")
        with cpu_mode(self._device):
            if self.training.distributed_optimizer:
                distributed_optimizer.load(self.optimizer, self.model, state)
            else:
                self.optimizer.load_state_dict(state["optimizer"])
            self.model.load_state_dict(state["model"], strict=True)
            if "scheduler" in state:
                self.scheduler.load_state_dict(state["scheduler"])
            if "rng" in state:
                set_rng_states(state["rng"])
            self.discard_step()
        self._iteration = int(state["iteration"])

    def sharded_state(self, is_loading: bool = False, weights_only: bool = False) -> dict[str, Any]:
        """This rank's part of the job's state as Megatron-Core's sharded state dicts (what
        Megatron-LM passes to ``dist_checkpointing``): the unwrapped model's, and its optimizer's
        (data-parallel reshardable under the distributed optimizer) unless ``weights_only``."""
        with cpu_mode(self._device):
            model = unwrap_model(self.model).sharded_state_dict()
            if weights_only:
                return {"model": model}
            metadata = (
                {"distrib_optim_sharding_type": "dp_reshardable"} if self.training.distributed_optimizer else None
            )
            optimizer = self.optimizer.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)
        return {"model": model, "optimizer": optimizer}

    def load_sharded(self, loaded: dict[str, Any], weights_only: bool = False) -> None:
        """Continues from what ``dist_checkpointing.load`` returned for ``sharded_state(True)``:
        the model, and unless ``weights_only`` the optimizer, the LR schedule and the iteration
        (``opt_param_scheduler`` and ``iteration``, as Megatron-LM saves them)."""
        with cpu_mode(self._device):
            unwrap_model(self.model).load_state_dict(loaded["model"], strict=True)
            if not weights_only:
                self.optimizer.load_state_dict(loaded["optimizer"])
                distributed_optimizer.steps_from_groups(self.optimizer)
                self.scheduler.load_state_dict(loaded["opt_param_scheduler"])
            self.discard_step()
        self._iteration = 0 if weights_only else int(loaded["iteration"])

    @property
    def step_is_redoable(self) -> bool:
        """Whether the last step that raised can simply be run again: true unless it failed
        after the optimizer had started to update the parameters."""
        return not self._update_started

    def discard_step(self) -> None:
        """Drops whatever a failed step left behind (its partial gradients), so that the
        next ``step()`` redoes the same iteration from a clean slate."""
        with cpu_mode(self._device):
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
        self._grad_sync_at = None
        self._local_grads = None

    def _finalize_grads(self, *args: Any, **kwargs: Any) -> Any:
        """Megatron's gradient all-reduce, with a note of when this rank reached it and the
        hook that fault injection uses to act inside it."""
        if self.keep_local_grads:
            self._local_grads = [buffer.grad_data.detach().clone() for buffer in self.model.buffers]
        if self.grad_sync_hook is not None:
            self.grad_sync_hook()
        self._grad_sync_at = time.perf_counter()
        return finalize_model_grads(*args, **kwargs)

    def partial_step(self) -> PartialStep | None:
        """After ``step()`` raised: the work of the failed step that can be reused, if it got
        as far as the gradient all-reduce and did not start the update."""
        if self._local_grads is None or self._update_started:
            return None
        return PartialStep(
            self._iteration + 1,
            self._dp,
            self.data_parallel_rank,
            [g.cpu() for g in self._local_grads],
            [entry.detach().cpu() for entry in self._step_losses],
            {name: list(pair) for name, pair in self._step_reports.items()},
        )

    def finish_step(self, partial: PartialStep) -> StepResult:
        """Completes the step ``partial`` was cut short in: its gradients go into this trainer's
        buffers, then the all-reduce, the update and the loss as in ``step()``. Only for the same
        iteration and the same data-parallel place (the same micro-batches); else ValueError."""
        if self._closed:
            raise RuntimeError("MegatronTrainer is closed")
        place = (self._iteration + 1, self._dp, self.data_parallel_rank)
        theirs = (partial.iteration, partial.data_parallel_size, partial.data_parallel_rank)
        if theirs != place:
            raise ValueError(f"partial step of (iteration, DP, DP rank) {theirs}, this trainer is at {place}")
        if len(partial.grads) != len(self.model.buffers):
            raise ValueError("partial step of another model")
        with cpu_mode(self._device):
            start = time.perf_counter()
            self._update_started = False
            self.model.zero_grad_buffer()
            self.optimizer.zero_grad()
            for buffer, grads in zip(self.model.buffers, partial.grads, strict=True):
                buffer.grad_data.copy_(grads)
            self._step_losses = list(partial.losses)
            self._step_reports = {name: list(pair) for name, pair in partial.reports.items()}
            self._finalize_grads([self.model])
            self._grad_sync_at = start  # nothing was computed again
            loss, tokens = self._update()
            seconds = time.perf_counter() - start
        return self._completed(loss, tokens, seconds, 0.0)

    def step(self) -> StepResult:
        if self._closed:
            raise RuntimeError("MegatronTrainer is closed")
        with cpu_mode(self._device):
            start = time.perf_counter()
            self._grad_sync_at = None
            self._update_started = False
            loss, tokens = self._train_step()
            end = time.perf_counter()
            seconds = end - start
            compute_seconds = (self._grad_sync_at or end) - start
        return self._completed(loss, tokens, seconds, compute_seconds)

    def _completed(self, loss: float, tokens: int, seconds: float, compute_seconds: float) -> StepResult:
        self._iteration += 1
        self._local_grads = None  # of a finished step: nothing left to reuse
        self._update_started = False
        update_ok, grad_norm = self._last_update
        return StepResult(
            iteration=self._iteration,
            loss=loss,
            seconds=seconds,
            tokens=tokens,
            flops=self.program.flops(tokens, self._replica_parameters),
            compute_seconds=compute_seconds,
            metrics=dict(self._metrics),
            learning_rate=self._learning_rate,
            grad_norm=float(grad_norm) if grad_norm else None,
            skipped=not update_ok,
        )

    def _train_step(self) -> tuple[float, int]:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._local_grads = None
        self._step_losses = []
        self._step_reports = {}
        self._forward_passes = 0
        self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self._data_iterator(),
            model=[self.model],
            num_microbatches=self._num_microbatches,
            seq_length=self._seq_length,
            micro_batch_size=self.training.micro_batch_size,
            forward_only=False,
        )
        return self._update()

    def _update(self) -> tuple[float, int]:
        # The loss's all-reduce comes before the update: a collective that fails after the
        # update has begun leaves a step that cannot be redone.
        loss, tokens = self._global_mean_loss(self._step_losses)
        self._learning_rate = float(self.optimizer.param_groups[0]["lr"])
        self._update_started = True
        update_ok, grad_norm, _ = self.optimizer.step()
        self._last_update = (update_ok, grad_norm)
        if update_ok:
            self.scheduler.step(increment=1)
        elif self.training.precision == "fp16":
            self._loss_scale_skip()
        else:
            raise RuntimeError(f"optimizer step {self._iteration + 1} skipped (non-finite grads)")
        return loss, tokens

    def _loss_scale_skip(self) -> None:
        """An fp16 step whose gradients overflowed: the loss scale was lowered and the update
        skipped, as Megatron-LM does (the iteration counts; the LR schedule waits). A skip at
        the smallest scale means the gradients overflow unscaled: no later step can do better,
        so it is the run's own error, not something a restart heals."""
        self._skipped_steps += 1
        scale = float(self.optimizer.get_loss_scale())
        parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        scalers = [part.grad_scaler for part in parts if getattr(part, "grad_scaler", None) is not None]
        minimum = max((float(getattr(scaler, "min_scale", 1.0)) for scaler in scalers), default=1.0)
        if scale <= minimum:
            raise ProgramError(
                f"fp16 loss scale collapsed: iteration {self._iteration + 1} overflowed with the loss scale at its"
                f" minimum ({minimum:g}) after {self._skipped_steps} skipped steps; train in bf16 or lower the"
                " learning rate"
            )

    def _first_sample(self) -> int:
        """The global index of this rank's first sample in the current iteration."""
        per_rank = self.training.global_batch_size // self._dp
        return self._iteration * self.training.global_batch_size + parallel_state.get_data_parallel_rank() * per_rank

    def _seed_micro_batch(self, micro_batch: int) -> None:
        """Seeds every generator a forward pass draws from (dropout's masks) from what the pass
        computes, not from which rank computes it or what it drew before: the job's seed, the
        iteration, the micro-batch's first global sample and the pipeline stage. A restarted
        rank, a reattempt and a job at another data-parallel degree then draw the same masks
        for the same samples. Megatron's split is kept: the default generators are common to a
        stage's tensor-parallel ranks, its tracker's model-parallel stream is per rank."""
        sample = self._first_sample() + micro_batch * self.training.micro_batch_size
        seed = keyed_seed(
            self.training.seed, self._iteration + 1, sample, int(parallel_state.get_pipeline_model_parallel_rank())
        )
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)

    def _data_iterator(self, dataset: Any = None, first: int | None = None) -> Iterator[Any]:
        """This rank's micro-batches of the current iteration (or of ``dataset`` from global
        sample ``first`` on)."""
        t = self.training
        dataset = self.dataset if dataset is None else dataset
        size = self._dataset_size if dataset is self.dataset else dataset_size(dataset)
        per_rank = t.global_batch_size // self._dp
        first = self._first_sample() if first is None else first
        for start in range(first, first + per_rank, t.micro_batch_size):
            # Past the data set's end the samples wrap around: another epoch, in the same order.
            samples = [dataset[g % size] for g in range(start, start + t.micro_batch_size)]
            yield collate(samples)

    def evaluate(self) -> float:
        """Collective: the mean loss over ``training.eval_iterations`` global batches of the
        program's validation data, the model in eval mode (no dropout, no gradients); the
        training state is left as it was."""
        if self._closed:
            raise RuntimeError("MegatronTrainer is closed")
        t = self.training
        with cpu_mode(self._device):
            if self._valid_dataset is None:
                self._valid_dataset = self.program.build_valid_dataset(t.eval_iterations * t.global_batch_size)
            saved = (self._step_losses, self._step_reports, self._forward_passes)
            losses: list[torch.Tensor] = []
            self.model.eval()
            try:
                with torch.no_grad():
                    for batch in range(t.eval_iterations):
                        self._step_losses, self._step_reports, self._forward_passes = [], {}, 0
                        first = batch * t.global_batch_size + self.data_parallel_rank * (
                            t.global_batch_size // self._dp
                        )
                        self._forward_backward(
                            forward_step_func=self._forward_step,
                            data_iterator=self._data_iterator(self._valid_dataset, first),
                            model=[self.model],
                            num_microbatches=self._num_microbatches,
                            seq_length=self._seq_length,
                            micro_batch_size=t.micro_batch_size,
                            forward_only=True,
                        )
                        losses.extend(self._step_losses)
                device = "cpu" if self._cpu else torch.cuda.current_device()
                totals = torch.zeros(2, dtype=torch.float64, device=device)
                for entry in losses:
                    totals += entry.to(totals)
                dist.all_reduce(totals)
            finally:
                self.model.train()
                self._step_losses, self._step_reports, self._forward_passes = saved
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan")

    def _forward_step(self, data_iterator: Iterator[Any], model: torch.nn.Module) -> tuple[torch.Tensor, Any]:
        # The schedule runs each stage's forward passes in micro-batch order (no interleaving),
        # so the count of this step's forward passes so far names the micro-batch.
        self._seed_micro_batch(self._forward_passes)
        self._forward_passes += 1
        output, loss_func = self.program.forward_step(data_iterator, model)
        if not callable(loss_func):
            raise ProgramError(
                f"forward_step must return (output_tensor, loss_func); its second value is a {type(loss_func).__name__}"
            )

        def recorded_loss(output_tensor: torch.Tensor) -> Any:
            result = loss_func(output_tensor)
            if isinstance(result, tuple) and len(result) == 2:
                # Megatron's older form, (mean loss, report): its tokens are the micro-batch's.
                loss, report = step_report.check_mean_loss(result)
                step_report.add(self._step_reports, report)
                tokens = float(self.training.micro_batch_size * self._seq_length)
                self._step_losses.append(
                    torch.stack([loss.detach().double() * tokens, loss.new_tensor(tokens).double()])
                )
                return result
            loss_sum, num_tokens, report = step_report.check_loss(result)
            step_report.add(self._step_reports, report)
            self._step_losses.append(torch.stack([loss_sum.detach().double(), num_tokens.detach().double()]))
            return loss_sum, num_tokens, report

        return output, recorded_loss

    def _global_mean_loss(self, losses: list[torch.Tensor]) -> tuple[float, int]:
        # Only last-stage ranks hold losses; TP peers hold identical copies. Summing (loss_sum,
        # tokens) over the whole world scales both by TP, so their ratio is the mean over the
        # global batch and every rank receives the same value. The third entry sums each rank's
        # parameter count (DP copies of every replica slice), for the FLOPs estimate.
        # The loss function's report pairs ride along (after the names are agreed once).
        device = "cpu" if self._cpu else torch.cuda.current_device()
        if self._report_names is None:
            self._report_names = step_report.agreed_names(self._step_reports)
        reports = step_report.pack(self._report_names, self._step_reports)
        totals = torch.tensor([0.0, 0.0, float(self._parameters), *reports], dtype=torch.float64, device=device)
        for entry in losses:
            totals[:2] += entry.to(totals)
        dist.all_reduce(totals)
        self._replica_parameters = float(totals[2]) / self._dp
        self._metrics = step_report.unpack(self._report_names, totals[3:].tolist())
        tokens = float(totals[1]) / self._tp
        return float(totals[0] / totals[1]) if totals[1] > 0 else float("nan"), round(tokens)

    def close(self) -> None:
        """Destroy Megatron's model-parallel state; the process group stays up."""
        if self._closed:
            return
        self._closed = True
        parallel_state.destroy_model_parallel()

    def release(self) -> None:
        """``close()`` and drop the model and optimizer, which hold Megatron's process groups:
        a gloo group closes its connections only when its last reference is gone, and until
        then a peer blocked in a collective with this rank stays blocked (until the timeout)
        even after ``dist.destroy_process_group()``. The configuration stays readable. The
        model and its config refer to each other (and to this trainer's methods), so the groups
        go with the next ``gc.collect()``."""
        self.close()
        del self.model, self.optimizer, self.scheduler


def _data_parallel(training: Training) -> int:
    """The DP degree of the current world under ``training``'s TP x PP; a ProgramError when the
    world or the batch does not split."""
    tp, pp = training.tensor_parallel, training.pipeline_parallel
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ProgramError(f"world size {world} is not divisible by tensor x pipeline = {tp * pp}")
    dp = world // (tp * pp)
    if training.global_batch_size % (training.micro_batch_size * dp):
        raise ProgramError(
            f"global_batch_size ({training.global_batch_size}) must be divisible by "
            f"micro_batch_size x data-parallel ({training.micro_batch_size} x {dp})"
        )
    return dp
