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
from typing import Any, TypeVar

from bench.common import log, percentile, write_results
from unicron.client import ClientError, UnicronClient
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


def one_repeat(
    cluster: LocalCluster, client: UnicronClient, probe: WriteProbe, fault: Callable[[LocalCluster], Fault], name: str
) -> tuple[dict[str, Any], list[str]]:
    """A fresh job (the remedy ladder escalates repeated failures of one job: that is not
    what is measured here), the fault, a trainer killed 0.5 s in, the job healed."""
    job = through_outage(lambda: submitted(client, name))
    while get(client, job.job_id).progress.iteration < 3:
        time.sleep(0.2)
    watch = RankWatch(cluster, job.job_id).start()
    try:
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
        row = {
            "no_write_s": round(gap_between(probe, started, time.monotonic()), 3),
            "heal_s": round(healed_s, 3),
            "coordinators_restarted": restarted,
        }
    finally:
        watch.stop()
    through_outage(lambda: cancelled(client, job.job_id))
    return row, watch.doubled


def run_arm(name: str, cluster: LocalCluster, fault: Callable[[LocalCluster], Fault], repeats: int) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    doubled: list[str] = []
    with cluster.client() as client:
        probe = WriteProbe(client, probe_spec, prefix=f"acked-{slug(name)}").start()
        try:
            for repeat in range(repeats):
                try:
                    row, twice = one_repeat(cluster, client, probe, fault, f"train-{slug(name)[:30]}-{repeat}")
                except (TimeoutError, ClientError, RuntimeError) as exc:
                    # A repeat that fails is a row with its reason; the arm goes on.
                    rows.append({"repeat": repeat, "failed": f"{type(exc).__name__}: {exc}"})
                    log(f"{name} #{repeat}: FAILED: {exc}")
                    restart_exited_coordinators(cluster)
                    continue
                rows.append({"repeat": repeat, **row})
                doubled += twice
                log(f"{name} #{repeat}: no write {row['no_write_s']:.2f}s, heal {row['heal_s']:.2f}s")
        finally:
            probe.stop()
        lost = probe.lost(client)
    gaps = [row["no_write_s"] for row in rows if "failed" not in row]
    heals = [row["heal_s"] for row in rows if "failed" not in row]
    return {
        "arm": name,
        "repeats": rows,
        "acknowledged_writes": len(probe.submitted) + len(probe.cancelled),
        "refused_calls": probe.failures,
        "lost_writes": lost,
        "ranks_run_twice": doubled,
        "refusals": probe.refusals,
        "failed_repeats": sum("failed" in row for row in rows),
        "no_write_s": summary(gaps),
        "heal_s": summary(heals),
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


T = TypeVar("T")


def summary(values: list[float]) -> dict[str, float | None]:
    """p50 and max; None when no repeat measured anything."""
    return {"p50": percentile(values, 0.5), "max": max(values)} if values else {"p50": None, "max": None}


def seconds(value: float | None, width: int) -> str:
    return f"{value:>{width - 1}.2f}s" if value is not None else f"{'-':>{width}}"


def through_outage(call: Callable[[], T], timeout_s: float = HEAL_TIMEOUT_S) -> T:
    """The bench's own writes, tried again while the control plane answers UNAVAILABLE."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return call()
        except ClientError as exc:
            if exc.code.name != "UNAVAILABLE" or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def submitted(client: UnicronClient, name: str) -> pb.Job:
    try:
        return client.submit(tiny_gpt(name, iterations=1_000_000))
    except ClientError as exc:
        if exc.code.name != "ALREADY_EXISTS":  # a try before was applied, not acknowledged
            raise
        return client.get(name)


def cancelled(client: UnicronClient, job_id: str) -> None:
    try:
        client.cancel(job_id, "repeat over")
    except ClientError as exc:
        if exc.code.name != "FAILED_PRECONDITION":  # a try before ended it
            raise


def gap_between(probe: WriteProbe, start: float, end: float) -> float:
    """The longest time without an acknowledged write within [start, end]."""
    times = [start, *(t for t in probe.successes if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(times))


def clusters(
    work: Path, only: str = ""
) -> list[tuple[LocalCluster, list[tuple[str, Callable[[LocalCluster], Fault]]]]]:
    """The single Redis's cluster and its arm, then the Sentinel group's and its faults
    (`only`: just the Sentinel faults whose name holds it, no baseline)."""
    single = LocalCluster(work / "single", agents=2, slots_per_agent=2, coordinators=2)
    options: dict[str, Any] = {"agents": 2, "slots_per_agent": 2, "coordinators": 2, "redis_replicas": 2}
    if netns.available() is None:
        group: LocalCluster = NetCluster(work / "sentinel", **options)
        faults = list(FAULTS.items())
    else:
        group = LocalCluster(work / "sentinel", **options)
        faults = [(name, FAULTS[name]) for name in LOCAL_FAULTS]
    if only:
        return [(group, [(name, fault) for name, fault in faults if only in name])]
    return [(single, [("single Redis restarted", restart_redis)]), (group, faults)]


def run(repeats: int, work: Path, only: str = "") -> dict[str, Any]:
    arms = []
    for cluster, faults in clusters(work, only):
        cluster.start()
        try:
            with cluster.client() as client:
                cluster.wait_nodes(client.nodes, cluster.agents)
            for name, fault in faults:
                arms.append(run_arm(name, cluster, fault, repeats))
        finally:
            cluster.stop()
    single = arms[0] if not only else {"no_write_s": {"p50": None}}
    return {
        "bench": "failover",
        "repeats": repeats,
        "hosts": "network namespaces" if netns.available() is None else "127.0.0.1",
        "arms": arms,
        "unavailability_ratio_p50": {
            arm["arm"]: arm["no_write_s"]["p50"] / max(single["no_write_s"]["p50"] or 0.0, 1e-9)
            for arm in arms[1:]
            if arm["no_write_s"]["p50"] is not None and single["no_write_s"]["p50"] is not None
        },
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"{'arm':<48} {'acked':>7} {'lost':>5} {'failed':>6} "
        f"{'no write p50':>13} {'max':>7} {'heal p50':>9} {'max':>7}",
    ]
    for arm in results["arms"]:
        lines.append(
            f"{arm['arm']:<48} {arm['acknowledged_writes']:>7} {len(arm['lost_writes']):>5} {arm['failed_repeats']:>6} "
            f"{seconds(arm['no_write_s']['p50'], 13)} {seconds(arm['no_write_s']['max'], 7)} "
            f"{seconds(arm['heal_s']['p50'], 9)} {seconds(arm['heal_s']['max'], 7)}"
        )
    for name, ratio in results["unavailability_ratio_p50"].items():
        lines.append(f"no write p50, {name} / single Redis restarted: {ratio:.1f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10, help="faults per arm (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 faults per arm")
    parser.add_argument(
        "--only", default="", help="run just the Sentinel faults whose name holds this, no baseline (default: all)"
    )
    parser.add_argument("--keep", action="store_true", help="keep the clusters' logs (default: removed)")
    args = parser.parse_args(argv)
    repeats = 3 if args.quick else args.repeats
    if repeats < 1:
        parser.error("--repeats must be at least 1")
    work = Path(tempfile.mkdtemp(prefix="unicron-bench-failover-"))
    try:
        results = run(repeats, work, args.only)
    finally:
        if args.keep:
            print(f"logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    # A partial run goes to a file of its own: the full run's numbers stay where they are.
    write_results(RESULTS if not args.only else RESULTS.with_name("failover_only.json"), results)
    print(table(results))
    bad = any(arm["lost_writes"] or arm["ranks_run_twice"] or arm["failed_repeats"] for arm in results["arms"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
