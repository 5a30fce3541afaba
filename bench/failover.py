"""The control plane's unavailability when its Redis fails: a single Redis killed and restarted
on the same machine (its append-only file brings the state back) against Redis replicated
under Sentinel whose primary is killed (a replica takes over), measured in the same run.

    python -m bench.failover [--repeats 10] [--quick]

Each arm is a LocalCluster on 127.0.0.1 (two agents of two slots, two coordinators, mutual
TLS) with one job training all along, and a client that submits and cancels jobs without
pause (unicron_dev.acked_writes). Each repeat kills Redis (SIGKILL: the single one, or the
current primary) and, half a second later, one of the job's trainers: a failure that must be
healed while the control plane is away. Measured per repeat:

* no write: the longest time without an acknowledged write from the fault on (what a client
  saw of the outage);
* heal: from the trainer's death until the job trains again in a new generation;
* and over the whole arm, the acknowledged writes that are not in the store at the end
  (which must be none).

Results go to bench/results/failover.json; the exit status is 1 when a write was lost.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from bench.common import log, percentile, write_results
from unicron.client import UnicronClient
from unicron.v1 import common_pb2 as pb
from unicron_dev.acked_writes import WriteProbe
from unicron_dev.localcluster import LocalCluster, tiny_gpt

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "failover.json"
SETTLE_S = 3.0  # between repeats: the writes go on, the group heals
HEAL_TIMEOUT_S = 120.0


def probe_spec(name: str) -> pb.JobSpec:
    # Needs every slot and may not preempt: it waits while the training job runs.
    spec = tiny_gpt(name, data=4, iterations=10)
    spec.priority_class = "best-effort"
    return spec


def wait_healed(client: UnicronClient, job_id: str, before: pb.Job, timeout_s: float = HEAL_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            job = client.get(job_id)
        except Exception:  # noqa: BLE001 (the control plane may still be failing over: ask again)
            time.sleep(0.1)
            continue
        if (
            job.assignment.generation > before.assignment.generation
            and job.progress.iteration > before.progress.iteration
        ):
            return
        time.sleep(0.05)
    raise TimeoutError(f"job {job_id} did not train again within {timeout_s:g}s")


def kill_a_trainer(cluster: LocalCluster, job_id: str) -> None:
    for trainer in cluster.trainer_processes(job_id):
        try:
            trainer.kill()
            return
        except psutil.NoSuchProcess:
            continue
    raise RuntimeError(f"no live trainer of {job_id}")


def restart_exited_coordinators(cluster: LocalCluster) -> list[str]:
    """A coordinator whose lease lapsed stopped itself (exit 75); a supervisor restarts it."""
    restarted = []
    for service in cluster.services:
        if service.name.startswith("coordinator") and service.proc.poll() is not None:
            cluster.restart(service.name)
            restarted.append(service.name)
    return restarted


def single_fault(cluster: LocalCluster) -> Callable[[], None]:
    cluster.restart_redis()  # SIGKILL and start again at once, on the same port and disk
    return lambda: None


def sentinel_fault(cluster: LocalCluster) -> Callable[[], None]:
    group = cluster.redis_group
    assert group is not None
    old = group.kill_primary()

    def recover() -> None:
        group.wait_healthy(60, not_primary=old)
        old.start()  # back as a replica of the new primary
        group.wait_healthy(60)

    return recover


def run_arm(
    name: str, cluster: LocalCluster, fault: Callable[[LocalCluster], Callable[[], None]], repeats: int
) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with cluster.client() as client:
        job = client.submit(tiny_gpt(f"train-{name}", iterations=1_000_000))
        while client.get(job.job_id).progress.iteration < 5:
            time.sleep(0.2)
        probe = WriteProbe(client, probe_spec, prefix=f"acked-{name}").start()
        try:
            for repeat in range(repeats):
                time.sleep(SETTLE_S)
                before = client.get(job.job_id)
                started = time.monotonic()
                recover = fault(cluster)
                time.sleep(0.5)
                kill_a_trainer(cluster, job.job_id)
                killed_at = time.monotonic()
                recover()
                wait_healed(client, job.job_id, before)
                healed_s = time.monotonic() - killed_at
                time.sleep(1.0)  # writes after the fault, so that the gap is closed
                restarted = restart_exited_coordinators(cluster)
                rows.append(
                    {
                        "repeat": repeat,
                        "no_write_s": round(probe.longest_gap_s(started), 3),
                        "heal_s": round(healed_s, 3),
                        "coordinators_restarted": restarted,
                    }
                )
                log(f"{name} #{repeat}: no write {rows[-1]['no_write_s']:.2f}s, heal {healed_s:.2f}s")
        finally:
            probe.stop()
        lost = probe.lost(client)
        client.cancel(job.job_id, "bench over")
    gaps = [row["no_write_s"] for row in rows]
    heals = [row["heal_s"] for row in rows]
    return {
        "arm": name,
        "repeats": rows,
        "acknowledged_writes": len(probe.submitted) + len(probe.cancelled),
        "refused_calls": probe.failures,
        "lost_writes": lost,
        "no_write_s": {"p50": percentile(gaps, 0.5), "max": max(gaps)},
        "heal_s": {"p50": percentile(heals, 0.5), "max": max(heals)},
    }


def run(repeats: int, work: Path) -> dict[str, Any]:
    arms = []
    for name, replicas, fault in (
        ("single-redis-restarted", 0, single_fault),
        ("sentinel-failover", 2, sentinel_fault),
    ):
        cluster = LocalCluster(
            work / name, agents=2, slots_per_agent=2, coordinators=2, redis_replicas=replicas
        ).start()
        try:
            with cluster.client() as client:
                cluster.wait_nodes(client.nodes, cluster.agents)
            arms.append(run_arm(name, cluster, fault, repeats))
        finally:
            cluster.stop()
    single, sentinel = arms
    return {
        "bench": "failover",
        "repeats": repeats,
        "arms": arms,
        "unavailability_ratio_p50": sentinel["no_write_s"]["p50"] / max(single["no_write_s"]["p50"], 1e-9),
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'arm':<24} {'acked':>7} {'lost':>5} {'no write p50':>13} {'max':>7} {'heal p50':>9} {'max':>7}",
    ]
    for arm in results["arms"]:
        lines.append(
            f"{arm['arm']:<24} {arm['acknowledged_writes']:>7} {len(arm['lost_writes']):>5} "
            f"{arm['no_write_s']['p50']:>12.2f}s {arm['no_write_s']['max']:>6.2f}s "
            f"{arm['heal_s']['p50']:>8.2f}s {arm['heal_s']['max']:>6.2f}s"
        )
    lines.append(f"unavailability, failover / restart (p50): {results['unavailability_ratio_p50']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="faults per arm (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 faults per arm")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="unicron-bench-failover-"))
    try:
        results = run(repeats, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(RESULTS, results)
    print(table(results))
    return 1 if any(arm["lost_writes"] for arm in results["arms"]) else 0


if __name__ == "__main__":
    sys.exit(main())
