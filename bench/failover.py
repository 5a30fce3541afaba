"""The control plane's unavailability when its Redis fails: a single Redis killed and restarted
on the same machine (its append-only file brings the state back) against Redis replicated
under Sentinel through each fault of tests/cluster/test_replicated_state.py, in the same run.

    python -m bench.failover [--repeats 10] [--quick]

Each arm runs a job training all along and a client that submits and cancels jobs without
pause (unicron_dev.acked_writes), on two agents of two slots and two coordinators with
mutual TLS. The single Redis is restarted on a LocalCluster (127.0.0.1); the Sentinel faults
run on network-namespace hosts (NetCluster: every Redis server and sentinel on a host of its
own) when this runs as root, else the faults that need no network on 127.0.0.1. Each repeat
injects the fault and, half a second later, kills one of the job's trainers: a failure that
must be healed while the control plane is away. Measured per repeat:

* no write: the longest time without an acknowledged write from the fault on (what a client
  saw of the outage);
* heal: from the trainer's death until the job trains again in a new generation;
* and over each arm, the acknowledged writes not in the store at the end (which must be
  none), and any rank seen alive under two generations at once.

Results go to bench/results/failover.json; the exit status is 1 when a write was lost or a
rank ran twice.
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import log, percentile, write_results
from unicron.client import UnicronClient
from unicron.v1 import common_pb2 as pb
from unicron_dev import netns
from unicron_dev.acked_writes import WriteProbe
from unicron_dev.localcluster import LocalCluster, tiny_gpt
from unicron_dev.netcluster import NetCluster
from unicron_dev.redis_faults import (
    FAULTS,
    LOCAL_FAULTS,
    Fault,
    RankWatch,
    kill_a_trainer,
    restart_exited_coordinators,
)

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


def restart_redis(cluster: LocalCluster) -> Fault:
    cluster.restart_redis()  # SIGKILL and start again at once, on the same port and disk
    yield


def run_arm(name: str, cluster: LocalCluster, fault: Callable[[LocalCluster], Fault], repeats: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    with cluster.client() as client:
        job = client.submit(tiny_gpt(f"train-{slug(name)}", iterations=1_000_000))
        while client.get(job.job_id).progress.iteration < 5:
            time.sleep(0.2)
        probe = WriteProbe(client, probe_spec, prefix=f"acked-{slug(name)}").start()
        watch = RankWatch(cluster, job.job_id).start()
        try:
            for repeat in range(repeats):
                time.sleep(SETTLE_S)
                before = get(client, job.job_id)
                started = time.monotonic()
                faulty = fault(cluster)
                next(faulty)
                time.sleep(0.5)
                kill_a_trainer(cluster, job.job_id)
                killed_at = time.monotonic()
                for _ in faulty:
                    pass
                wait_healed(client, job.job_id, before)
                healed_s = time.monotonic() - killed_at
                time.sleep(1.0)  # writes after the fault, so that the gap is closed
                restarted = restart_exited_coordinators(cluster)
                stamp = time.monotonic()
                rows.append(
                    {
                        "repeat": repeat,
                        "no_write_s": round(gap_between(probe, started, stamp), 3),
                        "heal_s": round(healed_s, 3),
                        "coordinators_restarted": restarted,
                    }
                )
                log(f"{name} #{repeat}: no write {rows[-1]['no_write_s']:.2f}s, heal {healed_s:.2f}s")
        finally:
            probe.stop()
            watch.stop()
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
        "ranks_run_twice": watch.doubled,
        "refusals": probe.refusals,
        "no_write_s": {"p50": percentile(gaps, 0.5), "max": max(gaps)},
        "heal_s": {"p50": percentile(heals, 0.5), "max": max(heals)},
    }


def slug(name: str) -> str:
    """A fault's name as a job name: lowercase words and dashes."""
    return "-".join(word for word in name.lower().replace("'", "").split() if word.isalnum())[:40].strip("-")


def get(client: UnicronClient, job_id: str) -> pb.Job:
    deadline = time.monotonic() + HEAL_TIMEOUT_S
    while True:
        try:
            return client.get(job_id)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def gap_between(probe: WriteProbe, start: float, end: float) -> float:
    """The longest time without an acknowledged write within [start, end]."""
    times = [start, *(t for t in probe.successes if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


def clusters(work: Path) -> list[tuple[LocalCluster, list[tuple[str, Callable[[LocalCluster], Fault]]]]]:
    """The single Redis's cluster and its arm, then the Sentinel group's and its faults."""
    single = LocalCluster(work / "single", agents=2, slots_per_agent=2, coordinators=2)
    options: dict[str, Any] = {"agents": 2, "slots_per_agent": 2, "coordinators": 2, "redis_replicas": 2}
    if netns.available() is None:
        group: LocalCluster = NetCluster(work / "sentinel", **options)
        faults = list(FAULTS.items())
    else:
        group = LocalCluster(work / "sentinel", **options)
        faults = [(name, FAULTS[name]) for name in LOCAL_FAULTS]
    return [(single, [("single Redis restarted", restart_redis)]), (group, faults)]


def run(repeats: int, work: Path) -> dict[str, Any]:
    arms = []
    for cluster, faults in clusters(work):
        cluster.start()
        try:
            with cluster.client() as client:
                cluster.wait_nodes(client.nodes, cluster.agents)
            for name, fault in faults:
                arms.append(run_arm(name, cluster, fault, repeats))
        finally:
            cluster.stop()
    single = arms[0]
    return {
        "bench": "failover",
        "repeats": repeats,
        "hosts": "network namespaces" if netns.available() is None else "127.0.0.1",
        "arms": arms,
        "unavailability_ratio_p50": {
            arm["arm"]: arm["no_write_s"]["p50"] / max(single["no_write_s"]["p50"], 1e-9) for arm in arms[1:]
        },
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'arm':<48} {'acked':>7} {'lost':>5} {'no write p50':>13} {'max':>7} {'heal p50':>9} {'max':>7}",
    ]
    for arm in results["arms"]:
        lines.append(
            f"{arm['arm']:<48} {arm['acknowledged_writes']:>7} {len(arm['lost_writes']):>5} "
            f"{arm['no_write_s']['p50']:>12.2f}s {arm['no_write_s']['max']:>6.2f}s "
            f"{arm['heal_s']['p50']:>8.2f}s {arm['heal_s']['max']:>6.2f}s"
        )
    for name, ratio in results["unavailability_ratio_p50"].items():
        lines.append(f"no write p50, {name} / single Redis restarted: {ratio:.1f}x")
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
    return 1 if any(arm["lost_writes"] or arm["ranks_run_twice"] for arm in results["arms"]) else 0


if __name__ == "__main__":
    sys.exit(main())
