"""Teams in the plan: slot limits and guarantees (a job names its team in ``Job.team``).

A *limit* (``PlanRequest.team_limits``: a quota's guarantee plus what the team may borrow) is
the most slots the team's jobs hold together. A *guarantee* (``PlanRequest.team_guarantees``)
makes borrowed slots the first given back: each team is *reserved* its guarantee, as far as
its jobs could use it (``reserves``), and the plan must fit every team's max(use, reserve)
plus the jobs outside guaranteed teams into the healthy slots. So another team may borrow a
team's idle guarantee only while that team's jobs could not use it; once they could (a job
waits, or could grow), the borrowers shrink to make room, whatever the weights. A guarantee
beats weight; within what is free, weight decides.

One rule for every part of the planner: the check of a plan (``domain.plan_problems``), the
CP-SAT models, the greedy plan and the paper's DP (``dp.plan_sizes_dp``: each team's jobs
first, within its limit, then the teams together, a team taking max(its slots, its reserve)
of the pool). These are constraints of the model, not a filter after it: the plan found is the
best among plans that keep them, and a running job over its team's share shrinks (or pauses)
through the planner's ordinary transitions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from services.planner.fields import check_id, check_int, fail

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


def checked(where: str, name: str, value: object) -> dict[str, int]:
    """A request's team -> slots mapping, checked (FieldError naming the entry)."""
    if not isinstance(value, Mapping):
        fail(where, name, f"must be a mapping team -> slots, got {value!r}")
        return {}
    for team, slots in value.items():
        check_id(where, f"{name} (key)", team)
        check_int(where, f"{name}[{team!r}]", slots, 0)
    return dict(value)


def grouped(request: PlanRequest) -> dict[str, list[Job]]:
    """Each team with a limit or a guarantee, with its jobs in request order."""
    out: dict[str, list[Job]] = {team: [] for team in (*request.team_limits, *request.team_guarantees)}
    for job in request.jobs:
        if job.team in out:
            out[job.team].append(job)
    return out


def reserves(request: PlanRequest, pool: int) -> dict[str, int]:
    """Slots held for each guaranteed team whoever borrows: its guarantee, no more than its
    jobs could use (their largest sizes; a pinned job its current one), and never less than
    what its pinned and non-preemptible jobs must have. Where the guarantees beyond those
    needs add up to more than the ``pool`` leaves, each is cut in proportion (a cluster that
    lost nodes keeps every plan feasible)."""
    from services.planner.domain import allowed_sizes

    want: dict[str, int] = dict.fromkeys(request.team_guarantees, 0)
    must: dict[str, int] = dict.fromkeys(request.team_guarantees, 0)
    outside = 0  # slots the others' pinned and non-preemptible jobs must have
    for job in request.jobs:
        sizes = allowed_sizes(job)
        need = (job.current_size if job.pinned else sizes[0]) if (job.pinned or not job.preemptible) else 0
        if job.team in want:
            want[job.team] += job.current_size if job.pinned else sizes[-1]
            must[job.team] += need
        else:
            outside += need
    extra = {t: max(0, min(g, want[t]) - must[t]) for t, g in request.team_guarantees.items()}
    slack = max(0, pool - outside - sum(must.values()))
    total = sum(extra.values())
    if total > slack:
        extra = {t: e * slack // total for t, e in extra.items()}
    return {t: must[t] + extra[t] for t in request.team_guarantees}


def pool_use(request: PlanRequest, sizes: Mapping[str, int], pool: int) -> int:
    """The pool a plan's sizes take: each guaranteed team max(its slots, its reserve), every
    other job its own size."""
    reserved = reserves(request, pool)
    used = usage(request.jobs, sizes)
    loose = sum(sizes.get(job.job_id, 0) for job in request.jobs if job.team not in reserved)
    return loose + sum(max(used.get(t, 0), r) for t, r in reserved.items())


def over_guarantees(request: PlanRequest, sizes: Mapping[str, int], pool: int) -> list[str]:
    """A sentence when borrowed slots eat into a team's guarantee its jobs could use."""
    if not request.team_guarantees:
        return []
    taken = pool_use(request, sizes, pool)
    if taken <= pool:
        return []
    return [f"teams' guarantees: the plan takes {taken} of {pool} healthy slots counting each team's reserve"]
