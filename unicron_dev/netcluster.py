"""A LocalCluster whose services run on hosts of their own: Linux network namespaces on one
bridge (unicron_dev.netns), so that every call between them, every heartbeat, every
collective and every state transfer crosses a real network link that a test can pull,
flap, slow or partition.

Hosts: `ctl` holds Redis and the planners (with `redis_replicas`, Redis's servers are `r0`..
and its sentinels `s0`..`s2`); each coordinator has a host of its own (`c0`,
`c1`: one can be cut off from Redis alone); each agent has one (`h1`..`hN`), with its
trainers, which talk gloo over the host's eth0. The test process reaches them all as the
host `harness`."""

from __future__ import annotations

from dataclasses import dataclass

from unicron.redisutil import LocalRedis
from unicron_dev.localcluster import LocalCluster
from unicron_dev.netns import HARNESS, Host, Network
from unicron_dev.redis_group import Place, RedisGroup

CONTROL = "ctl"
SENTINELS = 3


@dataclass
class NetCluster(LocalCluster):
    network: Network | None = None

    def host_names(self) -> list[str]:
        return [
            CONTROL,
            *self.redis_hosts(),
            *(f"c{i}" for i in range(self.coordinators)),
            *(f"h{i + 1}" for i in range(self.agents)),
        ]

    def redis_hosts(self) -> list[str]:
        """With a replicated Redis, each server (`r0`, the first primary, `r1`...) and each
        sentinel (`s0`..`s2`) on a host of its own: a partition can cut any of them off."""
        if not self.redis_replicas:
            return []
        return [*(f"r{i}" for i in range(1 + self.redis_replicas)), *(f"s{i}" for i in range(SENTINELS))]

    def start(self, timeout_s: float = 60.0) -> NetCluster:
        self.network = Network(self.host_names()).create()
        try:
            super().start(timeout_s)
        except BaseException:
            self.network.destroy()
            raise
        return self

    def stop(self, grace_s: float = 15.0) -> list[str]:
        try:
            return super().stop(grace_s)
        finally:
            if self.network is not None:
                self.network.destroy()

    def host(self, name: str) -> Host:
        assert self.network is not None, "the cluster is not started"
        return self.network.hosts[name]

    def node_host(self, node_id: str) -> str:
        """The host name of an agent's node (node-a -> h1)."""
        return f"h{ord(node_id.removeprefix('node-')) - ord('a') + 1}"

    # ---- LocalCluster's hooks -----------------------------------------------------------

    def _host(self, name: str) -> Host | None:
        if name.startswith("planner-"):
            return self.host(CONTROL)
        if name == "coordinator":
            return self.host("c0")
        if name.startswith("coordinator-"):
            return self.host(f"c{name.removeprefix('coordinator-')}")
        if name.startswith("node-"):
            return self.host(self.node_host(name))
        raise ValueError(f"no host for service {name!r}")

    def _certificate_hosts(self) -> list[str]:
        assert self.network is not None
        return [host.address for host in self.network.hosts.values() if host.name != HARNESS]

    def _new_redis_group(self) -> RedisGroup:
        def server(index: int) -> Place:
            host = self.host(f"r{index}")
            return Place(host.address, tuple(host.argv([])))

        def sentinel(index: int) -> Place:
            host = self.host(f"s{index}")
            return Place(host.address, tuple(host.argv([])))

        group = super()._new_redis_group()
        group.sentinels, group.server_place, group.sentinel_place = SENTINELS, server, sentinel
        return group

    def _new_redis(self) -> LocalRedis:
        control = self.host(CONTROL)
        return LocalRedis(self.run_dir / "redis", host=control.address, prefix=control.argv([]))
