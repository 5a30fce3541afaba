"""What a job's throughput is when no profile gives it: estimated from the model's size
(``ThroughputEstimate``), or assumed per slot, and calibrated by what the job was measured to
achieve at the sizes it ran at (``modelled_flops``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from services.planner.fields import check_float, fail

# Throughput assumed per slot when a job has neither a profile nor an estimate: 100 TFLOP/s, a
# rough achieved bf16 rate on A100/H100-class GPUs. Only its ratio to other jobs' throughput
# matters, and only when such jobs compete for the same slots.
ESTIMATED_FLOPS_PER_SLOT = 1.0e14

# ThroughputEstimate defaults (see its docstring).
GPU_PEAK_FLOPS = 989e12  # H100 SXM, dense bf16
DEFAULT_MFU = 0.4
DEFAULT_DP_BANDWIDTH_BYTES_PER_S = 50e9  # 400 Gb/s network per GPU (InfiniBand NDR)
DEFAULT_EXPOSED_COMM = 0.5
GRADIENT_BYTES_PER_PARAMETER = 4.0  # fp32 gradients, as Megatron reduces them by default


@dataclass(frozen=True)
class ThroughputEstimate:
    """T(x) estimated from the model's size when no profile was measured.

    A step processes ``tokens_per_step`` tokens (global batch x sequence length) and costs
    6 x P x tokens FLOPs for P = ``parameters`` (forward 2, backward 4 per parameter per token;
    Kaplan et al. 2020, "Scaling laws", sec. 2.1). On x = TP x PP x DP GPUs:

        compute(x) = 6 P tokens / (x * gpu_peak_flops * mfu)
        comm(x)    = 2 (DP - 1) / DP * (4 P / (TP PP)) / dp_bandwidth_bytes_per_s
        T(x)       = 6 P tokens / (compute(x) + exposed_comm * comm(x))

    ``mfu`` (model FLOPs utilization, 0.4 by default) is what Megatron-style 3D parallelism
    reaches at scale (PaLM reports 46%, Megatron-LM 2021 about 40-50%). ``comm`` is a ring
    all-reduce of the fp32 gradients of one model-parallel shard (4 P / (TP PP) bytes) over each
    GPU's share of inter-node bandwidth (Patarasuk & Yuan 2009: a ring moves 2 (n-1)/n of the
    data per member); ``exposed_comm`` of it is not hidden behind the backward pass. The step time
    is c0 / DP + k (DP - 1) / DP, so T grows with DP while compute dominates (sublinearly: the
    exposed all-reduce is a floor) and shrinks monotonically when it does not, which is when
    adding data parallelism really does not pay."""

    parameters: float
    tokens_per_step: float
    gpu_peak_flops: float = GPU_PEAK_FLOPS
    mfu: float = DEFAULT_MFU
    dp_bandwidth_bytes_per_s: float = DEFAULT_DP_BANDWIDTH_BYTES_PER_S
    exposed_comm: float = DEFAULT_EXPOSED_COMM

    def __post_init__(self) -> None:
        for name in ("parameters", "tokens_per_step", "gpu_peak_flops", "mfu", "dp_bandwidth_bytes_per_s"):
            check_float("ThroughputEstimate", name, getattr(self, name), positive=True)
        check_float("ThroughputEstimate", "exposed_comm", self.exposed_comm)
        if self.mfu > 1:
            fail("ThroughputEstimate", "mfu", f"must be at most 1, got {self.mfu!r}")
        if self.exposed_comm > 1:
            fail("ThroughputEstimate", "exposed_comm", f"must be at most 1, got {self.exposed_comm!r}")

    @property
    def work(self) -> float:
        """FLOPs of one step."""
        return 6.0 * self.parameters * self.tokens_per_step

    def exposed_comm_seconds(self, tensor_parallel: int, pipeline_parallel: int, x: int) -> float:
        """Seconds of a step's gradient all-reduce not hidden behind the backward pass."""
        unit = tensor_parallel * pipeline_parallel
        dp = x // unit
        grad_bytes = GRADIENT_BYTES_PER_PARAMETER * self.parameters / unit
        return self.exposed_comm * 2.0 * (dp - 1) / dp * grad_bytes / self.dp_bandwidth_bytes_per_s

    def flops(self, tensor_parallel: int, pipeline_parallel: int, x: int, compute_x_seconds: float = 0.0) -> float:
        """Estimated achieved FLOP/s on ``x`` GPUs (x a multiple of TP x PP). With
        ``compute_x_seconds`` (a step's compute seconds times the GPUs it ran on, as measured)
        in place of the modelled GPU's."""
        compute_x = compute_x_seconds or self.work / (self.gpu_peak_flops * self.mfu)
        return self.work / (compute_x / x + self.exposed_comm_seconds(tensor_parallel, pipeline_parallel, x))


# A measurement leaves at least this share of its step to compute, however much of it the
# model's all-reduce would claim (a model of GPUs and InfiniBand may overrate the network).
MIN_COMPUTE_SHARE = 0.1


def modelled_flops(
    estimate: ThroughputEstimate | None,
    tensor_parallel: int,
    pipeline_parallel: int,
    x: int,
    measured: Mapping[int, float] | None = None,
) -> float:
    """T(x) without a profile: the measured FLOP/s at a size the job ran at. Elsewhere the
    estimate with its compute speed taken from the nearest measured size (the measured step
    less the model's exposed all-reduce there): the model's GPU may be far from what this
    job's ranks really compute at (a CPU, a small model), and that, more than the network,
    is what decides whether more ranks pay. Without an estimate, the per-slot assumption
    scaled to the nearest measurement."""
    if not measured:
        if estimate is not None:
            return estimate.flops(tensor_parallel, pipeline_parallel, x)
        return ESTIMATED_FLOPS_PER_SLOT * x
    if x in measured:
        return float(measured[x])
    nearest = min(measured, key=lambda size: (abs(size - x), size))
    if estimate is None:
        return float(measured[nearest]) * x / nearest
    step = estimate.work / float(measured[nearest])
    compute = max(
        step - estimate.exposed_comm_seconds(tensor_parallel, pipeline_parallel, nearest), MIN_COMPUTE_SHARE * step
    )
    return estimate.flops(tensor_parallel, pipeline_parallel, x, compute_x_seconds=compute * nearest)
