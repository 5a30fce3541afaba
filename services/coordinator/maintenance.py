"""Node maintenance: an operator drains a node (its jobs move off by the cheapest transition
the planner finds, it takes no new ranks) and uncordons it afterwards; uncordon also returns
a node isolated after a fault, once repaired. A drain is not a
failure: no incident is opened, no failure cost is counted; the jobs move by an ordinary
re-plan. It is refused, with nothing changed, when a job on the node would have nowhere to
go: the planner is asked first, as if the node were drained already (`stranded`)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from services.coordinator import decide, state
from services.coordinator.context import Context
from services.coordinator.planner_client import Planner
from services.coordinator.registry import NodeRegistry
from services.coordinator.replan import QUIET_AFTER_INTERVALS, Replanner
from unicron.errors import FailedPrecondition, NotFound
from unicron.v1 import common_pb2, planner_service_pb2

log = logging.getLogger(__name__)

_SOLVED = (planner_service_pb2.SOLVE_STATUS_OPTIMAL, planner_service_pb2.SOLVE_STATUS_FEASIBLE)


def jobs_on(jobs: Sequence[common_pb2.Job], node_id: str) -> list[str]:
    """The active jobs with ranks on the node."""
    return sorted(job.job_id for job in jobs if job.state in state.ACTIVE and node_id in decide.nodes_of(job))


def stranded(on_node: Sequence[str], reply: planner_service_pb2.PlanResponse) -> list[str]:
    """The jobs of the node a trial plan without it leaves with nowhere to run: paused, or all
    of them when there is no plan at all."""
    if reply.status not in _SOLVED:
        return list(on_node)
    placed = {plan.job_id for plan in reply.jobs if any(plan.slots_by_node.values())}
    return [job_id for job_id in on_node if job_id not in placed]


class Maintenance:
    def __init__(self, ctx: Context, registry: NodeRegistry, replanner: Replanner) -> None:
        self._ctx = ctx
        self._registry = registry
        self._replanner = replanner

    @property
    def _planner(self) -> Planner:
        return self._replanner.planner

    def drain(self, node_id: str) -> tuple[common_pb2.Node, list[str]]:
        """Cordons the node and asks for the re-plan that moves its jobs off; returns the node
        and those jobs. FailedPrecondition, naming the jobs, when one would be left paused."""
        store = self._ctx.store
        node = store.get_node(node_id)
        if node is None:
            raise NotFound(f"node {node_id!r} not found")
        jobs = store.list_jobs()
        on_node = jobs_on(jobs, node_id)
        if node.cordoned:
            return node, on_node
        if on_node:
            reply = self._trial(jobs, node_id)
            left = stranded(on_node, reply)
            if left:
                why = f"; the planner: {reply.reason}" if reply.reason else ""
                raise FailedPrecondition(
                    f"node {node_id}: jobs {', '.join(left)} would have nowhere to run without it{why}"
                    " (free slots elsewhere, or cancel them, first)"
                )
        cordoned = store.set_node_cordoned(node_id, True)
        if cordoned is None:
            raise NotFound(f"node {node_id!r} not found")
        log.warning("node drained", extra={"node_id": node_id, "jobs": on_node})
        self._replanner.want(f"node {node_id} drained")
        return cordoned, on_node

    def uncordon(self, node_id: str) -> common_pb2.Node:
        """Returns the node to service: drained, it takes ranks again; isolated (a SEV1 fault,
        or its links to a job's peers failed), this is the operator's word that it is
        repaired, as its agent's registering again would be. Its agent need not restart: a
        fault fixed outside it (a cable reseated, a volume cleaned) or a false alarm would
        otherwise keep a healthy node out of every plan. A node still silent is declared
        lost again by the next reconcile step."""
        store = self._ctx.store
        node = store.set_node_cordoned(node_id, False)
        if node is None:
            raise NotFound(f"node {node_id!r} not found")
        if node.state == common_pb2.NODE_STATE_ISOLATED and store.set_node_state(
            node_id, common_pb2.NODE_STATE_READY, expected=common_pb2.NODE_STATE_ISOLATED, now=self._ctx.clock()
        ):
            log.warning("isolated node returned to service by an operator", extra={"node_id": node_id})
            node = store.get_node(node_id) or node
        log.warning("node uncordoned", extra={"node_id": node_id})
        # Jobs below their largest size may grow back onto it, as onto a node that joined.
        self._replanner.want(f"node {node_id} uncordoned")
        return node

    def _trial(self, jobs: list[common_pb2.Job], node_id: str) -> planner_service_pb2.PlanResponse:
        """The plan the re-plan after the drain would make, made now."""
        settings, now = self._ctx.settings, self._ctx.clock()
        nodes = []
        for node in self._registry.nodes():
            if node.node_id == node_id:
                drained = common_pb2.Node()
                drained.CopyFrom(node)
                drained.cordoned = True
                node = drained
            nodes.append(node)
        quiet = decide.lost_nodes(
            now, nodes, QUIET_AFTER_INTERVALS * settings.heartbeat_interval_s, self._ctx.started_at
        )
        request = decide.plan_request(
            jobs,
            nodes,
            settings.failure_rate_per_node_per_s,
            settings.plan_time_limit_s,
            decide.hit_jobs(jobs, nodes),
            quiet,
            settings.quotas.limits(),
            settings.quotas.guarantees(),
        )
        return self._planner.plan(request)
