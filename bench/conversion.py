"""Megatron-Core's own example, converted (examples/mcore_loop/converted.py), trained as a Unicron
job of tensor 2 x data 2 with Megatron's default dropout (0.1) through every kind of remedy, and
each trained model compared with the failure-free one's.

    python -m bench.conversion [--iterations 200] [--quick]

What a new user did to the same script before dropout's masks were keyed by their samples: a
crashed rank restarted from a live peer, and a node loss that shrank the job to data 1, each
ended at another loss than the failure-free run (1.92495 and 1.93190 against 1.93348). Here
every run goes through the real services on 127.0.0.1 (LocalCluster: two agents of two slots,
so each tensor-parallel pair has a node of its own):

* failure-free at data 2, and at data 1 (the distance between the two is what a resize may cost);
* a collective error on rank 1: reattempted in place;
* a hang of rank 1: found by the detector, the ranks restarted;
* a crash of rank 3: restarted, its state from a live peer;
* the loss of node-b's agent (last: the node does not come back): re-planned to data 1.

Each model is loaded from the job's final Megatron-Core checkpoint by ``examples.mcore_loop.load``
and compared with the failure-free one. A remedy that keeps the layout passes when the two are
bit-identical (distance 0, the same final loss); the shrink when it lies within twice the distance
between the failure-free runs at data 1 and 2. Results go to bench/results/conversion.json; the
exit status is 0 whatever the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.common import log, write_results
from unicron.client import UnicronClient
from unicron.faults import parse_fault
from unicron.redisutil import free_port
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import LocalCluster

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "conversion.json"
DROPOUT = 0.1  # Megatron's default, and its example's
ENDED = (pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED)
JOB_TIMEOUT_S = 900.0
LOAD_TIMEOUT_S = 300


@dataclass(frozen=True)
class Scenario:
    name: str
    data: int = 2
    fault: str = ""  # parse_fault's syntax; empty: failure-free
    rank: int = 0
    min_data: int = 0
    # Whether the remedy keeps the layout (then the result must be bit-identical).
    same_layout: bool = True


SCENARIOS = (
    Scenario("failure-free"),
    Scenario("failure-free at data 1", data=1),
    Scenario("reattempt (collective error)", fault="exception:connection_reset", rank=1),
    Scenario("restart (hang)", fault="hang", rank=1),
    Scenario("restart from a live peer (crash)", fault="crash", rank=3),
    # Last: node-b's agent is gone for good, and the job goes on at data 1 on node-a.
    Scenario("shrink to data 1 (node loss)", fault="agent-loss", rank=3, min_data=1, same_layout=False),
)


@dataclass
class Outcome:
    scenario: str
    state: str
    final_loss: float
    iteration: int
    seconds: float
    remedies: list[str] = field(default_factory=list)
    incidents: list[str] = field(default_factory=list)
    # Each resumption, with where the state came from ("state: peer at iteration 19, ...").
    resumed: list[str] = field(default_factory=list)
    data_parallel_at_end: int = 0
    distance: float | None = None  # to the failure-free model: largest relative parameter difference
    bound: float | None = None
    verdict: str = ""


def spec_of(scenario: Scenario, iterations: int) -> pb.JobSpec:
    spec = pb.JobSpec(name=f"conversion-{re.sub(r'[^a-z0-9]+', '-', scenario.name).strip('-')}")
    spec.program.entry_point = "examples.mcore_loop.converted:main"
    spec.program.args.extend(["--dropout", str(DROPOUT)])
    spec.parallelism.tensor, spec.parallelism.data = 2, scenario.data
    spec.parallelism.min_data = scenario.min_data
    t = spec.training
    t.iterations, t.global_batch_size, t.micro_batch_size = iterations, 8, 2
    t.learning_rate, t.seed, t.checkpoint_interval = 1e-3, 1234, 50
    return spec


def run_job(cluster: LocalCluster, client: UnicronClient, scenario: Scenario, iterations: int) -> tuple[Outcome, Path]:
    """One job through to its end, the fault injected a third of the way in."""
    started = time.monotonic()
    job_id = client.submit(spec_of(scenario, iterations)).job_id
    if scenario.fault:
        _wait(client, job_id, lambda j: j.progress.iteration >= iterations // 3 or j.state in ENDED)
        client.inject(job_id, parse_fault(scenario.fault, scenario.rank))
    job = _wait(client, job_id, lambda j: j.state in ENDED)
    incidents = [i for i in client.incidents(job_id) if i.kind != pb.FAILURE_KIND_STRAGGLER]
    outcome = Outcome(
        scenario=scenario.name,
        state=pb.JobState.Name(job.state),
        final_loss=job.progress.loss,
        iteration=job.progress.iteration,
        seconds=round(time.monotonic() - started, 1),
        remedies=[pb.Remedy.Name(r.remedy) for r in job.remedies],
        incidents=[f"{i.summary} -> {i.action_taken}" for i in incidents],
        resumed=[c.reason for c in job.history if c.reason.startswith("training resumed")],
        data_parallel_at_end=job.assignment.world_size // 2,
    )
    return outcome, cluster.run_dir / "agents" / "checkpoints" / job_id / "final"


def _wait(client: UnicronClient, job_id: str, done: Any) -> pb.Job:
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not done(job := client.get(job_id)):
        if time.monotonic() > deadline:
            client.cancel(job_id, "bench timeout")
            raise TimeoutError(f"{job_id} did not get there in {JOB_TIMEOUT_S:.0f} s (state {job.state})")
        time.sleep(0.5)
    return job


def model_distance(a: Path, b: Path) -> float:
    """The largest relative parameter difference between two trained models, loaded at TP 2 by
    the plain Megatron-Core script the conversion guide shows."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1"]
    argv += ["--master-port", str(free_port()), "-m", "examples.mcore_loop.load", str(a), str(b)]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=LOAD_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"loading {a} and {b} failed: {done.stderr[-2000:]}")
    decoder = json.JSONDecoder()
    found = [decoder.raw_decode(done.stdout, m.start())[0] for m in re.finditer(r'\{"rank"', done.stdout)]
    return max(float(f["distance"]) for f in found)


def judge(outcome: Outcome, reference: Outcome, resize_distance: float) -> str:
    """PASS or FAIL, with why: a same-layout remedy must be bit-identical, a resize within twice
    the failure-free distance between the two sizes."""
    if outcome.state != "JOB_STATE_SUCCEEDED" or outcome.distance is None:
        return f"FAIL: ended {outcome.state}"
    if outcome.bound is None:
        if outcome.distance == 0.0 and outcome.final_loss == reference.final_loss:
            return "PASS: bit-identical"
        return f"FAIL: distance {outcome.distance:.3g}, loss {outcome.final_loss!r} vs {reference.final_loss!r}"
    if outcome.distance <= outcome.bound:
        return f"PASS: within 2 x {resize_distance:.3g}"
    return f"FAIL: {outcome.distance:.3g} above 2 x {resize_distance:.3g}"


def run(iterations: int, work: Path) -> dict[str, Any]:
    outcomes: list[Outcome] = []
    finals: dict[str, Path] = {}
    cluster = LocalCluster(work / "cluster", fault_injection=True)
    cluster.start()
    try:
        with cluster.client() as client:
            cluster.wait_nodes(client.nodes, cluster.agents)
            for scenario in SCENARIOS:
                log(f"{scenario.name}: {iterations} iterations")
                outcome, finals[scenario.name] = run_job(cluster, client, scenario, iterations)
                log(f"  {outcome.state} at iteration {outcome.iteration}, loss {outcome.final_loss!r}")
                outcomes.append(outcome)
    finally:
        cluster.stop()
    reference, at_one = outcomes[0], outcomes[1]
    resize_distance = model_distance(finals[SCENARIOS[0].name], finals[SCENARIOS[1].name])
    at_one.distance = resize_distance
    for scenario, outcome in zip(SCENARIOS[2:], outcomes[2:], strict=True):
        if outcome.state == "JOB_STATE_SUCCEEDED":
            outcome.distance = model_distance(finals[SCENARIOS[0].name], finals[scenario.name])
        outcome.bound = None if scenario.same_layout else 2 * resize_distance
        outcome.verdict = judge(outcome, reference, resize_distance)
    return {
        "iterations": iterations,
        "dropout": DROPOUT,
        "layout": "tensor 2 x data 2",
        "failure_free_distance_data_1_to_2": resize_distance,
        "runs": [asdict(o) for o in outcomes],
        "passed": all(o.verdict.startswith("PASS") for o in outcomes[2:]),
    }


def table(results: dict[str, Any]) -> str:
    lines = [
        f"Megatron-Core's example converted, TP 2 x DP 2, {results['iterations']} iterations, dropout "
        f"{results['dropout']}",
        f"{'run':36} {'state':10} {'final loss':>12} {'distance':>10}  verdict",
    ]
    for run in results["runs"]:
        distance = "" if run["distance"] is None else f"{run['distance']:.3g}"
        state = run["state"].removeprefix("JOB_STATE_").lower()
        lines.append(f"{run['scenario']:36} {state:10} {run['final_loss']:12.6f} {distance:>10}  {run['verdict']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=200, help="iterations per job (default 200)")
    parser.add_argument("--quick", action="store_true", help="60 iterations per job")
    args = parser.parse_args(argv)
    iterations = 60 if args.quick else args.iterations
    work = Path(tempfile.mkdtemp(prefix="unicron-bench-conversion-"))
    try:
        results = run(iterations, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    write_results(RESULTS, results)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
