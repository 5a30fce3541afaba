"""Distributed-optimizer jobs: what a transition moves, from where, and what the buddy copies cost.

A distributed-optimizer rank holds its model slice (bf16 parameters, the same on every
data-parallel peer) and its optimizer shard (fp32 main parameters and Adam's moments, its own
range of the slice's flat buffer; ``model.JobModel``: State). With ``replication`` 2 each
rank's shard also lives in the host memory of its *buddy*: the rank of the same (tensor,
pipeline) position one data-parallel replica before it, on another node
(``unicron/trainer/buddy.py``, refreshed every iteration). Here a node holds one (tensor,
pipeline) slot of one replica (``model``: TP fills a node, a replica is ``pipeline`` nodes), so a
node's buddy is the node of the same pipeline stage in the previous replica
(``buddy_position``).

Where the lost shards come from (``shard_source``), for the nodes whose ranks lost their memory
since the job last trained (a node taken out, or a process restarted on a live node):

    live        nothing lost (a planned resize, a grow onto a repaired node)
    buddy       every lost node's buddy lives (copies on: replication 2, data-parallel degree >= 2)
    snapshot    some shard has no live copy, but every lost node lives: its in-memory snapshot
    checkpoint  some shard has no live copy and its node is gone (a rank and its buddy lost
                together, or no copies): every rank reloads the newest persistent checkpoint

What moves (``moves``), per receiving rank, the one receiving most setting the time:

    restart (same size)     the new rank: its slice from a live peer + its shard from its buddy
    migrate (gains a node)  a new rank: its slice from a peer + its new shard range (from the
                            live ranks and the buddies); a kept rank: what it resharded
    resize (no new node)    a kept rank: the part of its new shard range it did not hold
                            (``reshard_fraction``; each rank receives only what it will own)

Priced (``seconds``) by the fitted lines of ``timings``: the action's fixed part, the bytes at
the fitted peer transfer's per-byte rate (``restart_peer``: the slice, the buddy's shard and the
resharded ranges all go through one transfer plan, ``unicron/trainer/transfer.py``), the
rendezvous of the world, and the work lost (half an iteration from memory). A snapshot or
checkpoint fallback costs what those actions cost a replicated job (the lines over the state
each rank holds) and loses half the snapshot or checkpoint interval. A reattempt moves nothing
and keeps its fitted line over the state held.

The lines' per-byte slopes were fitted (bench/sizes.py) on transitions that move a rank's whole
state (restart from a peer, grow, snapshot, checkpoint), so there they are a cost per byte
moved; they come from two-CPU-core runs at 1M-100M parameters, a slow network for a GPU
cluster, which errs against Unicron. Not yet fitted: restarts and reshards of a distributed-
optimizer job at several sizes (``bench/buddy.py`` measures the copies, not the restarts); the
peer line stands in for them.

The copies' cost (``BuddySettings``): each iteration a rank copies its shard to host memory and
sends it to its buddy over the network. Not overlapped with the step, that is shard bytes over
the device-to-host bandwidth plus shard bytes over the rank's network bandwidth, added to every
iteration (``copy_s``), and the job's throughput and effective training time shrink by the share
it takes (``effective_share``). Memory (``memory_bytes``): the buddy's copy plus the rank's own
send buffer, two shards of host memory, as ``make bench-buddy`` measured (127 MB per rank for a
10M-parameter job at data-parallel degree 2). Measured on this 2-core CPU machine: 23% of a 0.33 s
iteration at 10M parameters, copying at 1.1 GB/s over loopback (bench/README.md: bench/buddy.py);
the cluster figures below are bandwidth *assumptions*, stated as settings.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from unicron import jobspec
from unicron_sim.engine import JobRun
from unicron_sim.model import SNAPSHOT_EVERY, JobModel
from unicron_sim.timings import TransitionFit

SOURCES = ("live", "buddy", "snapshot", "checkpoint")
# What a receiving rank gets, by where it comes from (``Moves.bytes``).
PIECES = ("slice", "buddy", "reshard", "snapshot", "checkpoint")
# The fitted line whose per-byte rate prices each piece (module docstring).
RATE_LINE = {
    "slice": "restart_peer",
    "buddy": "restart_peer",
    "reshard": "restart_peer",
    "snapshot": "restart_snapshot",
    "checkpoint": "checkpoint_restart",
}


def buddy_position(position: int, data_parallel: int, pipeline: int) -> int:
    """The position (in the job's node list, replica-major) of the node that holds a copy of
    the shards of the node at ``position``: the same stage, one replica before."""
    replica, stage = divmod(position, pipeline)
    return ((replica - 1) % data_parallel) * pipeline + stage


def shard_source(job: JobModel, before_gpus: int, lost: Mapping[int, bool]) -> str:
    """Where the lost shards come from (module docstring). ``lost``: the position of each node
    whose ranks lost their memory since the job last trained -> whether that node still lives."""
    if not lost:
        return "live"
    dp = job.data_parallel(before_gpus)
    if job.buddy_copies and dp >= 2 and not any(buddy_position(p, dp, job.pipeline) in lost for p in lost):
        return "buddy"
    if all(lost.values()):
        return "snapshot"
    return "checkpoint"


def likely_source(job: JobModel, kind: str) -> str:
    """The source a change of ``kind`` takes when one node was lost (the planner's estimates): a
    restart keeps its node (its snapshot lives), the other kinds follow a node taken out."""
    if kind == "reattempt":
        return "live"
    if job.buddy_copies and job.start_dp >= 2:
        return "buddy"
    return "snapshot" if kind == "restart" else "checkpoint"


def reshard_fraction(old_dp: int, new_dp: int) -> float:
    """The most any rank receives when the optimizer state of a slice is re-partitioned from
    ``old_dp`` equal ranges to ``new_dp``, as a fraction of the whole: each rank receives the part
    of its new range it did not hold. Kept ranks keep their order; ranks beyond ``old_dp`` are
    new and receive their whole range."""
    if old_dp == new_dp:
        return 0.0
    worst = 0.0
    for j in range(new_dp):
        start, end = j / new_dp, (j + 1) / new_dp
        held = max(0.0, min(end, (j + 1) / old_dp) - max(start, j / old_dp)) if j < old_dp else 0.0
        worst = max(worst, (end - start) - held)
    return worst


@dataclass(frozen=True)
class Moves:
    """A transition of a distributed-optimizer job: the fitted action it pays the fixed part of,
    where the lost shards come from, the bytes the rank receiving most gets by piece, and the
    iterations of training it loses."""

    action: str
    source: str
    bytes: Mapping[str, float] = field(default_factory=dict)
    lost_iterations: float = 0.5

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown state source {self.source!r}; known: {', '.join(SOURCES)}")
        unknown = [k for k in self.bytes if k not in PIECES]
        if unknown:
            raise ValueError(f"unknown pieces {', '.join(unknown)}; known: {', '.join(PIECES)}")
        if any(not (math.isfinite(v) and v >= 0) for v in self.bytes.values()):
            raise ValueError("bytes must be finite numbers >= 0")

    @property
    def total_bytes(self) -> float:
        return sum(self.bytes.values())


def _fallback(job: JobModel, source: str, gpus: int) -> Moves:
    held = job.state_bytes_per_rank(gpus)
    if source == "snapshot":
        return Moves("restart_snapshot", source, {"snapshot": held}, SNAPSHOT_EVERY / 2.0)
    return Moves("checkpoint_restart", "checkpoint", {"checkpoint": held}, job.checkpoint_interval / 2.0)


def moves(job: JobModel, kind: str, before_gpus: int, gpus: int, source: str) -> Moves:
    """What a change of ``kind`` from ``before_gpus`` to ``gpus`` moves (module docstring)."""
    if kind == "reattempt":
        return Moves("reattempt", "live")  # priced over the state held, as a replicated job's
    if kind == "start" or source == "checkpoint":
        return _fallback(job, "checkpoint", gpus)
    if source == "snapshot":
        # A snapshot holds the old layout: only a restart on the same size can use it.
        return _fallback(job, "snapshot" if kind == "restart" and before_gpus == gpus else "checkpoint", gpus)
    shard = job.shard_bytes_per_rank(gpus)
    lost_key = "buddy" if source == "buddy" else "reshard"
    if kind == "restart":
        return Moves("restart_peer", source, {"slice": job.slice_bytes_per_rank, lost_key: shard})
    if kind not in ("resize", "migrate"):
        raise ValueError(f"unknown transition kind {kind!r}")
    whole = job.shard_bytes_per_rank(job.tensor * job.pipeline)  # the slice's whole optimizer state
    kept = reshard_fraction(job.data_parallel(before_gpus), job.data_parallel(gpus)) * whole
    if kind == "resize" or kept > job.slice_bytes_per_rank + shard:
        return Moves("shrink" if kind == "resize" else "grow", source, {"reshard": kept})
    return Moves("grow", source, {"slice": job.slice_bytes_per_rank, lost_key: shard})


def seconds(job: JobModel, kind: str, before_gpus: int, gpus: int, fit: TransitionFit, source: str) -> float:
    """What the change costs the job: the action's fixed part, each piece at its line's per-byte
    rate, the rendezvous of ``gpus`` ranks and the work lost (module docstring)."""
    if gpus <= 0:
        return 0.0
    moved = moves(job, kind, before_gpus, gpus, source)
    line = fit.lines[moved.action]
    if moved.action == "reattempt":
        fixed = line.seconds(job.state_bytes_per_rank(gpus))
    else:
        fixed = line.fixed_s + sum(fit.lines[RATE_LINE[k]].per_byte_s * b for k, b in moved.bytes.items())
    return fixed + fit.rendezvous_s(gpus) + moved.lost_iterations * job.iteration_s(gpus)


# --- what a job's ranks lost --------------------------------------------------------------------


def note_lost(job: JobRun, node: int, alive: bool) -> None:
    """Records that the ranks of ``job`` on ``node`` lost their memory (``alive``: the node itself
    lives), for the job's open incident: what its next transition must restore (``sharded``)."""
    if node not in job.nodes or job.incident is None:
        return
    incident, lost = job.extra.get("lost", (None, {}))
    if incident is not job.incident:
        lost = {}
    position = job.nodes.index(node)
    lost[position] = lost.get(position, True) and alive
    job.extra["lost"] = (job.incident, lost)


def lost_memory(job: JobRun) -> dict[int, bool]:
    """The positions of ``job``'s nodes whose ranks lost their memory since it last trained, and
    whether each node lives (empty once the job trains again)."""
    incident, lost = job.extra.get("lost", (None, {}))
    if incident is None or incident is not job.incident or incident.resumed is not None:
        return {}
    return dict(lost)


# --- the copies' cost ------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuddySettings:
    """How fast a rank's shard reaches its buddy each iteration on a GPU cluster (*assumptions*:
    nothing here was measured on one). Device to host: PCIe Gen5 x16, 64 GB/s a direction in the
    specification, taken at about 80%. Network: one 400 Gb/s NIC per GPU
    (``jobspec.STATE_TRANSFER_BYTES_PER_S``, what the coordinator assumes for a peer transfer;
    Llama 3's cluster has 400 Gb/s between GPUs). ``overlapped``: the copy hidden behind the step
    (not what the trainer does today: it copies at the start of each iteration)."""

    device_to_host_bytes_per_s: float = 50e9
    network_bytes_per_s: float = jobspec.STATE_TRANSFER_BYTES_PER_S
    overlapped: bool = False

    def __post_init__(self) -> None:
        for name in ("device_to_host_bytes_per_s", "network_bytes_per_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0")


def copies(job: JobModel, gpus: int) -> bool:
    """Whether the job keeps buddy copies at this size (a buddy needs another replica)."""
    return job.buddy_copies and job.data_parallel(gpus) >= 2


def copy_s(job: JobModel, gpus: int, settings: BuddySettings) -> float:
    """Seconds each iteration spends refreshing the buddy copies (module docstring)."""
    if not copies(job, gpus) or settings.overlapped:
        return 0.0
    shard = job.shard_bytes_per_rank(gpus)
    return shard / settings.device_to_host_bytes_per_s + shard / settings.network_bytes_per_s


def memory_bytes(job: JobModel, gpus: int) -> float:
    """Host memory each rank spends on the copies: its buddy's shard and its own send buffer."""
    return 2.0 * job.shard_bytes_per_rank(gpus) if copies(job, gpus) else 0.0


def effective_share(job: JobModel, gpus: int, settings: BuddySettings) -> float:
    """The share of each iteration that trains: the step over the step plus the copy."""
    if gpus <= 0:
        return 1.0
    step = job.iteration_s(gpus)
    return step / (step + copy_s(job, gpus, settings))
