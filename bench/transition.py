"""Transition benchmark: how fast a job is back in training after each remedy the system performs
today, and how many iterations it recomputes, on real jobs (real trainer processes, real agents,
coordinator and planners on 127.0.0.1), side by side with today's practice measured on the same
trainer code: stop every process of the job, start them all again from the last persistent
checkpoint, recompute the lost steps.

    python -m bench.transition [--quick] [--repeats N] [--actions reattempt,restart,resize]

For each action and repeat it submits a fresh tiny GPT job (data-parallel 2, one rank per node),
injects the action's fault at an iteration drawn in 55..95 (never a multiple of the checkpoint
interval, 50), and reads the incident: transition = its `resumed` minus its `detected` (the
classified report), iterations recomputed = the coordinator's own count in the job's history. The
baseline runs the same ranks (`python -m services.trainer`) against a minimal fake agent, kills
them all after the same iteration, starts them all again on the same checkpoint directory and
times the first iteration after the restart and the return to the killed iteration. Results go to
bench/results/transition.json; a table with PASS/FAIL per target goes to stdout. The exit status
is 0 whatever the numbers: this is a measurement, not a test. See bench/README.md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil

from bench.common import log, stamp_seconds, write_results
from bench.detection import job_trainers
from bench.transition_baseline import BaselineSide
from bench.transition_model import (  # re-exported: the tests and bench.peers read them here
    ACTIONS,
    BASELINE_WORLD_AFTER,
    CHECKPOINT_INTERVAL,
    DATA_PARALLEL,
    EXPECTED_KIND,
    EXPECTED_REMEDY,
    FAULTS,
    JOB_DATA,
    LOST_FLOOR_S,
    LOST_SPAN,
    START_ATTEMPTS,
    STEP_RANGE,
    TARGET_SPEEDUP,
    WARM_ITERATIONS,
    BaselineSample,
    Event,
    JobEndedEarly,
    Resumed,
    Sample,
    Settings,
    _remedy_name,
    bench_spec,
    build_report,
    checkpoint_lost,
    draw_steps,
    format_table,
    lost_iterations,
    parse_resumed,
    recovery_from_events,
    time_lost,
    verdict_reasons,
)
from unicron.client import ClientError, UnicronClient
from unicron.faults import parse_fault
from unicron.v1 import common_pb2 as pb
from unicron_dev.localcluster import LocalCluster

__all__ = [
    "ACTIONS",
    "BASELINE_WORLD_AFTER",
    "CHECKPOINT_INTERVAL",
    "EXPECTED_KIND",
    "EXPECTED_REMEDY",
    "FAULTS",
    "LOST_FLOOR_S",
    "TARGET_SPEEDUP",
    "BaselineSample",
    "Event",
    "Resumed",
    "Sample",
    "UnicronSide",
    "_remedy_name",
    "build_report",
    "checkpoint_lost",
    "draw_steps",
    "format_table",
    "lost_iterations",
    "main",
    "parse_resumed",
    "recovery_from_events",
    "time_lost",
    "verdict_reasons",
]
_TERMINAL = (pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED, pb.JOB_STATE_SUCCEEDED)

RESULTS = Path(__file__).resolve().parent / "results" / "transition.json"


class UnicronSide:
    """Faults injected into real jobs on a LocalCluster, measured from the incident record and
    the job's event log."""

    def __init__(self, cluster: LocalCluster, client: UnicronClient, settings: Settings) -> None:
        self.cluster = cluster
        self.client = client
        self.settings = settings

    def start_job(self, action: str) -> pb.Job:
        name = f"bt-{action.replace('_', '-')}-{uuid.uuid4().hex[:8]}"
        data = JOB_DATA.get(action, DATA_PARALLEL)
        job = self.client.submit(
            bench_spec(name, self.settings.checkpoint_interval, data=data, model=self.settings.model)
        )
        deadline = time.monotonic() + self.settings.start_timeout_s
        while True:
            current = self.client.get(job.job_id)
            if current.progress.iteration >= WARM_ITERATIONS and current.state == pb.JOB_STATE_RUNNING:
                return current
            if current.state in _TERMINAL or current.remedies:
                # A (false) failure before the fault, e.g. a hang flagged during warm-up under load.
                self.finish_job(job.job_id)
                raise JobEndedEarly(f"job {name} had an incident before the injection: {current.reason}")
            if time.monotonic() > deadline:
                self.finish_job(job.job_id)
                raise RuntimeError(f"job {name} did not reach iteration {WARM_ITERATIONS}")
            time.sleep(0.1)

    def finish_job(self, job_id: str) -> None:
        procs = job_trainers(self.cluster, job_id)
        try:
            if self.client.get(job_id).state not in _TERMINAL:
                self.client.cancel(job_id, "bench: measured")
        except ClientError as exc:
            log(f"cancel of {job_id}: {exc}")
        _, alive = psutil.wait_procs(procs, timeout=20)
        for proc in alive:
            log(f"killing leftover trainer {proc.pid} of {job_id}")
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass

    def events(self, job_id: str, timeout_s: float = 20.0) -> list[Event]:
        """The job's whole event log (it must have ended, or the stream would not)."""
        out: list[Event] = []
        deadline = time.monotonic() + timeout_s
        stream = self.client.watch(job_id, after_event_id="0")
        try:
            for item in stream:
                kind = pb.JobEventType.Name(item.type).removeprefix("JOB_EVENT_TYPE_").lower()
                out.append(
                    Event(kind, stamp_seconds(item.time), int(item.progress.iteration), item.message, item.incident_id)
                )
                if time.monotonic() > deadline:
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
        return out

    def measure(self, action: str, index: int, step: int) -> Sample:
        rank = index % JOB_DATA.get(action, DATA_PARALLEL)
        text = FAULTS[action]
        sample = Sample(action=action, fault=f"{text}@{step + 1}", rank=rank, step=step)
        job: pb.Job | None = None
        for attempt in range(START_ATTEMPTS):
            try:
                job = self.start_job(action)
                break
            except JobEndedEarly as exc:
                sample.other_incidents.append(f"before injection: {exc}")
                if attempt == START_ATTEMPTS - 1:
                    sample.error = str(exc)
                    return sample
        assert job is not None
        sample.job_id = job.job_id
        sample.size_before = job.assignment.world_size
        sample.generation_before = job.assignment.generation
        detected: float | None = None
        try:
            if job.progress.iteration >= step:
                raise RuntimeError(f"job already at iteration {job.progress.iteration} before the injection")
            injected_at = time.time()
            self.client.inject(job.job_id, parse_fault(sample.fault, rank))
            incident, resumed_at, resumed = self._await_recovery(sample, injected_at)
            detected = stamp_seconds(incident.detected)
            sample.transition_s = round(resumed_at - detected, 4)
            if incident.HasField("resumed"):
                sample.cost_transition_s = round(incident.cost.transition_seconds, 4)
            current = self.client.get(job.job_id)
            sample.size_after = current.assignment.world_size
            sample.generation_after = current.assignment.generation
            if resumed is None:
                raise RuntimeError("the job's resume line could not be read")
            sample.resumed_by = resumed.remedy
            sample.state_source = resumed.source
            sample.restored_iteration = resumed.restored
            sample.recomputed = resumed.recomputed
            sample.lost_iterations = lost_iterations(step, resumed)
            # Back where it was (the iteration it had reached before the failure), and LOST_SPAN
            # past it, where its time lost is read.
            self._await_iteration(job.job_id, max(step, resumed.restored + resumed.recomputed) + LOST_SPAN)
            if action == "grow":
                self._grow(sample, current)
                detected = None  # the shrink's event log says nothing of the grow
        except Exception as exc:  # noqa: BLE001 -- one failed injection must not end the bench
            sample.error = sample.error or f"{type(exc).__name__}: {exc}"
        finally:
            self.finish_job(job.job_id)
        if detected is not None:
            try:
                self._from_events(sample, detected)
            except Exception as exc:  # noqa: BLE001
                sample.error = sample.error or f"events: {type(exc).__name__}: {exc}"
        return sample

    def _grow(self, sample: Sample, shrunk: pb.Job) -> None:
        """The shrunk job's isolated node comes back (its agent registers again, as a repaired
        node does) and the re-plan grows the job onto it. The job trains on at its old size
        while the new rank starts; the sample becomes the grow's: the pause (the old size's
        last iteration -> the first at the new size), the preparation (the re-plan's
        assignment -> that first iteration), and what the new rank's state cost (it comes
        from a live peer: nothing recomputed)."""
        # Kept apart from the chain, whose entries beyond the first are follow-up incidents.
        sample.preceded_by = f"shrink {sample.size_before}->{sample.size_after} in {sample.transition_s}s"
        self.ensure_nodes_ready()
        deadline = time.monotonic() + self.settings.recovery_timeout_s
        reached: dict[int, float] = {}  # iteration -> when the coordinator recorded it
        while True:
            job = self.client.get(sample.job_id)
            reached.setdefault(job.progress.iteration, stamp_seconds(job.progress.updated))
            grown = job.assignment.generation > shrunk.assignment.generation and job.assignment.world_size > 1
            assigned = stamp_seconds(job.assignment.assigned)
            lines = [c for c in job.history if "training resumed" in c.reason and stamp_seconds(c.time) >= assigned]
            if grown and lines:
                break
            if job.state in _TERMINAL:
                raise RuntimeError(f"job ended before it grew: {pb.JobState.Name(job.state)}: {job.reason}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the job did not grow within {self.settings.recovery_timeout_s:g}s: {job.reason}")
            time.sleep(0.1)
        resumed = parse_resumed(lines[0].reason)
        if resumed is None:
            raise RuntimeError(f"the grow's resume line could not be read: {lines[0].reason}")
        sample.size_before, sample.size_after = shrunk.assignment.world_size, job.assignment.world_size
        sample.generation_before, sample.generation_after = shrunk.assignment.generation, job.assignment.generation
        resumed_at = stamp_seconds(lines[0].time)
        sample.prepare_s = round(resumed_at - assigned, 4)
        # Polled every 0.1 s, so the old size's last iteration may have gone unseen: then the
        # pause is counted from the assignment, the most it can be.
        last_old = reached.get(resumed.restored, assigned)
        sample.transition_s = round(resumed_at - max(last_old, assigned), 4)
        sample.cost_transition_s = None
        sample.resumed_by, sample.state_source = resumed.remedy, resumed.source
        sample.restored_iteration, sample.recomputed = resumed.restored, resumed.recomputed
        sample.lost_iterations = resumed.recomputed

    def _await_recovery(self, sample: Sample, injected_at: float) -> tuple[pb.Incident, float, Resumed | None]:
        """Waits for the failure's incident (the first after the injection) and for the job's
        first resume after it, whichever incident that resume closes: a remedy that fails
        leads to a follow-up incident, and the failure costs until the job trains again.
        Returns (incident, when the job resumed, the resume's history line)."""
        expected = EXPECTED_KIND[sample.action]
        deadline = time.monotonic() + self.settings.recovery_timeout_s
        first_id = ""
        while True:
            found = sorted(
                (
                    i
                    for i in self.client.incidents(sample.job_id)
                    if stamp_seconds(i.detected) >= injected_at - 0.5 and i.kind != pb.FAILURE_KIND_STRAGGLER
                ),
                key=lambda i: stamp_seconds(i.detected),
            )
            job = self.client.get(sample.job_id)
            if found:
                first = next((i for i in found if i.incident_id == first_id), found[0])
                first_id = first.incident_id
                detected = stamp_seconds(first.detected)
                lines = [c for c in job.history if "training resumed" in c.reason and stamp_seconds(c.time) >= detected]
                if lines:
                    sample.incident_id = first.incident_id
                    sample.kind = pb.FailureKind.Name(first.kind)
                    sample.remedy = _remedy_name(first.remedy) if first.remedy else ""
                    sample.chain = [
                        f"{pb.FailureKind.Name(i.kind).removeprefix('FAILURE_KIND_')}:"
                        f"{_remedy_name(i.remedy) if i.remedy else 'none'}"
                        for i in found
                        if stamp_seconds(i.detected) <= stamp_seconds(lines[0].time)
                    ]
                    if first.kind != expected:
                        sample.error = f"the first incident after the injection is {sample.kind}, not the fault's"
                    return first, stamp_seconds(lines[0].time), parse_resumed(lines[0].reason)
            if job.state in _TERMINAL:
                raise RuntimeError(f"job ended: {pb.JobState.Name(job.state)}: {job.reason}")
            if time.monotonic() > deadline:
                kinds = [pb.FailureKind.Name(i.kind) for i in found]
                raise RuntimeError(
                    f"the job did not resume within {self.settings.recovery_timeout_s:g}s (incidents {kinds})"
                )
            time.sleep(0.1)

    def _await_iteration(self, job_id: str, iteration: int, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.client.get(job_id).progress.iteration < iteration:
            if time.monotonic() > deadline:
                raise RuntimeError(f"did not get back to iteration {iteration} within {timeout_s:g}s")
            time.sleep(0.1)

    def _from_events(self, sample: Sample, detected: float) -> None:
        recovery = recovery_from_events(self.events(sample.job_id), detected, at_least=sample.step)
        if recovery is None:
            return
        sample.pre_failure_iteration = recovery["pre_failure_iteration"]
        if sample.restored_iteration is not None:
            sample.recomputed_from_events = max(0, recovery["pre_failure_iteration"] - sample.restored_iteration)
        if recovery["regained_at"] is not None:
            sample.regain_s = round(recovery["regained_at"] - detected, 4)
        if recovery["lost_s"] is not None:
            sample.lost_s = round(recovery["lost_s"], 4)
        if recovery["free_resumed_at"] is not None:
            sample.free_s = round(recovery["free_resumed_at"] - detected, 4)

    def ensure_nodes_ready(self) -> None:
        """A resize leaves its node ISOLATED: restart that agent (a repaired node registering
        again) and wait until every node is READY."""
        states = {n.node_id: n.state for n in self.client.nodes()}
        for node_id, node_state in sorted(states.items()):
            if node_state == pb.NODE_STATE_READY:
                continue
            service = self.cluster.service(node_id)
            if service.proc.poll() is None:
                service.proc.send_signal(signal.SIGTERM)
                try:
                    service.proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    service.proc.kill()
                    service.proc.wait()
            self.cluster.restart(node_id)
        if any(s != pb.NODE_STATE_READY for s in states.values()):
            self.cluster.wait_nodes(self.client.nodes, self.cluster.agents, timeout_s=60)


# ---- main ----------------------------------------------------------------------------------

NOTES = [
    "p50_s: the incident's resumed - detected (detected: the coordinator held its first classified report; "
    "resumed: it received rank 0's first iteration in the new configuration, through the agent's 0.2 s report "
    "batching); cost_transition_p50_s is the incident's own cost.transition_seconds",
    "lost_iterations: the coordinator's count in the job history ('K iterations recomputed': the iteration before "
    "the failure minus the restored one); the most over the samples, so 0 means no sample lost any",
    "baseline: the same trainer processes against a fake agent (tests/trainer/harness.py), every rank SIGKILLed "
    "after the drawn iteration and started again at once on the same checkpoint directory (checkpoint interval as "
    "in settings); baseline_p50_s is kill -> rank 0's first iteration after the restart, baseline_regain_p50_s "
    "kill -> rank 0 back at the killed iteration. It has no detection, no control plane and an instant kill: the "
    "most favourable case of today's practice",
    "resize: an ECC error on one rank (SEV1) isolates its node and the re-plan shrinks the job from 2 ranks to 1 on "
    "the node left; its baseline restarts 1 rank (the node is gone). The isolated node's agent is restarted "
    "afterwards (a repaired node registering again)",
    "both sides fail after the same drawn iteration (uniform in the step range, never a multiple of the checkpoint "
    "interval); Unicron's fault fires at that iteration + 1, so the iteration before the failure is the drawn one",
    "the machine is shared and small: process start-up (torch and Megatron imports) dominates both sides, and "
    "other load moves every number",
]


def _interrupt(_signum: int, _frame: Any) -> None:
    raise KeyboardInterrupt("terminated")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transition", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 repeat per action")
    parser.add_argument("--repeats", type=int, default=None, help="samples per action (default 3, quick 1)")
    parser.add_argument("--actions", default=",".join(ACTIONS), help=f"comma-separated subset of {','.join(ACTIONS)}")
    parser.add_argument(
        "--checkpoint-interval", type=int, default=CHECKPOINT_INTERVAL, help="both sides' persistent checkpoints"
    )
    parser.add_argument("--steps", default=f"{STEP_RANGE[0]}-{STEP_RANGE[1]}", help="range of failure iterations")
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn failure iterations")
    parser.add_argument(
        "--model",
        default="gpt",
        help="gpt (the tiny GPT, default), digits:WIDTH (the MLP; 1024 is 1.1M parameters), llm:LAYERS:HIDDEN"
        " (the GPT in bf16 with the distributed optimizer and dropout; llm:4:448 is 10M parameters) or"
        " llama:SIZE (the FSDP2 example in bf16: tiny, 10m, 100m)",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the baseline (development only)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"JSON results (default {RESULTS})")
    parser.add_argument("--keep-logs", action="store_true", help="keep the run directory")
    args = parser.parse_args(argv)
    actions = [a for a in args.actions.split(",") if a]
    unknown = set(actions) - set(ACTIONS)
    if unknown:
        parser.error(f"unknown actions: {', '.join(sorted(unknown))}")
    low_text, _, high_text = args.steps.partition("-")
    try:
        step_range = (int(low_text), int(high_text))
    except ValueError:
        parser.error(f"--steps must be LOW-HIGH, got {args.steps!r}")
    if step_range[0] <= WARM_ITERATIONS + 5 or step_range[0] > step_range[1]:
        parser.error(f"--steps must lie above iteration {WARM_ITERATIONS + 5} and be ordered")
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    settings = Settings(
        repeats=repeats,
        actions=actions,
        checkpoint_interval=args.checkpoint_interval,
        step_range=step_range,
        seed=args.seed,
        model=args.model,
    )
    steps = draw_steps(actions, repeats, args.seed, *step_range, interval=args.checkpoint_interval)
    signal.signal(signal.SIGTERM, _interrupt)
    run_dir = Path(tempfile.mkdtemp(prefix="bench-transition-"))
    began = time.monotonic()
    environment: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    log(f"run directory {run_dir}; failure iterations {steps}")
    samples: list[Sample] = []
    baseline: list[BaselineSample] = []
    # Snapshots in memory and Redis off the checkpoints' disk, as deployed (LocalCluster.scratch_dir).
    scratch = Path(tempfile.mkdtemp(prefix="bench-transition-", dir="/dev/shm")) if Path("/dev/shm").is_dir() else None
    cluster = LocalCluster(
        run_dir / "cluster",
        agents=DATA_PARALLEL,
        slots_per_agent=1,
        fault_injection=True,
        warm_spares=1,
        scratch_dir=scratch,
    )
    try:
        cluster.start()
        with cluster.client() as client:
            cluster.wait_nodes(client.nodes, cluster.agents)
            unicron_side = UnicronSide(cluster, client, settings)
            baseline_side = BaselineSide(run_dir, settings)
            # Interleaved (one Unicron sample, then its baseline at the same iteration), so both
            # sides meet the same background load.
            for index in range(repeats):
                for action in actions:
                    step = steps[action][index]
                    sample = unicron_side.measure(action, index, step)
                    samples.append(sample)
                    log(
                        f"{action:<9} #{index + 1} step {step}: transition {sample.transition_s}s regain "
                        f"{sample.regain_s}s source {sample.state_source or '-'} recomputed {sample.recomputed} "
                        f"size {sample.size_before}->{sample.size_after} remedy {sample.remedy or '-'} {sample.error}"
                    )
                    unicron_side.ensure_nodes_ready()
                    if not args.no_baseline:
                        base = baseline_side.measure(action, step)
                        baseline.append(base)
                        log(
                            f"{'baseline':<9} #{index + 1} step {base.step_at_kill}: restart {base.restart_s}s "
                            f"regain {base.regain_s}s lost {base.lost_iterations} {base.error}"
                        )
    except (Exception, KeyboardInterrupt) as exc:  # noqa: BLE001 -- report what was measured before it broke
        log(f"bench aborted: {type(exc).__name__}: {exc}")
        environment["aborted"] = f"{type(exc).__name__}: {exc}"
    finally:
        leftovers = cluster.stop()
        if leftovers:
            log(f"processes outlived their cluster and were killed: {leftovers}")
    environment["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    environment["wall_s"] = round(time.monotonic() - began, 1)
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    if args.keep_logs:
        log(f"logs kept in {run_dir}")
    else:
        shutil.rmtree(run_dir, ignore_errors=True)
    report = build_report(
        samples,
        baseline,
        extra={
            "settings": {
                "repeats": repeats,
                "actions": actions,
                "faults": {a: FAULTS[a] for a in actions},
                "checkpoint_interval": args.checkpoint_interval,
                "step_range": list(step_range),
                "seed": args.seed,
                "model": args.model,
                "steps": steps,
                "data_parallel": DATA_PARALLEL,
                "baseline_world_after": {a: BASELINE_WORLD_AFTER.get(a, DATA_PARALLEL) for a in actions},
                "target_speedup": {a: TARGET_SPEEDUP[a] for a in actions},
            },
            "environment": environment,
            "notes": NOTES,
        },
    )
    write_results(args.out, report)
    print(format_table(report))
    print(f"\nwrote {args.out} ({environment['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
