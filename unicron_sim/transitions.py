"""Which transition a change is for a job, and what it costs: the fitted line of that action
(``timings.TransitionFit``: fixed + per byte of the rank's state + rendezvous over the world)
plus the training the job loses and must redo.

Which action. The coordinator keeps a rank in place through a reform where the new layout
gives it the same (tensor, pipeline) shard, and a rank that starts takes its shard from a
data-parallel peer that holds it (``services.coordinator.decide.kept_in_place``; a resized
model-parallel job's nodes keep their pipeline stages, ``decide.assignment_for``). So a job
restarts a rank from a live peer (``restart_peer``), drops ranks in place (``shrink``) and adds
ranks that fetch their state from a peer (``grow``) whenever every shard has a live holder:
any job with tensor and pipeline degree 1, and a model-parallel one whose data-parallel degree
is at least 2 (a lost node's shards live on in the other replicas; a shrink or a grow always
has one). A model-parallel job at data-parallel degree 1 that loses a rank restarts the classic
way, from its in-memory snapshot (``restart_snapshot``). ``model_parallel_reform=True`` prices
that case as a reform too (a design that replicates every shard), for comparison. A job the
plan starts again after a pause reloads its checkpoint (``checkpoint_restart``).

Lost work. A transition from memory (a reattempt, a peer, a shrink, a grow) redoes the
interrupted iteration: half an iteration on average. A snapshot restart loses what was
computed since the last snapshot, half the snapshot interval (``model.SNAPSHOT_EVERY``); a
checkpoint restart half the checkpoint interval (``JobModel.checkpoint_interval``, about 30
minutes). The iteration time is the job's at its size after the change.

Distributed-optimizer jobs (``JobModel.distributed_optimizer``) are priced by what each change
moves and where it comes from instead: the model slice from a peer, the optimizer shard from its
buddy's copy, the resharded ranges, or a snapshot or checkpoint fallback (``sharded``).
"""

from __future__ import annotations

from unicron_sim import sharded
from unicron_sim.model import GPUS_PER_NODE, SNAPSHOT_EVERY, JobModel
from unicron_sim.timings import TransitionFit

# The planner's transition kinds (services.planner.domain.Transition) plus the remedies and a
# paused job's start: what the strategies ask the price of.
KINDS = ("reattempt", "restart", "resize", "migrate", "start")


def action(job: JobModel, kind: str, gpus: int, model_parallel_reform: bool = False) -> str:
    """The fitted action (timings.ACTIONS) a change of ``kind`` is for ``job`` on ``gpus`` GPUs
    after it (module docstring)."""
    if kind == "reattempt":
        return "reattempt"
    if kind == "start":
        return "checkpoint_restart"
    if kind == "resize":
        return "shrink"
    if kind == "migrate":
        return "grow"
    if kind == "restart":
        replicated = gpus // (job.tensor * job.pipeline) >= 2
        whole = job.tensor == 1 and job.pipeline == 1
        return "restart_peer" if model_parallel_reform or whole or replicated else "restart_snapshot"
    raise ValueError(f"unknown transition kind {kind!r}; known: {', '.join(KINDS)}")


def lost_iterations(job: JobModel, fitted_action: str) -> float:
    """Iterations of training the action loses on average (module docstring)."""
    if fitted_action == "restart_snapshot":
        return SNAPSHOT_EVERY / 2.0
    if fitted_action == "checkpoint_restart":
        return job.checkpoint_interval / 2.0
    return 0.5


def seconds(
    job: JobModel,
    kind: str,
    gpus: int,
    fit: TransitionFit,
    model_parallel_reform: bool = False,
    before: int | None = None,
    source: str | None = None,
) -> float:
    """What a change of ``kind`` costs ``job``, which runs on ``gpus`` GPUs after it: the
    action's fitted time plus the work it loses. A distributed-optimizer job's is what the change
    moves from ``before`` GPUs (default: the same) with its lost shards from ``source`` (default:
    ``sharded.likely_source``)."""
    if gpus <= 0:
        return 0.0
    if job.distributed_optimizer:
        chosen_source = source if source is not None else sharded.likely_source(job, kind)
        if before is None:  # an estimate: a resize stands for a shrink by one replica
            before = gpus + (job.tensor * job.pipeline if kind == "resize" else 0)
        return sharded.seconds(job, kind, before, gpus, fit, chosen_source)
    chosen = action(job, kind, gpus, model_parallel_reform)
    world = gpus  # one rank per GPU
    moved = fit.seconds(chosen, job.state_bytes_per_rank(gpus), world)
    return moved + lost_iterations(job, chosen) * job.iteration_s(gpus)


def start_gpus(job: JobModel) -> int:
    return job.start_nodes * GPUS_PER_NODE
