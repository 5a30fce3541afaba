"""The recovery strategies compared, each a documented model over the same cluster and trace.

Every strategy sees the same failures; they differ in when a failure is noticed (detection),
how long the job is out (transition), what size it runs at afterwards (sub-healthy), and how
fast it trains when nothing fails (``factor``, relative to Megatron at the same size). A SEV1
kind (hardware: ECC, NVLink, invalid DMA mapping, GPU driver, node lost) takes its node out of
the cluster for the event's repair time in every strategy; the other kinds leave the node
healthy.

Numbers marked *assumption* are not from a publication or a measurement; they are stated so
that they can be challenged, and each is a setting.

unicron (this project; He et al., "Unicron", arXiv 2401.00134, SIGMOD'24 version)
    Detection in band: ``timings`` (bench/results/detection.json p50 per kind; a hang or a
    stuck NCCL collective at max(measured, 3 x the job's iteration time)). The remedy is the
    coordinator's severity ladder, called for every failure with the job's past remedies
    (``services.coordinator.ladder.choose``). Every transition costs what ``transitions`` says
    for the job's shape and size: the fitted line of the action the project takes for it
    (reattempt; restart from a peer or from the node's snapshot; shrink, grow, or a checkpoint
    restart) over the job's state per rank, the rendezvous of its world, and the work it loses;
    a distributed-optimizer job's by what it moves and from where (``sharded``: the slice from a
    peer, the shard from its buddy, the resharded ranges; a snapshot or the checkpoint when a
    rank and its buddy were lost together), its buddy copies charged on every iteration.
    A reconfigure isolates the node and re-plans *every* job with the real CP-SAT planner in
    process (``planning``), handed those same costs as its transition estimates; a repaired
    node's return re-plans too, and so does the jobs' arrival at the start (which the
    workloads are built to leave as they are: ``tests/unit/test_sim_measured.py``).
    An in-place remedy fails with probability ``remedy_failure`` (*assumption*: 10% of
    reattempts, 5% of restarts), the failure then recurring one iteration later, so the ladder
    escalates as it does in production. A job the ladder gives up on is resubmitted: requeue,
    setup and recompute as in checkpoint-restart.

unicron-alone (ablation: Unicron without cost-aware planning)
    Everything as unicron, except a reconfigure re-plans nothing: the hit job shrinks to the
    largest size its own surviving nodes hold (a resize) or waits,
    never takes another job's slots or a spare node, and grows back onto its node when it is
    repaired (a migrate: the node is new to it). Costs as unicron's.

megatron-cr (checkpoint-restart, Megatron-LM's default practice)
    The Unicron paper's account of today's recovery path (Sec. 2.3): a hang or a collective
    timeout (task hang, NCCL timeout, a lost node) is noticed only at the collective timeout,
    30 min in the paper (PyTorch's NCCL default is 10 min; Megatron jobs commonly raise it);
    any other failure kills the process and the supervisor sees it at its poll
    (detection.json's measured polling supervisor, about 4 s). Then the job is requeued (9 min),
    set up again (14 min) and recomputes what was lost since the last persistent checkpoint:
    half the checkpoint interval on average, 15 min for the paper's 30-min interval. About
    68 min for a hang. A lost node is replaced by a spare node when one is free; otherwise the
    job waits for the repair. No elasticity: the job always runs at its start size.

oobleck (Jang et al., "Oobleck", SOSP'23)
    Pipeline templates and f+1 replicas: after a node loss the job reinstantiates pipelines
    from the templates with the model state already replicated, so it keeps training on every
    surviving node (throughput in proportion to its nodes) after a reconfiguration of 90 s
    (*assumption*; the paper reports recovery in seconds to a few minutes); a repaired node
    rejoins with one more reconfiguration. Failures that do not remove a node restart the
    pipelines the same way. Detection has no hang monitoring: hangs and NCCL timeouts wait for
    the collective timeout, the rest is seen at the agent's poll.

varuna (Athlur et al., "Varuna", EuroSys'22)
    Job morphing: after a failure the job restarts from its last checkpoint in a new
    configuration on the nodes it has (no requeue, Varuna's manager stays up): setup (14 min)
    plus recompute (half of a 30-min checkpoint interval); it trains on every surviving node,
    in proportion to them; a repaired node is taken back by a planned morph (checkpoint, then
    setup: 14 min). Detection as oobleck.

bamboo (Thorpe et al., "Bamboo", NSDI'23)
    Redundant computation: each node also computes its pipeline neighbour's layers, so a lost
    node fails over to its neighbour in 30 s (*assumption*) and the job keeps training on the
    surviving nodes (in proportion to them); a repaired node rejoins with a 60 s
    reconfiguration (*assumption*). Failures that do not remove a node (software, network,
    hangs) are not covered by redundancy: restart from the last checkpoint, setup plus
    recompute, no requeue. Detection as oobleck.

Failure-free throughput of the elastic systems (``ElasticSettings``): 1.0 of Megatron's by
default, the same as Unicron's, so that what separates the strategies is what failures cost
them. Each plausibly trains slower than Megatron when nothing fails (Oobleck and Varuna lack
Megatron's tensor-parallel kernels and schedules; Bamboo computes its neighbour's layers
again), but no number for that was found that could be checked against its paper's own tables
here, so none is assumed; bench/sim.py reports how the comparison moves at 0.9 and 0.75.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.coordinator import ladder
from unicron.failures import TAXONOMY, kind_name
from unicron.v1 import common_pb2 as pb
from unicron_sim import sharded, transitions
from unicron_sim.engine import Incident, JobRun, Sim
from unicron_sim.model import GPUS_PER_NODE, JobModel
from unicron_sim.planning import Estimates, Move, Planner
from unicron_sim.timings import Timings
from unicron_sim.traces import FailureEvent, is_hardware

# Kinds where no process dies: only a timeout (or Unicron's iteration monitor) notices them.
HANG_KINDS = frozenset({pb.FAILURE_KIND_TASK_HANG, pb.FAILURE_KIND_COLLECTIVE_TIMEOUT})
# Kinds whose ranks are gone when reported (the ladder may not reattempt in place).
RANKS_GONE = frozenset({pb.FAILURE_KIND_PROCESS_EXIT, pb.FAILURE_KIND_NODE_LOST})


@dataclass(frozen=True)
class CheckpointSettings:
    """Today's recovery path (the Unicron paper, Sec. 2.3)."""

    collective_timeout_s: float = 1800.0
    requeue_s: float = 540.0
    setup_s: float = 840.0
    checkpoint_interval_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("collective_timeout_s", "requeue_s", "setup_s", "checkpoint_interval_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0")

    @property
    def recompute_s(self) -> float:
        """Work lost since the last checkpoint, on average half the interval."""
        return self.checkpoint_interval_s / 2.0

    @property
    def resubmit_s(self) -> float:
        return self.requeue_s + self.setup_s + self.recompute_s


@dataclass(frozen=True)
class UnicronSettings:
    ladder: ladder.LadderPolicy = field(default_factory=ladder.LadderPolicy)
    plan_time_limit_s: float = 1.0
    # Probability that an in-place remedy does not cure the failure (*assumption*).
    remedy_failure: Mapping[str, float] = field(default_factory=lambda: {"reattempt": 0.1, "restart": 0.05})
    group_nodes: bool = True
    # The planner is handed what the simulator charges for each transition (transitions);
    # False leaves the coordinator's own estimates in the request (decide.plan_request and
    # the planner's defaults), while the simulator still charges the fitted costs.
    fitted_estimates: bool = True
    # Price a model-parallel job's restart at data-parallel degree 1 (no peer holds the lost
    # shard) as a reform from a peer too, instead of the snapshot restart decide.kept_in_place
    # leaves it; see transitions.
    model_parallel_reform: bool = False
    # False sets a cap no plan reaches, which makes the planner skip its size-only DP hint.
    dp_hint: bool = True
    # A planner that finds no plan is asked again after this (the coordinator's backoff cap).
    replan_retry_s: float = 30.0
    # What the distributed-optimizer jobs' buddy copies cost each iteration (sharded).
    buddy: sharded.BuddySettings = field(default_factory=sharded.BuddySettings)

    def __post_init__(self) -> None:
        for name, p in self.remedy_failure.items():
            if not 0.0 <= p < 1.0:
                raise ValueError(f"remedy_failure[{name!r}] must lie in [0, 1)")
        if self.plan_time_limit_s <= 0:
            raise ValueError("plan_time_limit_s must be > 0")


def inband_detection_s(kind: int, job: JobRun, timings: Timings) -> float:
    """When Unicron notices a failure (module docstring)."""
    d = timings.detection_s
    iteration = job.model.iteration_s(job.model.start_nodes * GPUS_PER_NODE)
    if kind == pb.FAILURE_KIND_TASK_HANG:
        return max(d["hang"], timings.hang_k * iteration)
    if kind == pb.FAILURE_KIND_COLLECTIVE_TIMEOUT:
        return max(d["stuck-collective"], timings.hang_k * iteration)
    if kind == pb.FAILURE_KIND_NODE_LOST:
        return d["agent-loss"]
    if kind == pb.FAILURE_KIND_PROCESS_EXIT:
        return d["crash"]
    return d["exception"]


def timeout_detection_s(kind: int, timings: Timings, checkpoint: CheckpointSettings) -> float:
    """When a system without hang monitoring notices a failure: hangs and lost nodes at the
    collective timeout, the rest (the process dies) at the supervisor's poll."""
    if kind in HANG_KINDS or kind == pb.FAILURE_KIND_NODE_LOST:
        return checkpoint.collective_timeout_s
    return timings.detection_s["poll"]


def sev1_detection_bound_s(sim: Sim, timings: Timings) -> float:
    """The longest a SEV1 failure on a training job can wait to be noticed in band: the bound
    on the time between a node taken out and the re-plan it causes (runner's invariant)."""
    kinds = [int(k) for k in TAXONOMY if is_hardware(k)]
    return max((inband_detection_s(k, job, timings) for k in kinds for job in sim.jobs), default=0.0)


class _Base:
    name = ""
    factor = 1.0
    # Whether every node taken out must be followed by a re-plan (the runner checks it).
    replans_on_node_loss = False

    def __init__(self, timings: Timings, checkpoint: CheckpointSettings, seed: int = 0) -> None:
        self.timings = timings
        self.checkpoint = checkpoint
        self.rng = random.Random(f"unicron-sim-strategy:{seed}")
        self.home: list[int] = []  # node -> the job that started on it (-1: spare)

    def start(self, sim: Sim) -> None:
        self.home = list(sim.owner)

    def on_failure(self, sim: Sim, event: FailureEvent) -> None:
        raise NotImplementedError

    def on_repair(self, sim: Sim, node: int) -> None:
        return None

    def job_factor(self, job: JobModel, gpus: int) -> float:
        """The share of each iteration that trains (1: nothing but the step)."""
        return 1.0

    def _hit(self, sim: Sim, event: FailureEvent) -> tuple[JobRun, Incident] | None:
        """Takes a broken node out; the job hit and its incident, if a job trains there."""
        if is_hardware(event.kind):
            sim.take_out(event.node, event.repair_s)
        job = sim.job_on(event.node)
        if job is None:
            return None
        return job, sim.hit(job, kind_name(event.kind))  # type: ignore[arg-type]


class Unicron(_Base):
    name = "unicron"
    replans_on_node_loss = True

    def __init__(
        self,
        timings: Timings,
        checkpoint: CheckpointSettings,
        failure_rate_per_node_per_s: float,
        settings: UnicronSettings | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(timings, checkpoint, seed)
        self.settings = settings or UnicronSettings()
        self.rate = failure_rate_per_node_per_s
        self.planner: Planner | None = None

    def start(self, sim: Sim) -> None:
        super().start(sim)
        estimates = None
        if self.settings.fitted_estimates:
            kinds = ("restart", "resize", "migrate")
            estimates = {
                job.job_id: Estimates(*(self.cost(job, kind, job.start_nodes * GPUS_PER_NODE) for kind in kinds))
                for job in sim.cluster.jobs
            }
        self.planner = Planner(
            sim.cluster.jobs,
            self.rate,
            estimates,
            time_limit_s=self.settings.plan_time_limit_s,
            group_nodes=self.settings.group_nodes,
            dp_hint=self.settings.dp_hint,
        )
        self._arrive(sim)

    def job_factor(self, job: JobModel, gpus: int) -> float:
        return sharded.effective_share(job, gpus, self.settings.buddy)

    def cost(self, job: JobModel, kind: str, gpus: int, run: JobRun | None = None) -> float:
        """Seconds a change of ``kind`` costs ``job`` on ``gpus`` GPUs (``transitions``); with
        ``run``, from its size now and the memory its ranks lost since it last trained."""
        before = source = None
        if run is not None:
            before, source = run.gpus, sharded.shard_source(job, run.gpus, sharded.lost_memory(run))
        return transitions.seconds(
            job, kind, gpus, self.timings.fit, self.settings.model_parallel_reform, before, source
        )

    def move_cost(self, move: Move) -> float:
        """What the simulator charges for a planned change (the planner's estimate may differ)."""
        if move.kind == "pause" or not move.nodes:
            return 0.0
        kind = "start" if move.kind == "start" else (move.transition or "restart")
        return self.cost(move.job.model, kind, len(move.nodes) * GPUS_PER_NODE, move.job)

    def _arrive(self, sim: Sim) -> None:
        """The jobs' arrival: the coordinator plans them, all pending on an empty cluster,
        before they run (free of charge). The workloads are built so that this keeps every
        job at its start size; should it not, Unicron runs where its planner put the jobs."""
        assert self.planner is not None
        before = [list(job.nodes) for job in sim.jobs]
        for job in sim.jobs:
            sim.place(job, [])
        moves = self.planner.plan(sim)
        if moves is None:  # no plan: they run where they were submitted
            for job, nodes in zip(sim.jobs, before, strict=True):
                sim.place(job, nodes)
            return
        for move in moves:
            sim.place(move.job, move.nodes)
        for job, nodes in zip(sim.jobs, before, strict=True):
            if len(job.nodes) != len(nodes):
                sim.count("sized differently on arrival")

    def on_failure(self, sim: Sim, event: FailureEvent) -> None:
        hit = self._hit(sim, event)
        if hit is None:
            if is_hardware(event.kind):
                self._reconfigured(sim)  # capacity changed; the coordinator re-plans on a lost node
            return
        job, incident = hit
        if is_hardware(event.kind):
            sharded.note_lost(job, event.node, alive=False)
        sim.at(sim.now + inband_detection_s(event.kind, job, self.timings), self._decide, sim, job, incident, event)

    def _decide(self, sim: Sim, job: JobRun, incident: Incident, event: FailureEvent) -> None:
        sim.detected(incident)
        policy = self.settings.ladder
        job.remedies = [a for a in job.remedies if sim.now - a.started.ToNanoseconds() / 1e9 <= policy.window_s]
        decision = ladder.choose(
            event.kind,
            job.remedies,
            sim.now,
            policy,
            ranks_alive=event.kind not in RANKS_GONE,
            placement_ready=all(not sim.down[n] for n in job.nodes),
        )
        if decision.remedy is None:
            # The coordinator fails the job; its owner resubmits it (checkpoint-restart path).
            sim.count("jobs failed by the ladder")
            incident.remedy = "fail"
            job.remedies = []
            if any(sim.down[n] for n in job.nodes):
                self._reconfigured(sim)
            sim.resume_at(job, sim.now + self.checkpoint.resubmit_s)
            return
        attempt = pb.RemedyAttempt(remedy=decision.remedy)  # type: ignore[arg-type]
        attempt.started.FromNanoseconds(int(sim.now * 1e9))
        job.remedies.append(attempt)
        name = ladder.remedy_name(decision.remedy)
        incident.remedy = name
        sim.count(f"remedy {name}")
        if decision.remedy in (pb.REMEDY_REATTEMPT, pb.REMEDY_RESTART):
            if decision.remedy == pb.REMEDY_RESTART:
                sharded.note_lost(job, event.node, alive=True)  # its processes restart; the node lives
                self._count_source(sim, job)
            seconds = self.cost(job.model, name, job.gpus, job)
            sim.resume_at(job, sim.now + seconds)
            if self.rng.random() < self.settings.remedy_failure.get(name, 0.0):
                iteration = job.model.iteration_s(job.model.start_nodes * GPUS_PER_NODE)
                sim.at(sim.now + seconds + iteration, self._recur, sim, job, event)
            return
        sim.take_out(event.node, event.repair_s)  # isolate (a no-op for a node already out)
        self._reconfigured(sim)

    def _recur(self, sim: Sim, job: JobRun, event: FailureEvent) -> None:
        """The remedy did not cure it: the same failure again, where the job still trains."""
        if sim.owner[event.node] == job.index and not sim.down[event.node]:
            sim.count("remedies that failed")
            self.on_failure(sim, FailureEvent(sim.now, event.node, event.kind, event.repair_s))

    def on_repair(self, sim: Sim, node: int) -> None:
        self._reconfigured(sim)

    def _reconfigured(self, sim: Sim) -> None:
        """Re-plans every job (the coordinator's _replan)."""
        assert self.planner is not None
        moves = self.planner.plan(sim)
        if moves is None:
            sim.count("re-plans without a plan")
            sim.at(sim.now + self.settings.replan_retry_s, self._reconfigured, sim)
            return
        for move in moves:
            sim.count(f"plan {move.kind} {move.transition}".strip())
            if move.nodes and move.kind != "start":
                self._count_source(sim, move.job)
            sim.change(move.job, move.nodes, self.move_cost(move))

    def _count_source(self, sim: Sim, job: JobRun) -> None:
        """Counts where a distributed-optimizer job's lost shards come from (``sharded``)."""
        lost = sharded.lost_memory(job)
        if job.model.distributed_optimizer and lost:
            sim.count(f"shards from {sharded.shard_source(job.model, job.gpus, lost)}")


class UnicronAlone(Unicron):
    name = "unicron-alone"
    replans_on_node_loss = False  # the ablation: no cluster re-plan

    def _arrive(self, sim: Sim) -> None:
        return None  # it plans nothing: the jobs stay where they were submitted

    def _reconfigured(self, sim: Sim) -> None:
        """No cluster re-plan: every job with a node out shrinks onto its own healthy nodes."""
        for job in sim.jobs:
            if any(sim.down[n] for n in job.nodes):
                self._shrink(sim, job)

    def _shrink(self, sim: Sim, job: JobRun) -> None:
        alive = [n for n in job.nodes if not sim.down[n]]
        size = job.model.best_size_within(len(alive))
        nodes = alive[: size // GPUS_PER_NODE]
        sim.count("shrink" if nodes else "wait for repair")
        sim.change(job, nodes, self.cost(job.model, "resize", size, job) if nodes else 0.0)

    def on_repair(self, sim: Sim, node: int) -> None:
        index = self.home[node]
        if index < 0 or sim.owner[node] >= 0:
            return
        job = sim.jobs[index]
        own = [n for n in range(sim.cluster.nodes) if self.home[n] == index and not sim.down[n]]
        size = job.model.best_size_within(len(own))
        if size <= job.gpus:
            return
        extra = [n for n in own if n not in job.nodes and sim.owner[n] < 0]
        nodes = sorted(job.nodes + extra[: size // GPUS_PER_NODE - len(job.nodes)])
        kind = "migrate" if any(n not in job.nodes for n in nodes) else "resize"
        sim.count("grow back")
        sim.change(job, nodes, self.cost(job.model, kind, size, job))


class CheckpointRestart(_Base):
    name = "megatron-cr"

    def on_failure(self, sim: Sim, event: FailureEvent) -> None:
        hit = self._hit(sim, event)
        if hit is None:
            return
        job, incident = hit
        delay = timeout_detection_s(event.kind, self.timings, self.checkpoint)
        sim.at(sim.now + delay, self._restart, sim, job, incident)

    def _restart(self, sim: Sim, job: JobRun, incident: Incident) -> None:
        sim.detected(incident)
        job.extra["waiting"] = True
        self._try_start(sim, job)

    def _try_start(self, sim: Sim, job: JobRun) -> None:
        """Replaces the job's nodes that are out by free spares; restarts it when it has all."""
        broken = [n for n in job.nodes if sim.down[n]]
        spares = sim.free_nodes()[: len(broken)]
        if len(spares) < len(broken):
            sim.wait(job)
            return
        nodes = sorted([n for n in job.nodes if not sim.down[n]] + spares)
        sim.assign(job, nodes)
        job.extra["waiting"] = False
        sim.resume_at(job, sim.now + self.checkpoint.resubmit_s)

    def on_repair(self, sim: Sim, node: int) -> None:
        for job in sim.jobs:
            if job.extra.get("waiting"):
                self._try_start(sim, job)


class _Elastic(_Base):
    """Strategies that train on every surviving node, in proportion to the nodes they have
    (oobleck, varuna, bamboo): F(start size) x nodes / start nodes."""

    def _scale(self, sim: Sim, job: JobRun, nodes: list[int]) -> None:
        full = job.model.waf(job.model.start_nodes * GPUS_PER_NODE)
        sim.set_rate_scale(job, full * len(nodes) / job.model.start_nodes)

    def on_failure(self, sim: Sim, event: FailureEvent) -> None:
        hit = self._hit(sim, event)
        if hit is None:
            return
        job, incident = hit
        delay = timeout_detection_s(event.kind, self.timings, self.checkpoint)
        sim.at(sim.now + delay, self._recover, sim, job, incident, event)

    def _recover(self, sim: Sim, job: JobRun, incident: Incident, event: FailureEvent) -> None:
        sim.detected(incident)
        nodes = [n for n in job.nodes if not sim.down[n]]
        sim.assign(job, nodes)
        self._scale(sim, job, nodes)
        sim.resume_at(job, sim.now + self.recovery_s(event))

    def on_repair(self, sim: Sim, node: int) -> None:
        index = self.home[node]
        if index < 0 or sim.owner[node] >= 0:
            return
        job = sim.jobs[index]
        nodes = sorted([*job.nodes, node])
        self._scale(sim, job, nodes)
        sim.change(job, nodes, self.rejoin_s())

    def recovery_s(self, event: FailureEvent) -> float:
        raise NotImplementedError

    def rejoin_s(self) -> float:
        raise NotImplementedError


@dataclass(frozen=True)
class ElasticSettings:
    """Failure-free throughput relative to Megatron's (module docstring: 1.0 unless a number
    can be sourced) and the recovery times assumed."""

    oobleck_factor: float = 1.0
    oobleck_reconfigure_s: float = 90.0
    varuna_factor: float = 1.0
    bamboo_factor: float = 1.0
    bamboo_failover_s: float = 30.0
    bamboo_rejoin_s: float = 60.0

    def __post_init__(self) -> None:
        for name in ("oobleck_factor", "varuna_factor", "bamboo_factor"):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must lie in (0, 1]")

    @classmethod
    def uniform(cls, factor: float | None) -> ElasticSettings:
        """Every elastic system at ``factor`` of Megatron's failure-free throughput (None: 1.0)."""
        if factor is None:
            return cls()
        return cls(oobleck_factor=factor, varuna_factor=factor, bamboo_factor=factor)


class Oobleck(_Elastic):
    name = "oobleck"

    def __init__(self, timings: Timings, checkpoint: CheckpointSettings, settings: ElasticSettings, seed: int = 0):
        super().__init__(timings, checkpoint, seed)
        self.settings = settings
        self.factor = settings.oobleck_factor

    def recovery_s(self, event: FailureEvent) -> float:
        return self.settings.oobleck_reconfigure_s

    def rejoin_s(self) -> float:
        return self.settings.oobleck_reconfigure_s


class Varuna(_Elastic):
    name = "varuna"

    def __init__(self, timings: Timings, checkpoint: CheckpointSettings, settings: ElasticSettings, seed: int = 0):
        super().__init__(timings, checkpoint, seed)
        self.factor = settings.varuna_factor

    def recovery_s(self, event: FailureEvent) -> float:
        return self.checkpoint.setup_s + self.checkpoint.recompute_s

    def rejoin_s(self) -> float:
        return self.checkpoint.setup_s


class Bamboo(_Elastic):
    name = "bamboo"

    def __init__(self, timings: Timings, checkpoint: CheckpointSettings, settings: ElasticSettings, seed: int = 0):
        super().__init__(timings, checkpoint, seed)
        self.settings = settings
        self.factor = settings.bamboo_factor

    def recovery_s(self, event: FailureEvent) -> float:
        if is_hardware(event.kind):
            return self.settings.bamboo_failover_s
        return self.checkpoint.setup_s + self.checkpoint.recompute_s

    def rejoin_s(self) -> float:
        return self.settings.bamboo_rejoin_s


STRATEGIES = ("unicron", "megatron-cr", "oobleck", "varuna", "bamboo", "unicron-alone")
ELASTIC = ("oobleck", "varuna", "bamboo")


@dataclass(frozen=True)
class StrategyConfig:
    """Everything the strategies take besides the cluster and the trace."""

    timings: Timings
    failure_rate_per_node_per_s: float
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    unicron: UnicronSettings = field(default_factory=UnicronSettings)
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    seed: int = 0


def make(name: str, config: StrategyConfig) -> _Base:
    """A fresh strategy by name (one per simulation: strategies hold per-run state)."""
    builders: dict[str, Callable[[], _Base]] = {
        "unicron": lambda: Unicron(
            config.timings, config.checkpoint, config.failure_rate_per_node_per_s, config.unicron, config.seed
        ),
        "unicron-alone": lambda: UnicronAlone(
            config.timings, config.checkpoint, config.failure_rate_per_node_per_s, config.unicron, config.seed
        ),
        "megatron-cr": lambda: CheckpointRestart(config.timings, config.checkpoint, config.seed),
        "oobleck": lambda: Oobleck(config.timings, config.checkpoint, config.elastic, config.seed),
        "varuna": lambda: Varuna(config.timings, config.checkpoint, config.elastic, config.seed),
        "bamboo": lambda: Bamboo(config.timings, config.checkpoint, config.elastic, config.seed),
    }
    if name not in builders:
        raise ValueError(f"unknown strategy {name!r}; known: {', '.join(STRATEGIES)}")
    return builders[name]()
