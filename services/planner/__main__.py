"""`python -m services.planner`: one stateless planner replica."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass

from services.planner.server import Limits, PlannerServicer
from unicron import rpc
from unicron.config import require, setting
from unicron.logs import exit_flushed
from unicron.security import TLSConfig
from unicron.service import run_server
from unicron.v1 import planner_service_pb2_grpc


@dataclass(frozen=True)
class PlannerConfig(TLSConfig):
    bind: str = setting("127.0.0.1:50061", "host:port to serve on")
    time_limit_s: float = setting(2.0, "how long the solver searches for a plan when the request sets no limit")
    solver_workers: int = setting(1, "CP-SAT search workers per plan (one, with a fixed seed, gives repeatable plans)")
    max_jobs: int = setting(4096, "the most jobs one plan request may hold (more: RESOURCE_EXHAUSTED)")
    max_nodes: int = setting(16384, "the most nodes one plan request may hold (more: RESOURCE_EXHAUSTED)")
    max_workers: int = setting(8, "server threads: plan requests solved at once")
    log_level: str = setting("info", "debug, info, warning or error")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(":" in self.bind, "bind", "must be host:port")
        require(self.time_limit_s > 0, "time_limit_s", "must be positive")
        require(self.solver_workers >= 1, "solver_workers", "must be at least 1")
        require(self.max_workers >= 1, "max_workers", "must be at least 1")
        require(self.max_jobs >= 1, "max_jobs", "must be at least 1")
        require(self.max_nodes >= 1, "max_nodes", "must be at least 1")


def setup(config: PlannerConfig, server: rpc.Server, log: logging.Logger) -> None:
    server.add(
        planner_service_pb2_grpc.add_PlannerServiceServicer_to_server,
        PlannerServicer(
            Limits(
                max_jobs=config.max_jobs,
                max_nodes=config.max_nodes,
                default_time_limit_s=config.time_limit_s,
                workers=config.solver_workers,
            )
        ),
        "unicron.v1.PlannerService",
    )


if __name__ == "__main__":
    exit_flushed(run_server("planner", PlannerConfig, sys.argv[1:], setup))
