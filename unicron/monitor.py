"""Online statistical monitoring of one job generation's training iterations (docs/architecture.md: Detection).

Everything is derived from the iteration reports trainers already send after each
iteration, so detection costs the training loop no collective and no GPU work. The clock
is always passed in, which keeps every verdict reproducible in tests.

Task hang: after a warm-up, no new iteration within max(floor_s, k x the robust mean
iteration time). Straggler: a rank whose robust pre-all-reduce compute time is well above
the other ranks'. Both come from bounded windows, so a flood of reports costs O(1) each.

A report that is malformed (negative or non-finite durations, an iteration number that does
not advance, an unknown rank) is rejected before it touches any state: bad input can delay
a verdict but never manufactures one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from unicron.v1 import common_pb2

# Iteration numbers remembered to tell a rank's report of an iteration another rank already
# finished (same job event) from a genuinely new one. Ranks of a synchronous job are at most
# an iteration or two apart, so this only needs to exceed that by a wide margin.
_RECENT_ITERATIONS = 256


def _require(condition: bool, field: str, problem: str) -> None:
    if not condition:
        raise ValueError(f"{field}: {problem}")


def _finite(value: float) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class MonitorSettings:
    # Hang threshold as a multiple of the robust mean iteration time.
    k: float = 3.0
    # Never call a hang sooner than this after the last iteration: with very fast iterations,
    # k x mean falls below the jitter of report delivery and scheduling. Below 1 s, so that
    # the detection target (k x mean + 1 s) holds with the report's delivery on top; the
    # agent holds back the verdict while a trainer is runnable (starved by other load, not
    # hung) or waits on a disk.
    floor_s: float = 0.75
    # No hang verdict before this many iterations finished: the first steps include
    # rendezvous, compilation and allocator warm-up, and say nothing about the steady state.
    warmup_iterations: int = 3
    # Iterations kept for the robust statistics (per job for iteration time, per rank for
    # compute time).
    window: int = 20
    # A rank whose robust compute time exceeds the other ranks' median by this factor.
    straggler_ratio: float = 1.5
    # Compute samples a rank needs before it can be scored (or serve as a reference).
    straggler_min_iterations: int = 5
    # ...and by at least this many seconds: at millisecond scale, ratios are scheduler noise.
    straggler_min_excess_s: float = 0.1

    def __post_init__(self) -> None:
        _require(_finite(self.k) and self.k > 1.0, "k", "must be a finite number greater than 1")
        _require(_finite(self.floor_s) and self.floor_s >= 0.0, "floor_s", "must be a finite number >= 0")
        # At least one finished iteration is needed to have a mean to multiply.
        _require(self.warmup_iterations >= 1, "warmup_iterations", "must be at least 1")
        _require(self.window >= 1, "window", "must be at least 1")
        _require(
            _finite(self.straggler_ratio) and self.straggler_ratio > 1.0,
            "straggler_ratio",
            "must be a finite number greater than 1",
        )
        _require(
            _finite(self.straggler_min_excess_s) and self.straggler_min_excess_s >= 0.0,
            "straggler_min_excess_s",
            "must be a finite number >= 0",
        )
        _require(
            1 <= self.straggler_min_iterations <= self.window,
            "straggler_min_iterations",
            f"must be between 1 and window ({self.window})",
        )


_FINDING_KINDS = frozenset({common_pb2.FAILURE_KIND_TASK_HANG, common_pb2.FAILURE_KIND_STRAGGLER})


@dataclass(frozen=True)
class Finding:
    kind: common_pb2.FailureKind
    job_id: str
    generation: int
    rank: int | None  # None for a job-wide hang
    first_seen: float  # when the condition became true, not when a check noticed it
    message: str
    evidence: dict[str, float]

    def __post_init__(self) -> None:
        _require(self.kind in _FINDING_KINDS, "kind", "must be FAILURE_KIND_TASK_HANG or FAILURE_KIND_STRAGGLER")
        _require(bool(self.job_id), "job_id", "is required")
        _require(self.generation >= 0, "generation", "must not be negative")
        _require(_finite(self.first_seen), "first_seen", "must be finite")


class ReportRejected(ValueError):
    """An iteration report that cannot be true; the monitor's state is left untouched."""


def robust_mean(samples: Sequence[float]) -> float:
    """Interquartile mean: the mean of the middle half of the sorted samples (the median
    below four samples).

    Chosen over the plain median because it still uses half the window, so a job whose
    iterations alternate between two durations (e.g. gradient accumulation boundaries) gets
    a mean between them instead of the faster mode, which would put k x mean too close to
    the slower one. Chosen over the plain mean because up to a quarter of the window on
    either side (a checkpoint, an evaluation step, a garbage-collection pause) is discarded
    outright instead of inflating the hang threshold.
    """
    _require(len(samples) > 0, "samples", "must not be empty")
    ordered = sorted(samples)
    n = len(ordered)
    if n < 4:
        mid = n // 2
        return ordered[mid] if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    cut = n // 4
    middle = ordered[cut : n - cut]
    return math.fsum(middle) / len(middle)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _median_without(ordered: Sequence[float], index: int) -> float:
    """Median of the sorted `ordered` with the element at `index` left out, in O(1)."""
    n = len(ordered) - 1

    def at(j: int) -> float:
        return ordered[j] if j < index else ordered[j + 1]

    mid = n // 2
    return at(mid) if n % 2 else (at(mid - 1) + at(mid)) / 2


@dataclass(frozen=True)
class _Score:
    score: float
    rank_compute_s: float
    median_compute_s: float
    samples: int


class JobMonitor:
    """One job generation's iterations as seen by one observer (an agent sees its node's ranks).

    Not thread-safe: the owner serializes observe/check (the agent holds its monitors lock).

    The job's progress clock is the time the newest iteration was first completed by any
    rank: ranks of a synchronous job finish an iteration within one collective of each
    other, so the later ranks' reports of it are the same event and do not move the clock.
    An iteration number is "new" if no rank reported it among the last few hundred, rather
    than if it exceeds the highest number seen, so one rank claiming a wildly high number
    cannot freeze the clock for the others and fake a hang.
    """

    def __init__(
        self, job_id: str, generation: int, ranks: Iterable[int], settings: MonitorSettings, started_at: float
    ) -> None:
        rank_set = frozenset(ranks)
        _require(bool(job_id), "job_id", "is required")
        _require(generation >= 0, "generation", "must not be negative")
        _require(bool(rank_set), "ranks", "must name at least one rank")
        _require(all(r >= 0 for r in rank_set), "ranks", "must not be negative")
        _require(_finite(started_at), "started_at", "must be finite")
        self.job_id = job_id
        self.generation = generation
        self.settings = settings
        self.ranks = rank_set
        self.started_at = started_at
        # One duration sample per new iteration (not per report), so the window spans
        # `window` iterations however many ranks this observer sees.
        self._samples: deque[float] = deque(maxlen=settings.window)
        self._mean: float | None = None  # cache of robust_mean(_samples); None = stale or empty
        self._compute: dict[int, deque[float]] = {r: deque(maxlen=settings.window) for r in rank_set}
        self._last_iteration: dict[int, int] = {}
        self._recent: set[int] = set()
        self._recent_order: deque[int] = deque()
        self._frontier: int | None = None
        self._completed = 0
        self._last_progress = started_at
        self._last_report_at = started_at
        self._hang_reported = False
        self._stragglers: set[int] = set()

    # --- input ---------------------------------------------------------------------------

    def last_iteration_of(self, rank: int) -> int:
        """The last iteration ``rank`` reported finishing, 0 if none."""
        return self._last_iteration.get(rank, 0)

    def observe(self, rank: int, iteration: int, seconds: float, compute_seconds: float, now: float) -> None:
        """Records that `rank` finished `iteration`, which took `seconds` of wall time and
        `compute_seconds` before entering the gradient all-reduce (0 if unknown).

        Raises ReportRejected, changing nothing, if the report cannot be true.
        """
        self._validate(rank, iteration, seconds, compute_seconds, now)
        self._last_iteration[rank] = iteration
        self._last_report_at = max(self._last_report_at, now)
        # Warm-up iterations (rendezvous, first allocations) say nothing about a rank's speed.
        if compute_seconds > 0 and iteration > self.settings.warmup_iterations:
            self._compute[rank].append(compute_seconds)
        if iteration in self._recent:
            return
        sample = seconds
        if self._frontier is not None and iteration == self._frontier + 1:
            # The hang check measures silence on the observer's clock, so the expected silence
            # must include what the trainer's own timer may leave out (data loading, logging,
            # report delivery): take the observed spacing when it is longer.
            sample = max(seconds, now - self._last_progress)
        self._remember(iteration)
        self._frontier = iteration if self._frontier is None else max(self._frontier, iteration)
        self._completed += 1
        self._samples.append(sample)
        self._mean = None
        # max(): reports raced through different threads may arrive with slightly older stamps.
        self._last_progress = max(self._last_progress, now)
        self._hang_reported = False

    def _validate(self, rank: int, iteration: int, seconds: float, compute_seconds: float, now: float) -> None:
        if rank not in self.ranks:
            raise ReportRejected(f"rank: {rank} is not a rank of job {self.job_id} here")
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise ReportRejected(f"iteration: must be a non-negative integer, got {iteration!r}")
        if not _finite(seconds) or seconds < 0:
            raise ReportRejected(f"seconds: must be a finite number >= 0, got {seconds!r}")
        if not _finite(compute_seconds) or compute_seconds < 0:
            raise ReportRejected(f"compute_seconds: must be a finite number >= 0, got {compute_seconds!r}")
        if not _finite(now):
            raise ReportRejected(f"now: must be finite, got {now!r}")
        previous = self._last_iteration.get(rank)
        if previous is not None and iteration <= previous:
            raise ReportRejected(f"iteration: {iteration} does not advance rank {rank} past {previous}")

    def _remember(self, iteration: int) -> None:
        self._recent.add(iteration)
        self._recent_order.append(iteration)
        if len(self._recent_order) > _RECENT_ITERATIONS:
            self._recent.discard(self._recent_order.popleft())

    # --- verdicts ------------------------------------------------------------------------

    def check(self, now: float) -> list[Finding]:
        """New findings at `now`: a hang once per silent episode, a straggler once per rank
        until it recovers."""
        findings: list[Finding] = []
        hang = self._check_hang(now)
        if hang is not None:
            findings.append(hang)
        findings.extend(self._check_stragglers())
        return findings

    def hang_due_at(self) -> float | None:
        """When a hang verdict becomes due if no iteration finishes first (None: not armed),
        so an observer can wake exactly then instead of polling."""
        threshold = self._hang_threshold()
        return None if threshold is None else self._last_progress + threshold

    def _hang_threshold(self) -> float | None:
        if self._hang_reported or self._completed < self.settings.warmup_iterations:
            return None
        mean = self.mean_iteration_s
        if mean is None:  # unreachable while warmup_iterations >= 1; keeps the type honest
            return None
        return max(self.settings.floor_s, self.settings.k * mean)

    def _check_hang(self, now: float) -> Finding | None:
        threshold = self._hang_threshold()
        mean = self.mean_iteration_s
        if threshold is None or mean is None:
            return None
        scaled = self.settings.k * mean
        silent = now - self._last_progress
        if not silent > threshold:
            return None
        self._hang_reported = True
        if scaled >= self.settings.floor_s:
            why = f"{self.settings.k:g} x mean {mean:.2f}s = {threshold:.2f}s"
        else:
            why = f"floor {threshold:.2f}s; {self.settings.k:g} x mean {mean:.2f}s = {scaled:.2f}s"
        return Finding(
            kind=common_pb2.FAILURE_KIND_TASK_HANG,
            job_id=self.job_id,
            generation=self.generation,
            rank=None,
            first_seen=self._last_progress + threshold,
            message=f"no iteration for {silent:.1f}s ({why})",
            evidence={
                "silent_s": silent,
                "mean_s": mean,
                "threshold_s": threshold,
                "last_iteration": float(self._frontier if self._frontier is not None else 0),
            },
        )

    def _check_stragglers(self) -> list[Finding]:
        findings: list[Finding] = []
        for rank, s in sorted(self._scores().items()):
            excess = s.rank_compute_s - s.median_compute_s
            if s.score <= self.settings.straggler_ratio or excess < self.settings.straggler_min_excess_s:
                self._stragglers.discard(rank)  # recovered: a later relapse is a new finding
                continue
            if rank in self._stragglers:
                continue
            self._stragglers.add(rank)
            findings.append(
                Finding(
                    kind=common_pb2.FAILURE_KIND_STRAGGLER,
                    job_id=self.job_id,
                    generation=self.generation,
                    rank=rank,
                    # The scores are a function of the reports alone, so the condition has
                    # held at least since the last report (possibly a little earlier, between
                    # two checks).
                    first_seen=self._last_report_at,
                    message=(
                        f"rank {rank} computes for {s.rank_compute_s:.3f}s per iteration, "
                        f"{s.score:.2f}x the other ranks' median {s.median_compute_s:.3f}s"
                    ),
                    evidence={
                        "score": s.score,
                        "rank_compute_s": s.rank_compute_s,
                        "median_compute_s": s.median_compute_s,
                        "samples": float(s.samples),
                    },
                )
            )
        return findings

    def _scores(self) -> dict[int, _Score]:
        """Score = a rank's median compute time over its window / the median of the other
        scored ranks' medians. Leaving the rank itself out of the reference matters with the
        few ranks one agent sees: with two ranks, a 2x-slow rank would otherwise score 1.33."""
        medians = {
            rank: _median(window)
            for rank, window in self._compute.items()
            if len(window) >= self.settings.straggler_min_iterations
        }
        if len(medians) < 2:
            return {}
        ordered = sorted(medians.values())
        position = {value: index for index, value in enumerate(ordered)}  # any index of equal values will do
        scores: dict[int, _Score] = {}
        for rank, own in medians.items():
            reference = _median_without(ordered, position[own])
            scores[rank] = _Score(own / reference, own, reference, len(self._compute[rank]))
        return scores

    # --- read-outs -----------------------------------------------------------------------

    def scores(self) -> dict[int, float]:
        """Current straggler score per rank (1.0 = typical), for ranks with at least
        straggler_min_iterations compute samples when at least two such ranks exist."""
        return {rank: s.score for rank, s in self._scores().items()}

    @property
    def mean_iteration_s(self) -> float | None:
        """Robust running mean iteration time (see robust_mean); None before any iteration."""
        if self._mean is None and self._samples:
            self._mean = robust_mean(self._samples)
        return self._mean

    @property
    def last_progress(self) -> float:
        """When the newest iteration was first completed (started_at before any)."""
        return self._last_progress

    @property
    def last_iteration(self) -> int | None:
        """Highest iteration number any rank reported, None before any."""
        return self._frontier

    @property
    def iterations_completed(self) -> int:
        """Distinct iterations observed (what warm-up counts)."""
        return self._completed
