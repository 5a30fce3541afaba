"""Where a sharded job's state comes back from, side by side: the same bf16 GPT with Megatron's
distributed optimizer on two data-parallel ranks on two "nodes", one failure each run, healed
from each state source in turn, at each model size, in one run (issue: "Sharded state healed
from memory", item 7).

    python -m bench.sources [--models 4:448,8:1024] [--iterations N] [--fail-at K]

Runs, per size (every run a fresh pair of trainer processes on a fake agent, real gloo):

* restart from the buddy: rank 1 crashes in iteration K; a new rank 1 on a third node takes
  its model slice from rank 0 and its optimizer shard from rank 0's buddy copy (replication 2);
* restart from the snapshot: the same without buddy copies (replication 1), the new rank 1 on
  its own node, whose in-memory snapshot (every 2 iterations) survived; every rank rolls back;
* restart from the checkpoint: replication 1, no snapshots, a checkpoint every 4 iterations;
* the checkpoint-restart baseline: both ranks crash and start again as new processes from the
  checkpoint, as a job without Unicron would;
* shrink DP 2 -> 1 resharded in memory (rank 0 cuts its new range from its own shard and its
  buddy copy of rank 1's) against the same shrink through the checkpoint (replication 1);
* grow DP 1 -> 2 resharded in memory (the new rank receives only the ranges it will own).

Per run: the seconds from the failure (the last report before it) to the first report after
it, the iterations recomputed, and for the in-memory runs the bytes the receiving rank got and
their throughput against a plain loopback socket copy of the same bytes in the same run (the
issue's target: at least half of it). Process start-up is in every restart's time alike (a
real replacement process starts too). Results: bench/results/sources.json and a table. A
measurement, not a test: the exit status is 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.buddy import socket_copy_seconds
from bench.common import log, write_results
from unicron.redisutil import free_port
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2
from unicron_dev.localcluster import llm_gpt
from unicron_dev.trainer_procs import ReformAgent, Trainer, start_trainer

RESULTS = Path(__file__).parent / "results" / "sources.json"
MODELS = ("4:448", "8:1024")  # about 10M and 100M parameters (unicron_dev.localcluster.llm_gpt)
CHECKPOINT_EVERY = 4
WAIT_S = 1800.0


def _spec(model: str, iterations: int, replication: int, checkpoint_every: int, data: int = 2) -> common_pb2.JobSpec:
    layers, hidden = (int(v) for v in model.split(":"))
    spec = llm_gpt("sources-bench", layers, hidden, data=data, iterations=iterations)
    spec.training.replication = replication
    spec.training.checkpoint_interval = checkpoint_every
    return spec


def _node(name: str, snapshots: Path | None = None) -> dict[str, str]:
    extra = {"snapshot_dir": str(snapshots / name)} if snapshots is not None else {}
    return trainer_env(node=name, **extra)


def _fault(fault: str) -> dict[str, str]:
    return trainer_env(fault_injection=True, faults=(fault,))


def _from_peer() -> dict[str, str]:
    return trainer_env(state_from_peer=True)


def _finish(procs: list[Trainer], agent: ReformAgent) -> list[int]:
    try:
        return [p.wait(WAIT_S).returncode for p in procs]
    finally:
        agent.stop()


def _gap(agent: ReformAgent, before: tuple[int, int], after: tuple[int, int]) -> tuple[float, Any]:
    """Seconds from ``before``'s last report of generation 1 to ``after``'s first report of
    generation 2, and that report."""
    last = max(
        at
        for message, at in zip(agent.messages[before], agent.arrival_times[before], strict=True)
        if message.HasField("iteration") and message.iteration.generation == 1
    )
    for message, at in zip(agent.messages[after], agent.arrival_times[after], strict=True):
        if message.HasField("iteration") and message.iteration.generation == 2:
            return at - last, message.iteration
    raise RuntimeError(f"{after} sent no report of generation 2")


def _resharded(log_path: Path) -> dict[str, Any]:
    """The trainer's "optimizer shard resharded" record (piece_moves.py), {} when none."""
    found: dict[str, Any] = {}
    for line in log_path.read_text().splitlines():
        if '"msg": "optimizer shard resharded"' in line:
            found = json.loads(line)
    return found


def _row(name: str, seconds: float, report: Any, fail_at: int, resharded: dict[str, Any]) -> dict[str, Any]:
    return {
        "run": name,
        "seconds": round(seconds, 3),
        "state_source": report.state_source,
        "restored_iteration": report.restored_iteration,
        "recomputed": max(0, fail_at - 1 - report.restored_iteration),
        "received_bytes": int(resharded.get("received_bytes", 0)),
        "moved_s": float(resharded.get("seconds", 0.0)),
        "wire_s": float(resharded.get("wire_seconds", 0.0)),
        "kept_bytes": int(resharded.get("kept_bytes", 0)),
    }


def restart(model: str, iterations: int, fail_at: int, source: str, work: Path) -> dict[str, Any]:
    """Rank 1 crashes in iteration ``fail_at``; a new rank 1 joins rank 0, which reforms in
    place, the state coming from ``source`` (buddy, snapshot or checkpoint)."""
    replication = 2 if source == "buddy" else 1
    checkpoint_every = CHECKPOINT_EVERY if source == "checkpoint" else iterations
    snapshots = work / "snapshots" if source == "snapshot" else None
    spec = _spec(model, iterations, replication, checkpoint_every)
    port, new_port = free_port(), free_port()
    root = work / "ckpt"
    agent = ReformAgent({(1, 0): 0, (2, 1): 1}, 2, 2, new_port, ReformAgent.any_error)
    a, b = _node("node-a", snapshots), _node("node-b", snapshots)
    old = [
        start_trainer(agent.address, spec, 0, 2, port, work, 1, root, a),
        start_trainer(agent.address, spec, 1, 2, port, work, 1, root, {**b, **_fault(f"crash@{fail_at}")}),
    ]
    old[1].proc.wait(WAIT_S)
    where = b if source == "snapshot" else _node("node-c", snapshots)
    new = start_trainer(agent.address, spec, 1, 2, new_port, work, 2, root, {**where, **_from_peer()})
    codes = _finish([old[0], new], agent)
    if any(codes):
        raise RuntimeError(f"restart from {source}: exit statuses {codes}; see {work}")
    seconds, report = _gap(agent, (1, 0), (2, 1))
    return _row(f"restart from {source}", seconds, report, fail_at, _resharded(new.log_path))


def baseline(model: str, iterations: int, fail_at: int, work: Path) -> dict[str, Any]:
    """Both ranks die in iteration ``fail_at`` and start again as new processes from the
    checkpoint: what a job without Unicron does."""
    spec = _spec(model, iterations, 1, CHECKPOINT_EVERY)
    port, new_port = free_port(), free_port()
    root = work / "ckpt"
    agent = ReformAgent({}, 2, 2, new_port, lambda _: False)
    crash = _fault(f"crash@{fail_at}")
    old = [start_trainer(agent.address, spec, r, 2, port, work, 1, root, {**_node(f"n{r}"), **crash}) for r in (0, 1)]
    for proc in old:
        proc.proc.wait(WAIT_S)
    new = [start_trainer(agent.address, spec, r, 2, new_port, work, 2, root, _node(f"n{r}")) for r in (0, 1)]
    codes = _finish(new, agent)
    if any(codes):
        raise RuntimeError(f"checkpoint-restart baseline: exit statuses {codes}; see {work}")
    seconds, report = _gap(agent, (1, 0), (2, 0))
    return _row("checkpoint-restart baseline", seconds, report, fail_at, {})


def shrink(model: str, iterations: int, fail_at: int, in_memory: bool, work: Path) -> dict[str, Any]:
    """DP 2 -> 1: rank 1 leaves in iteration ``fail_at``, rank 0 goes on alone."""
    spec = _spec(model, iterations, 2 if in_memory else 1, iterations if in_memory else CHECKPOINT_EVERY)
    port, new_port = free_port(), free_port()
    root = work / "ckpt"
    agent = ReformAgent({(1, 0): 0}, 2, 1, new_port, ReformAgent.any_error)
    ranks = [
        start_trainer(agent.address, spec, 0, 2, port, work, 1, root, _node("node-a")),
        start_trainer(agent.address, spec, 1, 2, port, work, 1, root, {**_node("node-b"), **_fault(f"exit@{fail_at}")}),
    ]
    codes = _finish(ranks, agent)
    if codes[0]:
        raise RuntimeError(f"shrink: rank 0 exited {codes[0]}; see {work}")
    seconds, report = _gap(agent, (1, 0), (1, 0))
    name = "shrink in memory" if in_memory else "shrink through the checkpoint"
    return _row(name, seconds, report, fail_at, _resharded(ranks[0].log_path))


def grow(model: str, iterations: int, fail_at: int, work: Path) -> dict[str, Any]:
    """DP 1 -> 2 after iteration ``fail_at``: a new rank joins and receives its ranges."""
    spec = _spec(model, iterations, 2, iterations, data=1)
    port, new_port = free_port(), free_port()
    root = work / "ckpt"

    def ready(agent: ReformAgent) -> bool:
        return (2, 1) in agent.hellos and len(agent.of((1, 0), "iteration")) >= fail_at

    agent = ReformAgent({(1, 0): 0, (2, 1): 1}, 2, 2, new_port, ready)
    ranks = [
        start_trainer(agent.address, spec, 0, 1, port, work, 1, root, _node("node-a")),
        start_trainer(agent.address, spec, 1, 2, new_port, work, 2, root, {**_node("node-b"), **_from_peer()}),
    ]
    codes = _finish(ranks, agent)
    if any(codes):
        raise RuntimeError(f"grow: exit statuses {codes}; see {work}")
    # From the reform, not a failure: the seconds from it to the new rank's first report, and
    # nothing to recompute.
    report = agent.of((2, 1), "iteration")[0]
    seconds = agent.seconds_to_new_generation((2, 1))
    return _row("grow in memory", seconds, report, report.restored_iteration + 1, _resharded(ranks[1].log_path))


def measure(model: str, iterations: int, fail_at: int, tmp: Path) -> list[dict[str, Any]]:
    runs: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
        ("buddy", lambda w: restart(model, iterations, fail_at, "buddy", w)),
        ("snapshot", lambda w: restart(model, iterations, fail_at, "snapshot", w)),
        ("checkpoint", lambda w: restart(model, iterations, fail_at, "checkpoint", w)),
        ("baseline", lambda w: baseline(model, iterations, fail_at, w)),
        ("shrink-memory", lambda w: shrink(model, iterations, fail_at, True, w)),
        ("shrink-checkpoint", lambda w: shrink(model, iterations, fail_at, False, w)),
        ("grow-memory", lambda w: grow(model, iterations, fail_at, w)),
    ]
    rows = []
    for name, run in runs:
        log(f"GPT {model}: {name}")
        work = tmp / model.replace(":", "x") / name
        work.mkdir(parents=True)
        rows.append(run(work))
    return rows


def with_socket(rows: list[dict[str, Any]]) -> None:
    """Each in-memory move's throughput against a loopback socket copy of its bytes, now: the
    wire alone (the sends and receives) and the whole reshard (with packing, checksums and
    unpacking)."""
    for row in rows:
        if row["received_bytes"] and row["moved_s"] and row["wire_s"]:
            socket_s = min(socket_copy_seconds(row["received_bytes"]) for _ in range(3))
            row["socket_mb_s"] = round(row["received_bytes"] / 1e6 / socket_s, 1)
            row["wire_mb_s"] = round(row["received_bytes"] / 1e6 / row["wire_s"], 1)
            row["wire_vs_socket"] = round(socket_s / row["wire_s"], 3)
            row["vs_socket"] = round(socket_s / row["moved_s"], 3)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"LAYERS:HIDDEN list (default {','.join(MODELS)})")
    parser.add_argument("--iterations", type=int, default=14, help="iterations per run (default 14)")
    parser.add_argument("--fail-at", type=int, default=10, help="the iteration the failure hits (default 10)")
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"iterations": args.iterations, "fail_at": args.fail_at, "models": {}}
    with tempfile.TemporaryDirectory(prefix="bench-sources-") as tmp:
        for model in args.models.split(","):
            rows = measure(model, args.iterations, args.fail_at, Path(tmp))
            with_socket(rows)
            results["models"][model] = rows
    write_results(RESULTS, results)
    print("state sources (bf16 GPT, distributed optimizer, DP 2 on two nodes; seconds from the failure to the")
    print("first report after it, process start-up included)")
    for model, rows in results["models"].items():
        base = next(r["seconds"] for r in rows if r["run"] == "checkpoint-restart baseline")
        print(f"GPT {model}")
        print(
            f"  {'run':32} {'seconds':>8} {'vs base':>8} {'source':>11} {'recomputed':>10}"
            f" {'received':>10} {'wire':>6} {'whole':>6}"
        )
        for r in rows:
            moved = f"{r['received_bytes'] / 1e6:.1f} MB" if r["received_bytes"] else "-"
            wire = f"{r['wire_vs_socket']:.0%}" if "vs_socket" in r else "-"
            whole = f"{r['vs_socket']:.0%}" if "vs_socket" in r else "-"
            print(
                f"  {r['run']:32} {r['seconds']:8.2f} {r['seconds'] / base:8.2f} {r['state_source']:>11}"
                f" {r['recomputed']:>10} {moved:>10} {wire:>6} {whole:>6}"
            )
        wires = [r["wire_vs_socket"] for r in rows if "vs_socket" in r]
        if wires:
            print(
                f"  in-memory moves: the wire at {statistics.median(wires):.0%} of a loopback socket copy of the"
                " same bytes (median; target >= 50%); 'whole' adds packing, checksums and unpacking"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
