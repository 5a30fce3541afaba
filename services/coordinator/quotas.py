"""Team quotas, as Kueue's cohorts give them: each team has a guaranteed share of slots and may
borrow idle slots beyond it up to a limit (docs/architecture.md: Teams and quotas). Users
belong to teams through the tokens file (`team:`); a job counts against its owner's team.

What is enforced where:
- at submit (`check_submit`, before anything is written): a job whose team has no quota, or
  whose smallest size exceeds what its team may ever hold (guarantee plus borrowing limit), is
  refused with FAILED_PRECONDITION naming the quota;
- in every plan: the team's jobs hold at most its guarantee plus its borrowing limit together,
  and slots a team borrowed are the first given back once the team that is guaranteed them
  has jobs that could use them, whatever the weights: constraints of the planner's model
  (services/planner/teams.py), so a running job over a lowered quota or holding borrowed slots
  shrinks or pauses through the planner's ordinary transitions.

Not yet: fair share among one team's own jobs (weight decides there).

The quotas come from the coordinator's `--quotas-file` (YAML below); none: no team is limited."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from services.coordinator import state
from services.coordinator.decide import slots_by_node
from unicron.errors import FailedPrecondition
from unicron.v1 import common_pb2, job_service_pb2

_NAME = re.compile(r"^[a-z][a-z0-9-]{0,62}$")

EXAMPLE = "teams: {NAME: {guarantee: SLOTS, borrow_limit: SLOTS}}"


@dataclass(frozen=True)
class Quota:
    team: str
    guarantee: int  # slots the team is entitled to
    borrow_limit: int | None  # slots it may borrow beyond them; None: any idle slot

    @property
    def limit(self) -> int | None:
        """The most slots the team's jobs may hold together; None: the cluster's."""
        return None if self.borrow_limit is None else self.guarantee + self.borrow_limit

    def describe(self) -> str:
        borrow = "any idle slots" if self.borrow_limit is None else f"{self.borrow_limit} more"
        return f"team {self.team}'s quota: {self.guarantee} slots guaranteed, may borrow {borrow}"


@dataclass(frozen=True)
class Quotas:
    teams: Mapping[str, Quota]

    def __bool__(self) -> bool:
        return bool(self.teams)

    def limits(self) -> dict[str, int]:
        """The planner's team limits: every team that may not borrow without bound."""
        return {team: q.limit for team, q in self.teams.items() if q.limit is not None}

    def guarantees(self) -> dict[str, int]:
        """The planner's team guarantees: borrowed slots are the first given back."""
        return {team: q.guarantee for team, q in self.teams.items()}

    def check_submit(self, team: str, admin: bool, needed: int) -> None:
        """FailedPrecondition when a job of ``team`` needing at least ``needed`` slots could
        never run under the quotas. An admin outside every team is not limited."""
        if not self.teams or (admin and not team):
            return
        if not team:
            raise FailedPrecondition(
                f"quota: this cluster gives slots to teams ({', '.join(sorted(self.teams))}) and your user"
                " belongs to none (the tokens file's team)"
            )
        quota = self.teams.get(team)
        if quota is None:
            raise FailedPrecondition(f"quota: team {team!r} has no quota here ({', '.join(sorted(self.teams))})")
        if quota.limit is not None and needed > quota.limit:
            raise FailedPrecondition(
                f"quota: the job needs at least {needed} slots (tensor x pipeline x min_data), and "
                f"{quota.describe()}, {quota.limit} in all"
            )

    def oversubscribed(self, slots: int) -> str | None:
        """A sentence when the guarantees add up to more than the cluster's ``slots``."""
        promised = sum(q.guarantee for q in self.teams.values())
        if slots and promised > slots:
            return f"the teams' guarantees add up to {promised} slots, the cluster has {slots}: not all can be kept"
        return None


NONE = Quotas({})


def load(path: str | Path) -> Quotas:
    """The quotas a YAML file defines; ValueError naming what is wrong."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict) or not isinstance(data.get("teams"), dict) or set(data) - {"teams"}:
        raise ValueError(f"{path}: expected {EXAMPLE}")
    return Quotas({name: _quota(name, body, path) for name, body in data["teams"].items()})


def _quota(name: object, body: object, path: str | Path) -> Quota:
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{path}: teams.{name}: a team's name is lowercase letters, digits and '-'")
    if not isinstance(body, dict) or set(body) - {"guarantee", "borrow_limit"} or "guarantee" not in body:
        raise ValueError(f"{path}: teams.{name}: expected {{guarantee: SLOTS, borrow_limit: SLOTS}}")
    values = {key: body.get(key) for key in ("guarantee", "borrow_limit")}
    for key, value in values.items():
        if value is None and key == "borrow_limit":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}: teams.{name}.{key}: must be a whole number of slots >= 0, got {value!r}")
    return Quota(name, int(body["guarantee"]), values["borrow_limit"])


def used_slots(jobs: Iterable[common_pb2.Job]) -> dict[str, int]:
    """Slots each team's active jobs hold now."""
    used: dict[str, int] = {}
    for job in jobs:
        if job.team and job.state in state.ACTIVE:
            used[job.team] = used.get(job.team, 0) + sum(slots_by_node(job).values())
    return used


def waiting_reason(quotas: Quotas, job: common_pb2.Job, used: Mapping[str, int], needed: int) -> str | None:
    """Why a waiting job cannot start for its team's quota, if that is why: its team holds too
    much of what it may hold for the job's fewest slots to fit."""
    quota = quotas.teams.get(job.team)
    if quota is None or quota.limit is None:
        return None
    holds = used.get(job.team, 0)
    if holds + needed <= quota.limit:
        return None
    return (
        f"quota: team {job.team} holds {holds} of the {quota.limit} slots it may ({quota.guarantee} guaranteed"
        f" + {quota.borrow_limit} borrowed); this job needs {needed}"
    )


def report(quotas: Quotas, jobs: Iterable[common_pb2.Job], cluster_slots: int) -> job_service_pb2.ListQuotasResponse:
    """Each team's quota beside what its jobs hold now, for ``unicron quota``."""
    jobs = list(jobs)
    used = used_slots(jobs)
    waiting: dict[str, int] = {}
    for job in jobs:
        if job.team and job.state == state.PENDING:
            waiting[job.team] = waiting.get(job.team, 0) + 1
    out = job_service_pb2.ListQuotasResponse(cluster_slots=cluster_slots)
    for name in sorted(quotas.teams):
        quota, holds = quotas.teams[name], used.get(name, 0)
        out.teams.add(
            team=name,
            guarantee=quota.guarantee,
            borrow_limit=quota.borrow_limit or 0,
            borrow_unlimited=quota.borrow_limit is None,
            used=holds,
            borrowed=max(0, holds - quota.guarantee),
            waiting_jobs=waiting.get(name, 0),
        )
    return out
