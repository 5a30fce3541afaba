"""Which transition a change is for a job, and what it costs: the fitted line of that action
(``timings.TransitionFit``: fixed + per byte of the rank's state + rendezvous over the world)
plus the training the job loses and must redo.

Which action. The coordinator keeps ranks in place through a reform only for whole-model ranks
(tensor and pipeline degree 1: ``services.coordinator.decide.kept_in_place``). Such a job
restarts a rank from a live peer (``restart_peer``), drops ranks in place (``shrink``) and adds
ranks that fetch their state from a peer (``grow``). Any other job restarts the classic way on
every change, from the nearest state every rank has (architecture.md, Healing): on the same
nodes, its in-memory snapshot (``restart_snapshot``); when it shrinks with pipeline degree 1,
also its snapshot (each node keeps its tensor shard); when it shrinks with pipeline stages
(its nodes' stages move when the data-parallel degree changes: Megatron orders ranks with the
pipeline outermost) or gains a node (which holds no snapshot), the newest checkpoint
(``checkpoint_restart``). ``model_parallel_reform=True`` prices every job as if the coordinator
kept tensor- and pipeline-parallel ranks in place too (the paper's design), for comparison.
A job the plan starts again after a pause reloads its checkpoint.

Lost work. A transition from memory (a reattempt, a peer, a shrink, a grow) redoes the
interrupted iteration: half an iteration on average. A snapshot restart loses what was
computed since the last snapshot, half the snapshot interval (``model.SNAPSHOT_EVERY``); a
checkpoint restart half the checkpoint interval (``JobModel.checkpoint_interval``, about 30
minutes). The iteration time is the job's at its size after the change.
"""

from __future__ import annotations

from unicron_sim.model import GPUS_PER_NODE, SNAPSHOT_EVERY, JobModel
from unicron_sim.timings import TransitionFit

# The planner's transition kinds (services.planner.domain.Transition) plus the remedies and a
# paused job's start: what the strategies ask the price of.
KINDS = ("reattempt", "restart", "resize", "migrate", "start")


def action(job: JobModel, kind: str, model_parallel_reform: bool = False) -> str:
    """The fitted action (timings.ACTIONS) a change of ``kind`` is for ``job`` (module docstring)."""
    if kind == "reattempt":
        return "reattempt"
    if kind == "start":
        return "checkpoint_restart"
    in_place = model_parallel_reform or (job.tensor == 1 and job.pipeline == 1)
    if kind == "restart":
        return "restart_peer" if in_place else "restart_snapshot"
    if kind == "resize":
        if in_place:
            return "shrink"
        return "restart_snapshot" if job.pipeline == 1 else "checkpoint_restart"
    if kind == "migrate":
        return "grow" if in_place else "checkpoint_restart"
    raise ValueError(f"unknown transition kind {kind!r}; known: {', '.join(KINDS)}")


def lost_iterations(job: JobModel, fitted_action: str) -> float:
    """Iterations of training the action loses on average (module docstring)."""
    if fitted_action == "restart_snapshot":
        return SNAPSHOT_EVERY / 2.0
    if fitted_action == "checkpoint_restart":
        return job.checkpoint_interval / 2.0
    return 0.5


def seconds(job: JobModel, kind: str, gpus: int, fit: TransitionFit, model_parallel_reform: bool = False) -> float:
    """What a change of ``kind`` costs ``job``, which runs on ``gpus`` GPUs after it: the
    action's fitted time plus the work it loses."""
    if gpus <= 0:
        return 0.0
    chosen = action(job, kind, model_parallel_reform)
    world = gpus  # one rank per GPU
    moved = fit.seconds(chosen, job.state_bytes_per_rank, world)
    return moved + lost_iterations(job, chosen) * job.iteration_s(gpus)


def start_gpus(job: JobModel) -> int:
    return job.start_nodes * GPUS_PER_NODE
