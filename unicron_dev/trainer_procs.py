"""Real trainer processes (`python -m services.trainer`) on 127.0.0.1 for trainer tests and
benches, and a fake agent that moves them to a new process group: it welcomes every trainer,
records what each sends, and once a condition holds sends each chosen process one reform
(tests/trainer, bench/sources.py)."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import json_format

from unicron import rpc
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2, trainer_service_pb2_grpc
from unicron.v1 import trainer_service_pb2 as pb
from unicron_dev.localcluster import ROOT as REPO_ROOT

RANK_TIMEOUT_S = 120

ProcessKey = tuple[int, int]


class ReformAgent(trainer_service_pb2_grpc.TrainerAgentServiceServicer):
    """Welcomes every trainer and records what each process sends, keyed by its hello's
    (generation, rank). Once ``when(self)`` holds (checked after every message), it sends one
    AgentReform to every process in ``moves`` (process -> its rank in the new group), for the
    new ``generation``, ``world_size`` and rendezvous port; a process that connects later gets
    it on connecting. It answers nothing else: errors before or after are left unanswered."""

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
        self.messages: dict[ProcessKey, list[pb.ConnectRequest]] = defaultdict(list)
        # time.monotonic() of each message's arrival, in step with `messages`.
        self.arrivals: dict[ProcessKey, list[float]] = defaultdict(list)
        self.hellos: dict[ProcessKey, pb.TrainerHello] = {}
        self._outboxes: dict[ProcessKey, queue.Queue[pb.ConnectResponse | None]] = {}
        self._lock = threading.RLock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=rpc.SERVER_OPTIONS)
        trainer_service_pb2_grpc.add_TrainerAgentServiceServicer_to_server(self, self._server)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def stop(self) -> None:
        self._server.stop(0.5).wait()

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

    def Connect(self, request_iterator: Iterator[pb.ConnectRequest], context: grpc.ServicerContext) -> Any:
        first = next(request_iterator)
        key = (first.hello.generation, first.hello.rank)
        outbox: queue.Queue[pb.ConnectResponse | None] = queue.Queue()
        outbox.put(pb.ConnectResponse(welcome=pb.AgentWelcome(node_id="fake")))
        with self._lock:
            self.hellos[key] = first.hello
            self._outboxes[key] = outbox
            if self.fired and key in self.moves:
                outbox.put(self._reform(key))
        self._check()

        def read() -> None:
            try:
                for request in request_iterator:
                    with self._lock:
                        self.messages[key].append(request)
                        self.arrivals[key].append(time.monotonic())
                    self._check()
            except grpc.RpcError:
                pass
            outbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        while True:
            message = outbox.get()
            if message is None:
                return
            yield message

    def of(self, key: ProcessKey, kind: str) -> list[Any]:
        with self._lock:
            return [getattr(m, kind) for m in self.messages[key] if m.WhichOneof("message") == kind]

    def seconds_to_new_generation(self, key: ProcessKey) -> float:
        """From sending the reform to ``key``'s first report under the new generation."""
        with self._lock:
            for message, at in zip(self.messages[key], self.arrivals[key], strict=True):
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
    full_env = {
        **os.environ,
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
