"""Thin gRPC servicer over the planner's pure core: proto -> domain -> solve -> proto."""

from __future__ import annotations

import grpc

from services.planner import domain, solver
from unicron.errors import InvalidArgument
from unicron.rpc import grpc_errors
from unicron.v1 import planner_service_pb2 as pb
from unicron.v1 import planner_service_pb2_grpc

STATUS = {
    "OPTIMAL": pb.SOLVE_STATUS_OPTIMAL,
    "FEASIBLE": pb.SOLVE_STATUS_FEASIBLE,
    "INFEASIBLE": pb.SOLVE_STATUS_INFEASIBLE,
    "UNKNOWN": pb.SOLVE_STATUS_UNKNOWN,
}


def request_from_proto(message: pb.PlanRequest, *, default_time_limit_s: float, workers: int) -> domain.PlanRequest:
    try:
        request = domain.PlanRequest(
            nodes=tuple(
                domain.Node(
                    node_id=n.node_id,
                    slots=n.slots,
                    healthy=n.healthy,
                    failure_domain=n.failure_domain,
                )
                for n in message.nodes
            ),
            jobs=tuple(
                domain.Job(
                    job_id=j.job_id,
                    weight=j.weight,
                    tensor_parallel=j.tensor_parallel,
                    pipeline_parallel=j.pipeline_parallel,
                    min_dp=j.min_data_parallel,
                    max_dp=j.max_data_parallel,
                    throughput=dict(j.throughput) or None,
                    current=dict(j.current),
                    hit_by_failure=j.hit_by_failure,
                    preemptible=j.preemptible,
                    pinned=j.pinned,
                    transition_seconds=j.transition_seconds or 30.0,
                )
                for j in message.jobs
            ),
            failure_rate_per_node_per_s=message.failure_rate_per_node_per_second,
            time_limit_s=message.time_limit_seconds or default_time_limit_s,
            max_changed_jobs=message.max_changed_jobs or None,
            workers=workers,
        )
        domain.validate(request)
    except ValueError as exc:
        raise InvalidArgument("request", str(exc)) from None
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
        )
    return reply


class PlannerServicer(planner_service_pb2_grpc.PlannerServiceServicer):
    def __init__(self, default_time_limit_s: float, workers: int) -> None:
        self._default_time_limit_s = default_time_limit_s
        self._workers = workers

    @grpc_errors
    def Plan(self, request: pb.PlanRequest, context: grpc.ServicerContext) -> pb.PlanResponse:
        problem = request_from_proto(request, default_time_limit_s=self._default_time_limit_s, workers=self._workers)
        return result_to_proto(solver.plan(problem))

    @grpc_errors
    def Explain(self, request: pb.ExplainRequest, context: grpc.ServicerContext) -> pb.ExplainResponse:
        problem = request_from_proto(
            request.request, default_time_limit_s=self._default_time_limit_s, workers=self._workers
        )
        placement = {plan.job_id: dict(plan.slots_by_node) for plan in request.plan}
        try:
            objective = domain.score(problem, placement)
        except ValueError as exc:
            raise InvalidArgument("plan", str(exc)) from None
        return pb.ExplainResponse(objective=objective)
