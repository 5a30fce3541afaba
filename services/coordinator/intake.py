"""Intake: what a failure report does once it is recorded in its incident. Pure rules, the
clock passed in; `healing.Healer` carries out what they say.

A report joins the incident open under its key or opens one (`merge_update`); then the
incident is answered now (RESPOND: the ladder picks a remedy), later (HOLD: a network error
waits a moment for the report that explains it) or not at all (IGNORE)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from services.coordinator import incidents, links, state
from services.coordinator.store import new_incident_id
from unicron import incident_trace as trace
from unicron.v1 import common_pb2


class Route(enum.Enum):
    RESPOND = "respond"
    HOLD = "hold"
    IGNORE = "ignore"


@dataclass(frozen=True)
class Verdict:
    route: Route
    reason: str


class NoOpenIncident(Exception):
    """Raised by `merge_update` when the report may only join an open incident and none is."""


def route(
    incident: common_pb2.Incident,
    created: bool,
    world_size: int,
    silent_nodes: frozenset[str] = frozenset(),
    accounts_pending: bool = False,
) -> Verdict:
    """What to do with an incident a report just joined (`created`: the report opened it).
    `world_size`: its job's ranks (0 for a node's own incident); `silent_nodes`: the job's
    nodes not heard from since its hang began (not yet lost); `accounts_pending`: a hang
    names an unreachable peer and a node of the job has not reported yet (links.py)."""
    if incident.kind == common_pb2.FAILURE_KIND_STRAGGLER:
        return Verdict(Route.IGNORE, "a performance report: the planner may route around it, nothing to heal")
    undecided = bool(incident.job_id) and incident.remedy == common_pb2.REMEDY_UNSPECIFIED
    if undecided and waits_for_heartbeats(incident, silent_nodes):
        # A job stops iterating the moment one of its hosts drops off the network, seconds
        # before that host's heartbeats time out: a hang restart would go back onto the lost
        # host. Held until each node beats again (at most a heartbeat interval for a real
        # hang), or is lost: the loss then joins the incident as its root cause.
        return Verdict(Route.HOLD, f"node {sorted(silent_nodes)[0]} is silent: its heartbeat verdict first")
    if undecided and incident.kind == common_pb2.FAILURE_KIND_TASK_HANG and accounts_pending:
        # A link that fails has two ends: which one is cut off from the job takes every
        # node's account of what its trainers reach.
        return Verdict(Route.HOLD, f"up to {links.LINK_HOLD_S:g}s for every node's account of the hang")
    if undecided and incidents.holds(incident.kind) and not incidents.accounts_for_all(incident, world_size):
        # A network error is often how a peer's death looks from outside, and a death is
        # best answered once the peers said they wait (then only the dead rank restarts).
        return Verdict(Route.HOLD, f"waiting {incidents.DECISION_HOLD_S:g}s for every rank to be accounted for")
    if created:
        return Verdict(Route.RESPOND, "a new incident")
    if undecided:
        return Verdict(Route.RESPOND, "every rank is accounted for")
    if incident.remedy == common_pb2.REMEDY_REATTEMPT and incidents.needs_heavier_remedy(incident):
        return Verdict(Route.RESPOND, "later evidence shows the reattempt cannot work")
    return Verdict(Route.IGNORE, "joined an incident whose remedy is under way")


def waits_for_heartbeats(incident: common_pb2.Incident, silent_nodes: frozenset[str]) -> bool:
    """Whether a hang waits for the heartbeat verdict on a node of its job that is silent."""
    return incident.kind == common_pb2.FAILURE_KIND_TASK_HANG and bool(silent_nodes)


def hold_is_over(
    incident: common_pb2.Incident,
    now: float,
    silent_nodes: frozenset[str] = frozenset(),
    heartbeat_timeout_s: float = 3.0,
    accounts_pending: bool = False,
) -> bool:
    """Whether a held incident is due for its decision (also one a restarted coordinator
    finds undecided in the store): a network error's short hold is over, or a hang's silent
    node beat again or outlasted the heartbeat timeout (then it is lost, and its loss the
    root cause), and a hang naming an unreachable peer has every node's account or waited
    LINK_HOLD_S, whichever applies."""
    if not incident.job_id or incident.remedy != common_pb2.REMEDY_UNSPECIFIED or not incidents.is_open(incident, now):
        return False
    held_s = now - incident.detected.ToNanoseconds() / 1e9
    if incident.kind == common_pb2.FAILURE_KIND_TASK_HANG:
        # Held only while a node is silent; a bound, in case its loss is never recorded.
        heard = not silent_nodes or held_s >= heartbeat_timeout_s + 1.0
        return heard and (not accounts_pending or held_s >= links.LINK_HOLD_S)
    return incidents.holds(incident.kind) and held_s >= incidents.DECISION_HOLD_S


def may_open(job: common_pb2.Job, report: common_pb2.FailureReport) -> bool:
    """Whether a report about this job may open a new incident. Late evidence about a
    generation that is over, or a job that ended, still joins its open incident; it never
    opens a new one."""
    return job.assignment.generation == report.generation and not state.is_terminal(job.state)


def merge_update(
    report: common_pb2.FailureReport,
    now: float,
    create: bool = True,
    new_id: Callable[[], str] = new_incident_id,
) -> Callable[[common_pb2.Incident | None], common_pb2.Incident]:
    """The store's update of the incident open under the report's key: the report joins
    it, or opens a new one (unless not `create`: NoOpenIncident)."""

    def update(current: common_pb2.Incident | None) -> common_pb2.Incident:
        open_incident = current if current is not None and incidents.is_open(current, now, report) else None
        if open_incident is None and not create:
            raise NoOpenIncident
        merged = incidents.merge(open_incident, report, now, new_id())
        if open_incident is None:
            merged.traceparent = trace.new_incident_context()
        return merged

    return update
