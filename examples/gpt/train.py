"""The GPT example: a Megatron-Core GPT trained through the trainer library.

Under Unicron the job spec names it (``program.entry_point: examples.gpt.train:main``) and its
model shape goes in ``program.args``; the data comes from the spec's ``data`` (a prefix made by
``python -m examples.gpt.data``, and its tokenizer), or synthetic sequences without one. The
same file runs without Unicron::

    torchrun --nproc-per-node 2 -m examples.gpt.train --iterations 20 --data run/data/stdlib/stdlib
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from unicron.trainer import MegatronProgram, Training, context, train_program


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="examples.gpt.train", description=__doc__.splitlines()[0])
    shape = parser.add_argument_group("model shape")
    shape.add_argument("--num-layers", type=int, default=2, help="transformer layers (default 2)")
    shape.add_argument("--hidden-size", type=int, default=64, help="hidden size (default 64)")
    shape.add_argument("--num-attention-heads", type=int, default=4, help="attention heads (default 4)")
    shape.add_argument("--seq-length", type=int, default=32, help="tokens per sample (default 32)")
    shape.add_argument("--vocab-size", type=int, default=128, help="model vocabulary (default 128)")
    shape.add_argument("--ffn-hidden-size", type=int, default=0, help="MLP width (default 0: 4 x hidden)")
    shape.add_argument(
        "--hidden-dropout", type=float, default=0.1, help="dropout after attention and MLP (default 0.1, Megatron's)"
    )
    shape.add_argument(
        "--attention-dropout", type=float, default=0.1, help="dropout of attention weights (default 0.1, Megatron's)"
    )
    shape.add_argument(
        "--sequence-parallel", action="store_true", help="Megatron's sequence parallelism (needs TP > 1; default off)"
    )
    local = parser.add_argument_group("without Unicron (under Unicron the job spec's settings apply)")
    local.add_argument("--iterations", type=int, default=30, help="optimizer iterations (default 30)")
    local.add_argument("--global-batch-size", type=int, default=16, help="samples per iteration (default 16)")
    local.add_argument("--micro-batch-size", type=int, default=2, help="samples per forward pass (default 2)")
    local.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    local.add_argument("--seed", type=int, default=1234, help="initialization seed (default 1234)")
    local.add_argument("--tensor-parallel", type=int, default=1, help="TP degree (default 1)")
    local.add_argument("--pipeline-parallel", type=int, default=1, help="PP degree (default 1)")
    local.add_argument("--data", default="", help="data prefix (.bin/.idx) from examples.gpt.data; default synthetic")
    local.add_argument("--tokenizer", default="", help="tokenizer.json (default: beside the data)")
    local.add_argument("--checkpoint-dir", default="", help="persistent checkpoints here (default none)")
    local.add_argument("--precision", default="fp32", help="fp32, bf16 or fp16 (default fp32)")
    return parser.parse_args(argv)


def model_of(args: argparse.Namespace) -> Any:
    """The model shape the arguments give (an examples.gpt.model.ModelConfig)."""
    from examples.gpt.model import ModelConfig

    return ModelConfig(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=args.vocab_size,
        ffn_hidden_size=args.ffn_hidden_size,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        sequence_parallel=args.sequence_parallel,
    )


VALIDATION_SEED_OFFSET = 1_000_003


def program(
    model: Any, seed: int, data_path: str = "", tokenizer: str = "", precision: str = "fp32"
) -> MegatronProgram:
    """The GPT as a Megatron-Core program: real text from ``data_path`` (a prefix made by
    examples.gpt.data), or synthetic sequences without one; its TransformerConfig in
    ``precision`` (the job's training.precision)."""
    from examples.gpt.model import SyntheticData, forward_step, model_provider

    def dataset_provider(num_samples: int, data_seed: int = seed) -> Any:
        if not data_path:
            return SyntheticData(model, data_seed, num_samples)
        from examples.gpt import data

        tokenizer_path = tokenizer or str(Path(data_path).parent / "tokenizer.json")
        return data.load(data_path, tokenizer_path, model.seq_length, num_samples, data_seed, model.vocab_size)

    def valid_dataset_provider(num_samples: int) -> Any:
        # Other samples drawn the same way: synthetic sequences of another seed, or the text
        # cut and shuffled by another seed (the same documents: a sanity check of the loss,
        # not a held-out split).
        return dataset_provider(num_samples, seed + VALIDATION_SEED_OFFSET)

    return MegatronProgram(
        model_provider(model, precision),
        dataset_provider,
        forward_step,
        seq_length=model.seq_length,
        description=model.shape(),
        flops_per_token=model.flops_per_token(),
        valid_dataset_provider=valid_dataset_provider,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    training = Training(
        iterations=args.iterations,
        global_batch_size=args.global_batch_size,
        micro_batch_size=args.micro_batch_size,
        learning_rate=args.lr,
        seed=args.seed,
        tensor_parallel=args.tensor_parallel,
        pipeline_parallel=args.pipeline_parallel,
        checkpoint_interval=10 if args.checkpoint_dir else 0,
        precision=args.precision,
    )
    ctx = context()
    if ctx.under_unicron:
        data_path, tokenizer, settings = ctx.data_path, ctx.tokenizer, ctx.training or training
    else:
        data_path, tokenizer, settings = args.data, args.tokenizer, training
    gpt = program(model_of(args), settings.seed, data_path, tokenizer, settings.precision)
    train_program(gpt, training, checkpoint_dir=args.checkpoint_dir)


if __name__ == "__main__":
    main()
