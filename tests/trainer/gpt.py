"""The GPT example as the trainer tests build it in process: a ``MegatronTrainer`` over the
example's program (examples/gpt), from a model shape and a few training settings."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from examples.gpt.model import ModelConfig
from examples.gpt.train import model_of, parse, program
from unicron.trainer.engine import MegatronTrainer
from unicron.trainer.program import Training
from unicron.v1 import common_pb2

__all__ = ["MegatronTrainer", "ModelConfig", "TrainConfig", "gpt_trainer", "trainer_configs"]


@dataclass(frozen=True)
class TrainConfig:
    global_batch_size: int = 8
    micro_batch_size: int = 1
    lr: float = 1e-3
    seed: int = 1234


def gpt_trainer(
    model: ModelConfig,
    train: TrainConfig,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    device: str = "cpu",
    timeout: timedelta | None = None,
) -> MegatronTrainer:
    """The GPT example's trainer on this rank (torch.distributed initialized by the caller)."""
    training = Training(
        iterations=1000,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        learning_rate=train.lr,
        seed=train.seed,
        tensor_parallel=tensor_parallel,
        pipeline_parallel=pipeline_parallel,
    )
    return MegatronTrainer(program(model, train.seed), training, device=device, timeout=timeout)


def trainer_configs(spec: common_pb2.JobSpec) -> tuple[ModelConfig, TrainConfig]:
    """The GPT shape (from the program's arguments) and training settings of a job spec."""
    t = spec.training
    model = model_of(parse(list(spec.program.args)))
    return model, TrainConfig(t.global_batch_size, t.micro_batch_size or 1, t.learning_rate or 1e-3, t.seed)
