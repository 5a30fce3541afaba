"""End-to-end training of the Megatron-Core GPT on CPU with gloo.

A single-process run is the reference. Two worker processes (this file run as a script) then
train the same global batches with DP=2, TP=2 and PP=2 in turn. DP=2 and TP=2 must reproduce
the reference losses: that proves gradients are averaged over the global batch and that the
initial model does not depend on the TP degree.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.trainer.gpt import ModelConfig, TrainConfig, gpt_trainer
from unicron.trainer.program import ProgramError, Training
from unicron.trainer.step_result import StepResult

# Workers get this on PYTHONPATH so `services` imports whatever the caller's cwd.
REPO_ROOT = Path(__file__).resolve().parents[2]
# Without dropout: these runs are compared across tensor-parallel degrees, and a TP rank draws
# the attention's masks for its own heads from its own stream (Megatron's tracker), so the
# masks themselves depend on the TP degree. Remedies never change TP (test_exactness.py).
MODEL = ModelConfig(hidden_dropout=0.0, attention_dropout=0.0)
# A higher lr than the default so the loss falls well within the step budget.
TRAIN = TrainConfig(global_batch_size=8, micro_batch_size=1, lr=5e-3, seed=1234)
STEPS = 25
LAYOUT_STEPS = {"dp2": STEPS, "tp2": 4, "pp2": 4}
LAYOUTS = {"dp2": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
WORKERS = 2
WORKER_TIMEOUT_S = 150


def _train(steps: int, tensor_parallel: int = 1, pipeline_parallel: int = 1) -> list[StepResult]:
    trainer = gpt_trainer(MODEL, TRAIN, tensor_parallel, pipeline_parallel)
    try:
        return [trainer.step() for _ in range(steps)]
    finally:
        trainer.close()


def _worker(rank: int, store: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORKERS)
    try:
        # One process group, several trainers in turn: also covers close() and rebuilding.
        losses = {name: [r.loss for r in _train(LAYOUT_STEPS[name], tp, pp)] for name, (tp, pp) in LAYOUTS.items()}
        try:
            gpt_trainer(replace(MODEL, sequence_parallel=True), TRAIN, 2, 1).close()
            refused = ""
        except ProgramError as exc:
            refused = str(exc)
    finally:
        dist.destroy_process_group()
    Path(out).write_text(json.dumps({**losses, "tp2sp_refused": refused}))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[StepResult]:
    store = tmp_path_factory.mktemp("single") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        return _train(STEPS)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_process_losses(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[float]]]:
    tmp = tmp_path_factory.mktemp("two")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    outs = [tmp / f"rank{r}.json" for r in range(WORKERS)]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(r), str(tmp / "store"), str(outs[r])],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(WORKERS)
    ]
    logs = [_wait(p) for p in procs]
    for r, proc in enumerate(procs):
        assert proc.returncode == 0, f"worker {r} exited {proc.returncode}:\n{logs[r][-4000:]}"
    return [json.loads(out.read_text()) for out in outs]


def _wait(proc: subprocess.Popen[str]) -> str:
    try:
        output, _ = proc.communicate(timeout=WORKER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate()
    return output


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert math.isclose(g, w, rel_tol=1e-5), f"{what}: step {i + 1} loss {g} != {w}"


def test_loss_falls_single_process(reference: list[StepResult]) -> None:
    first, last = reference[0].loss, reference[-1].loss
    # An untrained model is near-uniform over the vocabulary.
    assert abs(first - math.log(MODEL.vocab_size)) < 0.3, first
    assert last < 0.7 * first, [round(r.loss, 3) for r in reference]


def test_step_result_accounting(reference: list[StepResult]) -> None:
    assert [r.iteration for r in reference] == list(range(1, STEPS + 1))
    tokens = TRAIN.global_batch_size * MODEL.seq_length
    flops = MODEL.flops_per_token() * tokens
    for result in reference:
        assert result.tokens == tokens
        assert result.flops == flops > 0
        assert result.seconds > 0


def test_dp2_matches_single_process(reference: list[StepResult], two_process_losses: list[dict[str, Any]]) -> None:
    rank0, rank1 = two_process_losses
    assert rank0["dp2"] == rank1["dp2"], "DP ranks must report the same loss"
    _assert_close(rank0["dp2"], [r.loss for r in reference], "DP=2 vs single process")


def test_tp2_matches_single_process(reference: list[StepResult], two_process_losses: list[dict[str, Any]]) -> None:
    rank0, rank1 = two_process_losses
    assert rank0["tp2"] == rank1["tp2"], "TP ranks must report the same loss"
    want = [r.loss for r in reference[: LAYOUT_STEPS["tp2"]]]
    _assert_close(rank0["tp2"], want, "TP=2 vs single process")


def test_pp2_trains(two_process_losses: list[dict[str, Any]]) -> None:
    # PP stages initialize their layers from their own RNG stream, so the trajectory differs
    # from the reference; it must still agree across ranks and learn.
    rank0, rank1 = two_process_losses
    losses = rank0["pp2"]
    assert losses == rank1["pp2"], "PP ranks must report the same loss"
    assert all(math.isfinite(loss) for loss in losses), losses
    assert losses[-1] < losses[0], losses


def test_invalid_configs_raise() -> None:
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig(hidden_size=0)
    with pytest.raises(ValueError, match="num_attention_heads"):
        ModelConfig(hidden_size=64, num_attention_heads=5)
    with pytest.raises(ProgramError, match="micro_batch_size"):
        Training(global_batch_size=6, micro_batch_size=4)
    with pytest.raises(ProgramError, match="learning_rate"):
        Training(learning_rate=0.0)
    with pytest.raises(ProgramError, match="lr_decay_style"):
        Training(lr_decay_style="stepwise")


def test_layout_must_fit_world(tmp_path: Path) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/s", rank=0, world_size=1)
    try:
        with pytest.raises(ProgramError, match="tensor x pipeline"):
            gpt_trainer(MODEL, TRAIN, tensor_parallel=2)
    finally:
        dist.destroy_process_group()


def test_sequence_parallel_without_fused_norms_fails_at_start_as_the_programs_error(
    two_process_losses: list[dict[str, Any]],
) -> None:
    # Megatron-Core's sequence parallelism needs Transformer Engine's or Apex's layer norm; the
    # local layer spec's torch LayerNorm refuses it. Without them (every CPU machine) a program
    # asking for it fails once, at its model provider, naming the reason.
    for rank in two_process_losses:
        assert rank["tp2sp_refused"].startswith(
            "model_provider raised AssertionError: sequence parallel not supported by torch LayerNorm"
        ), rank["tp2sp_refused"]


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2], sys.argv[3])
