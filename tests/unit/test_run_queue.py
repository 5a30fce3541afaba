"""The agent's starvation probe (services/agent/procstat.py `run_queue`), which tells a trainer
starved by other load (waiting for a CPU) from a hung one (asleep, or stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from services.agent.procstat import run_queue


def test_a_gone_process_has_waited_nothing() -> None:
    child = subprocess.Popen(["true"])
    child.wait()
    assert run_queue(child.pid) == (0.0, False)


def test_a_stopped_process_is_not_runnable() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(0.1)
        waited, runnable = run_queue(child.pid)
        assert waited >= 0.0 and runnable is False
        later, _ = run_queue(child.pid)
        assert later == waited  # a stopped process does not queue for the CPU
    finally:
        child.kill()
        child.wait()


def test_a_busy_process_is_runnable() -> None:
    child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        deadline = time.monotonic() + 5
        while not run_queue(child.pid)[1]:  # R while on a CPU or waiting for one
            assert time.monotonic() < deadline, "a busy loop never seen runnable"
            time.sleep(0.01)
    finally:
        child.kill()
        child.wait()
