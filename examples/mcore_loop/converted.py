"""``original.py`` converted to the trainer library: the same model, data and forward step;
the loop, its process group, seeding, DDP wrapper, optimizer and checkpoint are ``pretrain``'s.
Under Unicron the job spec names it (``program.entry_point: examples.mcore_loop.converted:main``).

    torchrun --nproc-per-node 2 -m examples.mcore_loop.converted --iterations 5 --save /tmp/mcore-loop
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.transformer_config import TransformerConfig

from unicron.trainer import Training, pretrain

TENSOR_PARALLEL = 2
SEQ_LENGTH = 32
VOCAB_SIZE = 128
GLOBAL_BATCH_SIZE = 8
MICRO_BATCH_SIZE = 2
LEARNING_RATE = 1e-3
SEED = 1234
# Megatron's default, and what its own example trains with, is 0.1. Off by default here so that
# this script and original.py can be compared loss for loss: the runtime keys each micro-batch's
# masks by its samples, the original draws them in rank order.
DROPOUT_HELP = "hidden and attention dropout (default 0.0; Megatron's default is 0.1)"


def model_provider(pre_process: bool = True, post_process: bool = True, dropout: float = 0.0) -> GPTModel:
    """This rank's slice of a 2-layer GPT."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
        pre_process=pre_process,
        post_process=post_process,
    )


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Mock GPT data: SEQ_LENGTH + 1 random token ids per sample, sample ``i`` drawn from
    (SEED, i) alone."""

    def __init__(self, num_samples: int) -> None:
        self.num_samples = num_samples

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids = torch.from_numpy(np.random.default_rng([SEED, index]).integers(VOCAB_SIZE, size=SEQ_LENGTH + 1))
        return {"tokens": ids[:-1], "labels": ids[1:]}


def dataset_provider(num_samples: int) -> RandomTokens:
    """The data, addressed by global sample index."""
    return RandomTokens(num_samples)


def forward_step(
    data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module
) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
    """One micro-batch through the model, and its loss function."""
    batch = next(data_iterator)
    device = next(model.parameters()).device
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    position_ids = torch.arange(tokens.size(1), device=device).unsqueeze(0).expand_as(tokens)
    output = model(tokens, position_ids, None, labels=labels)

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        loss_sum = output_tensor.float().sum()
        num_tokens = torch.tensor(labels.numel(), dtype=torch.int, device=device)
        return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), num_tokens.float()])}

    return output, loss_func


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=10, help="optimizer iterations (default 10)")
    parser.add_argument("--save", default="", help="checkpoints here, the trained model in <save>/final")
    parser.add_argument("--dropout", type=float, default=0.0, help=DROPOUT_HELP)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    pretrain(
        functools.partial(model_provider, dropout=args.dropout),
        dataset_provider,
        forward_step,
        Training(
            iterations=args.iterations,
            global_batch_size=GLOBAL_BATCH_SIZE,
            micro_batch_size=MICRO_BATCH_SIZE,
            learning_rate=LEARNING_RATE,
            seed=SEED,
            tensor_parallel=TENSOR_PARALLEL,
        ),
        seq_length=SEQ_LENGTH,
        checkpoint_dir=args.save,
    )


if __name__ == "__main__":
    main()
