"""The FSDP2 example: a small Llama-style decoder sharded with fully_shard, trained on text.

The model is trained in the user's own loop through the trainer library's Session, on real
text (Python's standard library, BPE-tokenized by examples/gpt/data.py; prepared on first
use, nothing to download).

Without Unicron::

    torchrun --nproc-per-node 2 -m examples.llama_fsdp.train --iterations 20

Under Unicron the job spec names it (``program.entry_point: examples.llama_fsdp.train:main``,
its own settings such as ``[--size, tiny, --seq-length, 64]`` in ``program.args``); the
spec's training settings (iterations, global_batch_size, learning_rate, seed,
checkpoint_interval, precision) replace the arguments of the same name, and the spec's
``data`` (a prefix made by ``python -m examples.gpt.data`` and its tokenizer), when it has
one, replaces --data-dir. The optimizer recipe (AdamW, betas 0.9/0.95, weight decay 0.1,
gradient clipping at 1.0, linear warmup then cosine decay to a tenth of the peak) is the
program's own, like the model's shape.

The model is built, sharded and given its optimizer in one function of the device mesh: the
session calls it at the start and again on a new mesh after every reform (a resize
included), then loads the state into what it built."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from examples.llama_fsdp.model import SIZES, Llama, LlamaConfig, parameters
from unicron.trainer import ProgramError, Session, Training, context

DEFAULT_VOCAB = 1024
# Where the text is prepared without a --data-dir: one directory per vocabulary size, since
# examples.gpt.data refuses to rebuild a directory prepared with other settings.
DEFAULT_DATA_ROOT = Path(".cache/data")
# The cosine decay ends at this fraction of the peak learning rate (as Llama's training did).
MIN_LR_RATIO = 0.1
PRECISIONS = ("bf16", "fp32")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="examples.llama_fsdp.train", description=__doc__.splitlines()[0])
    model = parser.add_argument_group("model and data")
    model.add_argument("--size", choices=sorted(SIZES), default="tiny", help="model preset (default tiny)")
    model.add_argument("--seq-length", type=int, default=64, help="tokens per sample (default 64)")
    model.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB,
        help=f"BPE vocabulary to prepare the text with (default {DEFAULT_VOCAB}); the model's is the tokenizer's",
    )
    model.add_argument(
        "--data-dir",
        default="",
        help=f"where the text is prepared, or reused (default {DEFAULT_DATA_ROOT}/llama-stdlib-<vocab size>)",
    )
    model.add_argument(
        "--warmup-iterations",
        type=int,
        default=None,
        help="linear warmup of the learning rate (default: a tenth of the iterations)",
    )
    model.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        help="residual dropout after attention and feed-forward (default 0); its masks are keyed by the samples",
    )
    model.add_argument(
        "--shard-degree",
        type=int,
        default=None,
        help="HSDP: ranks per shard group, each group a whole copy of the state (default: the job spec's "
        "parallelism.shard_degree under Unicron; 0, FSDP over all ranks, without)",
    )
    local = parser.add_argument_group("without Unicron (under Unicron the job spec's settings apply)")
    local.add_argument("--iterations", type=int, default=40, help="optimizer iterations (default 40)")
    local.add_argument("--global-batch-size", type=int, default=16, help="samples per iteration (default 16)")
    local.add_argument(
        "--micro-batch-size", type=int, default=4, help="samples per forward pass (default 4; divides a rank's share)"
    )
    local.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    local.add_argument("--seed", type=int, default=1234, help="initialization and data seed (default 1234)")
    local.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="bf16",
        help="bf16: bf16 compute, fp32 weights and gradient reduction; fp32: fp32 throughout (default bf16)",
    )
    local.add_argument("--checkpoint-dir", default="", help="persistent checkpoints here (default none)")
    local.add_argument("--checkpoint-interval", type=int, default=5, help="iterations between checkpoints (default 5)")
    args = parser.parse_args(argv)
    if args.warmup_iterations is not None and args.warmup_iterations < 0:
        parser.error(f"--warmup-iterations must not be negative, got {args.warmup_iterations}")
    return args


def text_source(args: argparse.Namespace) -> tuple[str, str]:
    """The data prefix and its tokenizer: the job spec's data under Unicron when it names
    some, else the text prepared (once; every rank may ask) in the data directory."""
    from examples.gpt import data as text

    ctx = context()
    if ctx.data_path:
        return ctx.data_path, ctx.tokenizer or text.tokenizer_beside(ctx.data_path)
    out = args.data_dir or DEFAULT_DATA_ROOT / f"llama-stdlib-{args.vocab_size}"
    prepared = text.prepare(out, vocab_size=args.vocab_size)
    return prepared.prefix, prepared.tokenizer_path


class TextData:
    """Megatron-Core's GPTDataset over the prepared text: sample ``i`` (a global index) is a
    window of the shuffled documents that depends on ``i`` alone, so a step's samples split
    over any number of ranks see the same tokens; that is what keeps a resize exact."""

    def __init__(self, dataset: Any) -> None:
        self._dataset = dataset

    def batch(self, indices: range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens, labels, loss_mask) of the samples, each (len(indices), seq_length)."""
        samples = [self._dataset[i] for i in indices]
        tokens, labels, mask = (torch.stack([s[key] for s in samples]) for key in ("tokens", "labels", "loss_mask"))
        return tokens, labels, mask


def warmup_cosine(warmup: int, total: int) -> Callable[[int], float]:
    """The learning rate's factor after ``it`` scheduler steps (iteration ``it + 1`` trains
    with it): linear up to 1 over the first ``warmup`` iterations, then a cosine that reaches
    MIN_LR_RATIO at iteration ``total``, the last."""

    def factor(it: int) -> float:
        if it < warmup:
            return (it + 1) / warmup
        progress = min(1.0, (it + 1 - warmup) / max(1, total - warmup))
        return MIN_LR_RATIO + (1.0 - MIN_LR_RATIO) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def main(argv: list[str] | None = None) -> None:
    args = parse(sys.argv[1:] if argv is None else argv)
    # Megatron-Core (under examples.gpt.data) loads after the arguments: --help stays quick.
    from examples.gpt import data as text

    # The text first, before any process group exists: preparing it takes seconds on one rank
    # while the others wait on its lock.
    prefix, tokenizer_path = text_source(args)
    session = Session(
        Training(
            iterations=args.iterations,
            global_batch_size=args.global_batch_size,
            micro_batch_size=args.micro_batch_size,
            learning_rate=args.lr,
            seed=args.seed,
            checkpoint_interval=args.checkpoint_interval if args.checkpoint_dir else 0,
            precision=args.precision,
        ),
        checkpoint_dir=args.checkpoint_dir,
    )
    training = session.training  # under Unicron, the job spec's settings
    if training.precision not in PRECISIONS:
        raise ProgramError(
            f"training.precision {training.precision}: this example trains in bf16 or fp32 (fp16 would need a loss"
            " scale)"
        )
    vocab_size = text.Tokenizer(tokenizer_path).vocab_size
    if not 0.0 <= args.dropout < 1.0:
        raise ProgramError(f"--dropout must be in [0, 1), got {args.dropout}")
    config: LlamaConfig = replace(
        SIZES[args.size], vocab_size=vocab_size, max_seq_len=args.seq_length, dropout=args.dropout
    )
    # bf16 as LLM teams train under FSDP2: parameters gathered and computed in bf16, gradients
    # reduced in fp32, and the sharded master weights and Adam's moments kept in fp32.
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if training.precision == "bf16"
        else MixedPrecisionPolicy()
    )
    warmup = min(
        training.iterations,
        args.warmup_iterations if args.warmup_iterations is not None else max(1, training.iterations // 10),
    )

    def build(mesh: Any) -> tuple[Llama, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
        # The same seed on every rank and at every rebuild: each rank builds the same whole
        # model and keeps its shard. After a reform the session loads the trained state over it.
        torch.manual_seed(training.seed)
        model = Llama(config)
        # Each block its own FSDP unit, so that one block's parameters are all-gathered at a
        # time; the root takes the embedding, the final norm and the output head.
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        optimizer = torch.optim.AdamW(
            model.parameters(), lr=training.learning_rate, betas=(0.9, 0.95), weight_decay=0.1
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, training.iterations))
        return model, optimizer, scheduler

    session.register(build=build, shard_degree=args.shard_degree)
    # Megatron's dataset logs its index building at info level, on every rank: kept to warnings.
    logging.getLogger("megatron.core.datasets").setLevel(logging.WARNING)
    data = TextData(
        text.load(
            prefix,
            tokenizer_path,
            args.seq_length,
            training.iterations * training.global_batch_size,
            training.seed,
            vocab_size,
        )
    )
    if session.rank == 0:
        print(
            f"llama {args.size}: {parameters(config):,} parameters (dim {config.dim}, {config.n_layers} layers,"
            f" {config.n_heads} heads, ffn {config.ffn_dim}, vocab {config.vocab_size}), seq {args.seq_length},"
            f" {training.precision}, FSDP2 over {session.world_size} ranks, global batch {training.global_batch_size},"
            f" iterations {session.iteration + 1}..{training.iterations}",
            flush=True,
        )
    for step in session.steps():
        with step:
            # A reform builds them again: taken from the session each step.
            model, optimizer, scheduler = session.model, session.optimizer, session.scheduler
            total = 0.0
            # Micro-batches seeded from their samples: dropout's masks do not depend on the rank
            # or the number of ranks, so a resize stays within the failure-free runs' distance.
            for micro in step.micro_batches():
                tokens, labels, mask = data.batch(micro)
                logits = model(tokens)
                per_token = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
                # The mean over all of this rank's token positions (masked ones count as zero),
                # not over the unmasked ones: every sample weighs the same, so FSDP's average
                # over the ranks is the global batch's mean however the batch is split.
                loss = (per_token * mask.flatten()).sum() / labels.numel() / step.micro_batch_count
                loss.backward()  # FSDP reduce-scatters the gradients: no all-reduce of our own
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
            step.report(total, tokens=len(step.samples()) * args.seq_length)


if __name__ == "__main__":
    main()
