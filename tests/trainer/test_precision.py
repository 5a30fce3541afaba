"""Training in bf16 and fp16 as Megatron-LM does it (training.precision): low-precision
parameters in a Float16Module, fp32 main parameters in the optimizer, gradients reduced in fp32,
fp16's dynamic loss scale. World 1, in this process, dropout on (the example's default)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from examples.gpt.model import ModelConfig
from examples.gpt.train import program
from tests.trainer.harness import tiny_spec
from unicron import jobspec
from unicron.errors import InvalidArgument
from unicron.trainer.engine import MegatronTrainer
from unicron.trainer.program import ProgramError, Training

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)


def _training(precision: str) -> Training:
    return Training(
        iterations=40, global_batch_size=4, micro_batch_size=2, learning_rate=1e-2, seed=3, precision=precision
    )


def _trainer(precision: str) -> MegatronTrainer:
    return MegatronTrainer(program(MODEL, 3, precision=precision), _training(precision))


def _params(trainer: MegatronTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items() if isinstance(v, torch.Tensor)}


def _main_params(trainer: MegatronTrainer) -> list[torch.Tensor]:
    """The optimizer's fp32 copies of the model's parameters."""
    return [p.detach().clone() for group in trainer.optimizer.param_groups for p in group["params"]]


@pytest.mark.usefixtures("world1")
def test_bf16_trains_with_fp32_main_parameters_and_resumes_bit_identical() -> None:
    trainer = _trainer("bf16")
    try:
        assert {p.dtype for p in trainer.model.parameters()} == {torch.bfloat16}
        assert {p.dtype for p in _main_params(trainer)} == {torch.float32}
        losses = [trainer.step().loss for _ in range(6)]
        assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
        saved = copy.deepcopy(trainer.state_dict())
        for _ in range(4):
            trainer.step()
        want_params, want_main = _params(trainer), _main_params(trainer)
    finally:
        trainer.release()
    resumed = _trainer("bf16")
    try:
        resumed.load_state_dict(saved)
        for _ in range(4):
            resumed.step()
        got_params, got_main = _params(resumed), _main_params(resumed)
    finally:
        resumed.release()
    # bf16 parameters, fp32 main parameters and Adam's moments all travel: bit-identical.
    assert all(got_params[k].equal(v) for k, v in want_params.items())
    assert all(g.equal(w) for g, w in zip(got_main, want_main, strict=True))


@pytest.mark.usefixtures("world1")
def test_fp16_skips_overflowing_steps_and_carries_its_loss_scale() -> None:
    trainer = _trainer("fp16")
    try:
        assert {p.dtype for p in trainer.model.parameters()} == {torch.float16}
        losses = [trainer.step().loss for _ in range(24)]
        # Megatron's initial scale (2^32) overflows: the first steps are skipped, not errors.
        assert trainer.skipped_steps > 0 and trainer.iteration == 24
        assert float(trainer.optimizer.get_loss_scale()) < 2.0**32
        assert all(math.isfinite(x) for x in losses)
        assert "grad_scaler" in trainer.state_dict()["optimizer"]
    finally:
        trainer.release()


@pytest.mark.usefixtures("world1")
def test_fp16_whose_loss_scale_collapses_is_the_programs_error() -> None:
    trainer = _trainer("fp16")
    try:
        with torch.no_grad():
            next(trainer.model.parameters()).fill_(float("nan"))  # every gradient non-finite
        with pytest.raises(ProgramError, match=r"fp16 loss scale collapsed: .* minimum \(1\)"):
            for _ in range(80):
                trainer.step()
    finally:
        trainer.release()


@pytest.mark.usefixtures("world1")
def test_a_model_of_another_precision_is_named_in_one_line() -> None:
    with pytest.raises(ProgramError) as error:
        MegatronTrainer(program(MODEL, 3, precision="fp32"), _training("bf16"))
    assert str(error.value) == (
        "the job trains in bf16 (training.precision), but the model's TransformerConfig has bf16=False; set bf16=True"
    )
    with pytest.raises(ProgramError, match="has bf16=True; set bf16=False"):
        MegatronTrainer(program(MODEL, 3, precision="bf16"), _training("fp32"))


def test_a_precision_the_spec_does_not_know_is_invalid_argument() -> None:
    spec = tiny_spec(iterations=4)
    spec.training.precision = "fp8"
    with pytest.raises(InvalidArgument) as error:
        jobspec.normalized(spec)
    assert error.value.field == "spec.training.precision"
    with pytest.raises(ProgramError, match=r"training\.precision 'fp8' is not one of fp32, bf16, fp16"):
        Training(precision="fp8")


class _Config:
    """A TransformerConfig's fields as ``check_model`` reads them."""

    tensor_model_parallel_size = 1
    pipeline_model_parallel_size = 1
    bf16 = fp16 = False
    params_dtype = torch.float32
    virtual_pipeline_model_parallel_size: int | None = None
    context_parallel_size = 1


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("virtual_pipeline_model_parallel_size", 2, "sets virtual_pipeline_model_parallel_size"),
        ("context_parallel_size", 2, "sets context_parallel_size=2, which Unicron does not run yet"),
    ],
)
def test_layouts_not_run_yet_are_refused_in_one_line(field: str, value: int, message: str) -> None:
    config = _Config()
    setattr(config, field, value)
    model = torch.nn.Linear(2, 2)
    model.config = config  # type: ignore[assignment]
    with pytest.raises(ProgramError, match=message):
        program(MODEL, 3).check_model(model, 1, 1)
