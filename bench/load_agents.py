"""Simulated agents for `make bench-load`: one process runs hundreds of them on asyncio.

Each one speaks the real agent protocol to the real coordinator: it registers, heartbeats on
the interval the coordinator asks for (on its heartbeat stream, as the agent does; a beat's
latency is from its write to its answer), holds its command stream open, acknowledges every
command, and for the ranks it is given reports an iteration every second, batched per node as
a real agent does. Only the trainers are missing: they would load the CPU this bench measures.

The process also measures its own lateness, so that the parent can tell a coordinator that
answered late from a generator that sent late: every beat and progress report records how long
after it was due it went out, and a probe timer every 50 ms records the event loop's lag (how
late a timer fires: the time this process was starved of CPU or busy with other agents).

It says `registered` on stdout once every agent is registered (`failed: WHY` if one cannot
be), and the parent drives it through stdin, one command per line, at any time:
  vanish NODE,NODE,...   those agents stop at once (no goodbye), as when their hosts die
  stop                   every agent stops (registering ones too); the statistics go to --out
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from unicron import rpc
from unicron.v1 import common_pb2
from unicron.v1 import node_service_pb2 as nodes_pb
from unicron.v1 import node_service_pb2_grpc as nodes_grpc

CALL_TIMEOUT_S = 5.0
PROGRESS_PERIOD_S = 1.0
RETRY_S = 0.5
# Registration retries as the agent's (services/agent/coordinator_client.py): 0.1 s doubling to 2 s.
RETRY_FIRST_S = 0.1
RETRY_MAX_S = 2.0
RETRYABLE = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# The event-loop probe's period: fine enough to see a stall well under the heartbeat interval,
# and 20 timers a second cost the loop nothing next to hundreds of agents.
PROBE_S = 0.05


@dataclass
class Stats:
    # (wall-clock time the call was sent, milliseconds it took, milliseconds it went out later
    # than due): the parent splits them into the run's phases (jobs starting, steady, burst)
    heartbeats: list[tuple[float, float, float]] = field(default_factory=list)
    progress: list[tuple[float, float, float]] = field(default_factory=list)
    # (wall-clock time, milliseconds late) of each probe timer: the event loop's lag
    loop_lag: list[tuple[float, float]] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    unknown_heartbeats: int = 0
    commands: dict[str, int] = field(default_factory=dict)
    vanished: dict[str, float] = field(default_factory=dict)

    def error(self, what: str, exc: grpc.RpcError) -> None:
        key = f"{what}:{exc.code().name}"
        self.errors[key] = self.errors.get(key, 0) + 1

    def count(self, table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1


@dataclass
class LocalJob:
    generation: int
    ranks: list[int]
    iteration: int = 0


class SimAgent:
    def __init__(
        self,
        node_id: str,
        slots: int,
        domain: str,
        stub: nodes_grpc.NodeServiceStub,
        stats: Stats,
        metadata: tuple[tuple[str, str], ...],
    ) -> None:
        self.node_id = node_id
        self.metadata = metadata
        self.slots = slots
        self.domain = domain
        self.stub = stub
        self.stats = stats
        self.jobs: dict[str, LocalJob] = {}
        self.last_command = ""
        self.interval_s = 1.0
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        request = nodes_pb.RegisterNodeRequest(
            node_id=self.node_id, address="127.0.0.1:1", slots=self.slots, failure_domain=self.domain
        )
        # As a real agent does: a registration that timed out or found no server is tried
        # again, after a jittered backoff (0.1 s doubling to 2 s), for as long as the parent
        # waits; each failed try counts in the errors. A stalled machine once held a wave of
        # 50 past the deadline, and 2,000 agents registering at once queue behind each other.
        delay = RETRY_FIRST_S
        while True:
            try:
                reply = await self.stub.RegisterNode(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in RETRYABLE:
                    raise
                self.stats.error("register", exc)
                await asyncio.sleep(random.uniform(delay / 2, delay))
                delay = min(RETRY_MAX_S, delay * 2)
        self.interval_s = reply.heartbeat_interval_seconds or 1.0
        self.last_command = reply.last_command_id
        for loop in (self._heartbeats, self._commands, self._progress):
            self.tasks.append(asyncio.create_task(loop()))

    def vanish(self) -> None:
        for task in self.tasks:
            task.cancel()

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        # Agents start at random phases, as real ones do, rather than all in one instant.
        next_at = loop.time() + random.uniform(0, self.interval_s)
        while True:
            # One stream per agent, a beat and its answer per interval, as the real agent.
            call = self.stub.StreamHeartbeats(metadata=self.metadata)
            try:
                while True:
                    late_ms = await until(next_at)
                    sent, started = time.time(), time.perf_counter()
                    await call.write(nodes_pb.StreamHeartbeatsRequest(node_id=self.node_id))
                    reply = await call.read()
                    if reply is grpc.aio.EOF:
                        break
                    self.stats.heartbeats.append((sent, (time.perf_counter() - started) * 1000, late_ms))
                    if not reply.known:
                        self.stats.unknown_heartbeats += 1
                    next_at += self.interval_s
            except grpc.RpcError as exc:
                self.stats.error("heartbeat", exc)
            finally:
                call.cancel()
            await asyncio.sleep(RETRY_S)
            next_at = loop.time()

    async def _commands(self) -> None:
        while True:
            call = self.stub.StreamCommands(
                nodes_pb.StreamCommandsRequest(node_id=self.node_id, after_command_id=self.last_command),
                metadata=self.metadata,
            )
            try:
                async for reply in call:
                    await self._handle(reply.command)
            except grpc.RpcError as exc:
                self.stats.error("stream", exc)
            finally:
                call.cancel()
            await asyncio.sleep(RETRY_S)

    async def _handle(self, command: nodes_pb.NodeCommand) -> None:
        kind = command.WhichOneof("command") or "none"
        self.stats.count(self.stats.commands, kind)
        job_id, generation = "", 0
        if kind == "start_workers":
            start = command.start_workers
            job_id, generation = start.job_id, start.assignment.generation
            self._place(job_id, start.assignment)
        elif kind == "reform":
            reform = command.reform
            job_id, generation = reform.job_id, reform.assignment.generation
            self._place(job_id, reform.assignment)
        elif kind == "stop_workers":
            stop = command.stop_workers
            job_id, generation = stop.job_id, stop.generation
            held = self.jobs.get(job_id)
            if held is not None and (generation == 0 or held.generation <= generation):
                del self.jobs[job_id]
        elif kind == "inject_fault":
            job_id, generation = command.inject_fault.job_id, command.inject_fault.generation
        self.last_command = command.command_id
        try:
            await self.stub.AckCommand(
                nodes_pb.AckCommandRequest(
                    node_id=self.node_id, command_id=command.command_id, job_id=job_id, generation=generation, ok=True
                ),
                timeout=CALL_TIMEOUT_S,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            self.stats.error("ack", exc)

    def _place(self, job_id: str, assignment: common_pb2.Assignment) -> None:
        ranks = [r for w in assignment.workers if w.node_id == self.node_id for r in w.ranks]
        if ranks:
            held = self.jobs.get(job_id)
            self.jobs[job_id] = LocalJob(assignment.generation, ranks, held.iteration if held else 0)
        else:
            self.jobs.pop(job_id, None)

    async def _progress(self) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(random.uniform(0, PROGRESS_PERIOD_S))
        while True:
            late_ms = await until(loop.time() + PROGRESS_PERIOD_S)
            if not self.jobs:
                continue
            reports = []
            for job_id, job in self.jobs.items():
                job.iteration += 1
                for rank in job.ranks:
                    reports.append(
                        nodes_pb.IterationReport(
                            job_id=job_id,
                            generation=job.generation,
                            rank=rank,
                            iteration=job.iteration,
                            loss=2.0,
                            seconds=PROGRESS_PERIOD_S,
                            compute_seconds=PROGRESS_PERIOD_S * 0.6,
                            tokens=1024,
                        )
                    )
            sent, started = time.time(), time.perf_counter()
            try:
                await self.stub.ReportProgress(
                    nodes_pb.ReportProgressRequest(node_id=self.node_id, reports=reports),
                    timeout=CALL_TIMEOUT_S,
                    metadata=self.metadata,
                )
                self.stats.progress.append((sent, (time.perf_counter() - started) * 1000, late_ms))
            except grpc.RpcError as exc:
                self.stats.error("progress", exc)


async def until(due: float) -> float:
    """Sleeps until `due` (the event loop's clock) and returns how many milliseconds late it
    woke: the generator's own lateness, the time its process was starved of CPU or its loop
    busy with other agents. A send already past due when asked (the previous answer came late)
    counts from the asking: that delay was the coordinator's, and its latency says so."""
    loop = asyncio.get_running_loop()
    target = max(due, loop.time())
    await asyncio.sleep(target - loop.time())
    return round(max(0.0, loop.time() - target) * 1000, 3)


async def probe_lag(stats: Stats) -> None:
    """The event loop's lag, sampled every PROBE_S from start to stop (registration included)."""
    loop = asyncio.get_running_loop()
    while True:
        late_ms = await until(loop.time() + PROBE_S)
        stats.loop_lag.append((time.time(), late_ms))


async def register(agents: dict[str, SimAgent]) -> None:
    """Registers every agent, in waves (a thousand simultaneous registrations are a storm no
    cluster starts with), and tells the parent on stdout how it went."""
    names = list(agents)
    try:
        for start in range(0, len(names), 50):
            await asyncio.gather(*(agents[n].start() for n in names[start : start + 50]))
    except grpc.RpcError as exc:
        print(f"failed: registration: {exc.code().name}: {exc.details()}", flush=True)
        return
    except Exception as exc:  # noqa: BLE001 -- the parent waits for a line; it gets the reason
        print(f"failed: registration: {type(exc).__name__}: {exc}", flush=True)
        return
    print("registered", flush=True)


async def serve(reader: asyncio.StreamReader, agents: dict[str, SimAgent], stats: Stats) -> None:
    """The parent's commands, until `stop` (or its end of stdin)."""
    while True:
        line = (await reader.readline()).decode().strip()
        if not line or line == "stop":
            return
        verb, _, rest = line.partition(" ")
        if verb == "vanish":
            now = time.time()
            for node_id in filter(None, rest.split(",")):
                if node_id in agents:
                    agents[node_id].vanish()
                    stats.vanished[node_id] = now
            print("vanished", flush=True)


async def run(args: argparse.Namespace) -> None:
    stats = Stats()
    probe = asyncio.create_task(probe_lag(stats))
    # A few channels, as a few hundred agents on separate hosts would not share one connection.
    # Mutual TLS with a client certificate of the cluster's CA, and the cluster's join token,
    # as agents without a node certificate of their own join.
    credentials = grpc.ssl_channel_credentials(
        root_certificates=Path(args.ca).read_bytes(),
        private_key=Path(args.key).read_bytes(),
        certificate_chain=Path(args.cert).read_bytes(),
    )
    metadata = (("authorization", "Bearer " + Path(args.join_token_file).read_text().strip()),)
    channels = [grpc.aio.secure_channel(rpc.target(args.coordinator), credentials) for _ in range(args.channels)]
    agents: dict[str, SimAgent] = {}
    for i in range(args.count):
        node_id = f"{args.prefix}-{args.first + i:05d}"
        stub = nodes_grpc.NodeServiceStub(channels[i % len(channels)])
        domain = f"rack-{(args.first + i) % args.domains}"
        agents[node_id] = SimAgent(node_id, args.slots, domain, stub, stats, metadata)
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    # Commands are read while the agents register: a parent that gives up on a slow
    # registration still gets the statistics (the generator's lag among them) of what happened.
    registering = asyncio.create_task(register(agents))
    await serve(reader, agents, stats)
    registering.cancel()
    probe.cancel()
    for agent in agents.values():
        agent.vanish()
    for channel in channels:
        await channel.close()
    Path(args.out).write_text(json.dumps(_summary(stats)))


def _summary(stats: Stats) -> dict[str, Any]:
    return {
        "heartbeats": stats.heartbeats,
        "progress": stats.progress,
        "errors": stats.errors,
        "unknown_heartbeats": stats.unknown_heartbeats,
        "commands": stats.commands,
        "vanished": stats.vanished,
        "loop_lag": stats.loop_lag,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load_agents", description=__doc__.split("\n\n")[0])
    parser.add_argument("--coordinator", required=True)
    parser.add_argument("--prefix", default="sim")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--domains", type=int, default=10)
    parser.add_argument("--channels", type=int, default=8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ca", required=True, help="the cluster's CA certificate")
    parser.add_argument("--cert", required=True, help="a client certificate the CA signed")
    parser.add_argument("--key", required=True, help="its key")
    parser.add_argument("--join-token-file", required=True, help="the cluster's join token")
    args = parser.parse_args(argv)
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
