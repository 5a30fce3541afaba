"""`python -m services.agent`: the agent of one node."""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from services.agent import log_service, trainer_user
from services.agent.agent import Agent, AgentSettings, serve
from services.agent.health import default_checks
from unicron import rpc
from unicron.config import require, setting
from unicron.logs import exit_flushed
from unicron.monitor import MonitorSettings
from unicron.security import ClientSecurity, ServerSecurity, TLSConfig, WorkerTokens, read_token_file, server_security
from unicron.service import grpc_dependency, run_server
from unicron.trainer.settings import trainer_env as settings_env

# The monitor's own defaults: the flags' defaults and what the bench reports cannot drift apart.
_MONITOR_DEFAULTS = MonitorSettings()


@dataclass(frozen=True)
class AgentConfig(TLSConfig):
    node_id: str = setting(socket.gethostname(), "this node's name in the cluster (default: the host name)")
    bind: str = setting("127.0.0.1:0", "host:port to serve on (port 0: any free port)")
    advertise: str = setting(
        "",
        "the host (IP or name) the coordinator, peers and trainers reach this agent at, and rank 0's rendezvous "
        "address when a rank 0 runs here: the host's address on the data network (empty: the bind address's "
        "host; required with a wildcard bind such as 0.0.0.0)",
    )
    data_interface: str = setting(
        "",
        "the network interface the trainers' collectives use (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME): the data "
        "network, not whichever one the host name resolves to (empty: the interface holding the advertised "
        "address; none for a loopback one)",
    )
    coordinator: str = setting(
        "127.0.0.1:50051", "the coordinator's host:port (several, comma-separated: the active one is found)"
    )
    slots: int = setting(2, "trainer ranks this node runs at once")
    gpus: str = setting(
        "auto",
        "the node's GPUs, one per slot, each trainer seeing only its slot's (CUDA_VISIBLE_DEVICES): auto (the GPUs "
        "this agent sees: its own CUDA_VISIBLE_DEVICES, else /dev/nvidiaN), none, or ids such as 0,1,2,3",
    )
    failure_domain: str = setting(
        "", "the failure domain (a rack, say) this node belongs to; reported, not used in plans yet"
    )
    image: str = setting(
        "",
        "the container image this agent and its trainers run in, as deploy/ names it (empty: outside one); a job "
        "whose program.image names another image does not run here",
    )
    work_dir: str = setting(
        "",
        "the agent's directory: its state and its trainers' output, under <work_dir>/<node_id>; a relative path "
        "is taken from where the agent starts (empty: $XDG_STATE_HOME/unicron/agent, else "
        "~/.local/state/unicron/agent, wherever the agent is started)",
    )
    checkpoint_dir: str = setting(
        "",
        "where trainers keep persistent checkpoints, a directory per job, which all nodes of a job must see (a "
        "shared filesystem in a real cluster; empty: <work_dir>/checkpoints, shared by agents on one machine)",
    )
    snapshot_dir: str = setting(
        "",
        "where trainers keep in-memory snapshots of their state for restarts, a directory per job (empty: "
        "/dev/shm/unicron/<node_id>, or <work_dir>/<node_id>/snapshots without /dev/shm; none: no snapshots)",
    )
    stop_grace_s: float = setting(5.0, "how long a stopped trainer has after SIGTERM before SIGKILL")
    fault_injection: bool = setting(False, "let faults be injected into this node's trainers (testing only)")
    monitor: bool = setting(True, "statistical monitoring of hangs and stragglers (off only to measure its cost)")
    health_period_s: float = setting(5.0, "how often the node's health checks run")
    health_return_s: float = setting(
        60.0,
        "after a health finding (a full disk, low memory) isolated the node: how long every check must "
        "pass again before the agent registers again and the node takes ranks again",
    )
    hang_k: float = setting(
        _MONITOR_DEFAULTS.k,
        "a rank is hung when no iteration ended for this many times its job's robust mean iteration time",
    )
    hang_floor_s: float = setting(_MONITOR_DEFAULTS.floor_s, "no hang is called sooner than this after an iteration")
    hang_warmup_iterations: int = setting(
        _MONITOR_DEFAULTS.warmup_iterations, "no hang is called before a job finished this many iterations"
    )
    max_workers: int = setting(32, "server threads (each open trainer stream holds one)")
    warm_spares: int = setting(
        1,
        "trainer processes kept ready (torch and Megatron imported), so that a restarted rank skips seconds of "
        "imports; each costs the memory of an idle trainer (a few hundred MB)",
    )
    spare_warmup_s: float = setting(
        60.0,
        "at start, the longest the agent waits for its warm spares before it registers, so that a job growing "
        "onto the node starts warm; 0 registers at once",
    )
    log_level: str = setting("info", "debug, info, warning or error")
    join_token_file: str = setting(
        "",
        "a file holding the cluster's join token, for a coordinator that does not know this node by its "
        "certificate (node:<node_id>)",
    )
    trainer_user: str = setting(
        "",
        "the user (a name or uid) this node's trainers run as, so that the user's program cannot read the node's "
        "key, join token or the agent's state; the agent must run as root, and those files must not be readable "
        "by that user (empty: the agent's own user)",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.join_token_file:
            read_token_file("join_token_file", self.join_token_file)
        require(bool(self.node_id), "node_id", "is required")
        require(":" in self.bind, "bind", "must be host:port")
        host = self.advertise or self.bind.rpartition(":")[0]
        require(
            host not in ("0.0.0.0", "::", "[::]", ""),
            "advertise",
            f"is required with a wildcard bind ({self.bind}): the address others reach this node at",
        )
        require(":" in self.coordinator, "coordinator", "must be host:port")
        require(self.slots >= 1, "slots", "must be at least 1")
        require(
            self.gpus in ("auto", "none") or all(part.strip() for part in self.gpus.split(",")),
            "gpus",
            "must be auto, none or a comma-separated list of GPU ids",
        )
        require(self.stop_grace_s >= 0, "stop_grace_s", "must not be negative")
        require(self.max_workers >= 4, "max_workers", "must be at least 4")
        require(0 <= self.warm_spares <= 64, "warm_spares", "must be between 0 and 64")
        require(0 <= self.spare_warmup_s <= 3600, "spare_warmup_s", "must be between 0 and 3600")
        require(self.health_period_s > 0, "health_period_s", "must be positive")
        require(self.health_return_s >= 0, "health_return_s", "must not be negative")
        require(self.hang_k > 1, "hang_k", "must exceed 1")
        require(self.hang_floor_s > 0, "hang_floor_s", "must be positive")
        require(self.hang_warmup_iterations >= 1, "hang_warmup_iterations", "must be at least 1")
        user = trainer_user.resolve(self.trainer_user)
        if user is not None:
            trainer_user.check(user, {"tls_key": self.tls_key, "join_token_file": self.join_token_file})


def advertised_host(config: AgentConfig) -> str:
    return config.advertise or config.bind.rpartition(":")[0]


def interface_of(host: str) -> str:
    """The network interface that holds `host` (an IP address); "" for a name, a loopback
    address, or an address no interface here holds."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return ""
    if ip.is_loopback:
        return ""
    for name, addresses in psutil.net_if_addrs().items():
        if any(address.address.split("%")[0] == str(ip) for address in addresses):
            return name
    return ""


def agent_root(config: AgentConfig, environ: Mapping[str, str] = os.environ) -> Path:
    """The agent's directory, absolute: the trainers it starts run elsewhere (a job's
    working_dir), and a default that followed the agent's start directory scattered its state
    over whichever directories it was started from."""
    if config.work_dir:
        return Path(config.work_dir).expanduser().resolve()
    state_home = environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state_home) / "unicron" / "agent"


def snapshot_root(config: AgentConfig, work_dir: Path) -> Path | None:
    if config.snapshot_dir == "none":
        return None
    if config.snapshot_dir:
        return Path(config.snapshot_dir)
    shm = Path("/dev/shm")
    return shm / "unicron" / config.node_id if shm.is_dir() else work_dir / "snapshots"


def coordinator_security(config: AgentConfig) -> ClientSecurity:
    return config.client(read_token_file("join_token_file", config.join_token_file) if config.join_token_file else "")


def trainer_env(config: AgentConfig, work_dir: Path) -> dict[str, str]:
    """How this agent's trainers reach it: TLS checked against the CA, on the trainer port,
    which asks for no client certificate (TRAINER_BIND); each proves itself by its worker
    token. Never the agent's certificate or key: a trainer runs the user's program. A trainer
    user may not read the agent's certificate files at all, so it gets a copy of the CA's
    certificate (public) in the agent's directory."""
    if config.plaintext:
        return settings_env(plaintext=True)
    ca = Path(config.tls_ca).resolve()
    if config.trainer_user:
        ca = trainer_user.public_copy(ca, work_dir / "trainer-ca.pem")
    return settings_env(plaintext=False, tls_ca=ca)


# Where the agent serves its trainers (its children, on this host): loopback, any free port.
TRAINER_BIND = "127.0.0.1:0"


def security(config: AgentConfig, tokens: WorkerTokens) -> ServerSecurity:
    """Trainers are admitted by the token this agent issued them, TLS or not (they show no
    certificate: their port asks for none). Of the certificates only the coordinator's names
    anyone, and it may only read the trainers' output; log_service.py says who reads it
    without TLS."""
    secured = server_security(config, tokens.lookup, certificates=False)
    auth = log_service.authenticator(tokens.lookup, tls=not config.plaintext, open_to_anyone=open_logs(config))
    return replace(secured, authenticator=auth)


def open_logs(config: AgentConfig) -> bool:
    """Plaintext without a join token: the coordinator registered this agent without
    credentials, so the cluster authenticates no one, and neither do its trainers' logs."""
    return config.plaintext and not config.join_token_file


def node_gpus(setting: str, visible: str | None = None, dev: Path = Path("/dev")) -> tuple[str, ...]:
    """The GPU ids a node's slots take, from the ``gpus`` setting: "auto" reads the agent's own
    CUDA_VISIBLE_DEVICES (``visible``), else counts the /dev/nvidiaN device files."""
    if setting == "none":
        return ()
    if setting != "auto":
        return tuple(part.strip() for part in setting.split(","))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if visible is not None:
        return tuple(part.strip() for part in visible.split(",") if part.strip())
    found = sorted(int(p.name[6:]) for p in dev.glob("nvidia[0-9]*") if p.name[6:].isdigit())
    return tuple(str(i) for i in found)


def setup(
    config: AgentConfig, server: rpc.Server, log: logging.Logger, tokens: WorkerTokens | None = None
) -> Callable[[], None]:
    root = agent_root(config)
    work_dir = root / config.node_id
    checkpoints = Path(config.checkpoint_dir).resolve() if config.checkpoint_dir else root / "checkpoints"
    work_dir.mkdir(parents=True, exist_ok=True)
    trainer_address = server.add_port(TRAINER_BIND, client_certificates=False)
    agent = Agent(
        AgentSettings(
            node_id=config.node_id,
            slots=config.slots,
            gpus=node_gpus(config.gpus),
            failure_domain=config.failure_domain,
            image=config.image,
            work_dir=work_dir,
            checkpoint_dir=checkpoints,
            snapshot_dir=snapshot_root(config, work_dir),
            stop_grace_s=config.stop_grace_s,
            fault_injection=config.fault_injection,
            monitoring=config.monitor,
            health_period_s=config.health_period_s,
            health_return_s=config.health_return_s,
            warm_spares=config.warm_spares,
            spare_warmup_s=config.spare_warmup_s,
            trainer_env=trainer_env(config, work_dir),
            trainer_address=trainer_address,
            data_interface=config.data_interface or interface_of(advertised_host(config)),
            trainer_user=trainer_user.resolve(config.trainer_user),
            monitor=MonitorSettings(
                k=config.hang_k, floor_s=config.hang_floor_s, warmup_iterations=config.hang_warmup_iterations
            ),
        ),
        config.coordinator,
        health_checks=default_checks(str(work_dir), str(checkpoints)),
        security=coordinator_security(config),
        worker_tokens=tokens,
    )
    if config.fault_injection:
        log.warning("fault injection is ENABLED on this agent: faults can be injected into its trainers")
    if open_logs(config):
        log.warning(
            "agent serves its trainers' output to ANY caller (plaintext, no join token: nothing is authenticated)"
        )
    serve(server, agent)
    log.info(
        "node %s offers %d slots to %s",
        config.node_id,
        config.slots,
        config.coordinator,
        extra={"work_dir": str(work_dir), "checkpoint_dir": str(checkpoints)},
    )
    # The bound port (0 asks for any) at the advertised host.
    return lambda: agent.start(f"{advertised_host(config)}:{server.address.rpartition(':')[2]}")


def main(argv: list[str]) -> int:
    tokens = WorkerTokens()
    return run_server(
        "agent",
        AgentConfig,
        argv,
        functools.partial(setup, tokens=tokens),
        dependencies=lambda config: [grpc_dependency("coordinator", config.coordinator, coordinator_security(config))],
        security=functools.partial(security, tokens=tokens),
    )


if __name__ == "__main__":
    exit_flushed(main(sys.argv[1:]))
