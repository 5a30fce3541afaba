"""Calls the planner through any of its replicas: starts at the next replica in turn and
fails over to the others when one is unreachable."""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

import grpc

from unicron import rpc
from unicron.errors import Unavailable
from unicron.retry import Backoff, retry
from unicron.security import ClientSecurity
from unicron.v1 import planner_service_pb2, planner_service_pb2_grpc

log = logging.getLogger(__name__)

FAILOVER_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class Planner(Protocol):
    """What the coordinator needs of a planner: PlannerClient over gRPC, or a planner in
    the same process in unit tests."""

    def plan(self, request: planner_service_pb2.PlanRequest) -> planner_service_pb2.PlanResponse: ...


class PlannerClient:
    def __init__(
        self, addresses: Sequence[str], timeout_s: float = 30.0, security: ClientSecurity | None = None
    ) -> None:
        if not addresses:
            raise ValueError("at least one planner address is required")
        self._stubs = [
            (address, planner_service_pb2_grpc.PlannerServiceStub(rpc.channel(address, security)))
            for address in addresses
        ]
        self._timeout_s = timeout_s
        self._next = itertools.cycle(range(len(self._stubs)))
        self._lock = threading.Lock()

    def plan(self, request: planner_service_pb2.PlanRequest) -> planner_service_pb2.PlanResponse:
        return retry(lambda: self._plan_once(request), retry_on=(Unavailable,), attempts=3, backoff=Backoff(0.2, 1.0))

    def _plan_once(self, request: planner_service_pb2.PlanRequest) -> planner_service_pb2.PlanResponse:
        with self._lock:
            start = next(self._next)
        errors = []
        for offset in range(len(self._stubs)):
            address, stub = self._stubs[(start + offset) % len(self._stubs)]
            try:
                reply: planner_service_pb2.PlanResponse = stub.Plan(request, timeout=self._timeout_s)
                return reply
            except grpc.RpcError as exc:
                if exc.code() not in FAILOVER_CODES:
                    raise
                log.warning("planner replica unreachable, failing over", extra={"replica": address})
                errors.append(f"{address}: {exc.code().name}")
        raise Unavailable("no planner replica answered (" + "; ".join(errors) + ")")
