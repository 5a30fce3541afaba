"""What a run shows (issue 33, item 4), through real trainer processes: every iteration report
carries the loss function's report dict, the learning rate and the gradient norm; a job that
evaluates reports its validation loss; rank 0 writes TensorBoard event files that TensorBoard
itself reads; and evaluating does not change what the job learns."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.trainer.harness import FakeAgent, run_ranks, tiny_spec
from unicron.trainer import checkpoint

ITERATIONS = 6


def _run(tmp_path: Path, name: str, evaluate: bool) -> FakeAgent:
    spec = tiny_spec(ITERATIONS, checkpoint_interval=ITERATIONS)
    t = spec.training
    t.lr_warmup_iterations, t.lr_decay_style, t.min_learning_rate = 2, "cosine", 1e-4
    if evaluate:
        t.eval_interval, t.eval_iterations = 4, 2
        t.tensorboard_dir = str(tmp_path / name / "tb")
    agent = FakeAgent()
    try:
        results = run_ranks(agent, spec, 2, tmp_path / name, tmp_path / name / "ckpt")
    finally:
        agent.stop()
    for result in results:
        assert result.returncode == 0, result.log[-3000:]
    return agent


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, FakeAgent, FakeAgent]:
    tmp = tmp_path_factory.mktemp("reports")
    return tmp, _run(tmp, "evaluated", True), _run(tmp, "plain", False)


def test_each_report_carries_the_loss_report_learning_rate_and_grad_norm(
    runs: tuple[Path, FakeAgent, FakeAgent],
) -> None:
    _, evaluated, _ = runs
    for rank in (0, 1):
        reports = evaluated.of(rank, "iteration")
        assert [r.iteration for r in reports] == list(range(1, ITERATIONS + 1))
        for report in reports:
            # The GPT example's loss function reports "lm loss" as (sum, tokens): over the whole
            # global batch that is the loss itself.
            assert report.metrics["lm loss"] == pytest.approx(report.loss, rel=1e-9)
            assert report.HasField("grad_norm") and math.isfinite(report.grad_norm) and report.grad_norm > 0
            assert not report.skipped
        # The rate each update used: Megatron's warm-up from 0 over 2 iterations to 5e-3, then
        # the cosine decay towards 1e-4.
        rates = [r.learning_rate for r in reports]
        assert rates[:3] == pytest.approx([0.0, 2.5e-3, 5e-3])
        assert rates[2:] == sorted(rates[2:], reverse=True) and rates[-1] > 1e-4


def test_validation_loss_every_interval_and_after_the_last(runs: tuple[Path, FakeAgent, FakeAgent]) -> None:
    _, evaluated, plain = runs
    reports = evaluated.of(0, "iteration")
    validated = {r.iteration: r.validation_loss for r in reports if r.HasField("validation_loss")}
    assert sorted(validated) == [4, ITERATIONS]
    assert all(math.isfinite(v) and v > 0 for v in validated.values())
    assert validated == {
        r.iteration: r.validation_loss for r in evaluated.of(1, "iteration") if r.HasField("validation_loss")
    }
    assert not any(r.HasField("validation_loss") for r in plain.of(0, "iteration"))


def test_evaluating_changes_nothing_the_job_learns(runs: tuple[Path, FakeAgent, FakeAgent]) -> None:
    tmp, evaluated, plain = runs
    assert [r.loss for r in evaluated.of(0, "iteration")] == [r.loss for r in plain.of(0, "iteration")]
    with_eval, without = _final_model(tmp / "evaluated" / "ckpt"), _final_model(tmp / "plain" / "ckpt")
    assert sorted(with_eval) == sorted(without)
    assert all(v.equal(with_eval[k]) for k, v in without.items())


def _final_model(root: Path) -> dict[str, Any]:
    manifest = checkpoint.read_manifest(root, ITERATIONS)["layout"]
    layout = checkpoint.layout_of_config(manifest["model"], 1, 1)
    found = checkpoint.find_latest(root, layout)
    assert found is not None and found[0] == ITERATIONS
    return {k: v for k, v in found[1]["model"].items() if hasattr(v, "equal")}


def test_tensorboard_reads_rank_zeros_events(runs: tuple[Path, FakeAgent, FakeAgent]) -> None:
    tmp, evaluated, _ = runs
    directory = tmp / "evaluated" / "tb"
    assert len(list(directory.glob("events.out.tfevents.*"))) == 1  # rank 0's only
    events = EventAccumulator(str(directory))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"loss", "lm loss", "learning-rate", "grad-norm", "validation loss", "skipped-iterations"} <= tags
    reports = evaluated.of(0, "iteration")
    assert [e.step for e in events.Scalars("loss")] == list(range(1, ITERATIONS + 1))
    assert [e.value for e in events.Scalars("loss")] == pytest.approx([r.loss for r in reports], rel=1e-6)
    assert [e.step for e in events.Scalars("validation loss")] == [4, ITERATIONS]
