"""What the hang detector reads about a job's trainer processes from /proc and psutil: CPU
time, bytes written, run-queue waits, whether a thread is runnable, whether a signal is caught. Small and
side-effect free, so the verdicts in verdicts.py can be fed by a fake in tests."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterable

import psutil


def catches(pid: int, sig: signal.Signals) -> bool:
    """Whether a process has a handler installed for sig (Linux: SigCgt in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (sig - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


def run_queue(pid: int) -> tuple[float, bool]:
    """Seconds the process's threads have waited for a CPU (/proc/<pid>/task/*/schedstat,
    second field, in ns), and whether one of them is runnable now (state R in its stat);
    (0, False) for a process that is gone."""
    waited, runnable = 0, False
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0, False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/schedstat") as stat:
                waited += int(stat.read().split()[1])
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                # The state follows the command name, which is in parentheses and may hold spaces.
                runnable = runnable or stat.read().rpartition(")")[2].split()[0] == "R"
        except (OSError, IndexError, ValueError):
            continue
    return waited / 1e9, runnable


def status(pid: int) -> str:
    """psutil's status of the process ("gone" when there is none)."""
    try:
        return str(psutil.Process(pid).status())
    except psutil.Error:
        return "gone"


def tcp_retransmits(snmp: str) -> int:
    """RetransSegs from a /proc/net/snmp text (a "Tcp:" line of names, then one of values)."""
    rows = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Tcp:")]
    if len(rows) >= 2 and "RetransSegs" in rows[0]:
        return int(rows[1][rows[0].index("RetransSegs")])
    return 0


class ProcessProbe:
    """The readings of a set of processes (a job's trainers on this node)."""

    def run_queue(self, pids: Iterable[int]) -> tuple[float, bool]:
        """Their threads' run-queue seconds together, and whether any thread is runnable."""
        waited, runnable = 0.0, False
        for pid in pids:
            seconds, queued = run_queue(pid)
            waited, runnable = waited + seconds, runnable or queued
        return waited, runnable

    def cpu_seconds(self, pids: Iterable[int]) -> float:
        total = 0.0
        for pid in pids:
            try:
                times = psutil.Process(pid).cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def written_bytes(self, pids: Iterable[int]) -> int:
        """Bytes they wrote, to files and sockets (Linux write_chars: gloo's sends are
        writes), since they started."""
        total = 0
        for pid in pids:
            try:
                total += psutil.Process(pid).io_counters().write_chars
            except (psutil.Error, AttributeError):
                pass
        return total

    def retransmits(self, pids: Iterable[int]) -> int:
        """TCP segments retransmitted by the network namespace of the first of them that
        is alive (its host's, /proc/<pid>/net/snmp RetransSegs), since boot; 0 unknown."""
        for pid in pids:
            try:
                with open(f"/proc/{pid}/net/snmp") as snmp:
                    return tcp_retransmits(snmp.read())
            except OSError:
                continue
        return 0

    def busy(self, pids: Iterable[int]) -> bool:
        """Whether one is running or waiting for the CPU or a disk now. A trainer starved by
        other load is runnable with little CPU to show for it, and one writing a checkpoint
        waits on the disk; a hung one sleeps in its collective or is stopped."""
        return any(status(pid) in (psutil.STATUS_RUNNING, psutil.STATUS_DISK_SLEEP) for pid in pids)
