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


def _root(reports: list[pb.FailureReport]) -> pb.FailureReport:
    """The earliest report explains the rest, except that a rank's own exception explains
    that rank's exit: the exit is the consequence, the exception the cause."""
    earliest = min(reports, key=lambda r: _seconds(r.first_seen))
    if earliest.source == pb.DETECTION_SOURCE_PROCESS_SUPERVISION:
        for report in reports:
            if (
                report.source == pb.DETECTION_SOURCE_EXCEPTION
                and report.HasField("rank")
                and earliest.HasField("rank")
                and report.rank == earliest.rank
            ):
                return report
    return earliest


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


def is_open(incident: pb.Incident, now: float) -> bool:
    """Whether new reports with the incident's key still join it."""
    return now - _seconds(incident.detected) <= MERGE_WINDOW_S


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


def ends_the_job(incident: pb.Incident) -> bool:
    """Until the self-healing ladder acts (reattempt, restart, reconfigure), every failure
    but a performance report ends its job; this is the one place that decides it."""
    return incident.kind != pb.FAILURE_KIND_STRAGGLER and bool(incident.job_id)
