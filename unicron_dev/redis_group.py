"""A replicated Redis for one-machine runs and tests: a primary, its replicas and the sentinels
that watch them, each a real process (redis-server, and redis-server --sentinel), on
127.0.0.1 or each on a network-namespace host of its own.

Every server refuses writes while it cannot reach a replica (`min-replicas-to-write 1`),
keeps an append-only file synced on every write, and the sentinels fail over after
`down_after_ms` of silence from the primary. Faults for tests: kill, pause (SIGSTOP) and
resume a member, by role."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from unicron.errors import FailedPrecondition, Unavailable
from unicron.redisutil import LocalRedis, RedisTLS, free_port, tls_options

MASTER = "unicron"
SENTINEL_PORT = 26379


@dataclass(frozen=True)
class Place:
    """Where a member runs: its address, and what its command line runs under."""

    host: str = "127.0.0.1"
    prefix: tuple[str, ...] = ()


@dataclass
class RedisGroup:
    data_dir: Path
    replicas: int = 2
    sentinels: int = 3
    quorum: int = 2
    down_after_ms: int = 1000
    failover_timeout_ms: int = 5000
    min_replicas_to_write: int = 1
    # A primary whose replicas have all been silent this long refuses writes.
    min_replicas_max_lag_s: int = 10
    # Where each server (the first is the primary to start with) and each sentinel runs:
    # callables of the member's index. Default: all on 127.0.0.1, each on a port of its own.
    server_place: Callable[[int], Place] = field(default=lambda _: Place())
    sentinel_place: Callable[[int], Place] = field(default=lambda _: Place())
    # Mutual TLS: every server's and sentinel's own certificate (also what they show each
    # other), and what this side shows them. None: plaintext.
    tls: RedisTLS | None = None
    client_tls: RedisTLS | None = None
    servers: list[LocalRedis] = field(default_factory=list)
    _sentinels: list[tuple[Place, int, subprocess.Popen[bytes] | None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        hosts = ",".join(f"{place.host}:{port}" for place, port, _ in self._sentinels)
        return f"{'rediss' if self.tls else 'redis'}+sentinel://{hosts}/{MASTER}"

    def _client(self, host: str, port: int) -> redis.Redis:
        return redis.Redis(
            host,
            port,
            socket_timeout=1.0,
            socket_connect_timeout=1.0,
            **({"ssl": True, **tls_options("rediss://", self.client_tls)} if self.tls else {}),
        )

    def start(self, timeout_s: float = 20.0) -> RedisGroup:
        if self.quorum > self.sentinels:
            raise FailedPrecondition(f"a quorum of {self.quorum} needs as many sentinels, not {self.sentinels}")
        try:
            for index in range(1 + self.replicas):
                self.servers.append(self._server(index).start())
            for index in range(self.sentinels):
                self._sentinels.append(self._sentinel(index))
            self.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _server(self, index: int) -> LocalRedis:
        place = self.server_place(index)
        extra = [
            "--min-replicas-to-write",
            str(self.min_replicas_to_write),
            "--min-replicas-max-lag",
            str(self.min_replicas_max_lag_s),
            # A replica answers reads while it syncs: its data may be old, but only sentinels
            # and tools read from it (clients read from the primary).
            "--replica-serve-stale-data",
            "yes",
            # A replica that must sync in full (an old primary rejoining) gets the data at once:
            # by default the primary waits 5 s for more replicas to share the transfer, and
            # writes wait for every replica the sentinels count as up.
            "--repl-diskless-sync-delay",
            "0",
        ]
        if index:
            primary = self.servers[0]
            extra += ["--replicaof", primary.host, str(primary.port)]
        if self.tls:
            extra += ["--tls-replication", "yes"]
        return LocalRedis(
            self.data_dir / f"redis-{index}",
            host=place.host,
            prefix=place.prefix,
            tls=self.tls,
            client_tls=self.client_tls,
            extra=extra,
        )

    def _sentinel(self, index: int) -> tuple[Place, int, subprocess.Popen[bytes] | None]:
        place = self.sentinel_place(index)
        port = free_port() if place.host == "127.0.0.1" else SENTINEL_PORT
        directory = self.data_dir / f"sentinel-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        primary = self.servers[0]
        # A sentinel rewrites its own config file (what it learned of the group): a file
        # of its own, written once here.
        config = directory / "sentinel.conf"
        config.write_text(
            "\n".join(
                [
                    f"bind {place.host}",
                    *self._sentinel_ports(port),
                    f"dir {directory}",
                    f"logfile {directory / 'sentinel.log'}",
                    f"protected-mode {'yes' if place.host == '127.0.0.1' else 'no'}",
                    f"sentinel monitor {MASTER} {primary.host} {primary.port} {self.quorum}",
                    f"sentinel down-after-milliseconds {MASTER} {self.down_after_ms}",
                    f"sentinel failover-timeout {MASTER} {self.failover_timeout_ms}",
                    f"sentinel parallel-syncs {MASTER} 1",
                    "",
                ]
            )
        )
        binary = shutil.which("redis-server")
        if binary is None:
            raise FailedPrecondition("redis-server is not installed: run `make redis` (apt-get install redis-server)")
        proc = subprocess.Popen(
            [*place.prefix, binary, str(config), "--sentinel"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        return place, port, proc

    def _sentinel_ports(self, port: int) -> list[str]:
        if self.tls is None:
            return [f"port {port}"]
        # TLS alone, to clients, to the servers it watches and to the other sentinels.
        return [
            "port 0",
            f"tls-port {port}",
            f"tls-cert-file {self.tls.cert}",
            f"tls-key-file {self.tls.key}",
            f"tls-ca-cert-file {self.tls.ca}",
            "tls-auth-clients yes",
            "tls-replication yes",
        ]

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        place, port, _ = self._sentinels[index]
        return self._client(place.host, port)

    def _named_primary(self, index: int) -> tuple[str, int]:
        host, port = self.sentinel_client(index).sentinel_get_master_addr_by_name(MASTER)
        return (host.decode() if isinstance(host, bytes) else str(host)), int(port)

    def primary(self) -> LocalRedis:
        """The server the sentinels name as primary now (asked of the first that answers)."""
        errors = []
        for index in range(len(self._sentinels)):
            if self._sentinels[index][2] is None:
                continue
            try:
                host, port = self._named_primary(index)
            except (redis.RedisError, TypeError) as exc:
                errors.append(str(exc))
                continue
            for server in self.servers:
                if (server.host, server.port) == (host, port):
                    return server
        raise Unavailable(f"no sentinel names a primary: {'; '.join(errors) or 'none answers'}")

    def wait_healthy(self, timeout_s: float = 20.0, not_primary: LocalRedis | None = None) -> LocalRedis:
        """Waits until every sentinel agrees on one primary (not `not_primary`) that has
        `min_replicas_to_write` replicas online; returns it."""
        deadline = time.monotonic() + timeout_s
        problem = "not asked yet"
        while time.monotonic() < deadline:
            problem = self._health_problem(not_primary)
            if not problem:
                return self.primary()
            time.sleep(0.1)
        raise Unavailable(f"the Redis group is not healthy after {timeout_s:g}s: {problem}")

    def _health_problem(self, not_primary: LocalRedis | None) -> str:
        try:
            addresses = {self._named_primary(i) for i, (_, _, proc) in enumerate(self._sentinels) if proc is not None}
            primary = self.primary()
        except (redis.RedisError, Unavailable, TypeError) as exc:
            return str(exc)
        if len(addresses) != 1:
            return f"the sentinels name {len(addresses)} different primaries"
        live = [i for i, (_, _, proc) in enumerate(self._sentinels) if proc is not None]
        for index in live:
            others = int(self.sentinel_client(index).sentinel_master(MASTER)["num-other-sentinels"])
            if others < len(live) - 1:
                return f"sentinel {index} knows {others} of the {len(live) - 1} others"
        if primary is not_primary:
            return "the old primary is still named"
        try:
            info: dict[str, Any] = self._client(primary.host, primary.port).info("replication")  # type: ignore[assignment]
        except redis.RedisError as exc:
            return f"the primary does not answer: {exc}"
        # Good replicas: online and acknowledging, what min-replicas-to-write counts.
        good = int(info.get("min_slaves_good_slaves", info.get("connected_slaves", 0)))
        if info.get("role") != "master" or good < self.min_replicas_to_write:
            return f"the primary has {good} good replica(s) of {self.min_replicas_to_write} it needs to take writes"
        return ""

    # ---- faults --------------------------------------------------------------------------

    def kill_primary(self) -> LocalRedis:
        """SIGKILLs the current primary; returns it (start it again with `.start()`: it comes
        back as whatever the sentinels make of it, a replica of the new primary)."""
        primary = self.primary()
        primary.kill()
        return primary

    def pause(self, server: LocalRedis) -> None:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGSTOP)

    def resume(self, server: LocalRedis) -> None:
        if server.pid is not None:
            os.kill(server.pid, signal.SIGCONT)

    def kill_sentinel(self, index: int) -> None:
        place, port, proc = self._sentinels[index]
        if proc is not None:
            proc.kill()
            proc.wait()
        self._sentinels[index] = (place, port, None)

    def restart_sentinel(self, index: int) -> None:
        """Starts a killed sentinel again from the config file it rewrote."""
        place, port, proc = self._sentinels[index]
        if proc is None:
            directory = self.data_dir / f"sentinel-{index}"
            binary = shutil.which("redis-server") or "redis-server"
            proc = subprocess.Popen(
                [*place.prefix, binary, str(directory / "sentinel.conf"), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            self._sentinels[index] = (place, port, proc)

    def stop(self) -> None:
        for index, (place, port, proc) in enumerate(self._sentinels):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            self._sentinels[index] = (place, port, None)
        for server in self.servers:
            self.resume(server)
            server.stop()

    def __enter__(self) -> RedisGroup:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
