"""Pure decisions of the reconcile loop: no I/O, the clock passed in, tested by tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from services.coordinator import state
from unicron import jobspec
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


def plan_request(
    jobs: Sequence[common_pb2.Job],
    nodes: Sequence[common_pb2.Node],
    failure_rate_per_node_per_s: float,
    time_limit_s: float,
) -> planner_service_pb2.PlanRequest:
    """The planner's view: running jobs are pinned where they are (resizing running jobs
    comes with the self-healing loop), pending ones may be placed or left waiting."""
    request = planner_service_pb2.PlanRequest(
        failure_rate_per_node_per_second=failure_rate_per_node_per_s,
        time_limit_seconds=time_limit_s,
    )
    for node in nodes:
        request.nodes.add(
            node_id=node.node_id,
            slots=node.slots,
            healthy=node.state == common_pb2.NODE_STATE_READY,
            failure_domain=node.failure_domain,
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
            preemptible=job.state == state.PENDING,
            pinned=job.state in state.ACTIVE,
            throughput=dict(job.spec.throughput),
        )
        parameters = jobspec.model_parameters(job.spec.model)
        if not job.spec.throughput:
            plan_job.estimate.parameters = parameters
            plan_job.estimate.tokens_per_step = job.spec.training.global_batch_size * job.spec.model.seq_length
        plan_job.transition.state_bytes = parameters * jobspec.STATE_BYTES_PER_PARAMETER
        if job.state in state.ACTIVE:
            for node_id, count in slots_by_node(job).items():
                plan_job.current[node_id] = count
    return request


def assignment_for(
    spec: common_pb2.JobSpec,
    slots: Mapping[str, int],
    nodes: Mapping[str, common_pb2.Node],
    generation: int,
) -> common_pb2.Assignment:
    """Ranks in node order, contiguous per node: Megatron puts TP ranks next to each other,
    so whole TP groups stay inside one node as the planner intended."""
    par = spec.parallelism
    world = sum(slots.values())
    group = par.tensor * par.pipeline
    assignment = common_pb2.Assignment(
        generation=generation,
        world_size=world,
        data_parallel=world // group,
    )
    next_rank = 0
    for node_id in sorted(slots, key=lambda n: (-slots[n], n)):
        count = slots[node_id]
        if count == 0:
            continue
        assignment.workers.add(node_id=node_id, ranks=range(next_rank, next_rank + count))
        next_rank += count
    first = assignment.workers[0].node_id
    assignment.master_addr = nodes[first].address.rsplit(":", 1)[0]
    return assignment


def total_slots(nodes: Iterable[common_pb2.Node]) -> int:
    return sum(node.slots for node in nodes)
