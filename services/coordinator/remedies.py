"""Remedies as writes: from a job, its incident and the ladder's decision to the edit of the
job and the commands it implies. Pure, the clock and every port passed in: the caller
resolves those before the compare-and-set (`healing.Healer._apply`), which may run this
more than once."""

from __future__ import annotations

from dataclasses import dataclass

from services.coordinator import cost, decide, incidents, ladder, state, transitions
from services.coordinator.events import EventType, event
from services.coordinator.store import JobWrite
from unicron.v1 import common_pb2


@dataclass(frozen=True)
class Inputs:
    """What a remedy's write needs besides the job: resolved before the compare-and-set."""

    now: float
    ack_timeout_s: float
    # Nodes whose agents are gone: their workers are marked stopped, not asked to stop.
    unreachable: frozenset[str]
    # Restart only the dead ranks when the others can keep their state (else all restart).
    reform_restarts: bool = True
    # The job's next assignment: a copy of this one for a reattempt, on a new rendezvous
    # port; for a restart, the same slots, as decide.assignment_for makes it. None otherwise.
    assignment: common_pb2.Assignment | None = None


def applies(job: common_pb2.Job, incident: common_pb2.Incident) -> bool:
    """A remedy is for the generation that failed, of a job still running."""
    return job.state in state.ACTIVE and job.assignment.generation == incident.generation


def reattempt_assignment(job: common_pb2.Job, now: float, master_port: int) -> common_pb2.Assignment:
    """The same ranks in the same places, in a new process group (a collective error can
    leave the old one unusable): a new generation and rendezvous, nothing else changes."""
    assignment = common_pb2.Assignment()
    assignment.CopyFrom(job.assignment)
    assignment.generation += 1
    assignment.assigned.FromNanoseconds(int(now * 1e9))
    assignment.master_port = master_port
    return assignment


def write(
    job: common_pb2.Job, incident: common_pb2.Incident, decision: ladder.Decision, given: Inputs
) -> JobWrite | None:
    """Edits `job` as the decision says and returns the events and commands that go with
    it; None (nothing to write) when the job moved on since the incident."""
    if not applies(job, incident):
        return None
    now, remedy = given.now, decision.remedy
    if remedy is None:
        return _fail(job, incident, decision, given)
    attempt = job.remedies.add(
        incident_id=incident.incident_id, remedy=remedy, reason=decision.reason, traceparent=incident.traceparent
    )
    attempt.started.FromNanoseconds(int(now * 1e9))
    commands: transitions.Commands = []
    if remedy in (common_pb2.REMEDY_REATTEMPT, common_pb2.REMEDY_RESTART):
        if given.assignment is None:
            raise ValueError(f"{ladder.remedy_name(remedy)} needs the job's next assignment")
        attempt.generation = given.assignment.generation
        commands = _regroup(job, incident, remedy, given.assignment, given)
    # A reconfigure writes no commands: the re-plan moves the job off the isolated node,
    # and sets the attempt's generation then.
    name = ladder.remedy_name(remedy)
    state.transition(job, state.RECOVERING, now, f"{name}: {incident.summary}")
    remedy_event = event(
        job, EventType.JOB_EVENT_TYPE_REMEDY, now, f"{name} for incident {incident.incident_id}: {decision.reason}"
    )
    remedy_event.incident_id = incident.incident_id
    for _, command in commands:
        command.traceparent = incident.traceparent
    return JobWrite([remedy_event], commands)


def _fail(job: common_pb2.Job, incident: common_pb2.Incident, decision: ladder.Decision, given: Inputs) -> JobWrite:
    reason = f"{incident.summary}; {decision.reason}"
    if incident.kind == common_pb2.FAILURE_KIND_PROGRAM_ERROR:
        job.failure_detail = incidents.program_traceback(incident)
    commands = transitions.stop(job, given.now, reason, given.ack_timeout_s, given.unreachable, job_ended=True)
    state.transition(job, state.FAILED, given.now, reason)
    return JobWrite([event(job, EventType.JOB_EVENT_TYPE_STATE_CHANGED, given.now, reason)], commands)


def _regroup(
    job: common_pb2.Job,
    incident: common_pb2.Incident,
    remedy: int,
    assignment: common_pb2.Assignment,
    given: Inputs,
) -> transitions.Commands:
    now, timeout, unreachable = given.now, given.ack_timeout_s, given.unreachable
    if remedy == common_pb2.REMEDY_REATTEMPT:
        same = {r: r for w in job.assignment.workers for r in w.ranks}
        why = "reattempt in a new process group"
        return transitions.reform(job, assignment, same, now, why, timeout, incident.incident_id, unreachable)
    rank_map = (
        decide.survivor_map(job, assignment, *incidents.waiting_and_gone(incident), unreachable)
        if given.reform_restarts
        else None
    )
    if rank_map is not None:
        # Only the dead ranks start again; they take the state from a live peer.
        why = f"restart of ranks {sorted(set(range(job.assignment.world_size)) - set(rank_map))}"
        return transitions.reform(job, assignment, rank_map, now, why, timeout, incident.incident_id, unreachable)
    commands = transitions.stop(job, now, f"restart: {incident.summary}", timeout, unreachable)
    return commands + transitions.start(job, assignment, now, f"restart after {incident.incident_id}", timeout)


def note(
    incident: common_pb2.Incident,
    decision: ladder.Decision,
    now: float,
    healthy_waf: float,
    healthy_slots: int,
) -> None:
    """Records on the incident what was done about it, and what the job ran at before."""
    remedy = decision.remedy
    incident.action_taken = (
        f"{ladder.remedy_name(remedy)}: {decision.reason}" if remedy else f"job failed: {decision.reason}"
    )
    if remedy:
        incident.remedy = remedy  # type: ignore[assignment]
        incident.remedy_started.FromNanoseconds(int(now * 1e9))
        incident.cost.healthy_waf = healthy_waf
        incident.cost.healthy_slots = healthy_slots
        if incident.HasField("resumed"):
            incident.cost.CopyFrom(cost.resumed_cost(incident))
