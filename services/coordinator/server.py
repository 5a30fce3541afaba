"""Thin gRPC servicers over the Coordinator: validate, convert, one call, convert back.

They are coroutines on an asyncio server (unicron.rpc.Server(asyncio=True)). Calls that reach
Redis run in the server's threads (`asyncio.to_thread`, which carries the caller along);
a heartbeat from a node already heard and an idle command stream cost no thread at all,
which is what lets one coordinator process hold a thousand agents."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from services.coordinator.coordinator import Coordinator
from unicron.errors import InvalidArgument, PermissionDenied
from unicron.rpc import Server, grpc_errors
from unicron.security import caller, owner_scope
from unicron.v1 import job_service_pb2 as jobs_pb
from unicron.v1 import job_service_pb2_grpc, node_service_pb2_grpc
from unicron.v1 import node_service_pb2 as nodes_pb

Context: TypeAlias = grpc.aio.ServicerContext
to_thread = asyncio.to_thread


class JobServicer(job_service_pb2_grpc.JobServiceServicer):
    """Users reach these only with a valid token (unicron.security.Guard); each call is scoped
    to the caller's own jobs unless the caller is an admin."""

    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    @grpc_errors
    async def SubmitJob(self, request: jobs_pb.SubmitJobRequest, context: Context) -> jobs_pb.SubmitJobResponse:
        if not request.HasField("spec"):
            raise InvalidArgument("spec", "is required")
        who = caller()
        job = await to_thread(self._coordinator.submit, request.spec, owner=who.name, admin=who.admin, team=who.team)
        return jobs_pb.SubmitJobResponse(job=job)

    @grpc_errors
    async def GetJob(self, request: jobs_pb.GetJobRequest, context: Context) -> jobs_pb.GetJobResponse:
        return jobs_pb.GetJobResponse(job=await to_thread(self._coordinator.get, request.job_id, _scope()))

    @grpc_errors
    async def ListJobs(self, request: jobs_pb.ListJobsRequest, context: Context) -> jobs_pb.ListJobsResponse:
        jobs = await to_thread(self._coordinator.list_jobs, set(request.states), _scope())
        return jobs_pb.ListJobsResponse(jobs=jobs)

    @grpc_errors
    async def ListQueue(self, request: jobs_pb.ListQueueRequest, context: Context) -> jobs_pb.ListQueueResponse:
        return jobs_pb.ListQueueResponse(entries=await to_thread(self._coordinator.queue, _scope()))

    @grpc_errors
    async def ListQuotas(self, request: jobs_pb.ListQuotasRequest, context: Context) -> jobs_pb.ListQuotasResponse:
        return await to_thread(self._coordinator.quotas)

    @grpc_errors
    async def CancelJob(self, request: jobs_pb.CancelJobRequest, context: Context) -> jobs_pb.CancelJobResponse:
        job = await to_thread(self._coordinator.cancel, request.job_id, request.reason, _scope())
        return jobs_pb.CancelJobResponse(job=job)

    @grpc_errors
    async def WatchJob(
        self, request: jobs_pb.WatchJobRequest, context: Context
    ) -> AsyncIterator[jobs_pb.WatchJobResponse]:
        # The coordinator's watch blocks in Redis reads of a second; it runs in a thread, one
        # event at a time, and ends at its next read once the watcher has gone.
        gone = threading.Event()
        events = self._coordinator.watch(request.job_id, request.after_event_id, lambda: not gone.is_set(), _scope())
        try:
            while (event := await to_thread(next, events, None)) is not None:
                yield jobs_pb.WatchJobResponse(event=event)
        finally:
            gone.set()

    @grpc_errors
    async def ListNodes(self, request: jobs_pb.ListNodesRequest, context: Context) -> jobs_pb.ListNodesResponse:
        return jobs_pb.ListNodesResponse(nodes=await to_thread(self._coordinator.nodes))

    @grpc_errors
    async def ListIncidents(
        self, request: jobs_pb.ListIncidentsRequest, context: Context
    ) -> jobs_pb.ListIncidentsResponse:
        incidents = await to_thread(self._coordinator.list_incidents, request.job_id, _scope())
        return jobs_pb.ListIncidentsResponse(incidents=incidents)

    @grpc_errors
    async def InjectFault(self, request: jobs_pb.InjectFaultRequest, context: Context) -> jobs_pb.InjectFaultResponse:
        if not request.HasField("fault"):
            raise InvalidArgument("fault", "is required")
        node_id = await to_thread(self._coordinator.inject_fault, request.job_id, request.fault, _scope())
        return jobs_pb.InjectFaultResponse(node_id=node_id)

    @grpc_errors
    async def GetCluster(self, request: jobs_pb.GetClusterRequest, context: Context) -> jobs_pb.GetClusterResponse:
        return await to_thread(self._coordinator.cluster, _scope())

    @grpc_errors
    async def StreamLogs(
        self, request: jobs_pb.StreamLogsRequest, context: Context
    ) -> AsyncIterator[jobs_pb.StreamLogsResponse]:
        source = await to_thread(self._coordinator.log_source, request.job_id, request.rank, _scope())
        async for chunk in self._coordinator.read_logs(source, request):
            yield jobs_pb.StreamLogsResponse(chunk=chunk)

    @grpc_errors
    async def DrainNode(self, request: jobs_pb.DrainNodeRequest, context: Context) -> jobs_pb.DrainNodeResponse:
        _admin_only("drain a node")
        if not request.node_id:
            raise InvalidArgument("node_id", "is required")
        node, jobs = await to_thread(self._coordinator.drain, request.node_id)
        return jobs_pb.DrainNodeResponse(node=node, jobs=jobs)

    @grpc_errors
    async def UncordonNode(
        self, request: jobs_pb.UncordonNodeRequest, context: Context
    ) -> jobs_pb.UncordonNodeResponse:
        _admin_only("uncordon a node")
        if not request.node_id:
            raise InvalidArgument("node_id", "is required")
        return jobs_pb.UncordonNodeResponse(node=await to_thread(self._coordinator.uncordon, request.node_id))


def _scope() -> str | None:
    return owner_scope(caller())


def _admin_only(what: str) -> None:
    """Nodes are the cluster's, not a user's: only an admin takes them in and out."""
    if _scope() is not None:
        raise PermissionDenied(f"only an admin may {what}")


class NodeServicer(node_service_pb2_grpc.NodeServiceServicer):
    def __init__(self, coordinator: Coordinator) -> None:
        self._coordinator = coordinator

    @grpc_errors
    async def RegisterNode(
        self, request: nodes_pb.RegisterNodeRequest, context: Context
    ) -> nodes_pb.RegisterNodeResponse:
        node, last_command = await to_thread(
            self._coordinator.register_node,
            request.node_id,
            request.address,
            request.slots,
            request.failure_domain,
            request.fault_injection,
            request.image,
        )
        # After the node is stored: a generation started on it from now on is a command in
        # its log, and the records this reads already show it.
        strays = await to_thread(self._coordinator.strays, request.node_id, request.running)
        return nodes_pb.RegisterNodeResponse(
            node=node,
            heartbeat_interval_seconds=self._coordinator.settings.heartbeat_interval_s,
            last_command_id=last_command,
            strays=strays,
        )

    @grpc_errors
    async def Heartbeat(self, request: nodes_pb.HeartbeatRequest, context: Context) -> nodes_pb.HeartbeatResponse:
        # The common case, a node heard before, is a dictionary write on the event loop.
        known = self._coordinator.heartbeat_if_seen(request.node_id) or await to_thread(
            self._coordinator.heartbeat, request.node_id
        )
        return nodes_pb.HeartbeatResponse(known=known)

    @grpc_errors
    async def StreamHeartbeats(
        self, requests: AsyncIterator[nodes_pb.StreamHeartbeatsRequest], context: Context
    ) -> AsyncIterator[nodes_pb.StreamHeartbeatsResponse]:
        async for request in requests:
            known = self._coordinator.heartbeat_if_seen(request.node_id) or await to_thread(
                self._coordinator.heartbeat, request.node_id
            )
            yield nodes_pb.StreamHeartbeatsResponse(known=known)

    @grpc_errors
    async def ReportProgress(
        self, request: nodes_pb.ReportProgressRequest, context: Context
    ) -> nodes_pb.ReportProgressResponse:
        await to_thread(self._coordinator.report_progress, request.node_id, list(request.reports))
        return nodes_pb.ReportProgressResponse()

    @grpc_errors
    async def ReportFailure(
        self, request: nodes_pb.ReportFailureRequest, context: Context
    ) -> nodes_pb.ReportFailureResponse:
        if not request.HasField("report"):
            raise InvalidArgument("report", "is required")
        await to_thread(self._coordinator.report_failure, request.node_id, request.report)
        return nodes_pb.ReportFailureResponse()

    @grpc_errors
    async def ReportWorkerExit(
        self, request: nodes_pb.ReportWorkerExitRequest, context: Context
    ) -> nodes_pb.ReportWorkerExitResponse:
        await to_thread(self._coordinator.report_worker_exit, request)
        return nodes_pb.ReportWorkerExitResponse()

    @grpc_errors
    async def ReportFaultInjected(
        self, request: nodes_pb.ReportFaultInjectedRequest, context: Context
    ) -> nodes_pb.ReportFaultInjectedResponse:
        await to_thread(self._coordinator.report_fault_injected, request)
        return nodes_pb.ReportFaultInjectedResponse()

    @grpc_errors
    async def AckCommand(self, request: nodes_pb.AckCommandRequest, context: Context) -> nodes_pb.AckCommandResponse:
        await to_thread(self._coordinator.ack_command, request)
        return nodes_pb.AckCommandResponse()

    @grpc_errors
    async def StreamCommands(
        self, request: nodes_pb.StreamCommandsRequest, context: Context
    ) -> AsyncIterator[nodes_pb.StreamCommandsResponse]:
        stream = await to_thread(self._coordinator.open_commands, request.node_id, request.after_command_id)
        try:
            while True:
                for command in await to_thread(stream.read):
                    yield nodes_pb.StreamCommandsResponse(command=command)
                if not await stream.changed():
                    return
        finally:
            stream.close()


def serve(server: Server, coordinator: Coordinator) -> None:
    """Puts the coordinator's two services on `server`, an asyncio one; stopping the server
    stops the coordinator first (its open streams end before its state store goes)."""
    if not server.is_async:
        raise ValueError("the coordinator's servicers are coroutines: serve them from Server(asyncio=True)")
    server.add(job_service_pb2_grpc.add_JobServiceServicer_to_server, JobServicer(coordinator), "unicron.v1.JobService")
    server.add(
        node_service_pb2_grpc.add_NodeServiceServicer_to_server, NodeServicer(coordinator), "unicron.v1.NodeService"
    )
    server.on_stop(coordinator.stop)
