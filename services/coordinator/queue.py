"""The queue as people read it: the jobs waiting for slots, in the order the planner prefers
them, each with what it waits for. A pure function of the stored jobs and the clock.

The planner does not keep a queue: it re-plans every job to maximize the cluster's weighted
FLOP/s (docs/architecture.md: The cost model). Among jobs that wait, the one it starts first
when slots free up is the one whose weight is highest (its priority class's), and among equal
weights the one that has waited longest: that is the order shown. A job larger than the slots
that free up can be passed by a smaller one behind it; its `waiting_for` says what it needs."""

from __future__ import annotations

from collections.abc import Iterable

from services.coordinator import quotas, state
from unicron import jobspec
from unicron.v1 import common_pb2, job_service_pb2


def waiting_since(job: common_pb2.Job) -> float:
    """When the job last began to wait: its last change into PENDING (submitted, or paused
    to make room), else its creation."""
    for change in reversed(job.history):
        if change.state == state.PENDING:
            return float(change.time.ToNanoseconds()) / 1e9
    return float(job.created.ToNanoseconds()) / 1e9


def entries(
    jobs: Iterable[common_pb2.Job], now: float, scope: str | None, limits: quotas.Quotas = quotas.NONE
) -> list[job_service_pb2.QueueEntry]:
    """The waiting jobs in order. ``scope``: whose jobs the caller may see by name (None:
    all); another's shows its place, class, team, weight and wait only. A job its team's quota
    keeps waiting says so (``limits``: the teams' quotas)."""
    jobs = list(jobs)
    used = quotas.used_slots(jobs)
    waiting = [job for job in jobs if job.state == state.PENDING]
    waiting.sort(key=lambda job: (-job.spec.weight, waiting_since(job), job.job_id))
    out = []
    for position, job in enumerate(waiting, start=1):
        entry = job_service_pb2.QueueEntry(
            position=position,
            priority_class=job.spec.priority_class,
            weight=job.spec.weight,
            waited_seconds=round(max(0.0, now - waiting_since(job)), 3),
            min_slots=jobspec.world_size(job.spec, job.spec.parallelism.min_data),
            team=job.team,
        )
        if scope is None or job.owner == scope:
            why = quotas.waiting_reason(limits, job, used, entry.min_slots) or job.reason
            entry.job_id, entry.name, entry.owner, entry.waiting_for = job.job_id, job.spec.name, job.owner, why
        out.append(entry)
    return out
