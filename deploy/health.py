"""The image's gRPC health check: exit 0 when the service in this container answers the
standard gRPC health check as SERVING, 1 otherwise.

Usage: health.py [--live] [host:port]. The address defaults to the service's bind
(UNICRON_COORDINATOR_BIND, UNICRON_PLANNER_BIND or UNICRON_AGENT_BIND), with a wildcard
host probed on 127.0.0.1; a container with none of them (the CLI) has nothing to check.

--live is a liveness check: it fails only when the port accepts connections but no
SERVING answer comes in time (a hung server). A standby coordinator binds no port until it
holds the lease, and is alive all the same."""

from __future__ import annotations

import os
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BIND_VARIABLES = ("UNICRON_COORDINATOR_BIND", "UNICRON_PLANNER_BIND", "UNICRON_AGENT_BIND")
TIMEOUT_S = 3.0


def probe_address(args: list[str]) -> str | None:
    address = args[0] if args else next((os.environ[v] for v in BIND_VARIABLES if os.environ.get(v)), None)
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT_S)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def listening(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=TIMEOUT_S):
            return True
    except OSError:
        return False


def main(argv: list[str]) -> int:
    live = "--live" in argv
    address = probe_address([a for a in argv if a != "--live"])
    if address is None:
        return 0
    if serving(address):
        return 0
    if live and not listening(address):
        return 0
    print(f"unhealthy: no SERVING answer from {address}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
