"""User programs that break the trainer library's contract, one per entry point: each must
fail its job once, with the cause named (tests/trainer/test_program_errors.py)."""

from __future__ import annotations

import sys
from typing import Any


def provider_raises() -> None:
    from examples.gpt.model import ModelConfig, forward_step
    from unicron.trainer import pretrain

    def dataset_provider(num_samples: int) -> Any:
        raise FileNotFoundError(f"no shard for {num_samples} samples in /nowhere")

    from examples.gpt.model import model_provider

    pretrain(
        model_provider(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2)), dataset_provider, forward_step
    )


def loss_returns_a_mean() -> None:
    import torch

    from examples.gpt.model import ModelConfig, SyntheticData, model_provider
    from unicron.trainer import pretrain

    model = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)

    def forward_step(data_iterator: Any, gpt: Any) -> Any:
        batch = next(data_iterator)
        positions = torch.arange(batch["tokens"].size(1)).unsqueeze(0).expand_as(batch["tokens"])
        output = gpt(batch["tokens"], positions, None, labels=batch["labels"])
        return output, lambda out: out.float().mean()  # Megatron wants (sum, tokens, report)

    pretrain(model_provider(model), lambda n: SyntheticData(model, 1, n), forward_step)


def returns_early() -> None:
    """A program that forgets to train."""


def exits_zero() -> None:
    sys.exit(0)
