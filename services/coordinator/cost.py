"""What failures cost and how efficiently the cluster runs (docs/architecture.md: The cost model, Observability).

Weighted achieved FLOP/s (WAF) of a job is its weight times the FLOP/s of its last
iteration; the cluster's WAF is the sum. A failure costs WAF x seconds in three phases:
detection (first sign -> classified report), transition (detection -> first good
iteration after the remedy), both at the job's healthy rate, and sub-healthy (running
smaller afterwards, at the rate it lost). Pure code, the clock passed in (seconds since
the epoch, as a float)."""

from __future__ import annotations

from collections.abc import Iterable

from google.protobuf.timestamp_pb2 import Timestamp

from unicron.v1 import common_pb2 as pb
from unicron.v1 import job_service_pb2

TERMINAL = frozenset({pb.JOB_STATE_SUCCEEDED, pb.JOB_STATE_FAILED, pb.JOB_STATE_CANCELLED})
# States in which a job holds slots.
HOLDING = frozenset({pb.JOB_STATE_SCHEDULED, pb.JOB_STATE_RUNNING, pb.JOB_STATE_RECOVERING})
# A finished job stays in the cluster summary this long after its last state change, so
# that `unicron cluster` still shows what a job that just ended earned and lost.
RECENT_S = 600.0


def _seconds(stamp: Timestamp) -> float:
    return stamp.ToNanoseconds() / 1e9


def weight(job: pb.Job) -> float:
    """w(t); a spec without one weighs 1.0 (the spec's documented default)."""
    return job.spec.weight or 1.0


def job_waf(job: pb.Job) -> float:
    """Weight x FLOP/s of the job's last iteration; 0 unless it is RUNNING."""
    if job.state != pb.JOB_STATE_RUNNING:
        return 0.0
    return weight(job) * job.progress.flops_per_second


def job_slots(job: pb.Job) -> int:
    """Slots the job holds now: its assigned ranks while scheduled, running or recovering."""
    if job.state not in HOLDING:
        return 0
    return sum(len(worker.ranks) for worker in job.assignment.workers)


def incident_cost(incident: pb.Incident, healthy_waf: float, resumed_waf: float, resumed_at: float) -> pb.FailureCost:
    """The cost of an incident whose job resumed at resumed_at, at resumed_waf, after
    running at healthy_waf before it. Sub-healthy time starts at 0 (accrue_sub_healthy)."""
    first_seen = _seconds(incident.first_seen)
    # An incident always has detected set; fall back to first_seen rather than the epoch.
    detected = _seconds(incident.detected) if incident.HasField("detected") else first_seen
    if not incident.HasField("first_seen"):
        first_seen = detected
    healthy = max(0.0, healthy_waf)
    detection = max(0.0, detected - first_seen)
    transition = max(0.0, resumed_at - detected)
    return pb.FailureCost(
        detection_seconds=detection,
        transition_seconds=transition,
        healthy_waf=healthy,
        resumed_waf=max(0.0, resumed_waf),
        detection_waf_seconds=healthy * detection,
        transition_waf_seconds=healthy * transition,
        sub_healthy_waf=max(0.0, healthy - resumed_waf),
    )


def resumed_cost(incident: pb.Incident) -> pb.FailureCost:
    """The cost of a resumed incident from what it records (healthy and resumed rate and
    size, resumed time), keeping the sub-healthy time accrued so far. The remedy's note
    and the resume may be written in either order: whichever comes second prices it."""
    out = incident_cost(incident, incident.cost.healthy_waf, incident.cost.resumed_waf, _seconds(incident.resumed))
    out.healthy_slots = incident.cost.healthy_slots
    out.resumed_slots = incident.cost.resumed_slots
    out.sub_healthy_waf = size_loss(out.healthy_waf, out.healthy_slots, out.resumed_slots)
    out.sub_healthy_seconds = incident.cost.sub_healthy_seconds
    out.sub_healthy_waf_seconds = incident.cost.sub_healthy_waf_seconds
    return out


def accrue_sub_healthy(cost: pb.FailureCost, seconds: float, slots_now: int | None = None) -> pb.FailureCost:
    """A copy of cost with seconds more of sub-healthy running (negative counts as 0).
    With slots_now, the sub-healthy rate first follows the job's size: healthy_waf x
    (1 - slots_now / healthy_slots), 0 once it is back to its healthy size."""
    out = pb.FailureCost()
    out.CopyFrom(cost)
    if slots_now is not None and out.healthy_slots:
        out.sub_healthy_waf = size_loss(out.healthy_waf, out.healthy_slots, slots_now)
    seconds = max(0.0, seconds)
    out.sub_healthy_seconds += seconds
    out.sub_healthy_waf_seconds += out.sub_healthy_waf * seconds
    return out


def size_loss(healthy_waf: float, healthy_slots: int, slots_now: int) -> float:
    """WAF lost by running on slots_now instead of healthy_slots, by the job's size alone
    (a first iteration after a restart is slow for reasons that do not last)."""
    if healthy_slots <= 0 or slots_now >= healthy_slots:
        return 0.0
    return healthy_waf * (1.0 - slots_now / healthy_slots)


def total_waf_seconds(cost: pb.FailureCost) -> float:
    """WAF x seconds lost in all three phases."""
    return cost.detection_waf_seconds + cost.transition_waf_seconds + cost.sub_healthy_waf_seconds


def current_cost(incident: pb.Incident, job: pb.Job | None, now: float) -> pb.FailureCost:
    """What the incident has cost so far. Its recorded cost once the job resumed; while
    the job is still RECOVERING from it, detection plus transition until now, at the
    job's last healthy rate (its progress still holds the last good iteration); else
    nothing (the job ended without resuming, or the incident needed no remedy)."""
    if incident.HasField("resumed"):
        return incident.cost
    if job is None or job.state != pb.JOB_STATE_RECOVERING or incident.HasField("resumed"):
        return pb.FailureCost()
    healthy = weight(job) * job.progress.flops_per_second
    return incident_cost(incident, healthy, healthy, now)


def _open_incidents(jobs: dict[str, pb.Job], incidents: list[pb.Incident]) -> set[str]:
    """Per recovering job, its newest unresolved incident: only that one accrues a
    provisional cost, so that merged or follow-up reports are not counted twice."""
    newest: dict[str, pb.Incident] = {}
    for incident in incidents:
        job = jobs.get(incident.job_id)
        if job is None or job.state != pb.JOB_STATE_RECOVERING:
            continue
        if incident.HasField("resumed"):
            continue
        best = newest.get(incident.job_id)
        if best is None or _seconds(incident.detected) > _seconds(best.detected):
            newest[incident.job_id] = incident
    return {incident.incident_id for incident in newest.values()}


def _ended_at(job: pb.Job) -> float:
    return _seconds(job.history[-1].time) if job.history else _seconds(job.created)


def shown(job: pb.Job, now: float, recent_s: float = RECENT_S) -> bool:
    """Whether the summary lists the job: not finished, or finished within recent_s."""
    return job.state not in TERMINAL or now - _ended_at(job) <= recent_s


def cluster_summary(
    jobs: Iterable[pb.Job],
    nodes: Iterable[pb.Node],
    incidents: Iterable[pb.Incident],
    now: float,
    recent_s: float = RECENT_S,
) -> job_service_pb2.GetClusterResponse:
    """The cluster's efficiency now. Nodes and slots count READY nodes only; slots used are
    the ranks of scheduled, running and recovering jobs. Jobs are listed (in the order
    given) while active and for recent_s after they end; the totals (WAF, failure cost,
    incidents) cover every job and every incident, listed or not."""
    all_jobs = list(jobs)
    by_id = {job.job_id: job for job in all_jobs}
    all_incidents = list(incidents)
    provisional = _open_incidents(by_id, all_incidents)

    lost_by_job: dict[str, float] = {}
    count_by_job: dict[str, int] = {}
    total_lost = 0.0
    for incident in all_incidents:
        if incident.HasField("resumed"):
            lost = total_waf_seconds(incident.cost)
        elif incident.incident_id in provisional:
            lost = total_waf_seconds(current_cost(incident, by_id.get(incident.job_id), now))
        else:
            lost = 0.0
        total_lost += lost
        if incident.job_id:
            lost_by_job[incident.job_id] = lost_by_job.get(incident.job_id, 0.0) + lost
            count_by_job[incident.job_id] = count_by_job.get(incident.job_id, 0) + 1

    summary = job_service_pb2.GetClusterResponse(
        failure_waf_seconds=total_lost,
        incidents=len(all_incidents),
        waf=sum(job_waf(job) for job in all_jobs),
    )
    for node in nodes:
        if node.state == pb.NODE_STATE_READY:
            summary.nodes_ready += 1
            summary.slots_total += node.slots
        elif node.state == pb.NODE_STATE_LOST:
            summary.nodes_lost += 1
    for job in all_jobs:
        slots = job_slots(job)
        summary.slots_used += slots
        if not shown(job, now, recent_s):
            continue
        running = job.state == pb.JOB_STATE_RUNNING
        summary.jobs.add(
            job_id=job.job_id,
            name=job.spec.name,
            state=job.state,
            weight=weight(job),
            slots=slots,
            flops_per_second=job.progress.flops_per_second if running else 0.0,
            waf=job_waf(job),
            failure_waf_seconds=lost_by_job.get(job.job_id, 0.0),
            incidents=count_by_job.get(job.job_id, 0),
            progress=job.progress,
        )
    return summary


def effective_training_time_ratio(job: pb.Job, incidents: Iterable[pb.Incident], now: float) -> float:
    """Share of the job's wall time since it was first scheduled (until now, or until it
    ended) not lost to detection and transition; 1.0 before it was scheduled. Not exported
    by the API; the sub-healthy phase loses rate, not time, so it does not count here."""
    started = next(
        (_seconds(c.time) for c in job.history if c.state in (pb.JOB_STATE_SCHEDULED, pb.JOB_STATE_RUNNING)), None
    )
    if started is None:
        return 1.0
    end = _ended_at(job) if job.state in TERMINAL else now
    elapsed = end - started
    if elapsed <= 0:
        return 1.0
    own = [incident for incident in incidents if incident.job_id == job.job_id]
    provisional = _open_incidents({job.job_id: job}, own)
    lost = 0.0
    for incident in own:
        if incident.HasField("resumed") or incident.incident_id in provisional:
            cost = current_cost(incident, job, end)
            lost += cost.detection_seconds + cost.transition_seconds
    return max(0.0, min(1.0, 1.0 - lost / elapsed))
