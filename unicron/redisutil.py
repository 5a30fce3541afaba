"""Redis connections, and a local redis-server for one-machine runs and tests."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import redis

from unicron.errors import FailedPrecondition, Unavailable


def connect(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)


def reachable(url: str) -> bool:
    try:
        return bool(connect(url).ping())
    except redis.RedisError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class LocalRedis:
    """A redis-server child process (on 127.0.0.1 unless told) with the append-only file on
    and synced on every write, so a restart of Redis, even after SIGKILL, loses nothing."""

    def __init__(
        self, data_dir: Path, port: int | None = None, host: str = "127.0.0.1", prefix: Sequence[str] = ()
    ) -> None:
        """`host`: the address it binds; `prefix`: what its command line runs under (say
        `ip netns exec <namespace>`, for a test host)."""
        self.data_dir = data_dir
        self.host = host
        self.port = port or (free_port() if host == "127.0.0.1" else 6379)
        self.url = f"redis://{host}:{self.port}/0"
        self._prefix = list(prefix)
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
                "--port",
                str(self.port),
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
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise Unavailable(f"redis-server exited early; see {self.data_dir / 'redis.log'}")
            if reachable(self.url):
                return self
            time.sleep(0.05)
        self.stop()
        raise Unavailable(f"redis-server did not answer on port {self.port} within {timeout_s}s")

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
