"""A helper process started through unicron.lifetime dies with its parent, even one that is
SIGKILLed (Megatron's checkpoint writer would otherwise leave its manager running)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PARENT = """
import os, signal, sys
from unicron import lifetime

if __name__ == "__main__":
    manager = lifetime.start_manager()
    queue = manager.Queue()  # the manager serves
    queue.put(1)
    print(manager._process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone but for its parent's wait (init reaps it).
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_manager_dies_with_its_killed_parent(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert done.returncode == -9, done.stderr[-2000:]
    manager = int(done.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(manager) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(manager), f"the manager {manager} outlived its killed parent"
