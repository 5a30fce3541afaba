"""Which node a stalled job's reachability accounts blame (services/coordinator/links.py),
by a table of cases; and the agent's check of its peers (services/agent/peers.py) against
real sockets."""

from __future__ import annotations

import socket
import time

import pytest

from services.agent import peers
from services.coordinator import incidents, links
from unicron.v1 import common_pb2 as pb

JOB = {"a", "b", "c", "d"}


def hang(node: str, unreachable: str = "", reachable: str = "", generation: int = 1) -> pb.FailureReport:
    out = pb.FailureReport(
        job_id="j",
        generation=generation,
        node_id=node,
        kind=pb.FAILURE_KIND_TASK_HANG,
        source=pb.DETECTION_SOURCE_STATISTICAL,
        unreachable_peers=list(unreachable),
        reachable_peers=list(reachable),
    )
    out.first_seen.FromNanoseconds(10**9)
    return out


def incident(*reports: pb.FailureReport) -> pb.Incident:
    merged = None
    for r in reports:
        merged = incidents.merge(merged, r, 2.0, "inc-1")
    assert merged is not None
    return merged


CUT_D = [hang("a", "d", "bc"), hang("b", "d", "ac"), hang("c", "d", "ab"), hang("d", "abc", "")]


@pytest.mark.parametrize(
    ("reports", "parted"),
    [
        # d is cut off from its peers: it reaches none of them, they reach all but d.
        (CUT_D, {"d"}),
        # A hang of the program: every node reaches every other.
        ([hang("a", "", "bcd"), hang("b", "", "acd"), hang("c", "", "abd"), hang("d", "", "abc")], set()),
        # d cannot reach a alone, and the others still reach d: d's link to a is down.
        ([hang("a", "", "bcd"), hang("b", "", "acd"), hang("c", "", "abd"), hang("d", "a", "bc")], set()),
        # The job split in halves (a, b | c, d): no node is the odd one out.
        ([hang("a", "cd", "b"), hang("b", "cd", "a"), hang("c", "ab", "d"), hang("d", "ab", "c")], set()),
        # Not every node has given its account: one end of a link cannot tell which failed.
        (CUT_D[2:], set()),
        # An account of an older generation says nothing about this one.
        ([*CUT_D[:3], hang("d", "abc", "", generation=0)], set()),
    ],
)
def test_the_node_cut_off_from_its_peers_is_found(reports: list[pb.FailureReport], parted: set[str]) -> None:
    assert links.parted_nodes(incident(*reports), JOB) == parted


def test_every_nodes_account_is_awaited_once_a_link_is_named() -> None:
    assert links.accounts_pending(incident(hang("d", "abc", "")), JOB)
    assert not links.accounts_pending(incident(hang("d", "", "abc")), JOB)  # the program's hang
    assert not links.accounts_pending(incident(*CUT_D), JOB)


def test_the_agent_tells_a_peer_that_answers_from_one_that_does_not() -> None:
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: the host answers with a refusal
    # A listener whose accept queue is full drops new connections' SYNs: to a connecting
    # peer it looks like a host that has gone.
    full = socket.socket()
    full.bind(("127.0.0.1", 0))
    full.listen(0)
    queued = [socket.create_connection(full.getsockname(), timeout=1)]
    try:
        checked = {
            "up": f"127.0.0.1:{listening.getsockname()[1]}",
            "refusing": f"127.0.0.1:{closed.getsockname()[1]}",
            "gone": f"127.0.0.1:{full.getsockname()[1]}",
            "nonsense": "not-an-address",
        }
        began = time.monotonic()
        unreachable, reachable = peers.check(checked, timeout_s=0.3)
        assert reachable == ["refusing", "up"]
        assert unreachable == ["gone", "nonsense"]
        assert time.monotonic() - began < 1.0  # probed at once, not one after another
    finally:
        for s in (listening, closed, full, *queued):
            s.close()
