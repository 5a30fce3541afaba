"""Warm spare trainers (services/agent/spares.py, services/trainer/spare.py) with a stand-in
spare program: the handover protocol, which launches a spare may serve, refilling, and the
supervisor's registry of which process runs which rank. The real spare (torch and Megatron
imported) runs in the end-to-end self-healing tests and in bench-transition."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.agent.spares import STATUS_FILE, SparePool
from services.agent.supervisor import REGISTRY_FILE, Supervisor, WorkerExit, WorkerKey
from unicron_dev.localcluster import ROOT

TRAINER = [sys.executable, "-m", "services.trainer"]
# Takes the handover as the real spare does, then prints what it became.
STAND_IN = [
    sys.executable,
    "-c",
    "import json, os, sys; from services.trainer.spare import _become; os.write(1, b'ready\\n');"
    " line = sys.stdin.readline();"
    " line or sys.exit(0); _become(json.loads(line));"
    " print(os.environ['UNICRON_TRAINER_RANK'], os.environ.get('BASE')); print('to stderr', file=sys.stderr)",
]
BASE = {"BASE": "1", "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def pool(tmp_path: Path, size: int = 1) -> SparePool:
    return SparePool(size, STAND_IN, TRAINER, BASE, tmp_path)


def wait_exit(proc: subprocess.Popen[bytes]) -> int:
    return proc.wait(timeout=30)


def test_a_spare_becomes_the_launch_it_is_handed(tmp_path: Path) -> None:
    spares = pool(tmp_path)
    spares.fill()
    out, err = tmp_path / "r.out", tmp_path / "r.err"
    proc = spares.take(TRAINER, {**BASE, "UNICRON_TRAINER_RANK": "3"}, out, err)
    assert proc is not None and wait_exit(proc) == 0
    assert out.read_text().split() == ["3", "1"]
    assert err.read_text().strip() == "to stderr"
    spares.close()


@pytest.mark.parametrize(
    ("argv", "env", "serves"),
    [
        (TRAINER, {**BASE, "UNICRON_TRAINER_RANK": "0", "UNICRON_TRAINER_SPEC": "{}"}, True),
        (TRAINER, BASE, True),
        ([sys.executable, "-c", "pass"], BASE, False),  # another program
        (TRAINER, {**BASE, "OMP_NUM_THREADS": "4"}, False),  # torch reads it at import
        (TRAINER, {**BASE, "EXTRA": "x"}, False),
        (TRAINER, {k: v for k, v in BASE.items() if k != "BASE"}, False),
    ],
)
def test_which_launches_a_spare_serves(tmp_path: Path, argv: list[str], env: dict[str, str], serves: bool) -> None:
    assert pool(tmp_path).serves(argv, env) is serves


def test_no_spare_for_a_launch_it_cannot_serve_or_when_none_is_ready(tmp_path: Path) -> None:
    spares = pool(tmp_path, size=0)
    assert spares.take(TRAINER, BASE, tmp_path / "o", tmp_path / "e") is None
    spares = pool(tmp_path)
    spares.fill()
    assert spares.take(TRAINER, {**BASE, "OMP_NUM_THREADS": "8"}, tmp_path / "o", tmp_path / "e") is None
    spares.close()


def test_a_dead_spare_is_skipped_and_the_pool_refills(tmp_path: Path) -> None:
    spares = pool(tmp_path, size=2)
    spares.fill()
    first = spares._spares[0]
    first.kill()
    first.wait()
    proc = spares.take(TRAINER, {**BASE, "UNICRON_TRAINER_RANK": "1"}, tmp_path / "o", tmp_path / "e")
    assert proc is not None and proc is not first and wait_exit(proc) == 0
    deadline = time.monotonic() + 10
    while len([p for p in spares._spares if p.poll() is None]) < 2:
        assert time.monotonic() < deadline, "the pool did not refill"
        time.sleep(0.05)
    spares.close()
    assert spares._spares == []


def test_the_pool_says_how_many_spares_are_ready_and_hands_out_a_ready_one_first(tmp_path: Path) -> None:
    spares = pool(tmp_path, size=2)
    spares.fill()
    status = tmp_path / STATUS_FILE
    deadline = time.monotonic() + 10
    while json.loads(status.read_text()) != {"size": 2, "ready": 2}:
        assert time.monotonic() < deadline, status.read_text()
        time.sleep(0.05)
    proc = spares.take(TRAINER, {**BASE, "UNICRON_TRAINER_RANK": "0"}, tmp_path / "o", tmp_path / "e")
    assert proc is not None and wait_exit(proc) == 0
    assert json.loads(status.read_text())["ready"] <= 1  # until the new one is ready
    spares.close()


def test_an_unused_spare_ends_with_the_pool(tmp_path: Path) -> None:
    spares = pool(tmp_path)
    spares.fill()
    proc = spares._spares[0]
    spares.close()
    assert proc.poll() is not None
    spares.fill()  # closed: starts nothing
    assert spares._spares == []


def test_the_supervisor_launches_through_a_spare_and_keeps_a_registry(tmp_path: Path) -> None:
    exits: list[WorkerExit] = []
    done = threading.Event()

    def on_exit(exit: WorkerExit) -> None:
        exits.append(exit)
        done.set()

    spares = pool(tmp_path)
    spares.fill()
    spare_pid = spares._spares[0].pid
    supervisor = Supervisor(tmp_path / "work", on_exit, spares)
    key = WorkerKey("job-1", 2, 5)
    pid = supervisor.launch(key, TRAINER, {**BASE, "UNICRON_TRAINER_RANK": "5"})
    assert pid == spare_pid
    registry = json.loads((tmp_path / "work" / REGISTRY_FILE).read_text())
    # Written at launch; the stand-in may already be gone and the registry empty again.
    entry = {"worker": "w1", "pid": pid, "slot": 0, "job_id": "job-1", "generation": 2, "rank": 5}
    entry["stderr"] = str(tmp_path / "work" / "job-1" / "gen2-rank5.err")
    assert registry in ([entry], [])
    assert done.wait(30)
    assert exits[0].key == key and exits[0].exit_code == 0
    assert json.loads((tmp_path / "work" / REGISTRY_FILE).read_text()) == []
    assert (tmp_path / "work" / "job-1" / "gen2-rank5.out").read_text().split() == ["5", "1"]
    supervisor.close()


def test_waiting_for_warm_spares_ends_when_they_are_ready_or_dead(tmp_path: Path) -> None:
    spares = pool(tmp_path, size=2)
    spares.fill()
    assert spares.wait_warm(timeout_s=30) == 2
    spares.close()
    assert spares.wait_warm(timeout_s=30) == 0  # closed: at once
    slow = SparePool(1, [sys.executable, "-c", "import time; time.sleep(60)"], TRAINER, BASE, tmp_path)
    slow.fill()
    started = time.monotonic()
    assert slow.wait_warm(timeout_s=0.5) == 0 and time.monotonic() - started < 5  # bounded
    slow._spares[0].kill()
    dead = SparePool(1, [sys.executable, "-c", "pass"], TRAINER, BASE, tmp_path)  # exits before ready
    dead.fill()
    started = time.monotonic()
    assert dead.wait_warm(timeout_s=30) == 0 and time.monotonic() - started < 10
    slow.close()
    dead.close()
