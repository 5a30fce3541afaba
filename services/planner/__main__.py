"""`python -m services.planner`: one stateless planner replica."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from services.planner.server import Limits, PlannerServicer
from unicron import rpc
from unicron.config import load_config, require
from unicron.errors import UnicronError
from unicron.logs import setup_logging
from unicron.telemetry import setup_telemetry, shutdown_telemetry
from unicron.v1 import planner_service_pb2_grpc


@dataclass(frozen=True)
class PlannerConfig:
    bind: str = "127.0.0.1:50061"
    time_limit_s: float = 2.0
    solver_workers: int = 1
    max_jobs: int = 4096
    max_nodes: int = 16384
    max_workers: int = 8
    log_level: str = "info"

    def __post_init__(self) -> None:
        require(":" in self.bind, "bind", "must be host:port")
        require(self.time_limit_s > 0, "time_limit_s", "must be positive")
        require(self.solver_workers >= 1, "solver_workers", "must be at least 1")
        require(self.max_workers >= 1, "max_workers", "must be at least 1")
        require(self.max_jobs >= 1, "max_jobs", "must be at least 1")
        require(self.max_nodes >= 1, "max_nodes", "must be at least 1")


def main(argv: list[str]) -> int:
    try:
        config = load_config(PlannerConfig, env_prefix="UNICRON_PLANNER", argv=argv, description="Unicron planner")
    except UnicronError as exc:
        print(f"unicron-planner: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("planner", config.log_level)
    setup_telemetry("planner")
    try:
        server = rpc.Server(bind=config.bind, max_workers=config.max_workers)
    except UnicronError as exc:
        log.error(str(exc))
        return 1
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
    server.install_signal_handlers()
    server.start()
    log.info("planner serving", extra={"address": server.address})
    server.wait()
    shutdown_telemetry()
    log.info("planner stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
