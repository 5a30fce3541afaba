"""Two real planner processes; one is killed while the coordinator's client keeps planning."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from services.coordinator.planner_client import PlannerClient
from unicron import rpc
from unicron.redisutil import free_port
from unicron.v1 import planner_service_pb2 as pb
from unicron_dev.localcluster import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def replicas() -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    started = []
    for _ in range(2):
        address = f"127.0.0.1:{free_port()}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.planner", "--bind", address, "--log-level", "warning", "--plaintext"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        started.append((address, proc))
    for address, _ in started:
        assert rpc.wait_ready(address, timeout_s=30)
    yield started
    for _, proc in started:
        proc.kill()
        proc.wait()


def test_plans_keep_coming_while_a_replica_is_killed(replicas: list[tuple[str, subprocess.Popen[bytes]]]) -> None:
    client = PlannerClient([address for address, _ in replicas], timeout_s=10)
    request = pb.PlanRequest(failure_rate_per_node_per_second=1e-6, time_limit_seconds=1)
    request.nodes.add(node_id="n1", slots=4, healthy=True)
    request.jobs.add(
        job_id="j", weight=1, tensor_parallel=1, pipeline_parallel=1, min_data_parallel=1, max_data_parallel=4
    )
    results: list[int] = []
    errors: list[BaseException] = []

    def keep_planning() -> None:
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline:
            try:
                results.append(client.plan(request).jobs[0].size)
            except BaseException as exc:  # noqa: BLE001 - collected and asserted below
                errors.append(exc)
            # A coordinator's pace, not a flood: a caller past the planner's rate limit
            # (200 a second) is refused by design, which is not what this test is about.
            time.sleep(0.01)

    worker = threading.Thread(target=keep_planning)
    worker.start()
    time.sleep(2)
    replicas[0][1].send_signal(signal.SIGKILL)  # mid-run
    worker.join()
    assert not errors, errors
    assert len(results) > 10 and set(results) == {4}
