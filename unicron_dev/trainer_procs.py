"""Real trainer processes (`python -m services.trainer`) on 127.0.0.1 for trainer tests and
benches, and a fake agent that moves them to a new process group: it welcomes every trainer,
records what each sends, and once a condition holds sends each chosen process one reform
(tests/trainer, bench/sources.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from google.protobuf import json_format

from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2
from unicron.v1 import trainer_service_pb2 as pb
from unicron_dev.fake_agent import Outbox, RecordingAgent
from unicron_dev.localcluster import ROOT as REPO_ROOT

RANK_TIMEOUT_S = 120

ProcessKey = tuple[int, int]


class ReformAgent(RecordingAgent[ProcessKey]):
    """Records what each process sends, keyed by its hello's (generation, rank). Once
    ``when(self)`` holds (checked after every message), it sends one AgentReform to every
    process in ``moves`` (process -> its rank in the new group), for the new ``generation``,
    ``world_size`` and rendezvous port; a process that connects later gets it on connecting. It
    answers nothing else: errors before or after are left unanswered."""

    def __init__(
        self,
        moves: dict[ProcessKey, int],
        generation: int,
        world_size: int,
        port: int,
        when: Callable[[ReformAgent], bool],
    ) -> None:
        self.moves = moves
        self.generation = generation
        self.world_size = world_size
        self.port = port
        self.when = when
        self.fired = False
        self.fired_at = 0.0
        self.hellos: dict[ProcessKey, pb.TrainerHello] = {}
        self._outboxes: dict[ProcessKey, Outbox] = {}
        super().__init__()

    def key_of(self, hello: pb.TrainerHello) -> ProcessKey:
        return (int(hello.generation), int(hello.rank))

    def _reform(self, key: ProcessKey) -> pb.ConnectResponse:
        return pb.ConnectResponse(
            reform=pb.AgentReform(
                incident_id="inc-reform",
                generation=self.generation,
                rank=self.moves[key],
                world_size=self.world_size,
                master_addr="127.0.0.1",
                master_port=self.port,
            )
        )

    def _check(self) -> None:
        with self._lock:
            if self.fired or not self.when(self):
                return
            self.fired = True
            self.fired_at = time.monotonic()
            for key, outbox in self._outboxes.items():
                if key in self.moves:
                    outbox.put(self._reform(key))

    def on_hello(self, key: ProcessKey, hello: pb.TrainerHello, outbox: Outbox) -> None:
        with self._lock:
            self.hellos[key] = hello
            self._outboxes[key] = outbox
            if self.fired and key in self.moves:
                outbox.put(self._reform(key))
        self._check()

    def on_message(self, key: ProcessKey, request: pb.ConnectRequest, outbox: Outbox) -> None:
        self._check()

    def seconds_to_new_generation(self, key: ProcessKey) -> float:
        """From sending the reform to ``key``'s first report under the new generation."""
        with self._lock:
            for message, at in zip(self.messages[key], self.arrival_times[key], strict=True):
                if message.HasField("iteration") and message.iteration.generation == self.generation:
                    return at - self.fired_at
        raise AssertionError(f"{key} sent no report of generation {self.generation}")

    def any_error(self) -> bool:
        with self._lock:
            return any(m.HasField("error") for ms in self.messages.values() for m in ms)


@dataclass
class RankResult:
    returncode: int
    log: str


@dataclass
class Trainer:
    """One started `python -m services.trainer` process."""

    proc: subprocess.Popen[bytes]
    log_path: Path

    def wait(self, timeout_s: float = RANK_TIMEOUT_S) -> RankResult:
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return RankResult(self.proc.returncode, self.log_path.read_text())


def trainer_process_env(
    agent_address: str,
    spec: common_pb2.JobSpec,
    rank: int,
    world_size: int,
    port: int,
    generation: int = 1,
    checkpoint_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, str]:
    """The whole environment of one rank's ``python -m services.trainer``: this process's, the
    rank's UNICRON_TRAINER_* settings, then ``env``."""
    return {
        **os.environ,
        # One intra-op thread, always, as the agent starts its trainers (trainer_base_env). The
        # thread count decides how a CPU matmul or reduction splits its sums, so two runs
        # compared bit for bit must have the same: one rank at 1 thread against a reference at
        # 2 differs from iteration 1 (grad norm 3.3989802 vs 3.3989805 on the GPT example).
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO_ROOT),
        **trainer_env(
            job_id="job-test",
            generation=generation,
            rank=rank,
            world_size=world_size,
            master_addr="127.0.0.1",
            master_port=port,
            agent=agent_address,
            spec=json_format.MessageToJson(spec),
            collective_timeout_s=60,
            checkpoint_dir=checkpoint_dir or "",
        ),
        **(env or {}),
    }


def start_trainer(
    agent_address: str,
    spec: common_pb2.JobSpec,
    rank: int,
    world_size: int,
    port: int,
    work: Path,
    generation: int = 1,
    checkpoint_dir: Path | None = None,
    env: dict[str, str] | None = None,
) -> Trainer:
    """Starts one rank (log: ``work/g<generation>r<rank>.log``); ``env`` adds UNICRON_TRAINER_*
    settings, e.g. faults or STATE_FROM_PEER."""
    work.mkdir(parents=True, exist_ok=True)
    full_env = trainer_process_env(agent_address, spec, rank, world_size, port, generation, checkpoint_dir, env)
    log_path = work / f"g{generation}r{rank}.log"
    with open(log_path, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "services.trainer"],
            env=full_env,
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    return Trainer(proc, log_path)
