"""The agent's hang verdicts. The monitor (unicron/monitor.py) suspects a hang when no
iteration comes within its threshold; before the agent reports it, the verdict looks at
what the job's trainers do: a job starved by other load, or busy on its CPU, is more likely
slow than hung, and waits a little longer; one whose collective still moves (crawling over
a slow or lossy link) waits longer still. The rules are pure functions
(`judge`, `starved`, `rate`); `HangJudge` keeps what they compare between looks and reads the
processes through a `Probe` (procstat.ProcessProbe, or a fake in tests)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from unicron.monitor import Finding

Key = tuple[str, int]  # (job, generation)

# A trainer that keeps burning CPU while no iteration finishes is more likely starved or
# slow than hung (a hung collective sleeps, a stopped process does not run): its hang
# verdict waits, but never longer than this many thresholds, since a GPU that hangs in
# NCCL can spin the CPU too.
HANG_HOLD_THRESHOLDS = 3.0
BUSY_CORES = 0.25
# A suspected hang whose trainers' threads together waited in the CPU run queue this many
# seconds per second is held: a starved compute thread waits nearly all the time, while a
# hung job's threads sleep and only its background threads queue now and then.
STARVED_WAIT = 0.25
# A CPU rate over less than this is clock-tick noise.
MIN_RATE_WINDOW_S = 0.05
# A collective that still moves, however slowly, is not hung: its hang verdict waits, up to
# MOVING_HOLD_THRESHOLDS thresholds (past that the collective's own timeout is due), and is
# given at the first look that finds it still. It moves when
# - its trainers keep writing more than SENDING_BYTES_PER_S since the job's last iteration,
#   in both halves of what was sampled (a slow link drains their sends slowly; a hung
#   collective sends nothing, every rank waiting to receive, and a pulled cable stops the
#   sends once the socket's buffer is full: one burst, then nothing), or
# - their host's TCP retransmitted within MOVING_WINDOW_S while every peer of the job still
#   answers (a lossy link: the data sits in the send buffers while TCP recovers it; a peer
#   that does not answer is the stall's cause, reported at once).
SENDING_BYTES_PER_S = 64 * 1024
MOVING_HOLD_THRESHOLDS = 10.0
# Long enough to span a lossy link's retransmission backoff (0.2 s, 0.4 s, 0.8 s).
MOVING_WINDOW_S = 2.0
# Less sampled time than this says nothing.
MIN_SPAN_S = 0.3

Samples = Sequence[tuple[float, float]]


def _since(samples: Samples, now: float, since: float) -> list[tuple[float, float]]:
    """The samples after the cutoff, led by the last one at or before it (the baseline)."""
    cutoff = max(now - MOVING_WINDOW_S, since)
    before = [s for s in samples if s[0] <= cutoff]
    return before[-1:] + [s for s in samples if s[0] > cutoff]


def _rate(samples: Samples) -> float:
    return (samples[-1][1] - samples[0][1]) / (samples[-1][0] - samples[0][0])


def sending(samples: Samples, now: float, since: float = 0.0) -> bool:
    """Whether (when, bytes written) samples, oldest first, show more than
    SENDING_BYTES_PER_S since `since` (within MOVING_WINDOW_S), in each half of it."""
    recent = _since(samples, now, since)
    if len(recent) < 3 or recent[-1][0] - recent[0][0] < MIN_SPAN_S:
        return False
    middle = (recent[0][0] + recent[-1][0]) / 2
    first = [s for s in recent if s[0] <= middle]
    second = [s for s in recent if s[0] >= first[-1][0]]
    return all(len(half) >= 2 and _rate(half) > SENDING_BYTES_PER_S for half in (first, second))


def grew(samples: Samples, now: float, since: float = 0.0) -> bool:
    """Whether (when, count) samples grew since `since` (within MOVING_WINDOW_S)."""
    recent = _since(samples, now, since)
    return len(recent) >= 2 and recent[-1][1] > recent[0][1]


class Probe(Protocol):
    def run_queue(self, pids: Iterable[int]) -> tuple[float, bool]: ...

    def cpu_seconds(self, pids: Iterable[int]) -> float: ...

    def busy(self, pids: Iterable[int]) -> bool: ...

    def written_bytes(self, pids: Iterable[int]) -> int: ...

    def retransmits(self, pids: Iterable[int]) -> int: ...


def judge(
    finding: Finding, last_progress: float | None, ignored: bool, busy: bool, now: float, moving: bool = False
) -> bool | None:
    """True: report the hang; False: it resolved itself (an iteration came after all, or
    the job is no longer watched); None: wait, the trainers look busy or starved, or their
    collective still moves."""
    threshold = finding.evidence.get("threshold_s", 0.0)
    if ignored or last_progress is None or last_progress > finding.first_seen - threshold:
        return False
    if moving and now < finding.first_seen + (MOVING_HOLD_THRESHOLDS - 1) * threshold:
        return None
    if busy and now < finding.first_seen + (HANG_HOLD_THRESHOLDS - 1) * threshold:
        return None
    return True


def starved(mark: tuple[float, float] | None, now: float, waited: float, runnable: bool) -> bool:
    """Whether the trainers wait for a CPU: at the first look (no `mark` of (when, waited)
    yet), whether a thread is runnable; later, whether their threads waited in the run
    queue more than STARVED_WAIT seconds per second since the mark."""
    if mark is None:
        return runnable
    return now > mark[0] and (waited - mark[1]) / (now - mark[0]) > STARVED_WAIT


def rate(previous: tuple[float, float] | None, now: float, amount: float) -> float | None:
    """Per second since the previous (when, amount) sample (cores from CPU seconds, bytes
    per second from bytes written); None without one."""
    if previous is None or now <= previous[0]:
        return None
    return (amount - previous[1]) / (now - previous[0])


class HangJudge:
    def __init__(
        self,
        probe: Probe,
        pids: Callable[[str], Iterable[int]],
        reaches_peers: Callable[[Key], bool] = lambda key: True,
    ) -> None:
        """`pids(job_id)`: the job's trainer processes on this node; `reaches_peers(key)`:
        whether every other node of that job generation answers (services/agent/peers.py)."""
        self._probe = probe
        self._pids = pids
        self._reaches_peers = reaches_peers
        self._suspected: dict[Key, Finding] = {}
        self._wait_marks: dict[Key, tuple[float, float]] = {}  # (when, run-queue seconds)
        self._cpu_last: dict[Key, tuple[float, float]] = {}  # (when, cpu seconds)
        self._cpu_rates: dict[Key, float] = {}  # cores, over the last sample
        self._sent: dict[Key, deque[tuple[float, float]]] = {}  # (when, bytes written)
        self._retransmitted: dict[Key, deque[tuple[float, float]]] = {}  # (when, TCP retransmits)

    def sample(self, keys: list[Key], now: float) -> None:
        """The CPU and send rates of each watched job generation's trainers; others are
        forgotten."""
        for key in keys:
            previous = self._cpu_last.get(key)
            if previous is None or now - previous[0] >= MIN_RATE_WINDOW_S:  # not an early wake-up
                cpu = self._probe.cpu_seconds(self._pids(key[0]))
                self._cpu_last[key] = (now, cpu)
                cores = rate(previous, now, cpu)
                if cores is not None:
                    self._cpu_rates[key] = cores
            pids = list(self._pids(key[0]))
            for table, amount in (
                (self._sent, self._probe.written_bytes(pids)),
                (self._retransmitted, self._probe.retransmits(pids)),
            ):
                samples = table.setdefault(key, deque())
                samples.append((now, float(amount)))
                while samples and samples[0][0] < now - 2 * MOVING_WINDOW_S:
                    samples.popleft()
        for stale in set(self._cpu_last) - set(keys):
            self._cpu_last.pop(stale, None)
            self._cpu_rates.pop(stale, None)
        for table in (self._sent, self._retransmitted):
            for stale in set(table) - set(keys):
                del table[stale]

    def suspect(self, finding: Finding) -> None:
        self._suspected[(finding.job_id, finding.generation)] = finding

    def verdicts(self, progress: dict[Key, float], ignored: Callable[[Key], bool], now: float) -> list[Finding]:
        """The suspected hangs that are hangs now, each with its evidence; the resolved ones
        are dropped, the others wait for the next look."""
        hangs = []
        for key, finding in list(self._suspected.items()):
            last, skip = progress.get(key), ignored(key)
            busy = moving = False
            if not skip and last is not None:
                busy = self._starved(key, now) or self._cpu_rates.get(key, 0.0) > BUSY_CORES
                busy = busy or self._probe.busy(self._pids(key[0]))
                moving = sending(self._sent.get(key, ()), now, last)
                # Any host of a lossy link's job retransmits now and then, not necessarily
                # since this stall began: the window alone counts here.
                recovering = grew(self._retransmitted.get(key, ()), now)
                moving = moving or (recovering and self._reaches_peers(key))
            verdict = judge(finding, last, skip, busy, now, moving)
            if verdict is None:
                continue
            del self._suspected[key]
            self._wait_marks.pop(key, None)
            if verdict:
                finding.evidence["held_s"] = max(0.0, now - finding.first_seen)
                finding.evidence["cpu_cores"] = self._cpu_rates.get(key, 0.0)
                hangs.append(finding)
        return hangs

    def _starved(self, key: Key, now: float) -> bool:
        waited, runnable = self._probe.run_queue(self._pids(key[0]))
        mark = self._wait_marks.get(key)
        self._wait_marks[key] = (now, waited)
        return starved(mark, now, waited, runnable)
