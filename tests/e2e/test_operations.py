"""What an operator sees and does on a real cluster (Redis, coordinator, planners, two agents,
Megatron-Core trainers on gloo): why a job got its size and what it was measured to achieve,
a job whose checkpoints fail shown as such, and a node drained for maintenance and returned."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import running, wait_for
from unicron import jobspec
from unicron.v1 import common_pb2
from unicron_dev.localcluster import ROOT, LocalCluster, gpt_program

pytestmark = pytest.mark.e2e
RUNNING = common_pb2.JOB_STATE_RUNNING


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir = Path(tmp_path_factory.mktemp("operations"))
    # The agents' checkpoint root is a file: every checkpoint fails (NotADirectoryError), as
    # on a full or read-only volume, while training goes on.
    blocked = run_dir / "checkpoints-volume"
    blocked.write_text("not a directory\n")
    yield from running(
        LocalCluster(run_dir, agents=2, slots_per_agent=2, agent_args=["--checkpoint-dir", str(blocked)])
    )


ACTIVE = [common_pb2.JOB_STATE_PENDING, common_pb2.JOB_STATE_SCHEDULED, RUNNING, common_pb2.JOB_STATE_RECOVERING]


@pytest.fixture(autouse=True)
def every_node_in_service(cluster: LocalCluster) -> Iterator[None]:
    """The tests share one cluster: each starts with both nodes READY and none drained, and
    ends with its jobs cancelled and its nodes uncordoned whatever it asserted, so that a
    failure stays in its test instead of taking the next one's slots."""
    deadline = time.monotonic() + 30
    with cluster.client() as client:
        while True:
            nodes = client.nodes()
            if all(n.state == common_pb2.NODE_STATE_READY and not n.cordoned for n in nodes):
                break
            states = {n.node_id: (common_pb2.NodeState.Name(n.state), n.cordoned) for n in nodes}
            assert time.monotonic() < deadline, f"nodes out of service before the test: {states}"
            time.sleep(0.2)
    yield
    with cluster.client() as client:
        for job in client.list_jobs(ACTIVE):
            client.cancel(job.job_id, "the test is over")
        for node in client.nodes():
            if node.cordoned:
                client.uncordon(node.node_id)


def unicron(cluster: LocalCluster, *args: str, user: str = "admin") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unicron.cli", "--coordinator", cluster.coordinator, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **cluster.client_env(user)},
    )


def spec(
    name: str, data: int, min_data: int, iterations: int, tensor: int = 1, throughput: dict[int, float] | None = None
) -> common_pb2.JobSpec:
    """`throughput`: a profile (size -> FLOP/s), which the planner takes over its own
    measurements: the job keeps the size the profile favours."""
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                **({"throughput": throughput} if throughput else {}),
                "program": gpt_program(),
                "parallelism": {"data": data, "min_data": min_data, "tensor": tensor},
                "training": {
                    "iterations": iterations,
                    "global_batch_size": 8,
                    "micro_batch_size": 2,
                    "checkpoint_interval": 2,
                },
            }
        )
    )


def test_a_job_says_why_its_size_learns_its_throughput_and_shows_failing_checkpoints(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = client.submit(spec("ops-explained", data=2, min_data=1, iterations=400))
        job = wait_for(client, job.job_id, lambda j: j.progress.iteration >= 8, "trains", 180)
        placed = next(c.reason for c in job.history if c.reason.startswith("placed on"))
        assert "FLOP/s by size 1: " in placed and "2: " in placed, placed
        job = wait_for(client, job.job_id, lambda j: bool(j.progress.measured_flops_per_second), "measured", 60)
        assert all(v > 0 for v in job.progress.measured_flops_per_second.values())
        job = wait_for(client, job.job_id, lambda j: bool(j.conditions), "a condition", 60)
        (condition,) = job.conditions
        assert condition.type == "checkpoints_failing" and condition.since_iteration >= 2
        shown = unicron(cluster, "get", job.job_id)
        assert "condition  checkpoints failing since iteration" in shown.stdout, shown.stdout + shown.stderr
        assert "throughput " in shown.stdout and "measured" in shown.stdout
        # Measured, the job may be re-planned to another size (on 2 shared cores one rank can
        # beat two): a move, not a failure.
        wait_for(client, job.job_id, lambda j: j.state == RUNNING, "running", 60)
        assert not client.incidents(job.job_id)
        client.cancel(job.job_id)


def test_a_drained_node_gives_up_its_ranks_without_an_incident_and_comes_back(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = client.submit(spec("ops-drained", data=2, min_data=1, iterations=1_000_000))
        job = wait_for(client, job.job_id, lambda j: j.progress.iteration >= 3, "trains", 180)
        node = job.assignment.workers[0].node_id
        drained = unicron(cluster, "drain", node)
        assert drained.returncode == 0 and f"drained {node}; moving {job.job_id} off it" in drained.stdout, drained
        start = job.progress.iteration

        def moved(j: common_pb2.Job) -> bool:
            nodes = {w.node_id for w in j.assignment.workers}
            return node not in nodes and j.state == common_pb2.JOB_STATE_RUNNING and j.progress.iteration > start + 3

        after = wait_for(client, job.job_id, moved, "moved off the drained node", 180)
        assert not after.remedies and not client.incidents(after.job_id)
        assert "drained" in unicron(cluster, "nodes").stdout
        # Nothing more lands there while it is drained; uncordoned, it is used again.
        time.sleep(2)
        assert node not in {w.node_id for w in client.get(job.job_id).assignment.workers}
        back = unicron(cluster, "uncordon", node)
        assert back.returncode == 0, back
        client.cancel(job.job_id)


def test_a_tensor_parallel_job_shrinks_with_its_shards_in_memory_and_frees_them_when_over(
    cluster: LocalCluster,
) -> None:
    """TP 2 x DP 2 over both agents, one tensor group a node. Drained, a node gives up its
    replica and the other node's ranks go on in place at DP 1, each with its own shard. Every
    checkpoint of this cluster fails, so the state can only have stayed in the ranks' memory.
    (The grow back is the planner's call on measured throughput, which on 2 shared cores may
    favour one replica: tests/trainer/test_exactness.py grows a TP 2 job from its peers.)
    Cancelled, the job's snapshots leave the nodes' tmpfs."""
    with cluster.client() as client:
        # A profile that favours both replicas: measured on 2 shared cores, one replica can
        # beat two, and the planner would shrink the job before the drain does.
        profile = {2: 1e9, 4: 2e9}
        job = client.submit(spec("ops-tensor", data=2, min_data=1, iterations=1_000_000, tensor=2, throughput=profile))
        job = wait_for(client, job.job_id, lambda j: j.progress.iteration >= 3 and j.state == RUNNING, "trains", 180)
        assert job.assignment.world_size == 4
        node = job.assignment.workers[0].node_id
        assert client.drain(node)[1] == [job.job_id]
        start = job.progress.iteration

        def shrunk_and_training(j: common_pb2.Job) -> bool:
            return j.assignment.world_size == 2 and j.state == RUNNING and j.progress.iteration > start + 3

        shrunk = wait_for(client, job.job_id, shrunk_and_training, "shrunk to one replica", 180)
        kept = [c.reason for c in shrunk.history if "in place" in c.reason]
        assert kept and "keeping ranks [2, 3] in place" in kept[-1], kept
        assert not shrunk.remedies and not client.incidents(job.job_id)
        (kept_node,) = {w.node_id for w in shrunk.assignment.workers}
        snapshots = cluster.run_dir / "snapshots" / kept_node / job.job_id
        assert snapshots.is_dir()
        client.uncordon(node)
        client.cancel(job.job_id)
        deadline = time.monotonic() + 30
        while snapshots.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not snapshots.exists()


def test_a_drain_with_nowhere_to_go_an_unknown_node_and_a_user_are_refused(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        job = client.submit(spec("ops-wide", data=4, min_data=4, iterations=1_000_000))
        wait_for(client, job.job_id, lambda j: j.state == common_pb2.JOB_STATE_RUNNING, "runs", 180)
        refused = unicron(cluster, "drain", "node-a")
        assert refused.returncode != 0 and job.job_id in refused.stderr and "Traceback" not in refused.stderr
        assert not any(n.cordoned for n in client.nodes())
        unknown = unicron(cluster, "drain", "node-zz")
        assert unknown.returncode != 0 and "not found" in unknown.stderr
        user = unicron(cluster, "drain", "node-b", user="alice")
        assert user.returncode != 0 and "admin" in user.stderr
        client.cancel(job.job_id)
