"""The runtime's training settings (``Training``) as Megatron-Core's own objects: the DDP and
optimizer configs and the LR scheduler, built the way Megatron-LM's ``pretrain()`` builds them
from its flags, and the RNG states a state copy carries (the seeds of a forward pass's
random draws are ``randomness.keyed_seed``).

Import after ``unicron.trainer.megatron_cpu`` (the engine does), so the shim's warning filters
see Megatron's import-time warnings."""

from __future__ import annotations

from typing import Any

import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from unicron.trainer.program import Training


def ddp_config(t: Training) -> DistributedDataParallelConfig:
    # Gradients are reduced in fp32 at every precision (Megatron-LM's
    # --accumulate-allreduce-grads-in-fp32). average_in_collective=False (the default): each
    # rank scales its grads by 1/DP and the all-reduce sums them.
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=t.overlap_grad_reduce,
        use_distributed_optimizer=t.distributed_optimizer,
    )


def optimizer_config(t: Training, params_dtype: torch.dtype) -> OptimizerConfig:
    """Megatron's optimizer config: bf16 and fp16 build its mixed-precision optimizer, which
    keeps fp32 main parameters (fp16 with Megatron's dynamic loss scale)."""
    return OptimizerConfig(
        optimizer=t.optimizer,
        lr=t.learning_rate,
        min_lr=t.min_learning_rate,
        weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1,
        adam_beta2=t.adam_beta2,
        adam_eps=t.adam_eps,
        sgd_momentum=t.sgd_momentum,
        clip_grad=t.clip_grad,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=params_dtype,
        use_distributed_optimizer=t.distributed_optimizer,
    )


def param_scheduler(optimizer: Any, t: Training) -> OptimizerParamScheduler:
    """The LR (and weight decay) schedule; the decay spans ``lr_decay_iterations`` (0: the
    job's iterations), warm-up included, as Megatron-LM's lr_decay_iters."""
    decay = max(1, t.lr_decay_iterations or t.iterations)
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if t.lr_warmup_iterations else t.learning_rate,
        max_lr=t.learning_rate,
        min_lr=t.min_learning_rate,
        lr_warmup_steps=t.lr_warmup_iterations,
        lr_decay_steps=decay,
        lr_decay_style=t.lr_decay_style,
        start_wd=t.weight_decay,
        end_wd=t.weight_decay,
        wd_incr_steps=decay,
        wd_incr_style="constant",
        wsd_decay_steps=t.lr_wsd_decay_iterations or None,
        lr_wsd_decay_style=t.lr_wsd_decay_style,
    )


def rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state()
    states["tracker"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    torch.set_rng_state(states["torch"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])
    if states.get("tracker"):
        tensor_parallel.get_cuda_rng_tracker().set_states(states["tracker"])
