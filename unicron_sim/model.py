"""The modeled cluster: nodes of 8 GPUs, jobs with sizes, weights and throughput profiles.

Jobs. Every job is a Megatron-style GPT run with tensor parallelism 8 (one TP group fills one
node, as large-model runs place it), pipeline degree ``pipeline`` and a data-parallel degree
between ``min_dp`` and ``max_dp``; it starts at ``start_dp``. A data-parallel replica is
``pipeline`` whole nodes, so a job always holds whole nodes: ``pipeline * dp`` of them. Losing
one node costs a whole replica (the replica's other nodes idle until the plan changes). A job
runs only at data-parallel degrees that split its global batch evenly (micro-batch 1: Megatron
asserts global batch % (micro-batch x DP) == 0), so its sizes (``dps``) are the divisors of the
batch in [min_dp, max_dp], and its throughput profile lists only those: the planner offers a
job only its profile's sizes (``services.planner.domain.allowed_sizes``).

Every job is also a job a user could submit: ``JobModel.spec`` is its JobSpec, and building a
``JobModel`` runs it through ``unicron.jobspec.normalized``, the coordinator's own validation;
a job it refuses is an ``InvalidArgument``, before anything is simulated.

State. A rank holds its (tensor, pipeline) shard of the parameters and the optimizer state:
``parameters / (TP x PP) x b`` bytes, ``b`` from the job's precision and optimizer
(``jobspec.state_bytes_per_parameter``: 16 for fp32 Adam; 18 for bf16 Adam, whose bf16
parameters, fp32 gradients, fp32 main parameters and two moments take 2 + 4 + 4 + 8). Under
Megatron's distributed optimizer (``training.distributed_optimizer``) the main parameters and
moments are sharded over the data-parallel ranks too, so ``b`` depends on the size the job
runs at (``state_bytes_per_rank(gpus)``).

Throughput profile. T(x) for every allowed size comes from the planner's own estimate
(``services.planner.domain.ThroughputEstimate``: 6 x parameters x tokens per step, 40% MFU on
H100 bf16 peak, an exposed ring all-reduce of fp32 gradients), so it is sub-linear in the
data-parallel degree exactly as the planner assumes; parameters come from the model shape by
Megatron's formula (``gpt_parameters``). The profile is handed to the
planner as a measured profile (sizes -> FLOP/s), which also lists the sizes a job may take.

Workloads (``workload``): the 128-GPU cluster runs four jobs of 1.3B-13B parameters with
different weights; larger clusters run a mix of 405B-, 70B- and 8B-class jobs (Llama-3-like
shapes) sized in proportion to the cluster; the nodes the batch divisors leave over (about 6%)
are hot spares. Every large job can shrink to about three quarters of its replicas (the
divisors of its batch in that range), so a job that loses nodes keeps training smaller while
they are repaired; none grows above its start size, which is where a failure-free run keeps it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from services.planner.domain import ThroughputEstimate
from unicron import jobspec
from unicron.errors import InvalidArgument
from unicron.v1 import common_pb2 as pb

GPUS_PER_NODE = 8
TENSOR_PARALLEL = GPUS_PER_NODE
VOCAB = 128_256  # Llama 3's tokenizer
SEQ_LENGTH = 8_192
# Persistent checkpoints about every 30 minutes, as the checkpoint-restart baseline assumes
# (strategies.CheckpointSettings); each job's interval in iterations follows from its step time.
CHECKPOINT_INTERVAL_S = 1800.0
# In-memory snapshots every 2 iterations (the trainer's default; architecture.md, Healing).
SNAPSHOT_EVERY = 2
# Iterations a job is submitted for: any number; the simulation ends before it matters.
ITERATIONS = 1_000_000


def gpt_parameters(layers: int, hidden: int, vocab: int, seq_length: int) -> float:
    """GPT parameter count (attention and a 4h MLP per layer, layer norms, untied input and
    output embeddings, learned positions)."""
    return 12.0 * layers * hidden**2 + 13.0 * layers * hidden + (2 * vocab + seq_length) * hidden


def _require(ok: bool, name: str, problem: str) -> None:
    if not ok:
        raise InvalidArgument(name, problem)


@dataclass(frozen=True)
class JobModel:
    job_id: str
    weight: float
    layers: int
    hidden: int
    pipeline: int
    min_dp: int
    max_dp: int
    start_dp: int
    global_batch: int  # samples (of SEQ_LENGTH tokens) per step

    def __post_init__(self) -> None:
        where = f"job {self.job_id!r}"
        _require(bool(self.job_id), "job_id", "must not be empty")
        _require(self.weight > 0 and math.isfinite(self.weight), f"{where}.weight", "must be a finite number > 0")
        for name in ("layers", "hidden", "pipeline", "min_dp", "max_dp", "start_dp", "global_batch"):
            value = getattr(self, name)
            _require(isinstance(value, int) and value >= 1, f"{where}.{name}", "must be an int >= 1")
        _require(self.min_dp <= self.start_dp <= self.max_dp, f"{where}.start_dp", "must lie in [min_dp, max_dp]")
        for name in ("min_dp", "max_dp", "start_dp"):
            _require(
                self.global_batch % getattr(self, name) == 0,
                f"{where}.{name}",
                f"{getattr(self, name)} does not split the global batch {self.global_batch}",
            )
        jobspec.normalized(self.spec())  # the coordinator's validation of a submitted job

    @property
    def tensor(self) -> int:
        return TENSOR_PARALLEL

    @property
    def nodes_per_replica(self) -> int:
        return self.pipeline

    @property
    def start_nodes(self) -> int:
        return self.pipeline * self.start_dp

    @cached_property
    def parameters(self) -> float:
        return gpt_parameters(self.layers, self.hidden, VOCAB, SEQ_LENGTH)

    @cached_property
    def estimate(self) -> ThroughputEstimate:
        return ThroughputEstimate(parameters=self.parameters, tokens_per_step=float(self.global_batch * SEQ_LENGTH))

    @cached_property
    def dps(self) -> tuple[int, ...]:
        """The data-parallel degrees the job may run at: those in [min_dp, max_dp] that split
        the global batch."""
        return tuple(dp for dp in range(self.min_dp, self.max_dp + 1) if self.global_batch % dp == 0)

    @cached_property
    def profile(self) -> dict[int, float]:
        """Size in GPUs -> achieved FLOP/s, for every allowed size."""
        unit = self.tensor * self.pipeline
        return {unit * dp: self.estimate.flops(self.tensor, self.pipeline, unit * dp) for dp in self.dps}

    def flops(self, gpus: int) -> float:
        """T(x); 0 when x is 0. x must be an allowed size."""
        return self.profile[gpus] if gpus else 0.0

    def waf(self, gpus: int) -> float:
        """F(x) = w * T(x)."""
        return self.weight * self.flops(gpus)

    def best_size_within(self, nodes: int) -> int:
        """The largest allowed size (GPUs) that fits on ``nodes`` whole nodes; 0 if none."""
        dp = max((d for d in self.dps if d * self.pipeline <= nodes), default=0)
        return self.tensor * self.pipeline * dp

    def iteration_s(self, gpus: int) -> float:
        """Seconds per optimizer step at size x (the hang detector's scale)."""
        return 6.0 * self.parameters * self.global_batch * SEQ_LENGTH / self.flops(gpus)

    @cached_property
    def _training(self) -> pb.TrainingSpec:
        return self.spec().training

    def state_bytes_per_rank(self, gpus: int) -> float:
        """One rank's shard of the state at size ``gpus`` (module docstring: State)."""
        unit = self.tensor * self.pipeline
        per_parameter = jobspec.state_bytes_per_parameter(self._training, max(1, gpus // unit))
        return self.parameters * per_parameter / unit

    @cached_property
    def checkpoint_interval(self) -> int:
        """Iterations between persistent checkpoints: about CHECKPOINT_INTERVAL_S at the start size."""
        return max(1, round(CHECKPOINT_INTERVAL_S / self.iteration_s(self.start_nodes * GPUS_PER_NODE)))

    def spec(self) -> pb.JobSpec:
        """The job as a user would submit it: program, model size, parallelism, batch, weight and
        the throughput profile (which names the sizes it may run at)."""
        spec = pb.JobSpec(name=self.job_id, weight=self.weight, preemptible=True)
        spec.program.entry_point = "examples.gpt.train:main"
        spec.estimate.parameters = self.parameters
        spec.estimate.tokens_per_step = float(self.global_batch * SEQ_LENGTH)
        spec.parallelism.tensor = self.tensor
        spec.parallelism.pipeline = self.pipeline
        spec.parallelism.data = self.start_dp
        spec.parallelism.min_data = self.min_dp
        spec.parallelism.max_data = self.max_dp
        spec.training.iterations = ITERATIONS
        spec.training.global_batch_size = self.global_batch
        spec.training.micro_batch_size = 1
        spec.training.checkpoint_interval = self.checkpoint_interval
        for size, flops in self.profile.items():
            spec.throughput[size] = flops
        return spec


@dataclass(frozen=True)
class ClusterModel:
    """``nodes`` nodes of GPUS_PER_NODE GPUs; ``jobs`` start on consecutive nodes in order, the
    rest are spare."""

    nodes: int
    jobs: tuple[JobModel, ...]

    def __post_init__(self) -> None:
        _require(isinstance(self.nodes, int) and self.nodes >= 1, "nodes", "must be an int >= 1")
        _require(len(self.jobs) >= 1, "jobs", "needs at least one job")
        ids = [j.job_id for j in self.jobs]
        _require(len(set(ids)) == len(ids), "jobs", "job ids must be unique")
        used = sum(j.start_nodes for j in self.jobs)
        _require(used <= self.nodes, "jobs", f"start on {used} nodes, the cluster has {self.nodes}")
        object.__setattr__(self, "jobs", tuple(self.jobs))

    @property
    def gpus(self) -> int:
        return self.nodes * GPUS_PER_NODE

    def initial_placement(self) -> list[list[int]]:
        out, first = [], 0
        for job in self.jobs:
            out.append(list(range(first, first + job.start_nodes)))
            first += job.start_nodes
        return out

    def failure_free_waf(self) -> float:
        return sum(j.waf(j.start_nodes * GPUS_PER_NODE) for j in self.jobs)


# Model shapes (layers, hidden): Llama-3-like 405B, 70B, 8B, and 13B / 7B / 1.3B GPT shapes.
SHAPES: dict[str, tuple[int, int]] = {
    "405b": (126, 16_384),
    "70b": (80, 8_192),
    "8b": (32, 4_096),
    "13b": (40, 5_120),
    "7b": (32, 4_096),
    "1.3b": (24, 2_048),
}


def small_workload(nodes: int = 16) -> ClusterModel:
    """No spare: four jobs of different weight. At 16 nodes: a 13B job on 3 replicas of 2 nodes,
    two 7B jobs on 4 nodes each and a 1.3B job on 2; other node counts (16 to 255) scale every
    degree with the cluster. Each may shrink, none grows above its start size: a job that could
    would take the lighter jobs' nodes on arrival (the planner pauses the 1.3B job, weight 0.5,
    to grow the 7B ones), and every strategy must start alike. The batch, 240 x the scale, is
    split evenly by every degree the 16-node cluster allows (1-4) and by their multiples."""
    _require(16 <= nodes < 256, "nodes", "the small workload needs 16 to 255 nodes")
    s = nodes // 16

    def job(job_id: str, weight: float, shape: str, pp: int, lo: int, hi: int, start: int) -> JobModel:
        return JobModel(job_id, weight, *SHAPES[shape], pipeline=pp, min_dp=lo * s, max_dp=hi * s, start_dp=start * s,
                        global_batch=240 * s)  # fmt: skip

    jobs = (
        job("a-13b", 2.0, "13b", 2, 2, 3, 3),
        job("b-7b", 1.0, "7b", 1, 2, 4, 4),
        job("c-7b", 1.0, "7b", 1, 1, 4, 4),
        job("d-1b3", 0.5, "1.3b", 1, 1, 2, 2),
    )
    return ClusterModel(nodes, jobs)


# (shape, pipeline degree, weight, share of the nodes, global batch in sequences of SEQ_LENGTH).
# Batches are chosen for their divisors, so that each job has a few data-parallel degrees to
# shrink to: 2,520 sequences (20.6M tokens; Llama 3 405B ended at 16M) for the 405B and 8B
# shapes, 1,008 (8.3M tokens) for the 70B ones.
LARGE_MIX: tuple[tuple[str, int, float, float, int], ...] = (
    ("405b", 16, 2.0, 0.40, 2520),
    ("70b", 8, 1.5, 0.30, 1008),
    ("70b", 4, 1.0, 0.15, 1008),
    ("8b", 1, 0.5, 0.15, 2520),
)

# A large job may shrink to this fraction of its start replicas (the batch's divisors in between):
# a few sizes each, which keeps the planner's problem small. At the Llama 3 failure rate and a
# day's repair, a job of a few hundred nodes has about one node out at a time.
SHRINK_TO = 0.75


def large_workload(nodes: int, jobs: int) -> ClusterModel:
    """``jobs`` jobs (a multiple of len(LARGE_MIX) works best) over ``nodes`` nodes. Each mix
    entry's share of the nodes is split evenly between its copies; each job takes the largest
    data-parallel degree that splits its batch and fits its share, and what that leaves free is
    spare (about 6% of the nodes at 16k and 100k GPUs)."""
    _require(jobs >= len(LARGE_MIX), "jobs", f"must be at least {len(LARGE_MIX)}")
    copies = [jobs // len(LARGE_MIX) + (1 if i < jobs % len(LARGE_MIX) else 0) for i in range(len(LARGE_MIX))]
    out: list[JobModel] = []
    for (shape, pp, weight, share, batch), count in zip(LARGE_MIX, copies, strict=True):
        for _ in range(count):
            fits = max(1, int(nodes * share / count) // pp)
            dp = max(d for d in range(1, fits + 1) if batch % d == 0)
            low = math.ceil(dp * SHRINK_TO)
            out.append(
                JobModel(
                    job_id=f"{shape}-{len(out):02d}",
                    weight=weight,
                    layers=SHAPES[shape][0],
                    hidden=SHAPES[shape][1],
                    pipeline=pp,
                    min_dp=min(d for d in range(low, dp + 1) if batch % d == 0),
                    max_dp=dp,
                    start_dp=dp,
                    global_batch=batch,
                )
            )
    return ClusterModel(nodes, tuple(out))


def workload(gpus: int) -> ClusterModel:
    """The job mix for a cluster of ``gpus`` GPUs (a multiple of GPUS_PER_NODE)."""
    _require(gpus % GPUS_PER_NODE == 0 and gpus > 0, "gpus", f"must be a positive multiple of {GPUS_PER_NODE}")
    nodes = gpus // GPUS_PER_NODE
    _require(nodes >= 16, "gpus", f"must be at least {16 * GPUS_PER_NODE}")
    if nodes < 256:
        return small_workload(nodes)
    # Tens of jobs at scale, each many nodes.
    return large_workload(nodes, 16)
