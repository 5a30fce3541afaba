"""Thin gRPC servicers over the Coordinator: validate, convert, one call, convert back."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from services.coordinator.coordinator import Coordinator
from unicron.errors import InvalidArgument
from unicron.rpc import Server, grpc_errors
from unicron.security import caller, owner_scope
from unicron.v1 import job_service_pb2 as jobs_pb
from unicron.v1 import job_service_pb2_grpc, node_service_pb2_grpc
from unicron.v1 import node_service_pb2 as nodes_pb


class JobServicer(job_service_pb2_grpc.JobServiceServicer):
    """Users reach these only with a valid token (unicron.security.Guard); each call is scoped
    to the caller's own jobs unless the caller is an admin."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    @grpc_errors
    def SubmitJob(self, request: jobs_pb.SubmitJobRequest, context: grpc.ServicerContext) -> jobs_pb.SubmitJobResponse:
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "is required")
        return jobs_pb.SubmitJobResponse(job=self._coordinator.submit(request.spec, owner=caller().name))

    @grpc_errors
    def GetJob(self, request: jobs_pb.GetJobRequest, context: grpc.ServicerContext) -> jobs_pb.GetJobResponse:
        return jobs_pb.GetJobResponse(job=self._coordinator.get(request.job_id, _scope()))

    @grpc_errors
    def ListJobs(self, request: jobs_pb.ListJobsRequest, context: grpc.ServicerContext) -> jobs_pb.ListJobsResponse:
        return jobs_pb.ListJobsResponse(jobs=self._coordinator.list_jobs(set(request.states), _scope()))

    @grpc_errors
    def CancelJob(self, request: jobs_pb.CancelJobRequest, context: grpc.ServicerContext) -> jobs_pb.CancelJobResponse:
        return jobs_pb.CancelJobResponse(job=self._coordinator.cancel(request.job_id, request.reason, _scope()))

    @grpc_errors
    def WatchJob(
        self, request: jobs_pb.WatchJobRequest, context: grpc.ServicerContext
    ) -> Iterator[jobs_pb.WatchJobResponse]:
        for event in self._coordinator.watch(request.job_id, request.after_event_id, context.is_active, _scope()):
            yield jobs_pb.WatchJobResponse(event=event)

    @grpc_errors
    def ListNodes(self, request: jobs_pb.ListNodesRequest, context: grpc.ServicerContext) -> jobs_pb.ListNodesResponse:
        return jobs_pb.ListNodesResponse(nodes=self._coordinator.nodes())

    @grpc_errors
    def ListIncidents(
        self, request: jobs_pb.ListIncidentsRequest, context: grpc.ServicerContext
    ) -> jobs_pb.ListIncidentsResponse:
        return jobs_pb.ListIncidentsResponse(incidents=self._coordinator.list_incidents(request.job_id, _scope()))

    @grpc_errors
    def InjectFault(
        self, request: jobs_pb.InjectFaultRequest, context: grpc.ServicerContext
    ) -> jobs_pb.InjectFaultResponse:
        if not request.HasField("fault"):
            raise InvalidArgument("fault", "is required")
        return jobs_pb.InjectFaultResponse(
            node_id=self._coordinator.inject_fault(request.job_id, request.fault, _scope())
        )

    @grpc_errors
    def GetCluster(
        self, request: jobs_pb.GetClusterRequest, context: grpc.ServicerContext
    ) -> jobs_pb.GetClusterResponse:
        return self._coordinator.cluster(_scope())


def _scope() -> str | None:
    return owner_scope(caller())


class NodeServicer(node_service_pb2_grpc.NodeServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    @grpc_errors
    def RegisterNode(
        self, request: nodes_pb.RegisterNodeRequest, context: grpc.ServicerContext
    ) -> nodes_pb.RegisterNodeResponse:
        node, last_command = self._coordinator.register_node(
            request.node_id, request.address, request.slots, request.failure_domain, request.fault_injection
        )
        return nodes_pb.RegisterNodeResponse(
            node=node,
            heartbeat_interval_seconds=self._coordinator.settings.heartbeat_interval_s,
            last_command_id=last_command,
        )

    @grpc_errors
    def Heartbeat(
        self, request: nodes_pb.HeartbeatRequest, context: grpc.ServicerContext
    ) -> nodes_pb.HeartbeatResponse:
        return nodes_pb.HeartbeatResponse(known=self._coordinator.heartbeat(request.node_id))

    @grpc_errors
    def ReportProgress(
        self, request: nodes_pb.ReportProgressRequest, context: grpc.ServicerContext
    ) -> nodes_pb.ReportProgressResponse:
        self._coordinator.report_progress(request.node_id, list(request.reports))
        return nodes_pb.ReportProgressResponse()

    @grpc_errors
    def ReportFailure(
        self, request: nodes_pb.ReportFailureRequest, context: grpc.ServicerContext
    ) -> nodes_pb.ReportFailureResponse:
        if not request.HasField("report"):
            raise InvalidArgument("report", "is required")
        self._coordinator.report_failure(request.node_id, request.report)
        return nodes_pb.ReportFailureResponse()

    @grpc_errors
    def ReportWorkerExit(
        self, request: nodes_pb.ReportWorkerExitRequest, context: grpc.ServicerContext
    ) -> nodes_pb.ReportWorkerExitResponse:
        self._coordinator.report_worker_exit(request)
        return nodes_pb.ReportWorkerExitResponse()

    @grpc_errors
    def ReportFaultInjected(
        self, request: nodes_pb.ReportFaultInjectedRequest, context: grpc.ServicerContext
    ) -> nodes_pb.ReportFaultInjectedResponse:
        self._coordinator.report_fault_injected(request)
        return nodes_pb.ReportFaultInjectedResponse()

    @grpc_errors
    def AckCommand(
        self, request: nodes_pb.AckCommandRequest, context: grpc.ServicerContext
    ) -> nodes_pb.AckCommandResponse:
        self._coordinator.ack_command(request)
        return nodes_pb.AckCommandResponse()

    @grpc_errors
    def StreamCommands(
        self, request: nodes_pb.StreamCommandsRequest, context: grpc.ServicerContext
    ) -> Iterator[nodes_pb.StreamCommandsResponse]:
        if not request.node_id:
            raise InvalidArgument("node_id", "is required")
        for command in self._coordinator.commands(request.node_id, request.after_command_id, context.is_active):
            yield nodes_pb.StreamCommandsResponse(command=command)


def serve(server: Server, coordinator: Coordinator) -> None:
    """Puts the coordinator's two services on `server`; stopping the server stops the
    coordinator first (its open streams end before its state store goes)."""
    server.add(job_service_pb2_grpc.add_JobServiceServicer_to_server, JobServicer(coordinator), "unicron.v1.JobService")
    server.add(
        node_service_pb2_grpc.add_NodeServiceServicer_to_server, NodeServicer(coordinator), "unicron.v1.NodeService"
    )
    server.on_stop(coordinator.stop)
