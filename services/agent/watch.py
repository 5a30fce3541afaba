"""What the agent keeps about each job generation it runs: its statistical monitor and the
flags that change how its silence and its reports are read. One record per (job,
generation), one lock, instead of a set per flag."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from unicron.monitor import Finding, JobMonitor, MonitorSettings
from unicron.v1 import node_service_pb2 as pb

Key = tuple[str, int]  # (job, generation)
# Generations forgotten whose ranks' last iterations are still answered: a rank's exit can
# be reported after its job's watch was dropped (its peer's exit, on another thread, saw no
# rank left running), and it must still say how far it got.
ENDED_KEPT = 256


@dataclass
class Watched:
    monitor: JobMonitor
    # The job's last iteration (0: unknown): once a rank reaches it the job is tearing
    # down, not hung, and its silence means nothing.
    last_iteration: int = 0
    finishing: bool = False
    # A trainer reported an error and waits for the coordinator's remedy: no hang verdicts
    # until an iteration completes again.
    awaiting_decision: bool = False
    # The next iteration ends a transition (a start, a reattempt, a reform): its report
    # skips the batching delay, since the coordinator counts the recovery until it hears.
    flush_next: bool = True
    ranks: list[int] = field(default_factory=list)
    # The job's other nodes and their agents' addresses, for the reachability check of a
    # hang (peers.py).
    peers: dict[str, str] = field(default_factory=dict)

    @property
    def quiet_expected(self) -> bool:
        """Whether the job may be silent without that being a hang."""
        return self.finishing or self.awaiting_decision


class JobWatch:
    def __init__(self, settings: MonitorSettings) -> None:
        self._settings = settings
        self._jobs: dict[Key, Watched] = {}
        self._ended: OrderedDict[Key, dict[int, int]] = OrderedDict()
        self._lock = threading.Lock()

    def start(
        self,
        job_id: str,
        generation: int,
        ranks: Iterable[int],
        last_iteration: int,
        now: float,
        peers: dict[str, str] | None = None,
    ) -> None:
        ranks = list(ranks)
        monitor = JobMonitor(job_id, generation, ranks, self._settings, now)
        with self._lock:
            self._ended.pop((job_id, generation), None)
            self._jobs[(job_id, generation)] = Watched(monitor, last_iteration, ranks=ranks, peers=dict(peers or {}))

    def peers_of(self, key: Key) -> dict[str, str]:
        with self._lock:
            watched = self._jobs.get(key)
            return dict(watched.peers) if watched is not None else {}

    def observe(self, key: Key, report: pb.IterationReport, now: float) -> bool | None:
        """Feeds a trainer's iteration to its monitor (ReportRejected when it is not a valid
        next one); returns whether it should reach the coordinator at once, None when the
        generation is not watched here."""
        with self._lock:
            watched = self._jobs.get(key)
            if watched is None:
                return None
            watched.monitor.observe(report.rank, report.iteration, report.seconds, report.compute_seconds, now)
            if report.iteration >= watched.last_iteration > 0:
                watched.finishing = True
            watched.awaiting_decision = False
            flush, watched.flush_next = watched.flush_next, False
            return flush

    def awaiting_decision(self, key: Key) -> None:
        with self._lock:
            watched = self._jobs.get(key)
            if watched is not None:
                watched.awaiting_decision = True

    def check(self, now: float) -> tuple[list[Finding], dict[Key, float], list[float]]:
        """The monitors' findings of the generations that may not be silent, every watched
        generation's last progress, and when the next hang verdicts fall due."""
        with self._lock:
            watched = [w for w in self._jobs.values() if not w.quiet_expected]
            findings = [finding for w in watched for finding in w.monitor.check(now)]
            progress = {key: w.monitor.last_progress for key, w in self._jobs.items()}
            due = [at for w in watched if (at := w.monitor.hang_due_at()) is not None]
        return findings, progress, due

    def quiet_expected(self, key: Key) -> bool:
        """Whether a generation may be silent: finishing, waiting for a decision, or no
        longer watched at all."""
        with self._lock:
            watched = self._jobs.get(key)
            return watched is None or watched.quiet_expected

    def last_iteration_of(self, key: Key, rank: int) -> int:
        """The last iteration `rank` reported in this generation, also after forget (0: none)."""
        with self._lock:
            watched = self._jobs.get(key)
            if watched is not None:
                return watched.monitor.last_iteration_of(rank)
            return self._ended.get(key, {}).get(rank, 0)

    def forget(self, job_id: str, max_generation: int = 0) -> None:
        """Drops the job's generations up to max_generation (0: all of them)."""
        with self._lock:
            for key in [k for k in self._jobs if k[0] == job_id and (not max_generation or k[1] <= max_generation)]:
                watched = self._jobs.pop(key)
                self._ended[key] = {rank: watched.monitor.last_iteration_of(rank) for rank in watched.ranks}
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
