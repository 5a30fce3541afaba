"""Team slot limits: the most slots the jobs of one team may hold together
(``PlanRequest.team_limits``; a job names its team in ``Job.team``). One rule for every part of
the planner: the check of a plan (``domain.plan_problems``), the CP-SAT models (a linear
constraint per limited team over its jobs' sizes), the greedy plan (a team's room is spent as
its jobs are kept, started and grown) and the paper's DP (``dp.plan_sizes_dp``: each team's
jobs first, within its limit, then the teams together within the pool).

A team without a limit, and a job without a team, are limited by the cluster only. A limit is
a constraint of the model, not a filter after it: the plan found is the best among plans that
keep every limit, and a running job over its team's limit shrinks (or pauses) through the
planner's ordinary transitions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.planner.domain import Job, PlanRequest


def limited(request: PlanRequest) -> dict[str, list[Job]]:
    """Each team that has a limit, with its jobs in request order (teams without jobs too)."""
    out: dict[str, list[Job]] = {team: [] for team in request.team_limits}
    for job in request.jobs:
        if job.team in out:
            out[job.team].append(job)
    return out


def usage(jobs: Iterable[Job], sizes: Mapping[str, int]) -> dict[str, int]:
    """Slots per team (jobs without a team left out) for sizes job_id -> slots."""
    out: dict[str, int] = {}
    for job in jobs:
        if job.team:
            out[job.team] = out.get(job.team, 0) + sizes.get(job.job_id, 0)
    return out


def over_limits(request: PlanRequest, sizes: Mapping[str, int]) -> list[str]:
    """A sentence per team whose jobs hold more slots than its limit."""
    used = usage(request.jobs, sizes)
    return [
        f"team {team!r}: {used[team]} slots held, its limit is {limit}"
        for team, limit in request.team_limits.items()
        if used.get(team, 0) > limit
    ]
