"""Incidents: the reports of one failure, from however many ranks and detectors saw it,
merged into one record with a root cause. Pure code, the clock passed in."""

from __future__ import annotations

from google.protobuf.timestamp_pb2 import Timestamp

from unicron import failures
from unicron.v1 import common_pb2 as pb

# Every rank of a job sees a failure that breaks a collective: one rank's crash becomes
# connection resets on its peers. Reports of a job generation within this window of the
# incident's first report are the same incident.
MERGE_WINDOW_S = 60.0


def incident_key(report: pb.FailureReport) -> str:
    """Reports with the same key belong to one incident (while it is open)."""
    if not report.job_id:
        return f"node:{report.node_id}:{pb.FailureKind.Name(report.kind)}"
    if report.kind == pb.FAILURE_KIND_STRAGGLER:
        # A slow rank is a standing performance condition of its own, not part of a crash.
        return f"job:{report.job_id}:{report.generation}:straggler:{report.rank}"
    return f"job:{report.job_id}:{report.generation}"


def _seconds(stamp: Timestamp) -> float:
    return stamp.ToNanoseconds() / 1e9


# Network errors of the surviving ranks are how a peer's death looks from the outside; the
# peers can catch theirs a few milliseconds before the dead rank's agent records the exit.
CONSEQUENCE_WINDOW_S = 2.0
_CONSEQUENCES = failures.GROUP_SYMPTOMS


# How long a job's network-error incident waits for a report that explains it (a rank's
# exit, seen by its agent within ~0.15 s) before the ladder acts on it as it stands.
DECISION_HOLD_S = 0.2


def holds(kind: int) -> bool:
    """Whether the ladder waits DECISION_HOLD_S for more reports before acting on an
    incident of this kind: a network error is often only the echo of a failure elsewhere,
    and a rank's death is cheapest to heal once its peers said they wait."""
    return kind in _CONSEQUENCES or kind == pb.FAILURE_KIND_PROCESS_EXIT


def accounts_for_all(incident: pb.Incident, world_size: int) -> bool:
    """Whether every rank of the job has reported: waiting after an error, or gone."""
    waiting, gone = waiting_and_gone(incident)
    return len(waiting | gone) >= world_size


def _root(reports: list[pb.FailureReport]) -> pb.FailureReport:
    """The report that explains the others. The earliest, except that (1) a network error
    is explained by a rank's death or a node's loss seen within CONSEQUENCE_WINDOW_S of it,
    (2) a hang is explained by the loss of one of the job's nodes (the job stopped because the
    node did), and (3) a rank's own exception explains that rank's exit."""
    ordered = sorted(reports, key=lambda r: _seconds(r.first_seen))
    root = ordered[0]
    if root.kind == pb.FAILURE_KIND_TASK_HANG:
        root = next((r for r in ordered if r.kind == pb.FAILURE_KIND_NODE_LOST), root)
    if root.kind in _CONSEQUENCES:
        horizon = _seconds(root.first_seen) + CONSEQUENCE_WINDOW_S
        causes = [r for r in ordered if r.kind not in _CONSEQUENCES and _seconds(r.first_seen) <= horizon]
        if causes:
            root = causes[0]
    if root.source == pb.DETECTION_SOURCE_PROCESS_SUPERVISION and root.HasField("rank"):
        for report in ordered:
            if report.source == pb.DETECTION_SOURCE_EXCEPTION and report.HasField("rank") and report.rank == root.rank:
                return report
    return root


def summary(report: pb.FailureReport) -> str:
    if report.HasField("rank"):
        where = f"rank {report.rank} on {report.node_id}"
    elif report.job_id and report.kind != pb.FAILURE_KIND_NODE_LOST:
        where = f"job-wide, seen on {report.node_id}"
    else:
        where = f"node {report.node_id}"
    text = f"{failures.classify(report.kind).description} ({where})"
    return f"{text}: {report.message}" if report.message else text


def merge(incident: pb.Incident | None, report: pb.FailureReport, now: float, incident_id: str) -> pb.Incident:
    """The incident after adding report (a new incident when `incident` is None)."""
    stamped = pb.FailureReport()
    stamped.CopyFrom(report)
    stamped.severity = failures.classify(report.kind).severity
    stamped.received.FromNanoseconds(int(now * 1e9))
    if not stamped.HasField("first_seen"):
        stamped.first_seen.CopyFrom(stamped.received)
    out = pb.Incident()
    if incident is None:
        out.incident_id = incident_id
        out.job_id = report.job_id
        out.generation = report.generation
        out.detected.CopyFrom(stamped.received)
    else:
        out.CopyFrom(incident)
    out.reports.append(stamped)
    root = _root(list(out.reports))
    out.kind = root.kind
    out.severity = root.severity
    out.node_id = root.node_id
    out.first_seen.CopyFrom(min((r.first_seen for r in out.reports), key=_seconds))
    out.recommended_action = failures.classify(root.kind).action.value
    out.summary = summary(root)
    return out


def is_open(incident: pb.Incident, now: float, report: pb.FailureReport | None = None) -> bool:
    """Whether a new report with the incident's key still joins it: within the merge
    window, and, once a remedy began, only if the report saw the failure before that (a
    rank's own error after it is a new failure). Except:

    - a group symptom (a network error) of the incident's generation, however late: it is
      how the failure, or its remedy (the old group torn down, a node isolated while the
      re-plan is under way), looks from a peer, and on its own it would get a second remedy
      (every remedy but a reconfigure starts a new generation, so such a report is an echo);
    - the exit of a rank that reported in the incident already: it gave up on the error it
      reported, and a loaded machine can take longer to end it than the coordinator takes to
      decide.

    A node's loss whose last heartbeat is later than the loss the incident recorded is a
    new loss (the node came back in between), not more of the same."""
    if now - _seconds(incident.detected) > MERGE_WINDOW_S:
        return False
    if report is not None and report.kind == pb.FAILURE_KIND_NODE_LOST and not report.job_id:
        return not report.HasField("first_seen") or _seconds(report.first_seen) <= _seconds(incident.detected)
    if report is None or not incident.HasField("remedy_started") or not report.HasField("first_seen"):
        return True
    if report.kind in _CONSEQUENCES and report.generation == incident.generation:
        return True
    if report.source == pb.DETECTION_SOURCE_PROCESS_SUPERVISION and report.HasField("rank"):
        if any(r.HasField("rank") and r.rank == report.rank and r.node_id == report.node_id for r in incident.reports):
            return True
    return _seconds(report.first_seen) <= _seconds(incident.remedy_started)


def program_traceback(incident: pb.Incident) -> str:
    """The traceback of the program's error behind an incident (its first report with one)."""
    return next((r.stack_trace for r in incident.reports if r.stack_trace), "")


def worker_exit_report(
    node_id: str, job_id: str, generation: int, rank: int, exit_code: int, signal: int, detail: str, exited_at: float
) -> pb.FailureReport:
    how = f"killed by signal {signal}" if signal else f"exit code {exit_code}"
    report = pb.FailureReport(
        job_id=job_id,
        generation=generation,
        rank=rank,
        node_id=node_id,
        kind=pb.FAILURE_KIND_PROCESS_EXIT,
        source=pb.DETECTION_SOURCE_PROCESS_SUPERVISION,
        message=f"{how}: {detail}" if detail else how,
        exit_code=exit_code,
        signal=signal,
    )
    report.first_seen.FromNanoseconds(int(exited_at * 1e9))
    return report


def node_lost_report(
    node_id: str, job_id: str, generation: int, last_heartbeat: float, timeout_s: float
) -> pb.FailureReport:
    report = pb.FailureReport(
        job_id=job_id,
        generation=generation,
        node_id=node_id,
        kind=pb.FAILURE_KIND_NODE_LOST,
        source=pb.DETECTION_SOURCE_HEARTBEAT,
        message=f"no heartbeat for {timeout_s:g}s",
        statistics={"heartbeat_timeout_s": timeout_s},
    )
    report.first_seen.FromNanoseconds(int(last_heartbeat * 1e9))
    return report


def needs_heavier_remedy(incident: pb.Incident) -> bool:
    """Whether a reattempt in place cannot heal the incident as now understood: its root
    cause calls for more, or a rank it needs is gone."""
    return failures.classify(incident.kind).action is not failures.Action.REATTEMPT or not ranks_alive(incident)


def waiting_and_gone(incident: pb.Incident) -> tuple[set[int], set[int]]:
    """Ranks of the incident's generation that wait for the coordinator's decision with their
    state intact (they reported how a peer's failure looks: a network error), and ranks that
    are gone or must go: exited, or alive after an error of their own (software, memory,
    device: failures.GROUP_SYMPTOMS), which waits for its replacement, its state untrusted."""
    waiting: set[int] = set()
    gone: set[int] = set()
    for r in incident.reports:
        if r.generation != incident.generation or not r.HasField("rank"):
            continue
        if r.source == pb.DETECTION_SOURCE_PROCESS_SUPERVISION:
            gone.add(r.rank)
        elif r.source == pb.DETECTION_SOURCE_EXCEPTION:
            (waiting if r.kind in _CONSEQUENCES else gone).add(r.rank)
    return waiting - gone, gone


def lost_nodes(incident: pb.Incident) -> set[str]:
    """Nodes the incident's generation lost (no heartbeat): their ranks are gone, even once
    the node's agent is back."""
    return {
        r.node_id
        for r in incident.reports
        if r.generation == incident.generation and r.kind == pb.FAILURE_KIND_NODE_LOST and r.node_id
    }


def ranks_alive(incident: pb.Incident) -> bool:
    """False when a rank of the incident's generation is gone or must go (waiting_and_gone),
    or its node is lost: nothing can then be reattempted in place."""
    gone_sources = (pb.DETECTION_SOURCE_PROCESS_SUPERVISION, pb.DETECTION_SOURCE_HEARTBEAT)
    gone = any(r.source in gone_sources and r.generation == incident.generation for r in incident.reports)
    return not gone and not waiting_and_gone(incident)[1]
