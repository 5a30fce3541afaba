"""User programs that keep the trainer library's contract in its less usual forms
(tests/trainer/test_program_errors.py)."""

from __future__ import annotations

from typing import Any

from examples.gpt.train import main as gpt_main


def gpt(argv: list[str] | None = None) -> None:
    gpt_main(argv)


def loss_as_mean_and_report() -> None:
    """Megatron's older loss form, (mean loss, report), as hand-written scripts return it."""
    import torch

    from examples.gpt.model import ModelConfig, SyntheticData, model_provider
    from unicron.trainer import pretrain

    model = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)

    def forward_step(data_iterator: Any, gpt: Any) -> Any:
        batch = next(data_iterator)
        positions = torch.arange(batch["tokens"].size(1)).unsqueeze(0).expand_as(batch["tokens"])
        output = gpt(batch["tokens"], positions, None, labels=batch["labels"])

        def loss_func(out: torch.Tensor) -> Any:
            loss = out.float().mean()
            return loss, {"lm loss": loss.detach()}

        return output, loss_func

    pretrain(model_provider(model), lambda n: SyntheticData(model, 1, n), forward_step)
