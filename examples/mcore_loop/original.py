"""A Megatron-Core training script written by hand, in the shape of Megatron-Core's own
examples/run_simple_mcore_train_loop.py: a small GPT split over two tensor-parallel ranks, a mock
data set of random token ids, its own loop, and a distributed checkpoint of the model at the end.
``converted.py`` is the same script converted to the trainer library.

    torchrun --nproc-per-node 2 -m examples.mcore_loop.original --iterations 5 --save /tmp/mcore-loop
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.utils.data import DataLoader, DistributedSampler

from unicron.trainer.megatron_cpu import cpu_mode

TENSOR_PARALLEL = 2
SEQ_LENGTH = 32
VOCAB_SIZE = 128
GLOBAL_BATCH_SIZE = 8
MICRO_BATCH_SIZE = 2
LEARNING_RATE = 1e-3
SEED = 1234
# Megatron's default, and what its own example trains with, is 0.1. Off by default here so that
# this loop and converted.py can be compared loss for loss: they draw their masks differently.
DROPOUT_HELP = "hidden and attention dropout (default 0.0; Megatron's default is 0.1)"


def model_provider(dropout: float = 0.0) -> GPTModel:
    """This rank's slice of a 2-layer GPT."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        tensor_model_parallel_size=TENSOR_PARALLEL,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        use_cpu_initialization=True,
    )
    return GPTModel(
        config=config,
        transformer_layer_spec=get_gpt_layer_local_spec(),
        vocab_size=VOCAB_SIZE,
        max_sequence_length=SEQ_LENGTH,
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


def train_data_iterator(num_samples: int) -> Iterator[dict[str, torch.Tensor]]:
    """This data-parallel rank's micro-batches."""
    dataset = RandomTokens(num_samples)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    sampler: DistributedSampler[int] = DistributedSampler(dataset, num_replicas=dp_size, rank=dp_rank, shuffle=False)
    return iter(DataLoader(dataset, batch_size=MICRO_BATCH_SIZE, sampler=sampler))


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
    parser.add_argument("--save", default="", help="save the trained model here (default: not saved)")
    parser.add_argument("--dropout", type=float, default=0.0, help=DROPOUT_HELP)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    # Megatron-Core asks for CUDA devices throughout; without CUDA the trainer library's shim
    # answers with the CPU (a no-op where CUDA is present).
    with cpu_mode():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TENSOR_PARALLEL)
        torch.manual_seed(SEED)
        model_parallel_cuda_manual_seed(SEED)
        model = model_provider(args.dropout)
        if cuda:
            model.cuda()
        model = DistributedDataParallel(model.config, DistributedDataParallelConfig(), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=LEARNING_RATE), [model])
        data = train_data_iterator(args.iterations * GLOBAL_BATCH_SIZE)
        micro_batches = GLOBAL_BATCH_SIZE // (MICRO_BATCH_SIZE * parallel_state.get_data_parallel_world_size())
        forward_backward = get_forward_backward_func()
        for iteration in range(1, args.iterations + 1):
            model.zero_grad_buffer()
            optimizer.zero_grad()
            reports = forward_backward(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[model],
                num_microbatches=micro_batches,
                seq_length=SEQ_LENGTH,
                micro_batch_size=MICRO_BATCH_SIZE,
                forward_only=False,
            )
            finalize_model_grads([model])
            optimizer.step()
            if torch.distributed.get_rank() == 0:
                loss_sum, num_tokens = sum(report["lm loss"] for report in reports).tolist()
                print(f"iteration {iteration}: lm loss {loss_sum / num_tokens:.6f}", flush=True)
        if args.save:
            Path(args.save).mkdir(parents=True, exist_ok=True)
            dist_checkpointing.save({"model": model.module.sharded_state_dict()}, args.save)
        parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
