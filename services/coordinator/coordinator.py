"""The coordinator: the application object that wires its parts, and the one the gRPC
servicers (server.py) call. It holds no logic of its own; each call goes to the part that
owns it (docs/architecture.md: the coordinator's parts):

- `jobs.Jobs`: the job API;
- `registry.NodeRegistry`: nodes, heartbeats, command streams;
- `reports.Reports`: what agents report (progress, failures, exits, acknowledgements);
- `healing.Healer`: reports into incidents, incidents into remedies (pure rules in
  `intake`, `ladder` and `remedies`);
- `replan.Replanner`: when to ask the planner, and carrying its plan out;
- `logs.Logs`: a rank's output, relayed from its node's agent;
- `reconciler.Reconciler`: the loop that observes, decides and acts."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator

from services.coordinator.command_feed import CommandStream
from services.coordinator.context import Context, Settings
from services.coordinator.healing import Healer
from services.coordinator.jobs import Jobs, visible
from services.coordinator.logs import Logs, LogSource
from services.coordinator.maintenance import Maintenance
from services.coordinator.metrics import CoordinatorMetrics
from services.coordinator.planner_client import Planner
from services.coordinator.reconciler import Reconciler
from services.coordinator.registry import NodeRegistry
from services.coordinator.replan import Replanner
from services.coordinator.reports import Monitors, Reports
from services.coordinator.store import Store
from unicron.security import ClientSecurity
from unicron.v1 import common_pb2, job_service_pb2, logs_pb2, node_service_pb2

__all__ = ["Coordinator", "Settings", "visible"]


class Coordinator:
    def __init__(
        self,
        store: Store,
        planner: Planner,
        settings: Settings | None = None,
        clock: Callable[[], float] = time.time,
        metrics: CoordinatorMetrics | None = None,
        agent_security: ClientSecurity | None = None,
    ) -> None:
        """`agent_security`: how it calls agents for their trainers' logs (None: plaintext)."""
        self.ctx = Context(store, settings or Settings(), clock, started_at=clock(), metrics=metrics)
        monitors = Monitors(self.ctx)
        self.registry = NodeRegistry(self.ctx, joined=lambda reason: self.replanner.want(reason))
        self.replanner = Replanner(self.ctx, planner, self.registry)
        self.healer = Healer(self.ctx, self.replanner, forget_job=monitors.forget, nodes=self.registry.nodes)
        self.reports = Reports(self.ctx, self.healer, self.replanner, monitors)
        self.jobs = Jobs(self.ctx, self.registry, self.replanner)
        self.logs = Logs(self.ctx, self.jobs, agent_security)
        self.reconciler = Reconciler(self.ctx, self.registry, self.healer, self.replanner)
        self.maintenance = Maintenance(self.ctx, self.registry, self.replanner)

    @property
    def store(self) -> Store:
        return self.ctx.store

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @settings.setter
    def settings(self, settings: Settings) -> None:
        self.ctx.settings = settings

    @property
    def planner(self) -> Planner:
        return self.replanner.planner

    @planner.setter
    def planner(self, planner: Planner) -> None:
        self.replanner.planner = planner

    @property
    def metrics(self) -> CoordinatorMetrics | None:
        return self.ctx.metrics

    @metrics.setter
    def metrics(self, metrics: CoordinatorMetrics | None) -> None:
        self.ctx.metrics = metrics

    # ---- job API ----------------------------------------------------------------------

    def submit(self, spec: common_pb2.JobSpec, owner: str = "", admin: bool = True, team: str = "") -> common_pb2.Job:
        return self.jobs.submit(spec, owner, admin, team)

    def get(self, job_id: str, scope: str | None = None) -> common_pb2.Job:
        return self.jobs.get(job_id, scope)

    def list_jobs(self, states: set[int] | None = None, scope: str | None = None) -> list[common_pb2.Job]:
        return self.jobs.list_jobs(states, scope)

    def queue(self, scope: str | None = None) -> list[job_service_pb2.QueueEntry]:
        return self.jobs.queue(scope)

    def quotas(self) -> job_service_pb2.ListQuotasResponse:
        return self.jobs.quotas()

    def cancel(self, job_id: str, reason: str, scope: str | None = None) -> common_pb2.Job:
        return self.jobs.cancel(job_id, reason, scope)

    def watch(
        self, job_id: str, after_event_id: str, is_active: Callable[[], bool], scope: str | None = None
    ) -> Iterator[common_pb2.JobEvent]:
        return self.jobs.watch(job_id, after_event_id, is_active, scope)

    def inject_fault(self, job_id: str, fault: common_pb2.Fault, scope: str | None = None) -> str:
        return self.jobs.inject_fault(job_id, fault, scope)

    def cluster(self, scope: str | None = None) -> job_service_pb2.GetClusterResponse:
        return self.jobs.cluster(scope)

    def list_incidents(self, job_id: str = "", scope: str | None = None) -> list[common_pb2.Incident]:
        return self.jobs.incidents(job_id, scope)

    def log_source(self, job_id: str, rank: int, scope: str | None = None) -> LogSource:
        return self.logs.source(job_id, rank, scope)

    def read_logs(
        self, source: LogSource, request: job_service_pb2.StreamLogsRequest
    ) -> AsyncIterator[logs_pb2.LogChunk]:
        return self.logs.read(source, request)

    # ---- nodes ------------------------------------------------------------------------

    def register_node(
        self,
        node_id: str,
        address: str,
        slots: int,
        failure_domain: str,
        fault_injection: bool = False,
        image: str = "",
    ) -> tuple[common_pb2.Node, str]:
        return self.registry.register(node_id, address, slots, failure_domain, fault_injection, image)

    def strays(
        self, node_id: str, running: Iterable[node_service_pb2.JobGeneration]
    ) -> list[node_service_pb2.JobGeneration]:
        return self.registry.strays(node_id, running)

    def heartbeat(self, node_id: str) -> bool:
        return self.registry.heartbeat(node_id)

    def heartbeat_if_seen(self, node_id: str) -> bool:
        return self.registry.heartbeat_if_seen(node_id)

    def drain(self, node_id: str) -> tuple[common_pb2.Node, list[str]]:
        return self.maintenance.drain(node_id)

    def uncordon(self, node_id: str) -> common_pb2.Node:
        return self.maintenance.uncordon(node_id)

    def nodes(self) -> list[common_pb2.Node]:
        return self.registry.with_usage()

    def open_commands(self, node_id: str, after_id: str) -> CommandStream:
        return self.registry.open_commands(node_id, after_id)

    # ---- reports from agents ----------------------------------------------------------

    def admit_report(self, node_id: str) -> None:
        self.reports.admit(node_id)

    def report_progress(self, node_id: str, reports: list[node_service_pb2.IterationReport]) -> None:
        self.reports.progress(node_id, reports)

    def report_failure(self, node_id: str, report: common_pb2.FailureReport) -> common_pb2.Incident | None:
        return self.reports.failure(node_id, report)

    def report_worker_exit(self, request: node_service_pb2.ReportWorkerExitRequest) -> None:
        self.reports.worker_exit(request)

    def report_fault_injected(self, request: node_service_pb2.ReportFaultInjectedRequest) -> None:
        self.reports.fault_injected(request)

    def ack_command(self, request: node_service_pb2.AckCommandRequest) -> None:
        self.reports.ack(request)

    # ---- the reconcile loop -----------------------------------------------------------

    def reconcile_once(self) -> None:
        self.reconciler.step()

    def start(self) -> None:
        self.reconciler.start()

    def stop(self) -> None:
        self.ctx.stopping.set()
        self.ctx.wake.set()
        self.registry.feed.stop()
        self.reconciler.join(timeout_s=5)
