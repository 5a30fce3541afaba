"""The agent's command executor: what the coordinator's commands do on this node (start,
stop and reform a job's ranks, inject a fault), each inside its span of the incident's
trace, and acknowledged when it changes trainers."""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import json_format

from services.agent.coordinator_client import CoordinatorClient
from services.agent.supervisor import Supervisor, WorkerKey
from services.agent.trainer_link import TrainerLink
from services.agent.watch import JobWatch
from unicron import incident_trace as trace
from unicron.security import WorkerTokens
from unicron.trainer.settings import trainer_env
from unicron.v1 import common_pb2, trainer_service_pb2
from unicron.v1 import node_service_pb2 as pb

if TYPE_CHECKING:
    from services.agent.settings import AgentSettings

log = logging.getLogger(__name__)


@dataclass
class Parts:
    """What the executor acts through."""

    settings: AgentSettings
    supervisor: Supervisor
    link: TrainerLink
    watch: JobWatch
    client: CoordinatorClient
    worker_tokens: WorkerTokens
    base_env: Callable[[], dict[str, str]]
    address: Callable[[], str]  # how this node's trainers reach the agent


class CommandExecutor:
    def __init__(self, parts: Parts) -> None:
        self._p = parts

    def execute(self, command: pb.NodeCommand) -> None:
        kind = command.WhichOneof("command")
        if kind == "start_workers":
            start = command.start_workers
            self._apply_and_ack(
                command, "start", start.job_id, start.assignment.generation, lambda: self.start_workers(start)
            )
        elif kind == "stop_workers":
            self._stop(command, command.stop_workers)
        elif kind == "reform":
            reform = command.reform
            self._apply_and_ack(
                command, "reform", reform.job_id, reform.assignment.generation, lambda: self.reform(reform)
            )
        elif kind == "inject_fault":
            self.inject(command.inject_fault)
        else:
            log.warning("ignoring unknown command", extra={"command_id": command.command_id})

    def kill_strays(self, strays: list[pb.JobGeneration]) -> None:
        """Kills the generations the coordinator said, at registration, it no longer runs on
        this node (it wrote them off while the node was LOST). No ack: no command asked."""
        p = self._p
        for stray in strays:
            p.watch.forget(stray.job_id, stray.generation)
            killed = p.supervisor.kill(stray.job_id, stray.generation)
            log.warning(
                "killed ranks the coordinator wrote off",
                extra={"job_id": stray.job_id, "generation": stray.generation, "ranks": [k.rank for k in killed]},
            )

    def _stop(self, command: pb.NodeCommand, stop: pb.StopWorkers) -> None:
        p = self._p
        log.info("stopping job", extra={"job_id": stop.job_id, "reason": stop.reason, "generation": stop.generation})
        p.link.request_stop(stop.job_id, stop.reason, stop.generation)
        p.watch.forget(stop.job_id, stop.generation)

        def stop_and_ack() -> None:
            with self._transition_span(command, "stop", stop.job_id, stop.generation):
                p.supervisor.stop(stop.job_id, p.settings.stop_grace_s, stop.generation)
            snapshots = _job_dir(p.settings.snapshot_dir, stop.job_id)
            if stop.job_ended and snapshots is not None:
                # Left behind, a cancelled 100M-parameter job's snapshots held gigabytes of
                # tmpfs until the agent exited (bench-sizes: the next jobs were OOM-killed).
                shutil.rmtree(snapshots, ignore_errors=True)
                log.info("freed the ended job's snapshots", extra={"job_id": stop.job_id})
            self._ack(command, stop.job_id, stop.generation)

        # Stopping waits out the trainers' grace: the command stream goes on meanwhile.
        threading.Thread(target=stop_and_ack, name="stop", daemon=True).start()

    def _transition_span(
        self, command: pb.NodeCommand, action: str, job_id: str, generation: int
    ) -> AbstractContextManager[object]:
        """This node's part of an incident's transition, in the incident's trace."""
        return trace.child_span(
            command.traceparent,
            trace.TRANSITION,
            {
                trace.ATTR_ACTION: action,
                trace.ATTR_JOB: job_id,
                trace.ATTR_NODE: self._p.settings.node_id,
                trace.ATTR_GENERATION: generation,
            },
        )

    def _ack(self, command: pb.NodeCommand, job_id: str, generation: int, error: str = "") -> None:
        self._p.client.ack(
            pb.AckCommandRequest(
                node_id=self._p.settings.node_id,
                command_id=command.command_id,
                job_id=job_id,
                generation=generation,
                ok=not error,
                error=error,
            )
        )

    def _apply_and_ack(
        self, command: pb.NodeCommand, action: str, job_id: str, generation: int, apply: Callable[[], None]
    ) -> None:
        """Runs a command that launches trainers, inside its transition span, and acknowledges
        it: with the error when a trainer cannot be started."""
        with self._transition_span(command, action, job_id, generation):
            try:
                apply()
            except OSError as exc:
                self._ack(command, job_id, generation, f"cannot {action} trainers: {exc}")
            except Exception as exc:
                # A command this agent cannot carry out must not end its command stream:
                # the coordinator hears why, and the next command is still taken.
                log.exception("command failed", extra={"job_id": job_id, "action": action})
                self._ack(command, job_id, generation, f"cannot {action} trainers: {type(exc).__name__}: {exc}")
            else:
                self._ack(command, job_id, generation)

    def start_workers(
        self, start: pb.StartWorkers, only: set[int] | None = None, extra_env: dict[str, str] | None = None
    ) -> None:
        """Starts this node's ranks of the assignment (only those in `only`, when given)."""
        p, assignment = self._p, start.assignment
        settings = p.settings
        wanted = start.spec.program.image
        if wanted and wanted != settings.image:
            # Trainers run in this agent's own image: another image's code is not here.
            raise OSError(
                f"the job's program.image is {wanted!r}, but this node runs "
                + (f"{settings.image!r}" if settings.image else "no named image")
                + " and starts no containers"
            )
        ranks = [r for w in assignment.workers if w.node_id == settings.node_id for r in w.ranks]
        if not ranks:
            return  # a reform that leaves this node out: its ranks were stopped, none start
        spec_json = json_format.MessageToJson(start.spec, indent=None)
        peers = {w.node_id: w.address for w in assignment.workers if w.node_id != settings.node_id and w.address}
        p.watch.start(start.job_id, assignment.generation, ranks, start.spec.training.iterations, time.time(), peers)
        for rank in ranks:
            key = WorkerKey(start.job_id, assignment.generation, rank)
            if key in p.supervisor.running(start.job_id) or (only is not None and rank not in only):
                continue  # a replayed command after a reconnect, or a rank kept alive
            env = p.base_env()
            if settings.data_interface:
                # Collectives over the data network, unless the job's environment says otherwise.
                env.setdefault("GLOO_SOCKET_IFNAME", settings.data_interface)
                env.setdefault("NCCL_SOCKET_IFNAME", settings.data_interface)
            env.update(settings.trainer_env)
            env.update(
                trainer_env(
                    job_id=start.job_id,
                    generation=assignment.generation,
                    rank=rank,
                    world_size=assignment.world_size,
                    master_addr=assignment.master_addr,
                    master_port=assignment.master_port,
                    agent=settings.trainer_address or p.address(),
                    node=settings.node_id,
                    domain=settings.failure_domain,
                    spec=spec_json,
                    fault_injection=settings.fault_injection,
                    token=p.worker_tokens.issue(start.job_id, assignment.generation, rank),
                    checkpoint_dir=_job_dir(settings.checkpoint_dir, start.job_id),
                    snapshot_dir=_job_dir(settings.snapshot_dir, start.job_id),
                )
            )
            env.update(extra_env or {})
            for directory in (settings.checkpoint_dir, settings.snapshot_dir):
                if directory is not None:
                    p.supervisor.give(directory / start.job_id)
            # Spares are the recovery reserve: a job's first start goes cold, so that a
            # failure soon after it still finds one ready.
            p.supervisor.launch(key, settings.trainer_command, env, spare=assignment.generation > 1)

    def reform(self, reform: pb.Reform) -> None:
        """Moves this node's live ranks of the job to the new generation in place (they
        keep their state and join the new process group), stops the live ranks the new
        assignment leaves out, and starts its new ranks, which take the state from a live
        peer."""
        p, assignment = self._p, reform.assignment
        here = {r for w in assignment.workers if w.node_id == p.settings.node_id for r in w.ranks}
        kept: set[int] = set()
        for key in p.supervisor.running(reform.job_id):
            new_rank = reform.rank_map.get(key.rank)
            if key.generation != reform.from_generation or new_rank is None or new_rank not in here:
                continue
            new_key = WorkerKey(reform.job_id, assignment.generation, new_rank)
            p.link.rekey(key, new_key, move_worker=functools.partial(p.supervisor.rekey, key, new_key))
            message = trainer_service_pb2.AgentReform(
                incident_id=reform.incident_id,
                generation=assignment.generation,
                rank=new_rank,
                world_size=assignment.world_size,
                master_addr=assignment.master_addr,
                master_port=assignment.master_port,
            )
            if not p.link.send(new_key, trainer_service_pb2.ConnectResponse(reform=message), hold=True):
                log.info("reform held for a trainer still starting", extra={"job_id": reform.job_id, "rank": key.rank})
            kept.add(new_rank)
        p.link.request_stop(reform.job_id, f"left out of generation {assignment.generation}", reform.from_generation)
        p.watch.forget(reform.job_id, reform.from_generation)
        threading.Thread(
            target=p.supervisor.stop,
            args=(reform.job_id, p.settings.stop_grace_s, reform.from_generation),
            name="stop",
            daemon=True,
        ).start()
        start = pb.StartWorkers(job_id=reform.job_id, spec=reform.spec, assignment=assignment)
        self.start_workers(start, only=here - kept, extra_env=trainer_env(state_from_peer=True))
        log.info(
            "reformed job",
            extra={
                "job_id": reform.job_id,
                "generation": assignment.generation,
                "kept": sorted(kept),
                "started": sorted(here - kept),
            },
        )

    def inject(self, inject: pb.InjectFault) -> None:
        p, fault = self._p, inject.fault
        if not p.settings.fault_injection:
            log.warning("refusing fault injection: disabled on this agent", extra={"job_id": inject.job_id})
            return
        if fault.kind == common_pb2.FAULT_KIND_AGENT_LOSS:
            request = pb.ReportFaultInjectedRequest(node_id=p.settings.node_id, job_id=inject.job_id, fault=fault)
            request.injected.FromNanoseconds(time.time_ns())
            p.client.report_fault(request, at_once=True)
            log.warning("injected fault: agent loss, dying now")
            # Like a node dying: the agent goes at once, its trainers lose their agent.
            os.kill(os.getpid(), signal.SIGKILL)
            return
        key = WorkerKey(inject.job_id, inject.generation, fault.rank)
        if not p.link.send(key, trainer_service_pb2.ConnectResponse(inject=fault)):
            log.warning("cannot inject: trainer not connected", extra={"job_id": inject.job_id, "rank": fault.rank})


def _job_dir(root: Path | None, job_id: str) -> str | None:
    return None if root is None else str(root / job_id)
