"""The baseline of bench.transition: today's practice measured on the same trainer code. The
job's ranks run directly (`python -m services.trainer`, the code the agents start) against a
fake agent that times every iteration report; at the drawn iteration every rank is SIGKILLed
and all are started again at once from the last persistent checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from bench.transition_model import (
    BASELINE_WORLD_AFTER,
    BASELINE_WORLD_BEFORE,
    DATA_PARALLEL,
    LOST_SPAN,
    BaselineSample,
    Settings,
    bench_spec,
    time_lost,
)
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2 as pb


@dataclass(frozen=True)
class Arrival:
    time: float
    generation: int
    rank: int
    iteration: int
    state_source: str
    restored_iteration: int


def _fake_agent_class() -> type:
    """unicron_dev/fake_agent.py's FakeAgent, timing every iteration report as it arrives
    (imported late: the pure parts and their tests do not need a gRPC server)."""
    from unicron.v1 import trainer_service_pb2 as tpb
    from unicron_dev.fake_agent import FakeAgent

    class TimedAgent(FakeAgent):
        def __init__(self) -> None:
            self.arrivals: list[Arrival] = []
            self._arrived = threading.Condition()
            super().__init__()

        def Connect(self, request_iterator: Iterator[tpb.ConnectRequest], context: Any) -> Any:
            return super().Connect(self._timed(request_iterator), context)

        def _timed(self, requests: Iterator[tpb.ConnectRequest]) -> Iterator[tpb.ConnectRequest]:
            for request in requests:
                if request.WhichOneof("message") == "iteration":
                    report = request.iteration
                    with self._arrived:
                        self.arrivals.append(
                            Arrival(
                                time.time(),
                                report.generation,
                                report.rank,
                                report.iteration,
                                report.state_source,
                                report.restored_iteration,
                            )
                        )
                        self._arrived.notify_all()
                yield request

        def wait(self, found: Callable[[list[Arrival]], Arrival | None], timeout_s: float) -> Arrival | None:
            deadline = time.monotonic() + timeout_s
            with self._arrived:
                while (hit := found(self.arrivals)) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    self._arrived.wait(min(left, 0.5))
                return hit

        def reports_of(self, generation: int, rank: int = 0) -> list[Arrival]:
            with self._arrived:
                return [a for a in self.arrivals if a.generation == generation and a.rank == rank]

    return TimedAgent


class BaselineSide:
    """The job's ranks run directly (`python -m services.trainer`, the same code the agents start)
    against a fake agent; today's recovery is: kill them all, start them all again."""

    def __init__(self, run_dir: Path, settings: Settings) -> None:
        self.run_dir = run_dir
        self.settings = settings
        self._count = 0

    def _spawn(
        self, agent: Any, spec: pb.JobSpec, world: int, generation: int, checkpoint_dir: Path, work: Path
    ) -> list[subprocess.Popen[bytes]]:
        from unicron.redisutil import free_port
        from unicron_dev.localcluster import ROOT as REPO_ROOT

        port = free_port()
        procs = []
        for rank in range(world):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO_ROOT),
                **trainer_env(
                    job_id="baseline",
                    generation=generation,
                    rank=rank,
                    world_size=world,
                    master_addr="127.0.0.1",
                    master_port=port,
                    agent=agent.address,
                    spec=json_format.MessageToJson(spec, indent=None),
                    checkpoint_dir=checkpoint_dir,
                ),
                # As the agent starts its trainers: one thread per rank (one slot each).
                "OMP_NUM_THREADS": "1",
            }
            with open(work / f"gen{generation}-rank{rank}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "services.trainer"],
                        env=env,
                        cwd=REPO_ROOT,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                    )
                )
        return procs

    @staticmethod
    def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    def measure(self, action: str, step: int) -> BaselineSample:
        world_before = BASELINE_WORLD_BEFORE.get(action, DATA_PARALLEL)
        world_after = BASELINE_WORLD_AFTER.get(action, DATA_PARALLEL)
        sample = BaselineSample(action=action, step=step, world_before=world_before, world_after=world_after)
        self._count += 1
        work = self.run_dir / f"baseline-{self._count:02d}-{action}"
        checkpoints = work / "checkpoints"
        work.mkdir(parents=True, exist_ok=True)
        spec = bench_spec("baseline", self.settings.checkpoint_interval, model=self.settings.model)
        agent = _fake_agent_class()()
        procs: list[subprocess.Popen[bytes]] = []
        try:
            procs = self._spawn(agent, spec, world_before, 1, checkpoints, work)

            def reached(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 1 and a.rank == 0 and a.iteration >= step), None)

            deadline = self.settings.start_timeout_s
            if agent.wait(reached, deadline) is None:
                codes = [p.poll() for p in procs]
                raise RuntimeError(f"the ranks did not reach iteration {step} in {deadline:g}s (exit codes {codes})")
            killed = time.time()
            self._kill(procs)  # every process of the job, at once
            procs = self._spawn(agent, spec, world_after, 2, checkpoints, work)

            def first(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 2 and a.rank == 0), None)

            started = agent.wait(first, self.settings.start_timeout_s)
            if started is None:
                raise RuntimeError("the restarted ranks completed no iteration")
            sample.restart_s = round(started.time - killed, 4)
            sample.state_source = started.state_source
            sample.restored_iteration = started.restored_iteration
            # Reports still in flight at the kill were computed before it: every generation-1 report counts.
            sample.step_at_kill = max(a.iteration for a in agent.reports_of(1))
            target = sample.step_at_kill

            def regained(arrivals: list[Arrival]) -> Arrival | None:
                return next((a for a in arrivals if a.generation == 2 and a.rank == 0 and a.iteration >= target), None)

            back = agent.wait(regained, self.settings.start_timeout_s)
            if back is None:
                raise RuntimeError(f"the restarted ranks did not get back to iteration {target}")
            sample.regain_s = round(back.time - killed, 4)
            sample.lost_iterations = max(0, target - started.restored_iteration)

            def past(arrivals: list[Arrival]) -> Arrival | None:
                return next(
                    (a for a in arrivals if a.generation == 2 and a.rank == 0 and a.iteration >= target + LOST_SPAN),
                    None,
                )

            # LOST_SPAN iterations past the kill: what the failure cost against a failure-free run.
            beyond = agent.wait(past, self.settings.start_timeout_s)
            if beyond is not None:
                done = {a.iteration: a.time for a in agent.reports_of(1)}
                lost = time_lost(done, target, beyond.time, done_iteration=beyond.iteration, span=LOST_SPAN)
                sample.lost_s = None if lost is None else round(lost, 4)
        except Exception as exc:  # noqa: BLE001 -- one failed sample must not end the bench
            sample.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._kill(procs)
            agent.stop()
        return sample
