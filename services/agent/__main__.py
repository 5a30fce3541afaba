"""`python -m services.agent`: the agent of one node."""

from __future__ import annotations

import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from services.agent.agent import Agent, AgentSettings
from unicron import rpc
from unicron.config import load_config, require
from unicron.errors import UnicronError
from unicron.logs import setup_logging
from unicron.telemetry import setup_telemetry, shutdown_telemetry
from unicron.v1 import trainer_service_pb2_grpc


@dataclass(frozen=True)
class AgentConfig:
    node_id: str = socket.gethostname()
    bind: str = "127.0.0.1:0"
    coordinator: str = "127.0.0.1:50051"
    slots: int = 2
    failure_domain: str = ""
    work_dir: str = "run/agent"
    stop_grace_s: float = 5.0
    max_workers: int = 32
    log_level: str = "info"

    def __post_init__(self) -> None:
        require(bool(self.node_id), "node_id", "is required")
        require(":" in self.bind, "bind", "must be host:port")
        require(":" in self.coordinator, "coordinator", "must be host:port")
        require(self.slots >= 1, "slots", "must be at least 1")
        require(self.stop_grace_s >= 0, "stop_grace_s", "must not be negative")
        require(self.max_workers >= 4, "max_workers", "must be at least 4")


def main(argv: list[str]) -> int:
    try:
        config = load_config(AgentConfig, env_prefix="UNICRON_AGENT", argv=argv, description="Unicron node agent")
    except UnicronError as exc:
        print(f"unicron-agent: {exc}", file=sys.stderr)
        return 2
    log = setup_logging("agent", config.log_level)
    setup_telemetry("agent")
    agent = Agent(
        AgentSettings(
            node_id=config.node_id,
            slots=config.slots,
            failure_domain=config.failure_domain,
            work_dir=Path(config.work_dir) / config.node_id,
            stop_grace_s=config.stop_grace_s,
        ),
        config.coordinator,
    )
    try:
        server = rpc.Server(bind=config.bind, max_workers=config.max_workers)
    except UnicronError as exc:
        log.error(str(exc))
        return 1
    server.add(
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server, agent.link, "unicron.v1.TrainerAgentService"
    )
    server.on_stop(agent.stop)
    server.install_signal_handlers()
    server.start()
    agent.start(server.address)
    log.info("agent serving", extra={"address": server.address, "node_id": config.node_id, "slots": config.slots})
    server.wait()
    shutdown_telemetry()
    log.info("agent stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
