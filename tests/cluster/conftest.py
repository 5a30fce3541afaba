"""A cluster of network-namespace hosts (unicron_dev.netcluster): four agent hosts, a control
host, two coordinator hosts. Needs root; `make test-cluster` runs these tests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.e2e.conftest import assert_exact, final_params, running, wait_for  # noqa: F401 (re-exported)
from unicron.client import UnicronClient
from unicron.v1 import common_pb2
from unicron_dev import netns
from unicron_dev.localcluster import tiny_gpt
from unicron_dev.netcluster import NetCluster

pytestmark = pytest.mark.cluster

AGENTS = 4


def namespace_hosts() -> None:
    """Skips the module where namespace hosts cannot be made (not root, no iproute2)."""
    why = netns.available()
    if why is not None:
        pytest.skip(f"namespace hosts: {why}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    namespace_hosts()
    local = NetCluster(
        tmp_path_factory.mktemp("cluster"),
        agents=AGENTS,
        slots_per_agent=1,
        coordinators=2,
        fault_injection=True,
    )
    yield from running(local)
    assert not [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}")], "namespaces left behind"


# Every elastic job of these tests runs this many iterations, so that its final parameters
# can be compared with one failure-free run's (a checkpoint every 10 iterations, the last
# one at the end).
ITERATIONS = 120


def elastic(name: str, iterations: int = ITERATIONS) -> common_pb2.JobSpec:
    """Four ranks that may shrink to two or three (a batch of 12 splits over each)."""
    spec = tiny_gpt(name, data=4, iterations=iterations)
    spec.parallelism.min_data = 2
    spec.training.global_batch_size, spec.training.micro_batch_size = 12, 1
    return spec


def succeeded_once(client: UnicronClient, name: str) -> common_pb2.Job:
    job = wait_for(client, name, lambda j: j.state == common_pb2.JOB_STATE_SUCCEEDED, "did not succeed", 180)
    ends = [h for h in job.history if h.state == common_pb2.JOB_STATE_SUCCEEDED]
    assert len(ends) == 1, job.history
    return job


def nodes_of(job: common_pb2.Job) -> set[str]:
    return {w.node_id for w in job.assignment.workers if w.ranks}


@pytest.fixture(scope="module")
def reference(cluster: NetCluster) -> dict[str, Any]:
    """The final parameters of a failure-free run of `elastic`'s job on four hosts."""
    with cluster.client() as client:
        client.submit(elastic("reference"))
        return final_params(cluster, succeeded_once(client, "reference"))


# What each fault test measured (detection and recovery seconds), printed after the run: the
# table of outcomes in docs/cluster-tests.md comes from here.
OUTCOMES: list[dict[str, object]] = []


def record(fault: str, **measured: object) -> None:
    OUTCOMES.append({"fault": fault, **measured})


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not OUTCOMES:
        return
    terminalreporter.section("network faults: what was measured")
    for outcome in OUTCOMES:
        fields = ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in outcome.items() if k != "fault"
        )
        terminalreporter.write_line(f"{outcome['fault']}: {fields}")
