"""Whether this node reaches the other nodes of a job, checked when the job stalls.

A stall whose nodes all still beat may be one host's network: cut off from its peers while
the control plane hears it. Each agent then tries a TCP connection to every other node's
agent at the address the assignment names (the node's data-network address): one that
answers, or refuses, is reachable; one that times out, or whose network is unreachable, is
not. The coordinator compares the accounts (services/coordinator/links.py)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Mapping

# Longer than a round trip on any data network, short enough not to hold the hang report
# back: a peer that does not answer a connection within this is cut off for the job's
# collectives too, which time out after seconds.
PROBE_TIMEOUT_S = 0.5


def reaches(address: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to host:port is answered (accepted or refused) in time."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except ConnectionRefusedError:
        return True  # the host answered: the network between us works
    except (OSError, ValueError):
        return False


def check(peers: Mapping[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> tuple[list[str], list[str]]:
    """The peers (node id -> address) that do not answer, and those that do, probed at once
    so that the whole check takes one timeout."""
    answers: dict[str, bool] = {}

    def probe(node_id: str, address: str) -> None:
        answers[node_id] = reaches(address, timeout_s)

    threads = [threading.Thread(target=probe, args=item, daemon=True) for item in peers.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 1.0)
    unreachable = sorted(n for n in peers if not answers.get(n, False))
    return unreachable, sorted(n for n in peers if answers.get(n, False))
