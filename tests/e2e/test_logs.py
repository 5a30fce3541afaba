"""`unicron logs` with every service a real process over mutual TLS: each rank's output read
from its own node's agent through the coordinator (which the agents admit by its
certificate), followed as it is written, and refused, in one line, to another user and for
a rank the job does not have."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

from tests.e2e.conftest import running, wait_for
from tests.e2e.log_program import MARK
from unicron import jobspec
from unicron.v1 import common_pb2, logs_pb2
from unicron_dev.localcluster import ROOT, LocalCluster

pytestmark = pytest.mark.e2e

OUT, ERR = logs_pb2.LOG_STREAM_STDOUT, logs_pb2.LOG_STREAM_STDERR


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # One slot per node: the job's two ranks run on two nodes, each read from its own agent.
    yield from running(LocalCluster(Path(tmp_path_factory.mktemp("e2e-logs")), slots_per_agent=1))


def spec(name: str) -> common_pb2.JobSpec:
    return jobspec.normalized(
        jobspec.spec_from_dict(
            {
                "name": name,
                "program": {"entry_point": "tests.e2e.log_program:main", "working_dir": str(ROOT)},
                "parallelism": {"data": 2},
                "training": {"iterations": 100_000, "global_batch_size": 64, "micro_batch_size": 1, "seed": 3},
            }
        )
    )


def text(chunks: Iterable[logs_pb2.LogChunk], stream: int) -> str:
    return b"".join(c.data for c in chunks if c.stream == stream).decode()


def unicron(cluster: LocalCluster, user: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "unicron.cli", "--coordinator", cluster.coordinator, *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, **cluster.client_env(user)},
    )


def test_each_rank_s_output_comes_from_its_own_node(cluster: LocalCluster) -> None:
    with cluster.client() as admin:
        job = admin.submit(spec("logs-e2e"))
        job = wait_for(admin, job.job_id, lambda j: j.progress.iteration >= 3, "three iterations", timeout_s=180)
        nodes = {rank: w.node_id for w in job.assignment.workers for rank in w.ranks}
        assert sorted(nodes) == [0, 1] and nodes[0] != nodes[1], nodes
        for rank in (0, 1):
            chunks = list(admin.logs(job.job_id, rank))
            assert f"{MARK} rank {rank} iteration 1\n" in text(chunks, OUT)
            assert f"{MARK} rank {rank} started" in text(chunks, ERR)

        # Following: only what is written from now on, as it is written.
        followed = admin.logs(job.job_id, rank=1, follow=True, tail_lines=0, streams=[OUT])
        received = ""
        while received.count("\n") < 3:
            received += next(followed).data.decode()
        followed.close()
        iterations = [int(line.rsplit(" ", 1)[1]) for line in received.splitlines()]
        assert iterations == list(range(iterations[0], iterations[0] + len(iterations))) and iterations[0] > 1

        # The CLI: the last lines, another user's view, a rank the job does not have.
        tailed = unicron(cluster, "admin", "logs", job.spec.name, "--rank", "1", "--tail", "2", "--stream", "stdout")
        assert tailed.returncode == 0, tailed.stderr
        assert len(tailed.stdout.splitlines()) == 2 and tailed.stdout.startswith(f"{MARK} rank 1 iteration ")
        hidden = unicron(cluster, "alice", "logs", job.job_id)
        assert (hidden.returncode, hidden.stdout) == (2, "")
        assert hidden.stderr == f"unicron: no job with id or name '{job.job_id}'\n"
        outside = unicron(cluster, "admin", "logs", job.job_id, "--rank", "2")
        assert (outside.returncode, outside.stderr) == (2, "unicron: rank: must be below the job's world size 2\n")
        admin.cancel(job.job_id)
