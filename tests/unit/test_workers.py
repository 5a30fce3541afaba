"""A worker keeps its identity for life (services/agent/supervisor.py): a reform changes its
membership, not its id, pid, stderr file or slot; each slot's trainer sees its own GPU."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.agent.__main__ import node_gpus
from services.agent.supervisor import Supervisor, WorkerExit, WorkerKey

# Writes which GPU it was given to stderr, then waits for its stdin to close.
SLEEPER = [
    sys.executable,
    "-c",
    "import os, sys; print(os.environ.get('CUDA_VISIBLE_DEVICES'), file=sys.stderr, flush=True); sys.stdin.read()",
]


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[Supervisor]:
    exits: list[WorkerExit] = []
    made = Supervisor(tmp_path, exits.append, gpus=("3", "5"))
    yield made
    made.stop(grace_s=1.0)


def test_a_reform_moves_the_membership_and_keeps_the_worker(supervisor: Supervisor) -> None:
    first, second = WorkerKey("j", 1, 0), WorkerKey("j", 1, 1)
    supervisor.launch(first, SLEEPER, {}, spare=False)
    supervisor.launch(second, SLEEPER, {}, spare=False)
    before = supervisor.worker(second)
    assert before is not None and before.slot == 1
    renamed = WorkerKey("j", 2, 0)  # rank 1 became rank 0 of generation 2
    assert supervisor.rekey(second, renamed)
    after = supervisor.worker(renamed)
    assert after is before and after.worker_id == before.worker_id and after.slot == 1
    # A hang report after the reform reads the file the process still writes.
    assert supervisor.stderr_path(renamed) == before.err_path
    assert before.err_path.name == "gen1-rank1.err"
    assert supervisor.pids("j")[renamed] == before.proc.pid


def test_each_slot_sees_its_own_gpu_and_a_freed_slot_is_reused(supervisor: Supervisor, tmp_path: Path) -> None:
    keys = [WorkerKey("j", 1, r) for r in range(2)]
    for key in keys:
        supervisor.launch(key, SLEEPER, {}, spare=False)
    done = threading.Event()
    supervisor._on_exit = lambda exit: done.set()
    first = supervisor.worker(keys[0])
    assert first is not None
    first.proc.kill()
    assert done.wait(10)
    supervisor.launch(WorkerKey("k", 1, 0), SLEEPER, {}, spare=False)
    reused = supervisor.worker(WorkerKey("k", 1, 0))
    assert reused is not None and reused.slot == 0 and reused.worker_id == "w3"
    err = tmp_path / "j" / "gen1-rank1.err"
    deadline = time.monotonic() + 10
    while not err.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert err.read_text().split() == ["5"]


@pytest.mark.parametrize(
    ("setting", "visible", "devices", "want"),
    [
        ("none", None, ["nvidia0"], ()),
        ("0,2", None, [], ("0", "2")),
        ("auto", "4,5", ["nvidia0"], ("4", "5")),
        ("auto", None, ["nvidia1", "nvidia0", "nvidiactl", "nvidia-uvm"], ("0", "1")),
        ("auto", None, [], ()),
    ],
)
def test_node_gpus(tmp_path: Path, setting: str, visible: str | None, devices: list[str], want: tuple) -> None:
    for name in devices:
        (tmp_path / name).touch()
    assert node_gpus(setting, visible, tmp_path) == want


@pytest.mark.parametrize(
    ("visible", "local_rank", "rank", "want"),
    [(1, None, 5, 0), (4, None, 5, 1), (4, "2", 5, 2), (8, "3", 0, 3)],
)
def test_a_trainer_picks_its_gpu(
    monkeypatch: pytest.MonkeyPatch, visible: int, local_rank: str | None, rank: int, want: int
) -> None:
    from unicron.trainer.loop import cuda_device

    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    # One visible GPU (its agent's slot) is device 0 whatever the rank; else LOCAL_RANK, else the rank.
    assert cuda_device(visible, rank) == want
