"""What one optimizer iteration of the Megatron-Core engine gives back: the finished step's
numbers (``StepResult``), or what a step that failed in its gradient all-reduce had computed
and a reattempt may reuse (``PartialStep``)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from unicron.trainer import step_report


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
    # The loss function's report dict over the whole global batch (step_report.py).
    metrics: dict[str, float] = field(default_factory=dict)
    learning_rate: float = 0.0  # of this iteration's update
    grad_norm: float | None = None  # before clipping; None where not computed
    skipped: bool = False  # fp16: the update was skipped for overflowing gradients


@dataclass(frozen=True)
class PartialStep:
    """What a step that failed in its gradient all-reduce had computed: this rank's local
    (not yet reduced) gradients of all its micro-batches and their losses. A rank that
    reattempts the step in a new group with the same data-parallel place applies them instead
    of recomputing the micro-batches (``MegatronTrainer.finish_step``)."""

    iteration: int
    data_parallel_size: int
    data_parallel_rank: int
    grads: list[torch.Tensor]
    losses: list[torch.Tensor]
    reports: step_report.Totals = field(default_factory=dict)
