"""Faults of the control plane's own machines, for a cluster whose Redis is replicated under
Sentinel (LocalCluster(redis_replicas=...)): what tests/cluster/test_replicated_state.py and
`make bench-failover` inject, and the watches that check what must hold meanwhile.

Each fault is a generator of the cluster: it starts the fault and yields once (a caller
injects a failure of its own then, to be healed while the control plane fails over), then
holds the fault as long as it lasts, waits for the failover it must cause, and undoes it.
`kill_primary` and `pause_primary` need only the group; the others the network-namespace
hosts of a NetCluster (`r0`.. the servers, `s0`.. the sentinels, `c0`, `c1` the coordinators)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import psutil

from services.agent.supervisor import REGISTRY_FILE
from unicron.redisutil import LocalRedis
from unicron_dev.localcluster import LocalCluster
from unicron_dev.netcluster import NetCluster
from unicron_dev.redis_group import RedisGroup

Fault = Iterator[None]
FAILOVER_TIMEOUT_S = 60.0
EXIT_LEASE_LOST = 75


def group_of(cluster: LocalCluster) -> RedisGroup:
    if cluster.redis_group is None:
        raise ValueError("the cluster's Redis is not replicated (LocalCluster(redis_replicas=2))")
    return cluster.redis_group


def network_of(cluster: LocalCluster) -> NetCluster:
    if not isinstance(cluster, NetCluster) or cluster.network is None:
        raise ValueError("this fault needs the network-namespace hosts of a started NetCluster")
    return cluster


def server_host(cluster: NetCluster, server: LocalRedis) -> str:
    return f"r{group_of(cluster).servers.index(server)}"


def kill_primary(cluster: LocalCluster) -> Fault:
    """SIGKILL of the primary; back, once a replica took over, as a replica of the new one."""
    group = group_of(cluster)
    old = group.kill_primary()
    yield
    group.wait_healthy(FAILOVER_TIMEOUT_S, not_primary=old)
    old.start()


def pause_primary(cluster: LocalCluster) -> Fault:
    """SIGSTOP of the primary until a replica took over (past the sentinels' timeout), then
    SIGCONT: it comes back believing it is the primary, and is demoted."""
    group = group_of(cluster)
    old = group.primary()
    group.pause(old)
    try:
        yield
        group.wait_healthy(FAILOVER_TIMEOUT_S, not_primary=old)
    finally:
        group.resume(old)


def partition(cluster: LocalCluster) -> Fault:
    """The primary and the active coordinator on one side; the replicas, the sentinels and
    the standby on the other (the agents and the clients reach both sides)."""
    net = network_of(cluster)
    group, network = group_of(net), net.network
    assert network is not None
    active = net._host(net.wait_active_coordinator())
    assert active is not None
    old = group.primary()
    minority = [server_host(net, old), active.name]
    majority = [
        name for name in [*net.redis_hosts(), *(f"c{i}" for i in range(net.coordinators))] if name not in minority
    ]
    network.cut(minority, majority)
    try:
        yield
        group.wait_healthy(FAILOVER_TIMEOUT_S, not_primary=old)
        # The cut-off coordinator on its own past its lease: it must decide nothing, and stop.
        time.sleep(net.lease_ttl())
    finally:
        for name in minority:
            network.heal(name)


def kill_sentinel(cluster: LocalCluster) -> Fault:
    group = group_of(cluster)
    group.kill_sentinel(0)
    yield
    time.sleep(3.0)
    group.restart_sentinel(0)


def flap_primary(cluster: LocalCluster) -> Fault:
    """The primary's link down and up every 1.5 s for 8 s."""
    net = network_of(cluster)
    network = net.network
    assert network is not None
    host = server_host(net, group_of(net).primary())
    flapping = network.flap(host, period_s=1.5, duration_s=8.0)
    yield
    flapping.join()
    network.heal(host)


FAULTS: dict[str, Callable[[LocalCluster], Fault]] = {
    "primary killed": kill_primary,
    "primary partitioned with the active coordinator": partition,
    "primary paused past the sentinels' timeout": pause_primary,
    "a sentinel killed": kill_sentinel,
    "primary's link flapping": flap_primary,
}
# The faults that need no network-namespace hosts.
LOCAL_FAULTS = ("primary killed", "primary paused past the sentinels' timeout", "a sentinel killed")


def kill_a_trainer(cluster: LocalCluster, job_id: str) -> None:
    for trainer in cluster.trainer_processes(job_id):
        try:
            trainer.kill()
            return
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no live trainer of {job_id} to kill")


def restart_exited_coordinators(cluster: LocalCluster) -> list[str]:
    """Coordinators that stopped themselves because their lease lapsed (exit 75) start again,
    as a supervisor would start them: as standbys. Any other exit is an error."""
    restarted = []
    for service in cluster.services:
        if service.name.startswith("coordinator") and service.proc.poll() is not None:
            if service.proc.returncode != EXIT_LEASE_LOST:
                raise RuntimeError(f"{service.name} exited {service.proc.returncode}, not {EXIT_LEASE_LOST}")
            cluster.restart(service.name)
            restarted.append(service.name)
    return restarted


@dataclass
class RankWatch:
    """Samples the agents' trainer registries while faults happen: a rank of the job alive in
    two processes of different generations in two samples running is a job run twice."""

    cluster: LocalCluster
    job_id: str
    period_s: float = 0.2
    doubled: list[str] = field(default_factory=list)
    samples: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> RankWatch:
        self._thread = threading.Thread(target=self._run, name="rank-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        previous: set[int] = set()
        while not self._stop.wait(self.period_s):
            doubled = self._doubled_ranks()
            self.samples += 1
            for rank in doubled & previous:
                self.doubled.append(f"rank {rank} of {self.job_id} alive under two generations at {time.time():.1f}")
            previous = doubled

    def _doubled_ranks(self) -> set[int]:
        generations: dict[int, set[int]] = {}
        for registry in (self.cluster.run_dir / "agents").glob(f"*/{REGISTRY_FILE}"):
            try:
                entries = json.loads(registry.read_text())
            except (OSError, ValueError):
                continue  # being rewritten: the next sample reads it
            for entry in entries:
                if entry.get("job_id") == self.job_id and psutil.pid_exists(entry["pid"]):
                    generations.setdefault(entry["rank"], set()).add(entry["generation"])
        return {rank for rank, seen in generations.items() if len(seen) > 1}
