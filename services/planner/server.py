"""Thin gRPC servicer over the planner's pure core: proto -> domain -> solve -> proto."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from services.planner import domain, solver
from unicron.errors import InvalidArgument, ResourceExhausted
from unicron.rpc import grpc_errors
from unicron.v1 import planner_service_pb2 as pb
from unicron.v1 import planner_service_pb2_grpc

STATUS = {
    "OPTIMAL": pb.SOLVE_STATUS_OPTIMAL,
    "FEASIBLE": pb.SOLVE_STATUS_FEASIBLE,
    "INFEASIBLE": pb.SOLVE_STATUS_INFEASIBLE,
    "UNKNOWN": pb.SOLVE_STATUS_UNKNOWN,
}


@dataclass(frozen=True)
class Limits:
    """The largest request one replica accepts; bigger ones get RESOURCE_EXHAUSTED."""

    max_jobs: int = 4096
    max_nodes: int = 16384
    # Sizes offered over all jobs (each job's DP range, or its profile's sizes): the work to
    # build the model grows with them, before the solver's time limit applies.
    max_sizes: int = 65536
    # A solve holds a server thread for up to its time limit: no request may ask for more.
    max_time_limit_s: float = 60.0
    default_time_limit_s: float = 2.0
    workers: int = 1


def _invalid(exc: ValueError) -> InvalidArgument:
    if isinstance(exc, domain.FieldError):
        return InvalidArgument(exc.path, exc.message)
    return InvalidArgument("request", str(exc))


def _job_from_proto(j: pb.PlanJob, path: str) -> domain.Job:
    t = j.transition
    defaults = domain.Transition()
    with domain.field_scope(f"{path}.transition"):
        transition = domain.Transition(
            restart_s=t.restart_seconds or defaults.restart_s,
            resize_s=t.resize_seconds or defaults.resize_s,
            migrate_s=t.migrate_seconds or defaults.migrate_s,
            state_bytes=t.state_bytes,
            bandwidth_bytes_per_s=t.bandwidth_bytes_per_second or defaults.bandwidth_bytes_per_s,
        )
    estimate = None
    if j.HasField("estimate"):
        with domain.field_scope(f"{path}.estimate"):
            estimate = domain.ThroughputEstimate(
                parameters=j.estimate.parameters, tokens_per_step=j.estimate.tokens_per_step
            )
    with domain.field_scope(path):
        return domain.Job(
            job_id=j.job_id,
            weight=j.weight,
            tensor_parallel=j.tensor_parallel,
            pipeline_parallel=j.pipeline_parallel,
            min_dp=j.min_data_parallel,
            max_dp=j.max_data_parallel,
            throughput=dict(j.throughput) or None,
            estimate=estimate,
            measured=dict(j.measured_throughput),
            current=dict(j.current),
            hit_by_failure=j.hit_by_failure,
            preemptible=j.preemptible,
            pinned=j.pinned,
            transition=transition,
            shard_degree=j.shard_degree,
            team=j.team,
        )


def request_from_proto(message: pb.PlanRequest, limits: Limits) -> domain.PlanRequest:
    if len(message.jobs) > limits.max_jobs:
        raise ResourceExhausted(f"request has {len(message.jobs)} jobs; this planner accepts at most {limits.max_jobs}")
    if len(message.nodes) > limits.max_nodes:
        raise ResourceExhausted(
            f"request has {len(message.nodes)} nodes; this planner accepts at most {limits.max_nodes}"
        )
    if message.time_limit_seconds > limits.max_time_limit_s:
        raise InvalidArgument(
            "request.time_limit_seconds",
            f"{message.time_limit_seconds:g} s is over this planner's limit of {limits.max_time_limit_s:g} s",
        )
    sizes = sum(len(j.throughput) or max(0, j.max_data_parallel - j.min_data_parallel + 1) for j in message.jobs)
    if sizes > limits.max_sizes:
        raise ResourceExhausted(
            f"request offers its jobs {sizes} sizes in all; this planner accepts at most {limits.max_sizes}"
        )
    try:
        nodes = []
        for i, n in enumerate(message.nodes):
            with domain.field_scope(f"request.nodes[{i}]"):
                nodes.append(
                    domain.Node(
                        node_id=n.node_id,
                        slots=n.slots,
                        healthy=n.healthy,
                        failure_domain=n.failure_domain,
                        drained=n.drained,
                    )
                )
        jobs = [_job_from_proto(j, f"request.jobs[{i}]") for i, j in enumerate(message.jobs)]
        with domain.field_scope("request"):
            request = domain.PlanRequest(
                nodes=tuple(nodes),
                jobs=tuple(jobs),
                failure_rate_per_node_per_s=message.failure_rate_per_node_per_second,
                time_limit_s=message.time_limit_seconds or limits.default_time_limit_s,
                max_changed_jobs=message.max_changed_jobs or None,
                seed=message.seed,
                workers=limits.workers,
                team_limits=dict(message.team_limits),
                team_guarantees=dict(message.team_guarantees),
            )
        domain.validate(request)
    except ValueError as exc:
        raise _invalid(exc) from None
    return request


def result_to_proto(result: domain.PlanResult) -> pb.PlanResponse:
    reply = pb.PlanResponse(
        status=STATUS.get(result.status, pb.SOLVE_STATUS_UNKNOWN),
        objective=result.objective,
        bound=result.bound,
        gap=result.gap,
        solve_seconds=result.solve_seconds,
        horizon_seconds=result.horizon_s,
        reason=result.reason,
    )
    for job in result.jobs:
        reply.jobs.add(
            job_id=job.job_id,
            slots_by_node=job.slots_by_node,
            size=job.size,
            changed=job.changed,
            reason=job.reason,
            transition=job.transition,
            transition_seconds=job.transition_s,
        )
    return reply


class PlannerServicer(planner_service_pb2_grpc.PlannerServiceServicer):
    def __init__(self, limits: Limits) -> None:
        self._limits = limits

    @grpc_errors
    def Plan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanResponse:
        return result_to_proto(solver.plan(request_from_proto(request, self._limits)))

    @grpc_errors
    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        problem = request_from_proto(request.request, self._limits)
        placement = {plan.job_id: dict(plan.slots_by_node) for plan in request.plan}
        try:
            objective = domain.score(problem, placement)
        except ValueError as exc:
            raise InvalidArgument("plan", str(exc)) from None
        return pb.ExplainResponse(objective=objective)
