"""Redis connections, and a local redis-server for one-machine runs and tests.

A ``rediss://`` URL is Redis over mutual TLS: the client checks the server against a CA and
shows a certificate of its own (``RedisTLS``), as every other hop of the control plane does."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.sentinel import Sentinel

from unicron.errors import FailedPrecondition, Unavailable
from unicron.ports import free_port  # re-exported: servers here and in tests take theirs from it
from unicron.redis_replication import (
    DEFAULT_WAIT_MS,
    ReplicatedRedis,
    SentinelView,
    is_sentinel,
    master_state,
    parse_sentinel_url,
    quorum_problem,
    replication_problem,
    watching_problem,
)


@dataclass(frozen=True)
class RedisTLS:
    """The files of a TLS connection to Redis: the CA that signed the server's certificate,
    and this side's certificate and key (a client's, or the server's own)."""

    ca: str
    cert: str
    key: str


def tls_options(url: str, tls: RedisTLS | None) -> dict[str, Any]:
    """redis-py's keyword arguments for ``url``: none for ``redis://``; for ``rediss://`` (and
    ``rediss+sentinel://``) the CA, certificate and key, and a server certificate that must
    check out."""
    if not url.startswith(("rediss://", "rediss+sentinel://")):
        return {}
    if tls is None:
        raise FailedPrecondition(f"{url} is Redis over TLS: it needs a CA, a certificate and a key")
    return {"ssl_ca_certs": tls.ca, "ssl_certfile": tls.cert, "ssl_keyfile": tls.key, "ssl_cert_reqs": "required"}


# How long the sentinels are asked whether a server written to is still the primary: a
# sentinel that does not answer in time counts as not answering.
SENTINEL_CHECK_S = 0.5


def connect(
    url: str,
    tls: RedisTLS | None = None,
    timeout_s: float = 5.0,
    connect_timeout_s: float = 2.0,
    acks: int = 0,
    wait_ms: int = DEFAULT_WAIT_MS,
) -> redis.Redis:
    """A client of the Redis at `url`: a server (redis://, rediss://, unix://) or the primary
    that sentinels name (redis+sentinel://, followed across failovers). With `acks`, every
    transaction returns only once that many replicas have it (unicron.redis_replication)."""
    if acks < 0 or wait_ms <= 0:
        raise ValueError("acks must not be negative and wait_ms must be positive")
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": connect_timeout_s}
    client: redis.Redis
    if is_sentinel(url):
        where = parse_sentinel_url(url)
        secure = tls_options(url, tls)
        sentinel = Sentinel(
            list(where.sentinels), sentinel_kwargs={**options, **secure, "ssl": where.tls} if where.tls else options
        )
        client = sentinel.master_for(
            where.master,
            redis_class=ReplicatedRedis,
            db=where.db,
            username=where.username,
            password=where.password,
            ssl=where.tls,
            **options,
            **secure,
        )
        assert isinstance(client, ReplicatedRedis)
        if acks:
            client.view = SentinelView(where, sentinel_options(url, tls, timeout_s=min(timeout_s, SENTINEL_CHECK_S)))
    else:
        client = ReplicatedRedis.from_url(url, **options, **tls_options(url, tls))
    assert isinstance(client, ReplicatedRedis)
    client.acks, client.wait_ms = acks, wait_ms
    return client


def sentinel_options(url: str, tls: RedisTLS | None, timeout_s: float = 2.0) -> dict[str, Any]:
    """How to reach the sentinels of a redis+sentinel:// URL (for checks and tools)."""
    options: dict[str, Any] = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if url.startswith("rediss+sentinel://"):
        options.update(tls_options(url, tls), ssl=True)
    return options


def replication_problem_at(url: str, tls: RedisTLS | None, acks: int) -> str | None:
    """Why a coordinator must not act on the Redis at `url` yet (None: it may): no sentinel
    answers, none knows the master, the primary does not answer or has fewer current replicas
    than each write waits for. A quorum that can never fail over is no passing state but a
    mistake: FailedPrecondition."""
    if not is_sentinel(url):
        return None
    where = parse_sentinel_url(url)
    try:
        state = master_state(where, sentinel_options(url, tls))
    except Unavailable as exc:
        return str(exc)
    wrong = quorum_problem(state, len(where.sentinels))
    if wrong is not None:
        raise FailedPrecondition(f"Sentinel master {where.master!r}: {wrong}")
    waiting = watching_problem(state)
    if waiting is not None:
        return waiting
    client = connect(url, tls, timeout_s=2.0)
    try:
        info: dict[str, Any] = client.info("replication")  # type: ignore[assignment]
    except redis.RedisError as exc:
        return f"the primary the sentinels name ({state.get('ip')}:{state.get('port')}) does not answer: {exc}"
    finally:
        client.close()
    return replication_problem(info, acks)


def sentinel_down_after_s(url: str, tls: RedisTLS | None) -> float | None:
    """How long the sentinels wait before they call the primary down (None: not Sentinel, or
    no sentinel answers): a failover takes at least this."""
    if not is_sentinel(url):
        return None
    try:
        state = master_state(parse_sentinel_url(url), sentinel_options(url, tls))
    except Unavailable:
        return None
    return int(state.get("down-after-milliseconds", 0)) / 1000


def redacted(url: str) -> str:
    """`url` with its password masked, for logs (any scheme, one host or many)."""
    return re.sub(r"^([a-z+]+://[^:@/]*):[^@/]*@", r"\1:***@", url)


def reachable(url: str, tls: RedisTLS | None = None) -> bool:
    try:
        return bool(connect(url, tls).ping())
    except redis.RedisError:
        return False


class LocalRedis:
    """A redis-server child process (on 127.0.0.1 unless told) with the append-only file on
    and synced on every write, so a restart of Redis, even after SIGKILL, loses nothing."""

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        host: str = "127.0.0.1",
        prefix: Sequence[str] = (),
        tls: RedisTLS | None = None,
        client_tls: RedisTLS | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        """`host`: the address it binds; `prefix`: what its command line runs under (say
        `ip netns exec <namespace>`, for a test host). `tls`: the server's own certificate and
        key and the CA its clients must show a certificate of; then it serves TLS alone
        (rediss://), and `client_tls` is whom it checks itself as while starting. `extra`:
        more redis-server arguments (a replica's --replicaof, say)."""
        self.data_dir = data_dir
        self.host = host
        self.port = port or (free_port() if host == "127.0.0.1" else 6379)
        self.tls, self.client_tls = tls, client_tls or tls
        self.url = f"{'rediss' if tls else 'redis'}://{host}:{self.port}/0"
        self._prefix = list(prefix)
        self._extra = list(extra)
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 10.0) -> LocalRedis:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FailedPrecondition("redis-server is not installed: run `make redis` (apt-get install redis-server)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            [
                *self._prefix,
                binary,
                "--bind",
                self.host,
                *self._port_arguments(),
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                # Every write reaches the disk before Redis answers: the control plane writes
                # little, and a killed Redis must not take the last second of state with it.
                "--appendfsync",
                "always",
                "--save",
                "",
                # Protected mode refuses every client not on loopback: on a test host's own
                # address (only its namespaces reach it) it would refuse the whole cluster.
                "--protected-mode",
                "yes" if self.host == "127.0.0.1" else "no",
                "--logfile",
                str(self.data_dir / "redis.log"),
                *self._extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise Unavailable(f"redis-server exited early; see {self.data_dir / 'redis.log'}")
            if reachable(self.url, self.client_tls):
                return self
            time.sleep(0.05)
        self.stop()
        raise Unavailable(f"redis-server did not answer on port {self.port} within {timeout_s}s")

    def _port_arguments(self) -> list[str]:
        if self.tls is None:
            return ["--port", str(self.port)]
        # TLS alone, and every client shows a certificate the CA signed.
        return [
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--tls-cert-file",
            self.tls.cert,
            "--tls-key-file",
            self.tls.key,
            "--tls-ca-cert-file",
            self.tls.ca,
            "--tls-auth-clients",
            "yes",
        ]

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc and self._proc.poll() is None else None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no chance to flush anything."""
        if self._proc and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()
