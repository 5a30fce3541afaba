"""The self-healing loop end to end, with real processes: three agents, two jobs of different
weights. A killed trainer is restarted, a SEV3 fault is reattempted in place, a rank with a
software error of its own is replaced while its peer trains on, a lost agent
makes the planner pause the lighter job so the heavier one keeps its size, and the agent's
return grows the cluster back. Each step checks that training goes on (iteration and loss
move), the incident record, and the incident's trace (spans written by every process to a
JSON-lines file)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from services.agent.supervisor import REGISTRY_FILE
from services.coordinator import decide
from tests.e2e.conftest import running, wait_for
from tests.e2e.healing import healed, incident_ids, inject, newest_incident, trains_on
from unicron import jobspec
from unicron.v1 import common_pb2
from unicron_dev.localcluster import LocalCluster, tiny_gpt

pytestmark = pytest.mark.e2e

HEAVY, LIGHT = "heal-heavy", "heal-light"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    run_dir = Path(tmp_path_factory.mktemp("heal"))
    local = LocalCluster(
        run_dir,
        agents=3,
        slots_per_agent=1,
        fault_injection=True,
        warm_spares=1,  # restarts take a spare trainer
        extra_env={"UNICRON_TRACE_FILE": str(run_dir / "spans.jsonl")},
    )
    cluster = running(local)
    next(cluster)
    try:
        with local.client() as client:
            # Measured-looking profiles (FLOP/s per size), so the plan does not hang on the
            # estimate for a toy model: the heavy job is worth 4x per FLOP.
            client.submit(
                spec(HEAVY, weight=4.0, data=2, min_data=1, preemptible=False, seed=1, profile={1: 1.0, 2: 1.9})
            )
            client.submit(spec(LIGHT, weight=1.0, data=1, min_data=1, preemptible=True, seed=2, profile={1: 1.0}))
            for name in (HEAVY, LIGHT):
                wait_for(client, name, lambda job: job.progress.iteration >= 3, "never trained", timeout_s=180)
        yield local
    finally:
        next(cluster, None)


def spec(
    name: str, weight: float, data: int, min_data: int, preemptible: bool, seed: int, profile: dict[int, float]
) -> common_pb2.JobSpec:
    out = tiny_gpt(name, data=data, seed=seed)
    for size, gflops in profile.items():
        out.throughput[size] = gflops * 1e9
    out.weight = weight
    out.preemptible = preemptible
    out.parallelism.min_data = min_data
    out.training.checkpoint_interval = 5
    # Divisible by micro-batch x every data-parallel degree the planner may pick.
    out.training.global_batch_size = 12
    out.training.micro_batch_size = 1
    return jobspec.normalized(out)


def spans_of(cluster: LocalCluster, incident: common_pb2.Incident, timeout_s: float = 20) -> list[dict[str, Any]]:
    """The incident's spans once its root is written (processes flush as spans end)."""
    trace_id = incident.traceparent.split("-")[1]
    path = cluster.run_dir / "spans.jsonl"
    deadline = time.monotonic() + timeout_s
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        spans = [s for s in map(json.loads, lines) if s["trace_id"] == trace_id]
        if any(s["name"] == "unicron.incident" for s in spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.5)


def check_trace(cluster: LocalCluster, incident: common_pb2.Incident, remedy: str) -> None:
    spans = spans_of(cluster, incident)
    names = [s["name"] for s in spans]
    (root,) = [s for s in spans if s["name"] == "unicron.incident"]
    assert root["parent_id"] in (None, "")
    assert root["attributes"]["unicron.incident.id"] == incident.incident_id
    for name in ("detect", "classify", "transition", "resumed"):
        assert name in names, names
    for span in spans:
        if span["name"] in ("detect", "classify", "resumed", "transition"):
            assert span["parent_id"] == root["span_id"], span
    classify = next(s for s in spans if s["name"] == "classify")
    assert classify["attributes"]["unicron.remedy"] == remedy
    services = {s["service"] for s in spans if s["name"] == "transition"}
    assert any("agent" in service for service in services), services


def test_a_killed_trainer_is_restarted_and_training_goes_on(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        before = client.get(LIGHT)
        seen = incident_ids(client, LIGHT)
        victims = cluster.trainer_processes(before.job_id, rank=0)
        assert len(victims) == 1
        victims[0].send_signal(signal.SIGKILL)
        incident = newest_incident(client, LIGHT, seen)
        healed(client, LIGHT, incident)
        after = wait_for(
            client, LIGHT, lambda j: j.progress.iteration > before.progress.iteration, "did not get past the crash"
        )
        incident = next(i for i in client.incidents(after.job_id) if i.incident_id == incident.incident_id)
    assert incident.kind == common_pb2.FAILURE_KIND_PROCESS_EXIT and incident.remedy == common_pb2.REMEDY_RESTART
    assert incident.HasField("resumed") and incident.cost.transition_seconds > 0
    assert after.assignment.generation > before.assignment.generation
    assert after.remedies[-1].remedy == common_pb2.REMEDY_RESTART and after.remedies[-1].HasField("resumed")
    resumed = next(c.reason for c in reversed(after.history) if "resumed" in c.reason)
    # A single-rank job has no live peer: the node's in-memory snapshot, or the checkpoint.
    assert "state: snapshot" in resumed or "state: checkpoint" in resumed, resumed
    check_trace(cluster, incident, "restart")


def test_a_sev3_fault_is_reattempted_in_place(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        before = client.get(HEAVY)
        pids = sorted(p.pid for p in cluster.trainer_processes(before.job_id))
        seen = incident_ids(client, HEAVY)
        inject(cluster, HEAVY, "exception:collective_timeout", rank=1)
        incident = newest_incident(client, HEAVY, seen)
        after = healed(client, HEAVY, incident)
        incident = next(i for i in client.incidents(after.job_id) if i.incident_id == incident.incident_id)
    assert incident.kind == common_pb2.FAILURE_KIND_COLLECTIVE_TIMEOUT
    assert incident.remedy == common_pb2.REMEDY_REATTEMPT and incident.HasField("resumed")
    # The same processes formed a new process group (a new generation, same placement), and
    # the iteration count never went back.
    assert sorted(p.pid for p in cluster.trainer_processes(after.job_id)) == pids and len(pids) == 2
    assert after.assignment.generation == before.assignment.generation + 1
    assert decide.slots_by_node(after) == decide.slots_by_node(before)
    assert after.progress.iteration > before.progress.iteration
    assert "state: live" in next(c.reason for c in reversed(after.history) if "resumed" in c.reason)
    check_trace(cluster, incident, "reattempt")


def test_a_rank_with_an_error_of_its_own_is_replaced_and_takes_a_live_peers_state(cluster: LocalCluster) -> None:
    # The rank reports the error and waits; the coordinator alone classifies it (SEV2: the
    # rank's state is not trusted), restarts that rank only, and the new process takes the
    # state from the rank that kept training.
    with cluster.client() as client:
        before = client.get(HEAVY)
        (kept,) = [p.pid for p in cluster.trainer_processes(before.job_id, rank=0)]
        (failed,) = [p.pid for p in cluster.trainer_processes(before.job_id, rank=1)]
        seen = incident_ids(client, HEAVY)
        inject(cluster, HEAVY, "exception:software_error", rank=1)
        incident = newest_incident(client, HEAVY, seen)
        after = healed(client, HEAVY, incident)
        incident = next(i for i in client.incidents(after.job_id) if i.incident_id == incident.incident_id)
    assert incident.kind == common_pb2.FAILURE_KIND_SOFTWARE_ERROR and incident.severity == common_pb2.SEVERITY_SEV2
    assert incident.remedy == common_pb2.REMEDY_RESTART and incident.HasField("resumed")
    pids = {rank: [p.pid for p in cluster.trainer_processes(after.job_id, rank=rank)] for rank in (0, 1)}
    assert pids[0] == [kept] and len(pids[1]) == 1 and pids[1] != [failed], pids
    assert after.progress.iteration > before.progress.iteration
    # Rank 0 (whose report the coordinator reads) went on with its own state; nothing redone.
    resumed = next(c.reason for c in reversed(after.history) if "resumed" in c.reason)
    assert "state: live" in resumed and "0 iterations recomputed" in resumed, resumed


def test_a_lost_agent_pauses_the_lighter_job_and_its_return_grows_it_back(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        heavy = client.get(HEAVY)
        heavy_size = heavy.assignment.world_size
        seen = incident_ids(client, HEAVY)
        victim = heavy.assignment.workers[0].node_id
        cluster.kill(victim, signal.SIGKILL)
        # The surviving rank's connection reset arrives first: the ladder reattempts, then
        # restarts; the heartbeat timeout then shows the node is gone: reconfigure.
        deadline = time.monotonic() + 60
        while not (
            lost := [
                i
                for i in client.incidents(heavy.job_id)
                if i.incident_id not in seen
                and i.kind == common_pb2.FAILURE_KIND_NODE_LOST
                and i.remedy != common_pb2.REMEDY_UNSPECIFIED
            ]
        ):
            assert time.monotonic() < deadline, "node loss not handled"
            time.sleep(0.2)
        incident = lost[0]
        assert incident.remedy == common_pb2.REMEDY_RECONFIGURE and incident.node_id == victim
        heavy = trains_on(client, HEAVY, timeout_s=180)
        light = client.get(LIGHT)
        # The heavier job keeps its size, off the lost node; the lighter one made room.
        assert heavy.assignment.world_size == heavy_size
        assert victim not in {w.node_id for w in heavy.assignment.workers}
        assert light.state == common_pb2.JOB_STATE_PENDING, light.reason
        incident = next(i for i in client.incidents(heavy.job_id) if i.incident_id == incident.incident_id)
        assert incident.HasField("resumed")
        check_trace(cluster, incident, "reconfigure")
        plan_spans = [s for s in spans_of(cluster, incident) if s["name"] == "plan"]
        assert plan_spans and plan_spans[0]["attributes"]["unicron.plan.solver_status"] in (
            "SOLVE_STATUS_OPTIMAL",
            "SOLVE_STATUS_FEASIBLE",
        )
        # The node comes back: the plan starts the lighter job again.
        cluster.service(victim).proc.wait(timeout=10)
        cluster.restart(victim)
        cluster.wait_nodes(client.nodes, 3)
        light = wait_for(
            client,
            LIGHT,
            lambda j: j.state == common_pb2.JOB_STATE_RUNNING and j.assignment.world_size == 1,
            "did not grow back",
            timeout_s=180,
        )
        light = trains_on(client, LIGHT)
        assert client.get(HEAVY).assignment.world_size == heavy_size
        cluster_view = client.cluster()
    assert cluster_view.nodes_ready == 3 and cluster_view.incidents >= 3
    assert cluster_view.waf > 0 and cluster_view.failure_waf_seconds > 0


def test_a_coordinator_killed_mid_transition_finishes_it_after_a_restart(cluster: LocalCluster) -> None:
    with cluster.client() as client:
        before = client.get(HEAVY)
        seen = incident_ids(client, HEAVY)
        inject(cluster, HEAVY, "crash", rank=0)
        # Kill the coordinator the moment the restart is committed, before the job resumed.
        wait_for(client, HEAVY, lambda j: len(j.remedies) > len(before.remedies), "no remedy", timeout_s=60)
        cluster.kill("coordinator", signal.SIGKILL)
        cluster.service("coordinator").proc.wait(timeout=10)
    cluster.restart("coordinator")
    with cluster.client() as client:
        after = trains_on(client, HEAVY, timeout_s=180)
        remedy = after.remedies[len(before.remedies)]
        incident = next(i for i in client.incidents(after.job_id) if i.incident_id == remedy.incident_id)
        jobs = client.list_jobs()
    assert incident.incident_id not in seen and incident.kind == common_pb2.FAILURE_KIND_PROCESS_EXIT
    assert after.assignment.generation > before.assignment.generation
    assert after.remedies[-1].HasField("resumed")
    assert incident.HasField("resumed")
    assert sorted(j.spec.name for j in jobs) == sorted([HEAVY, LIGHT])  # nothing lost or duplicated


def alive_generations(cluster: LocalCluster, node_id: str, job_id: str) -> set[int]:
    """The generations of the job whose trainers on the node are alive, by its agent's registry."""
    registry = cluster.run_dir / "agents" / node_id / REGISTRY_FILE
    try:
        entries = json.loads(registry.read_text())
    except (OSError, ValueError):
        return set()
    return {e["generation"] for e in entries if e["job_id"] == job_id and psutil.pid_exists(e["pid"])}


def test_an_agent_back_from_lost_kills_the_ranks_written_off(cluster: LocalCluster) -> None:
    """An agent silent past the heartbeat timeout (paused: its trainers live on) is declared
    LOST and its job moves on without it; when it comes back it must not keep the old
    generation's rank running beside the new one (found by the Sentinel partition test)."""
    with cluster.client() as client:
        heavy = trains_on(client, HEAVY, timeout_s=180)
        victim = heavy.assignment.workers[0].node_id
        assert alive_generations(cluster, victim, heavy.job_id) == {heavy.assignment.generation}
        log = cluster.service(victim).log_path
        registrations = log.read_text().count("registered with coordinator")
        cluster.kill(victim, signal.SIGSTOP)
        try:
            moved = wait_for(
                client,
                HEAVY,
                lambda j: j.assignment.generation > heavy.assignment.generation and victim not in decide.nodes_of(j),
                "never moved off the silent node",
                timeout_s=60,
            )
            assert heavy.assignment.generation in alive_generations(cluster, victim, heavy.job_id)
        finally:
            cluster.kill(victim, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while log.read_text().count("registered with coordinator") == registrations:
            assert time.monotonic() < deadline, "the agent never registered again"
            time.sleep(0.1)
        # Killed before the agent takes a command (SIGKILL, no grace): well inside a second.
        time.sleep(1.0)
        assert alive_generations(cluster, victim, heavy.job_id) == set(), "a written-off rank still runs"
        assert "killed ranks the coordinator wrote off" in log.read_text()
        trains_on(client, HEAVY, timeout_s=180)
        cluster.wait_nodes(client.nodes, 3)
    assert moved.assignment.generation > heavy.assignment.generation
