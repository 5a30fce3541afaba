"""What every end-to-end module does with its LocalCluster: start it, wait for the agents,
and at the end check that stopping it left no process behind."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc
import psutil

from tests.trainer.harness import relative_difference
from unicron.client import ClientError, UnicronClient
from unicron.trainer import checkpoint
from unicron.v1 import common_pb2
from unicron_dev.localcluster import LocalCluster

C = TypeVar("C", bound=LocalCluster)


def running(local: C) -> Iterator[C]:
    """Yields the started cluster once all its agents are READY; stops it even when the
    test module fails, and asserts nothing outlived it."""
    local.start()
    try:
        with local.client() as client:
            local.wait_nodes(client.nodes, local.agents)
        yield local
    finally:
        services = [s.proc.pid for s in local.services]
        leftovers = local.stop()
        assert leftovers == [], "processes outlived their service's shutdown"
        assert not [pid for pid in services if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]


def wait_for(
    client: UnicronClient, name: str, done: Callable[[common_pb2.Job], bool], what: str, timeout_s: float = 120
) -> common_pb2.Job:
    deadline = time.monotonic() + timeout_s
    while not done(job := _get_through_outages(client, name, deadline)):
        recent = "; ".join(c.reason for c in job.history[-4:])
        assert time.monotonic() < deadline, f"{name}: {what} (state {job.state}, {job.reason}; lately: {recent})"
        time.sleep(0.2)
    return job


def _get_through_outages(client: UnicronClient, name: str, deadline: float) -> common_pb2.Job:
    """The job, asked again while the control plane is away (a coordinator or its Redis
    failing over) until `deadline`: a test that waits for an outcome waits through that."""
    while True:
        try:
            return client.get(name)
        except ClientError as exc:
            if exc.code != grpc.StatusCode.UNAVAILABLE or time.monotonic() >= deadline:
                raise
            time.sleep(0.5)


def final_params(cluster: LocalCluster, job: common_pb2.Job) -> dict[str, Any]:
    """The model parameters of the job's last checkpoint, which must be of its last
    iteration (the agents of these hosts share one checkpoint directory)."""
    root = cluster.run_dir / "agents" / "checkpoints" / job.job_id
    (iteration, *_) = checkpoint.list_complete(root)
    assert iteration == job.spec.training.iterations
    saved = checkpoint.read_manifest(root, iteration)["layout"]
    found = checkpoint.find_latest(root, checkpoint.layout_of_config(saved["model"], 1, 1))
    assert found is not None and found[0] == iteration
    return dict(found[1]["model"])


def assert_exact(cluster: LocalCluster, job: common_pb2.Job, reference: dict[str, Any]) -> None:
    """The job's final parameters equal the failure-free run's, every tensor within 1e-6
    relative (the global batch is the same at every data-parallel degree)."""
    worst = relative_difference(final_params(cluster, job), reference)
    assert worst <= 1e-6, f"a tensor differs from the failure-free run's by {worst:.2e} relative"
