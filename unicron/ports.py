"""Free TCP ports for servers this project starts on one machine (rendezvous stores, Redis,
test servers), chosen below the kernel's ephemeral range.

Why not the kernel's own choice (bind to port 0, then close): that port lies in the
ephemeral range, which the kernel hands out again, to every server that binds port 0 (a
gRPC server on "127.0.0.1:0") and as the source port of every client socket, until the
caller's server binds it. Seen in CI: a rank's TCPStore client reached the fake agent's
gRPC server on the port chosen for its store and read an HTTP/2 SETTINGS frame ("Ping
failed, invalid value returned from server. Expected: 18727, Got: 68681728", that is
00 00 18 04), and the rank died. A client retrying its connect before the server is up
(TCPStore does, every few milliseconds) can even be given the port as its own source and
connect to itself. A port below the range is neither: nothing takes it but a caller that
names it."""

from __future__ import annotations

import random
import socket
import threading
import time
from pathlib import Path

EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default
# Below these: the well-known and registered services people run; 29500-29999 is the
# coordinator's rendezvous range on other hosts (decide.RENDEZVOUS_PORTS).
LOWEST = 20000
RESERVED = range(29500, 30000)
_ATTEMPTS = 200
# A port handed out is not bound until its server starts (seconds, for a Python service), and
# a second call meanwhile finds it free: seen in CI, a test cluster's metrics port and its
# coordinator's port were one. So a port this process handed out is not handed out again
# for this long.
REISSUE_AFTER_S = 600.0
_issued: dict[int, float] = {}
_issued_lock = threading.Lock()


def ephemeral_range(path: Path = EPHEMERAL_RANGE_FILE) -> tuple[int, int]:
    """The kernel's ephemeral port range (first, last); Linux's default where it cannot be read."""
    try:
        low, high = (int(word) for word in path.read_text().split())
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL
    return low, high


def candidates(ephemeral: tuple[int, int]) -> list[int]:
    """The ports free_port may choose from: from LOWEST up to the ephemeral range, less RESERVED."""
    return [port for port in range(LOWEST, ephemeral[0]) if port not in RESERVED]


def free_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A TCP port free on `host` now, outside the ephemeral range (module docstring), drawn at
    random so that concurrent processes rarely draw the same, and never one this process
    handed out in the last REISSUE_AFTER_S; the kernel's own choice when that range leaves
    none (an unusual ip_local_port_range). OSError when `host` is not an address of this
    machine."""
    draw = rng or random.SystemRandom()
    now = time.monotonic()
    with _issued_lock:
        for port, at in list(_issued.items()):
            if now - at >= REISSUE_AFTER_S:
                del _issued[port]
        pool = [port for port in candidates(ephemeral_range()) if port not in _issued]
        for port in draw.sample(pool, min(_ATTEMPTS, len(pool))):
            with socket.socket() as sock:
                try:
                    sock.bind((host, port))
                except OSError as exc:
                    if exc.errno == 99:  # EADDRNOTAVAIL: not this machine's address at all
                        raise
                    continue  # in use
            _issued[port] = now
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
