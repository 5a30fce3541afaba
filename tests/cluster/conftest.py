"""A cluster of network-namespace hosts (unicron_dev.netcluster): four agent hosts, a control
host, two coordinator hosts. Needs root; `make test-cluster` runs these tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import running
from unicron_dev import netns
from unicron_dev.netcluster import NetCluster

pytestmark = pytest.mark.cluster

AGENTS = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetCluster]:
    why = netns.available()
    if why is not None:
        pytest.skip(f"namespace hosts: {why}")
    local = NetCluster(
        tmp_path_factory.mktemp("cluster"),
        agents=AGENTS,
        slots_per_agent=1,
        coordinators=2,
        fault_injection=True,
    )
    yield from running(local)
    assert not [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}")], "namespaces left behind"


# What each fault test measured (detection and recovery seconds), printed after the run: the
# README's table of outcomes comes from here.
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
