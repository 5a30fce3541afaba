"""`python -m services.coordinator`: the control plane as a process."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

from services.coordinator.coordinator import Coordinator, Settings
from services.coordinator.planner_client import PlannerClient
from services.coordinator.server import JobServicer, NodeServicer
from services.coordinator.store import Store
from unicron import redisutil, rpc
from unicron.config import require
from unicron.service import run_server
from unicron.v1 import job_service_pb2_grpc, node_service_pb2_grpc


@dataclass(frozen=True)
class CoordinatorConfig:
    bind: str = "127.0.0.1:50051"
    redis_url: str = "redis://127.0.0.1:6379/0"
    planners: tuple[str, ...] = ("127.0.0.1:50061",)
    heartbeat_interval_s: float = 1.0
    heartbeat_timeout_s: float = 3.0
    reconcile_interval_s: float = 0.5
    plan_time_limit_s: float = 2.0
    failure_rate_per_node_per_s: float = 1.0 / (30 * 24 * 3600)
    max_workers: int = 64
    log_level: str = "info"

    def __post_init__(self) -> None:
        require(":" in self.bind, "bind", "must be host:port")
        require(len(self.planners) > 0, "planners", "needs at least one planner address")
        require(self.heartbeat_interval_s > 0, "heartbeat_interval_s", "must be positive")
        require(
            self.heartbeat_timeout_s > self.heartbeat_interval_s,
            "heartbeat_timeout_s",
            "must exceed heartbeat_interval_s",
        )
        require(self.reconcile_interval_s > 0, "reconcile_interval_s", "must be positive")
        require(self.max_workers >= 4, "max_workers", "must be at least 4")


def setup(config: CoordinatorConfig, server: rpc.Server, log: logging.Logger) -> Callable[[], None]:
    coordinator = Coordinator(
        Store(redisutil.connect(config.redis_url)),
        PlannerClient(config.planners),
        Settings(
            heartbeat_interval_s=config.heartbeat_interval_s,
            heartbeat_timeout_s=config.heartbeat_timeout_s,
            reconcile_interval_s=config.reconcile_interval_s,
            failure_rate_per_node_per_s=config.failure_rate_per_node_per_s,
            plan_time_limit_s=config.plan_time_limit_s,
        ),
    )
    server.add(job_service_pb2_grpc.add_JobServiceServicer_to_server, JobServicer(coordinator), "unicron.v1.JobService")
    server.add(
        node_service_pb2_grpc.add_NodeServiceServicer_to_server, NodeServicer(coordinator), "unicron.v1.NodeService"
    )
    server.on_stop(coordinator.stop)
    log.info("state in %s, planners %s", config.redis_url, ",".join(config.planners))
    return coordinator.start


if __name__ == "__main__":
    sys.exit(run_server("coordinator", CoordinatorConfig, sys.argv[1:], setup))
