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

Distributed-optimizer jobs (``distributed_optimizer=True``, as LLM teams train: bf16, Megatron's
distributed optimizer) split that state in two, because the two halves heal from different
places: the *model slice* (``slice_bytes_per_rank``: the bf16 parameters of the rank's (tensor,
pipeline) position, 2 bytes each, the same on every data-parallel rank, so a lost rank takes it
from any live peer) and the *optimizer shard* (``shard_bytes_per_rank``: fp32 main parameters
and Adam's two moments, 12 bytes per parameter over the data-parallel degree, on this rank
alone). The fp32 gradients (4 bytes) are recomputed, never moved. ``replication`` is the job
spec's (``training.replication``): 0 or 2 keeps a buddy copy of every shard in the host memory
of a data-parallel peer on another node (``unicron/trainer/buddy.py``); 1 keeps none. What a
transition moves and what the copies cost: ``sharded``.

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
# A distributed-optimizer job's state per parameter of its slice (module docstring: State):
# bf16 parameters, replicated over data parallelism; fp32 main parameter and Adam's two fp32
# moments, sharded over it (jobspec.state_bytes_per_parameter: 2 + 4 + 12 / DP, the 4 being the
# fp32 gradients, recomputed rather than moved).
SLICE_BYTES_PER_PARAMETER = 2
SHARD_BYTES_PER_PARAMETER = 12


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
    # bf16 with Megatron's distributed optimizer (module docstring: State); replication as the
    # spec's training.replication (0: the default, 2 under the distributed optimizer).
    distributed_optimizer: bool = False
    replication: int = 0
    checkpoint_every_s: float = CHECKPOINT_INTERVAL_S

    def __post_init__(self) -> None:
        where = f"job {self.job_id!r}"
        _require(
            self.checkpoint_every_s > 0 and math.isfinite(self.checkpoint_every_s),
            f"{where}.checkpoint_every_s",
            "must be a finite number > 0",
        )
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

    def data_parallel(self, gpus: int) -> int:
        return max(1, gpus // (self.tensor * self.pipeline))

    @property
    def slice_bytes_per_rank(self) -> float:
        """A distributed-optimizer rank's model slice: the bf16 parameters every data-parallel
        peer also holds (module docstring: State)."""
        return self.parameters / (self.tensor * self.pipeline) * SLICE_BYTES_PER_PARAMETER

    def shard_bytes_per_rank(self, gpus: int) -> float:
        """A distributed-optimizer rank's optimizer shard at size ``gpus``: held by it alone (and
        by its buddy's copy)."""
        return self.parameters / (self.tensor * self.pipeline) * SHARD_BYTES_PER_PARAMETER / self.data_parallel(gpus)

    @property
    def buddy_copies(self) -> bool:
        """Whether every optimizer shard has a buddy copy on another node (spec's replication)."""
        return self.distributed_optimizer and self.replication != 1

    @cached_property
    def checkpoint_interval(self) -> int:
        """Iterations between persistent checkpoints: about ``checkpoint_every_s`` at the start size."""
        return max(1, round(self.checkpoint_every_s / self.iteration_s(self.start_nodes * GPUS_PER_NODE)))

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
        if self.distributed_optimizer:
            spec.training.precision = "bf16"
            spec.training.distributed_optimizer = True
        spec.training.replication = self.replication
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


def large_workload(nodes: int, jobs: int, distributed_optimizer: bool = False, replication: int = 0) -> ClusterModel:
    """``jobs`` jobs (a multiple of len(LARGE_MIX) works best) over ``nodes`` nodes. Each mix
    entry's share of the nodes is split evenly between its copies; each job takes the largest
    data-parallel degree that splits its batch and fits its share, and what that leaves free is
    spare (about 6% of the nodes at 16k and 100k GPUs). ``distributed_optimizer`` and
    ``replication``: every job's (module docstring: State)."""
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
                    distributed_optimizer=distributed_optimizer,
                    replication=replication,
                )
            )
    return ClusterModel(nodes, tuple(out))


def workload(gpus: int, distributed_optimizer: bool = False, replication: int = 0) -> ClusterModel:
    """The job mix for a cluster of ``gpus`` GPUs (a multiple of GPUS_PER_NODE); at 256 nodes and
    more, its jobs run ``distributed_optimizer`` with ``replication`` (the small mix keeps a
    replicated optimizer: its tests and targets are about the ladder and the planner)."""
    _require(gpus % GPUS_PER_NODE == 0 and gpus > 0, "gpus", f"must be a positive multiple of {GPUS_PER_NODE}")
    nodes = gpus // GPUS_PER_NODE
    _require(nodes >= 16, "gpus", f"must be at least {16 * GPUS_PER_NODE}")
    if nodes < 256:
        return small_workload(nodes)
    # Tens of jobs at scale, each many nodes.
    return large_workload(nodes, 16, distributed_optimizer, replication)
