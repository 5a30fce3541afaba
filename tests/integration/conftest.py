"""In-process gRPC servers on 127.0.0.1 port 0 over a real Redis and the real planner."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import redis

from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.planner_client import PlannerClient
from services.coordinator.redis_store import RedisStore
from services.coordinator.server import serve
from services.planner.server import Limits, PlannerServicer
from unicron import rpc
from unicron.client import UnicronClient
from unicron.security import ClientSecurity
from unicron.v1 import node_service_pb2_grpc, planner_service_pb2_grpc


def start_planner(bind: str = "127.0.0.1:0") -> rpc.Server:
    server = rpc.Server(bind=bind, max_workers=4, grace_s=0.5)
    server.add(
        planner_service_pb2_grpc.add_PlannerServiceServicer_to_server,
        PlannerServicer(Limits(max_jobs=64, max_nodes=64)),
        "unicron.v1.PlannerService",
    )
    server.start()
    return server


@dataclass
class ControlPlane:
    coordinator: Coordinator
    server: rpc.Server
    planners: list[rpc.Server]
    redis: redis.Redis
    clock: Callable[[], float]

    @property
    def address(self) -> str:
        return self.server.address

    def client(self) -> UnicronClient:
        return UnicronClient(self.address, security=ClientSecurity.plaintext())

    def node_stub(self) -> node_service_pb2_grpc.NodeServiceStub:
        return node_service_pb2_grpc.NodeServiceStub(grpc.insecure_channel(self.address))


class FakeClock:
    """Time under the test's control, so heartbeat timeouts need no sleeping."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def control_plane(redis_client: redis.Redis, clock: FakeClock) -> Iterator[ControlPlane]:
    """Coordinator (reconcile loop not started: tests step it) and two planner replicas."""
    planners = [start_planner(), start_planner()]
    coordinator = Coordinator(
        RedisStore(redis_client),
        PlannerClient([p.address for p in planners], timeout_s=10),
        Settings(heartbeat_timeout_s=3.0),
        clock=clock,
    )
    server = rpc.Server(bind="127.0.0.1:0", max_workers=16, grace_s=0.5, asyncio=True)
    serve(server, coordinator)
    server.start()
    yield ControlPlane(coordinator, server, planners, redis_client, clock)
    server.stop()
    for planner in planners:
        planner.stop()
