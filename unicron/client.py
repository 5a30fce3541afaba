"""A small Python client of the public job API."""

from __future__ import annotations

import time
from collections.abc import Generator, Iterator, Sequence

import grpc

from unicron import rpc
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, job_service_pb2, job_service_pb2_grpc, logs_pb2

DEFAULT_COORDINATOR = "127.0.0.1:50051"
# A read of logs that does not follow them ends by then, however long they are.
LOGS_TIMEOUT_S = 300.0
# With several coordinators (one active, standbys), a read that finds none answering is sent
# again for this long: a standby takes the lease over within its TTL (3 s by default) of the
# active one's end and then starts serving. With one coordinator it fails at once, as an
# address with nothing behind it should. Only reads: sending them twice changes nothing.
FAILOVER_S = 10.0
FAILOVER_RETRY_S = 0.25
_READS = frozenset({"GetJob", "ListJobs", "ListQueue", "ListQuotas", "ListNodes", "ListIncidents", "GetCluster"})


class ClientError(Exception):
    """A failed call, with its gRPC status code and the server's one-line message."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _unwrap(exc: grpc.RpcError, address: str) -> ClientError:
    code = exc.code()
    details = exc.details() or ""
    if code == grpc.StatusCode.UNAVAILABLE and details.startswith("node "):
        return ClientError(code, details)  # a node behind the coordinator (logs), not the coordinator
    if code == grpc.StatusCode.UNAVAILABLE and not rpc.answered_by_server(exc):
        # A TLS handshake that fails (a wrong UNICRON_TLS_CA, a plaintext server) looks the same.
        return ClientError(code, f"cannot reach the coordinator at {address} (is it running?)")
    if code == grpc.StatusCode.UNAVAILABLE:
        return ClientError(code, f"the coordinator at {address} is unavailable: {details} (try again)")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return ClientError(code, f"not authenticated: {exc.details()} (set UNICRON_TOKEN or UNICRON_TOKEN_FILE)")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ClientError(code, f"the coordinator at {address} did not answer in time")
    return ClientError(code, exc.details() or code.name)


class UnicronClient:
    def __init__(
        self, address: str = DEFAULT_COORDINATOR, timeout_s: float = 10.0, security: ClientSecurity | None = None
    ) -> None:
        """`security` None: the environment's (UNICRON_TLS_CA, UNICRON_TOKEN, ...:
        ClientSecurity.from_env)."""
        self.address = address
        self._timeout_s = timeout_s
        self.security = security if security is not None else ClientSecurity.from_env()
        self._channel = rpc.channel(address, self.security)
        self._stub = job_service_pb2_grpc.JobServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> UnicronClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(self, method: str, request: object) -> object:
        """One call; a read is tried again for up to FAILOVER_S through a failover: of the
        coordinators (with more than one address), or of their Redis (the coordinator says
        UNAVAILABLE itself). A write is never tried again: it may have been applied."""
        give_up = time.monotonic() + FAILOVER_S
        while True:
            try:
                return getattr(self._stub, method)(request, timeout=self._timeout_s)
            except grpc.RpcError as exc:
                error = _unwrap(exc, self.address)
                details = exc.details() or ""
                away = error.code == grpc.StatusCode.UNAVAILABLE and not details.startswith("node ")
                switching = "," in self.address or rpc.answered_by_server(exc)
                if not (method in _READS and away and switching) or time.monotonic() >= give_up:
                    raise error from None
            time.sleep(FAILOVER_RETRY_S)

    def submit(self, spec: common_pb2.JobSpec) -> common_pb2.Job:
        reply = self._call("SubmitJob", job_service_pb2.SubmitJobRequest(spec=spec))
        assert isinstance(reply, job_service_pb2.SubmitJobResponse)
        return reply.job

    def get(self, job_id: str) -> common_pb2.Job:
        reply = self._call("GetJob", job_service_pb2.GetJobRequest(job_id=job_id))
        assert isinstance(reply, job_service_pb2.GetJobResponse)
        return reply.job

    def list_jobs(self, states: list[common_pb2.JobState] | None = None) -> list[common_pb2.Job]:
        reply = self._call("ListJobs", job_service_pb2.ListJobsRequest(states=states or []))
        assert isinstance(reply, job_service_pb2.ListJobsResponse)
        return list(reply.jobs)

    def quotas(self) -> job_service_pb2.ListQuotasResponse:
        """Each team's quota and what its jobs hold now."""
        reply = self._call("ListQuotas", job_service_pb2.ListQuotasRequest())
        assert isinstance(reply, job_service_pb2.ListQuotasResponse)
        return reply

    def queue(self) -> list[job_service_pb2.QueueEntry]:
        """The waiting jobs in the order the planner prefers them."""
        reply = self._call("ListQueue", job_service_pb2.ListQueueRequest())
        assert isinstance(reply, job_service_pb2.ListQueueResponse)
        return list(reply.entries)

    def cancel(self, job_id: str, reason: str = "") -> common_pb2.Job:
        reply = self._call("CancelJob", job_service_pb2.CancelJobRequest(job_id=job_id, reason=reason))
        assert isinstance(reply, job_service_pb2.CancelJobResponse)
        return reply.job

    def nodes(self) -> list[common_pb2.Node]:
        reply = self._call("ListNodes", job_service_pb2.ListNodesRequest())
        assert isinstance(reply, job_service_pb2.ListNodesResponse)
        return list(reply.nodes)

    def drain(self, node_id: str) -> tuple[common_pb2.Node, list[str]]:
        """Cordons the node; its jobs move off. Returns it and those jobs."""
        reply = self._call("DrainNode", job_service_pb2.DrainNodeRequest(node_id=node_id))
        assert isinstance(reply, job_service_pb2.DrainNodeResponse)
        return reply.node, list(reply.jobs)

    def uncordon(self, node_id: str) -> common_pb2.Node:
        reply = self._call("UncordonNode", job_service_pb2.UncordonNodeRequest(node_id=node_id))
        assert isinstance(reply, job_service_pb2.UncordonNodeResponse)
        return reply.node

    def incidents(self, job_id: str = "") -> list[common_pb2.Incident]:
        reply = self._call("ListIncidents", job_service_pb2.ListIncidentsRequest(job_id=job_id))
        assert isinstance(reply, job_service_pb2.ListIncidentsResponse)
        return list(reply.incidents)

    def inject(self, job_id: str, fault: common_pb2.Fault) -> str:
        """Injects a fault into a running job; returns the node that received it."""
        reply = self._call("InjectFault", job_service_pb2.InjectFaultRequest(job_id=job_id, fault=fault))
        assert isinstance(reply, job_service_pb2.InjectFaultResponse)
        return reply.node_id

    def cluster(self) -> job_service_pb2.GetClusterResponse:
        """Cluster-wide efficiency: nodes, slots, WAF per job and in total, failure cost."""
        reply = self._call("GetCluster", job_service_pb2.GetClusterRequest())
        assert isinstance(reply, job_service_pb2.GetClusterResponse)
        return reply

    def watch(self, job_id: str, after_event_id: str = "") -> Iterator[common_pb2.JobEvent]:
        """Events until the job ends; reconnects are the caller's (pass the last event_id)."""
        try:
            for reply in self._stub.WatchJob(
                job_service_pb2.WatchJobRequest(job_id=job_id, after_event_id=after_event_id)
            ):
                yield reply.event
        except grpc.RpcError as exc:
            raise _unwrap(exc, self.address) from None

    def logs(
        self,
        job_id: str,
        rank: int = 0,
        follow: bool = False,
        tail_lines: int | None = None,
        streams: Sequence[logs_pb2.LogStream] = (),
    ) -> Generator[logs_pb2.LogChunk, None, None]:
        """A rank's output, piece by piece: what it wrote (the last `tail_lines` lines of each
        stream, or all), then with `follow` what it writes until its process exits."""
        request = job_service_pb2.StreamLogsRequest(job_id=job_id, rank=rank, follow=follow, streams=streams)
        if tail_lines is not None:
            request.tail_lines = tail_lines
        call = self._stub.StreamLogs(request, timeout=None if follow else LOGS_TIMEOUT_S)
        try:
            for reply in call:
                yield reply.chunk
        except grpc.RpcError as exc:
            raise _unwrap(exc, self.address) from None
        finally:
            call.cancel()  # a caller that stops reading (a follow) ends the stream at once
