"""Chaos: while two jobs train, kill trainers, an agent, a planner replica and the active
coordinator, and crash Redis, one after another; the test plays each service's supervisor
(systemd, Kubernetes), starting again whatever died. At the end every job is still training or
has finished, none was lost or duplicated, and each job's event log tells what happened to it."""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import running
from unicron.client import ClientError, UnicronClient
from unicron.v1 import common_pb2
from unicron_dev.localcluster import LocalCluster, tiny_gpt

pytestmark = pytest.mark.e2e

log = logging.getLogger(__name__)
ITERATIONS = 250
JOBS = ("chaos-a", "chaos-b")
EventType = common_pb2.JobEventType
# Each kind of process dies at least once. A job's own trainers are killed at most twice: a
# third death of the same job within minutes is, by the escalation ladder, a job to give up on.
SCHEDULE = ["trainer:0", "trainer:1", "agent", "planner", "coordinator", "redis", "trainer:any"]
PAUSE_S = (3.0, 5.0)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    local = LocalCluster(Path(tmp_path_factory.mktemp("chaos")), agents=3, coordinators=2, planners=2)
    yield from running(local)


def retrying(call: Callable[[], object], timeout_s: float = 30.0) -> object:
    """The answer of `call` once the control plane answers again (during a Redis or
    coordinator restart it is UNAVAILABLE for a while)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ClientError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def supervise(cluster: LocalCluster) -> list[str]:
    """Starts again every service that is not running, as its supervisor would."""
    restarted = []
    for service in cluster.services:
        if service.proc.poll() is not None:
            cluster.restart(service.name)
            restarted.append(service.name)
    return restarted


def kill_a_trainer(cluster: LocalCluster, job_id: str, rng: random.Random) -> str:
    procs = cluster.trainer_processes(job_id)
    if not procs:
        return f"no live trainer of {job_id}"
    proc = rng.choice(procs)
    try:
        proc.kill()
    except psutil.NoSuchProcess:
        return f"trainer {proc.pid} of {job_id} was already gone"
    return f"killed trainer {proc.pid} of {job_id}"


def act(cluster: LocalCluster, action: str, jobs: list[str], rng: random.Random) -> str:
    if action.startswith("trainer:"):
        which = action.split(":", 1)[1]
        job_id = rng.choice(jobs) if which == "any" else jobs[int(which)]
        return kill_a_trainer(cluster, job_id, rng)
    if action == "agent":
        node = rng.choice([s.name for s in cluster.services if s.name.startswith("node-")])
        cluster.kill(node)
        cluster.service(node).proc.wait()
        return f"killed agent {node}"
    if action == "planner":
        name = rng.choice([s.name for s in cluster.services if s.name.startswith("planner-")])
        cluster.kill(name)
        cluster.service(name).proc.wait()
        return f"killed planner {name}"
    if action == "coordinator":
        active = cluster.wait_active_coordinator()
        cluster.kill(active)
        cluster.service(active).proc.wait()
        cluster.wait_active_coordinator(timeout_s=20, not_this=active)
        return f"killed the active coordinator {active}"
    if action == "redis":
        cluster.restart_redis()
        return "crashed and restarted Redis"
    raise ValueError(action)


def unfinished(client: UnicronClient, jobs: list[str]) -> str:
    """Each job's state, workers and incidents: what a stuck job waits for."""
    lines = []
    for job_id in jobs:
        job = client.get(job_id)
        workers = ", ".join(f"{w.node_id}:{w.generation}:{w.state}" for w in job.workers)
        lines.append(
            f"{job_id} {common_pb2.JobState.Name(job.state)} at {job.progress.iteration}, "
            f"generation {job.assignment.generation} ({job.reason}); workers {workers}"
        )
        for i in client.incidents(job_id):
            lines.append(f"  {i.incident_id} {common_pb2.FailureKind.Name(i.kind)} remedy {i.remedy}: {i.summary}")
    return "\n".join(lines)


def test_jobs_survive_chaos_and_their_logs_tell_the_story(cluster: LocalCluster) -> None:
    # A failing run prints its seed; UNICRON_CHAOS_SEED plays the same schedule again.
    seed = int(os.environ.get("UNICRON_CHAOS_SEED") or time.time())
    rng = random.Random(seed)
    schedule = SCHEDULE[:]
    rng.shuffle(schedule)
    print(f"chaos seed {seed}: {schedule}")
    with cluster.client() as client:
        jobs = [client.submit(tiny_gpt(name, data=2, iterations=ITERATIONS)).job_id for name in JOBS]
        deadline = time.monotonic() + 120
        while min(client.get(j).progress.iteration for j in jobs) < 3:
            assert time.monotonic() < deadline, "the jobs never trained"
            time.sleep(0.2)

        story = []
        for action in schedule:
            what = act(cluster, action, jobs, rng)
            time.sleep(rng.uniform(*PAUSE_S))
            restarted = supervise(cluster)
            story.append(f"{what}; restarted {restarted or 'nothing'}")
            log.warning("chaos: %s", story[-1])
        print("\n".join(story))

        # Every job finishes (or, at the least, trains on): none is lost or failed.
        deadline = time.monotonic() + 240
        final: dict[str, common_pb2.Job] = {}
        while len(final) < len(jobs):
            assert time.monotonic() < deadline, f"jobs did not finish: {unfinished(client, jobs)}"
            for job_id in jobs:
                job = retrying(lambda job_id=job_id: client.get(job_id))  # type: ignore[misc]
                assert isinstance(job, common_pb2.Job)
                assert job.state not in (common_pb2.JOB_STATE_FAILED, common_pb2.JOB_STATE_CANCELLED), (
                    f"{job.spec.name}: {common_pb2.JobState.Name(job.state)}: {job.reason}"
                )
                if job.state == common_pb2.JOB_STATE_SUCCEEDED and job.progress.iteration >= ITERATIONS:
                    final[job_id] = job
            time.sleep(0.5)
        supervise(cluster)

        listed = retrying(client.list_jobs)
        assert isinstance(listed, list)
        names = sorted(j.spec.name for j in listed)
        assert names == sorted(JOBS), f"lost or duplicated jobs: {names}"
        # Every agent is back, so no node stays lost. A node may stay isolated: a rank that
        # died there twice in a row is a suspect node by the escalation ladder, and that
        # decision is on record as an incident of the node.
        deadline = time.monotonic() + 15
        while lost := [n.node_id for n in client.nodes() if n.state == common_pb2.NODE_STATE_LOST]:
            assert time.monotonic() < deadline, f"nodes still lost: {lost}"
            time.sleep(0.2)
        incidents = client.incidents()
        for node in client.nodes():
            if node.state == common_pb2.NODE_STATE_ISOLATED:
                assert any(i.node_id == node.node_id for i in incidents), f"{node.node_id} isolated, no incident"

        for job_id in jobs:
            events = list(client.watch(job_id, after_event_id="0-0"))
            kinds = [e.type for e in events]
            states = [e.state for e in events if e.type == EventType.JOB_EVENT_TYPE_STATE_CHANGED]
            # From submission to success, once, with every iteration reported on the way.
            assert states[-1] == common_pb2.JOB_STATE_SUCCEEDED
            assert states.count(common_pb2.JOB_STATE_SUCCEEDED) == 1
            # Every iteration is in the log: reported, or inside the state training resumed
            # from (a killed agent can take the reports of its last iterations with it, but
            # not the checkpoint or the peer that holds them).
            reported = {e.progress.iteration for e in events if e.type == EventType.JOB_EVENT_TYPE_PROGRESS}
            restored = [e.progress.iteration for e in events if e.type == EventType.JOB_EVENT_TYPE_RESUMED]
            covered = reported | set(range(1, max(restored, default=0) + 1))
            missing = sorted(set(range(1, ITERATIONS + 1)) - covered)
            assert not missing, f"iterations missing from the log: {missing}"
            # A failure is on record with the remedy chosen for it (a rank that dies after its
            # last iteration needs none: nothing is left to redo).
            failures = sum(
                1
                for e in events
                if e.type == EventType.JOB_EVENT_TYPE_FAILURE and "after its last iteration" not in e.message
            )
            remedies = kinds.count(EventType.JOB_EVENT_TYPE_REMEDY)
            if failures:
                assert remedies >= 1, "failures without a remedy"
            summary = ", ".join(
                EventType.Name(k).removeprefix("JOB_EVENT_TYPE_").lower()
                for k in kinds
                if k != EventType.JOB_EVENT_TYPE_PROGRESS
            )
            print(f"{job_id}: {failures} failure(s), {remedies} remed(ies): {summary}")
        print(f"{len(incidents)} incident(s): {sorted({common_pb2.FailureKind.Name(i.kind) for i in incidents})}")


def test_every_service_runs_again_after_the_chaos(cluster: LocalCluster) -> None:
    """(The module fixture's teardown then asserts that no process outlives the cluster.)"""
    for service in cluster.services:
        assert service.proc.poll() is None, f"{service.name} is not running"
