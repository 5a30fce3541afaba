"""The queue people read (services/coordinator/queue.py), by tables: the waiting jobs in the
order the planner prefers them, what each waits for, and what another user's entry hides."""

from __future__ import annotations

from services.coordinator import queue
from unicron.v1 import common_pb2 as pb


def job(name: str, weight: float, created: float, owner: str = "alice", running: bool = False) -> pb.Job:
    state = pb.JOB_STATE_RUNNING if running else pb.JOB_STATE_PENDING
    out = pb.Job(job_id=f"job-{name}", owner=owner, state=state, reason=f"waiting for slots ({name})")
    out.spec.name, out.spec.weight, out.spec.priority_class = name, weight, "research"
    out.spec.parallelism.tensor = out.spec.parallelism.pipeline = 1
    out.spec.parallelism.data, out.spec.parallelism.min_data = 4, 2
    out.created.FromSeconds(int(created))
    return out


def test_heavier_first_then_the_longer_waiting_and_only_the_waiting() -> None:
    jobs = [
        job("late-heavy", 10.0, 300),
        job("early-light", 1.0, 100),
        job("later-light", 1.0, 200),
        job("running", 100.0, 50, running=True),
    ]
    entries = queue.entries(jobs, now=400.0, scope=None)
    assert [(e.position, e.name) for e in entries] == [(1, "late-heavy"), (2, "early-light"), (3, "later-light")]
    assert [e.waited_seconds for e in entries] == [100.0, 300.0, 200.0]
    assert entries[0].min_slots == 2 and entries[0].waiting_for == "waiting for slots (late-heavy)"


def test_a_paused_job_waits_since_it_was_paused() -> None:
    paused = job("paused", 1.0, 100)
    change = paused.history.add(state=pb.JOB_STATE_PENDING, reason="paused: made room")
    change.time.FromSeconds(350)
    (entry,) = queue.entries([paused], now=400.0, scope=None)
    assert entry.waited_seconds == 50.0


def test_another_users_job_shows_its_place_and_class_not_what_it_is() -> None:
    entries = queue.entries([job("theirs", 10.0, 100, owner="bob"), job("mine", 1.0, 100)], now=200.0, scope="alice")
    theirs, mine = entries
    assert (theirs.position, theirs.priority_class, theirs.weight) == (1, "research", 10.0)
    assert (theirs.job_id, theirs.name, theirs.owner, theirs.waiting_for) == ("", "", "", "")
    assert (mine.position, mine.name, mine.owner) == (2, "mine", "alice")


def test_a_job_its_teams_quota_holds_back_says_so() -> None:
    from services.coordinator.quotas import Quota, Quotas

    limits = Quotas({"vision": Quota("vision", 4, 2), "nlp": Quota("nlp", 2, None)})
    running = job("running", 1.0, 50, running=True)
    running.team = "vision"
    running.assignment.workers.add(node_id="a", ranks=[0, 1, 2, 3, 4])
    held_back, free_to_borrow = job("held-back", 1.0, 100), job("borrower", 1.0, 200)
    held_back.team, free_to_borrow.team = "vision", "nlp"
    entries = queue.entries([running, held_back, free_to_borrow], now=400.0, scope=None, limits=limits)
    assert [(e.name, e.team) for e in entries] == [("held-back", "vision"), ("borrower", "nlp")]
    assert entries[0].waiting_for == (
        "quota: team vision holds 5 of the 6 slots it may (4 guaranteed + 2 borrowed); this job needs 2"
    )
    assert entries[1].waiting_for == "waiting for slots (borrower)"  # nlp may borrow any idle slot
