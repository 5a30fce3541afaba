"""Team quotas at the coordinator (services/coordinator/quotas.py) by tables: the file, the
check at submit, what the planner is told, and the one warning about promises the cluster
cannot keep."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.coordinator import decide, quotas, state
from services.coordinator.quotas import Quota, Quotas
from unicron.errors import FailedPrecondition
from unicron.security import TokenBook
from unicron.v1 import common_pb2

QUOTAS = Quotas({"vision": Quota("vision", 16, 4), "nlp": Quota("nlp", 8, None)})


def test_a_file_gives_each_team_a_guarantee_and_a_borrowing_limit(tmp_path: Path) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text("teams:\n  vision: {guarantee: 16, borrow_limit: 4}\n  nlp: {guarantee: 8}\n")
    assert quotas.load(path) == QUOTAS
    assert QUOTAS.limits() == {"vision": 20}  # nlp may borrow any idle slot


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("vision: 16\n", "expected teams:"),
        ("teams: {Vision: {guarantee: 1}}\n", "teams.Vision"),
        ("teams: {vision: {borrow_limit: 1}}\n", "teams.vision: expected"),
        ("teams: {vision: {guarantee: -1}}\n", "teams.vision.guarantee"),
        ("teams: {vision: {guarantee: 2, borrow_limit: 1.5}}\n", "teams.vision.borrow_limit"),
        ("teams: {vision: {guarantee: 2, borow: 1}}\n", "teams.vision: expected"),
    ],
)
def test_a_bad_file_is_named(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "quotas.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=says):
        quotas.load(path)


@pytest.mark.parametrize(
    ("team", "admin", "needed", "refused"),
    [
        ("vision", False, 20, None),  # guarantee and borrowing, exactly
        ("vision", False, 21, "the job needs at least 21 slots"),
        ("nlp", False, 4096, None),  # may borrow without bound
        ("", False, 1, "belongs to none"),
        ("", True, 1, None),  # an admin outside every team
        ("audio", False, 1, "team 'audio' has no quota"),
    ],
)
def test_a_submit_the_quota_can_never_hold_is_refused(team: str, admin: bool, needed: int, refused: str | None) -> None:
    if refused is None:
        QUOTAS.check_submit(team, admin, needed)
        return
    with pytest.raises(FailedPrecondition, match=refused) as error:
        QUOTAS.check_submit(team, admin, needed)
    assert str(error.value).startswith("quota: ")


def test_no_quotas_limit_no_one() -> None:
    quotas.NONE.check_submit("", False, 10**6)
    assert quotas.NONE.limits() == {} and quotas.NONE.oversubscribed(1) is None


def test_guarantees_over_the_cluster_are_said() -> None:
    assert QUOTAS.oversubscribed(24) is None
    assert QUOTAS.oversubscribed(20) == (
        "the teams' guarantees add up to 24 slots, the cluster has 20: not all can be kept"
    )


def _job(job_id: str, team: str, job_state: int, slots: int = 0) -> common_pb2.Job:
    job = common_pb2.Job(job_id=job_id, team=team, state=job_state)  # type: ignore[arg-type]
    job.spec.parallelism.tensor = job.spec.parallelism.pipeline = 1
    job.spec.parallelism.data = job.spec.parallelism.min_data = job.spec.parallelism.max_data = 1
    if slots:
        job.assignment.workers.add(node_id="a", ranks=list(range(slots)))
    return job


def test_the_planner_is_told_each_jobs_team_and_the_limits() -> None:
    jobs = [_job("v", "vision", state.RUNNING, 2), _job("n", "nlp", state.PENDING)]
    request = decide.plan_request(jobs, [], 1e-6, 1.0, team_limits=QUOTAS.limits(), team_guarantees=QUOTAS.guarantees())
    assert {j.job_id: j.team for j in request.jobs} == {"v": "vision", "n": "nlp"}
    assert dict(request.team_limits) == {"vision": 20}
    assert dict(request.team_guarantees) == {"vision": 16, "nlp": 8}
    assert quotas.used_slots(jobs) == {"vision": 2}


def test_the_tokens_file_puts_users_in_teams(tmp_path: Path) -> None:
    path = tmp_path / "tokens.yaml"
    path.write_text("users:\n  - {name: alice, token: alice-token-0123456789, team: vision}\n")
    principal = TokenBook.load(str(path)).lookup("alice-token-0123456789")
    assert principal is not None and principal.team == "vision"
    path.write_text("users:\n  - {name: alice, token: alice-token-0123456789, team: [vision]}\n")
    with pytest.raises(Exception, match=r"users\[0\]\.team"):
        TokenBook.load(str(path))
