"""The agent's hang verdicts. The monitor (unicron/monitor.py) suspects a hang when no
iteration comes within its threshold; before the agent reports it, the verdict looks at
what the job's trainers do: a job starved by other load, or busy on its CPU, is more likely
slow than hung, and waits a little longer. The rules are pure functions (`judge`,
`starved`, `cpu_rate`); `HangJudge` keeps what they compare between looks and reads the
processes through a `Probe` (procstat.ProcessProbe, or a fake in tests)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
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


class Probe(Protocol):
    def run_queue(self, pids: Iterable[int]) -> tuple[float, bool]: ...

    def cpu_seconds(self, pids: Iterable[int]) -> float: ...

    def busy(self, pids: Iterable[int]) -> bool: ...


def judge(finding: Finding, last_progress: float | None, ignored: bool, busy: bool, now: float) -> bool | None:
    """True: report the hang; False: it resolved itself (an iteration came after all, or
    the job is no longer watched); None: wait, the trainers look busy or starved."""
    threshold = finding.evidence.get("threshold_s", 0.0)
    if ignored or last_progress is None or last_progress > finding.first_seen - threshold:
        return False
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


def cpu_rate(previous: tuple[float, float] | None, now: float, cpu: float) -> float | None:
    """Cores used since the previous (when, cpu seconds) sample; None without one."""
    if previous is None or now <= previous[0]:
        return None
    return (cpu - previous[1]) / (now - previous[0])


class HangJudge:
    def __init__(self, probe: Probe, pids: Callable[[str], Iterable[int]]) -> None:
        """`pids(job_id)`: the job's trainer processes on this node."""
        self._probe = probe
        self._pids = pids
        self._suspected: dict[Key, Finding] = {}
        self._wait_marks: dict[Key, tuple[float, float]] = {}  # (when, run-queue seconds)
        self._cpu_last: dict[Key, tuple[float, float]] = {}  # (when, cpu seconds)
        self._cpu_rates: dict[Key, float] = {}  # cores, over the last sample

    def sample_cpu(self, keys: list[Key], now: float) -> None:
        """The CPU rate of each watched job generation's trainers; others are forgotten."""
        for key in keys:
            previous = self._cpu_last.get(key)
            if previous is not None and now - previous[0] < MIN_RATE_WINDOW_S:
                continue  # an early wake-up
            cpu = self._probe.cpu_seconds(self._pids(key[0]))
            self._cpu_last[key] = (now, cpu)
            rate = cpu_rate(previous, now, cpu)
            if rate is not None:
                self._cpu_rates[key] = rate
        for stale in set(self._cpu_last) - set(keys):
            self._cpu_last.pop(stale, None)
            self._cpu_rates.pop(stale, None)

    def suspect(self, finding: Finding) -> None:
        self._suspected[(finding.job_id, finding.generation)] = finding

    def verdicts(self, progress: dict[Key, float], ignored: Callable[[Key], bool], now: float) -> list[Finding]:
        """The suspected hangs that are hangs now, each with its evidence; the resolved ones
        are dropped, the others wait for the next look."""
        hangs = []
        for key, finding in list(self._suspected.items()):
            last, skip = progress.get(key), ignored(key)
            busy = False
            if not skip and last is not None:
                busy = self._starved(key, now) or self._cpu_rates.get(key, 0.0) > BUSY_CORES
                busy = busy or self._probe.busy(self._pids(key[0]))
            verdict = judge(finding, last, skip, busy, now)
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
