"""The agent's hang verdicts by tables of cases, fed by a fake probe and the clock passed in;
and the per-generation bookkeeping (watch.py) they read."""

from __future__ import annotations

from collections.abc import Iterable

import pytest

from services.agent import procstat, verdicts
from services.agent.watch import ENDED_KEPT, JobWatch
from unicron.monitor import Finding, MonitorSettings, ReportRejected
from unicron.v1 import common_pb2
from unicron.v1 import node_service_pb2 as pb

HANG = common_pb2.FAILURE_KIND_TASK_HANG


def hang(first_seen: float = 100.0, threshold: float = 10.0) -> Finding:
    return Finding(HANG, "j", 1, None, first_seen, "no iteration", {"threshold_s": threshold})


@pytest.mark.parametrize(
    ("last_progress", "ignored", "busy", "now", "verdict"),
    [
        (85.0, False, False, 101.0, True),  # silent since before the threshold: a hang
        (95.0, False, False, 101.0, False),  # an iteration after all (within the threshold)
        (85.0, True, False, 101.0, False),  # finishing, or waiting for a decision
        (None, False, False, 101.0, False),  # the job is no longer watched
        (85.0, False, True, 101.0, None),  # busy: wait
        (85.0, False, True, 119.9, None),  # still within the hold (2 more thresholds)
        (85.0, False, True, 120.0, True),  # the hold is over: busy or not, it is a hang
    ],
)
def test_judge(last_progress: float | None, ignored: bool, busy: bool, now: float, verdict: bool | None) -> None:
    assert verdicts.judge(hang(), last_progress, ignored, busy, now) is verdict


@pytest.mark.parametrize(
    ("mark", "now", "waited", "runnable", "starved"),
    [
        (None, 10.0, 0.0, True, True),  # first look: a runnable thread is all there is to go on
        (None, 10.0, 5.0, False, False),
        ((9.0, 1.0), 10.0, 1.5, False, True),  # 0.5 s queued per second: starved
        ((9.0, 1.0), 10.0, 1.1, True, False),  # 0.1 s per second: a background thread
        ((10.0, 1.0), 10.0, 9.0, True, False),  # no time passed: nothing to compare
    ],
)
def test_starved(mark: tuple[float, float] | None, now: float, waited: float, runnable: bool, starved: bool) -> None:
    assert verdicts.starved(mark, now, waited, runnable) is starved


def test_rate() -> None:
    assert verdicts.rate(None, 10.0, 5.0) is None
    assert verdicts.rate((8.0, 1.0), 10.0, 2.0) == 0.5
    assert verdicts.rate((10.0, 1.0), 10.0, 2.0) is None


MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("samples", "since", "moving"),
    [
        ([(8.0 + t / 10, t * MIB / 10) for t in range(21)], 0.0, True),  # 1 MiB/s: a slow link
        ([(8.0, 0.0), (9.0, 500.0), (10.0, 1000.0)], 0.0, False),  # a log line: not a collective
        # A cable pulled: the socket buffer fills at once, then nothing moves.
        ([(8.0, 0.0), (8.1, 4 * MIB), (9.0, 4 * MIB), (10.0, 4 * MIB)], 0.0, False),
        # A hang: the writes were the last iteration's, before it finished.
        ([(8.0 + t / 10, t * MIB / 10) for t in range(11)] + [(9.5, MIB), (10.0, MIB)], 9.0, False),
        ([(9.9, 0.0), (10.0, MIB)], 0.0, False),  # too short a look to say
        ([], 0.0, False),
    ],
)
def test_sending(samples: list[tuple[float, float]], since: float, moving: bool) -> None:
    assert verdicts.sending(samples, 10.0, since) is moving


def test_retransmissions_count_only_since_the_last_iteration() -> None:
    samples = [(8.0, 5.0), (9.0, 7.0), (9.5, 7.0), (10.0, 7.0)]
    assert verdicts.grew(samples, 10.0, since=8.5)
    assert not verdicts.grew(samples, 10.0, since=9.2)


@pytest.mark.parametrize(
    ("now", "verdict"),
    [(101.0, None), (189.9, None), (190.0, True)],  # held up to 10 thresholds, then a hang
)
def test_judge_holds_a_collective_that_still_moves(now: float, verdict: bool | None) -> None:
    assert verdicts.judge(hang(), 85.0, False, False, now, moving=True) is verdict


def test_the_hosts_tcp_retransmissions_are_read_from_snmp() -> None:
    snmp = (
        "Ip: Forwarding DefaultTTL\nIp: 1 64\n"
        "Tcp: RtoAlgorithm RtoMin ActiveOpens OutSegs RetransSegs InErrs\nTcp: 1 200 10 500 42 0\n"
    )
    assert procstat.tcp_retransmits(snmp) == 42
    assert procstat.tcp_retransmits("Ip: 1\n") == 0
    with open("/proc/net/snmp") as real:
        assert procstat.tcp_retransmits(real.read()) >= 0


class FakeProbe:
    def __init__(self) -> None:
        self.cpu = 0.0
        self.queued = 0.0
        self.runnable = False
        self.busy_now = False
        self.written = 0
        self.retransmitted = 0

    def written_bytes(self, pids: Iterable[int]) -> int:
        return self.written

    def retransmits(self, pids: Iterable[int]) -> int:
        return self.retransmitted

    def run_queue(self, pids: Iterable[int]) -> tuple[float, bool]:
        return self.queued, self.runnable

    def cpu_seconds(self, pids: Iterable[int]) -> float:
        return self.cpu

    def busy(self, pids: Iterable[int]) -> bool:
        return self.busy_now


def test_a_job_spinning_its_cpu_is_held_then_reported() -> None:
    probe = FakeProbe()
    judge = verdicts.HangJudge(probe, lambda job_id: [1234])
    key = ("j", 1)
    judge.sample([key], 100.0)
    probe.cpu = 1.0  # a core's worth over the next second
    judge.sample([key], 101.0)
    judge.suspect(hang())
    assert judge.verdicts({key: 85.0}, lambda k: False, 101.0) == []  # busy: held
    (reported,) = judge.verdicts({key: 85.0}, lambda k: False, 120.0)
    assert reported.evidence["held_s"] == 20.0 and reported.evidence["cpu_cores"] == 1.0
    assert judge.verdicts({key: 85.0}, lambda k: False, 121.0) == []  # reported once


def test_a_crawling_collective_is_held_and_reported_once_it_stops_sending() -> None:
    probe = FakeProbe()
    judge = verdicts.HangJudge(probe, lambda job_id: [1234])
    key = ("j", 1)
    judge.suspect(hang())
    for tick in range(21):  # 1 MiB/s over two seconds
        probe.written = tick * MIB // 10
        judge.sample([key], 99.0 + tick / 10)
    assert judge.verdicts({key: 85.0}, lambda k: False, 101.0) == []  # sending: held
    for tick in range(1, 21):  # then nothing for two seconds: the link is gone
        judge.sample([key], 101.0 + tick / 10)
    assert len(judge.verdicts({key: 85.0}, lambda k: False, 103.0)) == 1


@pytest.mark.parametrize(("peers_answer", "held"), [(True, True), (False, False)])
def test_retransmissions_hold_a_hang_while_every_peer_answers(peers_answer: bool, held: bool) -> None:
    """A lossy link: TCP retransmits while the job stalls. Held while every peer answers
    (the data is still getting through); a peer that does not answer is the cause: reported."""
    probe = FakeProbe()
    asked: list[verdicts.Key] = []

    def reaches(key: verdicts.Key) -> bool:
        asked.append(key)
        return peers_answer

    judge = verdicts.HangJudge(probe, lambda job_id: [1234], reaches_peers=reaches)
    key = ("j", 1)
    for tick in range(21):
        probe.retransmitted = tick
        judge.sample([key], 99.0 + tick / 10)
    judge.suspect(hang())
    assert (judge.verdicts({key: 85.0}, lambda k: False, 101.0) == []) is held
    assert asked == [key]


def test_a_sleeping_job_is_reported_at_once_and_a_resolved_one_never() -> None:
    probe = FakeProbe()
    judge = verdicts.HangJudge(probe, lambda job_id: [1234])
    judge.suspect(hang())
    assert len(judge.verdicts({("j", 1): 85.0}, lambda k: False, 101.0)) == 1
    judge.suspect(hang())
    assert judge.verdicts({("j", 1): 99.0}, lambda k: False, 101.0) == []
    assert judge.verdicts({("j", 1): 85.0}, lambda k: False, 130.0) == []  # dropped for good


def iteration(rank: int, number: int) -> pb.IterationReport:
    return pb.IterationReport(job_id="j", generation=1, rank=rank, iteration=number, seconds=0.1)


def test_the_watch_flushes_the_first_report_and_knows_when_a_job_finishes() -> None:
    watch = JobWatch(MonitorSettings())
    assert watch.observe(("j", 1), iteration(0, 1), 1.0) is None  # not watched here
    watch.start("j", 1, [0, 1], last_iteration=3, now=0.0)
    assert watch.observe(("j", 1), iteration(0, 1), 1.0) is True  # ends a transition: at once
    assert watch.observe(("j", 1), iteration(0, 2), 2.0) is False
    with pytest.raises(ReportRejected):
        watch.observe(("j", 1), iteration(0, 2), 2.5)  # not a next iteration
    assert not watch.quiet_expected(("j", 1))
    watch.observe(("j", 1), iteration(0, 3), 3.0)
    assert watch.quiet_expected(("j", 1)) and watch.last_iteration_of(("j", 1), 0) == 3


def test_a_rank_s_last_iteration_outlives_its_job_s_watch() -> None:
    # Two ranks exit at once on two threads: the first exit handled finds no rank running
    # and forgets the job; the second must still report how far its rank got, or the
    # coordinator reads a clean exit before the last iteration (a program error).
    watch = JobWatch(MonitorSettings())
    watch.start("j", 1, [0, 1], last_iteration=3, now=0.0)
    for number in (1, 2, 3):
        for rank in (0, 1):
            watch.observe(("j", 1), iteration(rank, number), float(number))
    watch.forget("j")
    assert [watch.last_iteration_of(("j", 1), rank) for rank in (0, 1)] == [3, 3]
    assert watch.quiet_expected(("j", 1))
    for generation in range(2, ENDED_KEPT + 2):  # a bounded memory: the oldest goes first
        watch.start("j", generation, [0], last_iteration=3, now=0.0)
        watch.forget("j")
    assert watch.last_iteration_of(("j", 1), 0) == 0


def test_a_job_awaiting_a_decision_is_quiet_until_it_iterates() -> None:
    watch = JobWatch(MonitorSettings())
    watch.start("j", 1, [0], last_iteration=0, now=0.0)
    watch.start("j", 2, [0], last_iteration=0, now=0.0)
    watch.awaiting_decision(("j", 1))
    assert watch.quiet_expected(("j", 1)) and not watch.quiet_expected(("j", 2))
    watch.observe(("j", 1), iteration(0, 1), 1.0)
    assert not watch.quiet_expected(("j", 1))
    watch.forget("j", max_generation=1)
    assert watch.quiet_expected(("j", 1)) and not watch.quiet_expected(("j", 2))
    watch.forget("j")
    assert watch.check(5.0) == ([], {}, [])
