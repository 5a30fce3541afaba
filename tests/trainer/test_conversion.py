"""The conversion docs/trainer-library.md describes, on the project's own hand-written
Megatron-Core script (examples/mcore_loop): ``original.py`` (its own loop, TP 2) and
``converted.py`` (the same handed to ``pretrain``) both train under plain torchrun on CPU, to the
same losses; the converted one's final checkpoint loads in a plain Megatron-Core script
(``load.py``) as the model the original saved; and the counts the guide states for the diff are
the diff's."""

from __future__ import annotations

import difflib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from unicron.redisutil import free_port

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "mcore_loop"
GUIDE = ROOT / "docs" / "trainer-library.md"
ITERATIONS = 4
RUN_TIMEOUT_S = 120


@dataclass(frozen=True)
class Run:
    returncode: int
    output: str


def torchrun(module: str, *args: str, processes: int = 2) -> Run:
    """``torchrun --nproc-per-node N -m module args`` from the repository root, on CPU."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(free_port()), "-m", module, *args]
    done = subprocess.run(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S
    )
    return Run(done.returncode, done.stdout)


def original_losses(output: str) -> list[float]:
    return [float(m.group(1)) for m in re.finditer(r"^iteration \d+: lm loss (\S+)$", output, re.MULTILINE)]


def converted_losses(output: str) -> list[float]:
    """The ``lm loss`` of rank 0's iteration log lines (JSON, one per iteration)."""
    losses = []
    for line in output.splitlines():
        if line.startswith("{") and '"msg": "iteration ' in line:
            losses.append(float(json.loads(line)["lm loss"]))
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Run, Run]:
    """Both scripts trained for ITERATIONS under torchrun, 2 processes, TP 2: (where they saved,
    the original's run, the converted one's)."""
    out = tmp_path_factory.mktemp("conversion")
    original = torchrun(
        "examples.mcore_loop.original", "--iterations", str(ITERATIONS), "--save", str(out / "original")
    )
    converted = torchrun(
        "examples.mcore_loop.converted", "--iterations", str(ITERATIONS), "--save", str(out / "converted")
    )
    return out, original, converted


def test_both_scripts_train_to_the_same_losses(trained: tuple[Path, Run, Run]) -> None:
    _, original, converted = trained
    assert original.returncode == 0, original.output[-4000:]
    assert converted.returncode == 0, converted.output[-4000:]
    before, after = original_losses(original.output), converted_losses(converted.output)
    assert len(before) == len(after) == ITERATIONS, (before, after)
    # The same initial model, samples and updates: only float rounding differs (the runtime sums
    # the loss over the global batch, the hand-written loop averages per micro-batch).
    assert after == pytest.approx(before, abs=1e-5)


def test_the_final_checkpoint_loads_in_a_plain_script(trained: tuple[Path, Run, Run]) -> None:
    out, _, converted = trained
    assert converted.returncode == 0, converted.output[-4000:]
    final = out / "converted" / "final"
    assert (final / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERATIONS)
    assert (final / f"iter_{ITERATIONS:07d}" / "metadata.json").exists()
    # At the training's TP 2, and resharded to one process: both against the model the
    # original saved with its own dist_checkpointing.save.
    for processes in (2, 1):
        loaded = torchrun(
            "examples.mcore_loop.load",
            str(final),
            str(out / "original"),
            "--tensor-parallel",
            str(processes),
            processes=processes,
        )
        assert loaded.returncode == 0, loaded.output[-4000:]
        ranks = rank_reports(loaded.output)
        assert sorted(r["rank"] for r in ranks) == list(range(processes)), loaded.output[-4000:]
        for found in ranks:
            assert found["iterations"] == [ITERATIONS, None]
            # Loaded, it is the original's trained model up to Adam's rounding (two models that
            # failed to load would be two random initializations, about 1.4 apart).
            assert found["distance"] < 1e-2, found


def rank_reports(output: str) -> list[dict[str, Any]]:
    """Every ``{"rank": ...}`` object printed, also where two ranks' lines ran together."""
    decoder = json.JSONDecoder()
    found = []
    for start in (m.start() for m in re.finditer(r'\{"rank"', output)):
        found.append(decoder.raw_decode(output, start)[0])
    return found


def diff_counts(before: list[str], after: list[str], from_line: int = 0) -> tuple[int, int]:
    """Lines added, and lines removed at or after ``before[from_line]``, by difflib."""
    added = removed = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, before, after, autojunk=False).get_opcodes():
        if tag != "equal":
            added += j2 - j1
            removed += max(0, i2 - max(i1, from_line))
    return added, removed


def test_the_guide_states_the_diffs_counts() -> None:
    before = (EXAMPLE / "original.py").read_text().splitlines()
    after = (EXAMPLE / "converted.py").read_text().splitlines()
    section = GUIDE.read_text().split("### Converting a Megatron-Core script", 1)[1].split("\n## ", 1)[0]
    stated = re.search(
        r"`examples/mcore_loop/original.py` to `converted.py`:\s+(\d+) lines\s+added\s+and\s+(\d+)\s+removed,"
        r"\s+(\d+) of\s+them\s+the\s+hand-written\s+loop",
        section,
    )
    assert stated is not None, "the guide no longer states the example's counts"
    added, removed = diff_counts(before, after)
    main_at = before.index("def main(argv: list[str] | None = None) -> None:")
    _, in_main = diff_counts(before, after, from_line=main_at)
    assert (added, removed, in_main) == tuple(int(n) for n in stated.groups())
