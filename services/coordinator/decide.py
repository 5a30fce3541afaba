"""Pure decisions of the reconcile loop: no I/O, the clock passed in, tested by tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from services.coordinator import state
from unicron import buddy_map, jobspec
from unicron.v1 import common_pb2, planner_service_pb2


def lost_nodes(
    now: float, nodes: Iterable[common_pb2.Node], timeout_s: float, observing_since: float = 0.0
) -> list[str]:
    """READY nodes silent for longer than the timeout.

    Silence is counted from `observing_since` at the earliest (when this coordinator
    started listening): heartbeats sent while no coordinator was up went nowhere, so
    a coordinator restart must not read them as lost nodes.
    """
    return [
        node.node_id
        for node in nodes
        if node.state == common_pb2.NODE_STATE_READY
        and now - max(node.last_heartbeat.ToNanoseconds() / 1e9, observing_since) > timeout_s
    ]


# The worker states in which the node's ranks of that generation are meant to be alive, or
# are being stopped by a command already in the node's log.
_KEPT_WORKER_STATES = frozenset(
    {state.WORKER_STARTING, state.WORKER_LAUNCHED, state.WORKER_RUNNING, state.WORKER_STOPPING}
)


def is_stray(node_id: str, job: common_pb2.Job | None, generation: int) -> bool:
    """Whether ranks of `job`'s `generation` alive on `node_id` run without the coordinator:
    the job is gone or over, or no worker of that generation on the node is alive or being
    stopped in its records (a node declared LOST has its workers written off without a
    command, and its job moved on). A start or reform of a newer generation still waiting
    for this node's acknowledgement takes the ranks over itself: those are not stray."""
    if job is None or state.is_terminal(job.state):
        return True
    current = job.assignment.generation
    for worker in job.workers:
        if worker.node_id != node_id:
            continue
        if worker.generation == generation and worker.state in _KEPT_WORKER_STATES:
            return False
        if worker.generation == current > generation and worker.state == state.WORKER_STARTING:
            return False
    return True


def nodes_of(job: common_pb2.Job) -> list[str]:
    return [w.node_id for w in job.assignment.workers if w.ranks]


def slots_by_node(job: common_pb2.Job) -> dict[str, int]:
    return {w.node_id: len(w.ranks) for w in job.assignment.workers if w.ranks}


def used_slots(jobs: Iterable[common_pb2.Job]) -> dict[str, int]:
    used: dict[str, int] = {}
    for job in jobs:
        if job.state in state.ACTIVE:
            for node_id, count in slots_by_node(job).items():
                used[node_id] = used.get(node_id, 0) + count
    return used


def waiting_reason(
    job: common_pb2.Job, nodes: Iterable[common_pb2.Node], used: Mapping[str, int], planner_reason: str = ""
) -> str:
    """Why a pending job is not placed, in terms its user can act on: the slots it needs at its
    smallest size, in whole tensor-parallel groups (a group never spans nodes), and how many
    such slots are free now; when enough are, the planner's reason for leaving it out.
    ``used``: the slots the other jobs hold per node (under the plan just made)."""
    par = job.spec.parallelism
    tp, pp = max(par.tensor, 1), max(par.pipeline, 1)
    min_data = max(par.min_data or par.data, 1)
    needed = tp * pp * min_data
    free = sum(
        (node.slots - used.get(node.node_id, 0)) // tp * tp
        for node in nodes
        if node.state == common_pb2.NODE_STATE_READY and not node.cordoned
    )
    shape = f"tensor {tp} x pipeline {pp} x data {min_data}"
    if free < needed:
        group = f", in tensor-parallel groups of {tp} on one node" if tp > 1 else ""
        return f"waiting for {needed} free slots ({shape}{group}): {max(free, 0)} free now"
    return f"waiting: {free} slots are free ({needed} needed) but the planner left the job out" + (
        f" ({planner_reason})" if planner_reason else ""
    )


def hit_jobs(jobs: Iterable[common_pb2.Job], nodes: Iterable[common_pb2.Node]) -> set[str]:
    """Active jobs that must move: ranks on a node that is not READY (or is drained), or a remedy that waits
    for a re-plan to carry it out. The second without the first is a node lost and back (its
    agent started again) before the re-plan: the job's ranks there died all the same."""
    ready = {node.node_id for node in nodes if node.state == common_pb2.NODE_STATE_READY and not node.cordoned}
    return {
        job.job_id
        for job in jobs
        if job.state in state.ACTIVE and (any(n not in ready for n in nodes_of(job)) or awaits_replan(job))
    }


def awaits_replan(job: common_pb2.Job) -> bool:
    """Whether the job's last remedy is one the next re-plan carries out (a reconfiguration:
    no generation of its own yet)."""
    return (
        job.state == state.RECOVERING
        and bool(job.remedies)
        and not job.remedies[-1].HasField("resumed")
        and job.remedies[-1].generation == 0
    )


def plan_request(
    jobs: Sequence[common_pb2.Job],
    nodes: Sequence[common_pb2.Node],
    failure_rate_per_node_per_s: float,
    time_limit_s: float,
    hit: Iterable[str] = (),
    quiet: Iterable[str] = (),
    team_limits: Mapping[str, int] | None = None,
    team_guarantees: Mapping[str, int] | None = None,
) -> planner_service_pb2.PlanRequest:
    """The planner's view of the whole cluster: every active job may be resized or moved
    (what that costs is in its transition estimate, so jobs left alone stay where they
    are), pending ones may be placed or left waiting, `hit` jobs must change.

    A `quiet` node (READY, but its heartbeats are late) keeps the ranks it has and takes no
    new ones: when a rack vanishes its nodes are declared lost over a second or so, and a
    job moved off the first of them must not land on the next."""
    hit, quiet = set(hit), set(quiet)
    used = used_slots(jobs) if quiet else {}
    request = planner_service_pb2.PlanRequest(
        failure_rate_per_node_per_second=failure_rate_per_node_per_s,
        time_limit_seconds=time_limit_s,
        team_limits=team_limits or {},
        team_guarantees=team_guarantees or {},
    )
    for node in nodes:
        request.nodes.add(
            node_id=node.node_id,
            slots=min(node.slots, used.get(node.node_id, 0)) if node.node_id in quiet else node.slots,
            healthy=node.state == common_pb2.NODE_STATE_READY and not node.cordoned,
            failure_domain=node.failure_domain,
            drained=node.cordoned,
        )
    for job in jobs:
        if job.state not in state.ACTIVE and job.state != state.PENDING:
            continue
        par = job.spec.parallelism
        plan_job = request.jobs.add(
            job_id=job.job_id,
            weight=job.spec.weight,
            tensor_parallel=par.tensor,
            pipeline_parallel=par.pipeline,
            min_data_parallel=par.min_data,
            max_data_parallel=par.max_data,
            preemptible=job.spec.preemptible or job.state == state.PENDING,
            hit_by_failure=job.job_id in hit,
            throughput=dict(job.spec.throughput),
            shard_degree=par.shard_degree,
            team=job.team,
        )
        if not job.spec.throughput:
            plan_job.measured_throughput.update(job.progress.measured_flops_per_second)
        parameters, tokens_per_step = estimate_of(job)
        if not job.spec.throughput and parameters > 0 and tokens_per_step > 0 and estimable(job):
            plan_job.estimate.parameters = parameters
            plan_job.estimate.tokens_per_step = tokens_per_step
        # A joining rank fetches its own shard of the state from a live peer, all shards in
        # parallel: the bytes on one link are the job's state over TP x PP (the optimizer's
        # part over DP too, under the distributed optimizer: at the job's current degree, or
        # its smallest before it runs).
        shards = max(1, par.tensor) * max(1, par.pipeline)
        running = sum(slots_by_node(job).values()) // shards if job.state in state.ACTIVE else 0
        data_parallel = max(1, running or par.min_data)
        per_parameter = jobspec.state_bytes_per_parameter(job.spec.training, data_parallel)
        plan_job.transition.state_bytes = parameters * per_parameter / shards
        plan_job.transition.bandwidth_bytes_per_second = jobspec.STATE_TRANSFER_BYTES_PER_S
        if job.state in state.ACTIVE:
            for node_id, count in slots_by_node(job).items():
                plan_job.current[node_id] = count
    return request


def estimable(job: common_pb2.Job) -> bool:
    """Whether the planner may model the job's throughput across sizes: its spec declares its
    size, or a throughput was measured to scale the model by. Between its first report (which
    gives its size, estimate_of) and its first measurement (the report after: the first pays
    for warm-up), the model would price its ranks as the reference GPU, and for a small model
    that is all all-reduce: seen, a re-plan in that window shrank a 2-rank job on an idle
    cluster to 1 rank, "10x faster", and the next re-plan, measured, grew it back."""
    return _declares_estimate(job) or bool(job.progress.measured_flops_per_second)


def _declares_estimate(job: common_pb2.Job) -> bool:
    return job.spec.estimate.parameters > 0 and job.spec.estimate.tokens_per_step > 0


def estimate_of(job: common_pb2.Job) -> tuple[float, float]:
    """(parameters, tokens per step) of a job for the planner's estimate: as its spec declares
    them, else as its iterations reported them (FLOPs ~ 6 x parameters x tokens), else zeros
    (the planner then assumes a per-slot rate)."""
    if _declares_estimate(job):
        return job.spec.estimate.parameters, job.spec.estimate.tokens_per_step
    progress = job.progress
    if progress.iteration > 0 and progress.tokens > 0:
        tokens_per_step = progress.tokens / progress.iteration
        flops_per_step = progress.flops_per_second * progress.iteration_seconds
        if flops_per_step > 0:
            return flops_per_step / (6.0 * tokens_per_step), tokens_per_step
    return 0.0, 0.0


@dataclass(frozen=True)
class Change:
    """What a plan means for one job: start (pending -> placed), move (new placement or
    size for an active job), pause (active -> pending). Jobs the plan keeps get none."""

    job_id: str
    kind: str
    slots: dict[str, int]
    reason: str
    transition: str = ""


def hit_jobs_may_pause(request: planner_service_pb2.PlanRequest) -> planner_service_pb2.PlanRequest | None:
    """``request`` with its non-preemptible jobs that the failure hit made preemptible, or None
    when it has none. For a plan when no plan keeps them all running: a job that lost the
    slots it needs (its node isolated, no other free) waits, paused, for capacity, rather
    than hold every other job's re-plan up while it sits in recovery with nothing running.
    Its training state lives on in its checkpoint and snapshots. A pinned job stays pinned."""
    relaxed = planner_service_pb2.PlanRequest()
    relaxed.CopyFrom(request)
    freed = [job for job in relaxed.jobs if job.hit_by_failure and not job.preemptible and not job.pinned]
    for job in freed:
        job.preemptible = True
    return relaxed if freed else None


def plan_changes(
    jobs: Sequence[common_pb2.Job], reply: planner_service_pb2.PlanResponse, hit: Iterable[str] = ()
) -> list[Change]:
    hit = set(hit)
    by_id = {job.job_id: job for job in jobs}
    changes = []
    for plan in reply.jobs:
        job = by_id.get(plan.job_id)
        if job is None:
            continue
        slots = {node_id: count for node_id, count in plan.slots_by_node.items() if count}
        if job.state == state.PENDING:
            if slots:
                changes.append(Change(job.job_id, "start", slots, plan.reason, plan.transition))
        elif job.state in state.ACTIVE:
            if not slots:
                changes.append(Change(job.job_id, "pause", {}, plan.reason))
            elif slots != slots_by_node(job) or job.job_id in hit:
                changes.append(Change(job.job_id, "move", slots, plan.reason, plan.transition))
    return changes


def survivor_map(
    job: common_pb2.Job,
    assignment: common_pb2.Assignment,
    waiting: set[int],
    gone: set[int],
    unreachable: frozenset[str] = frozenset(),
) -> dict[int, int] | None:
    """Old rank -> new rank for the ranks that keep their state through a reform after a
    failure, or None when the job must restart the classic way (no rank kept).

    A rank that neither waits for a decision nor is gone sits in a collective with a rank
    that is gone or that will leave the old group for the new one: either way the collective
    breaks and the rank takes the reform. Not so with a rank on a node the coordinator cannot
    reach: it may be alive and hold its peers until the collective timeout. Then every rank
    must have answered (waited, or gone)."""
    behind = {r for w in job.assignment.workers if w.node_id in unreachable for r in w.ranks}
    gone = gone | behind
    if not gone:
        return None
    ranks = {r for w in job.assignment.workers for r in w.ranks}
    if behind and not ranks <= waiting | gone:
        return None
    return kept_in_place(job, assignment, gone)


def live_map(job: common_pb2.Job, assignment: common_pb2.Assignment) -> dict[int, int] | None:
    """Old rank -> new rank for a healthy job that a re-plan resizes or moves: its ranks on
    nodes it keeps join the new group at their next iteration boundary, without a restart.
    None when the job is not simply training (a transition of its own is under way)."""
    if job.state != state.RUNNING:
        return None
    return kept_in_place(job, assignment, set())


def kept_in_place(job: common_pb2.Job, assignment: common_pb2.Assignment, gone: set[int]) -> dict[int, int] | None:
    """Maps the live ranks on nodes the new assignment keeps to its ranks there that hold the
    same (tensor, pipeline) shard: a rank's state is its shard's, so it goes on in place only
    where the new layout gives it that shard (any rank, when the job has tensor and pipeline
    degree 1). A rank keeps its number where it can. None when no rank is kept."""
    par = job.spec.parallelism
    tensor, pipeline = max(par.tensor, 1), max(par.pipeline, 1)
    old_world, new_world = _world(job.assignment), _world(assignment)

    def old_shard(rank: int) -> tuple[int, int]:
        return shard_of(rank, old_world, tensor, pipeline)

    def new_shard(rank: int) -> tuple[int, int]:
        return shard_of(rank, new_world, tensor, pipeline)

    new_by_node = {w.node_id: sorted(w.ranks) for w in assignment.workers}
    mapping: dict[int, int] = {}
    for worker in job.assignment.workers:
        alive = sorted(r for r in worker.ranks if r not in gone)
        free = new_by_node.get(worker.node_id, [])
        same = [r for r in alive if r in free and old_shard(r) == new_shard(r)]
        mapping.update((r, r) for r in same)
        left = [r for r in free if r not in same]
        for rank in alive:
            if rank in mapping:
                continue
            match = next((r for r in left if new_shard(r) == old_shard(rank)), None)
            if match is not None:
                mapping[rank] = match
                left.remove(match)
    return mapping or None


def shard_of(rank: int, world: int, tensor: int, pipeline: int) -> tuple[int, int]:
    """(tensor rank, pipeline rank) of a global rank in Megatron's default order
    (tp-cp-ep-dp-pp: tensor innermost, pipeline outermost)."""
    data = max(world // (tensor * pipeline), 1)
    return rank % tensor, rank // (tensor * data)


def _world(assignment: common_pb2.Assignment) -> int:
    return assignment.world_size or sum(len(w.ranks) for w in assignment.workers)


def overdue_workers(now: float, jobs: Iterable[common_pb2.Job]) -> list[tuple[str, str]]:
    """(job_id, node_id) of workers whose command acknowledgement is past its deadline."""
    return [
        (job.job_id, worker.node_id)
        for job in jobs
        if job.state in state.ACTIVE and not _awaiting_plan(job)
        for worker in job.workers
        if worker.generation == job.assignment.generation
        and worker.HasField("deadline")
        and worker.deadline.ToNanoseconds() / 1e9 < now
    ]


def _awaiting_plan(job: common_pb2.Job) -> bool:
    """A reconfigure not yet placed: the job's current workers are going away anyway."""
    return (
        bool(job.remedies)
        and not job.remedies[-1].HasField("resumed")
        and job.remedies[-1].generation == 0
        and (job.remedies[-1].remedy == common_pb2.REMEDY_RECONFIGURE)
    )


def stalled_recoveries(now: float, jobs: Iterable[common_pb2.Job], timeout_s: float) -> list[str]:
    """RECOVERING jobs whose last remedy has not brought back an iteration within timeout_s."""
    return [
        job.job_id
        for job in jobs
        if job.state == state.RECOVERING
        and job.remedies
        and not job.remedies[-1].HasField("resumed")
        and now - job.remedies[-1].started.ToNanoseconds() / 1e9 > timeout_s
    ]


def assignment_for(
    spec: common_pb2.JobSpec,
    slots: Mapping[str, int],
    nodes: Mapping[str, common_pb2.Node],
    generation: int,
    previous: common_pb2.Assignment | None = None,
) -> common_pb2.Assignment:
    """Ranks in node order, contiguous per node: Megatron puts TP ranks next to each other,
    so whole TP groups stay inside one node as the planner intended. With the job's
    ``previous`` assignment, a model-parallel job's nodes keep their pipeline stages where
    they can (``_keeping_stages``)."""
    par = spec.parallelism
    world = sum(slots.values())
    group = par.tensor * par.pipeline
    assignment = common_pb2.Assignment(
        generation=generation,
        world_size=world,
        data_parallel=world // group,
    )
    order = sorted(slots, key=lambda n: (-slots[n], n))
    if previous is not None and group > 1 and previous.workers:
        order = _keeping_stages(order, slots, previous, max(par.tensor, 1), max(par.pipeline, 1))
    next_rank = 0
    for node_id in order:
        count = slots[node_id]
        if count == 0:
            continue
        node = nodes.get(node_id)
        address = node.address if node is not None else ""
        domain = node.failure_domain if node is not None else ""
        assignment.workers.add(
            node_id=node_id, ranks=range(next_rank, next_rank + count), address=address, failure_domain=domain
        )
        next_rank += count
    first = assignment.workers[0].node_id
    assignment.master_addr = nodes[first].address.rsplit(":", 1)[0]
    _place_copies(assignment, spec)
    return assignment


def _place_copies(assignment: common_pb2.Assignment, spec: common_pb2.JobSpec) -> None:
    """Who keeps whose buddy copy under this placement (unicron/buddy_map.py), for a job with
    replication 2: said, or the default of a distributed-optimizer job. (An FSDP2 program's
    default is 2 too, but nothing in the spec tells one: its map shows where it says 2.)"""
    training = spec.training
    if training.replication == 1 or not (training.distributed_optimizer or training.replication >= 2):
        return
    nodes = [""] * assignment.world_size
    domains = [""] * assignment.world_size
    for worker in assignment.workers:
        for rank in worker.ranks:
            nodes[rank], domains[rank] = worker.node_id, worker.failure_domain
    keeper, note = buddy_map.keepers(nodes, domains, spec.parallelism.tensor, spec.parallelism.pipeline)
    assignment.copy_kept_by.extend(keeper)
    assignment.copies = note


def _keeping_stages(
    order: list[str], slots: Mapping[str, int], previous: common_pb2.Assignment, tensor: int, pipeline: int
) -> list[str]:
    """``order`` rearranged so that each node the job keeps comes where its ranks hold the
    pipeline stage (and tensor ranks) they held: Megatron's ranks are pipeline-outermost, so a
    node's stage follows from its place in the order, and a data-parallel resize shifts every
    stage's start. A node that lands on another stage holds the wrong shard and takes its
    state from a peer instead of keeping it (``kept_in_place``). Kept nodes fill their old
    stage first, in their old order; new nodes and those a stage has no room for fill the
    rest, stage by stage."""
    stage_size = max(sum(slots[n] for n in order) // pipeline, 1)
    old_world = _world(previous)
    held: dict[str, tuple[int, int]] = {}  # node -> (its old stage, its old first rank)
    for worker in previous.workers:
        if worker.ranks and worker.node_id in slots:
            first = min(worker.ranks)
            held[worker.node_id] = (shard_of(first, old_world, tensor, pipeline)[1], first)
    stages: list[list[str]] = [[] for _ in range(pipeline)]
    room = [stage_size] * pipeline
    rest: list[str] = []
    for node in sorted(held, key=lambda n: held[n][1]):
        stage = held[node][0]
        if stage < pipeline and slots[node] <= room[stage]:
            stages[stage].append(node)
            room[stage] -= slots[node]
        else:
            rest.append(node)
    rest = [n for n in order if n not in held] + rest
    for stage in range(pipeline):
        while room[stage] > 0 and rest:
            fits = next((n for n in rest if slots[n] <= room[stage]), rest[0])
            rest.remove(fits)
            stages[stage].append(fits)
            room[stage] -= slots[fits]
    return [n for stage in stages for n in stage] + rest


def total_slots(nodes: Iterable[common_pb2.Node]) -> int:
    return sum(node.slots for node in nodes)


# Where rendezvous ports come from when the coordinator cannot test one by binding it (the
# job's rank 0 runs on another host): torch.distributed's customary default and the 500 above.
RENDEZVOUS_PORTS = range(29500, 30000)


def unused_rendezvous_port(
    master_addr: str, jobs: Iterable[common_pb2.Job], ports: range = RENDEZVOUS_PORTS, exclude: int = 0
) -> int | None:
    """The lowest port of `ports` that no active job rendezvouses on at `master_addr` (nor
    `exclude`, the port the job itself is leaving); None when all are taken."""
    taken = {
        job.assignment.master_port
        for job in jobs
        if job.state in state.ACTIVE and job.assignment.master_addr == master_addr
    } | {exclude}
    return next((port for port in ports if port not in taken), None)


def pending_remedy(job: common_pb2.Job) -> common_pb2.RemedyAttempt | None:
    """The job's last remedy while it has not brought training back."""
    if job.remedies and not job.remedies[-1].HasField("resumed"):
        return job.remedies[-1]
    return None
