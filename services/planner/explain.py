"""Why each job got what it got, in words, and the plan as a PlanResult."""

from __future__ import annotations

import math
from collections.abc import Mapping

from services.planner import domain, teams
from services.planner.domain import JobPlan, PlanResult
from services.planner.problem import (
    JobData,
    Problem,
)


def _slots_text(count: int) -> str:
    return f"{count} slot" if count == 1 else f"{count} slots"


def _plural_nodes(node_ids: list[str]) -> str:
    return f"{'node' if len(node_ids) == 1 else 'nodes'} {', '.join(node_ids)}"


def _team_limit_text(data: Problem, jd: JobData, team_used: Mapping[str, int], more: int) -> str | None:
    """When the job's team holds too much of its limit for the job to have ``more`` slots."""
    limit = data.request.team_limits.get(jd.job.team)
    if limit is None or team_used.get(jd.job.team, 0) + more <= limit:
        return None
    return f"team {jd.job.team} holds {team_used.get(jd.job.team, 0)} of its limit of {_slots_text(limit)}"


def _unplaced_reason(jd: JobData, left: int, cap_reached: int | None, team: str | None = None) -> str:
    """Why a job got no slots, given the slots ``left`` free for its TP size (``cap_reached``:
    the changed-jobs cap when the plan used it up, else None; ``team``: its team's limit, when
    that keeps it out)."""
    job = jd.job
    if job.pinned:
        return "pinned while not running"
    if team is not None:
        return team
    if left < jd.sizes[0]:
        return f"needs at least {_slots_text(jd.sizes[0])}, only {left} left free"
    if cap_reached is not None and not jd.forced:
        return f"changed-jobs cap of {cap_reached} reached"
    if not any(v > 0 for v in jd.move_value.values()):
        return "not worth its transition time before the next expected failure"
    return f"weight {job.weight:g} earns less per slot than the jobs given the slots"


# Sizes a reason lists at most: the smallest, the largest, and those around the chosen size.
SIZES_SHOWN = 6


def throughput_basis(job: domain.Job, size: int) -> str:
    """Where T(size) comes from, in a word: the job's profile, a measurement, the model's
    estimate, or the per-slot assumption."""
    if job.throughput is not None:
        return "profiled"
    if size in job.measured:
        return "measured"
    if job.estimate is None:
        return "assumed, scaled to measured" if job.measured else "assumed"
    return "estimated from measured compute" if job.measured else "estimated"


def throughput_text(job: domain.Job, chosen: int) -> str:
    """The FLOP/s behind a job's size, at the sizes considered ("1: 2.1e+09 measured, ...")."""
    sizes = domain.allowed_sizes(job)
    if len(sizes) > SIZES_SHOWN:
        at = min(range(len(sizes)), key=lambda i: abs(sizes[i] - chosen))
        around = sizes[max(0, at - 2) : at + 2]
        sizes = sorted({sizes[0], *around, sizes[-1]})
    parts = [f"{x}: {domain.throughput(job, x):.3g} {throughput_basis(job, x)}" for x in sizes]
    return "FLOP/s by size " + ", ".join(parts)


def job_reasons(data: Problem, result: Mapping[str, dict[str, int]]) -> dict[str, str]:
    """A reason per job, from comparing its current and new placement."""
    used = dict.fromkeys(data.nodes, 0)
    released = dict.fromkeys(data.nodes, 0)  # slots jobs give up on each node
    for jd in data.jobs:
        new, cur = result[jd.job.job_id], jd.job.current
        for node_id in set(new) | set(cur):
            used[node_id] += new.get(node_id, 0)
            released[node_id] += max(0, cur.get(node_id, 0) - new.get(node_id, 0))
    cap = data.request.max_changed_jobs
    voluntary = sum(1 for jd in data.jobs if domain.is_changed(jd.job, result[jd.job.job_id]) and not jd.forced)
    left_by_tp: dict[int, int] = {}
    team_used = teams.usage((jd.job for jd in data.jobs), {j: sum(slots.values()) for j, slots in result.items()})
    reasons: dict[str, str] = {}
    for jd in data.jobs:
        job, new = jd.job, result[jd.job.job_id]
        cur, tp = dict(job.current), job.tensor_parallel
        cur_size, new_size = job.current_size, sum(new.values())
        lost = sorted(n for n in cur if not data.nodes[n].healthy and not data.nodes[n].drained)
        drained = sorted(n for n in cur if data.nodes[n].drained)
        if lost or drained:
            cause = "; ".join(
                f"{_plural_nodes(names)} {what}" for names, what in ((lost, "lost"), (drained, "drained")) if names
            )
        elif job.hit_by_failure:
            cause = "hit by failure"
        else:
            cause = ""
        if new_size == 0:
            if tp not in left_by_tp:
                left_by_tp[tp] = sum((n.slots - used[n.node_id]) // tp * tp for n in data.healthy)
            team = _team_limit_text(data, jd, team_used, jd.sizes[0])
            why = _unplaced_reason(jd, left_by_tp[tp], cap if cap is not None and voluntary >= cap else None, team)
            if not cur:
                reasons[job.job_id] = f"not started: {why}"
            else:
                reasons[job.job_id] = f"paused: {cause + '; ' if cause else ''}{why}"
        elif not cur:
            reasons[job.job_id] = f"started on {_slots_text(new_size)}"
        elif new == cur:
            reasons[job.job_id] = (
                f"restarted in place on {_slots_text(new_size)} after failure" if job.hit_by_failure else "kept"
            )
        elif new_size < cur_size:
            others_gain = any(
                sum(result[other.job.job_id].values()) > other.job.current_size
                for other in data.jobs
                if other is not jd
            )
            team = _team_limit_text(data, jd, team_used, cur_size - new_size)
            why = cause or team or ("slots given to other jobs" if others_gain else "fewer ranks are worth more to it")
            reasons[job.job_id] = f"shrunk from {cur_size} to {_slots_text(new_size)}: {why}"
        elif new_size > cur_size:
            gained = [n for n, s in new.items() if s > cur.get(n, 0)]
            others = [released[n] - max(0, cur.get(n, 0) - new.get(n, 0)) for n in gained]
            kind = "freed" if any(o > 0 for o in others) else "idle"
            tail = f" ({cause})" if cause else ""
            reasons[job.job_id] = f"grown from {cur_size} to {_slots_text(new_size)} into {kind} slots{tail}"
        else:
            reasons[job.job_id] = f"moved: {cause}" if cause else "moved"
        if new_size != cur_size or not cur:
            reasons[job.job_id] += f" ({throughput_text(job, new_size)})"
    return reasons


def plan_result(
    data: Problem,
    status: str,
    reason: str,
    seconds: float,
    placement: Mapping[str, dict[str, int]] | None = None,
    bound: float = 0.0,
) -> PlanResult:
    if placement is None:
        return PlanResult(
            status, 0.0, bound, math.inf if bound == math.inf else 0.0, seconds, data.horizon.seconds, (), reason
        )
    reasons = job_reasons(data, placement)
    jobs = []
    for jd in data.jobs:
        slots = placement[jd.job.job_id]
        kind = domain.transition_kind(jd.job, slots)
        jobs.append(
            JobPlan(
                job_id=jd.job.job_id,
                slots_by_node={n: slots[n] for n in data.nodes if slots.get(n)},
                size=sum(slots.values()),
                changed=domain.is_changed(jd.job, slots),
                reason=reasons[jd.job.job_id],
                transition=kind or "",
                transition_s=domain.transition_seconds(jd.job, kind),
            )
        )
    objective = sum(domain.job_value(jd.job, placement[jd.job.job_id], data.horizon) for jd in data.jobs)
    bound = max(bound, objective)
    if bound == math.inf:
        gap = math.inf
    else:
        gap = (bound - objective) / abs(bound) if bound else 0.0
    return PlanResult(status, objective, bound, gap, seconds, data.horizon.seconds, tuple(jobs), reason)
