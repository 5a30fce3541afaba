"""What buddy copies cost (unicron/trainer/buddy.py): the same job, bf16 with Megatron's
distributed optimizer on two data-parallel ranks on two "nodes", run once without buddy copies
(replication 1) and once with them (2), in the same run. Per rank: the bytes it keeps for its
buddy, the time a refresh takes (send its own shard, receive the buddy's, checksums) against
the iteration time, and the refresh's throughput against this machine's own limit, a plain
loopback socket copy of the same bytes measured here.

    python -m bench.buddy [--model LAYERS:HIDDEN] [--iterations N]

Results go to bench/results/buddy.json and a table to stdout. A measurement, not a test: the
exit status is 0 whatever the numbers. See bench/README.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from bench.common import log, write_results
from unicron.redisutil import free_port
from unicron.trainer.settings import trainer_env
from unicron_dev.fake_agent import FakeAgent
from unicron_dev.localcluster import ROOT, llm_gpt

RESULTS = Path(__file__).parent / "results" / "buddy.json"
TARGET_OVERHEAD = 0.05  # of iteration time, at 10M parameters (the issue's)
WARMUP = 2  # iterations left out of the means: the first ones pay for start-up


def run_job(layers: int, hidden: int, iterations: int, replication: int, work: Path) -> dict[str, Any]:
    """Two ranks of one job on nodes "a" and "b"; their iteration seconds and buddy summaries."""
    spec = llm_gpt("buddy-bench", layers, hidden, data=2, iterations=iterations)
    spec.training.replication = replication
    agent = FakeAgent()
    port = free_port()
    procs = []
    try:
        for rank, node in enumerate(("node-a", "node-b")):
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                **trainer_env(
                    job_id="job-buddy",
                    generation=1,
                    rank=rank,
                    world_size=2,
                    master_addr="127.0.0.1",
                    master_port=port,
                    agent=agent.address,
                    node=node,
                    spec=json_format.MessageToJson(spec),
                ),
            }
            out = open(work / f"r{replication}-rank{rank}.log", "w")
            procs.append(
                (
                    subprocess.Popen(
                        [sys.executable, "-m", "services.trainer"],
                        env=env,
                        cwd=ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    ),
                    out,
                )
            )
        for proc, out in procs:
            proc.wait(timeout=1800)
            out.close()
    finally:
        agent.stop()
    ranks = []
    for rank in range(2):
        arrived = agent.arrived(rank, "iteration")[WARMUP:]
        # Wall time per iteration, report to report: the step, the refresh and whatever the
        # copy in flight takes from the step on a machine whose cores the step uses.
        seconds = [b - a for a, b in itertools.pairwise(arrived)]
        summary: dict[str, Any] = {}
        for line in (work / f"r{replication}-rank{rank}.log").read_text().splitlines():
            if '"msg": "buddy copies"' in line:
                summary = json.loads(line)
        ranks.append(
            {
                "iteration_s": statistics.mean(seconds) if seconds else 0.0,
                "held_bytes": int(summary.get("held_bytes", 0)),
                "refreshes": int(summary.get("refreshes", 0)),
                "refresh_s": float(summary.get("refresh_seconds", 0.0)),
                "copy_bytes": int(summary.get("copy_bytes", 0)),
                "transfer_s": float(summary.get("transfer_seconds", 0.0)) / max(1, int(summary.get("refreshes", 0))),
            }
        )
    return {"replication": replication, "ranks": ranks}


def socket_copy_seconds(size: int) -> float:
    """Seconds to copy ``size`` bytes over a loopback TCP socket, the way a plain program would."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    payload = bytearray(size)
    received = bytearray(size)

    def serve() -> None:
        conn, _ = server.accept()
        view, got = memoryview(received), 0
        while got < size:
            got += conn.recv_into(view[got:], size - got)
        conn.sendall(b"k")
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    began = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as client:
        client.sendall(payload)
        client.recv(1)
    took = time.perf_counter() - began
    thread.join()
    server.close()
    return took


def report(without: dict[str, Any], with_copies: dict[str, Any], socket_s: float) -> dict[str, Any]:
    base = statistics.mean(r["iteration_s"] for r in without["ranks"])
    rows = []
    for r in with_copies["ranks"]:
        refresh = r["refresh_s"] / r["refreshes"] if r["refreshes"] else 0.0
        rows.append(
            {
                "held_mb": r["held_bytes"] / 1e6,
                "refresh_s": refresh,
                "refresh_share": refresh / base if base else 0.0,
                "iteration_s": r["iteration_s"],
                "transfer_s": r["transfer_s"],
                # A refresh sends this rank's shard while its buddy's arrives: bytes each way.
                "transfer_mb_s": r["copy_bytes"] / 1e6 / r["transfer_s"] if r["transfer_s"] else 0.0,
            }
        )
    copy_bytes = max(r["copy_bytes"] for r in with_copies["ranks"])
    socket_mb_s = copy_bytes / 1e6 / socket_s if socket_s else 0.0
    with_copies = statistics.mean(r["iteration_s"] for r in rows)
    return {
        "iteration_s_without": base,
        "iteration_s_with": with_copies,
        "ranks": rows,
        "overhead": with_copies / base - 1 if base else 0.0,
        "target_overhead": TARGET_OVERHEAD,
        "socket_mb_s": socket_mb_s,
        "transfer_vs_socket": max(r["transfer_mb_s"] for r in rows) / socket_mb_s if socket_mb_s else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="4:448", help="LAYERS:HIDDEN of the GPT (default 4:448, 10M parameters)")
    parser.add_argument("--iterations", type=int, default=12, help="iterations per run (default 12)")
    args = parser.parse_args(argv)
    layers, hidden = (int(v) for v in args.model.split(":"))
    with tempfile.TemporaryDirectory(prefix="bench-buddy-") as tmp:
        runs = []
        for replication in (1, 2):
            log(f"replication {replication}: {args.iterations} iterations of GPT {layers}x{hidden}, DP 2 on two nodes")
            runs.append(run_job(layers, hidden, args.iterations, replication, Path(tmp)))
    copy_bytes = max(r["copy_bytes"] for r in runs[1]["ranks"])
    socket_s = min(socket_copy_seconds(copy_bytes) for _ in range(3)) if copy_bytes else 0.0
    result = {"model": args.model, "iterations": args.iterations, **report(runs[0], runs[1], socket_s)}
    write_results(RESULTS, result)
    print(f"buddy copies, GPT {args.model} (bf16, distributed optimizer, DP 2 on two nodes)")
    print(f"  iteration without copies  {result['iteration_s_without']:.3f} s")
    print(f"  iteration with copies     {result['iteration_s_with']:.3f} s (report to report)")
    for rank, row in enumerate(result["ranks"]):
        print(
            f"  rank {rank}: {row['held_mb']:.1f} MB for the copies (its buddy's and its own send buffer);"
            f" refresh {row['refresh_s'] * 1e3:.1f} ms, of which moving the bytes {row['transfer_s'] * 1e3:.1f} ms"
            f" ({row['transfer_mb_s']:.0f} MB/s each way)"
        )
    verdict = "PASS" if result["overhead"] <= TARGET_OVERHEAD else "FAIL"
    print(f"  overhead {result['overhead']:.1%} of iteration time (target <= {TARGET_OVERHEAD:.0%}): {verdict}")
    print(
        f"  loopback socket copy of the same bytes: {result['socket_mb_s']:.0f} MB/s;"
        f" the copies at {result['transfer_vs_socket']:.0%} of it (target >= 50%)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
