"""Megatron-Core GPT training core: model, data, and one optimizer iteration per ``step()``.

The caller owns the process: it initializes ``torch.distributed`` (gloo on CPU, NCCL on CUDA)
before building a ``GPTTrainer`` and destroys the process group after ``close()``. On CUDA it
also picks this rank's GPU (``torch.cuda.set_device``) first. To move a rank to another process
group in the same process, ``release()`` the trainer (not just ``close()``), destroy the group,
join the new one and build a new ``GPTTrainer``; services/trainer/reform.py does that.

Data is synthetic: sample ``g`` is a function of ``(seed, g)`` only. Iteration ``i`` consumes
global samples ``[i*G, (i+1)*G)`` (``G`` = global batch size). Data-parallel rank ``r`` of ``D``
takes the contiguous block ``[i*G + r*G/D, i*G + (r+1)*G/D)`` and cuts it, in order, into
micro-batches. The set of samples in a step therefore does not depend on ``D``, and with the
loss averaged over the whole global batch the update is the same (up to float rounding) for
every DP degree, which is what lets a job be resized between steps without changing what it
learns.

Because of that, the whole training state of a rank is its (TP, PP) slice of the model, the
optimizer state of that slice and the iteration number: ``state_dict()`` / ``load_state_dict()``
move exactly that, and a state saved under one DP degree loads under any other (same TP/PP).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from services.trainer.megatron_cpu import cpu_mode, wants_cpu

# isort: split
# Megatron is imported after the shim so the shim's warning filters see its import-time warnings.
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

Batch = tuple[torch.Tensor, torch.Tensor]
LossOutput = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]


def _require_positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """GPT shape. ``ffn_hidden_size=None`` means Megatron's default of ``4 * hidden_size``."""

    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 32
    vocab_size: int = 128
    ffn_hidden_size: int | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            _require_positive(name, getattr(self, name))
        # Tokens are drawn from [0, vocab) and the arithmetic data needs at least two symbols.
        if self.vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2, got {self.vocab_size}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.ffn_hidden_size is not None:
            _require_positive("ffn_hidden_size", self.ffn_hidden_size)

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 1
    lr: float = 1e-3
    seed: int = 1234

    def __post_init__(self) -> None:
        _require_positive("global_batch_size", self.global_batch_size)
        _require_positive("micro_batch_size", self.micro_batch_size)
        _require_positive("lr", self.lr)
        if self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size ({self.global_batch_size}) must be divisible by "
                f"micro_batch_size ({self.micro_batch_size})"
            )


@dataclass(frozen=True)
class StepResult:
    iteration: int  # 1-based number of the iteration this result completes
    loss: float  # mean per-token loss over the whole global batch, identical on every rank
    seconds: float  # wall time of the step on this rank
    tokens: int  # tokens processed by the whole job in the step
    flops: float  # model FLOPs of the whole job in the step
    # This rank's time before it entered the gradient all-reduce: its own share of the step.
    # Peers of a slow rank wait inside the all-reduce, so a straggler shows here, not in seconds.
    compute_seconds: float = 0.0


def model_flops_per_iteration(model: ModelConfig, global_batch_size: int) -> float:
    """Forward+backward model FLOPs of one iteration (Megatron-LM paper, Narayanan et al. 2021).

    ``24*B*s*l*h^2 * (1 + s/(6h) + V/(16*l*h))``. The formula assumes ``ffn_hidden_size = 4h``
    and counts no activation recomputation; for other FFN sizes it is an approximation.
    """
    b, s = global_batch_size, model.seq_length
    n_layers, h, v = model.num_layers, model.hidden_size, model.vocab_size
    return 24.0 * b * s * n_layers * h * h * (1.0 + s / (6.0 * h) + v / (16.0 * n_layers * h))


def synthetic_sample(seed: int, index: int, model: ModelConfig) -> Batch:
    """(tokens, labels) of global sample ``index``: an arithmetic sequence modulo vocab.

    A random start and a stride drawn from {1, 2, 3} give structure a small model learns in a
    few dozen steps (after one token the continuation is one of three, after two it is fixed).
    """
    rng = np.random.default_rng([seed, index])
    start = int(rng.integers(model.vocab_size))
    stride = int(rng.integers(1, 4))
    seq = (start + stride * np.arange(model.seq_length + 1)) % model.vocab_size
    seq_t = torch.from_numpy(seq).to(torch.int64)
    return seq_t[:-1], seq_t[1:]


def _micro_batches(seed: int, model: ModelConfig, first: int, count: int, micro_batch_size: int) -> Iterator[Batch]:
    for mb_start in range(first, first + count, micro_batch_size):
        samples = [synthetic_sample(seed, g, model) for g in range(mb_start, mb_start + micro_batch_size)]
        tokens = torch.stack([t for t, _ in samples])
        labels = torch.stack([lbl for _, lbl in samples])
        yield tokens, labels


def _loss_func(output_tensor: torch.Tensor) -> LossOutput:
    # Returning (sum, num_tokens, ...) makes the schedule divide by tokens and by the number of
    # micro-batches before backward; DDP then scales grads by 1/DP and sums them. Together the
    # gradient is that of the mean per-token loss over the whole global batch.
    loss_sum = output_tensor.float().sum()
    num_tokens = torch.tensor(output_tensor.numel(), dtype=torch.int)
    report = torch.stack([loss_sum.detach().clone(), num_tokens.float()])
    return loss_sum, num_tokens, {"lm loss": report}


@dataclass(frozen=True)
class PartialStep:
    """What a step that failed in its gradient all-reduce had computed: this rank's local
    (not yet reduced) gradients of all its micro-batches and their losses. A rank that
    reattempts the step in a new group with the same data-parallel place applies them instead
    of recomputing the micro-batches (``GPTTrainer.finish_step``)."""

    iteration: int
    data_parallel_size: int
    data_parallel_rank: int
    grads: list[torch.Tensor]
    losses: list[dict[str, torch.Tensor]]


class GPTTrainer:
    """One Megatron-Core GPT replica slice (TP x PP) on this rank, trained with Megatron DDP."""

    def __init__(
        self,
        model: ModelConfig,
        train: TrainConfig,
        tensor_parallel: int = 1,
        pipeline_parallel: int = 1,
        device: str = "cpu",
        timeout: timedelta | None = None,
    ) -> None:
        """``timeout``: of the collectives in Megatron's model- and data-parallel groups (the
        gradient all-reduce runs in those); None keeps Megatron's default of 30 minutes. Pass
        the timeout the default process group was created with."""
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed must be initialized before GPTTrainer")
        if parallel_state.model_parallel_is_initialized():
            raise RuntimeError("Megatron parallel state is already initialized; close() first")
        self._cpu = wants_cpu(device)
        self._device = device
        self.model_config = model
        self.train_config = train
        self._dp = _check_layout(model, train, tensor_parallel, pipeline_parallel)
        self._num_microbatches = train.global_batch_size // (train.micro_batch_size * self._dp)
        self._tp = tensor_parallel
        self._pp = pipeline_parallel
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
        # in place) and micro-batch losses: what a failed all-reduce leaves to reuse. The copy
        # costs one more gradient buffer of memory.
        self.keep_local_grads = True
        self._local_grads: list[torch.Tensor] | None = None
        self._step_losses: list[dict[str, torch.Tensor]] = []
        with cpu_mode(device):
            self._build(tensor_parallel, pipeline_parallel)

    def _build(self, tp: int, pp: int) -> None:
        timeouts = {} if self._timeout is None else {"distributed_timeout_minutes": self._timeout.total_seconds() / 60}
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, **timeouts
        )
        torch.manual_seed(self.train_config.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(self.train_config.seed)
        config = self._transformer_config(tp, pp)
        gpt = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=self.model_config.vocab_size,
            max_sequence_length=self.model_config.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
            # Untied embeddings avoid the first/last-stage embedding all-reduce under PP.
            share_embeddings_and_output_weights=False,
        )
        if not self._cpu:
            gpt.cuda(torch.cuda.current_device())
        self.model = DistributedDataParallel(
            config=config,
            # average_in_collective=False (the default): each rank scales its grads by 1/DP
            # and the all-reduce sums them, i.e. grads are averaged over DP ranks.
            ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True),
            module=gpt,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=self.train_config.lr, weight_decay=0.0),
            [self.model],
        )
        # Without these hooks the schedule never triggers DDP's grad all-reduce.
        config.no_sync_func = self.model.no_sync
        config.finalize_model_grads_func = self._finalize_grads
        self._forward_backward = get_forward_backward_func()

    def _transformer_config(self, tp: int, pp: int) -> TransformerConfig:
        m = self.model_config
        return TransformerConfig(
            num_layers=m.num_layers,
            hidden_size=m.hidden_size,
            num_attention_heads=m.num_attention_heads,
            ffn_hidden_size=m.ffn_size,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            # Dropout would draw different masks for a sample depending on which rank holds
            # it, breaking the equality of updates across DP degrees.
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
            # Required on CPU. On CUDA too: every TP rank draws the full weight from the same
            # seed and keeps its slice, so the initial model does not depend on the TP degree.
            use_cpu_initialization=True,
            # The default ("full") is deprecated and warns on every config; [] means the same.
            cuda_graph_scope=[],
        )

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

    def state_dict(self) -> dict[str, Any]:
        """This rank's training state: its model slice, the optimizer state of that slice
        (Megatron's non-distributed optimizer: identical on every DP rank) and the number of
        completed iterations, which also fixes the data position. References, not copies."""
        return {
            "iteration": self._iteration,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state`` (as returned by ``state_dict()``, possibly under another DP
        degree). Parameters are copied in place, so Megatron's DDP buffers stay valid."""
        if self._closed:
            raise RuntimeError("GPTTrainer is closed")
        with cpu_mode(self._device):
            self.model.load_state_dict(state["model"], strict=True)
            self.optimizer.load_state_dict(state["optimizer"])
            self.discard_step()
        self._iteration = int(state["iteration"])

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
            [{k: v.detach().cpu() for k, v in entry.items()} for entry in self._step_losses],
        )

    def finish_step(self, partial: PartialStep) -> StepResult:
        """Completes the step ``partial`` was cut short in: its gradients go into this trainer's
        buffers, then the all-reduce, the update and the loss as in ``step()``. Only for the same
        iteration and the same data-parallel place (the same micro-batches); else ValueError."""
        if self._closed:
            raise RuntimeError("GPTTrainer is closed")
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
            self._finalize_grads([self.model])
            self._grad_sync_at = start  # nothing was computed again
            loss = self._update()
            seconds = time.perf_counter() - start
        return self._completed(loss, seconds, 0.0)

    def step(self) -> StepResult:
        if self._closed:
            raise RuntimeError("GPTTrainer is closed")
        with cpu_mode(self._device):
            start = time.perf_counter()
            self._grad_sync_at = None
            self._update_started = False
            loss = self._train_step()
            end = time.perf_counter()
            seconds = end - start
            compute_seconds = (self._grad_sync_at or end) - start
        return self._completed(loss, seconds, compute_seconds)

    def _completed(self, loss: float, seconds: float, compute_seconds: float) -> StepResult:
        self._iteration += 1
        self._local_grads = None  # of a finished step: nothing left to reuse
        self._update_started = False
        g = self.train_config.global_batch_size
        return StepResult(
            iteration=self._iteration,
            loss=loss,
            seconds=seconds,
            tokens=g * self.model_config.seq_length,
            flops=model_flops_per_iteration(self.model_config, g),
            compute_seconds=compute_seconds,
        )

    def _train_step(self) -> float:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        self._local_grads = None
        self._step_losses = []
        self._forward_backward(
            forward_step_func=self._forward_step,
            data_iterator=self._data_iterator(),
            model=[self.model],
            num_microbatches=self._num_microbatches,
            seq_length=self.model_config.seq_length,
            micro_batch_size=self.train_config.micro_batch_size,
            forward_only=False,
        )
        return self._update()

    def _update(self) -> float:
        # The loss's all-reduce comes before the update: a collective that fails after the
        # update has begun leaves a step that cannot be redone.
        loss = self._global_mean_loss(self._step_losses)
        self._update_started = True
        update_ok, _, _ = self.optimizer.step()
        if not update_ok:
            raise RuntimeError(f"optimizer step {self._iteration + 1} skipped (non-finite grads)")
        return loss

    def _data_iterator(self) -> Iterator[Batch]:
        t = self.train_config
        per_rank = t.global_batch_size // self._dp
        first = self._iteration * t.global_batch_size
        first += parallel_state.get_data_parallel_rank() * per_rank
        return _micro_batches(t.seed, self.model_config, first, per_rank, t.micro_batch_size)

    def _forward_step(
        self, data_iterator: Iterator[Batch], model: torch.nn.Module
    ) -> tuple[torch.Tensor, Callable[[torch.Tensor], LossOutput]]:
        tokens, labels = next(data_iterator)
        device = "cpu" if self._cpu else torch.cuda.current_device()
        tokens, labels = tokens.to(device), labels.to(device)
        position_ids = torch.arange(tokens.size(1), device=device).unsqueeze(0).expand_as(tokens)
        # attention_mask=None: the local attention builds its own causal mask.
        output = model(tokens, position_ids, None, labels=labels)
        return output, self._recorded_loss

    def _recorded_loss(self, output_tensor: torch.Tensor) -> LossOutput:
        """``_loss_func``, keeping each micro-batch's reported loss for this step."""
        loss, tokens, report = _loss_func(output_tensor)
        self._step_losses.append(report)
        return loss, tokens, report

    def _global_mean_loss(self, losses: list[dict[str, torch.Tensor]]) -> float:
        # Only last-stage ranks hold losses; TP peers hold identical copies. Summing
        # (loss_sum, tokens) over the whole world scales both by TP, so their ratio is the mean
        # over the global batch and every rank receives the same value.
        device = "cpu" if self._cpu else torch.cuda.current_device()
        totals = torch.zeros(2, dtype=torch.float64, device=device)
        for entry in losses:
            totals += entry["lm loss"].to(totals)
        dist.all_reduce(totals)
        return float(totals[0] / totals[1])

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
        del self.model, self.optimizer


def _check_layout(model: ModelConfig, train: TrainConfig, tp: int, pp: int) -> int:
    """Validate the TP x PP x DP layout against the world size; return the DP degree."""
    _require_positive("tensor_parallel", tp)
    _require_positive("pipeline_parallel", pp)
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not divisible by TP*PP = {tp * pp}")
    dp = world // (tp * pp)
    if train.global_batch_size % (train.micro_batch_size * dp):
        raise ValueError(
            f"global_batch_size ({train.global_batch_size}) must be divisible by "
            f"micro_batch_size*DP ({train.micro_batch_size}*{dp})"
        )
    for name, value in (
        ("num_attention_heads", model.num_attention_heads),
        ("vocab_size", model.vocab_size),
        ("ffn_hidden_size", model.ffn_size),
    ):
        if value % tp:
            raise ValueError(f"{name} ({value}) must be divisible by tensor_parallel ({tp})")
    if model.num_layers % pp:
        raise ValueError(f"num_layers ({model.num_layers}) must be divisible by pipeline_parallel ({pp})")
    return dp
