"""The optimizer and schedule settings real runs tune reach Megatron-Core: from the job spec
(``loop.training_of``) or ``Training``, into the OptimizerConfig, DDP config and LR scheduler
the engine builds, and training follows them. World 1, in this process."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from examples.gpt.model import ModelConfig
from examples.gpt.train import program
from tests.trainer.harness import tiny_spec
from unicron import jobspec
from unicron.trainer.engine import MegatronTrainer
from unicron.trainer.loop import local_spec, training_of
from unicron.trainer.program import Training

MODEL = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
BASE = Training(iterations=12, global_batch_size=4, micro_batch_size=2, learning_rate=1e-2, seed=3)


def _trainer(training: Training) -> MegatronTrainer:
    return MegatronTrainer(program(MODEL, training.seed), training)


@pytest.mark.usefixtures("world1")
def test_adam_settings_reach_megatron_and_training_follows_them() -> None:
    tuned = replace(BASE, adam_beta1=0.8, adam_beta2=0.95, adam_eps=1e-6, clip_grad=0.5, weight_decay=0.1)
    trainer = _trainer(tuned)
    try:
        config = trainer.optimizer.config
        assert (config.optimizer, config.adam_beta1, config.adam_beta2, config.adam_eps) == ("adam", 0.8, 0.95, 1e-6)
        assert config.clip_grad == 0.5 and config.weight_decay == 0.1
        groups = trainer.optimizer.param_groups
        assert all(g["betas"] == (0.8, 0.95) and g["eps"] == 1e-6 for g in groups)
        tuned_losses = [trainer.step().loss for _ in range(4)]
    finally:
        trainer.release()
    trainer = _trainer(BASE)
    try:
        default_losses = [trainer.step().loss for _ in range(4)]
    finally:
        trainer.release()
    # Same first loss (same model and data), then the settings make their own trajectory.
    assert tuned_losses[0] == default_losses[0]
    assert tuned_losses[1:] != default_losses[1:]


@pytest.mark.usefixtures("world1")
def test_sgd_without_clipping() -> None:
    trainer = _trainer(replace(BASE, optimizer="sgd", sgd_momentum=0.5, clip_grad=0.0))
    try:
        assert isinstance(trainer.optimizer.optimizer, torch.optim.SGD)
        assert trainer.optimizer.param_groups[0]["momentum"] == 0.5
        assert trainer.optimizer.config.clip_grad == 0.0
        losses = [trainer.step().loss for _ in range(6)]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    finally:
        trainer.release()


def _wsd_lr(step: int, peak: float, floor: float, warmup: int, decay: int, anneal: int) -> float:
    """Megatron-Core's WSD rate with a linear anneal, written out independently."""
    if warmup and step <= warmup:
        return peak * step / warmup
    if step > decay:
        return floor
    start = decay - anneal
    coeff = 1.0 if step <= start else 1.0 - (step - start) / anneal
    return floor + coeff * (peak - floor)


@pytest.mark.usefixtures("world1")
def test_wsd_schedule_and_decay_span_from_the_spec() -> None:
    spec = local_spec(
        replace(
            BASE,
            lr_decay_style="WSD",
            lr_warmup_iterations=2,
            lr_decay_iterations=8,
            lr_wsd_decay_iterations=4,
            min_learning_rate=1e-3,
        )
    )
    training = training_of(jobspec.with_defaults(spec))
    # The decay span is carried through, not replaced by the job's iterations.
    assert (training.lr_decay_iterations, training.lr_wsd_decay_iterations) == (8, 4)
    trainer = _trainer(training)
    try:
        rates = []
        for _ in range(10):
            trainer.step()
            rates.append(trainer.optimizer.param_groups[0]["lr"])
    finally:
        trainer.release()
    want = [_wsd_lr(step, 1e-2, 1e-3, 2, 8, 4) for step in range(1, 11)]
    assert rates == pytest.approx(want, rel=1e-12), (rates, want)


def test_spec_defaults_and_a_set_zero() -> None:
    spec = tiny_spec(iterations=4)
    full = jobspec.with_defaults(spec)
    settings = training_of(full)
    assert (settings.optimizer, settings.adam_beta2, settings.clip_grad) == ("adam", 0.999, 1.0)
    spec.training.clip_grad = 0.0  # set: no clipping, not the default
    spec.training.adam_beta1 = 0.0
    settings = training_of(jobspec.with_defaults(spec))
    assert (settings.clip_grad, settings.adam_beta1) == (0.0, 0.0)
    # And back: a run without Unicron writes every setting into its local spec.
    assert training_of(jobspec.with_defaults(local_spec(settings))) == settings
