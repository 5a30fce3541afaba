"""The converted Megatron-Core script (examples/mcore_loop/converted.py, docs/trainer-library.md
"Converting a Megatron-Core script") as a Unicron job, unchanged: tensor 2 x data 2 over two
agents of two slots, with Megatron's default dropout (0.1), through the CLI as a user submits
it, with one trainer crashed midway. It heals, trains every iteration, succeeds, leaves its
trained model where the guide says, and that model is bit-identical to a failure-free run's.
``make bench-conversion`` takes the same job through every other kind of remedy."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from bench.conversion import model_distance
from tests.e2e.conftest import running, wait_for
from tests.e2e.test_demo_path import unicron
from unicron.v1 import common_pb2
from unicron_dev.localcluster import LocalCluster

pytestmark = pytest.mark.e2e

ITERATIONS = 60
SPEC = {
    "name": "e2e-conversion",
    "program": {"entry_point": "examples.mcore_loop.converted:main", "args": ["--dropout", "0.1"]},
    "parallelism": {"tensor": 2, "data": 2},
    "training": {
        "iterations": ITERATIONS,
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "learning_rate": 0.001,
        "seed": 1234,
        "checkpoint_interval": 10,
    },
}
ENDED = (common_pb2.JOB_STATE_SUCCEEDED, common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # LocalCluster's defaults: two agents of two slots, so each TP pair has a node of its own.
    yield from running(LocalCluster(Path(tmp_path_factory.mktemp("conversion")), fault_injection=True))


def final_model(cluster: LocalCluster, job_id: str) -> Path:
    """The agent's per-job checkpoint directory's final/, as Megatron-LM's save directory (the
    job keeps Unicron's format for its own checkpoints)."""
    return cluster.run_dir / "agents" / "checkpoints" / job_id / "final"


def submit(cluster: LocalCluster, tmp_path: Path, name: str) -> str:
    spec_file = tmp_path / f"{name}.yaml"
    spec_file.write_text(yaml.safe_dump({**SPEC, "name": name}))
    job_id: str = json.loads(unicron(cluster, "--json", "submit", str(spec_file)).stdout)["job_id"]
    return job_id


@pytest.fixture(scope="module")
def failure_free(cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory) -> common_pb2.Job:
    job_id = submit(cluster, tmp_path_factory.mktemp("failure-free"), "e2e-conversion-reference")
    with cluster.client() as client:
        job = wait_for(client, job_id, lambda j: j.state in ENDED, "never ended", timeout_s=300)
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED, job.reason
    return job


def test_the_converted_script_runs_as_a_job_and_heals_a_crash(
    cluster: LocalCluster, failure_free: common_pb2.Job, tmp_path: Path
) -> None:
    job_id = submit(cluster, tmp_path, "e2e-conversion")
    with cluster.client() as client:
        try:
            wait_for(client, job_id, lambda j: j.progress.iteration >= 2, "never trained", timeout_s=180)
            # Rank 3: the second TP pair's, on the other node. It dies before its next iteration.
            unicron(cluster, "inject", job_id, "crash", "--rank", "3")
            watched = unicron(cluster, "watch", job_id, check=False)
            job = client.get(job_id)
            incidents = [i for i in client.incidents(job_id) if i.kind != common_pb2.FAILURE_KIND_STRAGGLER]
        finally:
            if client.get(job_id).state not in ENDED:
                client.cancel(job_id)  # whatever happened, nothing is left running
    story = "\n".join(f"{i.incident_id} {i.summary} -> {i.action_taken}" for i in incidents)
    assert watched.returncode == 0, f"{watched.stdout}{watched.stderr}{job.reason}\n{story}"
    assert job.state == common_pb2.JOB_STATE_SUCCEEDED
    assert job.progress.iteration == ITERATIONS
    assert sorted({w.node_id for w in job.assignment.workers}) == ["node-a", "node-b"]
    assert job.assignment.world_size == 4
    # The crash was one incident, healed by a restart of the rank.
    assert [i.kind for i in incidents] == [common_pb2.FAILURE_KIND_PROCESS_EXIT], story
    assert "rank 3" in incidents[0].summary and incidents[0].HasField("resumed"), story
    assert job.remedies and job.remedies[0].remedy == common_pb2.REMEDY_RESTART
    final = final_model(cluster, job_id)
    assert (final / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    assert (final / f"iter_{ITERATIONS:07d}" / "metadata.json").exists()
    # Dropout on, the rank restarted from a live peer: the same masks, the same model, bit for
    # bit (a new user saw 1.92495 against 1.93348 when masks followed the rank's own stream).
    assert job.progress.loss == failure_free.progress.loss
    assert model_distance(final_model(cluster, failure_free.job_id), final) == 0.0
