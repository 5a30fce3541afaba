"""A rank's output for `unicron logs` (architecture.md, Observability). The coordinator keeps
none of it: each read finds the node that runs (or last ran) the rank in the job's
assignment (`locate`, pure), then relays that node's AgentLogService.ReadLogs stream to the
caller (`Logs.read`). Whose job it is was checked first, as for every job call: another
user's job is NOT_FOUND.

The coordinator calls agents with its own certificate (service:coordinator), the only one
an agent admits for its logs (services/agent/log_service.py). Every error about the node
starts with "node <id>": the client tells it from the coordinator itself being down."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, replace

import grpc

from services.coordinator.context import Context
from services.coordinator.jobs import Jobs
from unicron import rpc
from unicron.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
    UnicronError,
)
from unicron.security import AUTH_METADATA, BEARER, ClientSecurity
from unicron.v1 import agent_service_pb2, agent_service_pb2_grpc, common_pb2, job_service_pb2, logs_pb2

# A node's agent that has not answered a connection within this is unreachable (a dead
# host drops the packets: the connection attempt alone would take tens of seconds).
CONNECT_TIMEOUT_S = 5.0
STREAMS: tuple[logs_pb2.LogStream, ...] = (logs_pb2.LOG_STREAM_STDOUT, logs_pb2.LOG_STREAM_STDERR)


@dataclass(frozen=True)
class LogSource:
    """Where a rank's output is: its node, that node's agent, and the generation to read."""

    job_id: str
    rank: int
    node_id: str
    address: str
    generation: int

    @property
    def where(self) -> str:
        return f"node {self.node_id} ({self.address or 'no address'})"


def locate(job: common_pb2.Job, rank: int) -> LogSource:
    """The node of `rank` in the job's current (or last) assignment, at the address its
    agent had when the assignment was made."""
    assignment = job.assignment
    if not assignment.world_size:
        raise FailedPrecondition(f"job {job.job_id} has not been placed yet: none of its ranks has run")
    if rank >= assignment.world_size:
        raise InvalidArgument("rank", f"must be below the job's world size {assignment.world_size}")
    placement = next((w for w in assignment.workers if rank in w.ranks), None)
    if placement is None:
        raise FailedPrecondition(f"rank {rank} of job {job.job_id} has no node in generation {assignment.generation}")
    return LogSource(job.job_id, rank, placement.node_id, placement.address, assignment.generation)


def at_current_address(source: LogSource, node: common_pb2.Node | None) -> LogSource:
    """The source at the address its node registered last (an agent restarted elsewhere)."""
    if node is not None and node.address:
        source = replace(source, address=node.address)
    if not source.address:
        raise Unavailable(f"{source.where} is unreachable: its agent never said where it serves")
    return source


def streams_of(requested: Sequence[int]) -> list[logs_pb2.LogStream]:
    """The streams asked for (both for none); InvalidArgument for an unknown one."""
    for stream in requested:
        if stream not in STREAMS:
            raise InvalidArgument("streams", f"{stream} is not LOG_STREAM_STDOUT (1) or LOG_STREAM_STDERR (2)")
    return [s for s in STREAMS if s in requested] if requested else list(STREAMS)


def agent_request(source: LogSource, request: job_service_pb2.StreamLogsRequest) -> agent_service_pb2.ReadLogsRequest:
    read = agent_service_pb2.ReadLogsRequest(
        job_id=source.job_id,
        rank=source.rank,
        generation=source.generation,
        follow=request.follow,
        streams=streams_of(list(request.streams)),
    )
    if request.HasField("tail_lines"):
        read.tail_lines = request.tail_lines
    return read


def agent_error(source: LogSource, code: grpc.StatusCode, details: str) -> UnicronError:
    """What the caller is told when the node's agent did not serve the read."""
    where = source.where
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFound(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, problem = details.partition(": ")
        return InvalidArgument(field, problem or details)
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return FailedPrecondition(
            f"{where} refused the coordinator ({details}): reading logs needs TLS between the coordinator and "
            "the agents, or a cluster that authenticates no one"
        )
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhausted(f"{where}: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unavailable(f"{where} is unreachable: {details or code.name}")
    return Unavailable(f"{where} did not serve the logs: {code.name}: {details}")


class Logs:
    """The part that finds a rank's output and relays it from the node's agent."""

    def __init__(
        self,
        ctx: Context,
        jobs: Jobs,
        security: ClientSecurity | None = None,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
    ) -> None:
        """`security`: how the coordinator calls agents (its certificate); None: plaintext."""
        self._ctx = ctx
        self._jobs = jobs
        self._security = security
        self._connect_timeout_s = connect_timeout_s

    def source(self, job_id: str, rank: int, scope: str | None = None) -> LogSource:
        """Where the rank's output is; NOT_FOUND for a job outside the caller's scope."""
        found = locate(self._jobs.get(job_id, scope), rank)
        return at_current_address(found, self._ctx.store.get_node(found.node_id))

    def read(self, source: LogSource, request: job_service_pb2.StreamLogsRequest) -> AsyncIterator[logs_pb2.LogChunk]:
        return relay(source, agent_request(source, request), self._security, self._connect_timeout_s)


async def relay(
    source: LogSource,
    read: agent_service_pb2.ReadLogsRequest,
    security: ClientSecurity | None,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> AsyncIterator[logs_pb2.LogChunk]:
    """The node's chunks, as they come; ends when the agent's stream does, and cancels it
    when the caller goes away."""
    token = security.token if security is not None else ""
    metadata = ((AUTH_METADATA, BEARER + token),) if token else None
    async with _channel(source.address, security) as channel:
        call = agent_service_pb2_grpc.AgentLogServiceStub(channel).ReadLogs(read, metadata=metadata)
        try:
            await asyncio.wait_for(call.wait_for_connection(), connect_timeout_s)
            async for reply in call:
                yield reply.chunk
        except TimeoutError:
            raise Unavailable(f"{source.where} is unreachable: no connection within {connect_timeout_s:g} s") from None
        except grpc.aio.AioRpcError as exc:
            raise agent_error(source, exc.code(), exc.details() or "") from None
        finally:
            call.cancel()


def _channel(address: str, security: ClientSecurity | None) -> grpc.aio.Channel:
    credentials = security.credentials() if security is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=rpc.CHANNEL_OPTIONS)
    return grpc.aio.secure_channel(address, credentials, options=rpc.CHANNEL_OPTIONS)
