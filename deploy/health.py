"""The image's gRPC health check: exit 0 when the service in this container answers the
standard gRPC health check as SERVING, 1 otherwise.

Usage: health.py [--live] [host:port]. The address defaults to the service's bind
(UNICRON_COORDINATOR_BIND, UNICRON_PLANNER_BIND or UNICRON_AGENT_BIND), with a wildcard
host probed on 127.0.0.1; a container with none of them (the CLI) has nothing to check.

--live is a liveness check: it fails only when the port accepts connections but no
SERVING answer comes in time (a hung server). A standby coordinator binds no port until it
holds the lease, and is alive all the same.

The probe speaks as the service's peers do: over mutual TLS with the service's own
certificate (UNICRON_<SERVICE>_TLS_CA, _TLS_CERT, _TLS_KEY), unless UNICRON_<SERVICE>_PLAINTEXT
says plaintext or no CA is set. The health service is open to any caller the TLS admits."""

from __future__ import annotations

import os
import socket
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

BIND_VARIABLES = ("UNICRON_COORDINATOR_BIND", "UNICRON_PLANNER_BIND", "UNICRON_AGENT_BIND")
TIMEOUT_S = 3.0
TRUE = ("1", "true", "yes", "on")  # as unicron/config.py reads a boolean


def service_prefix() -> str | None:
    """UNICRON_<SERVICE>_ of the service this container runs (the one whose bind is set)."""
    return next((v.removesuffix("BIND") for v in BIND_VARIABLES if os.environ.get(v)), None)


def credentials() -> grpc.ChannelCredentials | None:
    """The TLS the service serves with, from its settings; None: plaintext."""
    prefix = service_prefix()
    if prefix is None or os.environ.get(f"{prefix}PLAINTEXT", "").strip().lower() in TRUE:
        return None
    ca = os.environ.get(f"{prefix}TLS_CA", "")
    if not ca:
        return None
    cert, key = os.environ.get(f"{prefix}TLS_CERT", ""), os.environ.get(f"{prefix}TLS_KEY", "")
    with open(ca, "rb") as ca_file:
        root = ca_file.read()
    if not (cert and key):
        return grpc.ssl_channel_credentials(root)
    with open(cert, "rb") as cert_file, open(key, "rb") as key_file:
        return grpc.ssl_channel_credentials(root, key_file.read(), cert_file.read())


def probe_address(args: list[str]) -> str | None:
    address = args[0] if args else next((os.environ[v] for v in BIND_VARIABLES if os.environ.get(v)), None)
    if address is None:
        return None
    host, _, port = address.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def serving(address: str, tls: grpc.ChannelCredentials | None = None) -> bool:
    channel = grpc.insecure_channel(address) if tls is None else grpc.secure_channel(address, tls)
    with channel:
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
    try:
        tls = credentials()
    except OSError as exc:
        print(f"unhealthy: cannot read the TLS settings: {exc}", file=sys.stderr)
        return 1
    if serving(address, tls):
        return 0
    if live and not listening(address):
        return 0
    print(f"unhealthy: no SERVING answer from {address}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
